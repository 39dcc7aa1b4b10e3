"""The test oracle: the loss of DESIGN.md, the log-probabilities, entropy and argmax of
``linear_log_probs`` and the gathered columns of ``linear_gather``, written as plainly as possible.

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


def linear_log_probs(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
    ignore_index: int = -100,
) -> tuple[Tensor, Tensor, Tensor]:
    """(log_probs, entropy, argmax), each of ``target``'s shape, materialising everything.
    Differentiable in the first two; ignored rows give 0 in both (argmax is every row's)."""
    opts = LossOptions(ignore_index, 0.0, logit_scale, softcap, 0.0)
    h, t = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
    z = logits(h, weight, bias, opts) / temperature
    logp = torch.log_softmax(z, dim=-1)
    valid = t != ignore_index
    picked = logp.gather(-1, torch.where(valid, t, 0).unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    zero = torch.zeros_like(picked)
    return (torch.where(valid, picked, zero).reshape(target.shape),
            torch.where(valid, entropy, zero).reshape(target.shape),
            z.argmax(dim=-1).reshape(target.shape))


def linear_gather(
    hidden: Tensor,
    weight: Tensor,
    index: Tensor,
    *,
    bias: Optional[Tensor] = None,
    log_probs: bool = False,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
) -> Tensor:
    """``linear_gather``'s values ``[..., k]``: the logits (``log_probs``: the log-probabilities) of
    each row at the ids ``index[..., k]``, materialising everything. Differentiable."""
    opts = LossOptions(-100, 0.0, logit_scale, softcap, 0.0)
    z = logits(hidden.reshape(-1, hidden.shape[-1]), weight, bias, opts) / temperature
    values = (torch.log_softmax(z, dim=-1) if log_probs else z).gather(-1, index.reshape(-1, index.shape[-1]))
    return values.reshape(index.shape)
