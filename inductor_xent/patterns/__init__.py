"""The pass: find lm_head matmul -> cross-entropy sites in a Dynamo graph and call our op instead.

``run(gm)`` visits every node; each idiom module (one per spelling family, see README.md) says
whether the node is a loss over logits (``LossSite``), a site it must decline (``Decline``), or
neither. For a site, ``_logits.trace`` walks back to the matmul and folds what lies between
(casts, views, scale, softcap, bias, a sequence slice) into the op's arguments. The driver then
checks what the idioms cannot see locally (other users of the logits, dtypes, devices, autocast,
in-place updates) and either rewrites or declines with a reason. It never changes semantics: when
unsure, it declines.

Every site bumps ``torch._dynamo.utils.counters["inductor_xent"]`` (``sites_fused`` /
``sites_declined`` and ``fused.<pattern>`` / ``declined.<pattern>``), is logged on
``logging.getLogger(__name__)`` and is returned as a ``Site`` (what ``inductor_xent.explain``
shows). ``INDUCTOR_XENT_DUMP_GRAPHS=1`` logs each graph before and after the pass.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Optional

import torch
from torch._dynamo.utils import counters
from torch.fx import GraphModule, Node

from .. import config, ops, strategy
from ..options import FLOAT_DTYPES
from . import (
    _dtensor,
    _logits,
    _mutation,
    lm_head_cross_entropy,
    log_softmax_nll,
    logsumexp_minus_gather,
    one_hot,
    z_loss,
)
from ._fx import Emitter, hint, same, tval
from ._site import NO_IGNORE, Decline, LossSite

log = logging.getLogger(__name__)

IDIOMS = (lm_head_cross_entropy, log_softmax_nll, one_hot, logsumexp_minus_gather)
SUPPORTED_DEVICES = ("cpu", "cuda")
ESCAPE_REASON = "the logits escape: they are a graph output (the compiled function returns them)"
ESCAPE_HINT = (
    "the logits are also a graph output (the compiled function returns them), so they must be "
    "materialised: compile a function that returns only the loss instead, e.g. "
    "torch.compile(lambda **batch: model(**batch).loss, backend='inductor_xent') or a whole training "
    "step; or pass options={'xent.allow_escaping_logits': True} to fuse the loss anyway"
)
# ops whose result aliases (or may alias) their input: no new [N, V] buffer
_VIEWS = ("view", "reshape", "flatten", "contiguous", "transpose", "t", "permute", "squeeze", "unsqueeze")


@dataclass
class Site:
    """One candidate site: what ``explain`` reports and ``run`` returns."""

    pattern: str
    fused: bool
    reason: str
    node: str  # the loss node's name in the Dynamo graph
    rows: Optional[str] = None  # N, the number of rows (symbolic when dynamic)
    vocab: Optional[int] = None  # V
    hidden_dim: Optional[int] = None  # D
    dtype: Optional[str] = None  # dtype of the matmul (the logits as eager computes them)
    logits_bytes: Optional[int] = None  # one [N, V] logits tensor in that dtype (at the example sizes)
    bytes_avoided: int = 0  # [N, V]-sized buffers the rewritten forward no longer materialises
    logits_escape: bool = False  # the logits are a graph output
    strategy: str = ""  # how a fused site computes its gradients (strategy.Plan.describe())
    extra_bytes: Optional[int] = None  # the strategy's estimated extra memory (at the example sizes)


def run(gm: GraphModule, *, allow_escaping_logits: bool = False, strategy: Optional[str] = None,
        store_budget=None) -> list[Site]:
    """Rewrite every supported site of ``gm`` in place; return one ``Site`` per candidate.
    ``strategy`` / ``store_budget`` override ``config``'s (see inductor_xent/strategy.py)."""
    graph = gm.graph
    if config.dump_graphs():
        log.info("inductor_xent: graph before the pass:\n%s", gm.print_readable(print_output=False))
    autocast = _autocast_reason(gm)
    sites: list[Site] = []
    erased: set = set()
    for node in list(graph.nodes):
        if node in erased or node.op not in ("call_function", "call_method"):
            continue
        try:  # analysis is pure: a bug here declines the site instead of failing the user's compile
            analysed = _analyse(gm, node, allow_escaping_logits, autocast)
        except Exception as e:  # noqa: BLE001
            log.warning("inductor_xent: internal error analysing %s; site left alone", node.name, exc_info=True)
            analysed = (Site("unknown", False, f"internal error in the pass (please report): {e!r}", node.name),
                        None, None, None)
        if analysed is None:
            continue
        site, found, chain, plan = analysed
        if plan is not None:  # rewrite (not guarded: a failure half way must not be swallowed)
            plan["strategy"] = _strategy(found, chain, plan, strategy, store_budget)
            site.strategy = plan["strategy"].describe()
            site.extra_bytes = plan["strategy"].extra_bytes if plan["strategy"].strategy == "store" else None
            site.bytes_avoided = _rewrite(gm, found, chain, plan, erased)
            site.fused = True
            site.reason = _fused_reason(found, chain, plan)
        sites.append(site)
        kind = "fused" if site.fused else "declined"
        counters["inductor_xent"][f"sites_{kind}"] += 1
        counters["inductor_xent"][f"{kind}.{site.pattern}"] += 1
        log.info("inductor_xent: %s %s site at %s: %s", kind, site.pattern, site.node, site.reason)
    if any(s.fused for s in sites):
        graph.lint()
        gm.recompile()
    if config.dump_graphs():
        log.info("inductor_xent: graph after the pass:\n%s", gm.print_readable(print_output=False))
    return sites


