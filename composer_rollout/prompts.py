"""Prompt sets for the rollout job: read, check and resolve them before any work starts.

A prompt set is a JSONL or Parquet file with one record per prompt: `id` (optional, unique; the record number
otherwise), `prompt_token_ids` or `prompt` (text, tokenized with the checkpoint's own tokenizer), optional
`sampling` (overrides of the job's SamplingParams for this prompt) and optional `answer` (a reference for eval
scorers: text or token ids). Embedded sets (`builtin:default`, `builtin:eval`, `builtin:random:N`) let the job run
with no files at all.

Every record is checked here, with its line (JSONL) or row (Parquet) in the message, so a bad file fails before a
GPU is touched: malformed JSON, no prompt field, an empty prompt, one too long for the context, token ids outside
the vocabulary, bad sampling values. With `skip_bad=True` bad records come back as Rejects instead, and the rest run.
No Ray and no Hydra here: the job and tests call it with plain values.
"""

import dataclasses
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from composer_rollout.engine import SamplingParams

_SAMPLING_KEYS = {f.name for f in dataclasses.fields(SamplingParams)}
_RECORD_KEYS = {"id", "prompt", "prompt_token_ids", "sampling", "answer"}


@dataclass(frozen=True)
class Prompt:
    """`index` is the record's position in the set: with the sampling seed it fixes the prompt's samples, so a
    prompt redone on any worker, or on resume, reproduces them exactly."""

    index: int
    id: str
    token_ids: list[int]
    sampling: SamplingParams
    answer: Any = None
    where: str = ""


@dataclass(frozen=True)
class Reject:
    where: str
    reason: str
    record: str  # the raw line (JSONL) or the row as JSON (Parquet)


class PromptError(ValueError):
    """One or more bad records; the message lists each with its line or row."""


def _copy_set(n: int, seed: int, vocab: int) -> list[dict]:
    # A copy task for the eval set: "a b c d SEP" -> "a b c d". A random policy scores ~0, a trained one would not.
    rng = random.Random(seed)
    out = []
    for i in range(n):
        body = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 4))]
        out.append({"id": f"copy-{i}", "prompt_token_ids": [*body, 2], "answer": body})
    return out


def builtin(name: str) -> list[dict]:
    """Embedded sets; token ids stay below 512, the tiny preset's vocabulary (and so fit every preset)."""
    if name == "default":
        return builtin("random:16")
    if name == "eval":
        return _copy_set(8, seed=1, vocab=512)
    if name.startswith("random:") and name[7:].isdigit() and int(name[7:]) > 0:
        rng = random.Random(0)
        return [{"id": f"p{i}", "prompt_token_ids": [rng.randrange(3, 512) for _ in range(rng.randint(4, 12))]}
                for i in range(int(name[7:]))]
    raise PromptError(f"prompts=builtin:{name}: unknown embedded set; use builtin:default, builtin:eval or "
                      f"builtin:random:N")


