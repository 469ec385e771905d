"""One MoE layer per T, for a profiler: run it under Nsight Compute to see where the kernels stall.

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section MemoryWorkloadAnalysis -k regex:kernel python jobs/profile_moe.py --tokens 1,8,64

--path warp (warp decode, its --schedule) or expert_centric (its dequant "auto": the FP8 GEMMs, kernel names
_gate_up_fp8_kernel and _down_fp8_kernel, for MXFP8 weights up to T = 1024).

Qwen3-30B-A3B shape, MXFP8 experts, uniform random routing; each T is launched three times (the first compiles) so
the profiler can skip warm-up launches with --launch-skip. Prints nothing but the T being run.
"""

import argparse

import torch

from kernels import expert_centric_moe, mxfp8_quantize
from kernels.warp_decode_moe import warp_decode_moe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,8,64")
    parser.add_argument("--schedule", default="auto")
    parser.add_argument("--path", default="warp", choices=("warp", "expert_centric"))
    args = parser.parse_args()
    H, I, E, k = 2048, 768, 128, 8
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = mxfp8_quantize(torch.randn(E, 2 * I, H, device="cuda", generator=gen) * 0.02)
    w2 = mxfp8_quantize(torch.randn(E, H, I, device="cuda", generator=gen) * 0.02)
    for T in (int(t) for t in args.tokens.split(",")):
        print(f"T={T}", flush=True)
        hidden = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
        ids = torch.rand(T, E, device="cuda", generator=gen).argsort(dim=1)[:, :k].to(torch.int32).contiguous()
        weights = torch.softmax(torch.randn(T, k, device="cuda", generator=gen), dim=-1)
        for _ in range(3):
            if args.path == "warp":
                warp_decode_moe(hidden, weights, ids, w13, w2, schedule=args.schedule)
            else:
                expert_centric_moe(hidden, weights, ids, w13, w2)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
