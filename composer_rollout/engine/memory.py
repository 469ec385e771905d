"""How many KV-cache slots an engine gets: on a GPU, what fits in a memory budget.

The whole KV cache is allocated at start-up ([layers, slots + 1, max_model_len, kv_heads, head_dim] for K and
for V, the extra slot being scratch), and every slot holds max_model_len tokens; a sequence that reaches the
limit ends with finish_reason "length". So once the engine has started, no request can run it out of memory:
the only question is how many slots to allocate, and it is answered here, before any work.

On CUDA the budget is `gpu_memory_fraction` of the device's total memory, minus the weights and an activation
reserve measured by running the largest forwards the engine will run (a prefill of max_prefill_tokens rows, packed
prompts of at most max_model_len - 1 tokens each, and a decode step of max_num_seqs rows with sampling) against a
one-slot cache. The engine gets max_num_seqs slots; when fewer fit it fails at start-up, naming the fields to change
and how many would fit. On CPU the cache is sized from max_num_seqs * max_model_len as before: host memory is not
ours to budget.

The arithmetic is a pure function of numbers (`plan_kv_slots`) so that it is tested without a GPU.
"""

import torch

from composer_rollout.engine.sampling import sample
from composer_rollout.model import ModelArgs, Packed

GiB = float(1 << 30)


def kv_bytes_per_token_per_layer(args: ModelArgs, dtype: torch.dtype) -> int:
    """K and V of one token in one layer."""
    return 2 * args.num_key_value_heads * args.head_dim * torch.empty((), dtype=dtype).element_size()


def plan_kv_slots(*, max_num_seqs: int, max_model_len: int, gpu_memory_fraction: float, total_bytes: int,
                  weights_bytes: int, reserve_bytes: int, bytes_per_token_per_layer: int, num_layers: int) -> int:
    """max_num_seqs, checked against the slots that fit: fraction * total - weights - reserve, over one slot's
    bytes (max_model_len tokens in every layer), less the scratch slot. Raises, naming the fields, when fewer fit:
    quietly serving fewer sequences than configured would be a silent fallback (and the job's prompt checks use
    the configured max_num_seqs)."""
    check_fraction(gpu_memory_fraction)
    slot_bytes = bytes_per_token_per_layer * num_layers * max_model_len
    budget = int(gpu_memory_fraction * total_bytes) - weights_bytes - reserve_bytes
    fits = max(budget, 0) // slot_bytes - 1
    if fits < 1:
        raise ValueError(
            f"the KV cache does not fit: engine.gpu_memory_fraction={gpu_memory_fraction} of {total_bytes / GiB:.2f} "
            f"GiB, less {weights_bytes / GiB:.2f} GiB of weights and a {reserve_bytes / GiB:.2f} GiB activation "
            f"reserve, leaves {budget / GiB:.2f} GiB; one slot of engine.max_model_len={max_model_len} tokens needs "
            f"{slot_bytes / GiB:.3f} GiB and two are needed (one sequence, one scratch). Lower engine.max_model_len "
            f"or raise engine.gpu_memory_fraction")
    if fits < max_num_seqs:
        raise ValueError(
            f"engine.max_num_seqs={max_num_seqs} KV slots of engine.max_model_len={max_model_len} tokens do not fit: "
            f"{budget / GiB:.2f} GiB is left after the weights and the activation reserve "
            f"(engine.gpu_memory_fraction={gpu_memory_fraction}), room for {fits}. Lower engine.max_num_seqs or "
            f"engine.max_model_len, or raise engine.gpu_memory_fraction")
    return max_num_seqs


def check_fraction(gpu_memory_fraction: float) -> None:
    if isinstance(gpu_memory_fraction, bool) or not (isinstance(gpu_memory_fraction, int | float)
                                                      and 0 < gpu_memory_fraction <= 1):
        raise ValueError(f"engine.gpu_memory_fraction={gpu_memory_fraction!r} must be in (0, 1]")


