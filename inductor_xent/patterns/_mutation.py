"""Which tensors a node of a Dynamo graph may write, decided from operator schemas, not op names.

The rewrite reads the hidden states, weight, bias and targets where the loss is, not where the
matmul was; a write in between changes what it reads. Dynamo graphs spell writes many ways:
``torch.mul(h, 3, out=h)`` (a pure-looking name), ``h.mul_(3)``, ``torch.relu_(h)``,
``F.relu(h, inplace=True)``, ``h += 1`` (``operator.iadd``), ``h[:, 0] = 0`` (``operator.setitem``),
``torch._foreach_mul_([h], 3)`` (a list), ``W.data = ...`` (``Tensor.set_``), ``h.data.mul_(3)``
(a write to an alias), ``torch.ops.aten.mul_.Tensor(h, s)``. So:

* an ``OpOverload`` has its ``_schema``; a torch function or Tensor method has the aten schemas of
  its name (``torch.jit._builtins._find_builtin``, else ``aten::<name>``), and an argument whose
  ``alias_info.is_write`` is set is written. Overloads are unioned (conservative), counting only
  those whose written argument fits the call (a tensor where the schema takes a tensor: so
  ``torch.sort(h)`` does not match the TorchScript list overload ``sort.Tensor(Tensor[](a!) self)``);
* ``out=`` always writes; so do ``inplace=True`` (``torch.nn.functional``) and Python's in-place
  operators and ``setitem`` (their first argument);
* a callable without any schema whose name looks in-place (Inductor's ``is_mutation_op`` regex), a
  higher-order op, or a written argument that cannot be located in the call: every tensor input.

``writes`` returns only the written *arguments*; ``written_between`` asks whether one may alias a
tensor the rewrite of a site reads or moves (storages of the example values).
"""

from __future__ import annotations

import functools
import inspect
import operator
import re
from typing import Any, Optional

import torch
from torch.fx import Node

from ._fx import bind, tval, val

# Python's in-place operators (``h += 1`` is traced as operator.iadd) and item assignment
_PY_INPLACE_NAMES = ("iadd", "isub", "imul", "imatmul", "itruediv", "ifloordiv", "imod", "ipow", "ilshift",
                     "irshift", "iand", "ior", "ixor", "setitem", "delitem")
_PY_INPLACE = {getattr(operator, n) for n in (*_PY_INPLACE_NAMES, "iconcat")}
_PY_INPLACE_METHODS = {f"__{n}__" for n in _PY_INPLACE_NAMES}
# torch._inductor.pattern_matcher._mutation_op_re: a trailing "_" (not dunder) or a set/enter/exit/seed word
_INPLACE_NAME = re.compile(r"(?<!_)(_$|_[.]|(\b|_)(set|enter|exit|seed)(\b|_))(?!_)")
# calls whose names look like writes (enter, exit) but that only switch autocast's dispatch state:
# Dynamo records ``with torch.autocast(...)`` inside a compiled function as these two, the exit
# taking the enter's handle (not a tensor)
_STATE_ONLY = tuple(f for f in (getattr(torch.amp.autocast_mode, name, None)
                                for name in ("_enter_autocast", "_exit_autocast")) if f is not None)
# Python's functional operators whose names end in "_" (``a & b`` is operator.and_): they write nothing
_PY_PURE = (operator.and_, operator.or_, operator.not_)


def writes(node: Node) -> tuple[Node, ...]:
    """The nodes among ``node``'s arguments whose tensors it may write (empty for a pure op)."""
    if node.op not in ("call_function", "call_method") or node.target in _STATE_ONLY or node.target in _PY_PURE:
        return ()
    out: list = []
    if node.kwargs.get("out") is not None:
        out.extend(_nodes(node.kwargs["out"]))
    target = node.target
    first = node.args[0] if node.args else None
    if target in _PY_INPLACE if node.op == "call_function" else target in _PY_INPLACE_METHODS:
        out.extend(_nodes(first))
    elif node.op == "call_function" and isinstance(target, torch._ops.HigherOrderOperator):
        out.extend(_tensor_inputs(node))  # its subgraph is not inspected: assume the worst
    elif _inplace_flag(node):
        out.extend(_nodes(first) or _tensor_inputs(node))
    else:
        schemas = _schemas(node)
        if schemas is None:  # no schema at all: judge by the name, as Inductor does
            if _INPLACE_NAME.search(_name(node)):
                out.extend(_tensor_inputs(node))
        else:
            for schema in schemas:
                out.extend(_schema_writes(node, schema))
    return tuple(dict.fromkeys(out))  # unique, in order


