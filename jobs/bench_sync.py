"""Weight sync of a Qwen3-30B-A3B-sized BF16 state (about 61 GB) into one rollout worker on the same GPU.

    python jobs/bench_sync.py --out DIR     # a table, one JSON line at the end, DIR/bench_sync.json and .png

The trainer is this process: it generates every tensor on the GPU under Hugging Face names (transformers 5's fused
expert layout, or the Hub's per-expert one as views of it) and pushes it with WeightSync into a RolloutPool worker
(a Ray actor on the same GPU, MXFP8 experts). A row's seconds run from `push` to the worker serving the new version:
staging (the worker maps or receives each bucket and re-quantizes the experts on the GPU), validation of the whole
update (every value finite), and the swap. GB/s is the source's bytes over those seconds; `shares` counts the IPC
shares of a cuda_ipc push (each allocation once per bucket it has tensors in: the Hub layout's tensors are views of
the fused layout's allocations, so it shares about as often as the fused one; WeightSync packs each layer's
per-expert tensors into the fused layout, composer_rollout.sync.packing, and these views, which tile the fused
tensors, are sent as those tensors without a copy: a trainer with one allocation per expert tensor pays one
concatenation per layer and projection group on its GPU instead, ~58 GB read and written). The target is cuda_ipc with
the fused layout at <= 0.5 s (NeMo-RL's fastest published Qwen3-30B refit: 0.74-1.0 s; verl and slime: about 7 s).
After the runs, a few of the worker's tensors are read back and compared bit for bit with the host quantizer's bytes.
Needs ray (carried as wheels on the lent GPU machine: jobs/gpu_sync.sh).

With a `collective` run (NCCL: issue 8, two or more GPUs) the trainer sits on a GPU of its own and --workers workers
(default: every other GPU) receive; each collective row also reports the plain NCCL broadcast of the same bucket
size on the same group (WeightSync.broadcast_ceiling) and the fraction of it the sync reached (target 70%).
cuda_ipc runs need the trainer on the worker's GPU, so they do not mix with collective ones in one invocation.
"""

import argparse
import json
import time
from pathlib import Path

import ray
import torch

from composer_rollout.config import EngineConfig, KernelConfig, ModelConfig, RolloutConfig, SyncConfig, WeightDtype
from composer_rollout.engine import SamplingParams
from composer_rollout.model import Qwen3MoE, preset
from composer_rollout.prompts import Prompt
from composer_rollout.rollout import RolloutPool, WeightSync
from composer_rollout.sync.channels import local_device
from kernels import mxfp8_quantize


def make_state(name: str, device: torch.device) -> tuple[list, list, int]:
    """(fused-layout pairs, Hub-layout pairs as views of the same memory, bytes) of random BF16 weights on the GPU."""
    args = preset(name)
    shapes = Qwen3MoE(args, device="meta").hf_dense_weights()
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(shape):
        return torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16).mul_(0.02)

    dense = [(n, torch.ones(p.shape, device=device, dtype=torch.bfloat16) if n.endswith("norm.weight")
              else rand(p.shape)) for n, p in shapes.items()]
    E, I, H = args.num_experts, args.moe_intermediate_size, args.hidden_size
    fused, hub = list(dense), list(dense)
    for layer in range(args.num_hidden_layers):
        w13, w2 = rand((E, 2 * I, H)), rand((E, H, I))
        prefix = f"model.layers.{layer}.mlp.experts"
        fused += [(f"{prefix}.gate_up_proj", w13), (f"{prefix}.down_proj", w2)]
        for e in range(E):
            hub += [(f"{prefix}.{e}.gate_proj.weight", w13[e, :I]), (f"{prefix}.{e}.up_proj.weight", w13[e, I:]),
                    (f"{prefix}.{e}.down_proj.weight", w2[e])]
    return fused, hub, sum(t.numel() * t.element_size() for _, t in fused)


def separate(fused: list, hub: list, experts: int) -> list:
    """The Hub layout with one allocation per expert tensor, as an FSDP gather or a Megatron export hands it over:
    each per-expert view cloned, a layer at a time, and that layer's fused tensors released (the GPU cannot hold a
    second 58 GB copy beside the worker). Empties `fused` and `hub`."""
    out, held = [], {n: i for i, (n, _) in enumerate(fused)}
    for i, (n, t) in enumerate(hub):
        out.append((n, t.clone() if ".mlp.experts." in n else t))
        hub[i] = t = None  # the views keep the fused storage alive too
        if n.endswith(f".experts.{experts - 1}.down_proj.weight"):  # the layer's last tensor: free its fused pair
            prefix = n.rsplit(".", 3)[0]
            for name in (f"{prefix}.gate_up_proj", f"{prefix}.down_proj"):
                fused[held[name]] = (name, None)
    fused.clear()
    hub.clear()
    return out


