"""``torch.topk(z, k)`` / ``z.topk(k)`` of the logits, of their ``log_softmax`` or of their
``softmax`` over the vocabulary (the largest ``k``): the student's top-k in top-k distillation, a
teacher's top-k export, top-k accuracy (issue 25, item 2).

A ``topk`` head: ``topk.linear_topk``'s op (``inductor_xent::linear_topk``: row chunks, each chunk's
logits and ``torch.topk`` over them, never the ``[N, V]`` logits) gives the values and indices; a
softmax's values are the exponentials of the log-probs'. Its users must read the result's two items
(``values, indices = torch.topk(...)``, ``.values``, ``[0]``); ``sorted=False`` is served sorted
(any order is allowed). Declined, with the reason: the smallest k (``largest=False``), a k that is not
a Python int when compiling, the result read whole. A top-k over fewer than ``MIN_VOCAB`` columns (a
mixture-of-experts router's) is no candidate.

The kept-set log-probs of top-k sampling replayed (``u.masked_fill(u < torch.topk(u, k).values[...,
-1:], -inf).log_softmax(-1).gather(-1, y[..., None])``, issue 25 item 3) are a ``kept`` head: the
top-k op and ``topk.kept_from_top`` on its values (eager keeps every column tied with the k-th, the
op the k that torch.topk returns).
"""

from __future__ import annotations

import operator
from dataclasses import replace

import torch
from torch.fx import Node

from ._fx import arg, hint, is_call, norm_dim, tval
from ._logits import is_matmul
from ._site import Decline, Head, log_probs_of, probs_of
from ._steps import MATCHERS

PATTERN = "topk"
TARGETS = (torch.topk, "topk")
LT = (operator.lt, torch.lt, "lt")
GT = (operator.gt, torch.gt, "gt")
MASKED_FILL = (torch.masked_fill, "masked_fill")
# fewer columns than this are no vocabulary: a mixture-of-experts router's top-k over its experts
# (Mixtral's 8, DeepSeek-V3's 256, Qwen3-Next's 512: softmax(gate(h)).topk(k)) or a classifier's,
# left alone (not a candidate: nothing to report)
MIN_VOCAB = 1024


def match(node: Node):
    src, k, dim = arg(node, 0, "input"), arg(node, 1, "k"), arg(node, 2, "dim", -1)
    largest, t = arg(node, 3, "largest", True), tval(src)
    if t is None or t.dim() < 2 or not isinstance(dim, int) or norm_dim(dim, t.dim()) != t.dim() - 1:
        return None  # over another dimension: no per-row top-k of the vocabulary
    if (hint(t.shape[-1]) or 0) < MIN_VOCAB:
        return None  # a router's experts, not a vocabulary
    of, logits, consumed, lse = "logits", src, (), ()
    lp, p = log_probs_of(src), probs_of(src)
    if lp is not None and lp.dim == t.dim() - 1:
        of, logits, consumed, lse = "log_probs", lp.logits, lp.nodes, lp.lse
    elif p is not None and p.dim == t.dim() - 1:
        of, logits, consumed, lse = "probs", p.logits, p.nodes, p.lse
    elif not (is_matmul(src) or is_call(src, tuple(MATCHERS))):
        return None  # of something computed from the logits (per-token values): not the vocabulary's top-k
    if largest is not True:
        return Decline(PATTERN, node, "torch.topk(..., largest=False) (the smallest k) is not fused", logits=logits,
                       kind="topk")
    if node.kwargs.get("out") is not None:
        return Decline(PATTERN, node, "torch.topk(..., out=...) writes into the caller's tensors", logits=logits,
                       kind="topk")
    if isinstance(k, bool) or not isinstance(k, int):
        return Decline(PATTERN, node, "a top-k whose k is not a Python int when compiling", logits=logits,
                       kind="topk")
    items = list(node.users)
    if not all(is_call(u, (operator.getitem,)) and arg(u, 1, "index") in (0, 1) for u in items):
        return Decline(PATTERN, node, "the top-k result is read whole (read its values and indices)", logits=logits,
                       kind="topk")
    if of == "logits":
        kept = _kept_set(node, src, items, k)
        if kept is not None:
            return kept
    return Head(PATTERN, node, logits, None, consumed, aux=tuple(items), kind="topk", needs_lse_of=lse, k=k,
                normalised=of)


def _only_user(node: Node):
    return next(iter(node.users)) if len(node.users) == 1 else None


def _kth(values: Node):
    """(the k-th value kept with a trailing 1, the nodes from ``values``) for ``values[..., -1:]``,
    ``values[..., -1, None]``, ``values[:, -1:]`` (the leading dims as full slices) or
    ``values[..., -1].unsqueeze(-1)``."""
    n = _only_user(values)
    if n is None or not is_call(n, (operator.getitem,)):
        return None
    idx = arg(n, 1, "index")
    idx = idx if isinstance(idx, tuple) else (idx,)
    lead = tval(values).dim() - 1
    if idx[:1] == (Ellipsis,):
        rest = idx[1:]
    elif len(idx) > lead and all(x == slice(None) for x in idx[:lead]):
        rest = idx[lead:]
    else:
        return None
    if rest in ((slice(-1, None, None),), (-1, None)):
        return n, (n,)
    if rest == (-1,):  # values[..., -1] then unsqueeze(-1)
        u = _only_user(n)
        if u is not None and is_call(u, ("unsqueeze", torch.unsqueeze)) and arg(u, 1, "dim") in (-1, lead):
            return u, (n, u)
    return None


def _kept_set(node: Node, u: Node, items: list, k: int):
    """The kept-set log-probs of top-k sampling replayed, as trainers spell it::

        kth = torch.topk(u, k).values[..., -1:]
        logp = u.masked_fill(u < kth, float("-inf")).log_softmax(-1).gather(-1, y[..., None])

    (also ``kth > u``, ``torch.where(u < kth, -inf, u)``): a ``kept`` head (the top-k op and
    ``topk.kept_from_top``), or None for any other use of the top-k."""
    from . import log_softmax_nll

    if len(items) != 1 or arg(items[0], 1, "index") != 0:
        return None
    found = _kth(items[0])
    cond = _only_user(found[0]) if found else None
    if cond is None or not ((is_call(cond, LT) and cond.args[:2] == (u, found[0]))
                            or (is_call(cond, GT) and cond.args[:2] == (found[0], u))):
        return None
    masked = _only_user(cond)
    inf = float("-inf")
    if masked is None or not ((is_call(masked, MASKED_FILL) and masked.args[:3] == (u, cond, inf))
                              or (is_call(masked, (torch.where,)) and masked.args[:3] == (cond, inf, u))):
        return None
    ls = _only_user(masked)
    gather = _only_user(ls) if ls is not None else None
    head = log_softmax_nll.match(gather) if gather is not None and is_call(gather, log_softmax_nll.TARGETS) else None
    if not isinstance(head, Head) or head.kind != "log_probs" or head.logits is not masked:
        return None
    return replace(head, pattern=PATTERN, logits=u, kind="kept", k=k, normalised="logits",
                   consumed=(node, *items, *found[1], cond, masked, *head.consumed))