# ---------------------------------------------------------------------------------------------
# one site
# ---------------------------------------------------------------------------------------------
def _analyse(gm, node: Node, allow_escaping: bool, autocast: Optional[str]):
    """(Site, LossSite, Logits, plan) for a site to rewrite, (Site, None, None, None) for one to
    decline, None when ``node`` is not a candidate."""
    for idiom in IDIOMS:
        found = idiom.match(node)
        if found is not None:
            break
    else:
        return None
    if isinstance(found, Decline):
        logits = found.logits if found.logits is not None else (found.node.args or (None,))[0]
        chain = _logits.trace(logits) if isinstance(logits, Node) else None
        if chain is None:  # not over lm_head logits at all: not a candidate
            log.debug("inductor_xent: %s at %s is not over lm_head logits (%s)", found.pattern,
                      found.node.name, found.reason)
            return None
        site = Site(found.pattern, False, found.reason, found.node.name)
        if not isinstance(chain, str):
            _describe(site, chain)
        return site, None, None, None
    chain = _logits.trace(found.logits)
    if chain is None:
        return None
    site = Site(found.pattern, False, "", found.loss.name)
    if isinstance(chain, str):
        site.reason = chain
        return site, None, None, None
    _describe(site, chain)
    plan = _plan(gm, found, chain, allow_escaping, autocast)
    if isinstance(plan, str):
        site.reason = plan
        site.logits_escape = plan == ESCAPE_REASON
        return site, None, None, None
    site.logits_escape = plan["escapes_to_output"]
    return site, found, chain, plan


def _describe(site: Site, chain: _logits.Logits) -> None:
    tw = tval(chain.weight)
    tz = tval(chain.matmul)
    v, d = (tw.shape[0], tw.shape[1]) if chain.weight_is_vd else (tw.shape[1], tw.shape[0])
    site.vocab, site.hidden_dim, site.dtype = hint(v), hint(d), str(tz.dtype).replace("torch.", "")
    rows = 1
    for s in tz.shape[:-1]:
        rows = rows * s
    site.rows = str(rows)
    n = hint(rows)
    site.logits_bytes = None if n is None or site.vocab is None else n * site.vocab * tz.element_size()


