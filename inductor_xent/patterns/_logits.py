"""Walk from the tensor a loss reads back to the lm_head matmul that produced it.

Every idiom ends at "logits with the vocabulary last". This module recognises what may sit between
the matmul and that tensor, and folds it into the op's arguments:

* the matmul: ``torch._C._nn.linear`` (``nn.Linear`` / ``F.linear``, bias or not), ``@`` /
  ``torch.matmul`` / ``torch.mm`` / ``.matmul`` / ``torch.einsum("...d,vd->...v")`` with the
  weight as ``W.t()`` / ``W.T`` / ``W.transpose(0, 1)`` of a ``[V, D]`` parameter, or a
  ``[D, V]`` weight used as is (the op then gets the strided view ``W.t()``);
* dtype casts (``.float()``, ``.to(dtype)``, ``.type_as``), ``view`` / ``reshape`` / ``flatten`` /
  ``contiguous`` that keep the vocabulary as the last dimension;
* multiplication or division by a Python number (-> ``logit_scale``), ``tanh`` between two such
  factors in either operand order (Gemma 2's ``final_logit_softcapping``: div -> tanh -> mul;
  RecurrentGemma's ``F.tanh(logits / cap) * cap``; -> ``softcap``);
* ``a * sigmoid(z / s)`` (modded-nanogpt), as ``a/2 * tanh(z / 2s) + a/2``: a softcap, and a
  constant after it that softmaxes ignore (a logsumexp of those logits adds it: ``Logits.shift``);
* a Python number added before the softcap (``tanh((z + 5) / s)``): a constant bias of the matmul
  (``Logits.bias_shift``); ``z - k`` as ``z + (-k)``;
* multiplication by a tensor holding one factor per vocabulary entry (or one in all), before any
  softcap: folded into the weight, ``W * s[:, None]`` (Dory's learned per-token logit scale);
* multiplication or division by a tensor of one factor per row (``logits / T.unsqueeze(-1)``, a
  per-token temperature as verl's engine passes it), before any softcap and bias: pushed onto the
  hidden states' rows, ``(h / T[..., None]) @ W.T`` (autograd gives ``T`` its gradient);
* ``.detach()``: the heads over it have no gradient (``Logits.detached``);
* a bias add of a ``[V]`` tensor right after the matmul;
* slices, transposes and permutations of the leading (batch/sequence) dimensions and the views
  around them (a chunk of ``logits.split(k)`` / ``logits.chunk(n)`` along one of them is a slice),
  which the rewrite replays on the hidden states instead (``logits[:, :-1]`` -> ``hidden[:, :-1]``;
  ``mm(h2d, W.t()).view(B, T, V)[:, 1:]`` -> ``h2d.reshape(B, T, D)[:, 1:]``;
  ProphetNet's ``logits.transpose(0, 1)`` of ``[B, ngram, T, V]`` -> ``hidden.transpose(0, 1)``).
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch.fx import Node

from .. import compat
from . import _dtensor
from ._fx import PERMUTE, Emitter, arg, is_call, norm_dim, number, permutation, same, tval, val
from ._site import Decline

LINEAR = (torch._C._nn.linear,)
MATMUL = (operator.matmul, torch.matmul, torch.mm, "matmul", "mm", "__matmul__")
CAST_METHODS = ("float", "half", "bfloat16", "double", "to", "type", "type_as")
VIEWS = (torch.reshape, torch.flatten, "view", "reshape", "flatten", "contiguous")

# The walk from the loss back to the matmul follows at most this many ops. Real heads have a handful
# (HF: linear, float, view; Gemma 2: linear, div, tanh, mul, float, view; ProphetNet adds a
# transpose, contiguous and view); a longer chain of foldable ops is not an lm_head's logits.
MAX_STEPS = 64
# Past an op it cannot fold, the walk follows first arguments this far looking for a matmul, to
# decline naming that op (an lm_head is there) rather than skip the loss as no site at all.
UNSUPPORTED_DEPTH = 16
# A tensor scale must not be computed from the logits; the search for them among its inputs gives
# up (and declines) past this many nodes.
DEPENDS_LIMIT = 100_000

GRAPH_INPUT = (
    "the logits are an input of this graph: a graph break separates the lm_head matmul from the loss "
    "(torch._dynamo.explain shows where); remove the break to fuse"
)
BREAK_INPUT = (
    "the logits are an input of this graph: a graph break separates the lm_head matmul from the loss "
    "(Dynamo resumes {fn} at line {line}; torch._dynamo.explain shows why); remove the break to fuse"
)
ARGUMENT_INPUT = (
    "the logits are an argument of the compiled function {fn}: its lm_head runs outside the compiled "
    "code (e.g. torchtune's compile_loss compiles the loss module alone); compile the function that "
    "computes the logits and the loss together (the model's forward with its loss, torch.compile(model), "
    "or a region from the hidden states and the lm_head weight to the loss) to fuse"
)
RESUME = re.compile(r"torch_dynamo_resume_in_(.+)_at_(\d+)$")
CALL_MODULE = (
    "the lm_head is an nn.Linear call_module node (torch._dynamo.config.inline_inbuilt_nn_modules="
    "False, possible on torch 2.11): set it to True (the default) to fuse"
)


@dataclass
class Logits:
    """The lm_head logits feeding a loss, and what the op needs to recompute them."""

    matmul: Node
    hidden: Node  # [..., D]
    weight: Node  # [V, D] as stored, or [D, V] when weight_is_vd is False
    weight_is_vd: bool
    bias: Optional[Node] = None  # [V]
    # a tensor of one factor per vocabulary entry (or a single one) multiplying the logits, and the
    # multiply: the rewrite computes ``weight * weight_scale.reshape(-1, 1)`` where that multiply was
    weight_scale: Optional[Node] = None
    weight_scale_at: Optional[Node] = None
    logit_scale: float = 1.0
    softcap: Optional[float] = None
    # a Python number added to the logits before the softcap (``tanh((z + 5) / s)``), in the matmul's
    # units: the op adds it to every vocabulary entry's bias
    bias_shift: float = 0.0
    # a Python number added after the softcap (``a * sigmoid(z / s)`` is ``a/2 * tanh(z / 2s) + a/2``):
    # softmaxes ignore it, a logsumexp of the final logits is the op's lse plus it
    shift: float = 0.0
    # heads reading ``logits.detach()``: their values carry no gradient
    detached: bool = False
    # views / slices of the leading dims between matmul and logits, in order, as (position in
    # ``nodes`` of the node they produce, op); ``replay`` applies them to the hidden states
    shape_ops: list = field(default_factory=list)
    nodes: list = field(default_factory=list)  # matmul ... logits, in graph order
    # what each of ``nodes`` does to the logits: (kind, payload) of its step ("matmul" first)
    kinds: list = field(default_factory=list)
    # nodes[final_from:] hold the final logit values with the rows in their final order, up to casts
    # and reshapes (for the lse mapping and heads of the same logits)
    final_from: int = 0
    # nodes[raw_at] holds the matmul's output plus the bias (the node of a separate bias add, else
    # the matmul): the raw logits the op can write (escape.py)
    raw_at: int = 0

    @property
    def row_scaled(self) -> bool:
        """The logits are multiplied (or divided) by a tensor of one factor per row: a per-row
        temperature, pushed onto the hidden states' rows."""
        return any(op[0] == "row_scale" for _, op in self.shape_ops)

    @property
    def sliced(self) -> bool:
        return any(op[0] == "slice" for _, op in self.shape_ops)

    @property
    def vd(self) -> tuple:
        """(V, D) of the weight (ints, or SymInts under dynamic shapes)."""
        shape = tval(self.weight).shape
        return (shape[0], shape[1]) if self.weight_is_vd else (shape[1], shape[0])

    @property
    def needs(self) -> tuple[bool, bool, bool]:
        """Which of (hidden, weight, bias) the graph will ask a gradient of."""
        grad = tval(self.matmul).requires_grad
        tb = tval(self.bias) if self.bias is not None else None
        return (bool(grad and tval(self.hidden).requires_grad), bool(grad and tval(self.weight).requires_grad),
                bool(grad and tb is not None and tb.requires_grad))


