"""A small GRPO loop: the rollout pool generates, a trainer learns from verifiable rewards, WeightSync pushes weights.

    python jobs/rl_demo.py                              # tiny model, 2 CPU workers, 20 steps, wandb offline
    python jobs/rl_demo.py steps=40 sync=collective     # longer, weights over a gloo group
    python jobs/rl_demo.py logger=none rollout.num_workers=1

The task is a verifiable toy: answer every prompt (BOS, `digits` random digit tokens, a separator) with `digits`
tokens of the digit 7 (token 17). Each completion token scores 0.75 if it is the 7 and 0.25 if it is any digit (ids
10..19), so a random-init policy, for which a digit is 2% likely, finds a signal at once: the reward climbs to the
digit plateau (0.25), then to 1.0 (about 18 steps at lr 1e-2). Conditional tasks (echo the prompt's last digit, copy
the string) stall at the digit plateau in 60 steps at this size: the policy commits to one digit before the
context-dependent signal accumulates, which is a property of the toy, not of the sync.

One step: rollouts of weight version v (prompts_per_step x group_size samples, drain mode: every sample is on v);
rewards; group-normalised advantages (GRPO); the trainer (composer_rollout.model.Qwen3MoE in FP32, plain autograd)
recomputes the completion logprobs with the weights of version v, which gives the rollout/trainer mismatch the way
RL users watch it (verl's training/rollout_probs_diff_*, slime's |Δ logprob|, NeMo-RL's token_mult_prob_error; the
workers run BF16 with MXFP8 experts, so it is not zero), takes one policy-gradient step, and pushes version v + 1.
It demonstrates the loop; it is not a training framework (no PPO clipping, no KL, one update per batch).
"""

import random
import sys
import time
from pathlib import Path

import hydra
import ray
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from composer_rollout.config import RLDemoConfig
from composer_rollout.engine import SamplingParams
from composer_rollout.model import Qwen3MoE, load_checkpoint, preset
from composer_rollout.prompts import Prompt
from composer_rollout.rollout import RolloutPool, WeightSync
from jobs.hydra_config import register, to_dataclass
from jobs.wandb_logger import make_logger

register("rl_demo_schema", RLDemoConfig)

DIGITS = list(range(10, 20))
BOS, SEP = 3, 2
TARGET = DIGITS[7]


def trainer_model(job: RLDemoConfig, device: str) -> tuple[Qwen3MoE, list[torch.Tensor]]:
    """The FP32 policy with every weight a leaf that requires grad; the experts (plain attributes, swapped whole by
    the engine) become such leaves too. Returns (model, parameters)."""
    if job.model.path:
        model = load_checkpoint(job.model.path, dtype=torch.float32, device=device)
    else:
        model = Qwen3MoE(preset(job.model.preset), dtype=torch.float32, device=device).init_random(job.model.seed)
    params = []
    for p in model.parameters():
        params.append(p.requires_grad_(True))
    for layer in model.layers:
        layer.mlp.w13 = layer.mlp.w13.detach().clone().requires_grad_(True)
        layer.mlp.w2 = layer.mlp.w2.detach().clone().requires_grad_(True)
        params += [layer.mlp.w13, layer.mlp.w2]
    return model, params


def hf_tensors(model: Qwen3MoE):
    """The trainer's weights under Hugging Face names, experts fused (transformers 5's layout), no copies."""
    for name, p in model.hf_dense_weights().items():
        yield name, p.detach()
    for i, layer in enumerate(model.layers):
        yield f"model.layers.{i}.mlp.experts.gate_up_proj", layer.mlp.w13.detach()
        yield f"model.layers.{i}.mlp.experts.down_proj", layer.mlp.w2.detach()


def make_prompts(rng: random.Random, job: RLDemoConfig, step: int) -> list[Prompt]:
    sampling = SamplingParams(temperature=job.temperature, max_tokens=job.digits, n=job.group_size,
                              seed=job.seed * 100_003 + step, stop_token_ids=[])
    return [Prompt(i, f"s{step}p{i}", [BOS] + [rng.choice(DIGITS) for _ in range(job.digits)] + [SEP], sampling)
            for i in range(job.prompts_per_step)]


def reward(completion: list[int], digits: int) -> float:
    return sum(0.25 * (t in DIGITS) + 0.75 * (t == TARGET) for t in completion) / digits


