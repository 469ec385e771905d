"""Generate completions from a Qwen3-MoE policy and print them with their logprobs.

    python jobs/generate.py                                   # tiny preset, CPU, torch kernel path
    python jobs/generate.py kernel=torch sampling.temperature=0.7 sampling.n=4
    python jobs/generate.py model.path=/ckpt/Qwen3-30B-A3B model.weight_dtype=mxfp8
"""

import time

import hydra
import torch
from omegaconf import DictConfig

from composer_rollout.config import GenerateJobConfig, build_engine
from composer_rollout.model.moe import tuned_table
from jobs.hydra_config import register, to_dataclass

register("generate_schema", GenerateJobConfig)


def _fmt(values, limit):
    shown = ", ".join(values[:limit])
    return shown + (", ..." if len(values) > limit else "")


@hydra.main(version_base=None, config_path="../conf", config_name="generate")
def main(cfg: DictConfig) -> None:
    job: GenerateJobConfig = to_dataclass(cfg)
    start = time.perf_counter()
    engine = build_engine(job.model, job.kernel, job.engine)
    load_s = time.perf_counter() - start
    graphs = f", decode graphs captured in {engine.stats.graph_capture_s:.1f} s" if engine.graphs else ""
    table = tuned_table(job.kernel.name.value, engine.device)
    graphs += f", MoE tiles {table}" if table else ""
    print(f"model {job.model.source} ({engine.model.weight_dtype} experts, {job.model.dtype.value}) on "
          f"{engine.device}, kernel={job.kernel.name.value} dense={job.kernel.dense.value}: loaded in {load_s:.2f} s"
          f"{graphs}, {engine.model.memory_bytes() / 2**20:.1f} MiB of weights")
    start = time.perf_counter()
    results = engine.generate(job.prompts, job.sampling)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    gen_s = time.perf_counter() - start
    print(f"{'prompt':>6} {'sample':>6} {'finish':>6} {'tokens':>6} {'mean lp':>8}  completion (token:logprob)")
    for r in results:
        pairs = [f"{t}:{lp:.2f}" for t, lp in zip(r.token_ids, r.logprobs, strict=True)]
        mean = sum(r.logprobs) / len(r.logprobs)
        print(f"{r.prompt_index:>6} {r.sample_index:>6} {r.finish_reason:>6} {r.num_completion_tokens:>6} "
              f"{mean:>8.3f}  {_fmt(pairs, 8)}")
    tokens = sum(r.num_completion_tokens for r in results)
    print(f"{len(results)} samples, {tokens} tokens in {gen_s:.2f} s ({tokens / gen_s:.1f} tokens/s)")
    if engine.device.type == "cuda":
        gib = 2**30
        print(f"GPU memory: {torch.cuda.max_memory_allocated() / gib:.2f} GiB peak allocated, "
              f"{torch.cuda.memory_allocated() / gib:.2f} GiB held (weights {engine.model.memory_bytes() / gib:.2f} "
              f"GiB, KV cache {engine.cache.nbytes / gib:.2f} GiB)")


if __name__ == "__main__":
    main()
