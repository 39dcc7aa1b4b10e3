"""``F.nll_loss(F.log_softmax(z, -1), y)`` and ``-log_softmax(z).gather(-1, y[..., None])``.

Mirrors older fairseq / torchtext training loops and the explicit two-step spelling in many
tutorials (``logp = F.log_softmax(logits, dim=-1); loss = F.nll_loss(logp.view(-1, V), y.view(-1))``),
and the "log-prob of the target" spelling of RL / DPO code (``torch.gather(F.log_softmax(logits / T,
-1), -1, labels.unsqueeze(-1)).squeeze(-1)``, e.g. TRL's ``selective_log_softmax`` for whole
batches, and ``torch.distributions.Categorical(logits=logits).log_prob(labels)``, whose log-probs
are ``logits − logsumexp(logits, -1, keepdim=True)``): a ``log_probs`` head, the user's own masking
and reduction stay. A gather of several columns per row (``ids[..., k]``, k > 1) of the log-probs,
the probabilities or the logits themselves is a ``gathered`` head (``_match_columns``): the student's
side of top-k distillation from a teacher's stored top-k.
"""

from __future__ import annotations

import functools
import inspect
import operator

import torch
import torch.nn.functional as F
from torch.fx import Node

from ._fx import arg, bind, hint, is_call, norm_dim, same, tval
from ._site import (
    SOFTMAX,
    Decline,
    Head,
    integer_target,
    log_probs_of,
    log_softmax,
    loss_args_reason,
    probs_of,
    unbroadcast,
    vocab_last,
)
from ._steps import CAST_METHODS, VIEWS, step_of

PATTERN = "log_softmax_nll"
TARGETS = (F.nll_loss, torch.gather, "gather")
_SIG = inspect.signature(F.nll_loss)


def _strip_views(node: Node) -> tuple[Node, tuple]:
    """Row views between log_softmax and the loss (``logp.view(-1, V)``), which commute with it."""
    views = []
    while is_call(node, VIEWS) and tval(node) is not None:
        step = step_of(node)  # the views the walk back from the logits folds
        if step is None:
            break
        views.append(node)
        node = step.src
    return node, tuple(views)


def _logits_of_log_probs(x: Node, class_dim: int):
    """(logits vocab-last, consumed nodes) when ``x`` is log_softmax of logits over the class dim."""
    found = vocab_last(x, class_dim)
    if found is not None:
        lp, consumed = found
        lp, views = _strip_views(lp)
        ls = log_softmax(lp)
        t = tval(lp)
        if ls is not None and ls[1] == t.dim() - 1:
            return ls[0], (*consumed, *views, lp)
    # log_softmax over dim 1 of transposed logits: F.nll_loss(F.log_softmax(z.transpose(1, 2), 1), y)
    ls = log_softmax(x)
    if ls is not None and ls[1] == norm_dim(class_dim, tval(x).dim()):
        found = vocab_last(ls[0], ls[1])
        if found is not None:
            return found[0], (*found[1], x)
    return None


def match(node: Node):
    if is_call(node, (F.nll_loss,)):
        return _match_nll(node)
    if is_call(node, (torch.gather, "gather")):
        return _match_gather(node)
    return None


def _match_nll(node: Node):
    a = bind(node, _SIG)
    if a is None:
        return Decline(PATTERN, node, "nll_loss arguments not understood")
    found = _logits_of_log_probs(a["input"], 1)
    if found is None:
        return None  # nll_loss of something else: not an lm_head site
    logits, consumed = found
    reason = loss_args_reason(a)
    if reason:
        return Decline(PATTERN, node, reason, logits=logits)
    return Head(PATTERN, node, logits, a["target"], consumed, (), a["ignore_index"], a["reduction"], 0.0,
                    shape_ref=a["target"])


