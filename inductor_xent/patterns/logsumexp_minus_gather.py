"""``torch.logsumexp(z, -1) - z.gather(-1, y[..., None]).squeeze(-1)``: the loss from its definition.

Mirrors hand-written losses in research code (e.g. PaLM/T5X-style z-loss implementations that need
the lse anyway, ``lse = torch.logsumexp(logits, -1); loss = lse - logits.gather(-1, t[:, None])[:, 0]``).
Both reads of ``z`` must see the same final logits; the logsumexp becomes the op's lse output (so a
z-loss term on it keeps working) and the difference becomes the op's per-row loss. The other order,
``z.gather(-1, y[..., None]).squeeze(-1) - torch.logsumexp(z, -1)``, is a ``log_probs`` head: RL
code's log-prob of the sampled token, e.g. TRL's ``selective_log_softmax`` for fp32 logits, whose
logsumexp is ``torch.stack([torch.logsumexp(row, -1) for row in logits])`` (``_site.lse_of``).
"""

from __future__ import annotations

import functools
import operator

import torch
from torch.fx import Node

from ._fx import arg, is_call, norm_dim, same, tval
from ._site import Decline, Head, integer_target, lse_of
from ._steps import CAST_METHODS

PATTERN = "logsumexp_minus_gather"
TARGETS = (operator.sub, torch.sub, "sub")


def _gathered(node):
    """(gather node, logits, index, squeezed) for ``z.gather(-1, idx)`` maybe squeezed to rows."""
    squeezed = None
    if is_call(node, (torch.squeeze, "squeeze")) and len(node.args) == 2:
        squeezed, node = node, arg(node, 0, "input")
    elif node is not None and is_call(node, (operator.getitem,)):
        src, index = node.args
        ts = tval(src)
        if ts is not None and isinstance(index, tuple) and index[-1] == 0 and all(
                i is Ellipsis or (isinstance(i, slice) and i == slice(None)) for i in index[:-1]) \
                and (Ellipsis in index or len(index) == ts.dim()):
            squeezed, node = node, src
    if not is_call(node, (torch.gather, "gather")) or node.kwargs.get("sparse_grad"):
        return None
    z, dim, index = arg(node, 0, "input"), arg(node, 1, "dim"), arg(node, 2, "index")
    tz, ti = tval(z), tval(index)
    if tz is None or ti is None or norm_dim(dim, tz.dim()) != tz.dim() - 1 or ti.dim() != tz.dim():
        return None
    if squeezed is not None and squeezed.op == "call_method" and squeezed.target == "squeeze" \
            and norm_dim(arg(squeezed, 1, "dim"), tz.dim()) != tz.dim() - 1:
        return None
    return node, z, index, squeezed


def _lse_minus_gathered(lse_node, g, head: str):
    while is_call(lse_node, CAST_METHODS):
        lse_node = arg(lse_node, 0, "input")  # lse.float() - z.float().gather(...)
    found_g = _gathered(g) if isinstance(g, Node) else None
    return None if lse_of(lse_node) is None or found_g is None else (lse_node, g, head, found_g)


def match(node: Node):
    if node.kwargs or len(node.args) != 2:
        return None
    a, b = node.args
    found = _lse_minus_gathered(a, b, "cross_entropy") or _lse_minus_gathered(b, a, "log_probs")
    if found is None:
        return None
    lse_node, g, head, (gather, z, index, squeezed) = found
    ti, tz, tout = tval(index), tval(z), tval(node)
    decline = functools.partial(Decline, PATTERN, node, logits=z, kind=head)
    if not same(ti.shape[-1], 1) or not all(same(a, b) for a, b in zip(ti.shape[:-1], tz.shape[:-1])):
        return decline("gather index does not pick one class per row")
    if tval(lse_node).dim() != tout.dim() or tval(g).dim() != tout.dim():
        return decline("logsumexp and gathered logit broadcast against each other")
    reason = integer_target(index)
    if reason:
        return decline(reason)
    consumed = (gather,) if squeezed is None else (gather, squeezed)
    return Head(
        PATTERN, node, z, index, consumed, shape_ref=index, drop_last=tout.dim() == ti.dim() - 1,
        needs_lse_of=(lse_node,), kind=head,
    )
