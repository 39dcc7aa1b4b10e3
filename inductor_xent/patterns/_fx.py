"""Small helpers over Dynamo FX graphs (torch IR): reading example values without adding guards,
recognising call spellings, and creating nodes whose ``meta["example_value"]`` is computed in the
graph's own fake mode.
"""

from __future__ import annotations

import inspect
import math
import operator
from typing import Any, Optional

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

TRANSPOSE = (torch.transpose, torch.swapaxes, torch.swapdims, "transpose", "swapaxes", "swapdims")
PERMUTE = (*TRANSPOSE, torch.permute, "permute")


def val(node: Any) -> Any:
    """The node's example value (a FakeTensor for tensors), or the constant itself."""
    if isinstance(node, Node):
        return node.meta.get("example_value")
    return node


def tval(node: Any) -> Optional[torch.Tensor]:
    """The example value if it is a tensor, else None."""
    v = val(node)
    return v if isinstance(v, torch.Tensor) else None


def same(a: Any, b: Any) -> bool:
    """``a == b`` for ints or SymInts, without installing a guard (False when unknown)."""
    return statically_known_true(a == b)


def hint(x: Any) -> Optional[int]:
    """A concrete value for an int or SymInt (its hint), without guarding; None when unknown."""
    if isinstance(x, int):
        return x
    try:
        h = x.node.hint
        return None if h is None else int(h)
    except Exception:  # noqa: BLE001 - unbacked or exotic symbols: no hint
        return None


def numel_hint(t: torch.Tensor) -> Optional[int]:
    """The number of elements of ``t`` from its sizes' hints; None when one has no hint."""
    sizes = [hint(s) for s in t.shape]
    return None if None in sizes else math.prod(sizes)


# Python's binary and unary operators as Dynamo may record them, as the tensor's own method
# (torch 2.11 traces ``z.argmax(-1) == y`` as ``argmax.__eq__(y)``; 2.13 as ``operator.eq``): the
# same call, arguments in the same order (reflected ones, ``__radd__``, are not among them)
DUNDERS = {f"__{name.rstrip('_')}__": getattr(operator, name) for name in (
    "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor", "add", "sub", "mul", "truediv", "floordiv",
    "mod", "pow", "neg", "invert", "abs", "matmul")}


_SYM_SIZE = (torch.ops.aten.sym_size.int,)
_ASSERT_SCALAR = (torch.ops.aten._assert_scalar.default,)


def size_checks(size: Node, rows: Any) -> Optional[list]:
    """When ``size`` is Dynamo's ``sym_size`` of dim 0 of a boolean index's result (a size known only
    at run time, under ``capture_dynamic_output_shape_ops``; ``rows`` the mask's element count) read
    only by the range checks Dynamo adds for it, ``size >= 0`` and ``size <= rows``, each asserted by
    ``_assert_scalar``: ``size`` and those nodes, which can go with the index. Else None (not such a
    size, or the count read elsewhere: a user's ``torch._check(z.shape[0] >= 4)`` stays)."""
    if not (size.op == "call_function" and size.target in _SYM_SIZE and len(size.args) == 2 and size.args[1] == 0):
        return None
    checks = list(size.users)
    for c in checks:
        if c.op != "call_function" or len(c.args) != 2 or c.args[0] is not size or c.kwargs:
            return None
        bound = c.args[1]
        if not ((c.target is operator.ge and bound == 0)
                or (c.target is operator.le and (same(bound, rows) if isinstance(bound, int) else
                                                 isinstance(bound, Node) and same(val(bound), rows)))):
            return None
        if not c.users or not all(a.op == "call_function" and a.target in _ASSERT_SCALAR for a in c.users):
            return None
    return [size, *checks, *(a for c in checks for a in c.users)]


def is_call(node: Any, targets: tuple) -> bool:
    """True when ``node`` calls one of ``targets`` (functions, and method names as strings; an
    operator function also matches its dunder method: ``DUNDERS``)."""
    if not isinstance(node, Node):
        return False
    if node.op == "call_function":
        return any(node.target is t for t in targets)
    if node.op != "call_method":
        return False
    op = DUNDERS.get(node.target)
    return node.target in targets or (op is not None and any(op is t for t in targets))


