"""Decode throughput of the engine on the GPU, against the bandwidth roofline measured in the same run.

Four sections (--sections):
- steps: one decode step (the captured CUDA graph of the batch bucket, then sampling and the read of the sampled
  tokens: what the engine does per step) at each batch B and context c, for each MoE kernel path. Every row's
  cache holds c random keys and values (never zeros), so attention reads c positions per row. The roofline of
  a step is the bytes it must read over the streaming-read bandwidth measured here: every dense weight, the
  distinct experts the step's tokens were routed to (counted from the step's own routing), the embedding rows
  and the K and V of B * c positions in every layer.
- longtail: the engine end to end (kernel auto, Triton attention, CUDA graphs) on requests whose response lengths
  are drawn from a log-normal (clipped to --longtail-max), more requests than slots: decode tokens/s and the mean
  batch occupancy (live rows over slots per decode step), over the whole run and while requests were waiting, and
  the whole-run bound of the same lengths for a scheduler that cannot know them in advance (fifo_occupancy).
- engine: the engine's own decode step (RolloutEngine with graphs, kernel auto) with B rows live and nothing
  prefilling, host bookkeeping included, beside the steps section's step at the first context.
- accuracy: the fast engine's greedy samples teacher-forced through an FP32 copy of the same weights (dense
  weights widened from BF16, the same MXFP8 experts, torch attention and MoE): |delta logprob| of the generated
  tokens, and where the greedy tokens first differ, the reference's top-2 margin there against BF16 rounding.

Prints a table per section, writes bench_decode.png and bench_decode.json under --out, ends with one JSON line.
Random init (`--preset`), so routing is near uniform: the expert bytes are those of real routing at that spread.
Made for the H200; on a CPU (`--device cpu`, Triton's interpreter, no CUDA graphs, a host-memory read ceiling)
it runs at toy sizes so that tests keep it working, and its numbers mean nothing.
"""

import argparse
import heapq
import json
import math
import os
import statistics
import time

import numpy as np
import torch

from composer_rollout.engine import RolloutEngine, SamplingParams
from composer_rollout.engine.capture import ExpertCapture
from composer_rollout.engine.graphs import DecodeGraphs, decode_step
from composer_rollout.engine.step_io import HostReadout
from composer_rollout.model import Qwen3MoE, preset
from jobs.bench_moe import read_ceiling_tbs
from kernels import MXFP8Tensor

TARGETS = {"roofline_b1_1k": 0.50, "roofline_b32_b64": 0.65, "warp_vs_ec_b1": 1.3, "warp_vs_ec_b8": 1.1,
           "occupancy": 0.90, "mean_abs_dlogprob": 0.01}


def weight_bytes(model) -> tuple[int, int, int]:
    """(dense bytes a decode step reads whatever the batch, bytes of one expert, bytes of one embedding row)."""
    dense = model.hf_dense_weights()
    embed = dense["model.embed_tokens.weight"]
    read = sum(t.numel() * t.element_size() for n, t in dense.items() if n != "model.embed_tokens.weight")
    if model.lm_head is None:  # tied: the head reads the whole embedding
        read += embed.numel() * embed.element_size()
    w13, w2 = model.experts(0)
    per_expert = sum((w.nbytes if isinstance(w, MXFP8Tensor) else w.numel() * w.element_size()) // w.shape[0]
                     for w in (w13, w2))
    return read, per_expert, embed.shape[1] * embed.element_size()


def fill_cache(cache, gen) -> None:
    for t in (cache.k, cache.v):
        for layer in range(t.shape[0]):
            t[layer].normal_(generator=gen)


def host_read_ceiling_tbs() -> float:
    x = torch.randint(0, 7, (1 << 26,), dtype=torch.int32)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / min(times) / 1e12


