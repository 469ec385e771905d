"""The rollout job: prompts in, one JSONL line per sample out, from a pool of Ray workers (one RolloutEngine each).

    python jobs/rollout.py                                    # embedded prompts, tiny preset, 2 CPU workers
    python jobs/rollout.py prompts=/data/prompts.jsonl sampling.n=8 rollout.num_workers=4
    python jobs/rollout.py eval=exact_match                   # score against each prompt's `answer`; pass@k
    python jobs/rollout.py resume=true hydra.run.dir=outputs/<the interrupted run>
    python jobs/rollout.py ray.address=auto                   # an existing cluster (`ray start --head`)
    python jobs/rollout.py rollout.name=policy sync=collective  # trainers push weights: WeightSync.connect("policy")
    ray job submit --working-dir . -- python jobs/rollout.py  # as a Ray job

Everything that can be checked is checked before Ray starts: the config (Hydra and the schemas), the checkpoint
and kernel path, every prompt record, the output file. Samples are written as they finish and flushed per line;
Ctrl-C leaves a file that `resume=true` completes without redoing or duplicating a sample.
"""

import dataclasses
import sys
import time
from pathlib import Path

import hydra
import ray
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from composer_rollout.config import RolloutJobConfig
from composer_rollout.engine import resolve_max_model_len
from composer_rollout.model import preset, resolve_kernel_path
from composer_rollout.model.checkpoint import read_args
from composer_rollout.output import RolloutWriter, format_summary, record, summarize, write_rejects
from composer_rollout.prompts import CheckpointTokenizer, PromptError, load_prompts
from composer_rollout.rollout import RolloutPool
from composer_rollout.scoring import eval_summary
from jobs.hydra_config import register, to_dataclass
from jobs.wandb_logger import make_logger, worker_metrics

register("rollout_schema", RolloutJobConfig)


def model_limits(job: RolloutJobConfig) -> tuple[int, int, str | None]:
    """(vocab size, max_model_len, tokenizer dir) without loading weights; a missing checkpoint fails here."""
    if job.model.path is not None:
        if not Path(job.model.path).is_dir():
            raise FileNotFoundError(f"model.path={job.model.path}: checkpoint directory does not exist")
        args, tok_dir = read_args(job.model.path), job.model.path
    else:
        args, tok_dir = preset(job.model.preset), None
    resolve_kernel_path(job.kernel.name.value)  # an unknown or unbuilt kernel path fails before Ray starts
    return args.vocab_size, resolve_max_model_len(args, job.engine.max_model_len), tok_dir


def prepare(job: RolloutJobConfig, run_dir: Path):
    vocab, max_len, tok_dir = model_limits(job)
    # A fixed seed makes a prompt's samples a function of (seed, prompt index, sample index): a prompt redone
    # on another worker after a crash, or on resume, gives exactly the same samples.
    sampling = job.sampling if job.sampling.seed is not None else dataclasses.replace(job.sampling,
                                                                                      seed=job.rollout.seed)
    tokenizer = CheckpointTokenizer(tok_dir) if tok_dir else None
    prompts, rejects = load_prompts(job.prompts, sampling=sampling, vocab_size=vocab, max_model_len=max_len,
                                    max_num_seqs=job.engine.max_num_seqs,
                                    tokenize=tokenizer.encode if tokenizer else None, skip_bad=job.skip_bad_prompts)
    output = Path(job.output) if job.output else run_dir / "rollouts.jsonl"
    if rejects:
        rejects_path = Path(job.rejects) if job.rejects else output.with_name("rejects.jsonl")
        write_rejects(rejects_path, rejects)
        print(f"skipped {len(rejects)} bad prompt record(s); reasons in {rejects_path}", file=sys.stderr)
    scorer = None
    if job.eval.scorer is not None:
        scorer = instantiate(job.eval.scorer)
        missing = [p.where for p in prompts if p.answer is None]
        if missing:
            raise PromptError(f"eval needs an `answer` in every prompt record; missing at {', '.join(missing[:10])}")
        if any(isinstance(p.answer, str) for p in prompts) and not tok_dir:
            raise PromptError("text answers need a tokenizer to decode completions: set model.path")
        bad_k = [k for k in job.eval.k if not 1 <= k <= max(p.sampling.n for p in prompts)]
        if bad_k:
            raise ValueError(f"eval.k={bad_k}: each k must be in [1, sampling.n]")
    decode = tokenizer.decode if scorer is not None and tokenizer else None
    return prompts, output, scorer, decode


