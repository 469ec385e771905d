"""jobs/rollout.py end to end, as a user runs it, against the tests' local Ray head (`ray.address=...`), two CPU
workers on the tiny model: the JSONL holds every sample once with every RolloutResult field and the summary
agrees with it; Hydra overrides take effect and bad ones fail before work; bad prompt records fail naming the line
(or go to a rejects file with skip_bad_prompts); resume completes a torn, interrupted output to exactly what an
uninterrupted run writes; eval scores with pass@k; wandb's offline run file reads back with wandb's protobufs."""

import glob
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from wandb_reader import history_and_config

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {"prompt_id", "prompt_index", "sample_index", "token_ids", "logprobs", "finish_reason", "weight_version",
          "num_prompt_tokens", "num_completion_tokens", "request_id", "latency_s", "ttft_s", "worker_id",
          "weight_versions"}


def run_job(tmp_path, ray_head, *overrides, name="run"):
    args = [sys.executable, "jobs/rollout.py", f"hydra.run.dir={tmp_path / name}", f"ray.address={ray_head}",
            "logger=none", "engine.max_model_len=96", "engine.max_num_seqs=8", *overrides]
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)


def lines(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


def test_output_complete_with_overrides(tmp_path, ray_head):
    proc = run_job(tmp_path, ray_head, "prompts=builtin:random:6", "sampling.n=3", "sampling.max_tokens=6",
                   "sampling.temperature=0.8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = lines(tmp_path / "run" / "rollouts.jsonl")
    assert sorted((r["prompt_index"], r["sample_index"]) for r in recs) == [(i, j) for i in range(6) for j in range(3)]
    assert all(set(r) == FIELDS and 1 <= r["num_completion_tokens"] <= 6 for r in recs)
    assert all(r["prompt_id"] == f"p{r['prompt_index']}" and r["weight_version"] == 0 for r in recs)
    assert {r["worker_id"] for r in recs} == {0, 1}
    assert re.search(r"samples\s+\| 18 \(6 prompts\)", proc.stdout), proc.stdout
    tokens = sum(r["num_completion_tokens"] for r in recs)
    assert f"completion tokens | {tokens} ({tokens} this run)" in proc.stdout
    assert "tokens/s worker 1" in proc.stdout and "finish reasons" in proc.stdout
    assert re.search(r"engine worker 1 +\| prefill [1-9]\d* tokens in [\d.]+ s \([1-9]\d* forwards, \d+% padding\), "
                     r"decode [1-9]\d* steps", proc.stdout)
    # a second run into the same directory never overwrites it
    again = run_job(tmp_path, ray_head, "prompts=builtin:random:6")
    assert again.returncode != 0 and "resume=true" in again.stderr


@pytest.mark.parametrize("override,needle", [
    ("rollout.bogus=1", "bogus"),
    ("logger.mode=sideways", "sideways"),
    ("model.path=/no/such/ckpt", "does not exist"),
    ("prompts=BAD", "bad.jsonl:2: malformed JSON"),
])
def test_bad_config_or_input_fails_before_work(tmp_path, ray_head, override, needle):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_token_ids": [3, 4]}\n{"prompt_token_ids": [3,\n')
    proc = run_job(tmp_path, ray_head, override.replace("BAD", str(bad)))
    assert proc.returncode != 0 and needle in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run" / "rollouts.jsonl").exists()


def test_skip_bad_prompts_writes_rejects(tmp_path, ray_head):
    src = tmp_path / "p.jsonl"
    src.write_text('{"id": "ok1", "prompt_token_ids": [3, 4]}\n{"id": "empty", "prompt_token_ids": []}\n'
                   '{"id": "ok2", "prompt_token_ids": [5], "sampling": {"n": 2}}\n'
                   '{"id": "big", "prompt_token_ids": [900]}\n')
    proc = run_job(tmp_path, ray_head, f"prompts={src}", "skip_bad_prompts=true", "sampling.max_tokens=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rejects = lines(tmp_path / "run" / "rejects.jsonl")
    assert [(r["where"].rsplit(":", 1)[1], r["reason"]) for r in rejects] == [
        ("2", "empty prompt"), ("4", "token id 900 outside the vocabulary [0, 512)")]
    recs = lines(tmp_path / "run" / "rollouts.jsonl")
    assert sorted((r["prompt_id"], r["sample_index"]) for r in recs) == [("ok1", 0), ("ok2", 0), ("ok2", 1)]


def test_resume_completes_an_interrupted_output(tmp_path, ray_head):
    out = tmp_path / "out.jsonl"
    common = ["prompts=builtin:random:5", "sampling.n=2", "sampling.max_tokens=8", f"output={out}"]
    full = run_job(tmp_path, ray_head, *common, name="full")
    assert full.returncode == 0, full.stderr[-3000:]
    complete = sorted(out.read_text().splitlines(), key=lambda x: (json.loads(x)["prompt_index"],
                                                                    json.loads(x)["sample_index"]))
    kept = out.read_text().splitlines()[:4]
    prefix = "".join(x + "\n" for x in kept).encode()
    out.write_bytes(prefix + b'{"prompt_id": "p3", "prompt_index": 3, "sampl')  # killed mid-line
    proc = run_job(tmp_path, ray_head, *common, "resume=true", name="resumed")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming: 4 already done" in proc.stdout
    data = out.read_bytes()
    assert data.startswith(prefix)  # nothing already written was touched
    assert Path(f"{out}.torn").read_bytes().startswith(b'{"prompt_id": "p3"')
    recs = [json.loads(x) for x in data.decode().splitlines()]
    assert len(recs) == 10 and len({(r["prompt_index"], r["sample_index"]) for r in recs}) == 10

    def strip(r):  # per-run bookkeeping differs; the samples themselves must not
        return {k: v for k, v in r.items() if k not in ("latency_s", "ttft_s", "worker_id", "request_id")}

    by_key = sorted((strip(r) for r in recs), key=lambda r: (r["prompt_index"], r["sample_index"]))
    assert by_key == [strip(json.loads(x)) for x in complete]


def test_eval_and_wandb_offline(tmp_path, ray_head):
    proc = run_job(tmp_path, ray_head, "eval=exact_match", "logger=wandb", "logger.every_s=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = lines(tmp_path / "run" / "rollouts.jsonl")
    assert len(recs) == 8 * 4 and all(r["score"] in (0.0, 1.0) for r in recs)
    mean = sum(r["score"] for r in recs) / len(recs)
    assert re.search(rf"mean_score\s+\| {mean:.4f}", proc.stdout) and "pass@4" in proc.stdout, proc.stdout
    (wandb_file,) = glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*" / "run-*.wandb"))
    history, config, summary = history_and_config(Path(wandb_file))
    assert config["rollout"]["num_workers"] == 2 and config["eval"]["k"] == [1, 4]
    assert config["engine"]["max_model_len"] == 96  # the resolved Hydra config, overrides included
    final = history[-1]
    assert 0 <= final["perf/prefill_padding"] < 1
    for key in ["perf/rollout_tokens_per_s", "perf/tokens_per_s_per_worker", "perf/prefill_tokens_per_s",
                "perf/decode_tokens_per_s", "timing_s/gen", "perf/batch_occupancy", "worker/0/tokens_per_s",
                "worker/1/occupancy", "eval/mean_score", "eval/pass@4"]:
        assert key in final, key
    assert final["rollout/samples"] == 32 and final["eval/mean_score"] == pytest.approx(mean)
    assert final["rollout/response_length/_type"] == "histogram"
    assert final["rollout/samples_table/_type"] == "table-file" and final["rollout/samples_table/nrows"] == 32
    assert sum(v for k, v in final.items() if k.startswith("rollout/finish_reason/")) == 32
    assert len(history) > 1 and all("perf/rollout_tokens_per_s" in h for h in history)  # live rows during the job


def test_ray_job_submit_against_a_local_head(tmp_path, ray_cluster):
    """The documented cluster route: `ray job submit -- python jobs/rollout.py ...`; the driver joins the cluster
    through RAY_ADDRESS, which the job supervisor sets (ray.address stays null)."""
    import shutil

    out = tmp_path / "submitted"
    cmd = [shutil.which("ray"), "job", "submit", "--address", ray_cluster["dashboard"], "--",
           sys.executable, str(ROOT / "jobs" / "rollout.py"), f"hydra.run.dir={out}", "logger=none",
           "prompts=builtin:random:3", "sampling.n=2", "sampling.max_tokens=4", "engine.max_model_len=96"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "succeeded" in proc.stdout + proc.stderr
    rows = lines(out / "rollouts.jsonl")
    assert sorted((r["prompt_id"], r["sample_index"]) for r in rows) == [(f"p{i}", j) for i in range(3) for j in (0, 1)]


def test_ctrl_c_leaves_a_file_that_resume_completes(tmp_path, ray_head, sigint_deliverable):
    """A real SIGINT to the driver mid-job: the file it leaves holds whole lines only, and resume=true finishes it
    with every sample exactly once."""
    import signal
    import time

    out = tmp_path / "out.jsonl"
    common = ["prompts=builtin:random:40", "sampling.n=2", "sampling.max_tokens=24", f"output={out}"]
    args = [sys.executable, "jobs/rollout.py", f"hydra.run.dir={tmp_path / 'first'}", f"ray.address={ray_head}",
            "logger=none", "engine.max_model_len=96", "engine.max_num_seqs=4", *common]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and len(out.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the job finished before it could be interrupted: " + proc.communicate()[1][-2000:]
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "interrupted:" in err, err[-3000:]
    done = lines(out)  # every line parses: nothing torn
    assert 3 <= len(done) < 80
    resumed = run_job(tmp_path, ray_head, *common, "resume=true", name="resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    recs = lines(out)
    assert recs[: len(done)] == done
    assert sorted((r["prompt_index"], r["sample_index"]) for r in recs) == [(i, j) for i in range(40) for j in (0, 1)]


def test_text_prompts_use_the_checkpoints_tokenizer(tmp_path, ray_head):
    """`prompt` text is tokenized with the tokenizer saved in model.path (a real Hugging Face tokenizer)."""
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from composer_rollout.model import Qwen3MoE, preset, save_checkpoint

    ckpt = tmp_path / "ckpt"
    save_checkpoint(Qwen3MoE(preset("tiny"), dtype=torch.float32).init_random(3), ckpt)
    words = ["<unk>", "<eos>"] + [f"w{i}" for i in range(510)]
    core = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>").save_pretrained(ckpt)
    texts = {"a": "w5 w17 w300 w2", "b": "w9 w9 w509"}
    src = tmp_path / "text.jsonl"
    src.write_text("".join(json.dumps({"id": k, "prompt": v}) + "\n" for k, v in texts.items()))
    proc = run_job(tmp_path, ray_head, f"model.path={ckpt}", f"prompts={src}", "sampling.max_tokens=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    tok = AutoTokenizer.from_pretrained(ckpt)
    got = {r["prompt_id"]: r["num_prompt_tokens"] for r in lines(tmp_path / "run" / "rollouts.jsonl")}
    assert got == {k: len(tok(v, add_special_tokens=False)["input_ids"]) for k, v in texts.items()} == {"a": 4, "b": 3}


def test_ray_address_auto_joins_the_running_cluster(tmp_path, ray_head):
    """`ray.address=auto` finds the head that `ray start --head` left running on this machine."""
    args = [sys.executable, "jobs/rollout.py", f"hydra.run.dir={tmp_path}", "ray.address=auto", "logger=none",
            "prompts=builtin:random:2", "sampling.max_tokens=3", "engine.max_model_len=96"]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Connecting to existing Ray cluster" in proc.stderr + proc.stdout
    assert len(lines(tmp_path / "rollouts.jsonl")) == 2
