"""Config schemas: the one module of dataclasses that jobs register in Hydra's ConfigStore.

Values live in `conf/` groups (model/, kernel/, sampling/, engine/); these classes give them types,
so an unknown key or an enum value out of range fails in Hydra before anything runs. Entry points
turn the composed config into these frozen dataclasses once (`OmegaConf.to_object`) and pass plain
values on; nothing in the library sees OmegaConf. Enums are StrEnums, so library code compares and
passes them as plain strings.
"""

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from composer_rollout.engine import RolloutEngine, SamplingParams
from composer_rollout.engine.memory import check_fraction


class KernelName(StrEnum):
    torch = "torch"
    warp_decode = "warp_decode"
    expert_centric = "expert_centric"
    auto = "auto"


class DenseName(StrEnum):
    torch = "torch"
    triton = "triton"


class WeightDtype(StrEnum):
    bf16 = "bf16"
    mxfp8 = "mxfp8"


class Dtype(StrEnum):
    bfloat16 = "bfloat16"
    float32 = "float32"
    float16 = "float16"


@dataclass(frozen=True)
class ModelConfig:
    """`path` (a Hugging Face checkpoint directory) wins over `preset` (random init with `seed`)."""

    preset: str = "tiny"
    path: str | None = None
    weight_dtype: WeightDtype = WeightDtype.bf16
    dtype: Dtype = Dtype.bfloat16
    seed: int = 0

    @property
    def source(self) -> str:
        return self.path or self.preset


@dataclass(frozen=True)
class KernelConfig:
    """name: the MoE experts' path. dense: the rest of each layer, "torch" (the reference ops: RMSNorm, RoPE, math
    SDPA over each row's whole slot, softmax + top-k router) or "triton" (fused Triton kernels: RMSNorm with the
    residual add in an FP32 residual stream, q/k-norm + RoPE + cache write in one launch, prefill and decode
    attention reading only each row's own context, skinny projections for a decode step's few tokens, FP32 router
    logits with softmax + top-k, FP32 logits). conf/kernel's Triton MoE paths choose "triton"."""

    name: KernelName = KernelName.torch
    dense: DenseName = DenseName.torch


@dataclass(frozen=True)
class EngineConfig:
    """gpu_memory_fraction: on CUDA, the share of the GPU's memory that weights, activations and the KV cache may
    take; the cache gets max_num_seqs slots of max_model_len tokens, or fewer if fewer fit (engine/memory.py).
    Unused on CPU, where the cache is max_num_seqs slots.
    max_prefill_tokens: the prompt tokens one engine step prefills, at most; a longer prompt is prefilled in chunks
    over several steps, each followed by a decode step of the live sequences (so they never wait for a whole long
    prompt). Shorter prompts go whole, several to a forward packed back to back (rows rounded up to 16). 4096: on
    the H200 the GRPO-shaped job's 15k prompt tokens took 0.73 s at 2048, 0.46 s at 4096, 0.42 s at 8192
    (docs/perf.md); past 4096 the gain is noise while the activation reserve and the live decodes' wait grow.
    cuda_graphs: capture each decode batch bucket as a CUDA graph at start-up and replay it (engine/graphs.py):
    null (the default) wherever that can run, a CUDA device and a Triton MoE path; true requires it (an error on the
    CPU or with kernel=torch); false keeps eager steps. On the H200 the 30B rollout job went from 257.5 tokens/s
    (eager, warp_decode) to 560 with graphs and kernel=auto (docs/perf.md)."""

    max_num_seqs: int = 16
    max_model_len: int | None = None
    device: str | None = None  # None: cuda when available, else cpu
    gpu_memory_fraction: float = 0.9
    max_prefill_tokens: int = 4096
    cuda_graphs: bool | None = None

    def __post_init__(self):
        check_fraction(self.gpu_memory_fraction)
        if isinstance(self.max_prefill_tokens, bool) or not isinstance(self.max_prefill_tokens, int) \
                or self.max_prefill_tokens < 1:
            raise ValueError(f"engine.max_prefill_tokens={self.max_prefill_tokens!r} must be an int >= 1")


DEFAULT_PROMPTS = [[3, 14, 15, 92, 65], [2, 7, 18, 28], [1, 4, 1, 4, 2, 1, 3, 5, 6], [10, 20, 30]]


