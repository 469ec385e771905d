"""jobs/tune_expert_centric.py's table writing, on the CPU: a retune of a few T buckets folds into the table already
there (its other buckets, shapes and crossover kept), and the crossover is the run of buckets warp decode won."""

import json

import pytest

from jobs.tune_expert_centric import crossover_of, merge_table
from kernels.expert_centric_moe import CONFIG_DIR, shape_key

KEY = shape_key(128, 2048, 768, 8)


def tile(block_n: int) -> dict:
    return dict(block_m=16, gate_up=dict(block_n=block_n, block_k=128, num_warps=4, num_stages=3),
                down=dict(block_n=2 * block_n, block_k=64, num_warps=4, num_stages=3))


def table(dequant: str, measured: dict, note: str = "first tune", **shapes) -> dict:
    entry = dict(weights="mxfp8", configs={T: tile(32 + int(T)) for T in measured}, measured=measured)
    if dequant != "f16_rel":
        entry["crossover_tokens"] = crossover_of(measured)
    return dict(device="NVIDIA H200", date="2026-12-01", tool="jobs/tune_expert_centric.py", note=note,
                dequant=dequant, shapes={KEY: entry, **shapes})


def timed(ec: float, warp: float | None = None) -> dict:
    return dict(expert_centric_us=ec, rel_err=2e-3, **({} if warp is None else dict(warp_decode_us=warp)))


def test_crossover_is_the_run_of_warp_decode_wins():
    assert crossover_of({"1": timed(25, 18), "2": timed(33, 28), "8": timed(84, 75), "16": timed(122, 138),
                         "32": timed(160, 120)}) == 8  # a later win does not extend the run
    assert crossover_of({"4": timed(50, 60), "8": timed(84, 75)}) == 0
    assert crossover_of({"1": timed(25, 18), "2": timed(33), "4": timed(50, 45)}) == 1  # 2: warp decode not timed
    assert crossover_of({"1": timed(25, 18), "8": dict(h100_expert_centric_us=80.0, warp_decode_us=70.0)}) == 1


def test_a_retune_of_some_buckets_keeps_the_others():
    other = {shape_key(128, 4096, 1536, 8): dict(weights="mxfp8", configs={"1": tile(64)}, measured={})}
    old = table("bf16", {"1": timed(47, 20), "16": timed(205, 200), "32": timed(266, 340),
                         "2048": dict(h100_expert_centric_us=791.1)}, **other)
    fresh = table("bf16", {"2048": timed(760), "8192": timed(2200)}, note="this run")
    fresh["date"] = "2026-12-08"
    merged = merge_table(old, fresh, KEY)
    entry = merged["shapes"][KEY]
    assert list(entry["configs"]) == ["1", "16", "32", "2048", "8192"]
    assert entry["configs"]["1"] == old["shapes"][KEY]["configs"]["1"]
    assert entry["configs"]["2048"] == fresh["shapes"][KEY]["configs"]["2048"]
    assert entry["measured"]["2048"] == timed(760)  # the old tile's numbers go with it
    assert fresh["shapes"][KEY]["crossover_tokens"] == 0 and entry["crossover_tokens"] == 16
    assert merged["shapes"][shape_key(128, 4096, 1536, 8)] == other[shape_key(128, 4096, 1536, 8)]
    assert merged["note"].startswith("first tune") and "2026-12-08: T = 2048, 8192 retuned" in merged["note"]
    assert merged["date"] == "2026-12-08"


def test_nothing_to_merge_into():
    fresh = table("fp8", {"64": timed(177)})
    assert merge_table(None, fresh, KEY) is fresh
    assert merge_table(table("bf16", {"1": timed(47, 20)}), fresh, KEY) is fresh  # another dequant mode's table


@pytest.mark.parametrize("name, crossover", [("expert_centric_h200.json", 16), ("expert_centric_h200_fp8.json", 8)])
def test_the_shipped_tables_keep_their_crossover(name, crossover):
    with open(f"{CONFIG_DIR}/{name}") as f:
        old = json.load(f)
    dequant = old.get("dequant", "bf16")
    assert old["shapes"][KEY]["crossover_tokens"] == crossover == crossover_of(old["shapes"][KEY]["measured"])
    merged = merge_table(old, table(dequant, {"4096": timed(1300)}), KEY)
    assert merged["shapes"][KEY]["crossover_tokens"] == crossover
    assert set(merged["shapes"][KEY]["configs"]) == set(old["shapes"][KEY]["configs"]) | {"4096"}
