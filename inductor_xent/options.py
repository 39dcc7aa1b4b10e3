"""The scalar options of the loss, shared by every implementation (reference, fallback, Triton)."""

from __future__ import annotations

from typing import NamedTuple, Optional


class LossOptions(NamedTuple):
    """Per-row loss, for logits ``z`` (after bias, ``logit_scale`` and ``softcap``) and target ``t``::

        loss = (1 - label_smoothing) * (lse - z[t]) + label_smoothing * (lse - mean(z)) + z_loss * lse**2

    and 0 where ``t == ignore_index``. ``softcap=None`` means no softcapping.
    """

    ignore_index: int = -100
    label_smoothing: float = 0.0
    logit_scale: float = 1.0
    softcap: Optional[float] = None
    z_loss: float = 0.0