def completion_logprobs(model: Qwen3MoE, prompts: list[list[int]], completions: list[list[int]],
                        temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced logprobs of each completion token, with grad: ([B, T] padded, [B, T] mask). The same
    definition as RolloutResult.logprobs: log_softmax(logits / temperature) over the whole vocabulary."""
    seqs = [p + c for p, c in zip(prompts, completions, strict=True)]
    B, S = len(seqs), max(map(len, seqs))
    T = max(map(len, completions))
    device = model.device
    ids = torch.tensor([s + [0] * (S - len(s)) for s in seqs], device=device)
    cache = model.new_kv_cache(B, S)  # a fresh cache per forward: the model writes into it under autograd
    hidden = model(ids, torch.arange(S, device=device).expand(B, S), torch.arange(B, device=device), cache)
    logprobs = torch.log_softmax(model.compute_logits(hidden) / (temperature or 1.0), dim=-1)
    out = torch.zeros(B, T, device=device)
    mask = torch.zeros(B, T, device=device)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        if c:  # position len(p) - 1 + j predicts completion token j
            rows = logprobs[i, len(p) - 1: len(p) - 1 + len(c)]
            out[i, :len(c)] = rows.gather(1, torch.tensor(c, device=device)[:, None]).squeeze(1)
            mask[i, :len(c)] = 1
    return out, mask


def mismatch_metrics(train_lp: torch.Tensor, rollout_lp: torch.Tensor) -> dict:
    """Rollout vs trainer logprobs of the same tokens (1-D, response tokens only), under the names RL users know."""
    diff = (train_lp - rollout_lp).abs()
    probs = (train_lp.exp() - rollout_lp.exp()).abs()
    return {"training/rollout_probs_diff_mean": probs.mean().item(),
            "training/rollout_probs_diff_max": probs.max().item(),
            "training/rollout_probs_diff_std": probs.std().item() if probs.numel() > 1 else 0.0,
            "training/rollout_logprobs_abs_diff_mean": diff.mean().item(),
            "training/rollout_logprobs_abs_diff_max": diff.max().item(),
            "training/token_mult_prob_error": diff.exp().mean().item()}


def grpo_step(model, optimizer, params, prompts: list[Prompt], results, job: RLDemoConfig) -> dict:
    by_index = {p.index: p.token_ids for p in prompts}
    rewards = torch.tensor([reward(r.token_ids, job.digits) for r in results])
    groups = rewards.view(len(prompts), job.group_size)  # results come sorted by (prompt, sample)
    adv = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)).view(-1)
    lp, mask = completion_logprobs(model, [by_index[r.prompt_index] for r in results],
                                   [r.token_ids for r in results], job.temperature)
    rollout_lp = torch.zeros_like(lp)
    for i, r in enumerate(results):
        rollout_lp[i, :len(r.logprobs)] = torch.tensor(r.logprobs)
    on = mask.bool()
    metrics = mismatch_metrics(lp.detach()[on], rollout_lp[on])
    loss = -(adv.to(lp.device)[:, None] * lp * mask).sum() / mask.sum()  # token-mean policy gradient
    optimizer.zero_grad()
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    lengths = [r.num_completion_tokens for r in results]
    return {"critic/rewards/mean": rewards.mean().item(), "critic/rewards/max": rewards.max().item(),
            "actor/pg_loss": loss.item(), "actor/grad_norm": grad_norm.item(),
            "response_length/mean": sum(lengths) / len(lengths), **metrics}


@hydra.main(version_base=None, config_path="../conf", config_name="rl_demo")
def main(cfg: DictConfig) -> None:
    job: RLDemoConfig = to_dataclass(cfg)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if job.group_size < 2 or job.group_size > job.engine.max_num_seqs:
        sys.exit(f"error: group_size={job.group_size} must be in [2, engine.max_num_seqs={job.engine.max_num_seqs}]")
    device = job.trainer_device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(job.seed)
    model, params = trainer_model(job, device)
    optimizer = torch.optim.Adam(params, lr=job.lr)
    started_ray = not ray.is_initialized()
    ray.init(address=job.ray.address, **({} if job.ray.num_cpus is None else {"num_cpus": job.ray.num_cpus}))
    logger = make_logger(job.logger, run_dir, OmegaConf.to_container(cfg, resolve=True))
    pool = RolloutPool(job.model, job.kernel, job.engine, job.rollout, job.sync)
    sync = WeightSync.from_config(pool, job.sync)
    rng = random.Random(job.seed)
    version = 1
    stats = sync.push(hf_tensors(model), version)  # the workers start from the trainer's weights
    print(f"trainer on {device}; {len(pool.workers)} workers; weights v1 pushed in {stats.seconds:.3f} s "
          f"({job.sync.transport.value}, {stats.tensors} tensors, {stats.bytes / 2**20:.1f} MiB)")
    history = []
    try:
        for step in range(job.steps):
            prompts = make_prompts(rng, job, step)
            start = time.perf_counter()
            results = pool.generate(prompts)
            gen_s = time.perf_counter() - start
            stale = sum(r.weight_version != version for r in results)
            metrics = grpo_step(model, optimizer, params, prompts, results, job)
            train_s = time.perf_counter() - start - gen_s
            version += 1
            stats = sync.push(hf_tensors(model), version)
            metrics.update({"timing_s/gen": gen_s, "timing_s/update_actor": train_s,
                            "timing_s/update_weights": stats.seconds, "perf/update_weights_gb_per_s": stats.gb_per_s,
                            "rollout/weight_version": version - 1, "rollout/stale_samples": stale})
            history.append(metrics)
            logger.live(step, metrics)
            print(f"step {step:>3}  reward {metrics['critic/rewards/mean']:.3f}  "
                  f"|Δlogprob| mean {metrics['training/rollout_logprobs_abs_diff_mean']:.4f} "
                  f"max {metrics['training/rollout_logprobs_abs_diff_max']:.4f}  "
                  f"probs_diff mean {metrics['training/rollout_probs_diff_mean']:.5f} "
                  f"max {metrics['training/rollout_probs_diff_max']:.4f}  "
                  f"gen {gen_s:.2f}s train {train_s:.2f}s sync {stats.seconds:.3f}s -> v{version}", flush=True)
    finally:
        logger.close()
        pool.shutdown()
        if started_ray:
            ray.shutdown()
    if history:
        first, last = history[0]["critic/rewards/mean"], history[-1]["critic/rewards/mean"]
        print(f"mean reward {first:.3f} -> {last:.3f} over {len(history)} steps")


if __name__ == "__main__":
    main()