class EagerSteps:
    """DecodeGraphs' interface without graphs (CPU): the same forward and sampler, launched op by op."""

    def __init__(self, model, cache):
        self.model, self.cache, self.capture_s = model, cache, 0.0

    def run(self, ids, positions, slots, temperature, seeds, steps):
        a = self.model.args
        capture = ExpertCapture(a.num_hidden_layers, ids.shape[0], a.num_experts_per_tok, a.num_experts,
                                self.model.device)
        return *decode_step(self.model, self.cache, ids, positions, slots, temperature, seeds, steps, capture), capture


def time_step(steps, ids, positions, slots, params, reps) -> tuple[float, torch.Tensor]:
    """Median seconds of one engine decode step (the engine's own when no row filters: the step with its sampler,
    then tokens and logprobs to the host), and the routed expert ids [layers, B, k] of the last one."""
    readout, times = HostReadout(ids.device), []
    temperature, _, _, seeds, step_ids = params
    for _ in range(reps + 2):
        start = time.perf_counter()
        _, tokens, logprobs, capture = steps.run(ids, positions, slots, temperature, seeds, step_ids)
        readout.read(tokens, logprobs, ids.shape[0])
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]), capture.ids.clone()


def bench_steps(model, batches, contexts, kernels, reps, ceiling_tbs, gen):
    a, dev, rows = model.args, model.device, []
    dense, per_expert, embed_row = weight_bytes(model)
    kv_token = a.num_hidden_layers * 2 * a.num_key_value_heads * a.head_dim * 2
    on_gpu = dev.type == "cuda"
    for c in contexts:
        free = torch.cuda.mem_get_info(dev)[0] - (4 << 30) if on_gpu else 1 << 62  # room for graph activations
        fit = [b for b in batches if (b + 1) * (c + 1) * kv_token <= free]
        for b in sorted(set(batches) - set(fit)):
            print(f"skip B={b} c={c}: the KV of {b}x{c} tokens ({b * c * kv_token / 1e9:.0f} GB) does not fit")
        if not fit:
            continue
        cache = model.new_kv_cache(max(fit), c + 1)
        fill_cache(cache, gen)
        for kernel in kernels:
            model.set_paths(kernel=kernel)
            graphs = DecodeGraphs(model, cache, fit) if on_gpu else EagerSteps(model, cache)
            for b in fit:
                ids = torch.randint(0, a.vocab_size, (b, 1), device=dev, generator=gen)
                positions = torch.full((b, 1), c - 1, device=dev)
                slots = torch.arange(b, device=dev)
                ones, zeros = torch.ones(b, device=dev), torch.zeros(b, dtype=torch.long, device=dev)
                params = (ones, zeros, ones, torch.arange(b, device=dev), zeros)  # T=1, no top-k/p, seeds 0..b-1
                seconds, ids_routed = time_step(graphs, ids, positions, slots, params, reps)
                distinct = sum(len(torch.unique(ids_routed[layer])) for layer in range(a.num_hidden_layers))
                weights = dense + distinct * per_expert + b * embed_row
                kv = b * c * kv_token
                roofline_s = (weights + kv) / (ceiling_tbs * 1e12)
                rows.append(dict(kernel=kernel, B=b, context=c, step_ms=round(seconds * 1e3, 3),
                                 tok_s=round(b / seconds, 1), weights_gb=round(weights / 1e9, 3),
                                 kv_gb=round(kv / 1e9, 3), roofline_ms=round(roofline_s * 1e3, 3),
                                 roofline_frac=round(roofline_s / seconds, 3), capture_s=round(graphs.capture_s, 1)))
                print(f"{kernel:>15} B={b:<4} c={c:<6} {seconds * 1e3:8.3f} ms {b / seconds:9.1f} tok/s  "
                      f"weights {weights / 1e9:6.2f} GB  kv {kv / 1e9:6.2f} GB  roofline {roofline_s * 1e3:7.3f} ms "
                      f"({100 * roofline_s / seconds:5.1f}%)", flush=True)
            del graphs
        del cache
        if on_gpu:
            torch.cuda.empty_cache()
    return rows