@dataclass(frozen=True)
class GenerateJobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    kernel: KernelConfig = field(default_factory=KernelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prompts: list[list[int]] = field(default_factory=lambda: [list(p) for p in DEFAULT_PROMPTS])


@dataclass(frozen=True)
class RolloutConfig:
    """The worker pool: one RolloutEngine per worker, each in its own bundle of a placement group.
    `seed` is the sampling seed used when `sampling.seed` is null: a fixed seed is what lets a prompt redone on
    another worker (after a crash, or on resume) give exactly the samples it would have given the first time."""

    num_workers: int = 2
    gpus_per_worker: float = 0.0
    cpus_per_worker: float = 1.0
    max_restarts: int = 3  # Ray restarts a dead worker this many times; its unfinished prompts go elsewhere meanwhile
    seed: int = 0
    # Names the workers in Ray (namespace "composer-rollout") so that a trainer in another process finds them with
    # WeightSync.connect(name); null leaves them unnamed (unreachable by name; two jobs never collide).
    name: str | None = None


class SyncTransport(StrEnum):
    object_store = "object_store"
    collective = "collective"
    cuda_ipc = "cuda_ipc"


class SyncMode(StrEnum):
    drain = "drain"
    abort = "abort"
    inflight = "inflight"


@dataclass(frozen=True)
class SyncConfig:
    """Weight sync from a trainer into the workers (composer_rollout.rollout.WeightSync). transport: object_store
    (Ray's object store; any node, CPU or GPU), collective (a torch.distributed group with the trainer: NCCL when
    it and every worker are on GPUs, gloo otherwise), cuda_ipc (trainer and worker on one GPU). mode, how a worker
    swaps: drain (stop admitting, let the sequences in flight finish on the old weights, then swap), abort (abort
    them: they come back with finish_reason "abort"), inflight (swap between two decode steps; sequences continue
    on the new weights with their KV cache, and record per-token versions). timeout_s: a worker drops an update
    left without a call for this long (its trainer died), and a collective waits this long for a rank."""

    transport: SyncTransport = SyncTransport.object_store
    bucket_mb: int = 512
    mode: SyncMode = SyncMode.drain
    timeout_s: float = 300.0

    def __post_init__(self):
        if not (isinstance(self.bucket_mb, int) and self.bucket_mb >= 1):
            raise ValueError(f"sync.bucket_mb={self.bucket_mb!r} must be an integer >= 1")
        if not self.timeout_s > 0:
            raise ValueError(f"sync.timeout_s={self.timeout_s!r} must be > 0")


@dataclass(frozen=True)
class RayConfig:
    """address null: start a local Ray instance (or join the one named by RAY_ADDRESS, as under `ray job submit`);
    "auto": an existing cluster on this machine; "ray://host:10001": a remote one."""

    address: str | None = None
    num_cpus: int | None = None  # only when starting a local instance; null: all of this machine's cores


class LoggerName(StrEnum):
    wandb = "wandb"
    none = "none"


class WandbMode(StrEnum):
    offline = "offline"
    online = "online"
    disabled = "disabled"


@dataclass(frozen=True)
class LoggerConfig:
    name: LoggerName = LoggerName.wandb
    mode: WandbMode = WandbMode.offline
    project: str = "composer-rollout"
    entity: str | None = None
    run_name: str | None = None
    dir: str | None = None  # null: the job's Hydra run directory
    table_rows: int = 32  # sample rollouts put in the wandb Table
    every_s: float = 2.0  # how often live metrics are logged during the job


@dataclass(frozen=True)
class EvalConfig:
    """scorer null: a plain rollout job. Otherwise a `_target_` dict (hydra.utils.instantiate) giving a callable
    (prompt, result, answer) -> float; the summary adds the mean score and pass@k for each k (k <= n)."""

    scorer: Any = None
    k: list[int] = field(default_factory=lambda: [1])


@dataclass(frozen=True)
class RolloutJobConfig:
    """jobs/rollout.py. prompts: a JSONL or Parquet path, or "builtin:default" / "builtin:eval" (embedded sets).
    output: null writes rollouts.jsonl in Hydra's run directory; an existing non-empty output needs resume=true."""

    model: ModelConfig = field(default_factory=ModelConfig)
    kernel: KernelConfig = field(default_factory=KernelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    prompts: str = "builtin:default"
    output: str | None = None
    resume: bool = False
    skip_bad_prompts: bool = False
    rejects: str | None = None  # null: rejects.jsonl beside the output


@dataclass(frozen=True)
class RLDemoConfig:
    """jobs/rl_demo.py: GRPO on a toy verifiable task (answer with the digit 7), the trainer in the driver process,
    the rollouts on the pool, weights pushed through WeightSync after every step. `model` configures the workers (the
    trainer keeps an FP32 copy of the same shape and init); `trainer_device` null: cuda when available, else cpu."""

    model: ModelConfig = field(default_factory=ModelConfig)
    kernel: KernelConfig = field(default_factory=KernelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    steps: int = 20
    prompts_per_step: int = 16
    group_size: int = 8  # samples per prompt (a GRPO group)
    digits: int = 3  # digits per prompt, and tokens per completion
    temperature: float = 1.0
    lr: float = 1e-2
    seed: int = 0
    trainer_device: str | None = None


def build_engine(model: ModelConfig, kernel: KernelConfig, engine: EngineConfig) -> RolloutEngine:
    return RolloutEngine.from_pretrained(
        model.source, kernel=kernel.name.value, dense=kernel.dense.value,
        weight_dtype=model.weight_dtype.value, dtype=model.dtype.value,
        device=engine.device, seed=model.seed, max_num_seqs=engine.max_num_seqs, max_model_len=engine.max_model_len,
        gpu_memory_fraction=engine.gpu_memory_fraction, max_prefill_tokens=engine.max_prefill_tokens,
        cuda_graphs=engine.cuda_graphs)
