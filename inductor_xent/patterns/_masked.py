"""Rows nobody reads: a row mask downstream of a log-probs site (issue 24, RL losses).

RL losses mask their per-token terms after the head, in the loss (TRL's GRPO, verl's ``masked_mean``,
OpenRLHF)::

    ratio = torch.exp(log_probs - old_log_probs)
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    loss = (per_token * completion_mask).sum() / completion_mask.sum()

also spelled ``torch.where(mask, x, 0)`` and ``x.masked_fill(~mask, 0)``. When every use of a site's
per-row values (log-probs, entropy, a cross-entropy with ``reduction="none"``) reaches the rest of the
graph only through such *gates* (elementwise math and row-major views on the way), a row that every
gate zeroes is read by nobody: the op skips it as it skips ``ignore_index`` rows (its ids become the
op's ignore_index there; its values are 0). ``find`` proves that walk and returns the ``RowMask``.

A gate ``x * mask`` is eager's 0 on those rows only where eager's ``x`` is finite. A skipped row's
stand-in values (log-prob 0, entropy 0) may make ``x`` overflow where eager's did not (``exp(0 −
old)`` with ``old < −88``), so the rewrite makes each multiply gate ``(x * mask).masked_fill(mask ==
0, 0)``: eager's value wherever eager's is finite. Where eager's term of a masked row is inf or NaN
(NaN hidden states in the padding, say), eager's loss is NaN and ours is the loss without that row;
and a masked row's zero may have the other sign (eager's ``lp * 0`` is −0.0, ours +0.0), which only
sign-sensitive math (``atan2``, ``1 / x``) can see. ``INDUCTOR_XENT_SKIP_IGNORED=0`` keeps eager's
(no mask is applied then).
An argmax (token accuracy) is followed the same way, its stand-in 0; ``argmax == labels`` also
settles the rows whose label is negative (an ignore_index: eager's comparison is False there whatever
the argmax), and a reduced cross-entropy of the same op its ``ignore_index`` rows (TRL's SFT loss with
``((pred == y) & (y != -100)).sum()``).
The backward never reads a skipped row's incoming gradient (the kernels and chunks mask it by the
target), so a NaN made there by the stand-in values goes nowhere.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch.fx import Node

from .. import config
from . import _dtensor, _mutation
from ._fx import Emitter, arg, is_call, number, same, tval
from ._site import NO_IGNORE

# elementwise calls that keep each row's value in its place (when the output has the shape of every
# operand the walk reached: no broadcast spreads a row)
ELEMENTWISE = (
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow, operator.abs,
    operator.gt, operator.lt, operator.ge, operator.le, operator.eq, operator.ne, operator.and_, operator.or_,
    operator.invert, torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.exp, torch.log, torch.log1p,
    torch.expm1, torch.exp2, torch.sigmoid, torch.tanh, torch.clamp, torch.clip, torch.clamp_min, torch.clamp_max,
    torch.maximum, torch.minimum, torch.where, torch.abs, torch.square, torch.sqrt, torch.rsqrt, torch.pow,
    torch.sign, torch.gt, torch.lt, torch.ge, torch.le, torch.eq, torch.ne, torch.logical_and, torch.logical_or,
    torch.logical_not, torch.relu, torch.nn.functional.relu, torch.nn.functional.softplus,
    torch.nn.functional.logsigmoid, torch.masked_fill,
    "add", "sub", "mul", "div", "neg", "exp", "log", "log1p", "expm1", "sigmoid", "tanh", "clamp", "clip",
    "clamp_min", "clamp_max", "abs", "square", "sqrt", "rsqrt", "pow", "sign", "gt", "lt", "ge", "le", "eq", "ne",
    "logical_and", "logical_or", "logical_not", "relu", "masked_fill", "detach",
    "float", "double", "half", "bfloat16", "to", "type_as",
)
# row-major views: element i of the result is element i of the input, whatever the shape
VIEWS = (torch.reshape, torch.flatten, torch.squeeze, torch.unsqueeze,
         "view", "reshape", "flatten", "squeeze", "unsqueeze", "view_as", "reshape_as", "contiguous")
# calls that read a tensor's shape (and dtype), not its values: of their first argument, of their second
SHAPE_READS = (torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, "size", "dim", "numel",
               "new_zeros", "new_ones", "new_empty", "new_full")
SHAPE_READS_OF_OTHER = ("expand_as", "type_as", "view_as", "reshape_as")
# torch.min(a, b) / torch.max(a, b) of two tensors are elementwise (TRL's -torch.min(loss1, loss2));
# with a dim they reduce
MIN_MAX = (torch.min, torch.max, "min", "max")
MULTIPLY = (operator.mul, torch.mul, "mul")
DIVIDE = (operator.truediv, torch.div, "div")
AND = (operator.and_, torch.logical_and, "logical_and")
WHERE = (torch.where,)
EQUAL = (operator.eq, torch.eq, "eq")
MASKED_FILL = (torch.masked_fill, "masked_fill")
ZEROS = (torch.zeros_like, "new_zeros")
# grad-mode and autocast switches (a mask of integers or booleans moves across them unchanged)
MODE_SWITCHES = (torch._C._set_grad_enabled, torch.amp.autocast_mode._enter_autocast,
                 torch.amp.autocast_mode._exit_autocast)
# the walk gives up past this many nodes, the skip condition past this many clauses
WALK_LIMIT = 2_000
CLAUSE_LIMIT = 64

# A row's "settled" condition at a node: where the node's value no longer depends on the site's values
# (a gate zeroed it). A monotone formula over the gates' zeroing conditions, in conjunctive normal form:
# a set of clauses, each a set of gate keys (kind, mask) of which any one zeroes the row. NEVER: a row is
# never settled (one empty clause).
NEVER = frozenset([frozenset()])


def _or(f: frozenset, key: tuple) -> frozenset:
    return frozenset(c | {key} for c in f)


def _and(fs: list) -> frozenset:
    clauses = set().union(*fs)
    return frozenset(c for c in clauses if not any(o < c for o in clauses))


@dataclass
class Gate:
    """A node that zeroes the rows its mask zeroes: ``x * mask`` or ``x & mask`` (``kind`` "mul"),
    ``torch.where(cond, x, 0)`` ("where"), ``torch.where(cond, 0, x)`` or ``x.masked_fill(cond, 0)``
    ("where_not"); ``argmax == labels`` ("negative": False wherever a label is negative, an
    ignore_index, whatever the argmax, which is in [0, V) in eager and 0 on a skipped row); a
    reduced cross-entropy's own ``ignore_index`` rows ("ignore": ``node`` is the head, ``mask`` its
    targets). ``mask`` has the rows' shape and no path from the site."""

    node: Node
    kind: str
    mask: Node

    @property
    def key(self) -> tuple:
        return (self.kind, self.mask)


