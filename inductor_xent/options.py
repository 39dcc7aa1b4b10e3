"""The loss's scalar options, the dtypes it takes and how its per-row values reduce, shared by every
implementation."""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

# what the op accepts, and what the Triton kernels take (float64 always runs the chunked path)
FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
REDUCTIONS = ("mean", "sum", "none")


def reduced(total: Tensor, valid: Tensor, reduction: str) -> Tensor:
    """The ``mean`` or ``sum`` loss from ``total``, the sum of the per-row losses (ignored rows add 0;
    ``valid`` marks the others): ``mean`` divides it by the number of non-ignored rows (NaN when there
    are none, like PyTorch; the count stays on the device: no host sync), ``sum`` is ``total``."""
    return total / valid.sum() if reduction == "mean" else total


def reduction_weights(valid: Tensor, reduction: str, dtype: torch.dtype) -> Tensor:
    """d(``reduced`` loss) / d(row loss) of every row, in ``dtype``: 0 on ignored rows, on the others
    1 / (the number of non-ignored rows) for ``mean`` and 1 for ``sum``."""
    if reduction == "mean":
        return torch.where(valid, 1.0 / valid.sum().to(dtype), 0.0)
    return valid.to(dtype)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every lower precision accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class LossOptions(NamedTuple):
    """Per-row loss, for logits ``z`` (after bias, ``logit_scale`` and ``softcap``) and target ``t``::

        loss = (1 - label_smoothing) * (lse - z[t]) + label_smoothing * (lse - mean(z)) + z_loss * lse**2

    and 0 where ``t == ignore_index``. ``softcap=None`` means no softcapping.
    """

    ignore_index: int = -100
    label_smoothing: float = 0.0
    logit_scale: float = 1.0
    softcap: Optional[float] = None
    z_loss: float = 0.0


def check_head_dtypes(hidden: Tensor, weight: Tensor, bias: Optional[Tensor] = None, head: str = "") -> None:
    """A head's hidden states, weight and bias in one dtype (after ``torch.autocast``'s casts), as the
    ops' GEMMs take them: else a ``TypeError`` naming the operand that differs (and ``head``, the
    student's or the teacher's, where there are two)."""
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != hidden.dtype:
            whose = f"the {head}'s " if head else ""
            raise TypeError(f"{whose}{name}.dtype ({t.dtype}) must equal {'its ' if head else ''}hidden.dtype "
                            f"({hidden.dtype}); inside torch.autocast they are cast as for F.linear")


def finite(x) -> bool:
    """``math.isfinite(x)`` for a Python number that may be a SymFloat: under ``torch.compile(dynamic=True)``
    Dynamo makes a float default of a function it inlines an input, and ``math.isfinite`` of one is a
    call it cannot trace (fullgraph failed there); a comparison it can (a guard on that input)."""
    return abs(x) < math.inf


def check_temperature(temperature) -> float:
    """``temperature`` as a float: ``TypeError`` for anything but a Python number (a bool, a tensor, a
    string), ``ValueError`` for one that is not finite and > 0. Every functional API checks it here."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a number, got {type(temperature).__name__}")
    if not (finite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    return float(temperature)


def fold_temperature(logit_scale: float, softcap: Optional[float], temperature: float) -> tuple[float, Optional[float]]:
    """(logit_scale, softcap) whose logits are the given ones divided by ``temperature``.

    The temperature divides the final logits, after the softcap (``model(...).logits / T`` in RL
    code, where a Gemma-2 model has already capped them)::

        softcap·tanh(x·scale/softcap) / T  ==  (softcap/T)·tanh(x·(scale/T)/(softcap/T))

    so it scales both ``logit_scale`` and ``softcap`` and every kernel epilogue serves unchanged
    (the derivative ``(scale/T)·sech²`` comes out of the same chain rule)."""
    return logit_scale / temperature, None if softcap is None else softcap / temperature


def compiled_per_row(fn):
    """``fn`` compiled by Inductor with the rows of every tensor argument dynamic (they are all per
    row) from its first call: one graph for every chunk size. A static graph per chunk size would
    reach Dynamo's recompile limit within eight batch sizes (and fail under ``fullgraph``), and
    Dynamo's own switch to dynamic rows at the second size would give a process's first call other
    kernels, so other bits, than its later calls (seen on an H100: the nucleus op's first call kept
    other sets)."""
    compiled = torch.compile(fn, dynamic=False, fullgraph=True)

    def call(*args):
        for a in args:
            if isinstance(a, Tensor) and a.dim() and a.shape[0] > 1:  # 0 and 1 rows specialise anyway
                torch._dynamo.mark_dynamic(a, 0)
        return compiled(*args)
    return call
