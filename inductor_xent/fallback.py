"""Chunked PyTorch implementation: CPU tensors, float64, and wherever the Triton kernels cannot run.

Forward and backward walk the rows in chunks and never hold more than one chunk of
``rows x V`` logits (plus its softmax and a tanh buffer when softcapping) at a time. The backward
recomputes each chunk's logits from ``hidden``, ``weight`` and the saved ``lse`` instead of storing
them: 8·N·D·V FLOPs in total instead of 6·N·D·V, in exchange for O(N + V·D) memory.

Gradient of the per-row loss w.r.t. the (capped) logits ``z`` of a row, with incoming gradients
``g`` (loss) and ``h`` (lse), ``p = softmax(z)``, ``ε`` = label_smoothing::

    dz = g·(p − (1 − ε)·onehot(t) − ε/V) + (2·z_loss·lse·g + h)·p

then times ``1 − tanh²`` for softcapping and ``logit_scale`` for the scale. Ignored rows have
``g = 0`` (their loss is the constant 0) but still pass ``h`` through.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import config
from .options import LossOptions
from .reference import compute_dtype


def chunk_rows(num_rows: int, vocab: int, dtype: torch.dtype) -> int:
    """Rows per chunk so that one chunk of logits fits in ``config.fallback_chunk_bytes``."""
    itemsize = torch.finfo(dtype).bits // 8
    return max(1, min(num_rows, config.fallback_chunk_bytes // max(1, vocab * itemsize)))


def _chunk_logits(h: Tensor, w: Tensor, b: Optional[Tensor], opts: LossOptions) -> tuple[Tensor, Optional[Tensor]]:
    """Logits of one row chunk in the compute dtype, and ``tanh(z_raw / softcap)`` when capped."""
    z = torch.mm(h, w.t()) if b is None else torch.addmm(b, h, w.t())
    if opts.logit_scale != 1.0:
        z.mul_(opts.logit_scale)
    if opts.softcap is None:
        return z, None
    tanh = torch.tanh(z.div_(opts.softcap))
    return torch.mul(tanh, opts.softcap, out=z), tanh


def _upcast(hidden: Tensor, weight: Tensor, bias: Optional[Tensor]):
    cd = compute_dtype(hidden.dtype)
    return cd, weight.to(cd), None if bias is None else bias.to(cd)


def forward(
    hidden: Tensor,  # (N, D)
    weight: Tensor,  # (V, D)
    bias: Optional[Tensor],  # (V,)
    target: Tensor,  # (N,)
    opts: LossOptions,
) -> tuple[Tensor, Tensor]:
    """Per-row loss and logsumexp, both (N,) in the compute dtype."""
    n, vocab = hidden.shape[0], weight.shape[0]
    cd, w, b = _upcast(hidden, weight, bias)
    loss = torch.empty(n, dtype=cd, device=hidden.device)
    lse = torch.empty(n, dtype=cd, device=hidden.device)
    eps = opts.label_smoothing
    step = chunk_rows(n, vocab, cd)
    for start in range(0, n, step):
        rows = slice(start, start + step)
        z, _ = _chunk_logits(hidden[rows].to(cd), w, b, opts)
        t = target[rows]
        valid = t != opts.ignore_index
        row_lse = torch.logsumexp(z, dim=-1)
        z_t = z.gather(1, torch.where(valid, t, 0).unsqueeze(1)).squeeze(1)
        row_loss = row_lse - (1 - eps) * z_t
        if eps != 0.0:
            row_loss -= eps * z.mean(dim=-1)
        if opts.z_loss != 0.0:
            row_loss += opts.z_loss * row_lse.square()
        loss[rows] = torch.where(valid, row_loss, 0.0)
        lse[rows] = row_lse
    return loss, lse


def backward(
    grad_loss: Tensor,  # (N,)
    grad_lse: Tensor,  # (N,)
    hidden: Tensor,  # (N, D)
    weight: Tensor,  # (V, D)
    bias: Optional[Tensor],  # (V,)
    target: Tensor,  # (N,)
    lse: Tensor,  # (N,)
    opts: LossOptions,
    needs: tuple[bool, bool, bool],
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients for (hidden, weight, bias); an empty tensor stands for each one not in ``needs``."""
    n, vocab = hidden.shape[0], weight.shape[0]
    cd, w, b = _upcast(hidden, weight, bias)
    need_h, need_w, need_b = needs
    grad_h = torch.empty((n, hidden.shape[1]) if need_h else (0,), dtype=hidden.dtype, device=hidden.device)
    grad_w = torch.zeros(weight.shape if need_w else (0,), dtype=cd, device=weight.device)
    grad_b = torch.zeros((vocab,) if need_b else (0,), dtype=cd, device=weight.device)
    eps = opts.label_smoothing
    valid = target != opts.ignore_index
    g = torch.where(valid, grad_loss.to(cd), 0.0)
    # The softmax's coefficient from the lse terms (z-loss and the lse output), kept apart from
    # g·(p − onehot): folding it into one factor g·(1 + 2·z_loss·lse) rounds the small z-loss term
    # against 1, and where p ≈ onehot (confident rows, V = 1) that rounding is the whole gradient.
    c = 2 * opts.z_loss * lse.to(cd) * g + grad_lse.to(cd)
    step = chunk_rows(n, vocab, cd)
    for start in range(0, n, step):
        rows = slice(start, start + step)
        h = hidden[rows].to(cd)
        z, tanh = _chunk_logits(h, w, b, opts)
        p = z.sub_(lse[rows].to(cd).unsqueeze(1)).exp_()  # softmax, in place of the logits
        d = p * g[rows].unsqueeze(1)
        d.scatter_add_(1, torch.where(valid[rows], target[rows], 0).unsqueeze(1), (-(1 - eps) * g[rows]).unsqueeze(1))
        if eps != 0.0:
            d.sub_((eps / vocab) * g[rows].unsqueeze(1))
        d.addcmul_(p, c[rows].unsqueeze(1))
        del p
        if tanh is not None:
            d.mul_(tanh.square_().neg_().add_(1))
        if opts.logit_scale != 1.0:
            d.mul_(opts.logit_scale)
        if need_h:
            grad_h[rows] = torch.mm(d, w)
        if need_w:
            grad_w.addmm_(d.t(), h)
        if need_b:
            grad_b += d.sum(dim=0)
    return grad_h, grad_w.to(weight.dtype), grad_b.to(weight.dtype if bias is None else bias.dtype)


def check_targets(target: Tensor, vocab: int, ignore_index: int) -> None:
    """Raise ``ValueError`` for a target outside ``[0, vocab)`` that is not ``ignore_index``.

    Reads the values, so it is only called on CPU tensors (on CUDA it would be a host sync)."""
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bool(bad.any()):
        values = torch.unique(target[bad])[:8].tolist()
        raise ValueError(
            f"target values {values} are outside [0, {vocab}) and are not ignore_index={ignore_index}"
        )
