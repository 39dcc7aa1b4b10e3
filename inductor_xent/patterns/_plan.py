"""Whether the heads found over one lm_head's logits can be rewritten, and how: a ``SitePlan``, or a
``Decline`` with the reason. What an idiom cannot see from its own node is checked here: that the
heads read the same logits and targets (then one op call serves them all), dtypes and devices, the
rows of the targets, the other users of the logits (a z-loss ``logsumexp`` is mapped onto the op's
lse; anything else keeps the logits alive), writes in between (``_mutation.written_between``),
grad-mode changes. Then ``gradients`` picks the site's strategy (strategy.py).

Autocast (``torch.autocast`` around the compiled call, or entered inside it) leaves no node at the
matmul: Dynamo traces the lm_head as ``linear(h, W)`` of fp32 tensors whose example value is
bfloat16 (or float16). That example value says what eager computes, so the op takes the hidden
states, weight and a linear's bias cast to the matmul's dtype (``SitePlan.dtype``), as autocast casts
them, and computes the loss in fp32 as autocast's fp32 list does for ``cross_entropy``; the
gradients flow back through the casts to the fp32 parameters.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, replace
from typing import Optional, Union

import torch
from torch.fx import Node

from .. import strategy
from ..options import FLOAT_DTYPES
from . import _dtensor, _logits, _masked, _mutation
from ._fx import arg, hint, is_call, numel_hint, same, tval
from ._logits import LogitsChain
from ._site import NO_IGNORE, OWN_OP, Decline, Head, ids_base, lse_of
from ._steps import SPLITS, Permute, Slice, StackedSlice, Step, stacked, step_of

SUPPORTED_DEVICES = ("cpu", "cuda")
ESCAPE_REASON = "the logits escape: they are a graph output (the compiled function returns them)"
# Target computations after a z-loss logsumexp move up to the op with everything they need from after
# it (HF's pad + slice + contiguous + view is 4 nodes); a longer closure is not a target computation.
MAX_HOISTED = 32


@dataclass
class Returned:
    """A tensor the graph returns that follows from the raw logits the op writes (escape.py): the
    walk's nodes after ``raw_at`` up to ``walk.nodes[at]``, then ``tail`` (steps after the walk that
    only lead to the output, e.g. accelerate's ``convert_outputs_to_fp32`` upcast), each a cast, a
    view, a Python-number scale or a tanh (``Step.returnable``)."""

    walk: LogitsChain
    at: int
    tail: list[Step]  # each the only user of the one before
    # stacked heads' logits returned whole (MusicGen's ``torch.stack(heads, 1).reshape(...)``): the stack
    # and where ``walk.nodes[at]`` is among its tensors; ``tail`` starts at the stack's user
    stack: Optional[tuple[Node, int]] = None

    @property
    def node(self) -> Node:
        """The node the output reads."""
        return self.tail[-1].node if self.tail else self.walk.nodes[self.at]

    @property
    def member_steps(self) -> list[Step]:
        """The steps from the raw logits to ``walk.nodes[at]`` (the stack's tensor, when stacked)."""
        w = self.walk
        return w.steps[w.raw_at: self.at]

    @property
    def replayed(self) -> list[Step]:
        """The steps from the raw logits to ``node``, in order (the stack between, when stacked)."""
        return [*self.member_steps, *self.tail]


@dataclass
class SitePlan:
    """How to rewrite the heads over one lm_head's logits: one op, placed right before ``anchor``
    (the first node it replaces), after ``hoist``."""

    heads: list  # (Head, LogitsChain) of every head over these logits, the driver's first
    logits: LogitsChain  # the op's rows and values: the walk of the first head that is not an argmax
    anchor: Node
    hoist: list  # target computations that came after the anchor, in graph order
    lse_users: dict  # logsumexp of the same logits -> (the walk, position of the node it reads, keepdim)
    escapes: list  # other users of the logits: they keep them (allow_escaping_logits)
    owned: list  # what the rewrite erases once dead: the heads, their walks, the rows of a stacked logsumexp
    dtype: torch.dtype  # what the op computes from: the matmul's dtype (autocast's, when it casts)
    returned: list = field(default_factory=list)  # [Returned]: logits the op writes for the graph's output
    siblings: list = field(default_factory=list)  # (Head, LogitsChain) over other row slices: their own sites
    shared: int = 0  # the sites one op serves together (this one among them): lm_head weight shared (_shared.py)
    apart: str = ""  # why this site keeps its own op next to others of its weight (_shared.groups)
    # the row masks every use of the values passes (_masked.find; set right before the rewrite), or why none
    row_mask: Optional[_masked.RowMask] = None
    row_mask_why: str = ""
    # per-row heads only (log-probs, cross-entropy with reduction "none") kept by the log-probs op's
    # store (per_row_store(): the cross-entropy op stores a reduced loss only)
    per_row_store: bool = False
    # replaced nodes (heads' values, logsumexps) that eager computes without gradient inside a grad-mode
    # change (a torch.no_grad() block after the op's first head): their replacements are detached
    no_grad: frozenset = frozenset()

    @property
    def autocast(self) -> bool:
        """The matmul computes in another dtype than its operands': autocast casts them."""
        return any(tval(n).dtype != self.dtype for n in (self.logits.hidden, self.logits.weight, self.logits.bias)
                   if n is not None)

    @property
    def needs(self) -> tuple[bool, bool, bool]:
        """Which of (hidden, weight, bias) the graph will ask a gradient of: none when every head
        reads ``logits.detach()`` or is computed without gradient (``no_grad``)."""
        if all(c.detached or all(n in self.no_grad for n in _valued(h)) for h, c in self.heads):
            return (False, False, False)
        return self.logits.needs

    @property
    def first(self) -> Head:
        """The driver's head (the candidate the site was found from)."""
        return self.heads[0][0]

    @property
    def main_heads(self) -> list:
        """The heads the site's cross-entropy or log-probs op serves: all but the top-k heads (each
        its own top-k op)."""
        return [(h, c) for h, c in self.heads if h.kind not in OWN_OP]

    @property
    def log_probs_op(self) -> bool:
        """Entropy and argmax come from the log-probs op (the cross-entropy op has neither); so do
        per-row heads whose gradients it stores (``per_row_store``)."""
        return self.per_row_store or any(h.kind in ("entropy", "argmax") for h, _ in self.heads)

    @property
    def target(self) -> Optional[Node]:
        """The op's class ids (every head with a target reads the same ones)."""
        h = _with_target(self.heads)
        return None if h is None else h.target

    @property
    def ignore_index(self) -> int:
        """The heads' ignore_index (a gather of the log-probs has none: eager raises on an ignored row's
        target there, so its rows are never ignored ones)."""
        return next((h.ignore_index for h, _ in self.heads if h.target is not None and h.ignore_index != NO_IGNORE),
                    NO_IGNORE)

    @property
    def escapes_to_output(self) -> bool:
        return any(u.op == "output" for u in self.escapes)


def decide(gm, heads: list, allow_escaping: bool, can_return: bool = False,
         siblings: Optional[list] = None) -> Union[SitePlan, Decline]:
    """The rewrite of ``heads`` ((Head, LogitsChain) pairs over one matmul, the driver's first), or
    why there is none. ``can_return``: the caller hands the returned logits to escape.wrap, so
    logits that are only returned (``torch.compile(model)``) are written by the op instead.
    ``siblings``: heads over other row slices of these logits, each rewritten as a site of its own
    (their slices are not other users of the logits)."""
    siblings = siblings or []
    site = heads[0][0]
    # the op's logits: a head's that reads them as they are (an argmax, top-k or gather may read them at
    # another positive scale or temperature: its own op, or a monotone view)
    chain = next((c for h, c in heads if h.kind not in ("argmax", *OWN_OP)), heads[0][1])
    reason = _heads_reason(heads, chain) or _inputs_reason(heads, chain)
    if reason:
        return Decline(None, site.loss, reason)
    read = dict.fromkeys(n for h, c in heads for n in (*c.nodes, *h.consumed))  # the logits and what heads derive
    owned = {**read, **dict.fromkeys(n for h, _ in heads for n in (h.loss, *h.aux))}
    lse_users = _logsumexps(heads, chain, read, owned)
    theirs = {n for _, c in siblings for n in c.nodes}
    # z.split(k) whose chunks are all read by these heads or their siblings, torch.stack of heads whose
    # items of these logits only these heads read: no other user (erased once dead)
    owned.update(dict.fromkeys(u for n in read for u in n.users if is_call(u, SPLITS)
                               and all(g in read or g in theirs for g in u.users)))
    stacks = [(m, u) for m in read for u in m.users if is_call(u, (torch.stack,))]
    for m, u in stacks:
        between, tails = _stack_reads(u, m, read) or (None, None)
        if between and not tails:  # the other heads' matmuls too: dead once the last head's rewrite erases it
            owned.update(_stack_owned(u, between))
    escapes = list(dict.fromkeys(u for n in read for u in n.users
                                 if u not in owned and u not in lse_users and u not in theirs))
    if lse_users and all(h.kind in OWN_OP for h, _ in heads):
        return Decline(None, site.loss, "a logsumexp of the logits next to top-k or gather heads alone (their ops "
                                        "give no lse to map it onto)")
    if any(n not in lse_users and n not in owned for h, _ in heads for n in h.needs_lse_of):
        return Decline(None, site.loss, "a logsumexp the head subtracts does not read the same logits as the rest")
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    first = min([*(h.loss for h, _ in heads), *lse_users], key=order.__getitem__)
    anchor = _op_place(gm, order, chain, first)
    target = _with_target(heads) and _with_target(heads).target
    inputs = [chain.hidden, chain.weight, chain.bias, target, *(n for h, _ in heads for n in (h.shape_ref, h.index))]
    hoist = _late_closure([n for n in inputs if isinstance(n, Node)], order, anchor)
    if hoist and anchor is not first and any(_floating(n) for n in hoist):
        hoist = None  # out of a no_grad block a float computation would take a gradient
    # before the escape check: with allow_escaping_logits a write would still be fused wrongly
    reason = _mutation.written_between(gm, order, [h for h, _ in heads], chain, list(read), lse_users, hoist or (),
                                       place=anchor)
    returned, why_not = [], None
    if not reason and escapes and can_return:
        returned, why_not = _returnable(heads, chain, read, escapes)
        escapes = [] if returned else escapes
        owned.update(dict.fromkeys(s.node for r in returned for s in r.tail))  # dead once the output reads the op
        for r in returned:  # a stack returned whole: the graph's output reads a copy of it
            if r.stack:
                owned.update(_stack_owned(r.stack[0], _stack_reads(r.stack[0], r.walk.nodes[r.at], read)[0]))
        if why_not and not allow_escaping and any(u.op == "output" for u in escapes):
            return Decline(None, site.loss, f"{ESCAPE_REASON}, and {why_not}", logits_escape=True)
    if not reason and escapes and not allow_escaping:
        if any(u.op == "output" for u in escapes):
            return Decline(None, site.loss, ESCAPE_REASON, logits_escape=True)
        names = ", ".join(sorted({u.name for u in escapes}))
        reason = f"the logits have other users ({names}); options={{'xent.allow_escaping_logits': True}} fuses anyway"
        stacks = [u for u in escapes if is_call(u, (torch.stack,))]
        if stacks:  # stacked heads whose stack is read whole (returned, e.g. MusicGen's lm_logits.reshape)
            returned = any(_reaches_output(u) for u in stacks)
            reason = (f"the stacked heads' logits ({', '.join(u.name for u in stacks)} = torch.stack of several "
                      "lm_heads) are read whole, not one head each"
                      + (f" (they are returned by the compiled function, and {why_not})" if returned and why_not
                         else " (they are returned by the compiled function: return only the loss, or compile a "
                              "function that does, to fuse each head)" if returned else f" ({reason})"))
    if not reason and hoist is None:
        reason = "the targets are computed after a logsumexp of the logits"
    no_grad = frozenset()
    if not reason:
        replaced = [*(n for h, _ in heads for n in _valued(h)), *lse_users]
        reason = _grad_modes(gm, order, chain, anchor, replaced)
        if isinstance(reason, frozenset):
            reason, no_grad = None, reason
    if reason:
        return Decline(None, site.loss, reason)
    return SitePlan(heads, chain, anchor, hoist, lse_users, escapes, list(owned), op_dtype(chain), returned, siblings,
                    no_grad=no_grad)


def _returnable(heads: list, chain: LogitsChain, read: dict, escapes: list) -> tuple[list, Optional[str]]:
    """([Returned], None) when the op can write the logits the graph returns (escape.py), else
    ([], why not). Every other user of the logits must lead only to the graph's output, through
    casts, views, Python-number scales and a softcap's tanh from the raw logits (matmul + bias),
    rows in the matmul's order."""
    if any(h.kind in ("entropy", "argmax") for h, _ in heads):
        return [], "the log-probs op (entropy, argmax) does not write the logits"
    if any(h.kind in OWN_OP for h, _ in heads):
        return [], "the top-k and gather ops do not write the logits"
    if _dtensor.involved(chain):
        return [], "the vocabulary-parallel op does not write the logits"
    if chain.weight_scale is not None:
        return [], "a tensor scale folded into the weight changes the op's raw logits"
    if chain.bias_shift or chain.row_scaled:
        return [], "a number added before the softcap, or a per-row temperature, changes the op's raw logits"
    if any(isinstance(op, (Slice, Permute)) and not _keeps_rows(op) for _, op in chain.shape_ops):
        return [], "the loss reads a slice or permutation of the rows of the returned logits"
    returned = []
    for n in read:
        for u in (u for u in n.users if u in escapes):
            walk = next((c for _, c in heads if n in c.nodes), None)
            if walk is None or walk.nodes.index(n) < walk.raw_at:
                return [], f"the returned {n.name} is not the lm_head's output (with its bias) or computed from it"
            if is_call(u, (torch.stack,)):  # stacked heads returned whole (MusicGen)
                found, stack = _stacked_tails(u, n, read)
                if isinstance(found, str):
                    return [], found
            else:
                found, stack = [_tail(n, u)], None
            for tail in found:
                if tail is None:
                    return [], f"the logits have other users in the graph than its output ({u.name})"
                r = Returned(walk, walk.nodes.index(n), tail, stack)
                # the graph replays these steps on the op's logits, escape.EscapedLogits their math in its backward
                if any(not s.returnable for s in r.replayed):
                    return [], f"the returned {r.node.name} is computed from the lm_head's output by more than " \
                               "casts, views and scales"
                returned.append(r)
    return returned, None


def _stacked_tails(stack: Node, n: Node, read: dict) -> tuple:
    """([tail, ...], (stack, k)) for ``n``, tensor ``k`` of ``stack`` (``torch.stack`` of several heads'
    logits), when the stack's users are takes of one head each (``_stack_reads``) and steps leading
    only to the graph's output (each tail's first step reads the stack); (why not, None) otherwise."""
    between, tails = _stack_reads(stack, n, read) or (None, None)
    tensors, dim = arg(stack, 0, "tensors"), arg(stack, 1, "dim", 0)
    if between is None or not tails:
        return f"the stacked heads' logits ({stack.name}) have other users than one head each and the output", None
    if not isinstance(dim, int) or not isinstance(tensors, (list, tuple)) or list(tensors).count(n) != 1:
        return f"{n.name} is not stacked once along a constant dimension ({stack.name})", None
    return [_tail(stack, t) for t in tails], (stack, list(tensors).index(n))


def _stack_owned(stack: Node, between: list) -> dict:
    """What the rewrite may erase once a stack of heads is dead: the nodes from it to the takes, and
    its tensors (the other heads' matmuls, dead once each head's rewrite erases its own take)."""
    return dict.fromkeys([*between, *(t for t in arg(stack, 0, "tensors") if isinstance(t, Node))])


def _keeps_rows(op: Step) -> bool:
    """A slice that keeps every row, from static sizes (MusicGen's ``logits[:, :, -T:]`` of T rows)."""
    if not isinstance(op, Slice) or tval(op.src) is None:
        return False
    shape = tval(op.src).shape
    for idx in (op.index if isinstance(op, StackedSlice) else (op.index,)):
        for i, size in zip(idx if isinstance(idx, tuple) else (idx,), shape):
            try:
                if not isinstance(i, slice) or not isinstance(size, int) or i.indices(size) != (0, size, 1):
                    return False
            except TypeError:  # symbolic bounds
                return False
    return True


def _reaches_output(node: Node, limit: int = 64) -> bool:
    """True when the graph's output reads ``node`` or what it computes (a bounded search)."""
    seen, frontier = set(), [node]
    while frontier and len(seen) < limit:
        n = frontier.pop()
        if n.op == "output":
            return True
        if n not in seen:
            seen.add(n)
            frontier.extend(n.users)
    return False


def _stack_reads(stack: Node, n: Node, read: dict) -> Optional[tuple[list, list]]:
    """(The nodes from ``stack`` (a ``torch.stack`` with ``n`` among its tensors) to the heads that take
    one tensor of it (``_steps.stacked``), the stack's other users), when every use of it is such a
    take or a slice keeping the stacked dimension, or (a user of the stack itself) not a getitem (the
    start of a tail to the output, MusicGen's ``reshape``), and the takes of ``n`` are among ``read``
    (the others read other heads' logits); else None."""
    between, frontier, tails = [stack], [stack], []
    while frontier:
        cur = frontier.pop()
        for g in cur.users:
            if not is_call(g, (operator.getitem,)):
                if cur is not stack:
                    return None
                tails.append(g)
                continue
            picked = stacked(g.args[0], g.args[1])
            if picked is not None:
                if picked[0] is n and g not in read:
                    return None
                continue
            if stacked(g, _whole(stack)) is None:  # not a slice that keeps every stacked tensor
                return None
            between.append(g)
            frontier.append(g)
    return between, tails


def _whole(stack: Node) -> tuple:
    """An index taking tensor 0 of ``stack`` whole: probes that slices keep the stacked dimension."""
    dim = arg(stack, 1, "dim", 0)
    return (*(slice(None),) * dim, 0) if isinstance(dim, int) else (0,)


def _tail(n: Node, u: Node) -> Optional[list[Step]]:
    """The steps from ``u`` (a user of ``n``) to the node the graph's output reads, when each is a
    step of the logits (``_steps.step_of``) whose only user is the next or the output; [] when ``u``
    is the output; None otherwise."""
    tail, src = [], n
    while u.op != "output":
        step = step_of(u)
        if step is None or step.src is not src or len(u.users) != 1:
            return None
        tail.append(step)
        src, u = u, next(iter(u.users))
    return tail


def _with_target(heads: list) -> Optional[Head]:
    return next((h for h, _ in heads if h.target is not None), None)


def _logsumexps(heads: list, chain: LogitsChain, read: dict, owned: dict) -> dict:
    """The logsumexps of the final logits that read the op's lse instead: the heads' own (first: a
    stacked one's rows join ``read`` and ``owned``) and the other users' (a z-loss). One that only
    the replaced heads read joins ``owned`` instead (erased with them)."""
    values = [c for _, c in heads if _logits.same_logits(c, chain)]
    lse_users: dict = {}
    for u in dict.fromkeys([*(n for h, _ in heads for n in h.needs_lse_of),
                            *(u for c in values for n in c.nodes for u in n.users)]):
        m = lse_of(u) if u not in owned else None
        at = m and next(((c, c.nodes.index(m[0])) for c in values if m[0] in c.nodes[c.final_from:]), None)
        if not at:
            continue
        read.update(dict.fromkeys(m[2]))
        owned.update(dict.fromkeys(m[2]))
        if all(w in owned for w in u.users):
            read[u] = owned[u] = None
        else:
            lse_users[u] = (*at, m[1])
    return lse_users


def _heads_reason(heads: list, chain: LogitsChain) -> Optional[str]:
    """Why these heads cannot share one op call, or None."""
    # a top-k head is an op of its own: its own scale, softcap and shift, the site's rows and operands
    if any(not _logits.same_logits(chain, c, monotone=h.kind in ("argmax", *OWN_OP)) for h, c in heads):
        return ("heads of one lm_head read different logits (another scale or temperature, softcap or rows): "
                "one op computes one set; compute every head from the same logits tensor to fuse")
    if any(h.kind in OWN_OP and (c.row_scaled != chain.row_scaled or c.bias_shift != chain.bias_shift)
           for h, c in heads):
        return ("a top-k or gather head over other logits than the site's (a per-row temperature or a number added "
                "before the cap)")
    with_target = [h for h, _ in heads if h.target is not None]
    if len({h.ignore_index for h in with_target} - {NO_IGNORE}) > 1:
        return "heads of the same logits with different ignore_index"
    if any(ids_base(h.target) is not ids_base(with_target[0].target) for h in with_target[1:]):
        return "heads of the same logits read different targets (one op takes one class id per row)"
    if len(heads) > 1 and any(h.label_smoothing for h in with_target):  # the op's rows would be smoothed for all
        return "label smoothing in a cross-entropy next to another head of the same logits"
    if any(h.kind in ("entropy", "argmax") for h, _ in heads) and _dtensor.involved(chain):
        return "vocabulary parallel: entropy and argmax heads (the log-probs op has no DTensor rule)"
    if any(h.kind in OWN_OP for h, _ in heads) and _dtensor.involved(chain):
        return "vocabulary parallel: a top-k or gather head (their ops have no DTensor rule)"
    if any(h.kind in ("topk", "gathered") and h.needs_lse_of for h, _ in heads) and all(h.kind in OWN_OP
                                                                                         for h, _ in heads):
        what = "a top-k" if any(h.kind == "topk" and h.needs_lse_of for h, _ in heads) else "a gather"
        return f"{what} of z − logsumexp(z) with no other head (spell it log_softmax(z, -1))"
    return None


def _inputs_reason(heads: list, chain: LogitsChain) -> Optional[str]:
    """Why the op cannot take these inputs (dtypes, devices, DTensor layouts, rows), or None."""
    tx, tw = tval(chain.hidden), tval(chain.weight)
    tb = tval(chain.bias) if chain.bias is not None else None
    with_target = [h for h, _ in heads if h.target is not None]
    dtype = op_dtype(chain)
    if dtype not in FLOAT_DTYPES:
        return f"unsupported logits dtype {dtype}"
    if any(t.dtype not in FLOAT_DTYPES for t in (tx, tw, tb) if t is not None):
        return f"unsupported dtypes: hidden {tx.dtype}, weight {tw.dtype}, bias {None if tb is None else tb.dtype}"
    # autocast casts the matmul's operands (a linear's bias among them), never a bias added after it
    cast_bias = tb is not None and chain.bias is arg(chain.matmul, 2, "bias") and is_call(chain.matmul, _logits.LINEAR)
    if tb is not None and not cast_bias and tb.dtype != dtype:
        return f"mixed dtypes: logits {dtype}, bias {tb.dtype} added after the matmul"
    devices = {t.device for t in (tx, tw, tb, *(tval(h.target) for h in with_target),
                                  *(tval(h.index) for h, _ in heads if h.index is not None)) if t is not None}
    if len(devices) != 1 or next(iter(devices)).type not in SUPPORTED_DEVICES:
        return f"unsupported device(s) {sorted(map(str, devices))}"
    dtensor = with_target and _dtensor.decline_reason(with_target[0], chain)  # tensor parallelism: a layout we can run?
    if dtensor:
        return dtensor
    for h in with_target:
        tt, tz = tval(h.target), tval(h.logits)
        if not same(tt.numel(), math.prod(tz.shape[:-1])):
            return f"the targets {tuple(tt.shape)} do not give one class id per row of the logits {tuple(tz.shape)}"
    # (a top-k's result is a tuple: its input's dtype is its values')
    if any(tval(arg(h.loss, 0, "input") if h.kind == "topk" else h.loss).dtype == torch.float64
           for h, _ in heads) and dtype != torch.float64:
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


def _mode_changes(gm, order: dict) -> list:
    """The graph's grad-mode switches (``torch.no_grad()`` / ``enable_grad()`` blocks), in order."""
    return sorted(gm.graph.find_nodes(op="call_function", target=torch._C._set_grad_enabled, sort=False),
                  key=order.__getitem__)


def _mode_at(changes: list, order: dict, node: Node) -> Optional[bool]:
    """The grad mode ``node`` runs in: the last switch before it; before the first, the other mode
    (Dynamo records a switch only where the mode it traces in changes); None without switches."""
    before = [c for c in changes if order[c] < order[node]]
    if before:
        return bool(arg(before[-1], 0, "mode"))
    return not arg(changes[0], 0, "mode") if changes else None


def _op_place(gm, order: dict, chain: LogitsChain, first: Node) -> Node:
    """The node the op is placed before: the first node it replaces, or where that runs in another
    grad mode than the lm_head matmul (a head inside a ``torch.no_grad()`` block first in the graph),
    the first mode switch after the matmul: the op runs in the matmul's mode (when all it reads is
    computed before that switch)."""
    changes = _mode_changes(gm, order)
    between = [c for c in changes if order[chain.matmul] < order[c] < order[first]]
    if not between or _mode_at(changes, order, first) == _mode_at(changes, order, chain.matmul):
        return first
    # what the op reads besides the logits' own nodes (a temperature tensor, a scale) must exist there
    # already; else it stays at its first node (and _grad_modes says whether that mode will do)
    chain_nodes = set(chain.nodes)
    read = {a for n in chain.nodes for a in n.all_input_nodes if a not in chain_nodes}
    return between[0] if all(order[a] < order[between[0]] for a in read) else first


def _grad_modes(gm, order: dict, chain: LogitsChain, anchor: Node, replaced: list) -> Union[frozenset, str, None]:
    """Where grad-mode switches lie between the lm_head matmul and the last node the op replaces: the
    replaced nodes (``replaced``) whose eager values carry no gradient, to detach (TRL's entropy or
    accuracy under no_grad next to the trained loss; the op runs in the matmul's mode, ``_op_place``);
    a reason when one that carries a gradient runs in another mode than the op; None without switches."""
    changes = _mode_changes(gm, order)
    last = max(replaced, key=order.__getitem__)
    if not any(order[chain.matmul] < order[n] < order[last] for n in changes):
        return None
    no_grad = frozenset(n for n in replaced if not _carries_grad(n))
    op_mode = _mode_at(changes, order, anchor)
    if any(_mode_at(changes, order, n) != op_mode for n in replaced if n not in no_grad):
        return ("the grad mode changes between the lm_head matmul and a head that trains (a torch.no_grad() "
                "or enable_grad() block between them): read the logits through .detach() instead, e.g. "
                "ref = logits.detach().log_softmax(-1) for a head without gradient, or "
                "F.linear(h, W).detach() for logits that need none, to fuse")
    return no_grad


def _floating(n: Node) -> bool:
    t = tval(n)
    return t is None or t.is_floating_point()


def _valued(h: Head) -> list:
    """The nodes whose values the rewrite replaces for ``h``: its loss, or a top-k's items."""
    return list(h.aux) if h.kind == "topk" else [h.loss]


def _carries_grad(n: Node) -> bool:
    t = tval(n)
    return t is None or (isinstance(t, torch.Tensor) and t.requires_grad)


def storing_gather(p: SitePlan):
    """The one gather head of log-probs (or probabilities) that may keep its logits for its backward:
    where the site has no loss or log-prob op (whose strategy would hold memory of its own) and no
    other gather of log-probs (each op would keep the same logits); None otherwise."""
    gathers = [h for h, _ in p.heads if h.kind == "gathered" and h.normalised != "logits"]
    return gathers[0] if len(gathers) == 1 and not p.main_heads else None


def per_row_store(p: SitePlan, how: strategy.GradientPlan) -> bool:
    """Whether per-token heads alone (``_per_row_heads``: no entropy or argmax, which the log-probs op
    serves anyway) go to the log-probs op because ``how`` (``gradients``' plan) stores: the cross-entropy
    op's store keeps a reduced loss only. Sets ``SitePlan.per_row_store`` before the rewrite."""
    return how.strategy == "store" and bool(p.main_heads) \
        and not any(h.kind in ("entropy", "argmax") for h, _ in p.heads) and _per_row_heads(p)


def _per_row_heads(p: SitePlan) -> bool:
    """Every head the op serves is per row (log-probs, a cross-entropy with reduction "none" and no
    label smoothing: RL's token log-probs) and the log-probs op can serve them (no returned logits)."""
    return not p.returned and all(
        h.kind == "log_probs" or (h.kind == "cross_entropy" and h.reduction == "none" and not h.label_smoothing)
        for h, _ in p.main_heads)


def op_dtype(chain: LogitsChain) -> torch.dtype:
    """The dtype the op computes from: the matmul's example value's, which under autocast is
    autocast's dtype (bfloat16, float16) while the hidden states and weight are fp32."""
    return tval(chain.matmul).dtype


def gradients(p: SitePlan, which: Optional[str], budget) -> strategy.GradientPlan:
    """How the rewritten site computes its gradients (strategy.choose, from the example values' sizes
    as hints and their requires_grad: which gradients the graph will ask for)."""
    main = p.main_heads
    if not main and storing_gather(p) is not None:  # its logits kept for its backward (strategy.choose_gather)
        tx, (v, d) = tval(p.logits.hidden), p.logits.vd
        n = numel_hint(tx)
        n = None if n is None else n // max(1, hint(d) or 1)
        how = strategy.choose_gather(n, hint(d) or strategy.DYNAMIC_ROWS, hint(v) or strategy.DYNAMIC_ROWS, p.dtype,
                                     needs=p.needs, log_probs=True, strategy=which, budget=budget,
                                     device=tx.device.type)
        if how.strategy == "store" and any(h.kind == "topk" for h, _ in p.heads):  # (its op keeps nothing)
            how = replace(how, reason="the top-k op recomputes the logits in its backward")
        return how
    if not main:
        ops = list(dict.fromkeys("gather" if h.kind == "gathered" else "top-k" for h, _ in p.heads))
        what = f"the {ops[0]} op recomputes" if len(ops) == 1 else f"the {' and '.join(ops)} ops recompute"
        return strategy.GradientPlan("recompute", reason=f"{what} the logits in their backward"
                                     if len(ops) > 1 else f"{what} the logits in its backward")
    site, chain = main[0][0], p.logits
    if _dtensor.involved(chain):  # the vocabulary-parallel (DTensor) rules cover the recompute ops
        return strategy.GradientPlan("recompute", reason="no vocabulary-parallel store kernel")
    tx = tval(chain.hidden)
    v, d = chain.vd
    n = numel_hint(tx)
    n = None if n is None else n // max(1, hint(d) or 1)
    def per_row() -> strategy.GradientPlan:
        return strategy.choose_log_probs(n, hint(d) or strategy.DYNAMIC_ROWS, hint(v) or strategy.DYNAMIC_ROWS,
                                         p.dtype, needs=p.needs, strategy=which, budget=budget,
                                         device=tx.device.type)

    if p.log_probs_op or _per_row_heads(p):  # per-row heads: the log-probs op's own store (strategy.py)
        return per_row()
    reduced = len(main) == 1 and site.kind == "cross_entropy"  # store gives one reduced loss
    return strategy.choose(n, hint(d) or strategy.DYNAMIC_ROWS, hint(v) or strategy.DYNAMIC_ROWS, p.dtype, p.dtype,
                           reduction=site.reduction if reduced else "none", needs=p.needs,
                           label_smoothing=site.label_smoothing, softcap=chain.softcap,
                           lse_used=bool(p.lse_users), strategy=which, budget=budget, device=tx.device.type)