@dataclass
class RowMask:
    """The rows the op may skip: those where every use of the site's values has settled (``skip``, in
    conjunctive normal form over gate keys), the gates whose keys it names, the masks' computations
    after the op's place (in graph order: moved before it)."""

    skip: frozenset
    gates: list  # [Gate] of the keys in ``skip``, in graph order
    hoist: list
    ignore_index: int = NO_IGNORE  # the site's (the "ignore" keys': rows whose target is it)

    def _rank(self) -> dict:
        """Each gate key's place: the graph order of its first gate."""
        return {g.key: i for i, g in reversed(list(enumerate(self.gates)))}

    def describe(self) -> str:
        """The masks by the names the user gave them, as the rows they keep (``masked_fill(~m, 0)`` keeps ``m``)."""
        keys = sorted({k for c in self.skip for k in c}, key=self._rank().__getitem__)
        said = {"where_not": lambda m: _not(_name(m)), "negative": lambda m: f"{_name(m)} >= 0",
                "ignore": lambda m: f"{_name(m)} != {self.ignore_index}"}
        return ", ".join(f"`{said.get(kind, _name)(m)}`" for kind, m in keys)

    def masked_ids(self, e: Emitter, ids: Node, ignore_index: int = NO_IGNORE) -> Node:
        """``ids`` with ``ignore_index`` (the op's) on the rows the op skips, (N,) in its row order."""
        rank = self._rank()  # keys and clauses in graph order: the same graph every run
        zero = {}
        for kind, m in sorted({k for c in self.skip for k in c}, key=rank.__getitem__):
            if kind == "where_not":
                z = m
            elif kind == "negative":
                z = e.call(operator.lt, m, 0)
            elif kind == "ignore":
                z = e.call(operator.eq, m, self.ignore_index)
            elif kind == "where" and tval(m).dtype == torch.bool:
                z = e.call(torch.logical_not, m)
            else:
                z = e.call(operator.eq, m, 0)
            zero[(kind, m)] = e.method("reshape", z, -1)
        skip = None
        for clause in sorted(self.skip, key=lambda c: sorted(rank[k] for k in c)):
            any_ = None
            for k in sorted(clause, key=rank.__getitem__):
                any_ = zero[k] if any_ is None else e.call(torch.logical_or, any_, zero[k])
            skip = any_ if skip is None else e.call(torch.logical_and, skip, any_)
        return e.call(torch.where, skip, ignore_index, ids)

    def seal(self, graph) -> None:
        """Each floating multiply gate made ``(x * mask).masked_fill(mask == 0, 0)``: 0 on a skipped
        row whatever its stand-in value made of ``x`` (module docstring)."""
        for g in self.gates:
            t = tval(g.node)
            if g.kind != "mul" or t is None or not t.dtype.is_floating_point:
                continue
            e = Emitter(graph, g.node.next, g.node)
            fill = e.method("masked_fill", g.node, e.call(operator.eq, g.mask, 0), 0)
            g.node.replace_all_uses_with(fill, delete_user_cb=lambda u, fill=fill: u is not fill)


