"""Rewrite one planned site: the fused op, the reduction the user asked for, the logsumexps mapped
onto the op's lse; then erase what became dead and count the [N, V] buffers no longer computed."""

from __future__ import annotations

import operator

from torch.fx import Node

from .. import ops, strategy
from . import _dtensor, _logits
from ._fx import Emitter, arg, numel_hint, tval
from ._plan import Plan

# ops whose result aliases (or may alias) their input: no new [N, V] buffer
_VIEWS = ("view", "reshape", "flatten", "contiguous", "transpose", "t", "permute", "squeeze", "unsqueeze")


def rewrite(gm, plan: Plan, how: strategy.Plan, erased: set) -> int:
    """Replace ``plan``'s site in ``gm``; the bytes of [N, V]-sized buffers it no longer computes.
    Nodes erased are added to ``erased``."""
    site, chain, graph = plan.site, plan.logits, gm.graph
    for n in plan.hoist:  # e.g. targets computed after a z-loss logsumexp: move them up
        plan.anchor.prepend(n)
    e = Emitter(graph, plan.anchor, site.loss)
    # the hidden states go through the logits' leading-dim views with D in place of V
    d = chain.vd[1]
    if not isinstance(d, int):  # a symbolic D (dynamic=True on a weight input): read it in the graph
        d = e.method("size", chain.weight, 1 if chain.weight_is_vd else 0)
    all_ops = [op for _, op in chain.shape_ops]
    hidden = _logits.replay(e, chain.hidden, all_ops, d)
    hidden2d = hidden if tval(hidden).dim() == 2 else e.method("flatten", hidden, 0, -2)
    if chain.weight_scale is not None:  # logits * s, s one factor per vocabulary entry: (W * s[:, None])
        weight = _logits.scaled_weight(graph, chain)
    else:
        weight = chain.weight if chain.weight_is_vd else e.method("t", chain.weight)
    target1d = site.target if tval(site.target).dim() == 1 else e.method("reshape", site.target, -1)
    options = (int(site.ignore_index), float(site.label_smoothing), float(chain.logit_scale),
               None if chain.softcap is None else float(chain.softcap), 0.0)
    if how.strategy == "store":  # the reduced loss; its gradients are computed in the same op
        out = e.call(ops.STORE, hidden2d, weight, chain.bias, target1d, *options, site.reduction, 0, how.budget,
                     *chain.needs)
        site.loss.replace_all_uses_with(_cast_like(e, e.getitem(out, 0), site.loss))
        return _erase_dead(gm, plan, erased)
    out = e.call(ops.FORWARD, hidden2d, weight, chain.bias, target1d, *options)
    rows, lse = _dtensor.local(e, e.getitem(out, 0)), _dtensor.local(e, e.getitem(out, 1))

    # the loss
    if site.reduction == "mean":
        count = e.method("sum", e.call(operator.ne, target1d, int(site.ignore_index)))
        loss = e.call(operator.truediv, e.method("sum", rows), count)
    elif site.reduction == "sum":
        loss = e.method("sum", rows)
    else:
        loss = e.method("view_as", rows, site.shape_ref)
        if site.drop_last:
            loss = e.method("squeeze", loss, -1)
    if site.negate:
        loss = e.call(operator.neg, loss)
    loss = _dtensor.restore(e, _cast_like(e, loss, site.loss), site.loss, chain)
    site.loss.replace_all_uses_with(loss)

    # logsumexps of the same logits (z-loss, or the idiom's own) read the op's lse
    # (shaped like the node each reads: the hidden states through the same views, less D)
    for u, keepdim in plan.lse_users.items():
        position = chain.nodes.index(arg(u, 0, "input"))
        upto = [op for i, op in chain.shape_ops if i <= position]
        if tval(u).dim() == 1 and not keepdim:
            value = lse  # one lse per row, in row order: exactly the op's
        else:
            like = hidden if upto == all_ops else _logits.replay(e, chain.hidden, upto, d)
            value = e.method("view", lse, e.getitem(e.method("size", like), slice(None, -1)))
            if keepdim:
                value = e.method("unsqueeze", value, -1)
        u.replace_all_uses_with(_dtensor.restore(e, _cast_like(e, value, u), u, chain))
    return _erase_dead(gm, plan, erased)


def _erase_dead(gm, plan: Plan, erased: set) -> int:
    """Erase what became dead (and only that: escaping logits stay for their other users); the
    bytes of [N, V]-sized buffers no longer computed."""
    site, chain = plan.site, plan.logits
    candidates = [site.loss, *plan.lse_users, *site.consumed, *site.aux, *reversed(chain.nodes)]
    # the matmul's own operand nodes (e.g. ``W.t()``, whatever the argument order: einsum puts the
    # equation first); each is erased only if nothing else uses it
    keep = {chain.hidden, chain.weight, chain.bias}
    candidates.extend(a for a in chain.matmul.all_input_nodes if a not in keep)
    avoided = 0
    n_rows_v = numel_hint(tval(chain.matmul))
    changed = True
    while changed:
        changed = False
        for n in candidates:
            if n in erased or n.users or n is chain.weight or n.op not in ("call_function", "call_method"):
                continue
            t = tval(n)
            is_view = n.op == "call_method" and n.target in _VIEWS or n.target is operator.getitem
            if n.op == "call_method" and n.target in _logits.CAST_METHODS:
                src = tval(arg(n, 0, "input"))
                is_view = src is not None and t is not None and src.dtype == t.dtype
            if t is not None and not is_view and n_rows_v and numel_hint(t) == n_rows_v:
                avoided += numel_hint(t) * t.element_size()
            gm.graph.erase_node(n)
            erased.add(n)
            changed = True
    return avoided


def _cast_like(e: Emitter, node: Node, like: Node) -> Node:
    want = tval(like).dtype
    return node if tval(node).dtype == want else e.method("to", node, want)
