"""The ops that may sit between the lm_head matmul and a loss, one small record each: a ``Step``
knows the node that computes it, its logits input (``src``), and how it folds into the
``LogitsChain`` the op recomputes (``fold``); the views and slices of the leading dimensions, and a
per-row factor, also replay themselves on the hidden states (``replay``). Each matcher is
registered, for the call targets it reads, where it is defined (``@matches``); ``step_of`` looks one
up. ``_logits.trace`` walks back from a loss through them and folds them forward.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Optional

import torch
import torch.nn.functional as F
from torch.fx import Node

from . import _dtensor
from ._fx import PERMUTE, arg, depends_on, is_call, norm_dim, number, permutation, same, tval, val

if TYPE_CHECKING:
    from ._logits import LogitsChain

CAST_METHODS = ("float", "half", "bfloat16", "double", "to", "type", "type_as")
VIEWS = (torch.reshape, torch.flatten, "view", "reshape", "flatten", "contiguous")
SPLITS = (torch.split, torch.chunk, "split", "chunk")


@dataclass
class Fold:
    """What folding the steps forward has gathered so far besides the chain's own fields: the
    Python-number scale before the softcap, and after its tanh (``post``, None before one) the
    multiplier and the constant added (``post_shift``, in final units)."""

    scale: float = 1.0
    post: Optional[float] = None
    post_shift: float = 0.0

    @property
    def capped(self) -> bool:
        return self.post is not None


@dataclass(frozen=True)
class Step:
    """One op between the matmul and the loss: ``node`` computes it from the logits ``src``."""

    node: Node
    src: Node
    # the logits' values (or their rows' order) change here: a head reading before it reads others
    changes_values: ClassVar[bool] = False
    # the graph may replay it on the raw logits the op writes (escape.py)
    returnable: ClassVar[bool] = False

    def fold(self, chain: LogitsChain, acc: Fold, at: int) -> Optional[str]:
        """Fold into ``chain`` (this step produces ``chain.nodes[at]``); why it cannot, else None."""
        return None

    def escape(self) -> Optional[tuple]:
        """What ``escape.EscapedLogits`` differentiates through when the graph returns logits computed
        through this step: (kind, value); None for an identity of values (a view)."""
        return None


class RowOp(Step):
    """A step on the leading (row) dimensions, replayed on the hidden states (D in place of V)."""

    def fold(self, chain: LogitsChain, acc: Fold, at: int) -> Optional[str]:
        chain.shape_ops.append((at, self))
        return None

    def replay(self, emit, tensor: Node, last: Any) -> Node:
        raise NotImplementedError


@dataclass(frozen=True)
class Cast(Step):
    returnable: ClassVar[bool] = True

    def escape(self) -> Optional[tuple]:
        return ("cast", tval(self.node).dtype)


@dataclass(frozen=True)
class Noop(Step):
    """``contiguous``, a DTensor ``redistribute`` / ``to_local`` that keeps the global value."""

    returnable: ClassVar[bool] = True


@dataclass(frozen=True)
class Reshape(RowOp):
    shape: tuple = ()
    returnable: ClassVar[bool] = True

    def replay(self, emit, tensor: Node, last: Any) -> Node:
        shape = list(self.shape)
        if not (isinstance(shape[-1], int) and shape[-1] == -1):
            shape[-1] = last
        return emit.method("reshape", tensor, shape)


@dataclass(frozen=True)
class Flatten(RowOp):
    start: Any = 0
    end: Any = -1
    returnable: ClassVar[bool] = True

    def replay(self, emit, tensor: Node, last: Any) -> Node:
        return emit.method("flatten", tensor, self.start, self.end)


@dataclass(frozen=True)
class Permute(RowOp):
    perm: tuple = ()
    changes_values: ClassVar[bool] = True  # the rows' order

    def replay(self, emit, tensor: Node, last: Any) -> Node:
        return emit.method("permute", tensor, self.perm)


@dataclass(frozen=True)
class Slice(RowOp):
    index: Any = None
    changes_values: ClassVar[bool] = True

    def replay(self, emit, tensor: Node, last: Any) -> Node:
        return emit.getitem(tensor, self.index)


@dataclass(frozen=True)
class StackedSlice(Slice):
    """One head of ``torch.stack(heads, dim)`` and the slices after it (``_steps.stacked``): ``index``
    holds them, each without ``dim``, applied in order."""

    def replay(self, emit, tensor: Node, last: Any) -> Node:
        for idx in self.index:
            if any(i != slice(None) for i in idx):
                tensor = emit.getitem(tensor, idx)
        return tensor


@dataclass(frozen=True)
class RowScale(RowOp):
    """A tensor of one factor per row (``logits / T.unsqueeze(-1)``): ``(h * r) @ W.T == (h @ W.T) * r``."""

    factor: Node = None
    divide: bool = False
    changes_values: ClassVar[bool] = True

    def fold(self, chain: LogitsChain, acc: Fold, at: int) -> Optional[str]:
        if acc.capped:
            return "the logits are multiplied by a per-row tensor after the softcap (before it, it folds)"
        if chain.bias is not None or chain.bias_shift:
            return "the logits of a linear with a bias (or a number added) are scaled per row"
        if chain.row_scaled:
            return "the logits are scaled per row twice"
        if depends_on(self.factor, chain.matmul):
            return "the logits are scaled per row by a tensor computed from the logits"
        return super().fold(chain, acc, at)

    def replay(self, emit, tensor: Node, last: Any) -> Node:
        return emit.call(operator.truediv if self.divide else operator.mul, tensor, self.factor)


@dataclass(frozen=True)
class Scale(Step):
    """A Python number multiplying (or dividing: its inverse) the logits."""

    k: float = 1.0
    changes_values: ClassVar[bool] = True
    returnable: ClassVar[bool] = True

    def fold(self, chain: LogitsChain, acc: Fold, at: int) -> Optional[str]:
        if acc.capped:
            acc.post, acc.post_shift = acc.post * self.k, acc.post_shift * self.k
        else:
            acc.scale *= self.k
        return None

    def escape(self) -> Optional[tuple]:
        return ("scale", self.k)


@dataclass(frozen=True)
class TensorScale(Step):
    """A tensor of one factor per vocabulary entry (or one in all): folded into the weight."""

    factor: Node = None
    changes_values: ClassVar[bool] = True

    def fold(self, chain: LogitsChain, acc: Fold, at: int) -> Optional[str]:
        if acc.capped:
            return "the logits are multiplied by a tensor after the softcap's tanh (a Python number only)"
        if chain.weight_scale is not None:
            return "the logits are multiplied by two tensors"
        if chain.bias is not None or chain.bias_shift:
            return "the logits of a linear with a bias are multiplied by a tensor"
        if depends_on(self.factor, chain.matmul):
            return "the logits are multiplied by a tensor computed from the logits"
        chain.weight_scale, chain.weight_scale_at = self.factor, self.node
        return None


@dataclass(frozen=True)
class Tanh(Step):
    changes_values: ClassVar[bool] = True
    returnable: ClassVar[bool] = True

    def fold(self, chain: LogitsChain, acc: Fold, at: int) -> Optional[str]:
        if acc.capped:
            return "two softcaps (tanh or sigmoid) between the matmul and the loss"
        acc.post = 1.0
        return None

    def escape(self) -> Optional[tuple]:
        return ("tanh", None)


@dataclass(frozen=True)
class Sigmoid(Step):
    """modded-nanogpt's softcap ``a * sigmoid(z / s)``: ``sigmoid(u) = tanh(u / 2) / 2 + 1 / 2``."""

    changes_values: ClassVar[bool] = True

    def fold(self, chain: LogitsChain, acc: Fold, at: int) -> Optional[str]:
        if acc.capped:
            return "two softcaps (tanh or sigmoid) between the matmul and the loss"
        acc.scale, acc.post, acc.post_shift = acc.scale * 0.5, 0.5, 0.5
        return None