def find(gm, plan) -> Union[RowMask, str]:
    """The ``RowMask`` of ``plan``'s site (a ``_plan.SitePlan``), or why its op computes every row."""
    if not config.skip_ignored_rows():
        return "INDUCTOR_XENT_SKIP_IGNORED=0"
    walked = [h for h, _ in plan.main_heads if h.kind in ("log_probs", "entropy", "argmax")
              or (h.kind == "cross_entropy" and h.reduction == "none")]
    # a reduced loss reads every row but its ignore_index ones (the cross-entropy op skips those itself;
    # next to an entropy or argmax, which the log-probs op serves, the rows its other heads leave too)
    reduced = [h for h, _ in plan.main_heads if not any(h is w for w in walked)]
    if not walked or (reduced and not plan.log_probs_op):
        return "not a log-probs site"
    if reduced and plan.ignore_index == NO_IGNORE:
        return "a reduced cross-entropy without ignore_index reads every row"
    if plan.returned:
        return "the compiled function returns the logits"
    if plan.lse_users or plan.escapes or plan.siblings or _dtensor.involved(plan.logits):
        return "the logits have other users"
    starts = [h.loss for h in walked]
    if any(tval(n) is None for n in starts):
        return "a head's value has no example"
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    found = _walk(starts, set(plan.owned))
    if isinstance(found, str):
        return found
    reached, sinks = found
    argmaxes = {h.loss for h in walked if h.kind == "argmax"}  # and their row-major views, in graph order
    for u in sorted(reached, key=order.__getitem__):
        if _view(u) and u.all_input_nodes and u.all_input_nodes[0] in argmaxes:
            argmaxes.add(u)
    gates = {u: g for u in reached if (g := _gate(u, reached, argmaxes)) is not None}
    settled = {n: NEVER for n in starts}
    for u in sorted(reached - set(starts), key=order.__getitem__):
        g = gates.get(u)
        if g is not None:
            settled[u] = _or(settled[_gated(g, reached)], g.key)
        elif not _view(u) and any(a in reached and not _same_shape(tval(a), tval(u))
                                           for a in u.all_input_nodes):
            return f"{u.name} ({_spelling(u)}) broadcasts the values"
        else:
            settled[u] = _and([settled[a] for a in u.all_input_nodes if a in reached])
        if len(settled[u]) > CLAUSE_LIMIT:
            return "the values' row masks are too many to combine"
    skip, why = None, None
    for h in reduced:  # settled on its ignore_index rows
        g = Gate(h.loss, "ignore", plan.target)
        gates[h.loss] = g
        skip = frozenset([frozenset([g.key])]) if skip is None else _and([skip, frozenset([frozenset([g.key])])])
    for u, n in sinks:
        skip = settled[n] if skip is None else _and([skip, settled[n]])
        if frozenset() in skip:
            why = _reads(u)
            break
    if why or skip is None or not sinks:
        return why or "no use of the values passes a row mask"
    keys = {k for c in skip for k in c}
    used = sorted((g for g in gates.values() if g.key in keys), key=lambda g: order[g.node])
    late = _late_masks(gm, used, order, plan.anchor, reached | set(plan.owned))
    if isinstance(late, str):
        return late
    last = max(order[u] for u, _ in sinks)
    writer = next((n for n in gm.graph.nodes if order[plan.anchor] <= order[n] <= last and _mutation.writes(n)),
                  None)
    if writer is not None:
        return f"{writer.name} writes a tensor between the op and the row masks"
    return RowMask(skip, used, late, int(plan.ignore_index))


