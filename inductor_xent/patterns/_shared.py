"""Sites over one lm_head weight: several hidden states through the same head (multi-token prediction's
depths in DeepSeek-V3 and Qwen3-Next style trainers: ``lm_head(h)`` for the next token and
``lm_head(h_k)`` for token ``k`` ahead, each with its cross-entropy; a head shared by two streams).

Each is a site of its own (``_plan.decide``); fused one by one they are one op each, every op reading
the weight. ``groups`` finds the planned sites that one op can serve together: the same weight, bias,
scale, softcap and dtype, heads that are cross-entropies or log-probs of one target, and nothing the
per-site op alone can give (returned logits, a logsumexp, entropy or argmax, top-k, label smoothing,
row slices of one logits tensor). ``_rewrite.rewrite_shared`` then calls one log-probs op over all
their rows (``torch.cat`` of the hidden states and of the targets), placed before the last site's first
replaced node, so the weight is read once per tile for every row; each site's loss reduces its own rows.

Placing the earlier sites' work there is checked: every user of their heads comes after that point (an
early ``.item()`` or log of the main loss keeps the sites apart), no write in between reaches what they
read (``_mutation.written_in``), and no grad-mode change lies between the first matmul and that point.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx import Node

from .. import strategy
from . import _dtensor, _mutation
from ._fx import hint, is_call, numel_hint, tval
from ._logits import is_matmul
from ._plan import SitePlan

KINDS = ("cross_entropy", "log_probs")
_THROUGH = ("t", "transpose", "to", "float", "bfloat16", "half")  # a weight's view or cast before its matmul


def may_share(gm) -> bool:
    """Whether some graph input (a parameter: placeholder or attribute) is an operand of two matmuls or
    more, directly or through one transpose or cast: only then can two sites share an lm_head weight
    (the driver plans every site twice otherwise for nothing)."""
    seen: dict = {}
    for n in gm.graph.nodes:
        if not is_matmul(n):
            continue
        for a in n.all_input_nodes:
            if a.op == "call_method" and a.target in _THROUGH and a.args:
                a = a.args[0]
            if isinstance(a, Node) and a.op in ("placeholder", "get_attr"):
                seen[a] = seen.get(a, 0) + 1
                if seen[a] > 1:
                    return True
    return False


def groups(gm, plans: list[SitePlan]) -> tuple[list[tuple[list[int], list[Node]]], dict]:
    """The sites each one op serves (indices into ``plans``, two or more, in graph order), each group with
    the nodes to move after the op (``_movable``); and why the sites of a weight that could not share
    one op keep their own (index -> reason, for ``explain``)."""
    by_key: dict = {}
    for i, p in enumerate(plans):
        key = _key(p)
        if key is not None:
            by_key.setdefault(key, []).append(i)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    found, apart = [], {}
    for members in by_key.values():
        if len(members) < 2 or len({plans[i].logits.matmul for i in members}) != len(members):
            continue
        why, sink = _movable(gm, order, [plans[i] for i in members])
        if why is None:
            found.append((sorted(members, key=lambda i: order[plans[i].anchor]), sink))
        else:
            apart.update(dict.fromkeys(members, why))
    return found, apart


def gradients(plans: list[SitePlan], which: Optional[str], budget) -> strategy.GradientPlan:
    """The shared op's strategy (the log-probs op's: ``strategy.choose_log_probs`` at all the rows)."""
    chain = plans[0].logits
    v, d = chain.vd
    rows = [numel_hint(tval(p.logits.hidden)) for p in plans]
    n = None if None in rows else sum(r // max(1, hint(d) or 1) for r in rows)
    return strategy.choose_log_probs(n, hint(d) or strategy.DYNAMIC_ROWS, hint(v) or strategy.DYNAMIC_ROWS,
                                     plans[0].dtype, needs=tuple(any(p.needs[i] for p in plans) for i in range(3)),
                                     strategy=which, budget=budget, device=tval(chain.hidden).device.type)


def _key(p: SitePlan) -> Optional[tuple]:
    """What sites must share to be one op call; None for a site that keeps its own op."""
    c = p.logits
    heads = [h for h, _ in p.heads]
    if (p.returned or p.lse_users or p.escapes or p.siblings or p.hoist or p.target is None
            or any(h.kind not in KINDS or h.label_smoothing for h in heads)
            or any(not _same_walk(c, w) or w.detached for _, w in p.heads)  # a detached site: no gradient at all
            or _dtensor.involved(c) or c.weight_scale is not None
            or any(is_call(n, (torch.stack,)) for n in p.owned)):
        return None
    return (c.weight, c.bias, c.weight_is_vd, float(c.logit_scale), c.softcap, c.bias_shift, p.dtype,
            tval(c.hidden).device, p.ignore_index, tval(p.target).dtype)


def _same_walk(a, b) -> bool:
    return a.matmul is b.matmul and float(a.logit_scale) == float(b.logit_scale) and a.softcap == b.softcap


def _movable(gm, order: dict, plans: list[SitePlan]) -> tuple[Optional[str], list[Node]]:
    """(Why the sites' op cannot sit before the last site's first replaced node, else None; the nodes that
    must move after it). The earlier sites' heads get their values there, so what reads them before
    (``lp.squeeze(-1)``, ``loss * w``: ``sink``) moves after the op, when none of it is an input of the
    op, writes anything or reads a tensor written meanwhile."""
    last = max(plans, key=lambda p: order[p.anchor])
    at = order[last.anchor]
    first = min(order[p.logits.matmul] for p in plans)
    changes = gm.graph.find_nodes(op="call_function", target=torch._C._set_grad_enabled, sort=False)
    if any(first < order[n] < at for n in changes):
        return "a grad-mode change between the sites", []
    replaced = {n for p in plans for n in (*p.owned, *(h.loss for h, _ in p.heads))}
    inputs: dict = {}
    for p in plans:
        c = p.logits
        inputs.update({c.hidden: "the hidden states", c.weight: "the weight", c.bias: "the bias",
                       p.target: "the targets",
                       **{op.factor: "the per-row temperature" for _, op in c.shape_ops
                          if isinstance(getattr(op, "factor", None), Node)}})
    inputs.pop(None, None)
    needed = _ancestors(list(inputs), order, at)
    sink: dict = {}
    frontier = [u for p in plans if p is not last for h, _ in p.heads for u in h.loss.users
                if order[u] < at and u not in replaced]
    while frontier:
        n = frontier.pop()
        if n in sink:
            continue
        if n in needed:
            return f"{n.name} reads an earlier site's value and the last site's inputs depend on it", []
        if n.op not in ("call_function", "call_method") or _mutation.writes(n) or n.target in (
                torch._C._set_grad_enabled,):
            return f"{n.name} reads an earlier site's value before the last site and cannot move", []
        sink[n] = None
        frontier.extend(u for u in n.users if order[u] < at and u not in replaced)
    reads = {m: m.name for n in sink for m in n.all_input_nodes if m not in sink and m not in replaced}
    lo = min([order[p.anchor] for p in plans if p is not last])
    why = _mutation.written_in(gm, order, {**inputs, **reads}, lo, at)
    return why, sorted(sink, key=order.__getitem__)


def _ancestors(nodes: list, order: dict, before: int) -> set:
    """The nodes ``nodes`` are computed from (themselves included), among those before ``before``."""
    seen, frontier = set(), list(nodes)
    while frontier:
        n = frontier.pop()
        if n not in seen and order[n] < before:
            seen.add(n)
            frontier.extend(n.all_input_nodes)
    return seen