@dataclass(frozen=True)
class Shift(Step):
    """A Python number added to the logits (``z + k``, ``z - k``)."""

    k: float = 0.0
    changes_values: ClassVar[bool] = True

    def fold(self, chain: LogitsChain, acc: Fold, at: int) -> Optional[str]:
        if acc.capped:
            acc.post_shift += self.k
        elif chain.row_scaled:
            return "a number added to the logits after a per-row temperature"
        elif acc.scale == 0.0:
            return "a number added to logits scaled by 0"
        else:  # z * scale + k = (z + k / scale) * scale: a constant bias of the matmul
            chain.bias_shift += self.k / acc.scale
        return None


@dataclass(frozen=True)
class Bias(Step):
    """A ``[V]`` tensor added to the matmul's output."""

    bias: Node = None
    changes_values: ClassVar[bool] = True

    def fold(self, chain: LogitsChain, acc: Fold, at: int) -> Optional[str]:
        if chain.bias is not None:
            return "a second bias added to a linear that already has one"
        if acc.scale != 1.0 or acc.capped or chain.weight_scale is not None or chain.row_scaled:
            return "a bias added after the logits were scaled or softcapped"
        chain.bias, chain.raw_at = self.bias, at
        return None


@dataclass(frozen=True)
class Detach(Step):
    def fold(self, chain: LogitsChain, acc: Fold, at: int) -> Optional[str]:
        chain.detached = True
        return None


