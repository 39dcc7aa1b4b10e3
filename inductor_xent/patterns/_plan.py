"""Whether a site found by an idiom can be rewritten, and how: a ``Plan``, or a ``Decline`` with
the reason. What an idiom cannot see from its own node is checked here: dtypes and devices, the
rows of the targets, the other users of the logits (a z-loss ``logsumexp`` is mapped onto the op's
lse; anything else keeps the logits alive), writes in between (``_mutation.written_between``),
grad-mode changes and autocast. Then ``gradients`` picks the site's strategy (strategy.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch.fx import Node

from .. import strategy
from ..options import FLOAT_DTYPES
from . import _dtensor, _mutation
from ._fx import hint, numel_hint, same, tval
from ._logits import Logits
from ._site import Decline, LossSite, lse_of

SUPPORTED_DEVICES = ("cpu", "cuda")
ESCAPE_REASON = "the logits escape: they are a graph output (the compiled function returns them)"
# Target computations after a z-loss logsumexp move up to the op with everything they need from after
# it (HF's pad + slice + contiguous + view is 4 nodes); a longer closure is not a target computation.
MAX_HOISTED = 32


@dataclass
class Plan:
    """How to rewrite one site: the op goes right before ``anchor`` (the loss, or the first
    logsumexp it replaces), after ``hoist``."""

    site: LossSite
    logits: Logits
    anchor: Node
    hoist: list  # target computations that came after the anchor, in graph order
    lse_users: dict  # logsumexp of the same logits -> its keepdim: each reads the op's lse instead
    escapes: list  # other users of the logits: they keep them (allow_escaping_logits)

    @property
    def escapes_to_output(self) -> bool:
        return any(u.op == "output" for u in self.escapes)


def plan(gm, site: LossSite, chain: Logits, allow_escaping: bool, autocast: Optional[str]) -> Union[Plan, Decline]:
    """The rewrite of ``site`` over ``chain``, or why there is none."""
    reason = autocast or _inputs_reason(site, chain)
    if reason:
        return Decline(None, site.loss, reason)
    owned = {*chain.nodes, *site.consumed, site.loss}
    lse_users: dict = {}
    escapes: list = []
    for i, c in enumerate(chain.nodes):
        for u in c.users:
            if u in owned:
                continue
            m = lse_of(u)
            if m is not None and m[0] is c and i >= chain.final_from:
                lse_users[u] = m[1]
            else:
                escapes.append(u)
    for c in site.consumed:
        escapes.extend(u for u in c.users if u not in owned)
    if any(n not in lse_users for n in site.needs_lse_of):
        return Decline(None, site.loss, "the logsumexp does not read the same logits as the gather")
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    anchor = min([site.loss, *lse_users], key=order.__getitem__)
    inputs = [chain.hidden, chain.weight, chain.bias, site.target, site.shape_ref]
    hoist = _late_closure([n for n in inputs if isinstance(n, Node)], order, anchor)
    # before the escape check: with allow_escaping_logits a write would still be fused wrongly
    reason = _mutation.written_between(gm, order, site, chain, lse_users, hoist or ())
    if not reason and escapes and not allow_escaping:
        if any(u.op == "output" for u in escapes):
            return Decline(None, site.loss, ESCAPE_REASON, logits_escape=True)
        names = ", ".join(sorted({u.name for u in escapes}))
        reason = f"the logits have other users ({names}); options={{'xent.allow_escaping_logits': True}} fuses anyway"
    if not reason and hoist is None:
        reason = "the targets are computed after a logsumexp of the logits"
    reason = reason or _grad_mode_between(gm, order, chain, anchor)
    if reason:
        return Decline(None, site.loss, reason)
    return Plan(site, chain, anchor, hoist, lse_users, escapes)


def _inputs_reason(site: LossSite, chain: Logits) -> Optional[str]:
    """Why the op cannot take these inputs (dtypes, devices, DTensor layouts, rows), or None."""
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
    if not same(tt.numel(), math.prod(tz.shape[:-1])):
        return f"the targets {tuple(tt.shape)} do not give one class id per row of the logits {tuple(tz.shape)}"
    if tval(site.loss).dtype == torch.float64 and tx.dtype != torch.float64:
        return "float64 loss of lower-precision logits: the op would compute in float32"
    return None


def _late_closure(nodes: list, order: dict, anchor: Node) -> Optional[list]:
    """The op's inputs that are computed after ``anchor`` and everything they need from after it,
    in graph order, when all of that can move before ``anchor`` (pure calls); else None."""
    late, stack = set(), [n for n in nodes if order[n] >= order[anchor]]
    while stack:
        n = stack.pop()
        if n in late:
            continue
        if (n.op not in ("call_function", "call_method") or n.is_impure() or _mutation.writes(n)
                or n is anchor or len(late) > MAX_HOISTED):
            return None
        late.add(n)
        stack.extend(m for m in n.all_input_nodes if order[m] >= order[anchor])
    return sorted(late, key=order.__getitem__)


def _grad_mode_between(gm, order: dict, chain: Logits, anchor: Node) -> Optional[str]:
    """A reason when moving the matmul's work down to ``anchor`` could change what it computes:
    a grad-mode change (``with torch.no_grad():`` around the lm_head only) in between."""
    changes = gm.graph.find_nodes(op="call_function", target=torch._C._set_grad_enabled, sort=False)
    if any(order[chain.matmul] < order[n] < order[anchor] for n in changes):
        return "the grad mode changes between the lm_head matmul and the loss"
    return None


def autocast_reason(gm) -> Optional[str]:
    """Autocast changes the matmul's dtype behind the graph's back: decline inside it."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and "autocast" in getattr(n.target, "__name__", ""):
            return "autocast region in the graph (not supported yet)"
    for dev in ("cpu", "cuda"):
        if torch.is_autocast_enabled(dev):
            return f"autocast is enabled for {dev} (not supported yet)"
    return None


def gradients(p: Plan, which: Optional[str], budget) -> strategy.Plan:
    """How the rewritten site computes its gradients (strategy.plan, from the example values' sizes
    as hints and their requires_grad: which gradients the graph will ask for)."""
    site, chain = p.site, p.logits
    if _dtensor.involved(chain):  # the vocabulary-parallel (DTensor) rules cover the recompute ops
        return strategy.Plan("recompute", reason="no vocabulary-parallel store kernel")
    tx, tw = tval(chain.hidden), tval(chain.weight)
    v, d = chain.vd
    n = numel_hint(tx)
    n = None if n is None else n // max(1, hint(d) or 1)
    return strategy.plan(n, hint(d) or strategy.DYNAMIC_ROWS, hint(v) or strategy.DYNAMIC_ROWS, tx.dtype, tw.dtype,
                         reduction="none" if site.negate else site.reduction, needs=chain.needs,
                         label_smoothing=site.label_smoothing, softcap=chain.softcap,
                         lse_used=bool(p.lse_users), strategy=which, budget=budget)
