"""Inputs shared by the tests of the kernels that multiply a few BF16 rows by a BF16 weight (kernels/lm_head.py,
kernels/skinny_linear.py): outputs of standard deviation ~6 (max ~25), the scale of Qwen3's logits, never zero."""

import torch


def linear_data(rows: int, out_features: int, in_features: int, device, seed: int = 0):
    """(x [rows, in] ~ 3 N(0, 1), weight [out, in] ~ N(0, 1) * 2 / sqrt(in)), BF16 on `device`."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, in_features, generator=g) * 3).bfloat16()
    w = (torch.randn(out_features, in_features, generator=g) * (2 / in_features**0.5)).bfloat16()
    return x.to(device), w.to(device)