def _walk(starts: list, owned: set) -> Union[tuple[set, list], str]:
    """(The nodes that keep each of the site's rows in its place, the other users of them as (user,
    node read)), or why the values cannot be followed."""
    reached, sinks, frontier = set(starts), [], list(starts)
    while frontier:
        n = frontier.pop()
        for u in n.users:
            if u in reached or _reads_shape_of(u, n):
                continue
            if len(reached) > WALK_LIMIT:
                return "the values' uses are too many to follow"
            if u in owned:
                return f"{u.name} reads the values and the logits"
            if _mutation.writes(u):
                return f"{u.name} ({_spelling(u)}) writes in place where the values flow"
            if not _row_wise(u, n):
                sinks.append((u, n))
                continue
            reached.add(u)
            frontier.append(u)
    for u in reached - set(starts):  # its gradient on a skipped row would be made of the stand-in values
        grad = next((a for a in u.all_input_nodes if a not in reached and getattr(tval(a), "requires_grad", False)),
                    None)
        if grad is not None:
            return f"{u.name} ({_spelling(u)}) combines the values with {grad.name}, which requires grad"
    # a user found before all of its reached inputs were: a sink by one input, reached by another
    sinks = [(u, n) for u, n in sinks if u not in reached]
    return reached, sinks


def _gated(g: Gate, reached: set) -> Node:
    """The gate's input the values reach."""
    return next(a for a in g.node.all_input_nodes if a in reached)


def _reads_shape_of(u: Node, n: Node) -> bool:
    """``u`` reads only the shape or dtype of ``n`` (``torch.zeros_like(lp)``, ``adv.expand_as(lp)``)."""
    if is_call(u, SHAPE_READS):
        return u.args[:1] == (n,) and n not in u.args[1:] and n not in u.kwargs.values()
    if is_call(u, SHAPE_READS_OF_OTHER):
        return u.args[0] is not n and n in u.args[1:]
    return False


def _gate(u: Node, reached: set, argmaxes: frozenset = frozenset()) -> Optional[Gate]:
    """``u`` (a node the walk reached) as a gate of one of its inputs the walk reached, or None.
    ``argmaxes``: the argmax heads' values and their row-major views."""
    out = tval(u)
    if is_call(u, EQUAL) and len(u.args) == 2 and not u.kwargs:
        a, b = u.args
        for x, m in ((a, b), (b, a)):
            t = tval(m)
            if x in argmaxes and _is_mask(m, out, reached) and not t.dtype.is_floating_point and t.dtype != torch.bool:
                return Gate(u, "negative", m)
    elif is_call(u, MULTIPLY + AND) and len(u.args) == 2 and not u.kwargs:
        a, b = u.args
        for x, m in ((a, b), (b, a)):
            if x in reached and _is_mask(m, out, reached) and _same_shape(tval(x), out):
                return Gate(u, "mul", m)
    elif is_call(u, WHERE) and len(u.args) == 3 and not u.kwargs:
        cond, a, b = u.args
        if _is_mask(cond, out, reached):
            if a in reached and _zero(b):
                return Gate(u, "where", cond)
            if b in reached and _zero(a):
                return Gate(u, "where_not", cond)
    elif is_call(u, MASKED_FILL) and arg(u, 0, "input") in reached:
        cond = arg(u, 1, "mask")
        if _zero(arg(u, 2, "value")) and _is_mask(cond, out, reached):
            return Gate(u, "where_not", cond)
    return None


def _is_mask(m, like: Optional[torch.Tensor], reached: set) -> bool:
    """``m`` can gate a value shaped ``like``: a tensor of that shape, without gradient, that the
    site's values do not reach."""
    t = tval(m)
    return isinstance(m, Node) and m not in reached and t is not None and not t.requires_grad and _same_shape(t, like)


def _zero(x) -> bool:
    return number(x) == 0.0 or (isinstance(x, Node) and is_call(x, ZEROS))


