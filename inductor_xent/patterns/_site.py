"""What an idiom hands to the driver: a head over lm_head logits (or a reason to decline), plus the
shared recognisers the idioms and the plan use (class dimension, loss arguments, log-probabilities
and probabilities of the logits, logsumexp)."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Optional, get_args

import torch
import torch.nn.functional as F
from torch.fx import Node

from ._fx import arg, is_call, norm_dim, number, permutation, same, tval

# ignore_index for spellings that have none (gather, one_hot): out of range of any class id and of
# int32, so no real target is ever ignored. Eager raises on such a target; we never see one.
NO_IGNORE = -(2**31)


# what a head computes per row of the logits, in the order explain names a site's heads
HeadKind = Literal["cross_entropy", "log_probs", "entropy", "argmax", "topk", "kept", "gathered", "distillation"]
HEAD_KINDS: tuple[HeadKind, ...] = get_args(HeadKind)
# heads computed by an op of their own (next to the site's cross-entropy or log-probs op, if any)
OWN_OP: tuple[HeadKind, ...] = ("topk", "kept", "gathered")


@dataclass
class Head:
    """A head over lm_head logits that the driver can replace by an output of the fused op.

    ``loss`` holds, per row of the logits (minus that when ``negate``), by ``kind``:
    ``cross_entropy`` the loss ``lse − z[target]`` (0 where ``target == ignore_index``) reduced by
    ``reduction`` (``mean``: ``rows.sum() / (target != ignore_index).sum()``); ``log_probs``
    ``z[target] − lse``; ``entropy`` ``−Σ p·log p``; ``argmax`` the first maximal column; ``topk``
    (``loss`` the ``torch.topk`` node, ``aux`` its item reads) the ``k`` largest ``normalised``
    values and their columns (the top-k op, next to the site's other op if any); ``kept`` the
    log-prob of the target over the row's top-k or nucleus (top-p) kept set (``loss`` the gather, as
    ``log_probs``); ``gathered`` the ``normalised`` values at the ids ``index[..., k]`` of each row
    (``loss`` the gather; gathered.py's op). Per-row
    values are viewed as ``shape_ref`` (then ``squeeze(-1)`` when ``drop_last``), or without one as
    the rows of ``logits`` (with a trailing 1 when ``keepdim``).
    """

    pattern: str
    loss: Node
    logits: Node  # the [..., V] tensor the idiom reads, vocabulary last
    target: Optional[Node]  # integer class ids, one per row of logits (target.reshape(-1)); None for entropy, argmax
    consumed: tuple = ()  # idiom nodes derived from the logits (erased once dead)
    aux: tuple = ()  # idiom nodes not derived from the logits (erased once dead)
    ignore_index: int = NO_IGNORE
    reduction: str = "none"
    label_smoothing: float = 0.0
    shape_ref: Optional[Node] = None
    drop_last: bool = False
    negate: bool = False
    needs_lse_of: tuple = ()  # logsumexp nodes the idiom relies on: each must map to the op's lse
    kind: HeadKind = "cross_entropy"
    keepdim: bool = False
    k: int = 0  # topk: how many per row; kept: the top-k kept set's (0: none)
    normalised: str = ""  # topk, gathered: of the "logits", "log_probs" or "probs"
    index: Optional[Node] = None  # gathered: the ids [..., k], k per row of the logits
    top_p: float = 1.0  # kept: the nucleus kept set's mass (1: none)
    top_p_rows: Optional[Node] = None  # kept: one mass per row instead (broadcasts to the rows' shape)

    @property
    def nucleus(self) -> bool:
        """A nucleus (top-p) kept set: one mass for every row, or one per row."""
        return self.kind == "kept" and (self.top_p < 1.0 or self.top_p_rows is not None)


@dataclass
class Decline:
    """Why a candidate is left alone (``pattern`` None from the walk back or the plan: the driver knows it)."""

    pattern: Optional[str]
    node: Node
    reason: str
    logits: Optional[Node] = None  # the logits the loss reads, when known (else its first argument)
    logits_escape: bool = False  # the logits are a graph output (explain says what to compile instead)
    logits_input: bool = False  # the logits are a graph input: a graph break before the loss
    kind: HeadKind = "cross_entropy"  # what the declined head computes (Head.kind)


def vocab_last(node: Any, class_dim: int) -> Optional[tuple[Node, tuple]]:
    """The same logits with the vocabulary as the last dimension, when ``node``'s class dimension
    ``class_dim`` is last already (2-D) or comes from ``transpose(1, 2)`` of a 3-D tensor."""
    t = tval(node)
    if t is None or t.dim() < 2:
        return None
    cd = norm_dim(class_dim, t.dim())
    if cd == t.dim() - 1:
        return node, ()
    if t.dim() == 3 and cd == 1 and permutation(node) == (0, 2, 1):
        return arg(node, 0, "input"), (node,)
    return None


LOG_SOFTMAX = (F.log_softmax, torch.log_softmax, "log_softmax")
SOFTMAX = (F.softmax, torch.softmax, "softmax")
SUB = (operator.sub, torch.sub, "sub")


def log_softmax(node: Any, targets: tuple = LOG_SOFTMAX) -> Optional[tuple[Node, int]]:
    """(input, normalised dim) when ``node`` is a log_softmax (or another of ``targets``, called
    alike) over an explicit dimension."""
    if not is_call(node, targets):
        return None
    src, dim = arg(node, 0, "input"), arg(node, 1, "dim")
    # F.log_softmax(input, dim, _stacklevel, dtype); the method's dtype is read by keyword only
    dtype = arg(node, 3, "dtype") if node.op == "call_function" else node.kwargs.get("dtype")
    t = tval(src)
    if t is None or dim is None or (dtype is not None and not dtype.is_floating_point):
        return None
    d = norm_dim(dim, t.dim())
    return None if d is None else (src, d)


class Normalised(NamedTuple):
    """Log-probabilities or probabilities of ``logits`` over their dimension ``dim``."""

    logits: Node
    dim: int
    nodes: tuple  # from the logits (excluded) to the result
    lse: tuple = ()  # logsumexp nodes it subtracts: the plan maps them onto the op's lse


def log_probs_of(node: Any) -> Optional[Normalised]:
    """``log_softmax(z, dim)``, or ``z − logsumexp(z, -1, keepdim=True)`` (the normalised logits of
    ``torch.distributions.Categorical``), maybe through what Categorical puts around them:
    ``broadcast_tensors(value, lp)[1]`` (``log_prob``) and ``clamp(lp, min=finfo.min)``
    (``entropy``; log-probabilities are finite, so that clamp changes nothing)."""
    around: tuple = ()
    while isinstance(node, Node):
        found = _passthrough(node)
        if found is None:
            break
        node, passed = found
        around = (*around, *passed)
    ls = log_softmax(node)
    if ls is not None:
        return Normalised(ls[0], ls[1], (*around, node))
    if is_call(node, SUB) and len(node.args) == 2 and not node.kwargs:
        z, lse = node.args
        m = lse_of(lse)
        if m is not None and m[0] is z and m[1]:
            return Normalised(z, tval(z).dim() - 1, (*around, node), (lse,))
    return None


def probs_of(node: Any) -> Optional[Normalised]:
    """``softmax(z, dim)`` (also of log-probabilities of ``z`` over the same dim, as Categorical's
    ``probs``), or ``exp`` of log-probabilities of ``z``."""
    sm = log_softmax(node, SOFTMAX)
    if sm is not None:
        lp = log_probs_of(sm[0])
        if lp is not None and lp.dim == sm[1]:
            return lp._replace(nodes=(*lp.nodes, node))
        return Normalised(sm[0], sm[1], (node,))
    lp = log_probs_of(arg(node, 0, "input")) if is_call(node, (torch.exp, "exp")) and len(node.args) == 1 else None
    return None if lp is None else lp._replace(nodes=(*lp.nodes, node))


def _passthrough(node: Node) -> Optional[tuple[Node, tuple]]:
    """(input, the nodes passed) when ``node`` returns its input's values unchanged for
    log-probabilities: the log-probs item of ``broadcast_tensors`` with nothing to broadcast,
    ``clamp(min=finfo.min)``."""
    t = tval(node)
    if is_call(node, (operator.getitem,)) and is_call(node.args[0], (torch.functional.broadcast_tensors,)) \
            and isinstance(node.args[1], int):
        src = node.args[0].args[node.args[1]]
        ts = tval(src)
        return (src, (node, node.args[0])) if ts is not None and t is not None and ts.shape == t.shape else None
    if is_call(node, (torch.clamp, "clamp", torch.clamp_min, "clamp_min")) and t is not None \
            and t.dtype.is_floating_point:
        low = arg(node, 1, "min")
        rest = [a for a in (*node.args[2:], node.kwargs.get("max")) if a is not None]
        return (arg(node, 0, "input"), (node,)) if low == torch.finfo(t.dtype).min and not rest else None
    return None


def unbroadcast(index: Any) -> tuple[Any, tuple]:
    """Categorical.log_prob's index ``broadcast_tensors(value, lp)[0][..., :1]`` as ``value`` (its
    last dimension 1, so the broadcast and the slice give it back), and the nodes in between;
    any other index as is."""
    if is_call(index, (operator.getitem,)) and index.args[1] == (Ellipsis, slice(None, 1, None)):
        item = index.args[0]
        if is_call(item, (operator.getitem,)) and item.args[1] == 0 \
                and is_call(item.args[0], (torch.functional.broadcast_tensors,)):
            value = item.args[0].args[0]
            tv, ti = tval(value), tval(index)
            if tv is not None and ti is not None and tv.shape == ti.shape:
                return value, (index, item)
    return index, ()


def loss_args_reason(a: dict) -> Optional[str]:
    """Why the arguments of ``F.cross_entropy`` / ``F.nll_loss`` (bound by name) are not fused, or None."""
    ii, eps = a["ignore_index"], number(a.get("label_smoothing", 0.0))
    if a["weight"] is not None:
        return "class weights (weight=...) are not supported"
    if a["size_average"] is not None or a["reduce"] is not None:
        return "legacy size_average/reduce arguments"
    reason = integer_target(a["target"])
    if reason:
        return reason
    if not isinstance(ii, int) or isinstance(ii, bool):
        return f"ignore_index {ii!r} is not a Python int"
    if eps is None or not 0.0 <= eps <= 1.0:
        return f"label_smoothing {a['label_smoothing']!r} is not a constant in [0, 1]"
    if a["reduction"] not in ("mean", "sum", "none"):
        return f"reduction {a['reduction']!r}"
    return None


def integer_target(node: Any) -> Optional[str]:
    """None when ``node`` holds int64 class ids, else a reason."""
    t = tval(node)
    if t is None:
        return "the target is not a tensor"
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return f"probability targets ({t.dtype}): only integer class ids are fused"
    if t.dtype != torch.int64:
        return f"target dtype {t.dtype} (int64 class ids only)"
    return None


_ORDER_KEEPING = (torch.reshape, torch.flatten, torch.unsqueeze, torch.squeeze, "view", "reshape", "flatten",
                  "unsqueeze", "squeeze", "contiguous")


def ids_base(node: Any) -> Any:
    """``node`` without the reshapes that keep its elements in order (``ids.view(-1)``,
    ``ids.unsqueeze(-1)``, ``ids[..., None]``): two heads' targets with one base are the same ids."""
    while is_call(node, _ORDER_KEEPING) or (
            is_call(node, (operator.getitem,)) and isinstance(node.args[1], tuple)
            and all(i is None or i is Ellipsis or i == slice(None) for i in node.args[1])):
        node = arg(node, 0, "input")
    return node


