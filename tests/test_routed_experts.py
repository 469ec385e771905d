"""Routed-expert capture (SamplingParams.return_routed_experts) on the tiny preset: the captured ids against the
router recomputed independently from the hidden states each MoE block received (forward pre-hooks), on the torch
path in FP32 and the warp-decode path (Triton's interpreter on CPU); shapes and row alignment (prompt +
completion - 1, no padding for a sample that stops early); a group's samples share the prompt's routing;
None when not asked for, and asking changes no token; the JSONL record, pickling and the config field."""

import dataclasses
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

from composer_rollout.config import RolloutJobConfig
from composer_rollout.engine import RolloutEngine, SamplingParams
from composer_rollout.engine.engine import ROW_MULTIPLE
from composer_rollout.model import Qwen3MoE, preset
from composer_rollout.output import record
from composer_rollout.prompts import Prompt
from jobs.hydra_config import register, to_dataclass

ARGS = preset("tiny")
L, K = ARGS.num_hidden_layers, ARGS.num_experts_per_tok


class RouterInputs:
    """Every MoE block's input, per forward, via pre-hooks: the router recomputed from them needs no engine code."""

    def __init__(self, model: Qwen3MoE):
        self.model, self.inputs = model, [[] for _ in model.layers]
        self.handles = [layer.mlp.register_forward_pre_hook(self._hook(i)) for i, layer in enumerate(model.layers)]

    def _hook(self, i):
        def hook(module, args):
            self.inputs[i].append(args[0].reshape(-1, args[0].shape[-1]).clone())
        return hook

    def routing(self) -> np.ndarray:
        """[tokens over all recorded forwards, layers, k]: top-k of the router logits (softmax keeps the order)."""
        per_layer = [torch.topk(F.linear(torch.cat(xs), layer.mlp.gate.weight).float(), K, dim=-1).indices
                     for xs, layer in zip(self.inputs, self.model.layers, strict=True)]
        return torch.stack(per_layer, dim=1).numpy()

    def close(self):
        for h in self.handles:
            h.remove()


@pytest.fixture(scope="module")
def engine() -> RolloutEngine:
    return RolloutEngine.from_pretrained("tiny", device="cpu", dtype="float32", max_model_len=64, max_num_seqs=8)


def rows(result) -> int:
    return result.num_prompt_tokens + result.num_completion_tokens - 1


@pytest.mark.parametrize("kernel", ["torch", "warp_decode"])
def test_captured_ids_equal_the_router_on_the_same_hidden_states(kernel):
    # One slot, so every forward is this sample's alone and the hooks see its tokens in position order.
    # warp_decode needs BF16 activations; interpreted kernels are slow, so the sequence is short.
    dtype, wdtype = (torch.float32, "bf16") if kernel == "torch" else (torch.bfloat16, "mxfp8")
    model = Qwen3MoE(ARGS, dtype=dtype, device="cpu", weight_dtype=wdtype, kernel=kernel).init_random(3, std=0.08)
    # A prefill budget under ROW_MULTIPLE: the prompt's forward has no padding rows, which the hooks would see.
    eng = RolloutEngine(model, max_num_seqs=1, max_model_len=32, max_prefill_tokens=ROW_MULTIPLE - 1)
    spy = RouterInputs(model)
    try:
        [r] = eng.generate([[5, 9, 200, 41]], SamplingParams(temperature=0.9, max_tokens=3, seed=1,
                                                             return_routed_experts=True))
        want = spy.routing()
    finally:
        spy.close()
    assert r.routed_experts.shape == (rows(r), L, K) == want.shape
    assert r.routed_experts.dtype == np.uint8
    np.testing.assert_array_equal(r.routed_experts, want)


def test_group_shares_the_prompt_routing_and_each_sample_matches_teacher_forcing(engine):
    prompts = [[3, 14, 15, 92, 65], [2, 7, 18, 28, 100, 4, 9]]
    results = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=7,
                                                      return_routed_experts=True))
    assert len(results) == 6
    for r in results:
        assert r.routed_experts.shape == (rows(r), L, K)
        spy = RouterInputs(engine.model)
        try:  # score() feeds prompt + completion[:-1] in one forward: exactly the tokens that have rows
            engine.score([prompts[r.prompt_index]], [r.token_ids])
            want = spy.routing()
        finally:
            spy.close()
        np.testing.assert_array_equal(r.routed_experts, want)
    for p, group in enumerate((results[:3], results[3:])):
        n_prompt = len(prompts[p])
        for r in group[1:]:
            np.testing.assert_array_equal(r.routed_experts[:n_prompt], group[0].routed_experts[:n_prompt])
    assert len({r.routed_experts[len(prompts[0]):].tobytes() for r in results[:3]}) > 1  # the samples do differ


def test_early_stop_is_not_padded_and_unrequested_is_none(engine):
    prompt = [10, 20, 30, 40]
    base = SamplingParams(temperature=1.0, max_tokens=8, seed=11)
    [free] = engine.generate([prompt], base)
    stop = free.token_ids[1]
    # Both requests decode in the same steps; one stops at its second token and one runs on, without capture.
    # Same prompt index, so the same seeds: the samples are `free`'s, up to the stop.
    engine.add_request(prompt, dataclasses.replace(base, stop_token_ids=[stop], return_routed_experts=True),
                       request_id="early")
    engine.add_request(prompt, base, request_id="plain")
    done = {}
    while engine.has_unfinished():
        done.update((r.request_id, r) for r in engine.step())
    early, plain = done["early"], done["plain"]
    assert early.finish_reason == "stop" and early.num_completion_tokens == free.token_ids.index(stop) + 1
    assert early.routed_experts.shape == (rows(early), L, K)
    assert plain.routed_experts is None and plain.token_ids == free.token_ids  # capture changed no token
    assert free.routed_experts is None


def test_abort_before_prefill_gives_an_empty_array(engine):
    rid = engine.add_request([4, 5, 6], SamplingParams(max_tokens=4, n=2, return_routed_experts=True))
    out = engine.abort(rid)
    assert [r.routed_experts.shape for r in out] == [(0, L, K)] * 2


def test_record_pickle_and_config():
    r = RolloutEngine.from_pretrained("tiny", device="cpu", dtype="float32", max_model_len=32).generate(
        [[7, 8, 9]], SamplingParams(max_tokens=2, seed=0, return_routed_experts=True))[0]
    back = pickle.loads(pickle.dumps(r))
    np.testing.assert_array_equal(back.routed_experts, r.routed_experts)
    prompt = Prompt(0, "p0", [7, 8, 9], SamplingParams())
    rec = json.loads(json.dumps(record(prompt, r, worker_id=0)))
    assert rec["routed_experts"] == r.routed_experts.tolist() and len(rec["routed_experts"]) == rows(r)
    assert "routed_experts" not in record(prompt, dataclasses.replace(r, routed_experts=None), worker_id=0)
    register("rollout_schema", RolloutJobConfig)
    with initialize_config_dir(version_base=None, config_dir=str(Path(__file__).parents[1] / "conf")):
        on = to_dataclass(compose("rollout", overrides=["sampling.return_routed_experts=true"]))
        off = to_dataclass(compose("rollout"))
    assert on.sampling.return_routed_experts is True and off.sampling.return_routed_experts is False
    with pytest.raises(ValueError, match="return_routed_experts"):
        SamplingParams(return_routed_experts=1)
