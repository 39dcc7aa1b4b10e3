"""The test oracle: the loss ``options.LossOptions`` defines, written as plainly as possible.

It materialises the whole ``[N, V]`` logits in float32 (float64 for float64 inputs) and is never
optimised: every fast path (``fallback.py``, the Triton kernels) is tested against it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .options import LossOptions, compute_dtype


def logits(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], opts: LossOptions) -> Tensor:
    """``z = softcap * tanh(linear(hidden, weight, bias) * logit_scale / softcap)`` in the compute dtype."""
    cd = compute_dtype(hidden.dtype)
    z = F.linear(hidden.to(cd), weight.to(cd), None if bias is None else bias.to(cd))
    z = z * opts.logit_scale
    if opts.softcap is not None:
        z = opts.softcap * torch.tanh(z / opts.softcap)
    return z


def loss_rows(
    hidden: Tensor,  # (N, D)
    weight: Tensor,  # (V, D)
    bias: Optional[Tensor],  # (V,)
    target: Tensor,  # (N,)
    opts: LossOptions,
) -> tuple[Tensor, Tensor]:
    """Per-row loss (0 on ignored rows) and the logsumexp of every row, both (N,)."""
    z = logits(hidden, weight, bias, opts)
    lse = torch.logsumexp(z, dim=-1)
    valid = target != opts.ignore_index
    z_target = z.gather(-1, torch.where(valid, target, 0).unsqueeze(-1)).squeeze(-1)
    eps = opts.label_smoothing
    loss = (1 - eps) * (lse - z_target) + eps * (lse - z.mean(dim=-1)) + opts.z_loss * lse**2
    return torch.where(valid, loss, torch.zeros_like(loss)), lse


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    bias: Optional[Tensor] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
    z_loss: float = 0.0,
) -> Tensor:
    """The public function's semantics, materialising everything. Differentiable."""
    opts = LossOptions(ignore_index, label_smoothing, logit_scale, softcap, z_loss)
    rows, _ = loss_rows(hidden.reshape(-1, hidden.shape[-1]), weight, bias, target.reshape(-1), opts)
    if reduction == "none":
        return rows.reshape(target.shape)
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / (target != ignore_index).sum()
