"""Which BF16 rounding of the fast decode path moves the logprobs most away from the FP32 twin.

bench_decode's accuracy section gives one number (mean |delta logprob| of the fast engine's greedy tokens against
an FP32 copy of the same weights). One change that removed a rounding (the MoE output in FP32, docs/perf.md) moved
it by less than its run-to-run spread, so guessing which rounding to remove is costly. Here the FP32 twin itself is
run with one rounding of the fast path emulated at a time (the tensor rounded to BF16 and widened back, by a
forward hook or a patched op), teacher-forced on the fast engine's own greedy tokens, and scored against the clean
twin on the same tokens: a deterministic number per rounding point, no sampling noise between points. "all" rounds
every point the fast path still rounds at the run's batch (FAST_POINTS; it should land near the fast engine's own
number, "fast": the gap is what the points miss, the kernels' summation orders, exp2, TF32), and "all_but:<point>"
every one of those but one: what removing that rounding from the fast path would buy.

Points (per layer unless noted; where a BF16 decode path rounds, the first run's fast path: docs/perf.md):
  qkv_in       the input norm's output, the qkv projection's input
  qk_proj      q and k as the qkv projection writes them (before their norms)
  q_attn       q after norm + RoPE, the QK^T dot's operand
  k_cache      k after norm + RoPE, as cached
  v_cache      v as projected and cached
  p_attn       the unnormalised softmax weights, the PV dot's operand
  attn_out     attention's output, o_proj's input
  o_out        o_proj's output (FP32 in the fast path since that run)
  moe_in       the post-attention norm's output (the router's and the experts' input)
  moe_out      the MoE block's output
  lm_in        the final norm's output, the lm_head's input (once per token)

Prints a table, writes accuracy_attribution.json and .png under --out, ends with one JSON line. On a CPU
(`--device cpu --preset tiny`, Triton's interpreter) it runs at toy sizes so that a test keeps it working.
"""

import argparse
import contextlib
import json
import os
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F

from composer_rollout.engine import RolloutEngine, SamplingParams
from composer_rollout.model import Qwen3MoE, layers, preset
from jobs.bench_decode import fp32_twin

POINTS = ("qkv_in", "qk_proj", "q_attn", "k_cache", "v_cache", "p_attn", "attn_out", "o_out", "moe_in", "moe_out",
          "lm_in")
FAST_POINTS = tuple(p for p in POINTS if p != "o_out")


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(t.dtype)


def _round_out(module, args, out):
    return _bf16(out)


def _round_in(module, args):
    return (_bf16(args[0]), *args[1:])


def _sdpa_p_bf16(q, k, v, attn_mask=None, enable_gqa=False, **_):
    """Math attention whose unnormalised softmax weights (exp(s - max), at most 1) are rounded to BF16 before the
    PV product, and whose normaliser sums the unrounded ones: the decode kernel's online softmax, one block."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~attn_mask, float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))
    return (_bf16(p) @ v) / p.sum(-1, keepdim=True)


@contextlib.contextmanager
def rounded(ref: Qwen3MoE, points: set[str]):
    """`ref` (an FP32 model on the torch dense path) with the fast path's BF16 roundings at `points`."""
    unknown = points - set(POINTS)
    if unknown:
        raise ValueError(f"rounding points {sorted(unknown)} are unknown; choose from {POINTS}")
    handles = []

    def hook(module, kind):
        handles.append(module.register_forward_hook(_round_out) if kind == "out"
                       else module.register_forward_pre_hook(_round_in))

    for layer in ref.layers:
        attn = layer.self_attn
        table = {"qkv_in": [(layer.input_layernorm, "out")], "qk_proj": [(attn.q_proj, "out"), (attn.k_proj, "out")],
                 "v_cache": [(attn.v_proj, "out")], "attn_out": [(attn.o_proj, "in")], "o_out": [(attn.o_proj, "out")],
                 "moe_in": [(layer.post_attention_layernorm, "out")], "moe_out": [(layer.mlp, "out")]}
        for point in points & set(table):
            for module, kind in table[point]:
                hook(module, kind)
    if "lm_in" in points:
        hook(ref.norm, "out")
    heads, kv_heads = ref.args.num_attention_heads, ref.args.num_key_value_heads
    rope = layers.apply_rope

    def rope_rounded(x, positions, inv_freq):
        y = rope(x, positions, inv_freq)
        # Attention.forward rotates q (num_attention_heads heads) then k (num_key_value_heads heads).
        which = "q_attn" if x.shape[2] == heads else "k_cache"
        return _bf16(y) if which in points else y

    with contextlib.ExitStack() as stack:
        if heads == kv_heads and ({"q_attn", "k_cache"} & points):
            raise ValueError("q_attn and k_cache need num_attention_heads != num_key_value_heads to tell q from k")
        stack.enter_context(mock.patch.object(layers, "apply_rope", rope_rounded))
        if "p_attn" in points:
            stack.enter_context(mock.patch.object(F, "scaled_dot_product_attention", _sdpa_p_bf16))
        try:
            yield ref
        finally:
            for h in handles:
                h.remove()


