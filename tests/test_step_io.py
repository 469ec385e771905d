"""The engine's host <-> device step buffers (composer_rollout/engine/step_io.py): a step's columns land in the views
its row count reads, unset columns and rows are zeros, a later step with fewer rows does not see the earlier one's
values, and a step past the buffers is refused."""

import pytest
import torch

from composer_rollout.engine.step_io import FLOAT_ROWS, INT_ROWS, HostReadout, StepInputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_columns_land_in_the_views_of_their_row_count():
    inputs = StepInputs(8, DEVICE)
    v = inputs.load(5, dict(ids=[7, 8, 9], seeds=[2**40 + 1] * 5, temperature=[0.5, 1.0], top_p=[1.0] * 5))
    assert set(v) == set(INT_ROWS) | set(FLOAT_ROWS)
    assert v["ids"].tolist() == [7, 8, 9, 0, 0] and v["seeds"].tolist() == [2**40 + 1] * 5
    assert v["temperature"].tolist() == [0.5, 1.0, 0.0, 0.0, 0.0] and v["top_k"].tolist() == [0] * 5
    assert v["ids"].dtype == torch.int64 and v["temperature"].dtype == torch.float32
    assert all(t.is_contiguous() and t.shape == (5,) for t in v.values())
    assert inputs.views(5)["ids"].data_ptr() == v["ids"].data_ptr()  # what a graph captured is where steps write
    fewer = inputs.load(2, dict(slots=[3, 4]))
    assert fewer["ids"].tolist() == [0, 0] and fewer["slots"].tolist() == [3, 4]
    with pytest.raises(ValueError, match="9 rows"):
        inputs.load(9, {})


def test_readout_returns_the_first_rows():
    tokens = torch.tensor([5, 6, 7], device=DEVICE)
    logprobs = torch.tensor([-0.5, -1.25, -2.0], device=DEVICE)
    readout = HostReadout(DEVICE)
    assert readout.read(tokens, logprobs, 2) == ([5, 6], [-0.5, -1.25])
    assert readout.read(tokens, logprobs, 3) == ([5, 6, 7], [-0.5, -1.25, -2.0])
