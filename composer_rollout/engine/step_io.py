"""A step's traffic between host and device: its per-row inputs in, its sampled tokens and logprobs out.

At batch 1 a decode step is ~3 ms of GPU work, and whatever the host does between two steps leaves the GPU idle:
each synchronous copy waits ~10-20 µs and each small launch costs ~5 µs of host time. So both directions go
through pinned buffers with copies that do not block. In: the rows' ints (top_k, seed, step, and for decode the
token id, position and slot) and floats (temperature, top_p) are written on the host and sent in two copies into
device buffers that the decode graphs read in place (StepInputs.views): no copy between device buffers, no
synchronisation. Out: tokens and logprobs come back in one wait (HostReadout). The host writes the pinned input
buffer again only after the previous step's readout has waited for the stream, which its copy precedes.
"""

import torch

INT_ROWS = ("top_k", "seeds", "steps", "ids", "positions", "slots")
FLOAT_ROWS = ("temperature", "top_p")


class StepInputs:
    """Per-row inputs of up to `max_rows` rows. Rows of one step lie as [len(INT_ROWS), rows] and [len(FLOAT_ROWS),
    rows] at the start of flat buffers, so a step of any row count is one contiguous copy per dtype, and the views a
    graph captured for its row count are where the next step of that count writes."""

    def __init__(self, max_rows: int, device):
        self.device, self.max_rows = torch.device(device), max_rows
        pin = self.device.type == "cuda"
        self._host = {dtype: torch.zeros(len(names) * max_rows, dtype=dtype, pin_memory=pin)
                      for dtype, names in ((torch.int64, INT_ROWS), (torch.float32, FLOAT_ROWS))}
        self._dev = {dtype: torch.zeros(len(h), dtype=dtype, device=self.device) for dtype, h in self._host.items()}

    def views(self, rows: int) -> dict[str, torch.Tensor]:
        """The device buffers of a `rows`-row step: {name: [rows] tensor} for every name of INT_ROWS and FLOAT_ROWS."""
        out = {}
        for dtype, names in ((torch.int64, INT_ROWS), (torch.float32, FLOAT_ROWS)):
            out.update(zip(names, self._dev[dtype][: len(names) * rows].view(len(names), rows), strict=True))
        return out

    def load(self, rows: int, columns: dict[str, list]) -> dict[str, torch.Tensor]:
        """Send `columns` ({name: list of at most `rows` values}; missing names and rows are zeros) to the device and
        return views(rows)."""
        if not 0 < rows <= self.max_rows:
            raise ValueError(f"a step of {rows} rows; the buffers hold 1 to {self.max_rows}")
        for dtype, names in ((torch.int64, INT_ROWS), (torch.float32, FLOAT_ROWS)):
            n = len(names) * rows
            host = self._host[dtype][:n].view(len(names), rows).numpy()
            host[:] = 0
            for i, name in enumerate(names):
                values = columns.get(name, ())
                host[i, : len(values)] = values
            self._dev[dtype][:n].copy_(self._host[dtype][:n], non_blocking=True)
        return self.views(rows)


class HostReadout:
    """A step's sampled tokens and logprobs to the host in one synchronisation: both copied into pinned buffers
    without blocking, then one wait (two .tolist() calls would wait twice). Grows to the largest step it reads."""

    def __init__(self, device):
        self.device, self.rows = torch.device(device), 0

    def read(self, tokens: torch.Tensor, logprobs: torch.Tensor, n: int) -> tuple[list[int], list[float]]:
        """The first n tokens and logprobs as lists."""
        if self.device.type != "cuda":
            return tokens[:n].tolist(), logprobs[:n].tolist()
        if n > self.rows:
            self.rows = max(n, 2 * self.rows)
            self._tokens = torch.empty(self.rows, dtype=torch.int64, pin_memory=True)
            self._logprobs = torch.empty(self.rows, dtype=torch.float32, pin_memory=True)
        self._tokens[:n].copy_(tokens[:n], non_blocking=True)
        self._logprobs[:n].copy_(logprobs[:n], non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return self._tokens[:n].tolist(), self._logprobs[:n].tolist()
