"""The pass: find lm_head matmul -> cross-entropy (log-probs, entropy, argmax) sites in a Dynamo
graph and call our op instead.

``run(gm)`` hands each idiom the nodes that call one of its ``TARGETS``, then traces, finds the
other heads over the same logits, plans, rewrites or declines each site it finds (README.md draws
the stages); when unsure, it declines.
Every site bumps ``torch._dynamo.utils.counters["inductor_xent"]`` (``sites_fused`` /
``sites_declined``, ``fused.<pattern>`` / ``declined.<pattern>``), is logged on
``logging.getLogger(__name__)`` (``TORCH_LOGS=inductor_xent``) and is returned as a ``SiteReport`` (what
``inductor_xent.explain`` shows). ``TORCH_LOGS=+inductor_xent`` logs each graph before and after the
pass, and ``TORCH_TRACE`` records them for tlparse (inductor_xent/logs.py).
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Optional, Union

from torch._dynamo.utils import counters
from torch.fx import GraphModule, Node

from .. import dynamo_tuning, escape, logs
from . import (
    _logits,
    _masked,
    _plan,
    _report,
    _rewrite,
    _row_index,
    _shared,
    _unloop,
    argmax,
    distill,
    entropy,
    lm_head_cross_entropy,
    log_softmax_nll,
    logsumexp_minus_gather,
    one_hot,
    topk,
)
from ._fx import arg
from ._plan import SitePlan
from ._report import ESCAPE_HINT, SiteReport
from ._site import HEAD_KINDS, Decline, Head

log = logging.getLogger(__name__)

IDIOMS = (lm_head_cross_entropy, log_softmax_nll, one_hot, logsumexp_minus_gather, entropy, argmax, topk)
# Other heads over the same logits are looked for among their users this many levels deep:
# Categorical's entropy is logits -> sub -> clamp -> mul -> sum, TRL's stacked logsumexp
# logits -> getitem -> logsumexp -> stack -> sub.
HEAD_DEPTH = 6


DONE = "inductor_xent_pass_done"  # gm.meta key set by run: the graph has been through the pass


def run(gm: GraphModule, *, allow_escaping_logits: bool = False, strategy: Optional[str] = None,
        store_budget=None, can_return: bool = False) -> list[SiteReport]:
    """Rewrite every supported site of ``gm`` in place; return one ``SiteReport`` per candidate.
    ``strategy`` / ``store_budget`` override ``config``'s (see inductor_xent/strategy.py).
    ``can_return``: the caller compiles ``gm`` and applies ``escape.wrap`` to the result, so logits
    the graph returns can be written by the op (escape.py); the graph may then gain outputs."""
    sites = logs.apply(gm, lambda g: _run(g, allow_escaping_logits, strategy, store_budget, can_return))
    return [] if sites is None else sites  # None: disabled_passes names the pass


def _run(gm: GraphModule, allow_escaping_logits: bool, strategy: Optional[str], store_budget,
         can_return: bool) -> list[SiteReport]:
    logs.graph(log, gm, "before")
    sites: list[SiteReport] = []
    erased: set = set()
    reported: set = set()  # heads already in another head's site
    gm.meta[DONE] = True
    _fold_loops(gm, allow_escaping_logits, can_return)
    sites.extend(_distillation(gm, strategy, store_budget))
    commuted = _row_index.commute(gm)
    candidates = _candidates(gm.graph)
    output = next(iter(gm.graph.find_nodes(op="output")), None)
    can_return = can_return and output is not None and isinstance(output.args[0], (tuple, list))
    if can_return:
        gm.meta[escape.META_KEY] = (len(output.args[0]), [])
    shared, apart = _shared_heads(gm, candidates, allow_escaping_logits, can_return, strategy, store_budget, erased,
                                  reported)
    sites.extend(shared)
    for node, idioms in candidates.items():
        if node in erased or node in reported:
            continue
        try:  # analysis is pure: a bug here declines the site instead of failing the user's compile
            found = _analyse(gm, node, idioms, candidates, allow_escaping_logits, can_return)
        except Exception as e:  # noqa: BLE001
            log.warning("inductor_xent: internal error analysing %s; site left alone", node.name, exc_info=True)
            found = Analysis("unknown", node.name, ("cross_entropy",), None,
                             Decline(None, node, f"internal error in the pass (please report): {e!r}"), [])
        if found is None:
            continue
        reported.update(h.loss for h in found.heads)
        if isinstance(found.outcome, SitePlan):  # rewrite (not guarded: a failure half way must not be swallowed)
            found.outcome.apart = apart.get(found.outcome.first.loss, "")
            _row_mask(gm, found.outcome)
            how = _plan.gradients(found.outcome, strategy, store_budget)
            found.outcome.per_row_store = _plan.per_row_store(found.outcome, how)
            avoided = _rewrite.rewrite(gm, found.outcome, how, erased)
            site = _report.fused(found.pattern, found.node, found.kinds, found.outcome, how, avoided)
        else:
            site = _report.declined(found.pattern, found.node, found.kinds, found.chain, found.outcome)
        sites.append(_counted(site))
    if commuted and any(s.fused for s in sites):  # a head over logits[mask]: the capture kept the index in
        gm.meta[dynamo_tuning.USED] = True
    if any(s.fused for s in sites):
        gm.graph.lint()
        gm.recompile()
    logs.graph(log, gm, "after")
    return sites


def _row_mask(gm: GraphModule, plan: SitePlan) -> None:
    """The row masks of ``plan``'s values (``_masked.find``), or why none; pure, so a bug here only
    leaves every row computed."""
    try:
        found = _masked.find(gm, plan)
    except Exception as e:  # noqa: BLE001
        log.warning("inductor_xent: internal error following %s's values; every row computed", plan.first.loss.name,
                    exc_info=True)
        found = f"internal error in the pass (please report): {e!r}"
    if isinstance(found, str):
        plan.row_mask_why = found
    else:
        plan.row_mask = found


def _shared_heads(gm: GraphModule, candidates: dict, allow_escaping: bool, can_return: bool, strategy, budget,
                  erased: set, reported: set) -> tuple[list[SiteReport], dict]:
    """Sites over one lm_head weight (multi-token prediction's depths) rewritten as one op call
    (``_shared.py``), before the sites are rewritten one by one; their heads join ``reported``. Also
    why the others of a weight keep their own ops (the first head's node -> reason)."""
    if len(candidates) < 2 or not _shared.may_share(gm):
        return [], {}
    found, seen = [], set()
    for node, idioms in candidates.items():
        if node in seen:
            continue
        try:  # pure; a failure leaves the sites to the one-by-one loop (which reports it)
            a = _analyse(gm, node, idioms, candidates, allow_escaping, can_return)
        except Exception:  # noqa: BLE001
            continue
        if a is not None and isinstance(a.outcome, SitePlan):
            seen.update(h.loss for h in a.heads)
            found.append(a)
    out = []
    groups, apart = _shared.groups(gm, [a.outcome for a in found])
    for group, sink in groups:
        members = [found[i] for i in group]
        plans = [a.outcome for a in members]
        how = _shared.gradients(plans, strategy, budget)
        for a, avoided in zip(members, _rewrite.rewrite_shared(gm, plans, sink, how, erased)):
            a.outcome.shared = len(plans)
            reported.update(h.loss for h in a.heads)
            out.append(_counted(_report.fused(a.pattern, a.node, a.kinds, a.outcome, how, avoided)))
    return out, {found[i].outcome.first.loss: why for i, why in apart.items()}


def _counted(site: SiteReport) -> SiteReport:
    kind = "fused" if site.fused else "declined"
    counters["inductor_xent"][f"sites_{kind}"] += 1
    counters["inductor_xent"][f"{kind}.{site.pattern}"] += 1
    log.info("inductor_xent: %s %s site (%s) at %s: %s", kind, site.pattern, site.head, site.node, site.reason)
    return site


def _distillation(gm: GraphModule, strategy: Optional[str], store_budget) -> list[SiteReport]:
    """Two lm_heads' divergence (patterns/distill.py), before the one-head idioms look at the graph."""
    return [_counted(s) for s in distill.run(gm, log, strategy, store_budget)]


def _fold_loops(gm: GraphModule, allow_escaping: bool, can_return: bool) -> None:
    """Fold the Python loops over rows of lm_head logits (``_unloop``) when that makes a site fuse:
    tried on a copy of the graph first, so that a loop the pass would decline anyway keeps the
    user's bounded memory."""
    def over_logits(loop) -> bool:
        bases = {b if loop.rows else b.args[0] for p in loop.pieces for b in p.values()}
        return any(isinstance(_logits.trace(b), _logits.LogitsChain) for b in bases)

    loops = [lp for lp in _unloop.find(gm.graph) if over_logits(lp)]
    if not loops:
        return
    trial = GraphModule(gm, _copy_graph(gm.graph))
    trial.meta.update(gm.meta)
    for loop in _unloop.find(trial.graph):
        if over_logits(loop):
            _unloop.fold(trial.graph, loop)
    candidates = _candidates(trial.graph)
    folded_fuses = False
    for node, idioms in candidates.items():
        try:
            analysed = _analyse(trial, node, idioms, candidates, allow_escaping, can_return)
        except Exception:  # noqa: BLE001 - as in run: the loops stay as they are
            log.debug("inductor_xent: analysing the folded loops failed", exc_info=True)
            return
        if analysed is not None and isinstance(analysed.outcome, SitePlan) and _report.unlooped(analysed.outcome):
            folded_fuses = True
    if folded_fuses:
        for loop in loops:
            _unloop.fold(gm.graph, loop)
        log.info("inductor_xent: folded %d Python loop(s) over the rows of the logits", len(loops))


def _copy_graph(graph):
    from torch.fx import Graph

    new = Graph()
    out = new.graph_copy(graph, {})
    new.output(out)
    return new


def _candidates(graph) -> dict[Node, list]:
    """The nodes calling some idiom's targets, in graph order, each with those idioms in IDIOMS order."""
    found: dict[Node, list] = {}
    for idiom in IDIOMS:
        for target in idiom.TARGETS:
            op = "call_method" if isinstance(target, str) else "call_function"  # a string names a method
            for node in graph.find_nodes(op=op, target=target, sort=False):
                found.setdefault(node, []).append(idiom)
    return dict(sorted(found.items()))


def _match(node: Node, idioms: list) -> Union[Head, Decline, None]:
    return next((f for f in (idiom.match(node) for idiom in idioms) if f is not None), None)


class Analysis(NamedTuple):
    """What ``_analyse`` found at a candidate: its report's pattern, node name and head kinds, the
    logits' chain (when the walk back found one), a plan or why not, the heads it covers."""

    pattern: str
    node: str
    kinds: tuple
    chain: Optional[_logits.LogitsChain]
    outcome: Union[SitePlan, Decline]
    heads: list


def _analyse(gm, node: Node, idioms: list, candidates: dict, allow_escaping: bool,
             can_return: bool) -> Optional[Analysis]:
    """The analysis of a candidate site at ``node``; None when it is none."""
    found = _match(node, idioms)
    if found is None:
        return None
    declined = isinstance(found, Decline)
    logits = arg(found.node, 0, "input") if declined and found.logits is None else found.logits
    chain = _logits.trace(logits) if isinstance(logits, Node) else None
    if chain is None:  # not over lm_head logits at all: not a candidate
        log.debug("inductor_xent: %s at %s is not over lm_head logits", found.pattern, node.name)
        return None
    walked = chain if isinstance(chain, _logits.LogitsChain) else None
    if declined or walked is None:  # the idiom's own reason first, whatever the walk found
        return Analysis(found.pattern, node.name, (found.kind,), walked, found if declined else chain, [])
    others = _other_heads(found, chain, candidates)
    # heads of other row slices of the same logits are sites of their own (analysed in turn), and so is
    # an argmax of a row slice next to heads of every row, or the reverse (no gradient: one forward GEMM)
    siblings = [(h, c) for h, c in others if _logits.other_rows(chain, c) or (
        "argmax" in (h.kind, found.kind) and _logits.sliced_rows(chain, c))]
    pairs = [(found, chain), *(p for p in others if p not in siblings)]
    heads = [h for h, _ in pairs]
    kinds = tuple(k for k in HEAD_KINDS if any(h.kind == k for h in heads))
    return Analysis(found.pattern, node.name, kinds, chain, _plan.decide(gm, pairs, allow_escaping, can_return,
                                                                           siblings), heads)


def _other_heads(found: Head, chain: _logits.LogitsChain, candidates: dict) -> list:
    """(Head, LogitsChain) of the other heads over the same lm_head matmul: candidates among the users
    of its logits (and of what ``found`` derives from them), HEAD_DEPTH levels deep, that an idiom
    matches and whose logits walk back to that matmul (the plan checks they are the same logits)."""
    # (the found head's own nodes are no other head: a kept-set head consumes the top-k it starts from)
    heads, seen, frontier = [], {found.loss, *found.consumed}, [*chain.nodes, *found.consumed]
    for _ in range(HEAD_DEPTH):
        users = []
        for u in (u for n in frontier for u in n.users):
            if u not in seen:
                seen.add(u)
                users.append(u)
        for u in users:
            other = _match(u, candidates[u]) if u in candidates else None
            walk = _logits.trace(other.logits) if isinstance(other, Head) else None
            if isinstance(walk, _logits.LogitsChain) and walk.matmul is chain.matmul:
                heads.append((other, walk))
        frontier = users
    return heads


__all__ = ["DONE", "ESCAPE_HINT", "IDIOMS", "SiteReport", "run"]