# ---------------------------------------------------------------------------------------------
# matchers: node (and its example value) -> its Step, or None when it cannot fold
# ---------------------------------------------------------------------------------------------
# call target -> matcher; a string is a Tensor method (F.tanh is its own callable in Dynamo graphs)
MATCHERS: dict[Any, Callable[[Node, torch.Tensor], Optional[Step]]] = {}


def matches(*targets) -> Callable:
    """Register the decorated matcher for ``targets``."""
    def register(fn):
        MATCHERS.update(dict.fromkeys(targets, fn))
        return fn
    return register


def step_of(node: Node) -> Optional[Step]:
    """``node`` as a step between the matmul and a loss, or None."""
    out = tval(node)
    if out is None or out.dim() < 1 or node.op not in ("call_function", "call_method"):
        return None
    match = MATCHERS.get(node.target)
    if match is not None:
        return match(node, out)
    # anything else may be a DTensor redistribute / to_local of tensor-parallel logits
    src = _dtensor.passes(node)
    return None if src is None else Noop(node, src)


@matches(*CAST_METHODS)
def _cast(node: Node, out: torch.Tensor) -> Optional[Step]:
    src = arg(node, 0, "input")
    ins = tval(src)
    ok_kw = set(node.kwargs) <= {"dtype", "non_blocking", "copy", "device"}
    if ins is not None and ok_kw and out.dtype.is_floating_point and out.device == ins.device \
            and out.shape == ins.shape:
        return Cast(node, src)
    return None


@matches(*VIEWS)
def _view(node: Node, out: torch.Tensor) -> Optional[Step]:
    src = arg(node, 0, "input")
    ins = tval(src)
    if ins is None or ins.dtype != out.dtype or out.dim() < 2 or not same(out.shape[-1], ins.shape[-1]):
        return None
    if node.target == "contiguous":
        return Noop(node, src)
    if node.target in ("flatten", torch.flatten):
        start, end = arg(node, 1, "start_dim", 0), arg(node, 2, "end_dim", -1)
        if norm_dim(end, ins.dim()) in (None, ins.dim() - 1) or norm_dim(start, ins.dim()) is None:
            return None  # flatten must stop before the vocabulary dimension
        return Flatten(node, src, start, end)
    shape = _shape_arg(node)
    return None if shape is None else Reshape(node, src, tuple(shape))


@matches(*PERMUTE)
def _permute(node: Node, out: torch.Tensor) -> Optional[Step]:
    perm = None if node.kwargs else permutation(node)
    return Permute(node, arg(node, 0, "input"), perm) if perm and perm[-1] == len(perm) - 1 else None


@matches(operator.getitem)
def _slice(node: Node, out: torch.Tensor) -> Optional[Step]:
    src, index = node.args
    if is_call(src, SPLITS) and isinstance(index, int):  # a chunk of ``z.split(k)``: z[i*k:(i+1)*k]
        return _chunk(node, src, index)
    picked = stacked(src, index)  # one head of stacked heads: torch.stack([h(x) for h in heads], 1)[:, k]
    if picked is not None:
        element, indices = picked
        return None if tval(element) is None else StackedSlice(node, element, tuple(indices))
    ins = tval(src)
    return Slice(node, src, index) if ins is not None and _leading_slice(index, ins.dim()) else None


def stacked(src: Node, index: Any) -> Optional[tuple[Node, list]]:
    """``src[index]`` as one of stacked heads: ``torch.stack(tensors, dim)``, then slices that keep
    ``dim`` whole, then ``index`` taking tensor ``k`` at ``dim`` (MusicGen's
    ``torch.stack(heads, 1)[:, :, -T:][:, k]``). (tensors[k], the slices to apply to it, in order:
    each index with ``dim`` left out), or None."""
    slices, cur = [], src
    while is_call(cur, (operator.getitem,)) and not is_call(cur, (torch.stack,)):
        slices.append(cur.args[1])
        cur = cur.args[0]
    if not is_call(cur, (torch.stack,)):
        return None
    tensors, dim = arg(cur, 0, "tensors"), arg(cur, 1, "dim", 0)
    if not isinstance(tensors, (list, tuple)) or not isinstance(dim, int) or dim < 0:
        return None
    items = index if isinstance(index, tuple) else (index,)
    if len(items) <= dim or not all(isinstance(i, slice) for n, i in enumerate(items) if n != dim):
        return None
    k = items[dim]
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < len(tensors) or not isinstance(tensors[k], Node):
        return None
    out = []
    for idx in reversed(slices):  # the innermost first
        idx = idx if isinstance(idx, tuple) else (idx,)
        if not all(isinstance(i, slice) for i in idx) or (len(idx) > dim and idx[dim] != slice(None)):
            return None
        out.append(idx[:dim] + idx[dim + 1:])
    return tensors[k], [*out, items[:dim] + items[dim + 1:]]