def largest_prefill(model, cache, max_prefill_tokens: int, max_model_len: int, max_num_seqs: int) -> torch.Tensor:
    """The engine's largest prefill forward into `cache`'s slot 0: max_prefill_tokens rows, packed as whole prompts go
    (max_model_len - 1 tokens at most each, every one the last chunk of a longest prompt, whose queries see the
    whole context; at most max_num_seqs of them, as each holds a slot); the final hidden state of each. A step's
    forward never has more rows, so its peak memory bounds any step's (whole prompts together can fill the budget
    where one prompt cannot)."""
    longest = min(max_prefill_tokens, max_model_len - 1)
    lengths = [longest] * (max_prefill_tokens // longest) + [max_prefill_tokens % longest] * bool(
        max_prefill_tokens % longest)
    lengths = lengths[:max_num_seqs]
    dev = model.device
    positions = torch.cat([torch.arange(max_model_len - 1 - n, max_model_len - 1, device=dev) for n in lengths])
    packed = Packed.of(lengths, [0] * len(lengths), dev)
    hidden = model(torch.zeros(1, sum(lengths), dtype=torch.long, device=dev), positions[None],
                   torch.zeros(len(lengths), dtype=torch.long, device=dev), cache, packed=packed)
    return hidden[0, torch.tensor(packed.starts[1:], device=dev) - 1]


@torch.inference_mode()
def measure_activation_reserve(model, max_num_seqs: int, max_model_len: int, max_prefill_tokens: int,
                               cuda_graphs: bool = False) -> int:
    """Peak bytes above the weights of the engine's largest forwards, on a one-slot cache (CUDA only). With CUDA
    graphs the decode step's activations stay allocated (the graphs' pool) while prefills run: the two peaks add."""
    dev = model.device
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    probe = model.new_kv_cache(1, max_model_len)
    model.compute_logits(largest_prefill(model, probe, max_prefill_tokens, max_model_len, max_num_seqs))
    torch.cuda.synchronize(dev)
    prefill_peak = torch.cuda.max_memory_allocated(dev) - base - probe.nbytes
    torch.cuda.reset_peak_memory_stats(dev)
    # Every decode row on the scratch slot: same shapes as a full batch, no live cache touched.
    rows = torch.full((max_num_seqs,), probe.scratch_slot, device=dev)
    zeros = torch.zeros(max_num_seqs, 1, dtype=torch.long, device=dev)
    logits = model.compute_logits(model(zeros, zeros, rows, probe)[:, 0])
    ones, none = torch.ones(max_num_seqs, device=dev), torch.zeros(max_num_seqs, dtype=torch.long, device=dev)
    sample(logits, ones, none, ones, none, none)
    torch.cuda.synchronize(dev)
    decode_peak = torch.cuda.max_memory_allocated(dev) - base - probe.nbytes
    reserve = prefill_peak + decode_peak if cuda_graphs else max(prefill_peak, decode_peak)
    del probe, logits
    torch.cuda.empty_cache()
    return max(reserve, 0)


def kv_slots(model, max_num_seqs: int, max_model_len: int, gpu_memory_fraction: float,
             max_prefill_tokens: int, cuda_graphs: bool = False) -> int:
    """max_num_seqs, checked against the memory budget on CUDA (plan_kv_slots raises when it does not fit); on
    the CPU, max_num_seqs as is."""
    check_fraction(gpu_memory_fraction)
    if model.device.type != "cuda":
        return max_num_seqs
    return plan_kv_slots(
        max_num_seqs=max_num_seqs, max_model_len=max_model_len, gpu_memory_fraction=gpu_memory_fraction,
        total_bytes=torch.cuda.mem_get_info(model.device)[1], weights_bytes=model.memory_bytes(),
        reserve_bytes=measure_activation_reserve(model, max_num_seqs, max_model_len, max_prefill_tokens,
                                                 cuda_graphs),
        bytes_per_token_per_layer=kv_bytes_per_token_per_layer(model.args, model.dtype),
        num_layers=model.args.num_hidden_layers)
