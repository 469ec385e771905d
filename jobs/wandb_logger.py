"""wandb for the rollout job: live throughput while it runs, the summary, histograms and a sample table at the end.

Offline by default (these machines have no network; `wandb sync` uploads later), `logger.mode=online` where
there is one, `logger=none` for no logger at all. Metric names follow what RL users already watch in verl
(`timing_s/*`, `perf/*`). Only jobs/ imports wandb; the library hands over plain dicts.
"""

from pathlib import Path

from composer_rollout.config import LoggerConfig, LoggerName


class NullLogger:
    def live(self, step: int, metrics: dict) -> None:
        pass

    def final(self, summary: dict, worker_stats: list[dict | None], records: list[dict]) -> None:
        pass

    def close(self) -> None:
        pass


def worker_metrics(stats: list[dict | None], gen_s: float) -> dict:
    """Pool-wide and per-worker series from the workers' own stats (a restarting worker reports None)."""
    live = [s for s in stats if s]
    prefill_s = sum(s["prefill_s"] for s in live)
    prefill_tokens, prefill_rows = sum(s["prefill_tokens"] for s in live), sum(s["prefill_rows"] for s in live)
    decode_s = sum(s["decode_s"] for s in live)
    out = {"perf/prefill_tokens_per_s": prefill_tokens / prefill_s if prefill_s else 0.0,
           # the share of prefill rows that were padding (a forward's row count rounds up to a multiple of 16)
           "perf/prefill_padding": 1 - prefill_tokens / prefill_rows if prefill_rows else 0.0,
           "perf/decode_tokens_per_s": sum(s["decode_tokens"] for s in live) / decode_s if decode_s else 0.0,
           "perf/batch_occupancy": sum(s["occupancy"] for s in live) / len(live) if live else 0.0}
    for s in live:
        w = s["worker_id"]
        out[f"worker/{w}/tokens_per_s"] = s["completion_tokens"] / gen_s if gen_s > 0 else 0.0
        out[f"worker/{w}/occupancy"] = s["occupancy"]
        out[f"worker/{w}/live_seqs"] = s["live"]
        out[f"worker/{w}/queued"] = s["queued"]
    return out


class WandbLogger:
    def __init__(self, cfg: LoggerConfig, run_dir: Path, config: dict):
        import wandb

        self.wandb, self.cfg = wandb, cfg
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.run_name, mode=cfg.mode.value,
                              dir=str(cfg.dir or run_dir), config=config)

    def live(self, step: int, metrics: dict) -> None:
        self.run.log(metrics, step=step)

    def final(self, summary: dict, worker_stats: list[dict | None], records: list[dict]) -> None:
        wandb = self.wandb
        gen_s = summary["gen_s"]
        metrics = {"perf/rollout_tokens_per_s": summary["tokens_per_s"], "timing_s/gen": gen_s,
                   "rollout/samples": summary["samples"], "rollout/completion_tokens": summary["completion_tokens"],
                   "rollout/mean_response_length": summary["mean_response_len"],
                   "rollout/max_response_length": summary["max_response_len"],
                   **worker_metrics(worker_stats, gen_s)}
        per_worker = summary["tokens_per_s_per_worker"]
        metrics["perf/tokens_per_s_per_worker"] = sum(per_worker.values()) / len(per_worker) if per_worker else 0.0
        for reason, count in summary["finish_reasons"].items():
            metrics[f"rollout/finish_reason/{reason}"] = count
        for k, v in summary.get("eval", {}).items():
            metrics[f"eval/{k}"] = v
        lengths = [r["num_completion_tokens"] for r in records]
        if lengths:
            metrics["rollout/response_length"] = wandb.Histogram(lengths)
        columns = ["prompt_id", "sample_index", "worker_id", "finish_reason", "num_completion_tokens",
                   "weight_version", "latency_s", "ttft_s", "mean_logprob", "token_ids"]
        table = wandb.Table(columns=columns)
        for r in records[: self.cfg.table_rows]:
            mean_lp = sum(r["logprobs"]) / len(r["logprobs"]) if r["logprobs"] else 0.0
            table.add_data(r["prompt_id"], r["sample_index"], r["worker_id"], r["finish_reason"],
                           r["num_completion_tokens"], r["weight_version"], r["latency_s"], r["ttft_s"], mean_lp,
                           " ".join(map(str, r["token_ids"])))
        metrics["rollout/samples_table"] = table
        self.run.log(metrics)
        self.run.summary.update({k: v for k, v in metrics.items() if isinstance(v, int | float)})

    def close(self) -> None:
        self.run.finish()


def make_logger(cfg: LoggerConfig, run_dir: Path, config: dict):
    return NullLogger() if cfg.name == LoggerName.none else WandbLogger(cfg, run_dir, config)
