"""``logits.argmax(-1)``: the predicted token, for token accuracy (``(logits.argmax(-1) == labels)``
masked and averaged) in evaluation and RL logging loops (TRL's and verl's ``mean_token_accuracy``).

Of the logits (a matmul or an op the walk back folds, so that an argmax over tensors computed from
them, such as per-token log-probs, is no candidate) or of their ``log_softmax`` / ``softmax`` (the
same argmax). An ``argmax`` head: the op's
argmax output (int64, no gradient) replaces it; the comparison and the mean stay. The op's argmax is
that of its own logits, accumulated in fp32: where two logits are within rounding of each other
(ties that rounding the logits to bf16 creates, for one) it may pick another column than eager.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from ._fx import arg, is_call, norm_dim, tval
from ._logits import is_matmul
from ._site import Head, log_probs_of, probs_of
from ._steps import MATCHERS

PATTERN = "argmax"
TARGETS = (torch.argmax, "argmax")


def match(node: Node):
    src, dim, keep = arg(node, 0, "input"), arg(node, 1, "dim"), arg(node, 2, "keepdim", False)
    t = tval(src)
    if t is None or t.dim() < 2 or norm_dim(dim, t.dim()) != t.dim() - 1 or not isinstance(keep, bool):
        return None  # the argmax of a whole tensor, or over another dim: no per-token prediction
    normalised = log_probs_of(src) or probs_of(src)
    if normalised is not None and normalised.dim == t.dim() - 1:
        return Head(PATTERN, node, normalised.logits, None, normalised.nodes, kind="argmax", keepdim=keep,
                        needs_lse_of=normalised.lse)
    if not (is_matmul(src) or is_call(src, tuple(MATCHERS))):
        return None  # e.g. of per-token log-probs or ratios computed from the logits: not a prediction
    return Head(PATTERN, node, src, None, kind="argmax", keepdim=keep)