def same_logits(a: Logits, b: Logits, *, monotone: bool = False) -> bool:
    """True when ``a`` and ``b`` (walks from two heads) are the same logits, rows in the same order:
    one matmul, and nodes shared up to where both are final. ``monotone`` (an argmax) also accepts
    logits that differ by a scale of the same sign or a softcap (their rows' argmax is the same, up
    to rounding), e.g. ``logits.argmax(-1)`` next to ``(logits / T).log_softmax(-1)``."""
    if a.matmul is not b.matmul:
        return False
    k = next((i for i, (x, y) in enumerate(zip(a.nodes, b.nodes)) if x is not y), min(len(a.nodes), len(b.nodes)))
    if k > a.final_from and k > b.final_from:
        return True
    reorders = any(i >= k and op[0] in ("slice", "permute") for c in (a, b) for i, op in c.shape_ops)
    return (monotone and not reorders and a.bias is b.bias and a.weight_scale is b.weight_scale
            and (a.logit_scale > 0) == (b.logit_scale > 0))


def other_rows(a: Logits, b: Logits) -> bool:
    """True when ``a`` and ``b`` walk back to one matmul but read different row slices of it (e.g.
    ``F.cross_entropy(logits[s:e], t[s:e], reduction="sum")`` summed over chunks): each is a site of
    its own, with the slice pushed onto the hidden states."""
    if a.matmul is not b.matmul or same_logits(a, b):
        return False
    k = next((i for i, (x, y) in enumerate(zip(a.nodes, b.nodes)) if x is not y), min(len(a.nodes), len(b.nodes)))
    return all(any(i >= k and op[0] == "slice" for i, op in c.shape_ops) for c in (a, b))


