"""``F.cross_entropy(lm_head(h) ..., y)``: the spelling of nearly every language model.

Mirrors HF transformers' ``ForCausalLMLoss`` / ``fixed_cross_entropy`` (``logits.float()`` ->
``.view(-1, V)`` -> ``F.cross_entropy(..., ignore_index=-100, reduction="mean" | "sum")``, then
``/ num_items_in_batch``; labels shifted with ``F.pad(labels, (0, 1), value=-100)[..., 1:]``),
nanoGPT (``F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)``),
``nn.CrossEntropyLoss`` modules (inlined by Dynamo to the same call) and the class-dim-1 form
``F.cross_entropy(logits.transpose(1, 2), y)``. ``reduction="none"`` followed by the user's own
masking and sum/mean keeps the user's code: only the per-row loss is replaced.

Declines class weights, probability targets and the legacy ``size_average`` / ``reduce`` arguments.
"""

from __future__ import annotations

import inspect

import torch.nn.functional as F
from torch.fx import Node

from ._fx import is_call, number
from ._site import Decline, LossSite, integer_target, vocab_last

PATTERN = "lm_head_cross_entropy"
_SIG = inspect.signature(F.cross_entropy)


def match(node: Node):
    if not is_call(node, (F.cross_entropy,)):
        return None
    try:
        bound = _SIG.bind(*node.args, **node.kwargs)
    except TypeError:
        return Decline(PATTERN, node, "cross_entropy arguments not understood")
    bound.apply_defaults()
    a = bound.arguments
    if a["weight"] is not None:
        return Decline(PATTERN, node, "class weights (weight=...) are not supported")
    if a["size_average"] is not None or a["reduce"] is not None:
        return Decline(PATTERN, node, "legacy size_average/reduce arguments")
    reason = integer_target(a["target"])
    if reason:
        return Decline(PATTERN, node, reason)
    ii, eps, reduction = a["ignore_index"], number(a["label_smoothing"]), a["reduction"]
    if not isinstance(ii, int) or isinstance(ii, bool):
        return Decline(PATTERN, node, f"ignore_index {ii!r} is not a Python int")
    if eps is None or not 0.0 <= eps <= 1.0:
        return Decline(PATTERN, node, f"label_smoothing {a['label_smoothing']!r} is not a constant in [0, 1]")
    if reduction not in ("mean", "sum", "none"):
        return Decline(PATTERN, node, f"reduction {reduction!r}")
    found = vocab_last(a["input"], 1)
    if found is None:
        return Decline(PATTERN, node, "the class dimension (1) of the input is not the logits' last dimension")
    logits, consumed = found
    return LossSite(
        PATTERN, node, logits, a["target"], consumed, (), ii, reduction, eps, shape_ref=a["target"],
    )