def _same_shape(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    return (a is not None and b is not None and a.dim() == b.dim()
            and all(same(p, q) for p, q in zip(a.shape, b.shape)))


def _row_wise(u: Node, n: Node) -> bool:
    """``u`` keeps each row of ``n`` (a node the walk reached) in its place: a row-major view, or
    elementwise without broadcasting ``n``."""
    out = tval(u)
    if out is None or u.op == "output":
        return False
    if is_call(u, VIEWS):  # (not a reinterpreting x.view(dtype): other elements per row)
        return not any(isinstance(a, torch.dtype) for a in (*u.args, *u.kwargs.values()))
    if _row_index(u):
        return True
    if is_call(u, DIVIDE) and not tval(n).dtype.is_floating_point:
        return False  # a stand-in 0 could raise in an integer division where eager's values did not
    binary = is_call(u, MIN_MAX) and len(u.args) == 2 and not u.kwargs and all(isinstance(a, Node) for a in u.args)
    return (binary or is_call(u, ELEMENTWISE)) and _same_shape(tval(n), out)


def _view(u: Node) -> bool:
    """``u`` is a row-major view of its input: a view call or an indexing that keeps every element."""
    return is_call(u, VIEWS) or _row_index(u)


def _row_index(u: Node) -> bool:
    """``x[idx]`` that keeps every element of ``x`` in row-major order: ``idx`` made of full slices,
    ``...``, ``None`` and 0 or -1 on dimensions of size 1 (the element count unchanged), as
    ``gather(lp, -1, ids[:, None])[:, 0]`` drops the gathered column."""
    if not (u.op == "call_function" and u.target is operator.getitem and len(u.args) == 2 and not u.kwargs):
        return False
    src, out = tval(u.args[0]), tval(u)
    if not (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)):
        return False
    idx = u.args[1] if isinstance(u.args[1], tuple) else (u.args[1],)
    kept = all(i is Ellipsis or i is None or (type(i) is int and i in (0, -1))
               or (isinstance(i, slice) and (i.start, i.stop, i.step) == (None, None, None)) for i in idx)
    return kept and same(src.numel(), out.numel())


def _reads(u: Node) -> str:
    if u.op == "output":
        return "the values are returned by the compiled function"
    return f"{u.name} ({_spelling(u)}) reads the values before a row mask"


def _late_masks(gm, gates: list, order: dict, anchor: Node, forbidden: set) -> Union[list, str]:
    """The masks' computations after ``anchor`` (the op's place), to move before it; why not when one
    reads the site's values or logits, is not a pure call, draws random numbers, or a grad-mode or
    autocast change lies between and one of them is a float tensor (moved, it would compute under
    another mode; integer and boolean masks come out the same)."""
    late, stack = set(), [g.mask for g in gates]
    while stack:
        n = stack.pop()
        if n in forbidden:
            return f"the row mask {n.name} is computed from the site's logits or values"
        if n in late or order[n] < order[anchor]:
            continue
        if (n.op not in ("call_function", "call_method") or n.is_impure() or _mutation.writes(n) or n is anchor
                or _mutation.seeded(n)):  # moved, it would reorder the random draws
            return f"the row mask {n.name} is computed after the site by more than pure calls"
        late.add(n)
        stack.extend(n.all_input_nodes)
    if late:
        last = max(order[n] for n in late)
        # (grad mode and autocast switches are impure calls; they change no integer or boolean result)
        exact = all(tval(n) is not None and not tval(n).is_floating_point() for n in late)
        mode = next((n for n in gm.graph.nodes if order[anchor] <= order[n] < last and n.is_impure()
                     and not (exact and n.op == "call_function" and n.target in MODE_SWITCHES)), None)
        if mode is not None:
            return (f"the row mask is computed after {_spelling(mode)} (a grad-mode or autocast switch, or a call with "
                    "side effects) and cannot move before the op")
    return sorted(late, key=order.__getitem__)


def _not(name: str) -> str:
    return name[1:] if name.startswith("~") else "~" + name


def _spelling(n: Node) -> str:
    return n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))


def _name(n: Node) -> str:
    """The mask as the user named it (a placeholder's ``L_mask_`` is ``mask``; ``~mask.bool()`` is
    ``~mask``)."""
    while is_call(n, ("to", "float", "bool", "type_as", "double", "half", "bfloat16", "long", "int")) and n.args:
        n = n.args[0]
    inner = arg(n, 0, "input") if is_call(n, (operator.invert, torch.logical_not, "logical_not")) else None
    if isinstance(inner, Node):
        return "~" + _name(inner)
    name = n.name
    if n.op == "placeholder" and name.startswith("l_") and name.endswith("_"):
        name = name[2:-1]
    return name
