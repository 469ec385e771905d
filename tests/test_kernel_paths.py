"""The model on each Triton kernel path against the torch path: same weights, same prompts.

On CPU the kernels run in Triton's interpreter, so the model is the tiny preset and generations short.
"""

import pytest
import torch

from composer_rollout import RolloutEngine, SamplingParams
from composer_rollout.model import Qwen3MoE, preset


def engine(kernel: str, weight_dtype: str, dtype=torch.bfloat16) -> RolloutEngine:
    args = preset("tiny", num_hidden_layers=1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = Qwen3MoE(args, dtype=dtype, device=device, weight_dtype=weight_dtype, kernel=kernel)
    model.init_random(seed=5, std=0.08)
    return RolloutEngine(model, max_num_seqs=4, max_model_len=64)


@pytest.mark.gpu
@pytest.mark.parametrize("weight_dtype", ["bf16", "mxfp8"])
def test_warp_decode_path_on_gpu(weight_dtype):
    prompts = torch.randint(2, 512, (3, 9), generator=torch.Generator().manual_seed(9)).tolist()
    ref, fast = engine("torch", weight_dtype), engine("warp_decode", weight_dtype)
    results = fast.generate(prompts, SamplingParams(temperature=0.9, max_tokens=8, n=2, seed=4))
    rows = [prompts[r.prompt_index] for r in results]
    got = torch.tensor(ref.score(rows, [r.token_ids for r in results], temperature=0.9))
    assert (got - torch.tensor([r.logprobs for r in results])).abs().max() < 0.05


def test_warp_decode_path_matches_torch_path():
    # Interpreted kernels cost milliseconds per program: one short prompt, two samples, two tokens each.
    # BF16 weights are covered by the kernel's own tests; here MXFP8 exercises the model's layout end to end.
    prompts = torch.randint(2, 512, (1, 4), generator=torch.Generator().manual_seed(9)).tolist()
    ref, fast = engine("torch", "mxfp8"), engine("warp_decode", "mxfp8")
    results = fast.generate(prompts, SamplingParams(temperature=0.9, max_tokens=2, n=2, seed=4))
    assert len(results) == 2 and all(r.num_completion_tokens == 2 for r in results)
    # Teacher-forced on the same tokens, the two paths' logprobs differ by BF16 rounding only.
    completions = [r.token_ids for r in results]
    prompt_rows = [prompts[r.prompt_index] for r in results]
    got = torch.tensor(fast.score(prompt_rows, completions, temperature=0.9))
    want = torch.tensor(ref.score(prompt_rows, completions, temperature=0.9))
    assert torch.allclose(got, torch.tensor([r.logprobs for r in results]), atol=1e-5)
    assert (got - want).abs().max() < 0.05, (got - want).abs().max()


def test_warp_decode_path_refuses_fp32_instead_of_falling_back():
    with pytest.raises(TypeError, match="hidden must be a bfloat16"):
        engine("warp_decode", "bf16", dtype=torch.float32).generate([[3, 4, 5]], SamplingParams(max_tokens=1))


@pytest.mark.parametrize("kernel", ["expert_centric", "auto"])
def test_expert_centric_and_auto_paths_match_torch_path(kernel):
    # MXFP8 experts, one prompt of 5 tokens, two samples of two tokens: the prefill (T = 5) runs expert-centric on
    # both paths; the decode step (T = 2) runs warp decode on `auto` (no tuned table on CPU: crossover 2).
    prompts = torch.randint(2, 512, (1, 5), generator=torch.Generator().manual_seed(11)).tolist()
    ref, fast = engine("torch", "mxfp8"), engine(kernel, "mxfp8")
    results = fast.generate(prompts, SamplingParams(temperature=0.9, max_tokens=2, n=2, seed=4))
    assert len(results) == 2 and all(r.num_completion_tokens == 2 for r in results)
    rows, completions = [prompts[r.prompt_index] for r in results], [r.token_ids for r in results]
    got = torch.tensor([r.logprobs for r in results])
    want = torch.tensor(ref.score(rows, completions, temperature=0.9))
    assert (got - want).abs().max() < 0.05, (got - want).abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["expert_centric", "auto"])
def test_expert_centric_and_auto_paths_on_gpu(kernel):
    prompts = torch.randint(2, 512, (3, 9), generator=torch.Generator().manual_seed(9)).tolist()
    ref, fast = engine("torch", "mxfp8"), engine(kernel, "mxfp8")
    results = fast.generate(prompts, SamplingParams(temperature=0.9, max_tokens=8, n=2, seed=4))
    rows = [prompts[r.prompt_index] for r in results]
    got = torch.tensor(ref.score(rows, [r.token_ids for r in results], temperature=0.9))
    assert (got - torch.tensor([r.logprobs for r in results])).abs().max() < 0.05


def test_unknown_path_says_so():
    with pytest.raises(ValueError, match="bogus"):
        engine("bogus", "bf16")
