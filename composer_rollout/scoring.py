"""Eval scoring: scorers chosen by config (`eval.scorer._target_`), pass@k and the mean score.

A scorer is any callable `(result, answer, text) -> float`: `result` the RolloutResult, `answer` the prompt's
reference (text or token ids), `text` the decoded completion when the job has a tokenizer (else None). The job
instantiates it from config, so a user's scorer is a module path away; ExactMatch is the one shipped.
"""

from math import comb

from composer_rollout.engine import RolloutResult


class ExactMatch:
    """1.0 when the completion equals the reference answer, else 0.0. Token-id answers compare token ids; text
    answers compare decoded text (stripped of surrounding whitespace when `strip`). A completion that ended on a
    stop token is compared without it: the stop token ends the answer, it is not part of it."""

    def __init__(self, strip: bool = True):
        self.strip = strip

    def __call__(self, result: RolloutResult, answer, text: str | None) -> float:
        if isinstance(answer, str):
            if text is None:
                raise ValueError("ExactMatch: a text answer needs the completion's text (a tokenizer from model.path)")
            return float(text.strip() == answer.strip()) if self.strip else float(text == answer)
        ids = result.token_ids[:-1] if result.finish_reason == "stop" else result.token_ids
        return float(list(ids) == list(answer))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    return 1.0 if n - c < k else 1.0 - comb(n - c, k) / comb(n, k)


def eval_summary(scores: dict[int, list[float]], ks: list[int]) -> dict[str, float]:
    """scores: prompt index -> its samples' scores. Mean score over samples; pass@k over prompts with >= k samples
    (a sample counts as correct when its score is 1)."""
    flat = [s for v in scores.values() for s in v]
    out = {"mean_score": sum(flat) / len(flat) if flat else 0.0}
    for k in ks:
        vals = [pass_at_k(len(v), sum(s >= 1.0 for s in v), k) for v in scores.values() if len(v) >= k]
        if vals:
            out[f"pass@{k}"] = sum(vals) / len(vals)
    return out
