"""The two transports that are not Ray's object store, reduced to what both ends need: no Ray here.

Collective: a torch.distributed process group of the trainer (rank 0) and the workers (ranks 1..N), built on its own
TCPStore by constructing the backend directly (ProcessGroupGloo / ProcessGroupNCCL), not through
`init_process_group`. The default group is process-global state: a worker may already belong to one (tensor
parallelism), two engines may share a process, and Ray runs an actor's calls on several threads. A group lives for
one sync session (a WeightSync's lifetime); a failed push tears it down and the next builds a new one under a new
store prefix. gloo moves CPU buffers (CI runs it), NCCL moves GPU buffers.

CUDA IPC: the trainer shares its tensors' CUDA allocations (torch.multiprocessing's reduction: an IPC handle, the
offset, a ref counter that keeps the allocation alive while the worker holds it, and an event the worker's stream
waits on so it never reads before the trainer's writes land); the worker maps them and copies, nothing is
serialised. The handle names a device by the trainer's index, which need not be the worker's (CUDA_VISIBLE_DEVICES
differs per Ray actor), so the GPU is matched by UUID.
"""

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class GroupSpec:
    """What a worker needs to join a sync group: the trainer's store address, its rank, the world, the backend."""

    group_id: str
    host: str
    port: int
    rank: int
    world_size: int
    backend: str  # "gloo" or "nccl"
    timeout_s: float


class SyncGroup:
    """One process's membership of a sync group; rank 0 (the trainer) broadcasts, the others receive. Rank 0 passes
    the store it hosts (`host_store`); constructing waits until every rank has joined."""

    def __init__(self, spec: GroupSpec, store: dist.TCPStore | None = None, device: torch.device | None = None):
        timeout = timedelta(seconds=spec.timeout_s)
        if spec.backend not in ("gloo", "nccl"):
            raise ValueError(f"sync group backend {spec.backend!r} is unknown (gloo or nccl)")
        if store is None:
            store = dist.TCPStore(spec.host, spec.port, spec.world_size, False, timeout=timeout)
        self.spec, self.store = spec, store
        prefixed = dist.PrefixStore(f"composer-sync/{spec.group_id}/", store)
        if spec.backend == "gloo":
            self.pg = dist.ProcessGroupGloo(prefixed, spec.rank, spec.world_size, timeout)
            self.device = torch.device("cpu")
        else:
            if not dist.is_nccl_available():
                raise RuntimeError("sync group backend nccl: this torch build has no NCCL")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, spec.rank, spec.world_size, opts)
            self.device = device if device is not None else torch.device("cuda", torch.cuda.current_device())

    def broadcast(self, tensor: torch.Tensor) -> None:
        """From rank 0 into `tensor` on every rank; returns once this rank's part is done."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([tensor], opts).wait()

    def close(self) -> None:
        self.pg = None
        self.store = None


def host_store(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store, on a free port of `host` (its `.port`); the trainer holds it for the group's lifetime."""
    return dist.TCPStore(host, 0, world_size, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def share_cuda(t: torch.Tensor) -> tuple:
    """The IPC description of a CUDA tensor (torch.multiprocessing's reduction arguments)."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not t.is_cuda:
        raise ValueError(f"cuda_ipc shares CUDA tensors; got one on {t.device}")
    return reduce_tensor(t.detach())[1]  # detached: a Parameter would be rebuilt as one


def local_device(uuid: str) -> int:
    """This process's index of the GPU with `uuid`, or an error listing the GPUs it sees."""
    seen = []
    for i in range(torch.cuda.device_count()):
        u = device_uuid(torch.device("cuda", i))
        if u == uuid:
            return i
        seen.append(u)
    raise RuntimeError(f"cuda_ipc: the trainer's GPU {uuid} is not visible here (this process sees {seen or 'none'}); "
                       f"cuda_ipc needs the trainer and the worker on the same GPU; use transport=collective")


def open_cuda(args: tuple, device_index: int) -> torch.Tensor:
    """Map a tensor shared with `share_cuda` onto this process's device `device_index` (no copy: the trainer's memory;
    read it before the trainer is told it may change it)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(args)
    args[6] = device_index  # the storage's device, as the trainer numbered it
    args[10] = False  # requires_grad: the worker only reads
    return rebuild_cuda_tensor(*args)