def forced_logprobs(ref: Qwen3MoE, prompts: list[list[int]], completions: list[list[int]]) -> torch.Tensor:
    """Teacher-forced FP32 logprobs [B, N] of each completion's tokens under `ref`, all sequences in one forward
    (same lengths: no eos in these runs)."""
    seqs = [p + c for p, c in zip(prompts, completions, strict=True)]
    if len({len(s) for s in seqs}) != 1:
        raise ValueError("forced_logprobs needs sequences of one length (prompts and completions without eos)")
    dev, B, n = ref.device, len(seqs), len(completions[0])
    ids = torch.tensor(seqs, device=dev)
    with torch.inference_mode():
        cache = ref.new_kv_cache(B, ids.shape[1])
        pos = torch.arange(ids.shape[1] - 1, device=dev)[None].expand(B, -1)
        hidden = ref(ids[:, :-1], pos, torch.arange(B, device=dev), cache)[:, -n:]
        lp = torch.log_softmax(ref.compute_logits(hidden), dim=-1)
        return lp.gather(2, ids[:, -n:, None])[..., 0]


def _stats(delta: torch.Tensor) -> dict:
    d = delta.abs().flatten().double().cpu().numpy()
    return dict(mean=float(d.mean()), p50=float(np.percentile(d, 50)), p99=float(np.percentile(d, 99)))


def attribute(model: Qwen3MoE, prompts: int, prompt_len: int, tokens: int, seed: int, leave_one_out: bool):
    a = model.args
    rng = np.random.default_rng(seed)
    ps = [rng.integers(0, a.vocab_size, prompt_len).tolist() for _ in range(prompts)]
    engine = RolloutEngine(model, max_num_seqs=prompts, max_model_len=prompt_len + tokens + 1, cuda_graphs=None)
    results = engine.generate(ps, SamplingParams(temperature=0.0, max_tokens=tokens))
    del engine
    completions = [r.token_ids for r in results]
    ref = fp32_twin(model)
    clean = forced_logprobs(ref, ps, completions)
    rows = [dict(variant="fast", **_stats(torch.tensor([r.logprobs for r in results], device=clean.device) - clean))]
    variants = [(p, {p}) for p in POINTS] + [("all", set(FAST_POINTS))]
    if leave_one_out:
        variants += [(f"all_but:{p}", set(FAST_POINTS) - {p}) for p in FAST_POINTS]
    for name, points in variants:
        with rounded(ref, points):
            rows.append(dict(variant=name, **_stats(forced_logprobs(ref, ps, completions) - clean)))
        print(f"{name:<20} mean {rows[-1]['mean']:.5f}  p50 {rows[-1]['p50']:.5f}  p99 {rows[-1]['p99']:.5f}",
              flush=True)
    return rows


def plot(rows, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 0.3 * len(rows) + 1.5))
    ax.barh([r["variant"] for r in rows], [r["mean"] for r in rows])
    ax.axvline(0.01, color="r", ls=":")
    ax.invert_yaxis()
    ax.set(title="mean |dlogprob| against the FP32 twin, by emulated BF16 rounding", xlabel="mean |dlogprob|")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "accuracy_attribution.png"), dpi=110)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--preset", default="qwen3_30b_a3b")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--leave-one-out", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model = Qwen3MoE(preset(args.preset, eos_token_id=()), device=args.device, weight_dtype="mxfp8", kernel="auto",
                     dense="triton").init_random(args.seed)
    rows = attribute(model, args.prompts, args.prompt_len, args.tokens, args.seed, args.leave_one_out)
    plot(rows, args.out)
    summary = dict(bench="accuracy_attribution", prompts=args.prompts, tokens=args.tokens,
                   mean_abs_dlogprob={r["variant"]: round(r["mean"], 6) for r in rows})
    with open(os.path.join(args.out, "accuracy_attribution.json"), "w") as f:
        json.dump(dict(summary, rows=rows), f)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
