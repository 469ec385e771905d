"""jobs/ncu_stalls.py on an export shaped like Nsight Compute's `--page source --print-source sass --csv` (two
kernels, quoted fields, the "(Not Issued)" twins of each stall column, which must not be counted twice)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.ncu_stalls import kernels, opcode, summarize

ROOT = Path(__file__).resolve().parents[1]
HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_barrier", "stall_long_sb",
          "stall_selected", "stall_barrier (Not Issued)", "stall_long_sb (Not Issued)"]


def _export(tmp_path, kernels_rows):
    lines = []
    for name, rows in kernels_rows.items():
        lines.append(f'"Kernel Name","{name}",')
        lines.append(",".join(f'"{h}"' for h in HEADER))
        lines += [",".join(f'"{v}"' for v in row) for row in rows]
    path = tmp_path / "sass.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


ROWS = {
    "_gate_up_fp8_kernel": [
        ["0x10", "@!P2  BRA 0x7f00", 60, 0, 55, 5, 0, 55],
        ["0x20", "WARPGROUP.DEPBAR.LE gsb0, 0x0", 30, 28, 0, 2, 28, 0],
        ["0x30", "QGMMA.64x32x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24", 10, 0, 1, 9, 0, 1],
    ],
    "_down_fp8_kernel": [["0x40", "IMAD.WIDE.U32 R16, R29, 0xc000, R26", 4, 0, 3, 1, 0, 3]],
}


def test_summary_per_kernel(tmp_path):
    found = kernels(_export(tmp_path, ROWS).read_text())
    assert list(found) == ["_gate_up_fp8_kernel", "_down_fp8_kernel"]
    s = summarize(found["_gate_up_fp8_kernel"], top=2)
    assert s["samples"] == 100
    assert s["reasons"] == {"long_sb": 56.0, "barrier": 28.0, "selected": 16.0}
    assert s["opcodes"] == {"BRA": 60.0, "WARPGROUP": 30.0, "QGMMA": 10.0}
    assert [h["address"] for h in s["hot"]] == ["0x10", "0x20"]
    assert s["hot"][0]["reasons"] == {"long_sb": 55}  # selected (5 of 60) is under a fifth
    assert opcode("@P4   IADD3 R84, P5, R114, 0x30, RZ") == "IADD3"


def test_cli_prints_a_json_line_and_refuses_other_files(tmp_path):
    out = subprocess.run([sys.executable, "jobs/ncu_stalls.py", str(_export(tmp_path, ROWS))], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1])["_down_fp8_kernel"]["samples"] == 4
    with pytest.raises(ValueError, match="Kernel Name"):
        kernels('"Address","Source"\n')
    with pytest.raises(ValueError, match="SourceCounters"):
        summarize([{"Address": "0x0", "Source": "NOP"}], top=1)