def _match_gather(node: Node):
    lp, dim, index = arg(node, 0, "input"), arg(node, 1, "dim"), arg(node, 2, "index")
    ls = log_probs_of(lp)
    tl, ti = tval(lp), tval(index)
    if tl is None or ti is None or norm_dim(dim, tl.dim()) != tl.dim() - 1:
        return None
    if tl.dim() >= 2 and (ls is None or (ti.dim() == tl.dim() and not same(ti.shape[-1], 1))):
        return _match_columns(node, lp, index, ls)
    if ls is None or node.kwargs.get("sparse_grad"):
        return None
    decline = functools.partial(Decline, PATTERN, node, logits=ls.logits, kind="log_probs")
    if ls.dim != tl.dim() - 1:
        return decline(f"log_softmax over dim {ls.dim}, not the vocabulary (last) dim")
    if ti.dim() != tl.dim():
        return decline("gather index of another rank than the log-probs")
    if not all(same(a, b) for a, b in zip(ti.shape[:-1], tl.shape[:-1])):
        return decline("gather index does not cover the logits' rows one to one")
    reason = integer_target(index)
    if reason:
        return decline(reason)
    target, between = unbroadcast(index)
    return Head(PATTERN, node, ls.logits, target, ls.nodes, between, shape_ref=target, needs_lse_of=ls.lse,
                    kind="log_probs")


_SCALES = (operator.truediv, operator.mul, torch.div, torch.mul, "div", "mul", *CAST_METHODS)


def _renormalised(node: Node, depth: int = 4) -> bool:
    """Whether the gathered logits are normalised over their k columns after (``F.log_softmax(s / T,
    -1)`` or a softmax, through scales by numbers, casts and views that keep the k columns last): the
    student renormalised over a
    teacher's top-k ids, what makes a gather of k logits a distribution's."""
    for user in node.users:
        found = log_softmax(user) or log_softmax(user, SOFTMAX)
        if found is not None and found[0] is node and norm_dim(found[1], tval(node).dim()) == tval(node).dim() - 1:
            return True
        scaled = is_call(user, _SCALES) and user.args and user.args[0] is node \
            and all(not isinstance(a, Node) for a in user.args[1:])
        # (a view that keeps the k columns last: DistillKit's gather of flattened rows, viewed back)
        kept = is_call(user, VIEWS) and tval(user) is not None and same(tval(user).shape[-1], tval(node).shape[-1])
        if depth > 1 and (scaled or kept) and _renormalised(user, depth - 1):
            return True
    return False


def _match_columns(node: Node, src: Node, index: Node, ls):
    """A gather of several columns of each row (``index[..., k]``, k > 1) of the log-probs (``ls``),
    the probabilities or the logits themselves: the student's side of top-k distillation from stored
    teacher ids (``F.log_softmax(s / T, -1).gather(-1, ids)``; the logits gathered, then normalised
    over the k: ``F.log_softmax(s.gather(-1, ids) / T, -1)``): a ``gathered`` head (gathered.py's
    op), or None where ``src`` is none of these (a gather of a per-token value, of a router's few
    columns, of logits not normalised over the k after)."""
    from ._logits import is_matmul, trace
    from ._steps import MATCHERS
    from .topk import MIN_VOCAB

    tl, ti = tval(src), tval(index)
    of, logits, consumed, lse = "logits", src, (), ()
    p = probs_of(src)
    if ls is not None:
        of, logits, consumed, lse = "log_probs", ls.logits, ls.nodes, ls.lse
    elif p is not None:
        of, logits, consumed, lse = "probs", p.logits, p.nodes, p.lse
    elif not (is_matmul(src) or is_call(src, tuple(MATCHERS))) or isinstance(trace(src), Decline) \
            or not _renormalised(node):
        # a gather of something computed from the logits (per-token values), of no lm_head's, or of a
        # matmul's columns not normalised after (a relative-position bias table's, Inkling's)
        return None
    if (hint(tl.shape[-1]) or 0) < MIN_VOCAB or ti.dim() != tl.dim() or (hint(ti.shape[-1]) or 0) < 2:
        return None  # a router's few columns; one column per row is a target's (the heads above); no column
    decline = functools.partial(Decline, PATTERN, node, logits=logits, kind="gathered")
    if (ls or p) is not None and (ls or p).dim != tl.dim() - 1:
        return decline(f"a {of.replace('_', '-')} gather over dim {(ls or p).dim}, not the vocabulary (last) dim")
    if node.kwargs.get("sparse_grad") or arg(node, 3, "sparse_grad", False):
        return decline("gather(..., sparse_grad=True) is not fused")
    if not all(same(a, b) for a, b in zip(ti.shape[:-1], tl.shape[:-1])):
        return decline("gather index does not cover the logits' rows one to one")
    if ti.dtype != torch.long:
        return decline(f"gather index of dtype {ti.dtype}")
    return Head(PATTERN, node, logits, None, consumed, kind="gathered", needs_lse_of=lse, k=hint(ti.shape[-1]),
                normalised=of, index=index)
