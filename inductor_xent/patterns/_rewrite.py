"""Rewrite one planned site: one fused op call for all its heads (the cross-entropy op, or the
log-probs op when an entropy or argmax is among them; a top-k op for each top-k head, a gather op
for each gather of several columns), each head's value from the op's outputs (the reduction the
user asked for, per-row values shaped as the head's), the logsumexps mapped onto the op's lse;
then erase what became dead and count the [N, V] buffers no longer computed."""

from __future__ import annotations

import functools
import operator
from typing import Any, NamedTuple, Optional

import torch
from torch.fx import Node

from .. import escape, gathered, ops, strategy, topk
from . import _dtensor, _logits
from ._fx import Emitter, arg, is_call, numel_hint, tval
from ._plan import SitePlan, storing_gather
from ._site import NO_IGNORE
from ._steps import CAST_METHODS, RowScale, StackedSlice, stacked

NEG = (operator.neg, torch.neg, "neg")

# ops whose result aliases (or may alias) their input: no new [N, V] buffer
_VIEWS = ("view", "reshape", "flatten", "contiguous", "transpose", "t", "permute", "squeeze", "unsqueeze")


class _Operands(NamedTuple):
    """A site's op operands, emitted by ``_operands``: the hidden states through the logits' leading-dim
    views (``hidden``; ``hidden2d`` flattened and cast), the weight ``[V, D]``, the bias, the targets
    flattened, and what shapes each head's value as its node (``all_ops``, ``d``)."""

    hidden: Node
    hidden2d: Node
    weight: Node
    bias: Optional[Node]
    target1d: Optional[Node]
    all_ops: list
    d: Any


def _operands(e: Emitter, plan: SitePlan, with_weight: bool = True) -> _Operands:
    """``with_weight=False``: the hidden states and targets only (weight and bias None: another site's)."""
    chain, graph = plan.logits, e.graph
    # the hidden states go through the logits' leading-dim views with D in place of V
    d = chain.vd[1]
    if not isinstance(d, int):  # a symbolic D (dynamic=True on a weight input): read it in the graph
        d = e.method("size", chain.weight, 1 if chain.weight_is_vd else 0)
    all_ops = [op for _, op in chain.shape_ops]
    hidden = _logits.replay(e, chain.hidden, all_ops, d)
    hidden2d = hidden if tval(hidden).dim() == 2 else e.method("flatten", hidden, 0, -2)
    target = plan.target
    target1d = target if target is None or tval(target).dim() == 1 else e.method("reshape", target, -1)
    if not with_weight:
        return _Operands(hidden, _cast(e, hidden2d, plan.dtype), None, None, target1d, all_ops, d)
    if chain.weight_scale is not None:  # logits * s, s one factor per vocabulary entry: (W * s[:, None])
        weight = _logits.scaled_weight(graph, chain)
    else:
        weight = chain.weight if chain.weight_is_vd else e.method("t", chain.weight)
    # autocast: the operands in the matmul's dtype, as autocast casts them (gradients flow back through the casts)
    hidden2d, weight = _cast(e, hidden2d, plan.dtype), _cast(e, weight, plan.dtype)
    bias = None if chain.bias is None else _cast(e, chain.bias, plan.dtype)
    if chain.bias_shift:  # a number added before the softcap: a constant bias
        v = chain.vd[0] if isinstance(chain.vd[0], int) else e.method("size", weight, 0)
        bias = (e.method("new_full", weight, (v,), chain.bias_shift) if bias is None
                else e.call(operator.add, bias, chain.bias_shift))
    return _Operands(hidden, hidden2d, weight, bias, target1d, all_ops, d)


