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

from ._fx import bind, number
from ._site import Decline, Head, loss_args_reason, vocab_last

PATTERN = "lm_head_cross_entropy"
TARGETS = (F.cross_entropy,)
_SIG = inspect.signature(F.cross_entropy)


def match(node: Node):
    a = bind(node, _SIG)
    if a is None:
        return Decline(PATTERN, node, "cross_entropy arguments not understood")
    reason = loss_args_reason(a)
    if reason:
        return Decline(PATTERN, node, reason)
    found = vocab_last(a["input"], 1)
    if found is None:
        return Decline(PATTERN, node, "the class dimension (1) of the input is not the logits' last dimension")
    logits, consumed = found
    return Head(PATTERN, node, logits, a["target"], consumed, (), a["ignore_index"], a["reduction"],
                    number(a["label_smoothing"]), shape_ref=a["target"])
