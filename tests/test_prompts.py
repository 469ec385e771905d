"""Prompt sets, the output file and eval scoring, without Ray: every kind of bad prompt record is refused with its
line and reason (or, with skip_bad, returned as a reject); resume reads back an interrupted file, sets a torn last
line aside and never rewrites what is there; ExactMatch and the unbiased pass@k estimator."""

import json

import pytest

from composer_rollout.engine import RolloutResult, SamplingParams
from composer_rollout.output import RolloutWriter, record
from composer_rollout.prompts import PromptError, load_prompts
from composer_rollout.scoring import ExactMatch, eval_summary, pass_at_k

KW = dict(sampling=SamplingParams(max_tokens=8, seed=0), vocab_size=512, max_model_len=32, max_num_seqs=4)
GOOD = {"id": "a", "prompt_token_ids": [5, 6, 7]}


def write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


@pytest.mark.parametrize("bad,needle", [
    ('{"id": "x", "prompt_token_ids": [1, 2', "malformed JSON"),
    ({"id": "x"}, "needs exactly one of `prompt_token_ids` or `prompt`"),
    ({"id": "x", "prompt_token_ids": []}, "empty prompt"),
    ({"id": "x", "prompt_token_ids": list(range(3, 40))}, "max_model_len=32"),
    ({"id": "x", "prompt_token_ids": [3, 512]}, "token id 512 outside the vocabulary"),
    ({"id": "x", "prompt_token_ids": [3], "sampling": {"temperature": -1}}, "temperature"),
    ({"id": "x", "prompt_token_ids": [3], "sampling": {"n": 9}}, "max_num_seqs=4"),
    ({"id": "x", "prompt_token_ids": [3], "sampling": {"tempurature": 1}}, "tempurature"),
    ({"id": "x", "prompt": "hello"}, "no tokenizer"),
    ({"id": "a", "prompt_token_ids": [3]}, "duplicate id 'a'"),
    ([1, 2, 3], "JSON object"),
])
def test_bad_record_named_by_line(tmp_path, bad, needle):
    path = write_jsonl(tmp_path / "p.jsonl", [GOOD, bad, {"id": "c", "prompt_token_ids": [9]}])
    with pytest.raises(PromptError) as e:
        load_prompts(path, **KW)
    assert "p.jsonl:2: " in str(e.value) and needle in str(e.value), str(e.value)
    prompts, rejects = load_prompts(path, **KW, skip_bad=True)
    assert [p.id for p in prompts] == ["a", "c"] and [p.index for p in prompts] == [0, 2]
    assert len(rejects) == 1 and rejects[0].where.endswith("p.jsonl:2") and needle in rejects[0].reason


def test_parquet_overrides_and_answers(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([
        {"id": "q0", "prompt_token_ids": [4, 5], "answer": [4]},
        {"id": "q1", "prompt_token_ids": [6], "answer": [6, 7]}]), tmp_path / "p.parquet")
    prompts, _ = load_prompts(str(tmp_path / "p.parquet"), **KW)
    assert [(p.id, p.token_ids, p.answer) for p in prompts] == [("q0", [4, 5], [4]), ("q1", [6], [6, 7])]
    path = write_jsonl(tmp_path / "o.jsonl", [{"prompt_token_ids": [3], "sampling": {"n": 3, "temperature": 0}}])
    (p,), _ = load_prompts(path, **KW)
    assert p.id == "0" and p.sampling == SamplingParams(n=3, temperature=0, max_tokens=8, seed=0)


def test_missing_file_and_unknown_builtin(tmp_path):
    with pytest.raises(PromptError, match="no such file"):
        load_prompts(str(tmp_path / "nope.jsonl"), **KW)
    with pytest.raises(PromptError, match="builtin:nope"):
        load_prompts("builtin:nope", **KW)


def result(i, j, tokens=(3, 4)):
    return RolloutResult(i, j, list(tokens), [-1.0] * len(tokens), "length", 0, 2, len(tokens), "r", 0.5, 0.1)


def test_resume_keeps_lines_and_sets_torn_tail_aside(tmp_path):
    prompts, _ = load_prompts("builtin:random:3", **{**KW, "sampling": SamplingParams(n=2, seed=0)})
    out = tmp_path / "rollouts.jsonl"
    w = RolloutWriter(out, prompts, resume=False)
    for i, j in [(0, 0), (0, 1), (2, 1)]:
        w.write(record(prompts[i], result(i, j), worker_id=1))
    w.close()
    good = out.read_bytes()
    out.write_bytes(good + b'{"prompt_id": "p1", "prompt_ind')  # Ctrl-C in the middle of a line
    with pytest.raises(FileExistsError, match="resume=true"):
        RolloutWriter(out, prompts, resume=False)
    w = RolloutWriter(out, prompts, resume=True)
    assert w.done == {(0, 0), (0, 1), (2, 1)}
    assert out.read_bytes() == good and (tmp_path / "rollouts.jsonl.torn").read_bytes().startswith(b'{"prompt_id"')
    w.write(record(prompts[1], result(1, 0), worker_id=0))
    with pytest.raises(RuntimeError, match="already"):
        w.write(record(prompts[0], result(0, 0), worker_id=0))
    w.close()
    assert out.read_bytes().startswith(good) and len(out.read_text().splitlines()) == 4
    other, _ = load_prompts("builtin:eval", **KW)
    with pytest.raises(ValueError, match="rollouts.jsonl:1: .* not in this prompt set"):
        RolloutWriter(out, other, resume=True)


def test_resume_counts_a_last_record_that_only_lost_its_newline(tmp_path):
    prompts, _ = load_prompts("builtin:random:2", **KW)
    out = tmp_path / "rollouts.jsonl"
    w = RolloutWriter(out, prompts, resume=False)
    for i in (0, 1):
        w.write(record(prompts[i], result(i, 0), worker_id=0))
    w.close()
    out.write_bytes(out.read_bytes()[:-1])  # stopped between the record and its newline
    w = RolloutWriter(out, prompts, resume=True)
    assert w.done == {(0, 0), (1, 0)} and len(w.existing) == 2
    w.close()
    assert out.read_text().endswith("}\n") and len(out.read_text().splitlines()) == 2
    assert not (tmp_path / "rollouts.jsonl.torn").exists()


def test_exact_match_and_pass_at_k():
    em = ExactMatch()
    stop = RolloutResult(0, 0, [7, 8, 1], [0.0] * 3, "stop", 0, 1, 3)
    assert em(stop, [7, 8], None) == 1.0 and em(stop, [7, 8, 1], None) == 0.0
    assert em(result(0, 0, (7, 8)), [7, 8], None) == 1.0 and em(result(0, 0, (7,)), [7, 8], None) == 0.0
    assert em(stop, " 42 ", "42") == 1.0 and em(stop, "42", "43") == 0.0
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 2) == 1.0 and pass_at_k(4, 3, 2) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25) and pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)
    s = eval_summary({0: [1.0, 0.0, 0.0, 0.0], 1: [0.0] * 4}, [1, 4])
    assert s == {"mean_score": pytest.approx(1 / 8), "pass@1": pytest.approx(0.125), "pass@4": pytest.approx(0.5)}