# ---------------------------------------------------------------------------------------------
# one op between matmul and loss: (kind, its logits input, payload), or None when it cannot fold
# ---------------------------------------------------------------------------------------------
Step = tuple[str, Node, Any]


def _cast(node: Node, out: torch.Tensor) -> Optional[Step]:
    src = arg(node, 0, "input")
    ins = tval(src)
    ok_kw = set(node.kwargs) <= {"dtype", "non_blocking", "copy", "device"}
    if ins is not None and ok_kw and out.dtype.is_floating_point and out.device == ins.device \
            and out.shape == ins.shape:
        return "cast", src, None
    return None


def _view(node: Node, out: torch.Tensor) -> Optional[Step]:
    src = arg(node, 0, "input")
    ins = tval(src)
    if ins is None or ins.dtype != out.dtype or out.dim() < 2 or not same(out.shape[-1], ins.shape[-1]):
        return None
    if node.target == "contiguous":
        return "noop", src, None
    if node.target in ("flatten", torch.flatten):
        start, end = arg(node, 1, "start_dim", 0), arg(node, 2, "end_dim", -1)
        if norm_dim(end, ins.dim()) in (None, ins.dim() - 1) or norm_dim(start, ins.dim()) is None:
            return None  # flatten must stop before the vocabulary dimension
        return "view", src, ("flatten", start, end)
    shape = _shape_arg(node)
    return None if shape is None else ("view", src, ("reshape", shape))


def _permute(node: Node, out: torch.Tensor) -> Optional[Step]:
    perm = None if node.kwargs else permutation(node)
    return ("view", arg(node, 0, "input"), ("permute", perm)) if perm and perm[-1] == len(perm) - 1 else None


def _slice(node: Node, out: torch.Tensor) -> Optional[Step]:
    src, index = node.args
    if is_call(src, SPLITS) and isinstance(index, int):  # a chunk of ``z.split(k)``: z[i*k:(i+1)*k]
        return _chunk(src, index)
    ins = tval(src)
    return ("slice", src, ("slice", index)) if ins is not None and _leading_slice(index, ins.dim()) else None


SPLITS = (torch.split, torch.chunk, "split", "chunk")


def _chunk(split: Node, i: int) -> Optional[Step]:
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
    return "slice", z, ("slice", (*(slice(None),) * dim, slice(bounds[i], bounds[i + 1])))