def refused(hub: list, layers: int, experts: int) -> list:
    """check_exact's tensors (the embedding, layer 0's gate_up_proj, the last layer's down_proj) rebuilt from
    per-expert tensors."""
    state, last = dict(hub), layers - 1
    p0, pl = "model.layers.0.mlp.experts", f"model.layers.{last}.mlp.experts"
    gate_up = [torch.cat([state[f"{p0}.{e}.gate_proj.weight"], state[f"{p0}.{e}.up_proj.weight"]])
               for e in range(experts)]
    return [("model.embed_tokens.weight", state["model.embed_tokens.weight"]),
            (f"{p0}.gate_up_proj", torch.stack(gate_up)),
            (f"{pl}.down_proj", torch.stack([state[f"{pl}.{e}.down_proj.weight"] for e in range(experts)]))]


def check_exact(pool: RolloutPool, fused: list, layers: int) -> bool:
    """A few of the worker's tensors against the host quantizer's bytes (computed here, on the GPU)."""
    state = dict(fused)
    last = layers - 1
    names = {"model.layers.0.mlp.experts.w13": state["model.layers.0.mlp.experts.gate_up_proj"],
             f"model.layers.{last}.mlp.experts.w2": state[f"model.layers.{last}.mlp.experts.down_proj"]}
    keys = [f"{n}.{part}" for n in names for part in ("data", "scales")] + ["model.embed_tokens.weight"]
    got = ray.get(pool.workers[0].weights.remote(keys))
    ok = torch.equal(got["model.embed_tokens.weight"], state["model.embed_tokens.weight"].cpu())
    for n, w in names.items():
        q = mxfp8_quantize(w)
        ok &= torch.equal(got[f"{n}.data"], q.data.view(torch.uint8).cpu()) and torch.equal(got[f"{n}.scales"],
                                                                                            q.scales.cpu())
    return bool(ok)