def _describe_worker(info: dict) -> str:
    """A worker's start-up line: id, process, device, graph capture time, which tuned MoE tile table it runs."""
    graphs = f", decode graphs captured in {info['graph_capture_s']:.1f} s" if info["graph_capture_s"] else ""
    tiles = f", MoE tiles {info['moe_tiles']}" if info["moe_tiles"] else ""
    return f"{info['worker_id']} (pid {info['pid']}, {info['device']}{graphs}{tiles})"


@hydra.main(version_base=None, config_path="../conf", config_name="rollout")
def main(cfg: DictConfig) -> None:
    job: RolloutJobConfig = to_dataclass(cfg)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        prompts, output, scorer, decode = prepare(job, run_dir)
        writer = RolloutWriter(output, prompts, resume=job.resume)
    except (ValueError, FileNotFoundError, FileExistsError, NotImplementedError) as e:
        sys.exit(f"error: {e}")
    by_index = {p.index: p for p in prompts}
    total = sum(p.sampling.n for p in prompts)
    records = list(writer.existing)
    print(f"{len(prompts)} prompts, {total} samples -> {output}"
          + (f" (resuming: {len(writer.done)} already done)" if writer.done else ""))

    started_ray = not ray.is_initialized()
    init_kw = {} if job.ray.num_cpus is None else {"num_cpus": job.ray.num_cpus}
    ray.init(address=job.ray.address, **init_kw)
    logger = make_logger(job.logger, run_dir, OmegaConf.to_container(cfg, resolve=True))
    pool = RolloutPool(job.model, job.kernel, job.engine, job.rollout, job.sync)
    print("workers: " + ", ".join(_describe_worker(i) for i in pool.info))
    if job.rollout.name is not None:
        print(f"accepting weight syncs: WeightSync.connect({job.rollout.name!r}) from a process joined to this Ray "
              f"cluster (transport {job.sync.transport.value}, mode {job.sync.mode.value})")
    start = last_log = time.perf_counter()
    step = 0
    try:
        with tqdm(total=total, initial=len(writer.done), unit="sample", desc="rollout", file=sys.stderr) as bar:
            for worker_id, result in pool.run(prompts, writer.done):
                p = by_index[result.prompt_index]
                score = None
                if scorer is not None:
                    score = float(scorer(result, p.answer, decode(result.token_ids) if decode else None))
                rec = record(p, result, worker_id, score)
                writer.write(rec)
                records.append(rec)
                bar.update(1)
                now = time.perf_counter()
                if now - last_log >= job.logger.every_s:
                    last_log, step = now, step + 1
                    new = sum(pool.tokens)
                    logger.live(step, {"perf/rollout_tokens_per_s": new / (now - start), "timing_s/gen": now - start,
                                       "rollout/samples": len(records), **worker_metrics(pool.stats(1.0), now - start)})
    except KeyboardInterrupt:
        writer.close()
        sys.exit(f"interrupted: {len(writer.done)} of {total} samples are in {output}; complete them with "
                 f"resume=true hydra.run.dir={run_dir}" + (f" output={output}" if job.output else ""))
    gen_s = time.perf_counter() - start
    writer.close()
    eval_metrics = None
    if scorer is not None:
        scores: dict[int, list[float]] = {}
        for r in records:
            scores.setdefault(r["prompt_index"], []).append(r["score"])
        eval_metrics = eval_summary(scores, job.eval.k)
    worker_stats = pool.stats()
    summary = summarize(records, dict(enumerate(pool.tokens)), gen_s, eval_metrics, worker_stats)
    if any(pool.restarts):
        print(f"worker restarts: {pool.restarts}")
    print(format_summary(summary))
    records.sort(key=lambda r: (r["prompt_index"], r["sample_index"]))
    logger.final(summary, worker_stats, records)
    logger.close()
    pool.shutdown()
    if started_ray:
        ray.shutdown()


if __name__ == "__main__":
    main()
