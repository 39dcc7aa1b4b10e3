"""What an idiom hands to the driver: a loss site (or a reason to decline), plus the shared
recognisers the idioms use (class dimension, log_softmax)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.fx import Node

from ._fx import arg, is_call, norm_dim, tval

# ignore_index for spellings that have none (gather, one_hot): out of range of any class id and of
# int32, so no real target is ever ignored. Eager raises on such a target; we never see one.
NO_IGNORE = -(2**31)


@dataclass
class LossSite:
    """A loss over lm_head logits that the driver can replace by ``linear_ce_fwd``.

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
    pattern: str
    node: Node
    reason: str
    logits: Optional[Node] = None  # the logits the loss reads, when known (else node.args[0])


def vocab_last(node: Any, class_dim: int) -> Optional[tuple[Node, tuple]]:
    """The same logits with the vocabulary as the last dimension, when ``node``'s class dimension
    ``class_dim`` is last already (2-D) or comes from ``transpose(1, 2)`` of a 3-D tensor."""
    t = tval(node)
    if t is None or t.dim() < 2:
        return None
    cd = norm_dim(class_dim, t.dim())
    if cd == t.dim() - 1:
        return node, ()
    if t.dim() == 3 and cd == 1:
        dims = None
        if is_call(node, (torch.transpose, torch.swapaxes, torch.swapdims), ("transpose", "swapaxes", "swapdims")):
            dims = {norm_dim(d, 3) for d in (arg(node, 1, "dim0"), arg(node, 2, "dim1"))}
        elif is_call(node, (torch.permute,), ("permute",)):
            perm = node.args[1:] if len(node.args) > 2 else node.args[1]
            dims = {1, 2} if tuple(norm_dim(d, 3) for d in perm) == (0, 2, 1) else None
        if dims == {1, 2}:
            return node.args[0], (node,)
    return None


_LOG_SOFTMAX_FUNCS = (F.log_softmax, torch.log_softmax, torch._C._nn.log_softmax) if hasattr(
    torch._C._nn, "log_softmax") else (F.log_softmax, torch.log_softmax)


def log_softmax(node: Any) -> Optional[tuple[Node, int]]:
    """(input, normalised dim) when ``node`` is a log_softmax over an explicit dimension."""
    if not is_call(node, _LOG_SOFTMAX_FUNCS, ("log_softmax",)):
        return None
    src, dim = arg(node, 0, "input"), arg(node, 1, "dim")
    dtype = node.kwargs.get("dtype", node.args[3] if node.op == "call_function" and len(node.args) > 3 else None)
    t = tval(src)
    if t is None or dim is None or (dtype is not None and not dtype.is_floating_point):
        return None
    d = norm_dim(dim, t.dim())
    return None if d is None else (src, d)


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
