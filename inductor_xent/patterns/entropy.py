"""The entropy of the next-token distribution, ``H = −Σ p·log p`` over the vocabulary.

Mirrors the entropy bonus and logging of RL fine-tuning: verl's ``entropy_from_logits``
(``pd = F.softmax(logits, -1); torch.logsumexp(logits, -1) - torch.sum(pd * logits, -1)``), the
``-(p * logp).sum(-1)`` of TRL / OpenRLHF-style code with ``logp = F.log_softmax(logits, -1)`` and
``p = F.softmax(logits, -1)`` or ``logp.exp()``, and ``torch.distributions.Categorical(logits=
logits).entropy()`` (``-(clamp(logits - lse, min=finfo.min) * softmax(logits - lse)).sum(-1)``). An
``entropy`` head: the op's entropy replaces the sum (``Σ p·log p`` is ``−H``) or the difference.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
from torch.fx import Node

from ._fx import arg, is_call, norm_dim, tval
from ._site import SUB, Decline, Head, Normalised, log_probs_of, lse_of, probs_of

PATTERN = "entropy"
TARGETS = (torch.sum, "sum", *SUB)
MUL = (operator.mul, torch.mul, "mul")


def match(node: Node):
    return _lse_minus_expected(node) if is_call(node, SUB) else _sum_p_log_p(node)


def _sum_of_product(node: Node) -> Optional[tuple]:
    """(a, b, the product, dim, keepdim) when ``node`` is ``(a * b).sum(dim, keepdim)``."""
    if not is_call(node, (torch.sum, "sum")) or node.kwargs.get("dtype") is not None:
        return None
    src, dim, keep = arg(node, 0, "input"), arg(node, 1, "dim"), arg(node, 2, "keepdim", False)
    if not is_call(src, MUL) or len(src.args) != 2 or src.kwargs or dim is None or not isinstance(keep, bool):
        return None
    return (*src.args, src, dim, keep)


def _sum_p_log_p(node: Node):
    """``(p * log p).sum(-1)``, which is −H."""
    found = _sum_of_product(node)
    if found is None:
        return None
    a, b, product, dim, keep = found
    for x, y in ((a, b), (b, a)):
        lp, p = log_probs_of(x), probs_of(y)
        if lp is not None and p is not None and lp.logits is p.logits:
            return _head(node, (lp, p), (product,), dim, keep, negate=True)
        if p is not None and is_call(x, (torch.log, "log")) and arg(x, 0, "input") is y:
            return Decline(PATTERN, node, logits=p.logits, kind="entropy", reason=(
                "p * torch.log(p): torch.log of a softmax is not log_softmax (-inf, then NaN, where a probability "
                "underflows to 0); write F.log_softmax(logits, -1) for log p to fuse"))
    return None


def _lse_minus_expected(node: Node):
    """``logsumexp(z, -1) - (softmax(z, -1) * z).sum(-1)``, which is H."""
    if node.kwargs or len(node.args) != 2 or not isinstance(node.args[1], Node):
        return None
    lse, expected = node.args
    m, found = lse_of(lse), _sum_of_product(expected)
    if m is None or found is None or m[1] != found[4]:
        return None
    a, b, product, dim, keep = found
    for z, y in ((a, b), (b, a)):
        p = probs_of(y)
        if z is m[0] and p is not None and p.logits is z:
            return _head(node, (p, Normalised(z, tval(z).dim() - 1, (), (lse,))), (product, expected), dim, keep)
    return None


def _head(node: Node, parts: tuple, own: tuple, dim, keep: bool, negate: bool = False):
    z = parts[0].logits
    last = tval(z).dim() - 1
    for what, d in (*(("softmax / log_softmax", p.dim) for p in parts), ("sum", norm_dim(dim, last + 1))):
        if d != last:
            return Decline(PATTERN, node, f"{what} over dim {d}, not the vocabulary (last) dim", logits=z,
                           kind="entropy")
    return Head(PATTERN, node, z, None, (*(n for p in parts for n in p.nodes), *own), negate=negate,
                    needs_lse_of=tuple(n for p in parts for n in p.lse), kind="entropy", keepdim=keep)