# names of calls that draw random numbers but whose schema takes no Generator (aten::dropout), or that
# have no schema found from the call (a method on a Python object)
_RANDOM_WORDS = ("rand", "bernoulli", "normal", "uniform", "multinomial", "dropout", "exponential", "poisson",
                 "cauchy", "geometric", "log_normal")


def seeded(node: Node) -> bool:
    """True when ``node``'s call may draw from the random generator (its result depends on the
    generator's state, so moving it reorders the draws): a schema it may dispatch to takes a
    ``Generator``, or its name is of the random family."""
    if node.op not in ("call_function", "call_method"):
        return False
    if any(w in _name(node).lower() for w in _RANDOM_WORDS):
        return True
    return any("Generator" in str(a.type) for schema in (_schemas(node) or ()) for a in schema.arguments)


def spelling(node: Node) -> str:
    """How the user wrote ``node``'s call, for a decline reason: ``torch.mul(..., out=)``,
    ``Tensor.mul_``, ``operator.setitem``, ``aten.mul_.Tensor``."""
    if node.op == "call_method":
        name = f"Tensor.{node.target}"
    elif isinstance(node.target, torch._ops.OpOverload):
        name = str(node.target)
    else:
        module = getattr(node.target, "__module__", None) or ""
        module = {"_operator": "operator", "torch._C._nn": "torch.nn.functional"}.get(module, module)
        if not module and isinstance(getattr(node.target, "__objclass__", None), type):
            module = "Tensor"  # torch.Tensor.set_ (Dynamo's spelling of ``t.data = ...``)
        name = f"{module}.{_name(node)}" if module else _name(node)
    if node.kwargs.get("out") is not None:
        return f"{name}(..., out=)"
    if _inplace_flag(node):
        return f"{name}(..., inplace=True)"
    return name


def swaps_storage(node: Node) -> bool:
    """True for ``Tensor.set_`` however spelled (Dynamo traces ``t.data = u`` as it): afterwards the
    example values' storages say what aliases what at the end of the trace, not before the call."""
    if node.op not in ("call_function", "call_method"):
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.name == "aten::set_"
    if isinstance(node.target, torch._ops.OpOverloadPacket):
        return node.target._qualified_op_name == "aten::set_"
    return _name(node) in ("set_", "swap_tensors")


def first_write(firsts, last: Node) -> Optional[Node]:
    """The first node after the earliest of ``firsts`` and before ``last`` (graph order) that writes a
    tensor (``writes``), or None."""
    order = {n: i for i, n in enumerate(last.graph.nodes)}
    lo = min(order[n] for n in firsts)
    return next((n for n in last.graph.nodes if lo < order[n] < order[last] and writes(n)), None)


def first_write_to(firsts, last: Node, reads: dict) -> Optional[tuple[Node, str]]:
    """(the first node after the earliest of ``firsts`` and before ``last`` that writes a tensor sharing
    storage with one of ``reads`` (node -> what it is), what it writes), or None: a write to anything
    else (a running sum, ``total += loss``) changes nothing ``reads`` holds."""
    order = {n: i for i, n in enumerate(last.graph.nodes)}
    return _first_write(last.graph, order, reads, min(order[n] for n in firsts) + 1, order[last] - 1)


def _first_write(graph, order: dict, reads: dict, lo: int, hi: int) -> Optional[tuple[Node, str]]:
    """(the first node from position ``lo`` to ``hi`` of ``order`` that writes a tensor sharing storage
    with one of ``reads`` (node -> what it is), what it writes), or None."""
    storages = [(_storage(r), what) for r, what in reads.items()]
    swapped = next((n for n in graph.nodes if swaps_storage(n)), None)
    for n in graph.nodes:
        if lo <= order[n] <= hi:
            for w in writes(n):
                what = reads.get(w) or _aliased(w, storages, swapped)
                if what:
                    return n, what
    return None