def rewrite(gm, plan: SitePlan, how: strategy.GradientPlan, erased: set) -> int:
    """Replace ``plan``'s heads in ``gm``; the bytes of [N, V]-sized buffers it no longer computes.
    Nodes erased are added to ``erased``."""
    site, chain, graph = plan.first, plan.logits, gm.graph
    for n in plan.hoist:  # e.g. targets computed after a z-loss logsumexp: move them up
        plan.anchor.prepend(n)
    e = Emitter(graph, plan.anchor, site.loss)
    hidden, hidden2d, weight, bias, target1d, all_ops, d = ops_in = _operands(e, plan)
    ii = int(plan.ignore_index)
    scale, cap = float(chain.logit_scale), None if chain.softcap is None else float(chain.softcap)
    folded: list = []  # negations of a head that the op's output replaces instead
    for h, c in plan.heads:  # top-k heads: one top-k op each (topk.py)
        # (each with its own scale and softcap: a top-k at a temperature next to the loss)
        own = float(c.logit_scale), None if c.softcap is None else float(c.softcap)
        if h.kind == "topk":
            _topk(e, h, c, (hidden2d, weight, bias), *own, (hidden, all_ops, d), plan.no_grad)
        elif h.kind == "gathered":
            store = how.budget if how.strategy == "store" and h is storing_gather(plan) else "0"
            _gathered(e, h, c, (hidden2d, weight, bias), *own, (hidden, all_ops, d), store, plan.no_grad)
        elif h.kind == "kept":
            t1d = h.target if tval(h.target).dim() == 1 else e.method("reshape", h.target, -1)
            if h.nucleus:  # a nucleus kept set (within the top-k when both)
                k_rows = e.call(torch.full_like, t1d, h.k) if h.k else None
                p_rows = None
                if h.top_p_rows is not None:  # one per row, expanded as the targets (topk._per_row_p)
                    p_rows = e.method("detach", h.top_p_rows)
                    if tval(h.target).dim() > tval(h.top_p_rows).dim():
                        p_rows = e.method("unsqueeze", p_rows, -1)
                    p_rows = e.method("to", e.method("reshape", e.method("expand_as", p_rows, h.target), -1),
                                      torch.float32)
                rows = e.getitem(e.call(topk.NUCLEUS, hidden2d, weight, bias, t1d, k_rows, p_rows, float(h.top_p),
                                        *own, int(h.ignore_index)), 0)
            else:
                out = e.call(topk.TOPK, hidden2d, weight, bias, h.k, *own, False)
                rows = e.call(topk.kept_from_top, e.getitem(out, 0), e.getitem(out, 1), t1d, int(h.ignore_index))
            _place(e, h.loss, _shaped(e, h, c, rows, hidden, all_ops, d), h.negate, chain, folded, plan.no_grad)
    if not plan.main_heads:
        return _erase_dead(gm, plan, erased, folded)
    write = (True,) if plan.returned else ()  # the op writes the logits the graph returns (escape.py)
    needs = plan.needs
    if how.strategy == "store" and not plan.log_probs_op:  # the reduced loss and its gradients, in one op
        out = e.call(ops.STORE, hidden2d, weight, bias, target1d, ii, float(site.label_smoothing), scale, cap,
                     0.0, site.reduction, 0, how.budget, *needs, *write)
        loss = e.getitem(out, 0)
        if plan.heads[0][1].detached:  # the loss of logits.detach(): no gradient, as eager's
            loss = e.method("detach", loss)
        site.loss.replace_all_uses_with(_without_grad(e, _cast_like(e, loss, site.loss), site.loss, plan.no_grad))
        _return_logits(gm, e, plan, out, 4)
        return _erase_dead(gm, plan, erased, folded)
    mask = plan.row_mask  # the rows no gate lets through are skipped (_masked.py): ignored ids there
    if mask is not None:
        for n in mask.hoist:  # (those the targets need too moved up already)
            if n not in plan.hoist:
                plan.anchor.prepend(n)
    skip = {} if mask is None else {"skip_ignored": True}
    if plan.log_probs_op:
        kinds = {h.kind for h, _ in plan.heads}
        if target1d is None:  # entropy and argmax only: any class id
            ids = e.method("new_zeros", hidden2d, e.method("size", hidden2d, 0), dtype=torch.long)
        elif ii == NO_IGNORE:
            ids = target1d
        else:  # per-row heads only, no logsumexp: nobody reads an ignored row (an entropy reads every row)
            skip_ii = plan.per_row_store and not plan.lse_users
            ids = e.call(torch.where, e.call(operator.eq, target1d, ii), NO_IGNORE if skip_ii else 0, target1d)
            skip = {"skip_ignored": True} if skip_ii else skip
        ids = ids if mask is None else mask.masked_ids(e, ids)
        lp_args = (hidden2d, weight, bias, ids, NO_IGNORE, scale, cap, "entropy" in kinds, "argmax" in kinds)
        if how.strategy == "store":  # the exp-logits of as many rows as the budget holds, sized at run time
            out = e.call(ops.LOGPROB_STORE, *lp_args, 0, how.budget, **skip)
        else:
            out = e.call(ops.LOGPROB_FORWARD, *lp_args, **skip)
        item = functools.cache(lambda i: _dtensor.local(e, e.getitem(out, i)))
        lp = item(0)
        values = {**_log_prob_values(e, lp, target1d, ii),
                  "entropy": (lambda: item(1), 1), "argmax": (lambda: item(2), 1)}
        lse = item(3) if plan.lse_users else None
    else:
        # no logsumexp of the graph reads the op's lse: the ignored rows' logits need not exist
        if mask is None and not (plan.lse_users or plan.returned or ii == NO_IGNORE):
            skip = {"skip_ignored": True}
        ids = target1d if mask is None else mask.masked_ids(e, target1d, ii)
        out = e.call(ops.FORWARD, hidden2d, weight, bias, ids, ii, float(site.label_smoothing), scale, cap,
                     0.0, *write, **skip)
        rows, lse = _dtensor.local(e, e.getitem(out, 0)), _dtensor.local(e, e.getitem(out, 1))
        values = {"cross_entropy": (lambda: rows, 1), "log_probs": (lambda: rows, -1)}
    _place_heads(e, plan, values, ops_in, ii, folded)
    if mask is not None:
        mask.seal(graph)

    # logsumexps of the same logits (z-loss, or the idiom's own) read the op's lse
    # (shaped like the node each reads: the hidden states through the same views, less D)
    for u, (c, position, keepdim) in plan.lse_users.items():
        value = _rows_like(e, lse, c, position, keepdim, hidden, all_ops, d)
        if c.shift:  # a number added after the softcap (a sigmoid's): the logsumexp's too
            value = e.call(operator.add, value, c.shift)
        if c.detached:
            value = e.method("detach", value)
        value = _without_grad(e, value, u, plan.no_grad)
        u.replace_all_uses_with(_dtensor.restore(e, _cast_like(e, value, u), u, chain))
    if plan.returned:
        _return_logits(gm, e, plan, out, 3)
    return _erase_dead(gm, plan, erased, folded)