def fifo_occupancy(lengths, slots: int) -> float:
    """The best whole-run occupancy of this workload for a scheduler that does not know lengths in advance: requests
    taken in arrival order, each into the first slot to free, at once and with no prefill cost. The drain (the last
    long responses decoding alone) is the workload's, so the engine's measured occupancy is judged against this."""
    free = [0] * slots
    end = 0
    for n in lengths:
        start = heapq.heappop(free)
        heapq.heappush(free, start + int(n))
        end = max(end, start + int(n))
    return float(sum(int(n) for n in lengths)) / (slots * end) if end else 0.0


def bench_longtail(model, slots, requests, prompt_len, max_len, seed):
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(math.log(max_len / 8), 1.0, requests), 16, max_len).astype(int)
    model.set_paths(kernel="auto")
    engine = RolloutEngine(model, max_num_seqs=slots, max_model_len=prompt_len + max_len, seed=seed,
                           cuda_graphs=None)
    for i, n in enumerate(lengths):
        prompt = rng.integers(0, model.args.vocab_size, prompt_len).tolist()
        engine.add_request(prompt, SamplingParams(temperature=1.0, max_tokens=int(n), seed=i), prompt_index=i)
    s, occupancy, waiting_occupancy, start = engine.stats, [], [], time.perf_counter()
    while engine.has_unfinished():
        steps, tokens, waiting = s.decode_steps, s.decode_tokens, engine.num_waiting > 0
        engine.step()
        if s.decode_steps > steps:
            occupancy.append((s.decode_tokens - tokens) / slots)
            if waiting:
                waiting_occupancy.append(occupancy[-1])
    seconds = time.perf_counter() - start
    out = dict(slots=slots, requests=requests, prompt_len=prompt_len, max_len=max_len,
               mean_len=round(float(lengths.mean()), 1), seconds=round(seconds, 2),
               decode_tok_s=round(s.decode_tokens / s.decode_s, 1), total_tok_s=round(s.decode_tokens / seconds, 1),
               occupancy=round(float(np.mean(occupancy)), 4),
               occupancy_bound_fifo=round(fifo_occupancy(lengths, slots), 4),
               occupancy_while_waiting=round(float(np.mean(waiting_occupancy)), 4) if waiting_occupancy else None,
               capture_s=round(engine.graphs.capture_s, 1) if engine.graphs else None)
    print("longtail", out, flush=True)
    return out, occupancy


def bench_engine(model, batches, context, tokens, seed):
    """The engine's own decode step (RolloutEngine, kernel auto, graphs where they run): B requests of a `context`-token
    prompt, and the median wall time of its decode steps with all B rows live and nothing prefilling, the host's
    part (inputs, the graph launch, the readout and the bookkeeping) included. Against the steps section's step at
    the same B and context, the difference is what the engine's Python costs per step."""
    model.set_paths(kernel="auto")
    rng, rows = np.random.default_rng(seed), []
    engine = RolloutEngine(model, max_num_seqs=max(batches), max_model_len=context + tokens + 1, seed=seed,
                           cuda_graphs=None)
    s = engine.stats
    for b in batches:
        for i in range(b):
            engine.add_request(rng.integers(0, model.args.vocab_size, context).tolist(),
                               SamplingParams(temperature=1.0, max_tokens=tokens, seed=i), prompt_index=i)
        times = []
        while engine.has_unfinished():
            full = engine.num_live == b and engine.num_waiting == 0
            decode_s, prefills = s.decode_s, s.prefill_forwards
            engine.step()
            if full and s.prefill_forwards == prefills:
                times.append(s.decode_s - decode_s)
        rows.append(dict(B=b, context=context, engine_step_ms=round(statistics.median(times) * 1e3, 3),
                         steps=len(times)))
        print(f"engine B={b:<4} c={context:<6} {rows[-1]['engine_step_ms']:8.3f} ms per decode step "
              f"(median of {len(times)})", flush=True)
    return rows