def _fused_reason(site: LossSite, chain: _logits.Logits, plan: dict) -> str:
    parts = [f"reduction={site.reduction}"]
    if site.ignore_index != NO_IGNORE:
        parts.append(f"ignore_index={site.ignore_index}")
    if site.label_smoothing:
        parts.append(f"label_smoothing={site.label_smoothing}")
    if chain.bias is not None:
        parts.append("bias")
    if chain.logit_scale != 1.0:
        parts.append(f"logit_scale={chain.logit_scale:g}")
    if chain.softcap is not None:
        parts.append(f"softcap={chain.softcap:g}")
    if chain.weight_scale is not None:
        parts.append("tensor scale folded into the weight")
    if chain.sliced:
        parts.append("slice pushed onto the hidden states")
    if not chain.weight_is_vd:
        parts.append("[D, V] weight")
    vocab_parallel = _dtensor.describe(chain)
    if vocab_parallel:
        parts.append(vocab_parallel)
    if plan["lse_users"]:
        parts.append(f"{len(plan['lse_users'])} logsumexp mapped onto the op's lse")
    if plan["escapes"]:
        parts.append("logits still materialised for their other users (allow_escaping_logits)")
    parts.append("strategy " + plan["strategy"].describe())
    return "fused: " + ", ".join(parts)


def _plan(gm, site: LossSite, chain: _logits.Logits, allow_escaping: bool, autocast) -> dict | str:
    """Everything the rewrite needs, or the reason to decline."""
    if autocast:
        return autocast
    tx, tw, tt = tval(chain.hidden), tval(chain.weight), tval(site.target)
    tb = tval(chain.bias) if chain.bias is not None else None
    if tx.dtype not in FLOAT_DTYPES:
        return f"unsupported hidden dtype {tx.dtype}"
    if tw.dtype != tx.dtype or (tb is not None and tb.dtype != tx.dtype):
        return f"mixed dtypes: hidden {tx.dtype}, weight {tw.dtype}, bias {None if tb is None else tb.dtype}"
    devices = {t.device for t in (tx, tw, tt, tb) if t is not None}
    if len(devices) != 1 or next(iter(devices)).type not in SUPPORTED_DEVICES:
        return f"unsupported device(s) {sorted(map(str, devices))}"
    dtensor = _dtensor.decline_reason(site, chain)  # tensor parallelism: a layout we can run?
    if dtensor:
        return dtensor
    tz = tval(site.logits)
    rows = 1
    for size in tz.shape[:-1]:
        rows = rows * size
    if not same(tt.numel(), rows):
        return (f"the targets {tuple(tt.shape)} do not give one class id per row of the logits "
                f"{tuple(tz.shape)}")
    out_dtype = tval(site.loss).dtype
    if out_dtype == torch.float64 and tx.dtype != torch.float64:
        return "float64 loss of lower-precision logits: the op would compute in float32"

    owned = {*chain.nodes, *site.consumed, site.loss}
    lse_users: dict = {}
    escapes: list = []
    for i, c in enumerate(chain.nodes):
        for u in c.users:
            if u in owned:
                continue
            m = z_loss.lse_of(u)
            if m is not None and m[0] is c and i >= chain.final_from:
                lse_users[u] = m[1]
            else:
                escapes.append(u)
    for c in site.consumed:
        escapes.extend(u for u in c.users if u not in owned)
    for n in site.needs_lse_of:
        if n not in lse_users:
            return "the logsumexp does not read the same logits as the gather"
    # where the op goes: before the loss and before every logsumexp it replaces
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    anchor = min([site.loss, *lse_users], key=order.__getitem__)
    inputs = [chain.hidden, chain.weight, chain.bias, site.target, site.shape_ref]
    late = _late_closure([n for n in inputs if isinstance(n, Node)], order, anchor)
    # before the escape check: with allow_escaping_logits a write would still be fused wrongly
    written = _written_between(gm, order, site, chain, lse_users, late or ())
    if written:
        return written
    if escapes:
        to_output = any(u.op == "output" for u in escapes)
        if not allow_escaping:
            if to_output:
                return ESCAPE_REASON
            names = ", ".join(sorted({u.name for u in escapes}))
            return f"the logits have other users ({names}); options={{'xent.allow_escaping_logits': True}} fuses anyway"
    if late is None:
        return "the targets are computed after a logsumexp of the logits"
    unsafe = _grad_mode_between(gm, order, chain, anchor)
    if unsafe:
        return unsafe
    return {
        "anchor": anchor,
        "hoist": late,
        "lse_users": lse_users,
        "escapes": escapes,
        "escapes_to_output": any(u.op == "output" for u in escapes),
    }


