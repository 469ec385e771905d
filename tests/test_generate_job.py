"""jobs/generate.py end to end, as a user runs it: the default run and the documented overrides print
a table of completions with logprobs and a tokens/s line; an unknown key, an unknown group option, a
bad sampling value, a bad enum value and a kernel path that is not built each fail with a non-zero
exit and a message naming the problem."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(stop|length|abort)\s+(\d+)\s+(-?\d+\.\d+)\s+(.*)$")
SUMMARY = re.compile(r"^(\d+) samples, (\d+) tokens in [\d.]+ s \(([\d.]+) tokens/s\)$", re.M)


def run_job(tmp_path, *overrides) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return subprocess.run([sys.executable, "jobs/generate.py", f"hydra.run.dir={tmp_path / 'run'}", *overrides],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def parse_table(stdout: str, max_tokens: int) -> list[tuple[int, int, str, int]]:
    assert "completion (token:logprob)" in stdout
    rows = []
    for line in stdout.splitlines():
        m = ROW.match(line)
        if not m:
            continue
        prompt, sample, finish, tokens, mean = int(m[1]), int(m[2]), m[3], int(m[4]), float(m[5])
        pairs = re.findall(r"(\d+):(-?\d+\.\d+)", m[6])
        assert len(pairs) == min(tokens, 8) and m[6].endswith(", ...") == (tokens > 8)
        assert all(float(lp) <= 0 for _, lp in pairs) and mean <= 0
        assert 1 <= tokens <= max_tokens and (finish == "stop" or tokens == max_tokens)
        rows.append((prompt, sample, finish, tokens, m[6]))
    summary = SUMMARY.search(stdout)
    assert summary, stdout
    assert int(summary[1]) == len(rows) and int(summary[2]) == sum(r[3] for r in rows)
    return rows


def test_default_run_prints_a_table(tmp_path):
    proc = run_job(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "tokens/s" in proc.stdout and "kernel=torch" in proc.stdout
    rows = parse_table(proc.stdout, max_tokens=32)  # conf/sampling/default.yaml
    assert [(r[0], r[1]) for r in rows] == [(0, 0), (1, 0), (2, 0), (3, 0)]  # the four default prompts, n=1
    assert (tmp_path / "run" / ".hydra" / "config.yaml").exists()


def test_documented_overrides(tmp_path):
    proc = run_job(tmp_path, "model=tiny", "kernel=torch", "sampling.temperature=0.7", "sampling.n=4",
                   "engine.max_model_len=256")  # a shorter cache only to keep the test quick
    assert proc.returncode == 0, proc.stderr
    assert "tokens/s" in proc.stdout
    rows = parse_table(proc.stdout, max_tokens=32)
    assert [(r[0], r[1]) for r in rows] == [(i, j) for i in range(4) for j in range(4)]
    for i in range(4):  # four different draws per prompt
        assert len({r[4] for r in rows if r[0] == i}) == 4


@pytest.mark.parametrize("override,needle", [
    ("foo=1", "foo"),
    ("kernel=bogus", "bogus"),
    ("sampling.temperature=-1", "temperature"),
    ("model.weight_dtype=fp4", "fp4"),
])
def test_bad_configs_fail_with_a_message(tmp_path, override, needle):
    proc = run_job(tmp_path, override)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert needle in output, output
    assert "tokens/s" not in output  # it failed before generating


def test_a_shadowing_kernels_package_is_named(tmp_path):
    """Hugging Face's `kernels` package (a transformers 5.25 requirement) takes our kernels' import name; a stand-in
    placed first on the path must fail the job with a message naming the clash, not a bare 'cannot import name'."""
    (tmp_path / "site" / "kernels").mkdir(parents=True)
    (tmp_path / "site" / "kernels" / "__init__.py").write_text("CUDAProperties = object\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    proc = subprocess.run([sys.executable, "jobs/generate.py", f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "is not composer-rollout's" in proc.stderr and str(tmp_path / "site" / "kernels") in proc.stderr, proc.stderr
    assert "tokens/s" not in proc.stdout