def _chunk(node: Node, split: Node, i: int) -> Optional[Step]:
    """Chunk ``i`` of ``z.split(size_or_sections, dim)`` / ``z.chunk(n, dim)`` along a leading
    dimension of static size, as the slice it is."""
    z = arg(split, 0, "input")
    tz = tval(z)
    if tz is None or split.kwargs.keys() - {"dim", "split_size_or_sections", "split_size", "chunks"}:
        return None
    dim = norm_dim(arg(split, 2, "dim", 0), tz.dim())
    how = arg(split, 1, "split_size_or_sections", split.kwargs.get("split_size", split.kwargs.get("chunks")))
    if dim is None or dim >= tz.dim() - 1 or not isinstance(tz.shape[dim], int):
        return None
    length = tz.shape[dim]
    if is_call(split, (torch.chunk, "chunk")):
        how = -(-length // how) if isinstance(how, int) and how > 0 else None
    if isinstance(how, int) and not isinstance(how, bool) and how > 0:
        bounds = list(range(0, length, how)) + [length]
    elif isinstance(how, (list, tuple)) and all(isinstance(k, int) for k in how) and sum(how) == length:
        bounds = [0, *(sum(how[: j + 1]) for j in range(len(how)))]
    else:
        return None
    if not 0 <= i < len(bounds) - 1:
        return None
    return Slice(node, z, (*(slice(None),) * dim, slice(bounds[i], bounds[i + 1])))


@matches(operator.mul, torch.mul, "mul")
def _mul(node: Node, out: torch.Tensor) -> Optional[Step]:
    """``z * k`` with ``k`` a Python number (Scale), ``z * s`` with ``s`` a tensor of one factor per
    vocabulary entry (or one in all) that changes neither the shape nor the dtype of ``z``
    (TensorScale), or ``z * r`` with ``r`` one factor per row (``[..., 1]``, broadcast over the
    vocabulary: RowScale); either operand order."""
    if node.kwargs.get("out"):
        return None
    a, b = arg(node, 0, "input"), arg(node, 1, "other")
    for src, k in ((a, b), (b, a)):
        ts, tk = tval(src), tval(k)
        if not isinstance(src, Node) or ts is None:
            continue
        if not isinstance(k, Node):
            return None if number(k) is None else Scale(node, src, number(k))
        if tk is None or not tk.dtype.is_floating_point or tk.dim() > ts.dim():
            continue
        if _row_factors(tk, ts, out):
            return RowScale(node, src, k, False)
        if ts.dtype != out.dtype or ts.dim() != out.dim() or not all(same(x, y) for x, y in zip(ts.shape, out.shape)):
            continue
        if all(same(x, 1) for x in tk.shape[:-1]) and (tk.dim() == 0 or same(tk.shape[-1], 1)
                                                       or same(tk.shape[-1], out.shape[-1])):
            return TensorScale(node, src, k)
    return None


@matches(operator.truediv, torch.div, torch.true_divide, "div", "true_divide")
def _div(node: Node, out: torch.Tensor) -> Optional[Step]:
    if node.kwargs.get("rounding_mode") or node.kwargs.get("out"):
        return None
    src, other = arg(node, 0, "input"), arg(node, 1, "other")
    ts, tk = tval(src), tval(other)
    if isinstance(src, Node) and ts is not None and tk is not None and tk.dtype.is_floating_point \
            and _row_factors(tk, ts, out):  # a per-row temperature: logits / T[..., None]
        return RowScale(node, src, other, True)
    k = number(other)
    return Scale(node, src, 1.0 / k) if isinstance(src, Node) and k not in (None, 0.0) else None


def _row_factors(tk: torch.Tensor, ts: torch.Tensor, out: torch.Tensor) -> bool:
    """True when ``tk`` holds one factor per row of ``ts`` (a ``[..., 1]`` tensor that broadcasts over
    its leading dimensions without growing them, and is not a single number), and multiplying keeps
    ``ts``'s shape."""
    if tk.dim() < 1 or tk.dim() > ts.dim() or not same(tk.shape[-1], 1) or ts.dim() < 2:
        return False
    if ts.dim() != out.dim() or not all(same(x, y) for x, y in zip(ts.shape, out.shape)):
        return False
    lead = list(zip(reversed(tk.shape[:-1]), reversed(ts.shape[:-1])))
    return all(same(k, 1) or same(k, n) for k, n in lead) and any(not same(k, 1) for k, _ in lead)


def _unary(cls: type) -> Callable[[Node, torch.Tensor], Optional[Step]]:
    def match(node: Node, out: torch.Tensor) -> Optional[Step]:
        return cls(node, arg(node, 0, "input")) if len(node.args) == 1 and not node.kwargs else None
    return match


matches(torch.tanh, F.tanh, "tanh")(_unary(Tanh))
matches(torch.sigmoid, F.sigmoid, "sigmoid")(_unary(Sigmoid))
matches(torch.Tensor.detach, "detach")(_unary(Detach))


@matches(operator.sub, torch.sub, "sub")
def _sub(node: Node, out: torch.Tensor) -> Optional[Step]:
    """``z - k`` with ``k`` a Python number: a shift by ``-k``."""
    if node.kwargs or len(node.args) != 2 or not isinstance(node.args[0], Node):
        return None
    k = number(node.args[1])
    return None if k is None or isinstance(node.args[1], Node) else Shift(node, node.args[0], -k)


@matches(operator.add, torch.add, "add")
def _add(node: Node, out: torch.Tensor) -> Optional[Step]:
    """``z + b`` with ``b`` a ``[V]`` tensor (Bias), or ``z + k`` with ``k`` a Python number (Shift);
    either operand order; not with an ``alpha``."""
    if node.kwargs or len(node.args) != 2:
        return None
    a, b = arg(node, 0, "input"), arg(node, 1, "other")
    for src, k in ((a, b), (b, a)):
        if isinstance(src, Node) and not isinstance(k, Node) and number(k) is not None:
            return Shift(node, src, number(k))
    for src, bias in ((a, b), (b, a)):
        ts, tb = tval(src), tval(bias)
        if ts is not None and tb is not None and tb.dim() == 1 and ts.dim() == out.dim() \
                and same(tb.shape[0], out.shape[-1]):
            return Bias(node, src, bias)
    return None


def divides_by_a_tensor(node: Node) -> bool:
    """``node`` divides by a tensor (or a symbolic number) that no step folds (for the decline's hint)."""
    return MATCHERS.get(node.target) is _div and isinstance(arg(node, 1, "other"), Node)


def _leading_slice(index: Any, ndim: int) -> bool:
    """True when ``index`` only slices dimensions before the last (no ints, None or tensors)."""
    items = index if isinstance(index, tuple) else (index,)
    if not all(isinstance(i, slice) or i is Ellipsis for i in items):
        return False
    if sum(i is Ellipsis for i in items) > 1:
        return False
    if Ellipsis in items:
        after = items[items.index(Ellipsis) + 1:]
        return not after or after[-1] == slice(None)
    return len(items) < ndim or items[-1] == slice(None)


def _shape_arg(node: Node) -> Optional[list]:
    """The target shape of ``view`` / ``reshape`` / ``torch.reshape`` whose last entry is the
    vocabulary (or -1); None when it has another form."""
    if node.op == "call_method":
        rest = list(node.args[1:]) or [node.kwargs.get("size", node.kwargs.get("shape"))]
    else:
        rest = [arg(node, 1, "shape")]
    if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
        rest = list(rest[0])
    if not rest or any(r is None for r in rest):
        return None
    last = val(rest[-1])
    if isinstance(last, bool) or last is None:
        return None
    return rest if (isinstance(last, int) and last == -1) or same(last, tval(node).shape[-1]) else None


def finish(chain: LogitsChain, acc: Fold) -> Optional[str]:
    """The scale and softcap the op applies, from what the steps gathered; why not, else None."""
    if acc.capped:
        if acc.post == 0.0 or not math.isfinite(acc.post):
            return f"softcap multiplier {acc.post} is not a finite nonzero number"
        chain.softcap, chain.logit_scale, chain.shift = abs(acc.post), acc.scale * acc.post, acc.post_shift
    else:
        chain.logit_scale = acc.scale
    if not all(math.isfinite(x) for x in (chain.logit_scale, chain.bias_shift, chain.shift)):
        return f"logit scale {chain.logit_scale} or shift {chain.bias_shift}, {chain.shift} is not finite"
    return None