def _mul(node: Node, out: torch.Tensor) -> Optional[Step]:
    """``z * k`` with ``k`` a Python number ("scale"), ``z * s`` with ``s`` a tensor of one factor
    per vocabulary entry (or one in all) that changes neither the shape nor the dtype of ``z``
    ("tensor_scale"), or ``z * r`` with ``r`` one factor per row (``[..., 1]``, broadcast over the
    vocabulary: "row_scale"); either operand order."""
    if node.kwargs.get("out"):
        return None
    a, b = arg(node, 0, "input"), arg(node, 1, "other")
    for src, k in ((a, b), (b, a)):
        ts, tk = tval(src), tval(k)
        if not isinstance(src, Node) or ts is None:
            continue
        if not isinstance(k, Node):
            return None if number(k) is None else ("scale", src, number(k))
        if tk is None or not tk.dtype.is_floating_point or tk.dim() > ts.dim():
            continue
        if _row_factors(tk, ts, out):
            return "row_scale", src, ("row_scale", k, False)
        if ts.dtype != out.dtype or ts.dim() != out.dim() or not all(same(x, y) for x, y in zip(ts.shape, out.shape)):
            continue
        if all(same(x, 1) for x in tk.shape[:-1]) and (tk.dim() == 0 or same(tk.shape[-1], 1)
                                                       or same(tk.shape[-1], out.shape[-1])):
            return "tensor_scale", src, k
    return None


def _div(node: Node, out: torch.Tensor) -> Optional[Step]:
    if node.kwargs.get("rounding_mode") or node.kwargs.get("out"):
        return None
    src, other = arg(node, 0, "input"), arg(node, 1, "other")
    ts, tk = tval(src), tval(other)
    if isinstance(src, Node) and ts is not None and tk is not None and tk.dtype.is_floating_point \
            and _row_factors(tk, ts, out):  # a per-row temperature: logits / T[..., None]
        return "row_scale", src, ("row_scale", other, True)
    k = number(other)
    return ("scale", src, 1.0 / k) if isinstance(src, Node) and k not in (None, 0.0) else None


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


def _tanh(node: Node, out: torch.Tensor) -> Optional[Step]:
    return ("tanh", arg(node, 0, "input"), None) if len(node.args) == 1 and not node.kwargs else None


def _sigmoid(node: Node, out: torch.Tensor) -> Optional[Step]:
    """modded-nanogpt's softcap ``a * sigmoid(z / s)``: ``sigmoid(u) = tanh(u / 2) / 2 + 1 / 2``."""
    return ("sigmoid", arg(node, 0, "input"), None) if len(node.args) == 1 and not node.kwargs else None


def _detach(node: Node, out: torch.Tensor) -> Optional[Step]:
    return ("detach", arg(node, 0, "input"), None) if len(node.args) == 1 and not node.kwargs else None


def _sub(node: Node, out: torch.Tensor) -> Optional[Step]:
    """``z - k`` with ``k`` a Python number: a shift by ``-k``."""
    if node.kwargs or len(node.args) != 2 or not isinstance(node.args[0], Node):
        return None
    k = number(node.args[1])
    return None if k is None or isinstance(node.args[1], Node) else ("shift", node.args[0], -k)


def _bias(node: Node, out: torch.Tensor) -> Optional[Step]:
    """``z + b`` with ``b`` a ``[V]`` tensor ("bias"), or ``z + k`` with ``k`` a Python number ("shift");
    either operand order."""
    if node.kwargs or len(node.args) < 2:
        return None
    a, b = arg(node, 0, "input"), arg(node, 1, "other")
    for src, k in ((a, b), (b, a)):
        if isinstance(src, Node) and not isinstance(k, Node) and number(k) is not None:
            return "shift", src, number(k)
    for src, bias in ((a, b), (b, a)):
        ts, tb = tval(src), tval(bias)
        if ts is not None and tb is not None and tb.dim() == 1 and ts.dim() == out.dim() \
                and same(tb.shape[0], out.shape[-1]):
            return "bias", src, bias
    return None


# target -> step; a string is a Tensor method (F.tanh is its own callable in Dynamo graphs)
STEPS: dict[Any, Callable[[Node, torch.Tensor], Optional[Step]]] = {
    **dict.fromkeys(CAST_METHODS, _cast),
    **dict.fromkeys(VIEWS, _view),
    **dict.fromkeys(PERMUTE, _permute),
    operator.getitem: _slice,
    **dict.fromkeys((operator.mul, torch.mul, "mul"), _mul),
    **dict.fromkeys((operator.truediv, torch.div, torch.true_divide, "div", "true_divide"), _div),
    **dict.fromkeys((torch.tanh, F.tanh, "tanh"), _tanh),
    **dict.fromkeys((torch.sigmoid, F.sigmoid, "sigmoid"), _sigmoid),
    **dict.fromkeys((operator.add, torch.add, "add"), _bias),
    **dict.fromkeys((operator.sub, torch.sub, "sub"), _sub),
    **dict.fromkeys((torch.Tensor.detach, "detach"), _detach),
}