def _late_closure(nodes: list, order: dict, anchor: Node) -> Optional[list]:
    """The op's inputs that are computed after ``anchor`` and everything they need from after it,
    in graph order, when all of that can move before ``anchor`` (pure calls); else None."""
    late, stack = set(), [n for n in nodes if order[n] >= order[anchor]]
    while stack:
        n = stack.pop()
        if n in late:
            continue
        if (n.op not in ("call_function", "call_method") or n.is_impure() or _mutation.writes(n)
                or n is anchor or len(late) > 32):
            return None
        late.add(n)
        stack.extend(m for m in n.all_input_nodes if order[m] >= order[anchor])
    return sorted(late, key=order.__getitem__)


def _strategy(site: LossSite, chain: _logits.Logits, plan: dict, which, budget) -> strategy.Plan:
    """The gradient strategy of a site about to be rewritten (strategy.plan, from the example values'
    sizes as hints and their requires_grad: which gradients the graph will ask for)."""
    if _dtensor.involved(chain):  # the vocabulary-parallel (DTensor) rules cover the recompute ops
        return strategy.Plan("recompute", reason="no vocabulary-parallel store kernel")
    tx, tw = tval(chain.hidden), tval(chain.weight)
    d = tw.shape[1] if chain.weight_is_vd else tw.shape[0]
    v = tw.shape[0] if chain.weight_is_vd else tw.shape[1]
    n = _numel_hint(tx)
    n = None if n is None else n // max(1, hint(d) or 1)
    return strategy.plan(n, hint(d) or strategy.DYNAMIC_ROWS, hint(v) or strategy.DYNAMIC_ROWS, tx.dtype, tw.dtype,
                         reduction="none" if site.negate else site.reduction, needs=_needs(chain),
                         label_smoothing=site.label_smoothing, softcap=chain.softcap,
                         lse_used=bool(plan["lse_users"]), strategy=which, budget=budget)


_GRAD_MODE = {torch._C._set_grad_enabled}


def _grad_mode_between(gm, order, chain: _logits.Logits, anchor: Node) -> Optional[str]:
    """A reason when moving the matmul's work down to ``anchor`` could change what it computes:
    a grad-mode change (``with torch.no_grad():`` around the lm_head only) in between."""
    lo, hi = order[chain.matmul], order[anchor]
    for n in gm.graph.nodes:
        if lo < order[n] < hi and n.op == "call_function" and n.target in _GRAD_MODE:
            return "the grad mode changes between the lm_head matmul and the loss"
    return None


def _written_between(gm, order, site: LossSite, chain: _logits.Logits, lse_users, hoisted) -> Optional[str]:
    """A reason when a write could change what the rewrite computes.

    The op reads the hidden states, weight, bias and targets where it is placed (before the loss
    and the logsumexps it replaces); eager read them at the matmul and at the idiom's own nodes
    (``one_hot(y)``, a gather). So no node from the first of those reads to the last node replaced
    may write a tensor sharing storage with any of them, with the logits the replaced nodes read,
    or with the inputs of a target computation hoisted up to the op; and no replaced node may
    write anything (the write would vanish). When the loss requires grad, no later node may write
    the hidden states, weight, bias or targets either: the op saves all four for its backward,
    which would then fail where eager's (saving only what each gradient needs) may not. Which op
    writes what comes from its schema (``_mutation.writes``), storages from the example values (a
    view shares its base's); an unknown storage declines.
    """
    reads = {chain.hidden: "the hidden states", chain.weight: "the weight", chain.bias: "the bias",
             site.target: "the targets"}
    for n in (*chain.nodes, *site.consumed):
        reads.setdefault(n, "the logits")
    for n in (*site.aux, *hoisted):  # one_hot(y) and its casts; target computations moved up
        reads.setdefault(n, "the targets")
    for n in hoisted:
        for m in n.all_input_nodes:
            reads.setdefault(m, "the targets")  # what they are computed from
    reads.pop(None, None)
    replaced = {site.loss, *lse_users, *chain.nodes, *site.consumed, *site.aux}
    lo = min(order[n] for n in (chain.matmul, *site.consumed, *site.aux))
    hi = max(order[n] for n in (site.loss, *lse_users, *hoisted))
    # eager reads the targets at the loss (or at the idiom's own one_hot / gather), the op where it is
    # placed: a write to them before both is seen by both (ProphetNet builds its targets in place,
    # new_zeros().fill_() then slices set, after its lm_head)
    anchor = min(order[n] for n in (site.loss, *lse_users))
    target_from = min([anchor] + [order[n] for n in (*site.aux, *hoisted)])
    start = {r: (target_from if what == "the targets" and r is site.target else lo) for r, what in reads.items()}
    # the op saves hidden/weight/bias/targets for its backward (whatever requires grad), where eager's
    # linear saves only what the other operand's gradient needs: a later write would fail backward
    saved = [chain.hidden, chain.weight, chain.bias, site.target] if tval(site.loss).requires_grad else []
    storages = [(_storage(r), what, start[r]) for r, what in reads.items()]
    saved_storages = [(_storage(r), reads[r], 0) for r in saved if r is not None]
    swapped = next((n for n in gm.graph.nodes if _mutation.swaps_storage(n)), None)
    for n in gm.graph.nodes:
        if order[n] < lo:
            continue
        between = order[n] <= hi
        for w in _mutation.writes(n):
            op = _mutation.spelling(n)
            where = "between the lm_head matmul and the loss" if between else (
                "after the loss, and the fused op's backward reads it (eager's may not)")
            if between and w in reads and order[n] >= start[w]:
                return f"{op} writes {reads[w]} {where}"
            if between and n in replaced:
                return f"{op} writes {w.name}, and the fused op would replace it"
            live = [(st, what) for st, what, since in (storages if between else saved_storages)
                    if order[n] >= since]
            what = _aliased(w, live, swapped)
            if what:
                return f"{op} writes {what} {where}"
    return None


