"""The ``inductor_xent`` operators in ``torch.library``; op names live here and nowhere else.

* ``inductor_xent::linear_ce_fwd(hidden, weight, bias, target, <options>) -> (loss, lse)``: per-row
  loss (0 on ignored rows) and per-row logsumexp, both (N,), float32 (float64 for float64 inputs).
* ``inductor_xent::linear_ce_bwd(grad_loss, grad_lse, hidden, weight, bias, target, lse, <options>,
  needs_hidden, needs_weight, needs_bias) -> (grad_hidden, grad_weight, grad_bias)``: always three
  tensors; one that is not needed is empty, shape (0,).

The forward's autograd formula calls the backward op, so under ``torch.compile`` AOTAutograd sees
two opaque nodes and the partitioner saves ``hidden, weight, bias, target, lse``: never the logits.
Both ops are plain ``custom_op``s: Inductor calls them as fallback kernels, which launch our Triton
kernels on CUDA. No op synchronises with the host (the mean's denominator is the caller's).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from . import config, fallback
from .options import KERNEL_DTYPES, LossOptions
from .reference import compute_dtype


def use_triton(hidden: Tensor) -> bool:
    """Which implementation runs for these inputs (see ``config.impl``)."""
    mode = config.impl()
    if mode == "reference" or hidden.dtype not in KERNEL_DTYPES:
        return False
    if mode == "triton":
        return True
    return hidden.device.type == "cuda" and _triton_kernels() is not None


@functools.cache
def _triton_kernels():
    """The launcher module, or None when Triton cannot be imported here."""
    try:
        from .templates import launch
    except ImportError:
        return None
    return launch


def _kernels(hidden: Tensor):
    launch = _triton_kernels()
    if launch is None:
        raise RuntimeError(
            "INDUCTOR_XENT_IMPL=triton, but the Triton kernels cannot be imported here: install "
            "triton (and set TRITON_INTERPRET=1 for CPU tensors), or use INDUCTOR_XENT_IMPL=auto"
        )
    reason = launch.unsupported_reason(hidden)
    if reason:
        raise RuntimeError(f"the Triton kernels cannot run these inputs: {reason}")
    return launch


def _opts(ignore_index: int, label_smoothing: float, logit_scale: float, softcap: Optional[float], z_loss: float):
    return LossOptions(ignore_index, label_smoothing, logit_scale, softcap, z_loss)


# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------
@torch.library.custom_op("inductor_xent::linear_ce_fwd", mutates_args=())
def linear_ce_fwd(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    target: Tensor,
    ignore_index: int,
    label_smoothing: float,
    logit_scale: float,
    softcap: Optional[float],
    z_loss: float,
) -> tuple[Tensor, Tensor]:
    opts = _opts(ignore_index, label_smoothing, logit_scale, softcap, z_loss)
    if target.device.type == "cpu":
        fallback.check_targets(target, weight.shape[0], ignore_index)
    if use_triton(hidden):
        return _kernels(hidden).forward(hidden, weight, bias, target, opts)
    return fallback.forward(hidden, weight, bias, target, opts)


@linear_ce_fwd.register_fake
def _(hidden, weight, bias, target, ignore_index, label_smoothing, logit_scale, softcap, z_loss):
    cd = compute_dtype(hidden.dtype)
    n = hidden.shape[0]
    return hidden.new_empty((n,), dtype=cd), hidden.new_empty((n,), dtype=cd)


# ---------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------
@torch.library.custom_op("inductor_xent::linear_ce_bwd", mutates_args=())
def linear_ce_bwd(
    grad_loss: Tensor,
    grad_lse: Tensor,
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    target: Tensor,
    lse: Tensor,
    ignore_index: int,
    label_smoothing: float,
    logit_scale: float,
    softcap: Optional[float],
    z_loss: float,
    needs_hidden: bool,
    needs_weight: bool,
    needs_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    opts = _opts(ignore_index, label_smoothing, logit_scale, softcap, z_loss)
    needs = (needs_hidden, needs_weight, needs_bias and bias is not None)
    if use_triton(hidden):
        return _kernels(hidden).backward(grad_loss, grad_lse, hidden, weight, bias, target, lse, opts, needs)
    return fallback.backward(grad_loss, grad_lse, hidden, weight, bias, target, lse, opts, needs)


@linear_ce_bwd.register_fake
def _(grad_loss, grad_lse, hidden, weight, bias, target, lse, ignore_index, label_smoothing,
      logit_scale, softcap, z_loss, needs_hidden, needs_weight, needs_bias):
    grad_b_shape = weight.shape[:1] if needs_bias and bias is not None else (0,)
    return (
        hidden.new_empty(hidden.shape if needs_hidden else (0,)),
        weight.new_empty(weight.shape if needs_weight else (0,)),
        weight.new_empty(grad_b_shape, dtype=weight.dtype if bias is None else bias.dtype),
    )


# ---------------------------------------------------------------------------------------------
# autograd: the forward's derivative is our backward op
# ---------------------------------------------------------------------------------------------
def _setup_context(ctx, inputs, output):
    hidden, weight, bias, target, *options = inputs
    ctx.save_for_backward(hidden, weight, bias, target, output[1])
    ctx.options = options


def _backward(ctx, grad_loss, grad_lse):
    hidden, weight, bias, target, lse = ctx.saved_tensors
    if grad_loss is None:
        grad_loss = torch.zeros_like(lse)
    if grad_lse is None:
        grad_lse = torch.zeros_like(lse)
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    grad_h, grad_w, grad_b = linear_ce_bwd(
        grad_loss, grad_lse, hidden, weight, bias, target, lse, *ctx.options,
        need_h, need_w, need_b and bias is not None,
    )
    return (
        grad_h if need_h else None,
        grad_w if need_w else None,
        grad_b if need_b and bias is not None else None,
        None, None, None, None, None, None,
    )


linear_ce_fwd.register_autograd(_backward, setup_context=_setup_context)
