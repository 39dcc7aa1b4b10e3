"""The error measure of the zoo sweep and of the tests' tolerance rule (tests/helpers.py): the
relative error in float64, with NaN where the reference has NaN counting as exact."""

from __future__ import annotations

import torch


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ in float64 (absolute error when ref is all zeros)."""
    x, ref = x.detach().double(), ref.detach().double()
    if torch.isnan(ref).any() or torch.isnan(x).any():
        return 0.0 if torch.equal(torch.isnan(x), torch.isnan(ref)) and torch.allclose(
            x.nan_to_num(), ref.nan_to_num(), rtol=0, atol=0) else float("inf")
    num = (x - ref).norm().item()
    den = ref.norm().item()
    return num / den if den > 0 else num
