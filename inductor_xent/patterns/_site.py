"""What an idiom hands to the driver: a loss site (or a reason to decline), plus the shared
recognisers the idioms and the plan use (class dimension, loss arguments, log_softmax, logsumexp)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.fx import Node

from ._fx import arg, is_call, norm_dim, number, permutation, tval

# ignore_index for spellings that have none (gather, one_hot): out of range of any class id and of
# int32, so no real target is ever ignored. Eager raises on such a target; we never see one.
NO_IGNORE = -(2**31)


@dataclass
class LossSite:
    """A loss over lm_head logits that the driver can replace by the fused op.

    The replacement of ``loss`` is: per-row loss ``rows`` (N,), reduced by ``reduction``
    (``mean``: ``rows.sum() / (target != ignore_index).sum()``); for ``none`` viewed as
    ``shape_ref`` (then ``squeeze(-1)`` when ``drop_last``); negated when ``negate`` (the idiom
    computes ``log p(target)`` rather than the loss).
    """

    pattern: str
    loss: Node
    logits: Node  # the [..., V] tensor the idiom reads, vocabulary last
    target: Node  # integer class ids; target.reshape(-1) has one per row of logits
    consumed: tuple = ()  # idiom nodes derived from the logits (erased once dead)
    aux: tuple = ()  # idiom nodes not derived from the logits (erased once dead)
    ignore_index: int = NO_IGNORE
    reduction: str = "none"
    label_smoothing: float = 0.0
    shape_ref: Optional[Node] = None
    drop_last: bool = False
    negate: bool = False
    needs_lse_of: tuple = ()  # logsumexp nodes the idiom relies on: each must map to the op's lse


@dataclass
class Decline:
    """Why a candidate is left alone (``pattern`` None from the walk back or the plan: the driver knows it)."""

    pattern: Optional[str]
    node: Node
    reason: str
    logits: Optional[Node] = None  # the logits the loss reads, when known (else its first argument)
    logits_escape: bool = False  # the logits are a graph output (explain says what to compile instead)
    logits_input: bool = False  # the logits are a graph input: a graph break before the loss


def vocab_last(node: Any, class_dim: int) -> Optional[tuple[Node, tuple]]:
    """The same logits with the vocabulary as the last dimension, when ``node``'s class dimension
    ``class_dim`` is last already (2-D) or comes from ``transpose(1, 2)`` of a 3-D tensor."""
    t = tval(node)
    if t is None or t.dim() < 2:
        return None
    cd = norm_dim(class_dim, t.dim())
    if cd == t.dim() - 1:
        return node, ()
    if t.dim() == 3 and cd == 1 and permutation(node) == (0, 2, 1):
        return arg(node, 0, "input"), (node,)
    return None


LOG_SOFTMAX = (F.log_softmax, torch.log_softmax, "log_softmax")


def log_softmax(node: Any) -> Optional[tuple[Node, int]]:
    """(input, normalised dim) when ``node`` is a log_softmax over an explicit dimension."""
    if not is_call(node, LOG_SOFTMAX):
        return None
    src, dim = arg(node, 0, "input"), arg(node, 1, "dim")
    # F.log_softmax(input, dim, _stacklevel, dtype); the method's dtype is read by keyword only
    dtype = arg(node, 3, "dtype") if node.op == "call_function" else node.kwargs.get("dtype")
    t = tval(src)
    if t is None or dim is None or (dtype is not None and not dtype.is_floating_point):
        return None
    d = norm_dim(dim, t.dim())
    return None if d is None else (src, d)


def loss_args_reason(a: dict) -> Optional[str]:
    """Why the arguments of ``F.cross_entropy`` / ``F.nll_loss`` (bound by name) are not fused, or None."""
    ii, eps = a["ignore_index"], number(a.get("label_smoothing", 0.0))
    if a["weight"] is not None:
        return "class weights (weight=...) are not supported"
    if a["size_average"] is not None or a["reduce"] is not None:
        return "legacy size_average/reduce arguments"
    reason = integer_target(a["target"])
    if reason:
        return reason
    if not isinstance(ii, int) or isinstance(ii, bool):
        return f"ignore_index {ii!r} is not a Python int"
    if eps is None or not 0.0 <= eps <= 1.0:
        return f"label_smoothing {a['label_smoothing']!r} is not a constant in [0, 1]"
    if a["reduction"] not in ("mean", "sum", "none"):
        return f"reduction {a['reduction']!r}"
    return None


def integer_target(node: Any) -> Optional[str]:
    """None when ``node`` holds int64 class ids, else a reason."""
    t = tval(node)
    if t is None:
        return "the target is not a tensor"
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return f"probability targets ({t.dtype}): only integer class ids are fused"
    if t.dtype != torch.int64:
        return f"target dtype {t.dtype} (int64 class ids only)"
    return None


def lse_of(node: Any) -> Optional[tuple[Node, bool]]:
    """(logits, keepdim) when ``node`` is ``logsumexp`` over the last dimension of ``logits``: the
    plan maps a z-loss (PaLM / T5X / OLMo ``1e-4 * torch.logsumexp(logits, -1).pow(2).mean()`` next to
    the cross-entropy; Chameleon) onto the op's lse output instead of keeping the logits alive."""
    if not is_call(node, (torch.logsumexp, "logsumexp")):
        return None
    z, dim, keep = arg(node, 0, "input"), arg(node, 1, "dim"), arg(node, 2, "keepdim", False)
    tz = tval(z)
    if tz is None or norm_dim(dim, tz.dim()) != tz.dim() - 1 or not isinstance(keep, bool):
        return None
    return z, keep
