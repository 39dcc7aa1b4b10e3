"""The tolerance rule of STYLE.md: errors relative to PyTorch's own error against float64."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inductor_xent import reference
from inductor_xent.options import LossOptions


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ in float64 (absolute error when ref is all zeros)."""
    x, ref = x.detach().double(), ref.detach().double()
    if torch.isnan(ref).any() or torch.isnan(x).any():
        return 0.0 if torch.equal(torch.isnan(x), torch.isnan(ref)) and torch.allclose(
            x.nan_to_num(), ref.nan_to_num(), rtol=0, atol=0) else float("inf")
    num = (x - ref).norm().item()
    den = ref.norm().item()
    return num / den if den > 0 else num


def assert_within_torch_error(ours, torch_same_dtype, exact, *, k: float = 4.0, floor: float = 1e-6, what=""):
    """err(ours, exact) <= k * err(torch_same_dtype, exact) + floor.

    ``exact`` is computed in float64; ``torch_same_dtype`` is what plain PyTorch gets in the input
    dtype, so the bound says "no worse than PyTorch itself" (k leaves room for a different but
    equally good rounding order)."""
    e_ours, e_torch = rel_err(ours, exact), rel_err(torch_same_dtype, exact)
    assert e_ours <= k * e_torch + floor, f"{what}: err(ours)={e_ours:.3g} > {k}*err(torch)={e_torch:.3g} + {floor:g}"


def torch_same_dtype_loss(hidden, weight, target, bias=None, **kw):
    """The eager PyTorch spelling users write: the linear in the input dtype, then .float()."""
    opts = LossOptions(kw.get("ignore_index", -100), kw.get("label_smoothing", 0.0),
                       kw.get("logit_scale", 1.0), kw.get("softcap"), kw.get("z_loss", 0.0))
    z = F.linear(hidden, weight, bias)
    z = z.to(reference.compute_dtype(hidden.dtype)) * opts.logit_scale
    if opts.softcap is not None:
        z = opts.softcap * torch.tanh(z / opts.softcap)
    v = weight.shape[0]
    zf, t = z.reshape(-1, v), target.reshape(-1)
    red = kw.get("reduction", "mean")
    loss = F.cross_entropy(zf, t, ignore_index=opts.ignore_index, reduction="none",
                           label_smoothing=opts.label_smoothing)
    valid = t != opts.ignore_index
    loss = loss + torch.where(valid, opts.z_loss * torch.logsumexp(zf, -1) ** 2, 0.0)
    if red == "none":
        return loss.reshape(target.shape)
    if red == "sum":
        return loss.sum()
    return loss.sum() / valid.sum()