def step_of(node: Node) -> Optional[Step]:
    """(kind, its logits input, payload) of ``node`` as a step between the matmul and a loss, or None."""
    out = tval(node)
    if out is None or out.dim() < 1 or node.op not in ("call_function", "call_method"):
        return None
    step = STEPS.get(node.target)
    # anything else may be a DTensor redistribute / to_local of tensor-parallel logits
    return step(node, out) if step is not None else _dtensor.step(node)


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


def _depends_on(node: Node, target: Node) -> bool:
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


def _einsum_weight(node: Any) -> Optional[tuple[Node, Node, bool]]:
    """(hidden, weight, weight_is_vd) for ``torch.einsum("...d,vd->...v", h, W)`` (or ``"...d,dv"``)."""
    if not is_call(node, (torch.einsum,)) or len(node.args) != 3 or not isinstance(node.args[0], str):
        return None
    eq = node.args[0].replace(" ", "")
    if eq.count("->") != 1:
        return None
    lhs, out = eq.split("->")
    ops = lhs.split(",")
    if len(ops) != 2 or len(ops[1]) != 2 or not ops[0]:
        return None
    a, w = ops
    c = a[-1]
    letters = a.replace("...", "")
    if c not in w or len(set(letters)) != len(letters):
        return None
    v = w.replace(c, "", 1)
    if len(v) != 1 or v in a or out != a[:-1] + v:
        return None
    return node.args[1], node.args[2], w == v + c


def is_matmul(node: Any) -> bool:
    return is_call(node, LINEAR + MATMUL) or _einsum_weight(node) is not None


def _root(node: Node) -> Union[Logits, Decline]:
    """The matmul node's operands, as a partially filled Logits."""
    if is_call(node, LINEAR):
        x, w, b = arg(node, 0, "input"), arg(node, 1, "weight"), arg(node, 2, "bias")
        tw = tval(w)
        if tw is None or tw.dim() != 2:
            return Decline(None, node, "the linear's weight is not a 2-D tensor")
        return Logits(node, x, w, True, b if isinstance(b, Node) else None)
    einsum = _einsum_weight(node)
    if einsum is not None:
        x, w, is_vd = einsum
        return Logits(node, x, w, is_vd)
    x, m = arg(node, 0, "input"), arg(node, 1, "other")
    tm = tval(m)
    if tm is None or tm.dim() != 2:
        return Decline(None, node, "the matmul's right operand is not a 2-D weight")
    # W.t() / W.T / W.transpose(0, 1) / W.permute(1, 0) of a [V, D] weight: use W itself
    inner = arg(m, 0, "input")
    is_t = (
        is_call(m, ("t", torch.t))
        or (m.op == "call_function" and m.target is getattr and m.args[1:] in (("T",), ("mT",)))
        or (is_call(m, (torch.transpose, "transpose")) and {norm_dim(d, 2) for d in m.args[1:3]} == {0, 1})
        or (is_call(m, ("permute",)) and tuple(m.args[1:]) in ((1, 0), ((1, 0),), ([1, 0],)))
    )
    if is_t and tval(inner) is not None and tval(inner).dim() == 2:
        return Logits(node, x, inner, True)
    return Logits(node, x, m, False)


def trace(logits: Node) -> Union[Logits, Decline, None]:
    """Logits for the tensor ``logits`` (vocabulary last); a Decline when an lm_head matmul is there
    but something unsupported sits in between; None when no matmul feeds it."""
    steps: list[tuple[str, Node, Any, Node]] = []
    node = logits
    for _ in range(MAX_STEPS):
        if is_matmul(node):
            break
        step = step_of(node) if isinstance(node, Node) else None
        if step is None:
            return _stopped(node, steps)
        steps.append((*step, node))
        node = step[1]
    else:
        return None
    root = _root(node)
    if isinstance(root, Decline):
        return root
    tx = tval(root.hidden)
    if tx is None or tx.dim() < 2:
        return Decline(None, node, "the hidden states are not a [..., D] tensor with at least one row dimension")
    reason = _fold(root, steps)
    return root if reason is None else Decline(None, node, reason)


