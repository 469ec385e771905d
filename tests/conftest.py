"""Test set-up: Triton runs in its interpreter where there is no GPU.

TRITON_INTERPRET must be set before any kernel module is imported (triton.jit reads it when a
kernel is defined), so it is set here, at collection time, and never in library code.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