def rewrite_shared(gm, plans: list, sink: list, how: strategy.GradientPlan, erased: set) -> list[int]:
    """Replace the heads of ``plans`` (sites over one lm_head weight: multi-token-prediction depths, a
    head shared by several hidden states; ``_shared.groups``) with one log-probs op over all their
    rows, placed before the last site's first replaced node, and move ``sink`` (what read the earlier
    sites' values before that point) after it; each site's bytes of [N, V]-sized buffers no longer
    computed."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    last = max(plans, key=lambda p: order[p.anchor])
    e = Emitter(graph, last.anchor, last.first.loss)
    operands = [_operands(e, p, with_weight=i == 0) for i, p in enumerate(plans)]  # one weight (and bias) for all
    chain, ii = last.logits, int(last.ignore_index)
    scale, cap = float(chain.logit_scale), None if chain.softcap is None else float(chain.softcap)
    hidden = e.call(torch.cat, [o.hidden2d for o in operands], 0)
    target = e.call(torch.cat, [o.target1d for o in operands], 0)
    op = ops.LOGPROB_STORE if how.strategy == "store" else ops.LOGPROB_FORWARD
    # the op skips the ignored rows (0 there), each site's cross-entropy is minus its rows' log-probs;
    # no site reads an lse (_shared.groups): the op need not compute the ignored rows at all
    out = e.call(op, hidden, operands[0].weight, operands[0].bias, target, ii, scale, cap, False, False,
                 *((0, how.budget) if how.strategy == "store" else ()),
                 **({} if ii == NO_IGNORE else {"skip_ignored": True}))
    rows = e.call(torch.split, e.getitem(out, 0), [e.method("size", o.hidden2d, 0) for o in operands])
    folded = [[] for _ in plans]
    for k, (plan, ops_k) in enumerate(zip(plans, operands)):
        _place_heads(e, plan, _log_prob_values(e, e.getitem(rows, k), ops_k.target1d, ii), ops_k, ii, folded[k])
    for n in sink:  # in graph order, after what the op's values were emitted as
        last.anchor.prepend(n)
    return [_erase_dead(gm, plan, erased, f) for plan, f in zip(plans, folded)]


def _log_prob_values(e: Emitter, lp: Node, target1d: Optional[Node], ii: int) -> dict:
    """The log-probs and cross-entropy heads' per-row values (value thunk, sign) from the op's log-probs:
    the cross-entropy is minus them, 0 on ignored rows."""
    masked = functools.cache(lambda: lp if ii == NO_IGNORE else
                             e.call(torch.where, e.call(operator.ne, target1d, ii), lp, 0.0))
    return {"log_probs": (lambda: lp, 1), "cross_entropy": (masked, -1)}


def _place_heads(e: Emitter, plan: SitePlan, values: dict, ops_in: _Operands, ii: int, folded: list) -> None:
    """Each of ``plan``'s main heads reads its value (``values``: kind -> (thunk, sign)), reduced as the
    head asks or shaped as its node."""
    for h, c in plan.main_heads:
        value, sign = values[h.kind]
        value = value()
        if h.kind == "cross_entropy" and h.reduction != "none":
            if h.reduction == "mean":
                count = e.method("sum", e.call(operator.ne, ops_in.target1d, ii))
                value = e.call(operator.truediv, e.method("sum", value), count)
            else:
                value = e.method("sum", value)
            if c.detached:  # the loss of logits.detach(): no gradient, as eager's
                value = e.method("detach", value)
        else:
            value = _shaped(e, h, c, value, ops_in.hidden, ops_in.all_ops, ops_in.d)
        _place(e, h.loss, value, (sign < 0) != h.negate, plan.logits, folded, plan.no_grad)


def _return_logits(gm, e: Emitter, plan: SitePlan, out: Node, index: int) -> None:
    """The logits the graph returns, from the op's ``index``-th output (the raw logits, (N, V)):
    shaped as the matmul's output, the user's nodes between the raw logits and each returned tensor
    replayed on them (right before the graph's output, where all they read exists), the returned
    tensor replaced by the replay; the lm_head's operands returned too, and an ``escape.Escape``
    recorded for ``escape.wrap``."""
    if not plan.returned:
        return
    graph, chain = gm.graph, plan.logits
    output = next(iter(graph.find_nodes(op="output")))
    lead = e.getitem(e.method("size", chain.hidden), slice(None, -1))
    raw = e.method("unflatten", e.getitem(out, index), 0, lead)
    operands = tuple(None if n is None else _operand(gm, output, n) for n in (chain.hidden, chain.weight, chain.bias))
    records = gm.meta.setdefault(escape.META_KEY, (None, []))[1]
    for r in plan.returned:
        value = raw
        for step in r.member_steps:  # each reads the one before (its logits input)
            value = _copy_before(graph, output, step.node, step.src, value)
        stacked = None
        if r.stack:  # a copy of the stack with this head's tensor from the op (the other heads' in their turn)
            stack, k = r.stack
            value = _copy_before(graph, output, stack, r.walk.nodes[r.at], value)
            dim, count = arg(stack, 1, "dim", 0), len(arg(stack, 0, "tensors"))
            stacked = (dim % tval(stack).dim(), k, count)
        for step in r.tail:
            value = _copy_before(graph, output, step.node, step.src, value)
        output.replace_input_with(r.node, value)
        steps = tuple(s.escape() for s in r.replayed if s.escape() is not None)
        for i, o in enumerate(output.args[0]):
            if o is value:
                records.append(escape.Escape(i, *operands, plan.dtype, chain.weight_is_vd, steps, stacked))


def _copy_before(graph, output: Node, node: Node, src: Node, value: Node) -> Node:
    """A copy of ``node`` right before the graph's output, reading ``value`` where it read ``src``."""
    with graph.inserting_before(output):
        return graph.node_copy(node, lambda a: value if a is src else a)


def _operand(gm, output: Node, node: Node) -> tuple[str, int]:
    """Where ``escape.wrap`` finds ``node`` at run time: the call's argument (a placeholder), or an
    output appended to the graph's."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if node in placeholders:
        return ("arg", placeholders.index(node))
    outs = list(output.args[0])
    if node not in outs:
        outs.append(node)
        output.args = (type(output.args[0])(outs),)
    return ("out", outs.index(node))


def _rows_like(e: Emitter, value: Node, c: _logits.LogitsChain, position: int, keepdim: bool, hidden: Node,
               all_ops: list, d) -> Node:
    """``value`` (one per row of the op, in its order) shaped as the rows of ``c.nodes[position]``
    (then with a trailing 1 when ``keepdim``); ``hidden`` is the op's hidden states before
    flattening, the hidden states through ``all_ops``."""
    if tval(c.nodes[position]).dim() == 2 and not keepdim:
        return value  # one per row, in row order: exactly the op's
    value = e.method("view", value, _lead(e, c, position, hidden, all_ops, d))
    return e.method("unsqueeze", value, -1) if keepdim else value


def _shaped(e: Emitter, h, c: _logits.LogitsChain, value: Node, hidden: Node, all_ops: list, d) -> Node:
    """A per-row head value (one per row of the op) shaped as the head's node: as its ``shape_ref``
    (then less the trailing 1 when ``drop_last``), else as the rows of its logits; detached for a
    head that read ``logits.detach()``."""
    if h.shape_ref is not None:
        value = e.method("view_as", value, h.shape_ref)
        if h.drop_last:
            value = e.method("squeeze", value, -1)
    else:
        value = _rows_like(e, value, c, len(c.nodes) - 1, h.keepdim, hidden, all_ops, d)
    return e.method("detach", value) if c.detached else value


def _lead(e: Emitter, c: _logits.LogitsChain, position: int, hidden: Node, all_ops: list, d) -> Node:
    """The leading sizes (all but the vocabulary) of ``c.nodes[position]``, read from the hidden
    states through the same views."""
    upto = [op for i, op in c.shape_ops if i <= position]
    shaping = [op for op in upto if not isinstance(op, RowScale)]  # only the shape matters here
    like = hidden if upto == all_ops else _logits.replay(e, c.hidden, shaping, d)
    return e.getitem(e.method("size", like), slice(None, -1))


def _topk(e: Emitter, h, c: _logits.LogitsChain, operands: tuple, scale: float, cap, shaping: tuple,
          no_grad: frozenset = frozenset()) -> None:
    """One top-k head: the top-k op over the site's operands, its values (exponentials for a
    softmax's) and indices shaped as the rows of the logits it read, with ``k`` last, in place of
    the ``torch.topk`` result's two items."""
    out = e.call(topk.TOPK, *operands, h.k, scale, cap, h.normalised != "logits")
    items = [e.getitem(out, 0), e.getitem(out, 1)]
    if h.normalised == "probs":
        items[0] = e.call(torch.exp, items[0])
    elif h.normalised == "logits" and c.shift:  # a number added after the softcap (a sigmoid's): the values'
        items[0] = e.call(operator.add, items[0], c.shift)
    if tval(c.nodes[-1]).dim() != 2:
        lead = _lead(e, c, len(c.nodes) - 1, *shaping)
        items = [e.method("unflatten", t, 0, lead) for t in items]
    if c.detached:
        items[0] = e.method("detach", items[0])
    for u in h.aux:  # getitem(topk, 0 or 1)
        u.replace_all_uses_with(_without_grad(e, _cast_like(e, items[arg(u, 1, "index")], u), u, no_grad))


def _gathered(e: Emitter, h, c: _logits.LogitsChain, operands: tuple, scale: float, cap, shaping: tuple,
              budget: str, no_grad: frozenset = frozenset()) -> None:
    """One gather head: gathered.py's op over the site's operands and the ids flattened to ``[N, k]``,
    its values (exponentials for a softmax's) shaped as the gather's, in place of the gather;
    ``budget``: what its logits kept for the backward may take ("0": none)."""
    k = e.method("size", h.index, -1)  # (a symbolic k under dynamic shapes)
    index = e.method("reshape", h.index, e.method("size", operands[0], 0), k)
    out = e.call(gathered.GATHER, *operands, index, scale, cap, h.normalised != "logits", 0, budget)
    values = e.getitem(out, 0)
    if h.normalised == "probs":
        values = e.call(torch.exp, values)
    elif h.normalised == "logits" and c.shift:  # a number added after the softcap (a sigmoid's)
        values = e.call(operator.add, values, c.shift)
    if tval(c.nodes[-1]).dim() != 2:
        values = e.method("unflatten", values, 0, _lead(e, c, len(c.nodes) - 1, *shaping))
    if c.detached:
        values = e.method("detach", values)
    h.loss.replace_all_uses_with(_without_grad(e, _cast_like(e, values, h.loss), h.loss, no_grad))


def _place(e: Emitter, node: Node, value: Node, negative: bool, chain: _logits.LogitsChain, folded: list,
           no_grad: frozenset = frozenset()) -> None:
    """Make ``node``'s users read ``value`` (minus it when ``negative``): a negation that is the
    node's only user reads ``value`` itself instead (``-F.cross_entropy(..., reduction="none")``,
    ``-(p * logp).sum(-1)`` cost no negation). Detached where ``node`` is among ``no_grad``
    (``SitePlan.no_grad``: eager computes it without gradient)."""
    value = _without_grad(e, value, node, no_grad)
    users = list(node.users)
    if negative and len(users) == 1 and is_call(users[0], NEG) and len(users[0].args) == 1 and not users[0].kwargs:
        node, negative = users[0], False
        folded.append(node)
    if negative:
        value = e.call(operator.neg, value)
    node.replace_all_uses_with(_dtensor.restore(e, _cast_like(e, value, node), node, chain))


def _unstack(graph, stack: Node, erased: set) -> None:
    """The other heads' takes of ``stack`` (``torch.stack(heads, dim)[..., k]`` and the slices between)
    read their own head's logits instead (``_steps.stacked``), and are erased: the stack, with this
    head's tensor, dies even when another head's site declines (its take kept the whole stack, and
    this head's GEMM with it)."""
    frontier = [stack]
    while frontier:
        for g in list(frontier.pop().users):
            if not is_call(g, (operator.getitem,)):
                continue
            picked = stacked(g.args[0], g.args[1])
            if picked is None:  # a slice keeping every head: the takes are after it
                frontier.append(g)
                continue
            element, indices = picked
            take = StackedSlice(g, element, tuple(indices))
            g.replace_all_uses_with(take.replay(Emitter(graph, g, g), element, None))
            graph.erase_node(g)
            erased.add(g)


def _erase_dead(gm, plan: SitePlan, erased: set, folded: list) -> int:
    """Erase what became dead (and only that: escaping logits stay for their other users); the
    bytes of [N, V]-sized buffers no longer computed."""
    chain = plan.logits
    candidates = [*folded, *plan.lse_users, *reversed(plan.owned)]
    # the matmul's own operand nodes (e.g. ``W.t()``, whatever the argument order: einsum puts the
    # equation first); each is erased only if nothing else uses it
    keep = {chain.hidden, chain.weight, chain.bias}
    candidates.extend(a for a in chain.matmul.all_input_nodes if a not in keep)
    avoided = _erase(gm, chain, plan, candidates, erased)
    stacks = [n for n in plan.owned if is_call(n, (torch.stack,)) and n not in erased and n.users]
    for n in stacks:  # stacked heads whose other heads are still to come, or declined
        _unstack(gm.graph, n, erased)
    return avoided + (_erase(gm, chain, plan, candidates, erased) if stacks else 0)


def _erase(gm, chain: _logits.LogitsChain, plan: SitePlan, candidates: list, erased: set) -> int:
    """Erase the dead ``candidates``, each once its users are gone; the bytes of the [N, V]-sized ones."""
    avoided = 0
    n_rows_v = numel_hint(tval(chain.matmul))
    # recreated from the op's logits (the raw logits included): not avoided
    returned = {n for r in plan.returned for n in (*r.walk.nodes[: r.walk.raw_at + 1], *(s.node for s in r.replayed))}
    changed = True
    while changed:
        changed = False
        for n in candidates:
            if n in erased or n.users or n is chain.weight or n.op not in ("call_function", "call_method"):
                continue
            t = tval(n)
            is_view = n.op == "call_method" and n.target in _VIEWS or n.target is operator.getitem
            if n.op == "call_method" and n.target in CAST_METHODS:
                src = tval(arg(n, 0, "input"))
                is_view = src is not None and t is not None and src.dtype == t.dtype
            if t is not None and not is_view and n_rows_v and numel_hint(t) == n_rows_v and n not in returned:
                avoided += numel_hint(t) * t.element_size()
            gm.graph.erase_node(n)
            erased.add(n)
            changed = True
    return avoided


def _without_grad(e: Emitter, value: Node, node: Node, no_grad: frozenset) -> Node:
    """``value`` detached where ``node`` (what it replaces) is among ``no_grad``: eager computes it
    inside a ``torch.no_grad()`` block while the op runs with gradient (``SitePlan.no_grad``)."""
    t = tval(node)
    if node not in no_grad or t is None or not t.is_floating_point():
        return value
    return e.method("detach", value)


def _cast(e: Emitter, node: Node, dtype: torch.dtype) -> Node:
    return node if tval(node).dtype == dtype else e.method("to", node, dtype)


def _cast_like(e: Emitter, node: Node, like: Node) -> Node:
    return _cast(e, node, tval(like).dtype)