def _stopped(node: Any, steps: list) -> Optional[Decline]:
    """Why the walk cannot pass ``node`` when an lm_head lies behind it; None when none does."""
    if isinstance(node, Node) and node.op == "placeholder" and steps and steps[-1][0] == "cast":
        return Decline(None, node, _input_reason(node), logits_input=True)
    if isinstance(node, Node) and node.op == "call_module" and _is_linear_module(node):
        return Decline(None, node, CALL_MODULE)
    cur = node
    for _ in range(UNSUPPORTED_DEPTH):
        first = arg(cur, 0, "input") if isinstance(cur, Node) else None
        if isinstance(first, (list, tuple)) and first:  # torch.stack / torch.cat of several heads
            first = first[0]
        if not isinstance(first, Node):
            return None
        cur = first
        if is_matmul(cur):
            desc = node.target if node.op == "call_method" else getattr(node.target, "__name__", node.target)
            reason = f"unsupported op between the lm_head matmul and the loss: {node.op} {desc} ({node.name})"
            return Decline(None, node, reason + _unsupported_hint(node))
    return None


def _input_reason(node: Node) -> str:
    """Why logits that are a placeholder cannot fuse: a graph break in the user's function, or no
    lm_head in the compiled function at all (Dynamo names the frame it traced)."""
    fn = compat.dynamo_frame(node.graph.owning_module)
    if fn is None:
        return GRAPH_INPUT
    resumed = RESUME.match(fn)
    return BREAK_INPUT.format(fn=resumed[1], line=resumed[2]) if resumed else ARGUMENT_INPUT.format(fn=fn)


def _unsupported_hint(node: Node) -> str:
    """What to change, for the unsupported ops RL code writes."""
    if node.target is operator.getitem:
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        if index and isinstance(index[0], int):
            return (": a row of the logits (logits[i], e.g. a Python loop over the batch such as TRL's "
                    "selective_log_softmax for bf16 logits): each row's head reads its own slice of one logits "
                    "tensor; write it batched (logits.log_softmax(-1).gather(-1, ids[..., None])) to fuse")
        return (": an index that is not a slice of the leading dimensions (e.g. one of several stacked "
                "heads; compute each head's loss from its own matmul to fuse)")
    if STEPS.get(node.target) is _div and isinstance(arg(node, 1, "other"), Node):
        return (": the logits are divided by a tensor that is not one factor per row (a per-row temperature "
                "logits / T.unsqueeze(-1) folds), or by a symbolic number (a Python float Dynamo made dynamic); "
                "a Python number or a [..., 1] tensor fold")
    return ""


def _is_linear_module(node: Node) -> bool:
    try:
        return isinstance(node.graph.owning_module.get_submodule(node.target), torch.nn.Linear)
    except (AttributeError, TypeError):
        return False