def written_between(gm, order: dict, heads: list, chain, logits: list, lse_users, hoisted,
                   place: Optional[Node] = None) -> Optional[str]:
    """A reason when a write could change what the rewrite of ``heads`` (Heads over ``chain``;
    ``logits``: every node holding the logits or what the heads derive from them) computes.

    The op reads the hidden states, weight, bias and targets where it is placed (before the heads
    and the logsumexps it replaces); eager read them at the matmul and at the idioms' own nodes
    (``one_hot(y)``, a gather; ``place``: where the op goes when not before its first replaced node,
    ``_plan._op_place``). So no node from the first of those reads to the last node replaced
    may write a tensor sharing storage with any of them, with the logits the replaced nodes read,
    or with the inputs of a target computation hoisted up to the op; and no replaced node may
    write anything (the write would vanish). When a head requires grad, no later node may write
    the hidden states, weight, bias or targets either: the op saves all four for its backward,
    which would then fail where eager's (saving only what each gradient needs) may not. Which op
    writes what comes from its schema (``writes``), storages from the example values (a
    view shares its base's); an unknown storage declines.
    """
    targets = [n for h in heads for n in (h.target, h.index) if n is not None]  # (a gather's ids read as targets)
    losses = [h.loss for h in heads]
    aux = [n for h in heads for n in h.aux]
    reads = {chain.hidden: "the hidden states", chain.weight: "the weight", chain.bias: "the bias",
             **dict.fromkeys(targets, "the targets")}
    # a per-row temperature multiplies the hidden states where the op is placed (eager: at its division)
    for _, op in chain.shape_ops:
        factor = getattr(op, "factor", None)
        if isinstance(factor, Node):
            reads.setdefault(factor, "the per-row temperature")
    for h in heads:  # a nucleus head's per-row masses (eager reads them at its comparison)
        if h.top_p_rows is not None:
            reads.setdefault(h.top_p_rows, "the per-row top_p")
    for n in logits:
        reads.setdefault(n, "the logits")
    # one_hot(y) and its casts; target computations moved up, and what they are computed from
    for n in (*aux, *hoisted, *(m for h in hoisted for m in h.all_input_nodes)):
        reads.setdefault(n, "the targets")
    reads.pop(None, None)
    replaced = {*losses, *lse_users, *logits, *aux}
    lo = min(order[n] for n in (chain.matmul, *logits, *aux))
    hi = max(order[n] for n in (*losses, *lse_users, *hoisted))
    # eager reads the targets at the loss (or at the idiom's own one_hot / gather), the op where it is
    # placed: a write to them before both is seen by both (ProphetNet builds its targets in place,
    # new_zeros().fill_() then slices set, after its lm_head)
    anchor = min(order[n] for n in (*losses, *lse_users, *([place] if place is not None else ())))
    target_from = min([anchor] + [order[n] for n in (*aux, *hoisted)])
    start = {r: (target_from if what == "the targets" and r in targets else lo) for r, what in reads.items()}
    # the op saves hidden/weight/bias/targets for its backward (whatever requires grad), where eager's
    # linear saves only what the other operand's gradient needs: a later write would fail backward
    grad = any(t.requires_grad for n in losses for t in _tensors(val(n)))
    saved = [chain.hidden, chain.weight, chain.bias, *targets] if grad else []
    storages = [(_storage(r), what, start[r]) for r, what in reads.items()]
    saved_storages = [(_storage(r), reads[r], 0) for r in saved if r is not None]
    swapped = next((n for n in gm.graph.nodes if swaps_storage(n)), None)
    # a write an idiom took in as part of its spelling (HF's top-p ``removed[..., -1:] = 0``): to a tensor
    # only the heads compute and read, sharing no storage with anything else the op reads, replaced with them
    own = {m for h in heads for m in h.consumed}
    others = [(_storage(r), what) for r, what in reads.items() if r not in own]

    def own_write(n: Node) -> bool:
        return n in own and bool(writes(n)) and all(
            w in own and all(u in own for u in w.users) and _aliased(w, others, swapped) is None for w in writes(n))

    for n in gm.graph.nodes:
        if order[n] < lo or own_write(n):
            continue
        between = order[n] <= hi
        for w in writes(n):
            op = spelling(n)
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