def fp32_twin(model) -> Qwen3MoE:
    """An FP32 copy of `model`: dense weights widened from BF16, the same MXFP8 experts, torch attention and MoE."""
    a = model.args
    ref = Qwen3MoE(a, dtype=torch.float32, device=model.device, weight_dtype="mxfp8")
    fast = model.hf_dense_weights()
    for name, p in ref.hf_dense_weights().items():
        p.copy_(fast[name].float())
    for i in range(a.num_hidden_layers):
        ref.layers[i].mlp.w13, ref.layers[i].mlp.w2 = model.experts(i)
    return ref


def score_against(ref, ps, results) -> dict:
    """Teacher-force each prompt + greedy completion through `ref`: |delta logprob| of the generated tokens, and
    where the greedy tokens first differ from ref's argmax, whether ref's top-2 margin there beats BF16 rounding."""
    dev = ref.device
    deltas, bad_divergences, first_diff = [], 0, []
    with torch.inference_mode():
        for p, r in zip(ps, results, strict=True):
            seq = p + r.token_ids
            cache = ref.new_kv_cache(1, len(seq))
            hidden = ref(torch.tensor([seq[:-1]], device=dev), torch.arange(len(seq) - 1, device=dev)[None],
                         torch.zeros(1, dtype=torch.long, device=dev), cache)[0, len(p) - 1:]
            logits = ref.compute_logits(hidden)
            lp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(r.token_ids, device=dev)[:, None])[:, 0]
            deltas += (lp.cpu() - torch.tensor(r.logprobs)).abs().tolist()
            top2 = logits.topk(2, dim=-1).values
            differs = (logits.argmax(-1).cpu() != torch.tensor(r.token_ids)).nonzero()
            if len(differs):
                j = int(differs[0])
                first_diff.append(j)
                margin, rounding = float(top2[j, 0] - top2[j, 1]), 2.0 ** -8 * abs(float(top2[j, 0]))
                bad_divergences += margin > rounding
    d = np.array(deltas)
    return dict(mean_abs_dlogprob=float(d.mean()), p50=float(np.percentile(d, 50)),
                p99=float(np.percentile(d, 99)), max=float(d.max()), greedy_divergences=len(first_diff),
                first_divergence=first_diff, divergences_above_bf16_margin=int(bad_divergences))


def bench_accuracy(model, prompts, prompt_len, tokens, seed):
    """The fast engine (kernel auto, Triton dense path, CUDA graphs) against the FP32 twin; for scale, the same
    for the BF16 engine with Hugging Face's numerics (dense torch: BF16 residual stream and logits, eager)."""
    a, on_gpu = model.args, model.device.type == "cuda"
    rng = np.random.default_rng(seed)
    ps = [rng.integers(0, a.vocab_size, prompt_len).tolist() for _ in range(prompts)]
    ref, out = fp32_twin(model), dict(prompts=prompts, tokens=tokens)
    for dense in ("triton", "torch"):
        model.set_paths(kernel="auto", dense=dense)
        engine = RolloutEngine(model, max_num_seqs=prompts, max_model_len=prompt_len + tokens + 1,
                               cuda_graphs=on_gpu and dense == "triton")
        stats = score_against(ref, ps, engine.generate(ps, SamplingParams(temperature=0.0, max_tokens=tokens)))
        del engine
        if dense == "triton":
            out.update(stats)
        else:
            out["bf16_hf_numerics"] = stats
    model.set_paths(dense="triton")
    print("accuracy", out, flush=True)
    return out


