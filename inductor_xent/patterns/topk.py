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
op the k that torch.topk returns). So are those of nucleus (top-p) sampling replayed, as HF's
``TopPLogitsWarper`` spells them (``_nucleus_set``), alone or after the top-k warper (HF's order): a
``kept`` head with ``top_p`` (and ``k``), the nucleus op (``inductor_xent::linear_nucleus_logprob``).
The warper's bound may be one p per row, ``1 - p[..., None]`` with ``p`` of the rows' shape or
broadcasting to it (``_per_row_p``: a rollout engine's per-request top_p): ``top_p_rows``.
"""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import Optional

import torch
from torch.fx import Node

from ._fx import arg, hint, is_call, norm_dim, tval
from ._logits import is_matmul
from ._site import Decline, Head, log_probs_of, probs_of
from ._steps import MATCHERS

PATTERN = "topk"
SORT = (torch.sort, "sort")
TARGETS = (torch.topk, "topk", *SORT)
LT = (operator.lt, torch.lt, "lt")
GT = (operator.gt, torch.gt, "gt")
LE = (operator.le, torch.le, "le")
MASKED_FILL = (torch.masked_fill, "masked_fill")
SOFTMAX = (torch.softmax, torch.nn.functional.softmax, "softmax")
CUMSUM = (torch.cumsum, "cumsum")
SCATTER = (torch.scatter, "scatter")
# fewer columns than this are no vocabulary: a mixture-of-experts router's top-k over its experts
# (Mixtral's 8, DeepSeek-V3's 256, Qwen3-Next's 512: softmax(gate(h)).topk(k)) or a classifier's,
# left alone (not a candidate: nothing to report)
MIN_VOCAB = 1024


def match(node: Node):
    if is_call(node, SORT):
        return _nucleus_set(node)
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
    consumed = (node, *items, *found[1], cond, masked)
    sort = next((w for w in masked.users if is_call(w, SORT)), None)
    if sort is not None:  # HF's top-k warper, then its top-p warper over what it kept: one nucleus op
        head = _nucleus_set(sort) if len(masked.users) == 2 else None
        return None if head is None else replace(head, logits=u, k=k, consumed=(*consumed, *head.consumed))
    ls = _only_user(masked)
    gather = _only_user(ls) if ls is not None else None
    head = log_softmax_nll.match(gather) if gather is not None and is_call(gather, log_softmax_nll.TARGETS) else None
    if not isinstance(head, Head) or head.kind != "log_probs" or head.logits is not masked:
        return None
    return replace(head, pattern=PATTERN, logits=u, kind="kept", k=k, normalised="logits",
                   consumed=(*consumed, *head.consumed))


def _nucleus_set(node: Node):
    """The kept-set log-probs of nucleus (top-p) sampling replayed, as HF's ``TopPLogitsWarper`` spells
    them (``min_tokens_to_keep=1``, the setitem optional)::

        sorted_logits, sorted_indices = torch.sort(u, descending=False)
        cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        sorted_indices_to_remove = cumulative_probs <= (1 - top_p)
        sorted_indices_to_remove[..., -1:] = 0
        indices_to_remove = sorted_indices_to_remove.scatter(1, sorted_indices, sorted_indices_to_remove)
        logp = u.masked_fill(indices_to_remove, -inf).log_softmax(-1).gather(-1, y[..., None])

    A column is removed where the mass at or below it is at most ``1 − top_p``, that is where the mass
    above it is at least ``top_p``: the nucleus op's rule (``topk._kept_sorted``), up to rounding at
    the boundary. A ``kept`` head with ``top_p`` (and no top-k), or None for any other use of a sort."""
    from . import log_softmax_nll

    u, t = arg(node, 0, "input"), tval(arg(node, 0, "input"))
    dim, descending = arg(node, 1, "dim", -1), arg(node, 2, "descending", False)
    if (t is None or t.dim() < 2 or (hint(t.shape[-1]) or 0) < MIN_VOCAB or not isinstance(dim, int)
            or norm_dim(dim, t.dim()) != t.dim() - 1 or descending is not False or node.kwargs.get("out") is not None):
        return None
    items = {arg(i, 1, "index"): i for i in node.users if is_call(i, (operator.getitem,))}
    if len(node.users) != 2 or set(items) != {0, 1}:
        return None
    sm = _only_user(items[0])
    cs = _only_user(sm) if sm is not None and is_call(sm, SOFTMAX) and _last(sm, 1, t) else None
    le = _only_user(cs) if cs is not None and is_call(cs, CUMSUM) and _last(cs, 1, t) else None
    if le is None or not is_call(le, LE) or le.args[0] is not cs:
        return None
    bound, p_rows = le.args[1], None
    if isinstance(bound, Node):  # one p per row: 1 - p[..., None] (or (1 - p).unsqueeze(-1)), p a float tensor
        p_rows = _per_row_p(bound, t)
        if p_rows is None:
            return None
        bound = 0.0
    if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not 0.0 <= bound < 1.0:
        return None
    kept_last = [w for w in le.users if is_call(w, (operator.setitem,))]
    scatter = [w for w in le.users if is_call(w, SCATTER)]
    if len(scatter) != 1 or len(kept_last) + 1 != len(le.users) or len(kept_last) > 1:
        return None
    if kept_last and not _keeps_last(kept_last[0], t.dim()):
        return None
    sc = scatter[0]
    if not (_last(sc, 1, t) and sc.args[2:4] == (items[1], le) and not sc.kwargs):
        return None
    if any(n.kwargs.get("out") is not None for n in (sm, cs, le)):  # a write into another tensor: not this spelling
        return None
    masked = _only_user(sc)
    inf = float("-inf")
    if masked is None or not is_call(masked, MASKED_FILL) or masked.args[:3] != (u, sc, inf):
        return None
    ls = _only_user(masked)
    gather = _only_user(ls) if ls is not None else None
    head = log_softmax_nll.match(gather) if gather is not None and is_call(gather, log_softmax_nll.TARGETS) else None
    if not isinstance(head, Head) or head.kind != "log_probs" or head.logits is not masked:
        return None
    if p_rows is not None and tval(head.target).dim() - tval(p_rows).dim() not in (0, 1):
        return None  # the rewrite expands p as the targets (the rows, maybe with the gather's trailing 1)
    return replace(head, pattern=PATTERN, logits=u, kind="kept", k=0, top_p=1.0 if p_rows is not None else 1.0 - bound,
                   top_p_rows=p_rows, normalised="logits",
                   consumed=(node, *items.values(), sm, cs, le, *kept_last, sc, masked, *head.consumed))


UNSQUEEZE = (torch.unsqueeze, "unsqueeze")


def _per_row_p(bound: Node, t) -> Optional[Node]:
    """``p`` for a comparison bound of ``1 - p[..., None]``, ``1 - p.unsqueeze(-1)`` or ``(1 - p)[..., None]``
    / ``.unsqueeze(-1)``: a float tensor that broadcasts to the rows' shape (``t``'s but the last
    dimension: one nucleus mass per row, as vLLM keeps top_p per request, or per sequence); else None.
    A comparison passes no gradient to ``p``: the op reads it detached."""
    def trailing(n):  # n[..., None] or n.unsqueeze(-1): the node under it
        if is_call(n, UNSQUEEZE) and norm_dim(arg(n, 1, "dim"), t.dim()) == t.dim() - 1:
            return arg(n, 0, "input")
        if is_call(n, (operator.getitem,)) and arg(n, 1, "index") in ((Ellipsis, None), (slice(None), None)):
            return n.args[0]
        return None

    def one_minus(n):  # 1 - n (operator.sub(1, n), torch.rsub(n, 1))
        if is_call(n, (operator.sub, torch.sub)) and len(n.args) == 2 and n.args[0] == 1 and not n.kwargs:
            return n.args[1]
        if is_call(n, (torch.rsub, "rsub")) and len(n.args) == 2 and n.args[1] == 1 and not n.kwargs:
            return n.args[0]
        return None

    inner = trailing(bound)
    p = one_minus(inner) if inner is not None else None
    if p is None:
        inner = one_minus(bound)
        p = trailing(inner) if isinstance(inner, Node) else None
    pv = tval(p) if isinstance(p, Node) else None
    if pv is None or not pv.is_floating_point() or pv.dim() != t.dim() - 1:
        return None
    try:
        rows = torch.broadcast_shapes(tuple(pv.shape), tuple(t.shape[:-1]))
    except RuntimeError:
        return None
    return p if tuple(rows) == tuple(t.shape[:-1]) else None


def _last(node: Node, at: int, t) -> bool:
    """``node``'s dim argument (position ``at``, or ``dim=``) is the last of ``t``'s."""
    dim = arg(node, at, "dim")
    return isinstance(dim, int) and norm_dim(dim, t.dim()) == t.dim() - 1


def _keeps_last(setitem: Node, ndim: int) -> bool:
    """``removed[..., -1:] = 0`` (or ``[:, -1:]``, ``= False``): the largest column always kept."""
    index, value = setitem.args[1], setitem.args[2]
    index = index if isinstance(index, tuple) else (index,)
    lead = index[1:] if index[:1] == (Ellipsis,) else index[ndim - 1:] if all(
        i == slice(None) for i in index[: ndim - 1]) else None
    return lead == (slice(-1, None, None),) and value in (0, False) and not isinstance(value, float)
