"""The rollout job's output: one JSONL line per sample, written and flushed as each sample finishes.

The file is append-only, so whatever is in it when a job stops (Ctrl-C, a crash, a lost machine) is a prefix of
what a finished job would hold, plus at most one torn last line. Resuming reads the complete lines back as done
samples, moves a torn tail aside (to `<output>.torn`, appended, so even a fragment is never lost) and appends the
rest. A non-empty output is never reopened without resume, so nothing written is overwritten. Also here: the
summary (samples, tokens, tokens/s overall and per worker, finish reasons, response lengths, eval scores).
"""

import dataclasses
import json
import os
from collections import Counter
from pathlib import Path

from composer_rollout.engine import RolloutResult
from composer_rollout.prompts import Prompt, Reject


def record(prompt: Prompt, result: RolloutResult, worker_id: int, score: float | None = None) -> dict:
    """A sample's line: prompt id, every RolloutResult field (weight version, latency, ttft included; routed_experts
    only when the sample asked for it, as nested lists), worker."""
    rec = {"prompt_id": prompt.id, **dataclasses.asdict(result), "worker_id": worker_id}
    if result.routed_experts is None:
        del rec["routed_experts"]  # only written when asked for: it is the largest field by far
    else:
        rec["routed_experts"] = result.routed_experts.tolist()  # [tokens][layers][k] ints
    if score is not None:
        rec["score"] = score
    return rec


