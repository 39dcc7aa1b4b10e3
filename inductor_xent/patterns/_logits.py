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
* multiplication by a tensor holding one factor per vocabulary entry (or one in all), before any
  softcap: folded into the weight, ``W * s[:, None]`` (Dory's learned per-token logit scale);
* a bias add of a ``[V]`` tensor right after the matmul;
* slices, transposes and permutations of the leading (batch/sequence) dimensions and the views
  around them, which the rewrite replays on the hidden states instead (``logits[:, :-1]`` ->
  ``hidden[:, :-1]``; ``mm(h2d, W.t()).view(B, T, V)[:, 1:]`` -> ``h2d.reshape(B, T, D)[:, 1:]``;
  ProphetNet's ``logits.transpose(0, 1)`` of ``[B, ngram, T, V]`` -> ``hidden.transpose(0, 1)``).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch.fx import Node

from . import _dtensor
from ._fx import Emitter, arg, is_call, norm_dim, number, same, tval

LINEAR = (torch._C._nn.linear,)
MATMUL = (operator.matmul, torch.matmul, torch.mm)
MATMUL_METHODS = ("matmul", "mm", "__matmul__")
CAST_METHODS = ("float", "half", "bfloat16", "double", "to", "type", "type_as")
VIEW_METHODS = ("view", "reshape", "flatten", "contiguous")
VIEW_FUNCTIONS = (torch.reshape, torch.flatten)
MUL = (operator.mul, torch.mul)
DIV = (operator.truediv, torch.div, torch.true_divide)
ADD = (operator.add, torch.add)
TANH = (torch.tanh, F.tanh)  # F.tanh is its own callable in Dynamo graphs
TRANSPOSE = (torch.transpose, torch.swapaxes, torch.swapdims)
TRANSPOSE_METHODS = ("transpose", "swapaxes", "swapdims")


GRAPH_INPUT = (
    "the logits are an input of this graph: a graph break separates the lm_head matmul from the loss "
    "(torch._dynamo.explain shows where); remove the break to fuse"
)


CALL_MODULE = (
    "the lm_head is an nn.Linear call_module node (torch._dynamo.config.inline_inbuilt_nn_modules="
    "False, possible on torch 2.11): set it to True (the default) to fuse"
)


def _is_linear_module(node: Node) -> bool:
    try:
        return isinstance(node.graph.owning_module.get_submodule(node.target), torch.nn.Linear)
    except (AttributeError, TypeError):
        return False


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
    # views / slices of the leading dims between matmul and logits, in order, as (position in
    # ``nodes`` of the node they produce, op); ``replay`` applies them to the hidden states
    shape_ops: list = field(default_factory=list)
    nodes: list = field(default_factory=list)  # matmul ... logits, in graph order
    final_from: int = 0  # nodes[final_from:] hold the final logit values (for the lse mapping)

    @property
    def sliced(self) -> bool:
        return any(op[0] == "slice" for _, op in self.shape_ops)

    @property
    def out(self) -> Node:
        return self.nodes[-1]


def _is_full_slice(s: Any) -> bool:
    return isinstance(s, slice) and s.start is None and s.stop is None and s.step is None


def _leading_slice(index: Any, ndim: int) -> bool:
    """True when ``index`` only slices dimensions before the last (no ints, None or tensors)."""
    items = index if isinstance(index, tuple) else (index,)
    if not all(isinstance(i, slice) or i is Ellipsis for i in items):
        return False
    if sum(i is Ellipsis for i in items) > 1:
        return False
    if Ellipsis in items:
        after = items[items.index(Ellipsis) + 1:]
        return not after or _is_full_slice(after[-1])
    return len(items) < ndim or _is_full_slice(items[-1])


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
    last, vocab = rest[-1], tval(node).shape[-1]
    if isinstance(last, Node):
        last = last.meta.get("example_value")
    if isinstance(last, bool) or last is None:
        return None
    if (isinstance(last, int) and last == -1) or same(last, vocab):
        return rest
    return None


def replay(emit, tensor: Node, ops: list, last: Any) -> Node:
    """Apply the leading-dim views / slices ``ops`` of the logits to ``tensor``, whose last
    dimension is ``last`` (D for the hidden states, 1 for an lse column) instead of V."""
    for op in ops:
        if op[0] == "slice":
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


def _tensor_side(node: Node) -> tuple[Optional[Node], Any]:
    """For a binary op ``a (op) b``: (the tensor operand, the other operand)."""
    a, b = arg(node, 0, "input"), arg(node, 1, "other")
    if isinstance(a, Node) and tval(a) is not None and not isinstance(b, Node):
        return a, b
    if isinstance(b, Node) and tval(b) is not None and not isinstance(a, Node):
        return b, a
    return None, None


def _step(node: Node) -> Optional[tuple[str, Node, Any]]:
    """One op between matmul and loss: (kind, its logits input, payload), or None."""
    out = tval(node)
    if out is None or out.dim() < 1:
        return None
    if node.op == "call_method" and node.target in CAST_METHODS:
        src = node.args[0]
        ins = tval(src)
        ok_kw = set(node.kwargs) <= {"dtype", "non_blocking", "copy", "device"}
        if ins is not None and ok_kw and out.dtype.is_floating_point and out.device == ins.device \
                and out.shape == ins.shape:
            return "cast", src, None
        return None
    if is_call(node, VIEW_FUNCTIONS, VIEW_METHODS):
        src = node.args[0]
        ins = tval(src)
        if ins is None or ins.dtype != out.dtype or out.dim() < 2 or not same(out.shape[-1], ins.shape[-1]):
            return None
        if node.target == "contiguous":
            return "noop", src, None
        if node.target in ("flatten", torch.flatten):
            start, end = arg(node, 1, "start_dim", 0), arg(node, 2, "end_dim", -1)
            # flatten must stop before the vocabulary dimension
            if norm_dim(end, ins.dim()) in (None, ins.dim() - 1) or norm_dim(start, ins.dim()) is None:
                return None
            return "view", src, ("flatten", start, end)
        shape = _shape_arg(node)
        if shape is None:
            return None
        return "view", src, ("reshape", shape)
    if is_call(node, TRANSPOSE + (torch.permute,), TRANSPOSE_METHODS + ("permute",)):
        perm = _leading_permutation(node)
        return None if perm is None else ("view", node.args[0], ("permute", perm))
    if node.op == "call_function" and node.target is operator.getitem:
        src, index = node.args
        ins = tval(src)
        if ins is not None and _leading_slice(index, ins.dim()):
            return "slice", src, ("slice", index)
        return None
    if is_call(node, MUL, ("mul",)) and not node.kwargs.get("out"):
        src, k = _tensor_side(node)
        k = number(k)
        if src is not None and k is not None:
            return "scale", src, k
        return _tensor_scale(node, out)
    if is_call(node, DIV, ("div", "true_divide")) and not node.kwargs.get("rounding_mode") \
            and not node.kwargs.get("out"):
        src, k = arg(node, 0, "input"), number(arg(node, 1, "other"))
        if isinstance(src, Node) and k not in (None, 0.0):
            return "scale", src, 1.0 / k
        return None
    if is_call(node, TANH, ("tanh",)) and len(node.args) == 1 and not node.kwargs:
        return "tanh", node.args[0], None
    if is_call(node, ADD, ("add",)) and not node.kwargs:
        a, b = node.args[:2] if len(node.args) >= 2 else (None, None)
        for src, bias in ((a, b), (b, a)):
            ts, tb = tval(src), tval(bias)
            if ts is not None and tb is not None and tb.dim() == 1 and ts.dim() == out.dim() \
                    and same(tb.shape[0], out.shape[-1]):
                return "bias", src, bias
        return None
    return _dtensor.step(node)  # redistribute / to_local of tensor-parallel (DTensor) logits


def _leading_permutation(node: Node) -> Optional[tuple]:
    """The permutation a transpose / permute applies, when it keeps the last (vocabulary) dim last."""
    ins = tval(node.args[0]) if node.args else None
    if ins is None or node.kwargs:
        return None
    n = ins.dim()
    if is_call(node, TRANSPOSE, TRANSPOSE_METHODS):
        if len(node.args) != 3:
            return None
        d0, d1 = norm_dim(node.args[1], n), norm_dim(node.args[2], n)
        if d0 is None or d1 is None:
            return None
        perm = list(range(n))
        perm[d0], perm[d1] = d1, d0
    else:
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
        perm = [norm_dim(d, n) for d in dims]
        if len(perm) != n or None in perm or sorted(perm) != list(range(n)):
            return None
    return tuple(perm) if perm[-1] == n - 1 else None


def _tensor_scale(node: Node, out: torch.Tensor) -> Optional[tuple[str, Node, Node]]:
    """``z * s`` (either order) with ``s`` a tensor of one factor per vocabulary entry, or one factor:
    ("tensor_scale", z, s), when the multiply changes neither the shape nor the dtype of ``z``."""
    a, b = arg(node, 0, "input"), arg(node, 1, "other")
    for src, scale in ((a, b), (b, a)):
        ts, tk = tval(src), tval(scale)
        if ts is None or tk is None or not tk.dtype.is_floating_point or tk.dim() > ts.dim():
            continue
        if ts.dtype != out.dtype or ts.dim() != out.dim() or not all(same(x, y) for x, y in zip(ts.shape, out.shape)):
            continue
        if all(same(x, 1) for x in tk.shape[:-1]) and (tk.dim() == 0 or same(tk.shape[-1], 1)
                                                       or same(tk.shape[-1], out.shape[-1])):
            return "tensor_scale", src, scale
    return None


def _depends_on(node: Node, target: Node, limit: int = 100_000) -> bool:
    """True when ``target`` is among ``node``'s inputs, transitively (or the graph is too large to tell)."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n is target or len(seen) > limit:
            return True
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return False


def scaled_weight(graph, chain: Logits) -> Node:
    """``[V, D]`` weight times ``chain.weight_scale`` per row, in the weight's dtype, computed where the
    logits were multiplied (so it reads the scale when eager did)."""
    e = Emitter(graph, chain.weight_scale_at, chain.weight_scale_at)
    w = chain.weight if chain.weight_is_vd else e.method("t", chain.weight)
    w = e.call(operator.mul, w, e.method("reshape", chain.weight_scale, (-1, 1)))
    return w if tval(w).dtype == tval(chain.weight).dtype else e.method("to", w, tval(chain.weight).dtype)


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


def _is_matmul(node: Any) -> bool:
    return is_call(node, LINEAR + MATMUL, MATMUL_METHODS) or _einsum_weight(node) is not None


def _root(node: Node) -> Union[Logits, str]:
    """The matmul node's operands, as a partially filled Logits, or a reason."""
    if is_call(node, LINEAR):
        x, w = arg(node, 0, "input"), arg(node, 1, "weight")
        b = arg(node, 2, "bias")
        tw = tval(w)
        if tw is None or tw.dim() != 2:
            return "the linear's weight is not a 2-D tensor"
        return Logits(node, x, w, True, b if isinstance(b, Node) else None)
    einsum = _einsum_weight(node)
    if einsum is not None:
        x, w, is_vd = einsum
        return Logits(node, x, w, is_vd)
    x, m = node.args[:2]
    tm = tval(m)
    if tm is None or tm.dim() != 2:
        return "the matmul's right operand is not a 2-D weight"
    # W.t() / W.T / W.transpose(0, 1) / W.permute(1, 0) of a [V, D] weight: use W itself
    inner = m.args[0] if isinstance(m, Node) and m.args else None
    is_t = (
        is_call(m, (), ("t",))
        or (m.op == "call_function" and m.target is getattr and m.args[1:] in (("T",), ("mT",)))
        or (is_call(m, (torch.t,)))
        or (is_call(m, (torch.transpose,), ("transpose",)) and {norm_dim(d, 2) for d in m.args[1:3]} == {0, 1})
        or (is_call(m, (), ("permute",)) and tuple(m.args[1:]) in ((1, 0), ((1, 0),), ([1, 0],)))
    )
    if is_t and tval(inner) is not None and tval(inner).dim() == 2:
        return Logits(node, x, inner, True)
    return Logits(node, x, m, False)


def trace(logits: Node) -> Union[Logits, str, None]:
    """Logits for the tensor ``logits`` (vocabulary last), a reason to decline when an lm_head
    matmul is there but something unsupported sits in between, or None when no matmul feeds it."""
    steps: list[tuple[str, Node, Any, Node]] = []
    node = logits
    for _ in range(64):
        if _is_matmul(node):
            break
        step = _step(node) if isinstance(node, Node) else None
        if step is None:
            if isinstance(node, Node) and node.op == "placeholder" and steps and steps[-1][0] == "cast":
                return GRAPH_INPUT
            if isinstance(node, Node) and node.op == "call_module" and _is_linear_module(node):
                return CALL_MODULE
            return _unsupported(node)
        steps.append((*step, node))
        node = step[1]
    else:
        return None
    root = _root(node)
    if isinstance(root, str):
        return root
    tx = tval(root.hidden)
    if tx is None or tx.dim() < 2:
        return "the hidden states are not a [..., D] tensor with at least one row dimension"
    root.nodes = [node]

    # replay the steps forward, folding them into (bias, logit_scale, softcap, shape_ops)
    scale, post, tanh_seen = 1.0, None, False
    final_from = 0
    for kind, _src, payload, n in reversed(steps):
        root.nodes.append(n)
        if kind == "scale":
            if tanh_seen:
                post *= payload
            else:
                scale *= payload
        elif kind == "tanh":
            if tanh_seen:
                return "two tanh between the matmul and the loss"
            tanh_seen, post = True, 1.0
        elif kind == "tensor_scale":
            if tanh_seen:
                return "the logits are multiplied by a tensor after the softcap's tanh (a Python number only)"
            if root.weight_scale is not None:
                return "the logits are multiplied by two tensors"
            if root.bias is not None:
                return "the logits of a linear with a bias are multiplied by a tensor"
            if _depends_on(payload, root.matmul):
                return "the logits are multiplied by a tensor computed from the logits"
            root.weight_scale, root.weight_scale_at = payload, n
        elif kind == "bias":
            if root.bias is not None:
                return "a second bias added to a linear that already has one"
            if scale != 1.0 or tanh_seen or root.weight_scale is not None:
                return "a bias added after the logits were scaled or softcapped"
            root.bias = payload
        elif kind in ("slice", "view"):
            root.shape_ops.append((len(root.nodes) - 1, payload))
        if kind in ("scale", "tensor_scale", "tanh", "bias", "slice"):
            final_from = len(root.nodes) - 1
    root.final_from = final_from
    if tanh_seen:
        if post == 0.0 or not math.isfinite(post):
            return f"softcap multiplier {post} is not a finite nonzero number"
        root.softcap, root.logit_scale = abs(post), scale * post
    else:
        root.logit_scale = scale
    if not math.isfinite(root.logit_scale):
        return f"logit scale {root.logit_scale} is not finite"
    return root


def _unsupported(node: Any) -> Optional[str]:
    """A reason when an lm_head matmul lies upstream of ``node`` through an op we cannot fold."""
    cur = node
    for _ in range(16):
        first = cur.args[0] if isinstance(cur, Node) and cur.args else None
        if isinstance(first, (list, tuple)) and first:  # torch.stack / torch.cat of several heads
            first = first[0]
        if not isinstance(first, Node):
            return None
        cur = first
        if _is_matmul(cur):
            desc = node.target if node.op == "call_method" else getattr(node.target, "__name__", node.target)
            what = (": an index that is not a slice of the leading dimensions (e.g. one of several stacked "
                    "heads; compute each head's loss from its own matmul to fuse)"
                    if node.target is operator.getitem else "")
            return f"unsupported op between the lm_head matmul and the loss: {node.op} {desc} ({node.name}){what}"
    return None
