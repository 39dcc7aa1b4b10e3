"""Python loops over the rows of the logits, folded back into one batched computation before the
idioms look at the graph.

Memory-minded code computes a head piece by piece and joins the pieces:

* **row chunks**, ``torch.cat([f(c) for c in logits.split(k)])``: LitGPT's ``chunked_cross_entropy``
  (``logits.split(chunk_size)`` with the targets split alike, ``F.cross_entropy(..., reduction="none")``
  per chunk, ``torch.cat(...).sum() / n``), TRL's ``entropy_from_logits`` (``flat.split(chunk_size)``,
  an entropy per chunk, ``torch.cat``);
* **rows of the batch**, ``torch.stack([f(row) for row in logits])``: TRL's ``selective_log_softmax``
  (bf16 branch, ``zip(logits, index)``; its fp32 branch stacks one ``logsumexp`` per row), verl's
  ``logprobs_from_logits_v2``.

Dynamo unrolls the loop: one ``getitem`` of the ``split`` (or of the tensor) per piece, the same ops
on each, and the ``cat`` / ``stack`` that joins them. When every piece runs the same row-wise ops
(a table below: softmaxes, logsumexp, gather, reductions over a dimension that is not the rows',
elementwise math, casts, and a cross-entropy without reduction on row chunks), over consecutive
pieces that cover the tensor in order, the join equals those ops applied once to the whole tensors
(dimensions shifted by one for rows of the batch), which is what ``fold`` builds in the join's place.
The pieces' computation is then dead and erased.

The driver folds a loop only where the folded graph has a site that fuses (``patterns.run``
tries it on a copy first): a loop over logits the pass then declines keeps the user's bounded
memory. The site's report says which loop it folded.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node

from ._fx import Emitter, is_call, norm_dim, same, tval

META_KEY = "inductor_xent_unlooped"  # node.meta of each node fold builds: what it folded, for the report

SPLITS = (torch.split, torch.chunk, torch.tensor_split, "split", "chunk")
# row-wise ops whose ``dim`` (argument 1) must name a dimension inside a piece's rows
DIM_OPS = (F.log_softmax, F.softmax, torch.log_softmax, torch.softmax, torch.logsumexp, torch.gather,
           torch.unsqueeze, torch.squeeze, torch.sum, torch.mean, torch.amax, torch.argmax,
           "log_softmax", "softmax", "logsumexp", "gather", "unsqueeze", "squeeze", "sum", "mean", "amax",
           "argmax")
# elementwise ops, and casts (a tensor operand that is not a piece's must broadcast over the rows)
ELEMENTWISE = (operator.neg, operator.mul, operator.add, operator.sub, operator.truediv, torch.exp, torch.log,
               torch.neg, torch.mul, torch.add, torch.sub, torch.div, torch.where, torch.clamp,
               "exp", "log", "neg", "mul", "add", "sub", "div", "float", "to", "masked_fill", "clamp", "pow")
# per-row losses over [rows, V] chunks (class dimension 1): only as row chunks, only unreduced
LOSSES = (F.cross_entropy, F.nll_loss)
MAX_NODES = 64  # per piece: a head is a few ops; more is not such a loop


@dataclass(frozen=True)
class Loop:
    """A join (``torch.cat`` / ``torch.stack`` along dim 0) of pieces that run the same row-wise
    ops, in order; ``nodes[k]`` are piece k's computation in graph order, ``bases`` the whole
    tensors its pieces come from (a split's input, or the tensor whose rows are taken)."""

    join: Node
    rows: bool  # stack of rows of the batch (dims shift by one); else cat of row chunks
    nodes: tuple  # per piece: its nodes in graph order (the pieces' getitems excluded)
    pieces: tuple  # per piece: {getitem node: base}
    describe: str  # for the report: "row chunks (split) joined by torch.cat", ...


def find(graph: Graph) -> list[Loop]:
    """Every join in ``graph`` whose pieces can be folded (``fold``), in graph order."""
    loops = []
    for target in (torch.cat, torch.stack):
        for join in graph.find_nodes(op="call_function", target=target, sort=True):
            loop = _loop(join)
            if loop is not None:
                loops.append(loop)
    return sorted(loops, key=lambda lp: _order(lp.join))


def _order(n: Node) -> int:
    return list(n.graph.nodes).index(n)


def _loop(join: Node) -> Optional[Loop]:
    items = join.args[0] if join.args else join.kwargs.get("tensors")
    dim = join.args[1] if len(join.args) > 1 else join.kwargs.get("dim", 0)
    rows = join.target is torch.stack
    if dim != 0 or not isinstance(items, (list, tuple)) or len(items) < 2 \
            or not all(isinstance(i, Node) for i in items):
        return None
    walks = [_walk(item, k, rows) for k, item in enumerate(items)]
    if any(w is None for w in walks):
        return None
    shapes = [w[0] for w in walks]
    if any(s != shapes[0] for s in shapes[1:]):
        return None
    pieces = tuple(w[2] for w in walks)
    if not _covers(pieces, len(items), rows):
        return None
    kind = "the rows of the batch (torch.stack)" if rows else "row chunks (split, torch.cat)"
    return Loop(join, rows, tuple(w[1] for w in walks), pieces, kind)


def _walk(out: Node, k: int, rows: bool) -> Optional[tuple]:
    """(its shape, piece k's nodes in graph order, {piece getitem: base}) of the computation of
    ``out`` from pieces k, or None when it is not one this module folds. The shape is the
    computation with every node replaced by (its call, its arguments' shapes), and every tensor
    not computed from a piece by itself: the same for every piece of a loop. At most MAX_NODES
    nodes are looked at (a shared tensor with a longer history is not such a loop)."""
    nodes: dict = {}
    pieces: dict = {}
    memo: dict = {}  # node -> (shape, computed from a piece)

    def shape(a: Any) -> tuple:
        if isinstance(a, (list, tuple)):
            got = [shape(x) for x in a]
            return tuple(g[0] for g in got), any(g[1] for g in got)
        if not isinstance(a, Node):
            return ("const", repr(a)), False
        if a in memo:
            return memo[a]
        base = _piece_base(a, k, rows)
        if base is not None:
            pieces[a] = base
            memo[a] = (("piece", base), True)
            return memo[a]
        if a.op in ("placeholder", "get_attr"):
            memo[a] = (("shared", a), False)
            return memo[a]
        if len(memo) >= MAX_NODES:
            raise _NotALoop
        memo[a] = (("pending", a), False)  # a cycle cannot happen in a graph; this bounds the count
        args = [shape(x) for x in a.args]
        kwargs = [(key, shape(v)) for key, v in sorted(a.kwargs.items())]
        if not any(g[1] for g in args) and not any(g[1] for _, g in kwargs):
            memo[a] = (("shared", a), False)
            return memo[a]
        if not _row_wise(a, rows):
            raise _NotALoop
        nodes[a] = None
        memo[a] = ((a.op, a.target, tuple(g[0] for g in args), tuple((key, g[0]) for key, g in kwargs)), True)
        return memo[a]

    try:
        sig, dep = shape(out)
    except _NotALoop:
        return None
    if not dep or not pieces or not _shared_broadcast(nodes, rows):
        return None
    return sig, tuple(sorted(nodes, key=_order)), pieces


class _NotALoop(Exception):
    pass


def _piece_base(n: Node, k: int, rows: bool) -> Optional[Node]:
    """The whole tensor when ``n`` is piece ``k`` of it: ``split(...)[k]`` (the split node, for row
    chunks) or ``tensor[k]`` (rows)."""
    if n.op != "call_function" or n.target is not operator.getitem or not isinstance(n.args[1], int) \
            or n.args[1] != k or not isinstance(n.args[0], Node):
        return None
    src = n.args[0]
    if rows:
        return src if tval(src) is not None else None
    return src if is_call(src, SPLITS) and _split_dim(src) == 0 else None


def _split_dim(split: Node) -> Optional[int]:
    t = tval(split.args[0]) if split.args else None
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    return None if t is None else norm_dim(dim, t.dim())


def _row_wise(n: Node, rows: bool) -> bool:
    """Whether ``n`` computes each row of its piece operands from that row alone."""
    if is_call(n, DIM_OPS):
        x = tval(n.args[0]) if n.args else None
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        ndim = None if x is None else x.dim() + (1 if is_call(n, (torch.unsqueeze, "unsqueeze")) else 0)
        d = None if ndim is None or dim is None else norm_dim(dim, ndim)
        return d is not None and (rows or d >= 1)  # a row chunk's dim 0 is its rows
    if is_call(n, LOSSES):
        x = tval(n.args[0]) if n.args else None
        return not rows and x is not None and x.dim() == 2 and n.kwargs.get("reduction") == "none" \
            and n.kwargs.get("weight") is None and len(n.args) == 2
    return is_call(n, ELEMENTWISE)


def _shared_broadcast(nodes: dict, rows: bool) -> bool:
    """Tensors the pieces share (not computed from them) broadcast over the rows: fewer dimensions
    than a row chunk (no more than a row, for rows of the batch), and never a gather's index or a
    loss's target."""
    for n in nodes:
        out = tval(n)
        for i, a in enumerate(x for x in (*n.args, *n.kwargs.values()) if isinstance(x, Node)):
            if a in nodes or tval(a) is None or _is_piece(a):
                continue
            if is_call(n, (torch.gather, "gather") + LOSSES) and i > 0:
                return False
            if out is None or tval(a).dim() > out.dim() - (0 if rows else 1):
                return False
    return True


def _is_piece(a: Node) -> bool:
    return a.op == "call_function" and a.target is operator.getitem and isinstance(a.args[1], int) \
        and isinstance(a.args[0], Node)


def _covers(pieces: tuple, count: int, rows: bool) -> bool:
    """The pieces are all of each base, in order: as many as its rows (rows of the batch) or as
    its split has chunks, every split of the loop with the same arguments over as many rows."""
    bases = set(pieces[0].values())
    if any(set(p.values()) != bases for p in pieces):
        return False
    for base in bases:
        if rows:
            t = tval(base)
            if t is None or not same(t.shape[0], count):
                return False
        else:
            chunks = base.meta.get("example_value")
            if not isinstance(chunks, (list, tuple)) or len(chunks) != count:
                return False
    if not rows:
        splits = list(bases)
        first = splits[0]
        for s in splits[1:]:
            if s.target != first.target or s.args[1:] != first.args[1:] or s.kwargs != first.kwargs \
                    or not same(tval(s.args[0]).shape[0], tval(first.args[0]).shape[0]):
                return False
    return True


def fold(graph: Graph, loop: Loop) -> Node:
    """Replace ``loop.join`` by piece 0's computation applied to the whole tensors (dims shifted by
    one for rows of the batch); erase what became dead. Returns the node now in the join's place."""
    e = Emitter(graph, loop.join, loop.join)
    env: dict = {}
    for piece, base in loop.pieces[0].items():
        env[piece] = base if loop.rows else base.args[0]
    out = None
    for n in loop.nodes[0]:
        args = torch.fx.node.map_arg(n.args, lambda a: env.get(a, a))
        kwargs = dict(torch.fx.node.map_arg(n.kwargs, lambda a: env.get(a, a)))
        if loop.rows and is_call(n, DIM_OPS):
            args, kwargs = _shift_dim(args, kwargs)
        out = env[n] = e._make(n.op, n.target, tuple(args), kwargs)
        out.meta[META_KEY] = loop.describe
    loop.join.replace_all_uses_with(out)
    graph.erase_node(loop.join)
    dead = [n for nodes in loop.nodes for n in nodes] + [p for pieces in loop.pieces for p in pieces] + \
        ([] if loop.rows else list(set(loop.pieces[0].values())))
    for n in sorted(dead, key=_order, reverse=True):
        if not n.users:
            graph.erase_node(n)
    return out


def _shift_dim(args: tuple, kwargs: dict) -> tuple:
    """A row's dim for the batch: one more when counted from the front."""
    if len(args) > 1:
        d = args[1]
        return (args[0], d + 1 if isinstance(d, int) and d >= 0 else d, *args[2:]), kwargs
    d = kwargs.get("dim")
    if isinstance(d, int) and d >= 0:
        kwargs["dim"] = d + 1
    return args, kwargs


def describe(node: Node) -> Optional[str]:
    """What ``fold`` folded into ``node``, if it built it."""
    return node.meta.get(META_KEY)


__all__ = ["Loop", "describe", "find", "fold"]