def read_existing(path: Path, prompts: list[Prompt]) -> tuple[list[dict], bytes]:
    """The complete records of an earlier run, checked against this prompt set, and its torn tail (b"" if none).
    A bad line anywhere but at the end is not a torn write: it fails, naming the line."""
    data = path.read_bytes()
    cut = data.rfind(b"\n") + 1
    body, tail = data[:cut], data[cut:]
    by_index = {p.index: p for p in prompts}

    def checked(line: str | bytes, lineno: int) -> dict:
        try:
            rec = json.loads(line)
            key = (rec["prompt_index"], rec["sample_index"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{lineno}: not a rollout record ({e}); refusing to append to it") from None
        p = by_index.get(key[0])
        if p is None or p.id != rec.get("prompt_id") or not 0 <= key[1] < p.sampling.n:
            raise ValueError(f"{path}:{lineno}: sample {key} of prompt {rec.get('prompt_id')!r} is not in this "
                             f"prompt set; resume needs the same prompts and sampling.n as the interrupted job")
        return rec

    lines = body.decode().splitlines()
    records = [checked(line, lineno) for lineno, line in enumerate(lines, start=1)]
    if tail:
        try:  # a last line that parsed but lost only its newline is a complete record: keep it, as done
            rec = json.loads(tail)
        except json.JSONDecodeError:
            return records, tail
        if isinstance(rec, dict) and "sample_index" in rec:
            records.append(checked(tail, len(lines) + 1))
            return records, b""
    return records, tail


class RolloutWriter:
    """Append-only JSONL; `done` holds the (prompt index, sample index) pairs already in the file."""

    def __init__(self, path: str | Path, prompts: list[Prompt], *, resume: bool):
        self.path = Path(path)
        self.existing: list[dict] = []
        if self.path.exists() and self.path.stat().st_size > 0:
            if not resume:
                raise FileExistsError(f"output {self.path} already has rollouts; pass resume=true to complete it, "
                                      f"or choose another output / hydra.run.dir")
            self.existing, tail = read_existing(self.path, prompts)
            if tail:
                with open(f"{self.path}.torn", "ab") as f:
                    f.write(tail + b"\n")
                self._truncate_tail(len(tail))
            elif not self.path.read_bytes().endswith(b"\n"):
                with open(self.path, "ab") as f:  # complete last record whose newline was lost
                    f.write(b"\n")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.done = {(r["prompt_index"], r["sample_index"]) for r in self.existing}
        if len(self.done) != len(self.existing):
            raise ValueError(f"{self.path} holds the same sample twice; it was not written by this job")
        self._f = open(self.path, "a")

    def _truncate_tail(self, n: int) -> None:
        size = self.path.stat().st_size
        with open(self.path, "r+b") as f:
            f.truncate(size - n)

    def write(self, rec: dict) -> None:
        key = (rec["prompt_index"], rec["sample_index"])
        if key in self.done:
            raise RuntimeError(f"sample {key} is already in {self.path}")  # the pool dedupes; this is a bug guard
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()
        self.done.add(key)

    def close(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


def write_rejects(path: str | Path, rejects: list[Reject]) -> None:
    """Bad records with their reasons, one JSON line each; rewritten whole (it is derived from the input)."""
    with open(path, "w") as f:
        for r in rejects:
            f.write(json.dumps({"where": r.where, "reason": r.reason, "record": r.record}) + "\n")


def summarize(records: list[dict], new_tokens_by_worker: dict[int, int], gen_s: float,
              eval_metrics: dict[str, float] | None = None, worker_stats: list[dict | None] = ()) -> dict:
    """Totals over every record in the output; throughput over this run's samples and wall time; and where each
    worker's engine spent its time (prefill, decode steps; the rest of the wall time is host work and waiting),
    from the workers' own counters (a worker that did not answer is left out)."""
    lengths = [r["num_completion_tokens"] for r in records]
    new_tokens = sum(new_tokens_by_worker.values())
    out = {"samples": len(records), "prompts": len({r["prompt_index"] for r in records}),
           "completion_tokens": sum(lengths), "new_tokens": new_tokens, "gen_s": gen_s,
           "tokens_per_s": new_tokens / gen_s if gen_s > 0 else 0.0,
           "tokens_per_s_per_worker": {w: t / gen_s if gen_s > 0 else 0.0
                                       for w, t in sorted(new_tokens_by_worker.items())},
           "finish_reasons": dict(Counter(r["finish_reason"] for r in records)),
           "mean_response_len": sum(lengths) / len(lengths) if lengths else 0.0,
           "max_response_len": max(lengths, default=0)}
    keys = ("prefill_tokens", "prefill_s", "prefill_forwards", "prefill_rows", "decode_steps", "decode_s", "occupancy")
    out["engine"] = {s["worker_id"]: {k: s[k] for k in keys} for s in worker_stats if s}
    if eval_metrics:
        out["eval"] = eval_metrics
    return out


def format_summary(s: dict) -> str:
    rows = [("samples", f"{s['samples']} ({s['prompts']} prompts)"),
            ("completion tokens", f"{s['completion_tokens']} ({s['new_tokens']} this run)"),
            ("generation time", f"{s['gen_s']:.2f} s"),
            ("tokens/s", f"{s['tokens_per_s']:.1f}")]
    rows += [(f"tokens/s worker {w}", f"{v:.1f}") for w, v in s["tokens_per_s_per_worker"].items()]
    rows += [("finish reasons", ", ".join(f"{k}={v}" for k, v in sorted(s["finish_reasons"].items()))),
             ("response length", f"mean {s['mean_response_len']:.1f}, max {s['max_response_len']}")]
    for w, e in s.get("engine", {}).items():
        step_ms = 1e3 * e["decode_s"] / e["decode_steps"] if e["decode_steps"] else 0.0
        padding = 1 - e["prefill_tokens"] / e["prefill_rows"] if e["prefill_rows"] else 0.0
        rows.append((f"engine worker {w}", f"prefill {e['prefill_tokens']} tokens in {e['prefill_s']:.2f} s "
                     f"({e['prefill_forwards']} forwards, {padding:.0%} padding), decode {e['decode_steps']} steps in "
                     f"{e['decode_s']:.2f} s ({step_ms:.2f} ms/step, occupancy {e['occupancy']:.0%})"))
    rows += [(k, f"{v:.4f}") for k, v in s.get("eval", {}).items()]
    width = max(len(k) for k, _ in rows)
    bar = "-" * (width + 3 + max(len(v) for _, v in rows))
    return "\n".join(["rollout summary", bar, *(f"{k:<{width}} | {v}" for k, v in rows), bar])