def read_records(source: str) -> list[tuple[str, str, dict | None, str | None]]:
    """(where, raw, record or None, parse error or None) per record, in order."""
    if source.startswith("builtin:"):
        return [(f"builtin:{source[8:]} record {i + 1}", json.dumps(r), r, None)
                for i, r in enumerate(builtin(source[8:]))]
    path = Path(source)
    if not path.is_file():
        raise PromptError(f"prompts={source}: no such file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # only Parquet inputs need pyarrow

        rows = pq.read_table(path).to_pylist()
        return [(f"{path} row {i + 1}", json.dumps(r, default=str), r, None) for i, r in enumerate(rows)]
    out = []
    for lineno, raw in enumerate(path.read_text().splitlines(), start=1):
        if not raw.strip():
            continue  # blank lines (a trailing newline, spacing) are not records
        where = f"{path}:{lineno}"
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError as e:
            out.append((where, raw, None, f"malformed JSON: {e.msg} at column {e.colno}"))
            continue
        out.append((where, raw, rec, None) if isinstance(rec, dict) else
                   (where, raw, None, f"a record must be a JSON object, got {type(rec).__name__}"))
    return out


def _is_ids(x) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def resolve(rec: dict, index: int, where: str, *, sampling: SamplingParams, vocab_size: int, max_model_len: int,
            max_num_seqs: int, tokenize: Callable[[str], list[int]] | None) -> Prompt:
    """One record as a Prompt; ValueError naming the field otherwise."""
    unknown = set(rec) - _RECORD_KEYS
    if unknown:
        raise ValueError(f"unknown field(s) {sorted(unknown)}; a record has {sorted(_RECORD_KEYS)}")
    has_ids, has_text = rec.get("prompt_token_ids") is not None, rec.get("prompt") is not None
    if has_ids == has_text:
        raise ValueError("needs exactly one of `prompt_token_ids` or `prompt`" if not has_ids else
                         "has both `prompt_token_ids` and `prompt`; give one")
    if has_ids:
        ids = rec["prompt_token_ids"]
        if not _is_ids(ids):
            raise ValueError("`prompt_token_ids` must be a list of integers")
    else:
        if not isinstance(rec["prompt"], str):
            raise ValueError("`prompt` must be a string")
        if tokenize is None:
            raise ValueError("`prompt` is text but there is no tokenizer: set model.path to a checkpoint directory "
                             "with tokenizer files, or give `prompt_token_ids`")
        ids = tokenize(rec["prompt"])
    if not ids:
        raise ValueError("empty prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens; the context (max_model_len={max_model_len}) leaves no "
                         f"room to generate")
    over = rec.get("sampling") or {}
    if not isinstance(over, dict):
        raise ValueError("`sampling` must be an object of SamplingParams fields")
    if set(over) - _SAMPLING_KEYS:
        raise ValueError(f"sampling: unknown field(s) {sorted(set(over) - _SAMPLING_KEYS)}; "
                         f"known: {sorted(_SAMPLING_KEYS)}")
    try:
        params = dataclasses.replace(sampling, **over)
    except ValueError as e:
        raise ValueError(f"sampling: {e}") from None
    if params.n > max_num_seqs:
        raise ValueError(f"sampling.n={params.n} exceeds engine.max_num_seqs={max_num_seqs}")
    answer = rec.get("answer")
    if answer is not None and not (isinstance(answer, str) or _is_ids(answer)):
        raise ValueError("`answer` must be text or a list of token ids")
    pid = rec.get("id", index)
    if not isinstance(pid, str | int) or isinstance(pid, bool):
        raise ValueError("`id` must be a string or an integer")
    return Prompt(index, str(pid), list(ids), params, answer, where)


def load_prompts(source: str, *, sampling: SamplingParams, vocab_size: int, max_model_len: int, max_num_seqs: int,
                 tokenize: Callable[[str], list[int]] | None = None,
                 skip_bad: bool = False) -> tuple[list[Prompt], list[Reject]]:
    """All prompts of `source` checked; raises PromptError listing every bad record unless skip_bad."""
    prompts, rejects, seen = [], [], set()
    for index, (where, raw, rec, error) in enumerate(read_records(source)):
        if error is None:
            try:
                p = resolve(rec, index, where, sampling=sampling, vocab_size=vocab_size, max_model_len=max_model_len,
                            max_num_seqs=max_num_seqs, tokenize=tokenize)
                if p.id in seen:
                    raise ValueError(f"duplicate id {p.id!r}")
                seen.add(p.id)
                prompts.append(p)
                continue
            except ValueError as e:
                error = str(e)
        rejects.append(Reject(where, error, raw))
    if rejects and not skip_bad:
        shown = "\n".join(f"  {r.where}: {r.reason}" for r in rejects[:20])
        more = f"\n  ... and {len(rejects) - 20} more" if len(rejects) > 20 else ""
        raise PromptError(f"{len(rejects)} bad prompt record(s) in {source} (skip_bad_prompts=true writes them to a "
                          f"rejects file and runs the rest):\n{shown}{more}")
    if not prompts:
        raise PromptError(f"{source}: no usable prompts")
    return prompts, rejects


class CheckpointTokenizer:
    """The checkpoint directory's own tokenizer (transformers), loaded once, on first use: text prompts need it to
    encode, text-answer scorers to decode, and a job with neither never loads it."""

    def __init__(self, path: str):
        self.path, self._tok = path, None

    def _get(self):
        if self._tok is None:
            from transformers import AutoTokenizer  # only text prompts and text answers need transformers

            self._tok = AutoTokenizer.from_pretrained(self.path)
        return self._tok

    def encode(self, text: str) -> list[int]:
        return self._get()(text, add_special_tokens=False)["input_ids"]

    def decode(self, token_ids: list[int]) -> str:
        return self._get().decode(token_ids)