def _fold(root: Logits, steps: list) -> Optional[str]:
    """Replay ``steps`` forward from the matmul, folding them into ``root`` (bias, logit_scale,
    softcap, shifts, weight_scale, shape_ops with the per-row factors); a reason when they do not fold."""
    root.nodes, root.kinds = [root.matmul], [("matmul", None)]
    scale, post, post_shift, tanh_seen = 1.0, None, 0.0, False
    for kind, _src, payload, n in reversed(steps):
        root.nodes.append(n)
        root.kinds.append((kind, payload))
        if kind == "scale":
            if tanh_seen:
                post, post_shift = post * payload, post_shift * payload
            else:
                scale *= payload
        elif kind in ("tanh", "sigmoid"):
            if tanh_seen:
                return "two softcaps (tanh or sigmoid) between the matmul and the loss"
            tanh_seen, post = True, 1.0
            if kind == "sigmoid":  # sigmoid(u) = tanh(u / 2) / 2 + 1 / 2
                scale, post, post_shift = scale * 0.5, 0.5, 0.5
        elif kind == "shift":
            if tanh_seen:
                post_shift += payload
            elif root.row_scaled:
                return "a number added to the logits after a per-row temperature"
            elif scale == 0.0:
                return "a number added to logits scaled by 0"
            else:  # z * scale + k = (z + k / scale) * scale: a constant bias of the matmul
                root.bias_shift += payload / scale
        elif kind == "tensor_scale":
            if tanh_seen:
                return "the logits are multiplied by a tensor after the softcap's tanh (a Python number only)"
            if root.weight_scale is not None:
                return "the logits are multiplied by two tensors"
            if root.bias is not None or root.bias_shift:
                return "the logits of a linear with a bias are multiplied by a tensor"
            if _depends_on(payload, root.matmul):
                return "the logits are multiplied by a tensor computed from the logits"
            root.weight_scale, root.weight_scale_at = payload, n
        elif kind == "row_scale":
            if tanh_seen:
                return "the logits are multiplied by a per-row tensor after the softcap (before it, it folds)"
            if root.bias is not None or root.bias_shift:
                return "the logits of a linear with a bias (or a number added) are scaled per row"
            if root.row_scaled:
                return "the logits are scaled per row twice"
            if _depends_on(payload[1], root.matmul):
                return "the logits are scaled per row by a tensor computed from the logits"
            root.shape_ops.append((len(root.nodes) - 1, payload))
        elif kind == "bias":
            if root.bias is not None:
                return "a second bias added to a linear that already has one"
            if scale != 1.0 or tanh_seen or root.weight_scale is not None or root.row_scaled:
                return "a bias added after the logits were scaled or softcapped"
            root.bias, root.raw_at = payload, len(root.nodes) - 1
        elif kind == "detach":
            root.detached = True
        elif kind in ("slice", "view"):
            root.shape_ops.append((len(root.nodes) - 1, payload))
        # from here on the values are final, and rows keep their order (a head or logsumexp reading
        # an earlier node would see other values, or its rows in another order)
        if kind in VALUE_KINDS or (kind == "view" and payload[0] == "permute"):
            root.final_from = len(root.nodes) - 1
    if tanh_seen:
        if post == 0.0 or not math.isfinite(post):
            return f"softcap multiplier {post} is not a finite nonzero number"
        root.softcap, root.logit_scale, root.shift = abs(post), scale * post, post_shift
    else:
        root.logit_scale = scale
    if not all(math.isfinite(x) for x in (root.logit_scale, root.bias_shift, root.shift)):
        return f"logit scale {root.logit_scale} or shift {root.bias_shift}, {root.shift} is not finite"
    return None


# the steps that change the logits' values (or their rows' order)
VALUE_KINDS = ("scale", "tensor_scale", "row_scale", "tanh", "sigmoid", "shift", "bias", "slice")


def replay(emit, tensor: Node, ops: list, last: Any) -> Node:
    """Apply the leading-dim views / slices ``ops`` of the logits to ``tensor``, whose last
    dimension is ``last`` (D for the hidden states) instead of V; per-row factors multiply it."""
    for op in ops:
        if op[0] == "row_scale":  # a per-row factor: (h * r) @ W.T == (h @ W.T) * r
            tensor = emit.call(operator.truediv if op[2] else operator.mul, tensor, op[1])
        elif op[0] == "slice":
            tensor = emit.getitem(tensor, op[1])
        elif op[0] == "permute":
            tensor = emit.method("permute", tensor, op[1])
        elif op[0] == "flatten":
            tensor = emit.method("flatten", tensor, op[1], op[2])
        else:
            shape = list(op[1])
            if not (isinstance(shape[-1], int) and shape[-1] == -1):
                shape[-1] = last
            tensor = emit.method("reshape", tensor, shape)
    return tensor


def scaled_weight(graph, chain: Logits) -> Node:
    """``[V, D]`` weight times ``chain.weight_scale`` per row, in the weight's dtype, computed where the
    logits were multiplied (so it reads the scale when eager did)."""
    e = Emitter(graph, chain.weight_scale_at, chain.weight_scale_at)
    w = chain.weight if chain.weight_is_vd else e.method("t", chain.weight)
    w = e.call(operator.mul, w, e.method("reshape", chain.weight_scale, (-1, 1)))
    return w if tval(w).dtype == tval(chain.weight).dtype else e.method("to", w, tval(chain.weight).dtype)
