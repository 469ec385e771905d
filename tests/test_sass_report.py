"""jobs/sass_report.py compiles a real kernel for sm_90 on the CPU (Triton's bundled ptxas and cuobjdump), with the
JIT's pointer alignment, and reports its hottest loop; it refuses a signature that misses an argument. Run as a
subprocess without TRITON_INTERPRET (set for this suite by conftest.py), under which kernels are not compiled."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL = "kernels.moe_gate_up_fp8:_gate_up_fp8_kernel"
SIG = ("x_ptr=*fp8e4nv,xs_ptr=*u8,sorted_ptr=*i32,block_expert_ptr=*i32,d_ptr=*fp8e4nv,"
       "w_desc=tensordesc<fp8e4nv[1, 2, 64, 64]>,s_ptr=*i16,a_ptr=*u8,as_ptr=*u8")
CONST = "H=2048,I=768,K_TOP=8,F32_DOT=False,TMA=True,BLOCK_M=16,BLOCK_N=64,BLOCK_K=64,BOX_K=64"


def _run(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "jobs/sass_report.py", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True)


def test_fp8_gate_up_loop(tmp_path):
    out = _run(KERNEL, "--sig", SIG + ",P=i32", "--const", CONST, "--sass", str(tmp_path / "k.sass"))
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert 32 < r["registers"] <= 255 and not r["spills"] and r["shared_bytes"] > 0
    # The K loop: 2 groups a step, each one FP8 dot of two m64 wgmmas, the weights of both in one TMA box; the hidden
    # tile by cp.async, which needs the 16-byte alignment the JIT gives (without it, byte-wide synchronous LDGs)
    assert r["loop_ops"]["QGMMA"] == 4 and r["loop_ops"]["UTMALDG"] == 1 and r["loop_ops"]["LDGSTS"] >= 1
    assert 0 < r["loop_instructions"] < r["instructions"]
    assert "QGMMA" in (tmp_path / "k.sass").read_text()


def test_refuses_a_signature_missing_an_argument():
    out = _run(KERNEL, "--sig", SIG, "--const", CONST)
    assert out.returncode != 0 and "without a --sig or --const ['P']" in out.stderr
