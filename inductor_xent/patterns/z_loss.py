"""A separate ``torch.logsumexp(z, -1)`` of the same logits, mapped onto the op's lse output.

Mirrors PaLM / T5X / OLMo z-loss (``z_loss = 1e-4 * torch.logsumexp(logits, -1).pow(2).mean()``
next to the cross-entropy) and Chameleon-style training code. The driver calls ``lse_of`` on every
other user of the logits; when it matches, that logsumexp reads the op's lse (cast to the logits'
dtype) instead of keeping the logits alive.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from ._fx import arg, is_call, norm_dim, tval


def lse_of(node) -> tuple[Node, bool] | None:
    """(logits, keepdim) when ``node`` is ``logsumexp`` over the last dimension of ``logits``."""
    if not is_call(node, (torch.logsumexp, "logsumexp")):
        return None
    z, dim, keep = arg(node, 0, "input"), arg(node, 1, "dim"), arg(node, 2, "keepdim", False)
    tz = tval(z)
    if tz is None or norm_dim(dim, tz.dim()) != tz.dim() - 1 or not isinstance(keep, bool):
        return None
    return z, keep