def _aliased(w: Node, storages: list, swapped: Optional[Node]) -> Optional[str]:
    """What ``w`` may alias among ``storages`` ((storage, what) pairs), or None."""
    if not storages:
        return None
    if swapped is not None:  # storages are as the trace left them, not as they were at the write
        return f"{w.name} (aliasing unknown: {_mutation.spelling(swapped)} in the graph)"
    mutated = _storage(w)
    for st, what in storages:
        if mutated is None or st is None:
            return f"{w.name} (storage unknown)"
        if st is mutated:
            return what
    return None


def _storage(node: Node):
    """The untyped storage of a node's example value (views share it), or None when unknown."""
    t = tval(node)
    try:
        return None if t is None else t.untyped_storage()
    except Exception:  # noqa: BLE001 - e.g. a tensor subclass without storage
        return None


def _rewrite(gm, site: LossSite, chain: _logits.Logits, plan: dict, erased: set) -> int:
    graph = gm.graph
    for n in plan["hoist"]:  # e.g. targets computed after a z-loss logsumexp: move them up
        plan["anchor"].prepend(n)
    e = Emitter(graph, plan["anchor"], site.loss)
    # the hidden states go through the logits' leading-dim views with D in place of V
    d = tval(chain.weight).shape[1 if chain.weight_is_vd else 0]
    if not isinstance(d, int):  # a symbolic D (dynamic=True on a weight input): read it in the graph
        d = e.method("size", chain.weight, 1 if chain.weight_is_vd else 0)
    plan["hidden_last"] = d
    hidden = _logits.replay(e, chain.hidden, [op for _, op in chain.shape_ops], d)
    hidden2d = hidden if tval(hidden).dim() == 2 else e.method("flatten", hidden, 0, -2)
    if chain.weight_scale is not None:  # logits * s, s one factor per vocabulary entry: (W * s[:, None])
        weight = _logits.scaled_weight(graph, chain)
    else:
        weight = chain.weight if chain.weight_is_vd else e.method("t", chain.weight)
    target1d = site.target if tval(site.target).dim() == 1 else e.method("reshape", site.target, -1)
    chosen: strategy.Plan = plan["strategy"]
    if chosen.strategy == "store":  # the reduced loss; its gradients are computed in the same op
        out = e.call(
            ops.STORE, hidden2d, weight, chain.bias, target1d,
            int(site.ignore_index), float(site.label_smoothing), float(chain.logit_scale),
            None if chain.softcap is None else float(chain.softcap), 0.0, site.reduction, 0, chosen.budget,
            *_needs(chain),
        )
        site.loss.replace_all_uses_with(_cast_like(e, e.getitem(out, 0), site.loss))
        return _erase_dead(gm, site, chain, plan, erased)
    out = e.call(
        ops.FORWARD, hidden2d, weight, chain.bias, target1d,
        int(site.ignore_index), float(site.label_smoothing), float(chain.logit_scale),
        None if chain.softcap is None else float(chain.softcap), 0.0,
    )
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
    all_ops = [op for _, op in chain.shape_ops]
    for u, keepdim in plan["lse_users"].items():
        position = chain.nodes.index(u.args[0] if u.args else u.kwargs["input"])
        upto = [op for i, op in chain.shape_ops if i <= position]
        if tval(u).dim() == 1 and not keepdim:
            value = lse  # one lse per row, in row order: exactly the op's
        else:
            like = hidden if upto == all_ops else _logits.replay(e, chain.hidden, upto, plan["hidden_last"])
            value = e.method("view", lse, e.getitem(e.method("size", like), slice(None, -1)))
            if keepdim:
                value = e.method("unsqueeze", value, -1)
        u.replace_all_uses_with(_dtensor.restore(e, _cast_like(e, value, u), u, chain))
    return _erase_dead(gm, site, chain, plan, erased)