def lse_of(node: Any) -> Optional[tuple[Node, bool, tuple]]:
    """(logits, keepdim, nodes in between) when ``node`` is ``logsumexp`` over the last dimension of
    ``logits`` (or that unsqueezed at the end: keepdim), or TRL's ``selective_log_softmax`` (fp32
    branch) ``torch.stack([torch.logsumexp(row, -1) for row in logits])`` over every row in order
    (its rows and their logsumexps in between): the plan maps a z-loss (PaLM / T5X / OLMo
    ``1e-4 * torch.logsumexp(logits, -1).pow(2).mean()`` next to the cross-entropy; Chameleon) onto
    the op's lse output instead of keeping the logits alive."""
    if is_call(node, (torch.stack,)):
        return _stacked_lse(node)
    if is_call(node, (torch.unsqueeze, "unsqueeze")):  # lse.unsqueeze(-1): TRL 1.16's keepdim
        inner, t = lse_of(arg(node, 0, "input")), tval(node)
        if inner is None or inner[1] or t is None or norm_dim(arg(node, 1, "dim"), t.dim()) != t.dim() - 1:
            return None
        return inner[0], True, (*inner[2], arg(node, 0, "input"))
    if not is_call(node, (torch.logsumexp, "logsumexp")):
        return None
    z, dim, keep = arg(node, 0, "input"), arg(node, 1, "dim"), arg(node, 2, "keepdim", False)
    tz = tval(z)
    if tz is None or norm_dim(dim, tz.dim()) != tz.dim() - 1 or not isinstance(keep, bool):
        return None
    return z, keep, ()


def _stacked_lse(node: Node) -> Optional[tuple[Node, bool, tuple]]:
    items = arg(node, 0, "tensors")
    if arg(node, 1, "dim", 0) != 0 or not isinstance(items, (list, tuple)) or not items:
        return None
    rows = [lse_of(i) if is_call(i, (torch.logsumexp, "logsumexp")) else None for i in items]
    if any(r is None or r[1] or not is_call(r[0], (operator.getitem,)) for r in rows):
        return None
    z = rows[0][0].args[0]
    if any(r[0].args != (z, i) for i, r in enumerate(rows)) or not same(tval(z).shape[0], len(rows)):
        return None
    return z, False, (*(r[0] for r in rows), *items)