def arg(node: Node, index: int, name: str, default: Any = None) -> Any:
    """Positional argument ``index`` or keyword ``name`` of a call node (a method's ``self`` is
    argument 0): the one way the pass reads a call's arguments."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def bind(node: Node, signature: inspect.Signature) -> Optional[dict]:
    """Every argument of a call to a Python function with ``signature``, defaults filled in, by
    name; None when the call does not fit it."""
    try:
        bound = signature.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return bound.arguments


def norm_dim(dim: Any, ndim: int) -> Optional[int]:
    """``dim`` as a non-negative int, or None when it is not a plain int in range."""
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    if not isinstance(dim, int) or isinstance(dim, bool) or not -ndim <= dim < ndim:
        return None
    return dim % ndim


def permutation(node: Node) -> Optional[tuple]:
    """The order of its input's dims a transpose / permute gives (``x.transpose(1, 2)`` of a 3-D ``x``:
    ``(0, 2, 1)``); None for another op or dims that are not constants in range."""
    ins = tval(arg(node, 0, "input")) if is_call(node, PERMUTE) else None
    if ins is None:
        return None
    n = ins.dim()
    if is_call(node, TRANSPOSE):
        d0, d1 = norm_dim(arg(node, 1, "dim0"), n), norm_dim(arg(node, 2, "dim1"), n)
        if d0 is None or d1 is None:
            return None
        perm = list(range(n))
        perm[d0], perm[d1] = d1, d0
        return tuple(perm)
    dims = node.args[1:] if len(node.args) > 2 else arg(node, 1, "dims")
    perm = tuple(norm_dim(d, n) for d in (dims if isinstance(dims, (tuple, list)) else (dims,)))
    return perm if None not in perm and sorted(perm) == list(range(n)) else None


# ``depends_on`` gives up (answers True) past this many nodes
DEPENDS_LIMIT = 100_000


def depends_on(node: Node, target: Node) -> bool:
    """True when ``target`` is among ``node``'s inputs, transitively (or the graph is too large to tell)."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n is target or len(seen) > DEPENDS_LIMIT:
            return True
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return False


def number(x: Any) -> Optional[float]:
    """A Python int/float constant as float (bools and symbolic values excluded), else None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)


class Emitter:
    """Creates nodes before ``anchor`` and fills in their example values by running the call on
    the inputs' example values in the graph's fake mode."""

    def __init__(self, graph: Graph, anchor: Node, meta_from: Node):
        self.graph = graph
        self.anchor = anchor
        self.meta_from = meta_from
        # the fake mode of the graph's example values (Dynamo's own; never TracingContext's)
        fakes = (tval(n) for n in graph.nodes)
        self.fake_mode = next((t.fake_mode for t in fakes if t is not None and hasattr(t, "fake_mode")), None)

    def _example(self, op: str, target: Any, args: tuple, kwargs: dict) -> Any:
        if self.fake_mode is None:
            return None
        a, k = torch.fx.node.map_arg(args, val), torch.fx.node.map_arg(kwargs, val)
        with self.fake_mode:
            return getattr(a[0], target)(*a[1:], **k) if op == "call_method" else target(*a, **k)

    def _make(self, op: str, target: Any, args: tuple, kwargs: dict) -> Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.create_node(op, target, args, kwargs)
        for key in ("stack_trace", "source_fn_stack", "nn_module_stack"):
            if key in self.meta_from.meta:
                node.meta[key] = self.meta_from.meta[key]
        node.meta["example_value"] = self._example(op, target, args, kwargs)
        return node

    def call(self, target: Any, *args: Any, **kwargs: Any) -> Node:
        return self._make("call_function", target, args, kwargs)

    def method(self, name: str, *args: Any, **kwargs: Any) -> Node:
        return self._make("call_method", name, args, kwargs)

    def getitem(self, node: Node, index: Any) -> Node:
        return self.call(operator.getitem, node, index)
