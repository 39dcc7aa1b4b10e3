"""``-(F.one_hot(y, V) * F.log_softmax(z, -1)).sum(-1)``: cross-entropy written out by hand.

Mirrors course and tutorial code (d2l.ai's "cross-entropy from scratch", JAX/optax-style ports such
as ``-(jax.nn.one_hot(labels, V) * log_softmax(logits)).sum(-1)`` translated to torch). The sum is
the target's log-probability (a ``log_probs`` head); the negation and reduction the user wrote stay.
``num_classes`` must be the vocabulary size (``-1`` infers it from the data: declined).
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.nn.functional as F
from torch.fx import Node

from ._fx import arg, is_call, norm_dim, same, tval
from ._site import Decline, Head, integer_target, log_softmax
from ._steps import CAST_METHODS

PATTERN = "one_hot"
TARGETS = (torch.sum, "sum")


def _one_hot(node):
    """(class ids node, num_classes, nodes) when ``node`` is one_hot(y, n), maybe cast."""
    chain = []
    while is_call(node, CAST_METHODS):
        chain.append(node)
        node = arg(node, 0, "input")
    if is_call(node, (F.one_hot,)):
        return arg(node, 0, "tensor"), arg(node, 1, "num_classes", -1), (*chain, node)
    return None


def match(node: Node):
    if node.kwargs.get("dtype") is not None:
        return None
    src, dim, keep = arg(node, 0, "input"), arg(node, 1, "dim"), arg(node, 2, "keepdim", False)
    if not is_call(src, (operator.mul, torch.mul, "mul")) or len(src.args) != 2 or src.kwargs:
        return None
    for oh, lp in (src.args, src.args[::-1]):
        found, ls = _one_hot(oh), log_softmax(lp)
        if found is not None and ls is not None:
            break
    else:
        return None
    y, num_classes, oh_nodes = found
    tl = tval(lp)
    decline = functools.partial(Decline, PATTERN, node, logits=ls[0], kind="log_probs")
    if ls[1] != tl.dim() - 1 or norm_dim(dim, tl.dim()) != tl.dim() - 1 or keep:
        return decline("sum is not over the vocabulary dimension without keepdim")
    if not isinstance(num_classes, int) or not same(num_classes, tl.shape[-1]):
        reason = f"one_hot num_classes={num_classes!r} is not the vocabulary size"
        return decline(reason)
    reason = integer_target(y)
    if reason:
        return decline(reason)
    ty = tval(y)
    if ty.dim() != tl.dim() - 1 or not all(same(a, b) for a, b in zip(ty.shape, tl.shape[:-1])):
        # one_hot(y) * lp broadcasts: a row of lp may meet another row's target (or several)
        reason = f"the one-hot targets {tuple(ty.shape)} broadcast against the log-probs {tuple(tl.shape)}"
        return decline(reason)
    return Head(PATTERN, node, ls[0], y, (lp, src), oh_nodes, shape_ref=y, kind="log_probs")