def plot(rows, occupancy, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    for (kernel, c) in sorted({(r["kernel"], r["context"]) for r in rows}):
        pts = sorted((r["B"], r["tok_s"], 100 * r["roofline_frac"]) for r in rows
                     if r["kernel"] == kernel and r["context"] == c)
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{kernel} c={c}")
        axes[1].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=f"{kernel} c={c}")
    axes[0].set(title="decode tokens/s", xscale="log", yscale="log", xlabel="batch")
    axes[1].set(title="% of bandwidth roofline", xscale="log", xlabel="batch", ylim=(0, 100))
    axes[1].axhline(65, color="r", ls=":")
    axes[2].plot(occupancy)
    axes[2].set(title="long tail: batch occupancy per decode step", xlabel="step", ylim=(0, 1.05))
    for ax in axes[:2]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "bench_decode.png"), dpi=110)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--preset", default="qwen3_30b_a3b")
    p.add_argument("--sections", default="steps,engine,longtail,accuracy")
    p.add_argument("--batches", default="1,8,32,64,128")
    p.add_argument("--contexts", default="1024,4096,16384")
    p.add_argument("--kernels", default="warp_decode,expert_centric,auto")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--engine-tokens", type=int, default=32)
    p.add_argument("--longtail-slots", type=int, default=64)
    p.add_argument("--longtail-requests", type=int, default=512)
    p.add_argument("--longtail-max", type=int, default=8192)
    p.add_argument("--accuracy-prompts", type=int, default=8)
    p.add_argument("--accuracy-tokens", type=int, default=64)
    p.add_argument("--accuracy-prompt-len", type=int, default=256)
    p.add_argument("--longtail-prompt-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    sections = set(args.sections.split(","))
    known = {"steps", "engine", "longtail", "accuracy"}
    if sections - known:
        raise SystemExit(f"--sections: unknown {sorted(sections - known)}")
    if args.engine_tokens < 3:  # the first token comes from the prefill, the second from a step that prefilled
        raise SystemExit(f"--engine-tokens must be >= 3 (a decode step with every row live), got {args.engine_tokens}")
    os.makedirs(args.out, exist_ok=True)
    ceiling = read_ceiling_tbs() if args.device == "cuda" else host_read_ceiling_tbs()
    print(f"read ceiling {ceiling:.3f} TB/s (streaming read, median)", flush=True)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    # No eos: random weights would stop a sample at random; every response runs to its drawn length.
    model = Qwen3MoE(preset(args.preset, eos_token_id=()), device=args.device, weight_dtype="mxfp8", kernel="auto",
                     dense="triton").init_random(args.seed)
    rows, engine_rows, longtail, occupancy, accuracy = [], [], None, [], None
    if "steps" in sections:
        rows = bench_steps(model, [int(b) for b in args.batches.split(",")],
                           [int(c) for c in args.contexts.split(",")], args.kernels.split(","), args.reps, ceiling, gen)
    if "engine" in sections:
        engine_rows = bench_engine(model, [int(b) for b in args.batches.split(",")],
                                   int(args.contexts.split(",")[0]), args.engine_tokens, args.seed)
    if "longtail" in sections:
        longtail, occupancy = bench_longtail(model, args.longtail_slots, args.longtail_requests,
                                             args.longtail_prompt_len, args.longtail_max, args.seed)
    if "accuracy" in sections:
        accuracy = bench_accuracy(model, args.accuracy_prompts, args.accuracy_prompt_len, args.accuracy_tokens,
                                  args.seed)
    plot(rows, occupancy, args.out)

    def tok_s(kernel, b, c):
        return next((r["tok_s"] for r in rows if (r["kernel"], r["B"], r["context"]) == (kernel, b, c)), None)

    frac = {f"{r['kernel']}/B{r['B']}/c{r['context']}": r["roofline_frac"] for r in rows}
    ratio = {f"B{b}/c{c}": round(tok_s("warp_decode", b, c) / tok_s("expert_centric", b, c), 3)
             for b in (1, 8) for c in {r["context"] for r in rows}
             if tok_s("warp_decode", b, c) and tok_s("expert_centric", b, c)}
    engine = {f"B{r['B']}/c{r['context']}": r["engine_step_ms"] for r in engine_rows}
    summary = dict(bench="decode", ceiling_tbs=round(ceiling, 3), roofline_frac=frac,
                   warp_vs_expert_centric=ratio, engine=engine, longtail=longtail, accuracy=accuracy, targets=TARGETS)
    with open(os.path.join(args.out, "bench_decode.json"), "w") as f:
        json.dump(dict(summary, rows=rows, engine_rows=engine_rows, occupancy=occupancy), f)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