def plot(rows: list[dict], path: Path, target_s: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['transport']}\n{r['layout']}, {r['bucket_mb']} MB" for r in rows]
    ax.bar(labels, [r["seconds"] for r in rows], color=["tab:green" if r["transport"] == "cuda_ipc" else "tab:blue"
                                                        for r in rows])
    ax.axhline(target_s, color="tab:red", linestyle="--", label=f"target {target_s} s (cuda_ipc)")
    ax.set_yscale("log")
    ax.set_ylabel("seconds per full sync (best of reps)")
    ax.set_title(title)
    for i, r in enumerate(rows):
        ax.annotate(f"{r['seconds']:.3g} s\n{r['gb_per_s']:.1f} GB/s", (i, r["seconds"]), ha="center", va="bottom",
                    fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/bench_sync")
    parser.add_argument("--preset", default="qwen3_30b_a3b")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--runs", nargs="+", default=["cuda_ipc:fused:512", "cuda_ipc:fused:8192",
                                                      "cuda_ipc:hub:512", "object_store:fused:512"],
                        help="transport:layout:bucket_mb, in order (object_store runs once: it is slow); layouts "
                             "fused, hub (views of the fused tensors), hub_alloc (one allocation per expert tensor: "
                             "the fused state is converted for it, so it must come last)")
    parser.add_argument("--workers", type=int, default=None, help="collective runs: workers (default: GPUs - 1)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_sync needs a CUDA GPU (cuda_ipc shares the trainer's GPU memory with the worker)")
    transports = {run.split(":")[0] for run in args.runs}
    collective = "collective" in transports
    if collective and "cuda_ipc" in transports:
        raise SystemExit("--runs: collective puts the trainer on a GPU of its own, cuda_ipc on the worker's: run "
                         "them in separate invocations")
    num_workers = args.workers or (torch.cuda.device_count() - 1 if collective else 1)
    if collective and not 1 <= num_workers < torch.cuda.device_count():
        raise SystemExit(f"--runs collective: needs a GPU for the trainer and one per worker; {num_workers} "
                         f"worker(s) on {torch.cuda.device_count()} GPU(s)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ray.init(num_cpus=4, include_dashboard=False)
    start = time.perf_counter()
    pool = RolloutPool(ModelConfig(preset=args.preset, weight_dtype=WeightDtype.mxfp8), KernelConfig(),
                       EngineConfig(max_num_seqs=2, max_model_len=128),
                       RolloutConfig(num_workers=num_workers, gpus_per_worker=1, cpus_per_worker=2),
                       SyncConfig(timeout_s=900))
    build_s = time.perf_counter() - start
    held = [local_device(info["gpu_uuid"]) for info in pool.info]  # the workers' GPUs, as this process sees them
    free = [i for i in range(torch.cuda.device_count()) if i not in held]
    device = torch.device("cuda", free[0] if collective else held[0])
    torch.cuda.set_device(device)
    fused, hub, nbytes = make_state(args.preset, device)
    allocations = len({t.untyped_storage().data_ptr() for _, t in hub})
    print(f"worker built in {build_s:.1f} s; trainer state {nbytes / 1e9:.1f} GB BF16 ({len(fused)} fused-layout "
          f"tensors, {len(hub)} in the Hub layout, all in {allocations} allocations) on "
          f"{torch.cuda.get_device_name(device)}")
    runs = [run.split(":") for run in args.runs]
    layouts = [layout for _, layout, _ in runs]
    if "hub_alloc" in layouts and any(lay != "hub_alloc" for lay in layouts[layouts.index("hub_alloc"):]):
        raise SystemExit("--runs: hub_alloc rows must come last (the fused state is converted for them)")
    model_args = preset(args.preset)
    rows, version, exact, alloc = [], 0, True, None
    print(f"{'transport':>12} {'layout':>6} {'bucket':>7} {'best s':>8} {'GB/s':>7} {'stage s':>8} {'valid s':>8} "
          f"{'swap s':>7} {'buckets':>7} {'shares':>7}  all reps (s)")
    for transport, layout, bucket_mb in runs:
        sync = WeightSync(pool, transport=transport, bucket_mb=int(bucket_mb), timeout_s=900)
        if layout == "hub_alloc" and alloc is None:
            if version:  # what the earlier rows left on the worker, before their source is released
                exact &= check_exact(pool, fused, model_args.num_hidden_layers)
            alloc = separate(fused, hub, model_args.num_experts)
            torch.cuda.synchronize()
        state = {"fused": fused, "hub": hub, "hub_alloc": alloc}[layout]
        reps = 1 if transport == "object_store" else args.reps + 1  # the first cuda_ipc push compiles and warms up
        stats = []
        for _ in range(reps):
            version += 1
            stats.append(sync.push(state, version))
        timed = stats[1:] if len(stats) > 1 else stats
        best = min(timed, key=lambda s: s.seconds)
        ceiling = sync.broadcast_ceiling(int(bucket_mb) << 20) if transport == "collective" else None
        rows.append({"transport": transport, "layout": layout, "bucket_mb": int(bucket_mb), "seconds": best.seconds,
                     "gb_per_s": best.gb_per_s, "stage_s": best.stage_s, "validate_s": best.prepare_s,
                     "swap_s": best.commit_s, "buckets": best.buckets, "tensors": best.tensors,
                     "shared_storages": best.shared_storages,
                     "reps_s": [round(s.seconds, 4) for s in stats], "broadcast_gb_per_s": ceiling,
                     "of_broadcast": ceiling and round(best.gb_per_s / ceiling, 3)})
        r = rows[-1]
        print(f"{transport:>12} {layout:>6} {bucket_mb:>7} {r['seconds']:>8.3f} {r['gb_per_s']:>7.1f} "
              f"{r['stage_s']:>8.3f} {r['validate_s']:>8.3f} {r['swap_s']:>7.3f} {r['buckets']:>7} "
              f"{r['shared_storages']:>7}  {r['reps_s']}"
              + (f"  plain broadcast {ceiling:.1f} GB/s ({100 * r['of_broadcast']:.0f}%)" if ceiling else ""),
              flush=True)
    last = refused(alloc, model_args.num_hidden_layers, model_args.num_experts) if alloc else fused
    exact &= check_exact(pool, last, model_args.num_hidden_layers)
    served = pool.generate([Prompt(0, "p0", [1, 2, 3], SamplingParams(max_tokens=4, seed=0))])[0]
    print(f"worker tensors bit-exact with the source's quantization: {exact}; it serves version "
          f"{served.weight_version} (pushed {version})")
    pool.shutdown()
    ipc = [r["seconds"] for r in rows if r["transport"] == "cuda_ipc" and r["layout"] == "fused"]
    result = {"bench": "sync", "preset": args.preset, "state_gb": round(nbytes / 1e9, 2), "build_s": round(build_s, 1),
              "workers": num_workers,
              "cuda_ipc_best_s": round(min(ipc), 4) if ipc else None, "target_s": 0.5, "exact": exact,
              "served_version": served.weight_version, "rows": rows}
    (out / "bench_sync.json").write_text(json.dumps(result, indent=2))
    try:
        plot(rows, out / "bench_sync.png", 0.5,
             f"{args.preset}: {nbytes / 1e9:.0f} GB BF16 -> {num_workers} worker(s) (MXFP8), "
             f"{torch.cuda.get_device_name(device)}")
    except ImportError:
        print("matplotlib is not installed here: no bench_sync.png")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}
                     | {"rows": [{k: r[k] for k in ("transport", "layout", "bucket_mb", "seconds", "gb_per_s",
                                                   "of_broadcast")} for r in rows]}))
    ray.shutdown()


if __name__ == "__main__":
    main()