def written_in(gm, order: dict, reads: dict, lo: int, hi: int) -> Optional[str]:
    """A reason when a node from ``lo`` to ``hi`` (positions in ``order``) writes a tensor sharing storage
    with one of ``reads`` (node -> what it is): an op moved from ``lo`` to ``hi`` would read it changed."""
    found = _first_write(gm.graph, order, reads, lo, hi)
    return None if found is None else f"{spelling(found[0])} writes {found[1]} between the sites"


# ---------------------------------------------------------------------------------------------
def _aliased(w: Node, storages: list, swapped: Optional[Node]) -> Optional[str]:
    """What ``w`` may alias among ``storages`` ((storage, what) pairs), or None."""
    if not storages:
        return None
    if swapped is not None:  # storages are as the trace left them, not as they were at the write
        return f"{w.name} (aliasing unknown: {spelling(swapped)} in the graph)"
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


def _name(node: Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    return getattr(node.target, "__name__", "") or str(node.target)


def _nodes(value: Any) -> list:
    """The Nodes in an argument value (a Node, or a list/tuple of them, e.g. ``_foreach_*_``)."""
    if isinstance(value, Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in _nodes(v)]
    return []


def _tensor_inputs(node: Node) -> list:
    return [n for n in node.all_input_nodes if isinstance(n.meta.get("example_value"), torch.Tensor)
            or n.meta.get("example_value") is None]


def _inplace_flag(node: Node) -> bool:
    """``inplace=True`` given to a Python function that has such a parameter (``F.relu``,
    ``F.dropout``, ...), by keyword or position; a non-constant flag counts as True."""
    if node.op != "call_function":
        return False
    try:
        sig = _signature(node.target)
    except TypeError:  # an unhashable callable
        sig = None
    if sig is None or "inplace" not in sig.parameters:
        return False
    bound = bind(node, sig)
    if bound is None:
        return True  # cannot tell which argument is the flag: assume it is set
    flag = bound.get("inplace", False)
    # a Node or SymBool counts as set; never bool() it (a guard on a symbolic flag)
    return not (flag is None or (isinstance(flag, (bool, int)) and not flag))


@functools.cache
def _signature(fn) -> Optional[inspect.Signature]:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature
        return None


def _schemas(node: Node) -> Optional[list]:
    """The schemas ``node``'s call may dispatch to, or None when it has none."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return [target._schema]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return [getattr(target, o)._schema for o in target.overloads()]
    name = None
    if node.op == "call_function":
        try:
            name = torch.jit._builtins._find_builtin(target)
        except Exception:  # noqa: BLE001 - unhashable or exotic callables
            name = None
    return _schemas_named(name or f"aten::{_name(node)}")


@functools.cache
def _schemas_named(qualified: str) -> Optional[list]:
    try:
        found = torch._C._jit_get_schemas_for_operator(qualified)
    except RuntimeError:
        return None
    return list(found) or None


def _schema_writes(node: Node, schema) -> list:
    """The nodes ``schema`` writes when it is the overload called (none when it cannot be)."""
    positional = [a for a in schema.arguments if not a.kwarg_only]
    if len(node.args) > len(positional):  # more arguments than this overload takes
        return []
    written = []
    for i, a in enumerate(schema.arguments):
        kind = _tensor_kind(a.type)
        if a.alias_info is None or not a.alias_info.is_write or kind is None:
            continue  # read-only, or an int/float/str list: a TorchScript overload, not a tensor op
        if not a.kwarg_only and i < len(node.args):
            value = node.args[i]
        elif a.name in node.kwargs:
            value = node.kwargs[a.name]
        elif a.name == "self" and "input" in node.kwargs:  # Python spells aten's self as input
            value = node.kwargs["input"]
        else:
            continue  # not given: this overload (or this optional argument) is not what was called
        if kind == "tensor" and isinstance(value, Node):
            written.append(value)
        elif kind == "list" and isinstance(value, (list, tuple)):
            written.extend(_nodes(value))
    return written


def _tensor_kind(t) -> Optional[str]:
    if isinstance(t, torch._C.OptionalType):
        t = t.getElementType()
    if isinstance(t, torch._C.TensorType):
        return "tensor"
    if isinstance(t, torch._C.ListType) and _tensor_kind(t.getElementType()) == "tensor":
        return "list"
    return None


def _tensors(value: Any) -> list:
    """The tensors of an example value: itself, or a tuple's (a top-k's values and indices)."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    return [t for t in items if isinstance(t, torch.Tensor)]
