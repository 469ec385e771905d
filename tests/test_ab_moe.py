"""jobs/ab_moe.py end to end on the CPU (Triton's interpreter, toy shape): both trees load side by side, the table,
the JSON line and the PNG come out, and a base tree whose warp decode computes something else is reported as not
bit-identical while the unchanged expert-centric path is."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ab_moe_compares_two_trees(tmp_path):
    base = tmp_path / "base"
    shutil.copytree(ROOT / "kernels", base / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    wd = base / "kernels" / "warp_decode_moe.py"
    src = wd.read_text()
    check = "    check_kernel_args(hidden, topk_weights, topk_ids, w13, w2)\n"
    assert src.count(check) == 1
    wd.write_text(src.replace(check, check + "    hidden = hidden * 2\n"))
    cmd = [sys.executable, "jobs/ab_moe.py", "--base", str(base), "--out", str(tmp_path / "out"), "--shape", "tiny",
           "--tokens", "1,3", "--paths", "warp_decode,expert_centric", "--layers", "1", "--rounds", "1",
           "--device", "cpu"]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["bit_identical"] == {"warp_decode/T1": False, "warp_decode/T3": False,
                                        "expert_centric/T1": True, "expert_centric/T3": True}
    assert set(summary["change_pct"]) == set(summary["bit_identical"])
    assert (tmp_path / "out" / "ab_moe.png").stat().st_size > 0
    rows = json.loads((tmp_path / "out" / "ab_moe.json").read_text())["rows"]
    assert len(rows) == 8 and all(r["us"] > 0 and r["mb"] > 0 for r in rows)


def test_ab_moe_refuses_a_base_without_kernels(tmp_path):
    cmd = [sys.executable, "jobs/ab_moe.py", "--base", str(tmp_path), "--device", "cpu"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "no kernels/ package there" in proc.stderr
