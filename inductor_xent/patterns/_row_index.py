"""Rows picked by a boolean mask before a head: ``logits[mask].argmax(-1)`` (token accuracy over the
labelled rows) and ``F.cross_entropy(logits[mask], labels[mask])``.

Dynamo keeps such an index in the graph only under ``capture_dynamic_output_shape_ops`` (on in our
compiled calls: dynamo_tuning.DynamoScope); otherwise it breaks the graph there and the logits leave
it. In the graph, a head over ``logits[mask]`` reads a ``[rows kept, V]`` copy of the logits, which
no idiom matches, and the copy keeps every other head of those logits from fusing (the logits have
another user). ``commute`` moves the selection after the head wherever that is exact:

* ``z[m].argmax(-1)`` is ``z.argmax(-1)[m]``: each row's argmax reads that row only (keepdim too);
* ``F.cross_entropy(z[m], y[m], ignore_index=i, reduction=r)`` is ``F.cross_entropy(z', torch.where(m,
  y, i), ...)`` (``z'``: ``z`` with its leading dimensions flattened): a row the mask drops is an
  ignored row, which adds nothing to the sum, to the mean's count (label smoothing included) or to
  the gradients; ``reduction="none"`` picks its values by the mask afterwards. Not with class
  weights, which the pass declines (the picked rows are the cheaper unfused form).

The rows the mask drops then cost nothing where the op skips ignored rows. Only where ``m`` is a
boolean tensor of exactly ``z``'s leading shape, ``z`` is a matmul's output or one of the steps the
pass reads between the lm_head and a loss (``_steps.MATCHERS``), the cross-entropy's target is ``y[m]``
of the same mask node, and nothing writes a tensor between the index and the head. The new nodes
carry the replaced nodes' example values (the same unbacked row count), so the rest of the pass
sees the shapes Dynamo traced; an index left with no reader but Dynamo's range checks of its row
count goes, with them.
"""

from __future__ import annotations

import inspect
import logging
import operator
from typing import Optional

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from . import _mutation
from ._fx import Emitter, arg, bind, is_call, norm_dim, size_checks, tval
from ._logits import is_matmul
from ._steps import MATCHERS

log = logging.getLogger(__name__)

ARGMAX = (torch.argmax, "argmax")
_CE = inspect.signature(F.cross_entropy)


def commute(gm: GraphModule) -> int:
    """Rewrite every head over a boolean-masked copy of the logits that ``commute`` can (module
    docstring); returns how many."""
    done = 0
    for index in list(gm.graph.nodes):
        rows = _masked_rows(index)
        if rows is None:
            continue
        logits, mask = rows
        for user in list(index.users):
            if _argmax(index, user, logits, mask) or _cross_entropy(index, user, logits, mask):
                done += 1
        checks = [size_checks(u, tval(mask).numel()) for u in index.users]
        if all(c is not None for c in checks):  # nothing but Dynamo's range checks of its row count left
            for node in reversed([n for c in checks for n in c]):
                gm.graph.erase_node(node)
            gm.graph.erase_node(index)
    if done:
        log.debug("inductor_xent: %d head(s) over boolean-masked logits read the logits, the mask after them", done)
    return done


def _masked_rows(node: Node) -> Optional[tuple[Node, Node]]:
    """``(logits, mask)`` when ``node`` is ``logits[mask]`` with a boolean mask of the logits' leading
    shape and logits the pass can read (module docstring)."""
    if not is_call(node, (operator.getitem,)) or len(node.args) != 2:
        return None
    logits, mask = node.args
    z, m = tval(logits), tval(mask)
    if z is None or m is None or m.dtype != torch.bool or z.dim() < 2 or tuple(m.shape) != tuple(z.shape[:-1]):
        return None
    if not z.is_floating_point() or not (is_matmul(logits) or is_call(logits, tuple(MATCHERS))):
        return None
    return logits, mask


def _argmax(index: Node, user: Node, logits: Node, mask: Node) -> bool:
    if not is_call(user, ARGMAX) or arg(user, 0, "input") is not index:
        return False
    dim, keep = arg(user, 1, "dim"), arg(user, 2, "keepdim", False)
    if norm_dim(dim, 2) != 1 or not isinstance(keep, bool) or _mutation.first_write((index,), user) is not None:
        return False
    emit = Emitter(user.graph, user, user)
    full = emit.call(torch.argmax, logits, -1, keepdim=keep)
    _replace(user, full, mask)
    return True


def _cross_entropy(index: Node, user: Node, logits: Node, mask: Node) -> bool:
    if not is_call(user, (F.cross_entropy,)):
        return False
    a = bind(user, _CE)
    if a is None or a["input"] is not index or a["size_average"] is not None or a["reduce"] is not None \
            or a["weight"] is not None:  # (class weights: a site the pass declines; the picked rows are cheaper)
        return False
    target, ignore, reduction = a["target"], a["ignore_index"], a["reduction"]
    if not (is_call(target, (operator.getitem,)) and len(target.args) == 2 and target.args[1] is mask):
        return False
    if not isinstance(ignore, int) or reduction not in ("mean", "sum", "none") \
            or _mutation.first_write((index,), user) is not None:
        return False
    labels = target.args[0]
    y = tval(labels)
    if y is None or tuple(y.shape) != tuple(tval(mask).shape) or y.is_floating_point() \
            or _mutation.first_write((target,), user) is not None:
        return False
    emit = Emitter(user.graph, user, user)
    if tval(logits).dim() > 2:
        logits, labels, mask = (emit.call(torch.flatten, logits, 0, -2), emit.call(torch.flatten, labels),
                                emit.call(torch.flatten, mask))
    kept = emit.call(torch.where, mask, labels, ignore)
    loss = emit.call(F.cross_entropy, logits, kept, ignore_index=ignore, reduction=reduction,
                     label_smoothing=a["label_smoothing"])
    if reduction == "none":
        _replace(user, loss, mask)
    else:
        user.replace_all_uses_with(loss)
        user.graph.erase_node(user)
    if not target.users:
        user.graph.erase_node(target)
    return True


def _replace(user: Node, full: Node, mask: Node) -> None:
    """Replace ``user`` with ``full[mask]``, whose example value is ``user``'s (the rows Dynamo counted)."""
    with user.graph.inserting_before(user):
        picked = user.graph.call_function(operator.getitem, (full, mask))
    picked.meta.update({k: v for k, v in user.meta.items() if k in ("example_value", "stack_trace", "source_fn_stack",
                                                                     "nn_module_stack")})
    user.replace_all_uses_with(picked)
    user.graph.erase_node(user)