def _needs(chain: _logits.Logits) -> tuple[bool, bool, bool]:
    """(needs_hidden, needs_weight, needs_bias) of the store op: what the graph will ask for."""
    grad = tval(chain.matmul).requires_grad
    tb = tval(chain.bias) if chain.bias is not None else None
    return (bool(grad and tval(chain.hidden).requires_grad), bool(grad and tval(chain.weight).requires_grad),
            bool(grad and tb is not None and tb.requires_grad))


def _erase_dead(gm, site: LossSite, chain: _logits.Logits, plan: dict, erased: set) -> int:
    """Erase what became dead (and only that: escaping logits stay for their other users); the
    bytes of [N, V]-sized buffers no longer computed."""
    graph = gm.graph
    candidates = [site.loss, *plan["lse_users"], *site.consumed, *site.aux, *reversed(chain.nodes)]
    # the matmul's own operand nodes (e.g. ``W.t()``, whatever the argument order: einsum puts the
    # equation first); each is erased only if nothing else uses it
    keep = {chain.hidden, chain.weight, chain.bias}
    candidates.extend(a for a in chain.matmul.all_input_nodes if a not in keep)
    avoided = 0
    n_rows_v = _numel_hint(tval(chain.matmul))
    changed = True
    while changed:
        changed = False
        for n in candidates:
            if n in erased or n.users or n is chain.weight or n.op not in ("call_function", "call_method"):
                continue
            t = tval(n)
            is_view = n.op == "call_method" and n.target in _VIEWS or n.target is operator.getitem
            if n.op == "call_method" and n.target in _logits.CAST_METHODS:
                src = tval(n.args[0])
                is_view = src is not None and t is not None and src.dtype == t.dtype
            if t is not None and not is_view and n_rows_v and _numel_hint(t) == n_rows_v:
                avoided += _numel_hint(t) * t.element_size()
            graph.erase_node(n)
            erased.add(n)
            changed = True
    return avoided


def _cast_like(e: Emitter, node: Node, like: Node) -> Node:
    want = tval(like).dtype
    return node if tval(node).dtype == want else e.method("to", node, want)


def _numel_hint(t) -> Optional[int]:
    n = 1
    for s in t.shape:
        h = hint(s)
        if h is None:
            return None
        n *= h
    return n


def _autocast_reason(gm) -> Optional[str]:
    """Autocast changes the matmul's dtype behind the graph's back: decline inside it."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and "autocast" in getattr(n.target, "__name__", ""):
            return "autocast region in the graph (not supported yet)"
    for dev in ("cpu", "cuda"):
        try:
            if torch.is_autocast_enabled(dev):
                return f"autocast is enabled for {dev} (not supported yet)"
        except (TypeError, RuntimeError):  # pragma: no cover - older signatures
            pass
    return None


__all__ = ["Site", "run", "IDIOMS"]
