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
  constant after it that softmaxes ignore (a logsumexp of those logits adds it: ``LogitsChain.shift``);
* a Python number added before the softcap (``tanh((z + 5) / s)``): a constant bias of the matmul
  (``LogitsChain.bias_shift``); ``z - k`` as ``z + (-k)``;
* multiplication by a tensor holding one factor per vocabulary entry (or one in all), before any
  softcap: folded into the weight, ``W * s[:, None]`` (Dory's learned per-token logit scale);
* multiplication or division by a tensor of one factor per row (``logits / T.unsqueeze(-1)``, a
  per-token temperature as verl's engine passes it), before any softcap and bias: pushed onto the
  hidden states' rows, ``(h / T[..., None]) @ W.T`` (autograd gives ``T`` its gradient);
* ``.detach()``: the heads over it have no gradient (``LogitsChain.detached``);
* a bias add of a ``[V]`` tensor right after the matmul;
* slices, transposes and permutations of the leading (batch/sequence) dimensions and the views
  around them (a chunk of ``logits.split(k)`` / ``logits.chunk(n)`` along one of them is a slice),
  which the rewrite replays on the hidden states instead (``logits[:, :-1]`` -> ``hidden[:, :-1]``;
  ``mm(h2d, W.t()).view(B, T, V)[:, 1:]`` -> ``h2d.reshape(B, T, D)[:, 1:]``;
  ProphetNet's ``logits.transpose(0, 1)`` of ``[B, ngram, T, V]`` -> ``hidden.transpose(0, 1)``).
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch.fx import Node

from .. import compat
from . import _steps
from ._fx import Emitter, arg, is_call, norm_dim, tval
from ._site import Decline
from ._steps import Permute, RowOp, RowScale, Slice, StackedSlice, Step, step_of

LINEAR = (torch._C._nn.linear,)
MATMUL = (operator.matmul, torch.matmul, torch.mm, "matmul", "mm", "__matmul__")

# The walk from the loss back to the matmul follows at most this many ops. Real heads have a handful
# (HF: linear, float, view; Gemma 2: linear, div, tanh, mul, float, view; ProphetNet adds a
# transpose, contiguous and view); a longer chain of foldable ops is not an lm_head's logits.
MAX_STEPS = 64
# Past an op it cannot fold, the walk follows first arguments this far looking for a matmul, to
# decline naming that op (an lm_head is there) rather than skip the loss as no site at all.
UNSUPPORTED_DEPTH = 16

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
class LogitsChain:
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
    # views / slices of the leading dims and per-row factors between matmul and logits, in order, as
    # (position in ``nodes`` of the node they produce, RowOp); ``replay`` applies them to the hidden states
    shape_ops: list[tuple[int, RowOp]] = field(default_factory=list)
    nodes: list = field(default_factory=list)  # matmul ... logits, in graph order
    steps: list[Step] = field(default_factory=list)  # the step computing each of nodes[1:]
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
        return any(isinstance(op, RowScale) for _, op in self.shape_ops)

    @property
    def sliced(self) -> bool:
        return any(isinstance(op, Slice) and not isinstance(op, StackedSlice) for _, op in self.shape_ops)

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


def same_logits(a: LogitsChain, b: LogitsChain, *, monotone: bool = False) -> bool:
    """True when ``a`` and ``b`` (walks from two heads) are the same logits, rows in the same order:
    one matmul, and nodes shared up to where both are final. ``monotone`` (an argmax) also accepts
    logits that differ by a scale of the same sign or a softcap (their rows' argmax is the same, up
    to rounding), e.g. ``logits.argmax(-1)`` next to ``(logits / T).log_softmax(-1)``."""
    if a.matmul is not b.matmul:
        return False
    k = next((i for i, (x, y) in enumerate(zip(a.nodes, b.nodes)) if x is not y), min(len(a.nodes), len(b.nodes)))
    if k > a.final_from and k > b.final_from:
        return True
    reorders = any(i >= k and isinstance(op, (Slice, Permute)) for c in (a, b) for i, op in c.shape_ops)
    return (monotone and not reorders and a.bias is b.bias and a.weight_scale is b.weight_scale
            and (a.logit_scale > 0) == (b.logit_scale > 0))


def other_rows(a: LogitsChain, b: LogitsChain) -> bool:
    """True when ``a`` and ``b`` walk back to one matmul but read different row slices of it (e.g.
    ``F.cross_entropy(logits[s:e], t[s:e], reduction="sum")`` summed over chunks): each is a site of
    its own, with the slice pushed onto the hidden states."""
    if a.matmul is not b.matmul or same_logits(a, b):
        return False
    return all(_sliced_apart(a, b, c) for c in (a, b))


def sliced_rows(a: LogitsChain, b: LogitsChain) -> bool:
    """True when ``a`` and ``b`` walk back to one matmul and one of them reads a row slice of the
    logits the other reads (TRL's token accuracy on ``logits[..., :-1, :]`` next to HF's loss over
    every row with padded labels): an argmax there is a site of its own (one more forward GEMM over
    its rows, none of the [N, V] logits) rather than a decline of both."""
    if a.matmul is not b.matmul or same_logits(a, b):
        return False
    return any(_sliced_apart(a, b, c) for c in (a, b))


def _sliced_apart(a: LogitsChain, b: LogitsChain, c: LogitsChain) -> bool:
    """``c`` (``a`` or ``b``) slices its rows after the node where the two walks part."""
    k = next((i for i, (x, y) in enumerate(zip(a.nodes, b.nodes)) if x is not y), min(len(a.nodes), len(b.nodes)))
    return any(i >= k and isinstance(op, Slice) for i, op in c.shape_ops)


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


def _root(node: Node) -> Union[LogitsChain, Decline]:
    """The matmul node's operands, as a partially filled LogitsChain."""
    if is_call(node, LINEAR):
        x, w, b = arg(node, 0, "input"), arg(node, 1, "weight"), arg(node, 2, "bias")
        tw = tval(w)
        if tw is None or tw.dim() != 2:
            return Decline(None, node, "the linear's weight is not a 2-D tensor")
        return LogitsChain(node, x, w, True, b if isinstance(b, Node) else None)
    einsum = _einsum_weight(node)
    if einsum is not None:
        x, w, is_vd = einsum
        return LogitsChain(node, x, w, is_vd)
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
        return LogitsChain(node, x, inner, True)
    return LogitsChain(node, x, m, False)


def trace(logits: Node) -> Union[LogitsChain, Decline, None]:
    """LogitsChain for the tensor ``logits`` (vocabulary last); a Decline when an lm_head matmul is there
    but something unsupported sits in between; None when no matmul feeds it."""
    steps: list[Step] = []
    node = logits
    for _ in range(MAX_STEPS):
        if is_matmul(node):
            break
        step = step_of(node) if isinstance(node, Node) else None
        if step is None:
            return _stopped(node, steps)
        steps.append(step)
        node = step.src
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
    if isinstance(node, Node) and node.op == "placeholder" and steps and isinstance(steps[-1], _steps.Cast):
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
    if _scatters_sorted(node):
        return (": the sorted logits scattered back to their columns (vLLM's apply_top_k_top_p, which writes "
                "into the sorted logits) are not fused; HF's warper spelling (the removed mask scattered, then "
                "masked_fill on the logits) is, and so is linear_log_probs(..., top_k=, top_p=) with one p per row")
    if _steps.divides_by_a_tensor(node):
        return (": the logits are divided by a tensor that is not one factor per row (a per-row temperature "
                "logits / T.unsqueeze(-1) folds), or by a symbolic number (a Python float Dynamo made dynamic); "
                "a Python number or a [..., 1] tensor fold")
    return ""


def _scatters_sorted(node: Node) -> bool:
    """``s.scatter(-1, order, s)`` with ``s, order = z.sort(...)``: the sorted logits put back."""
    if not is_call(node, (torch.scatter, "scatter")):
        return False
    src = arg(node, 0, "input")
    return is_call(src, (operator.getitem,)) and is_call(src.args[0], (torch.sort, "sort"))


def _is_linear_module(node: Node) -> bool:
    try:
        return isinstance(node.graph.owning_module.get_submodule(node.target), torch.nn.Linear)
    except (AttributeError, TypeError):
        return False


def _fold(chain: LogitsChain, steps: list) -> Optional[str]:
    """Fold ``steps`` (the walk back's, loss first) forward from the matmul into ``chain`` (bias,
    logit_scale, softcap, shifts, weight_scale, shape_ops); a reason when they do not fold."""
    chain.nodes, chain.steps, acc = [chain.matmul], [], _steps.Fold()
    for step in reversed(steps):
        chain.nodes.append(step.node)
        chain.steps.append(step)
        reason = step.fold(chain, acc, len(chain.nodes) - 1)
        if reason:
            return reason
        # from here on the values are final, and rows keep their order (a head or logsumexp reading
        # an earlier node would see other values, or its rows in another order)
        if step.changes_values:
            chain.final_from = len(chain.nodes) - 1
    return _steps.finish(chain, acc)


def replay(emit, tensor: Node, ops: list, last: Any) -> Node:
    """Apply the leading-dim steps ``ops`` of the logits (views, slices, per-row factors: ``RowOp``)
    to ``tensor``, whose last dimension is ``last`` (D for the hidden states) instead of V."""
    for op in ops:
        tensor = op.replay(emit, tensor, last)
    return tensor


def scaled_weight(graph, chain: LogitsChain) -> Node:
    """``[V, D]`` weight times ``chain.weight_scale`` per row, in the weight's dtype, computed where the
    logits were multiplied (so it reads the scale when eager did)."""
    e = Emitter(graph, chain.weight_scale_at, chain.weight_scale_at)
    w = chain.weight if chain.weight_is_vd else e.method("t", chain.weight)
    w = e.call(operator.mul, w, e.method("reshape", chain.weight_scale, (-1, 1)))
    return w if tval(w).dtype == tval(chain.weight).dtype else e.method("to", w, tval(chain.weight).dtype)
