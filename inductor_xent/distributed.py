"""Vocabulary-parallel linear + cross-entropy: ``inductor_xent``'s ops on DTensors.

Tensor parallelism shards the lm_head weight over the vocabulary (``ColwiseParallel``: ``weight``
``Shard(0)`` on one mesh dim, the hidden states ``Replicate``). Importing this module registers
DTensor rules (``torch.library.register_torch_dispatch``) for ``ops.FORWARD``,
``ops.BACKWARD`` and ``ops.STORE``, so the ops accept such DTensors: eagerly (the public
``linear_cross_entropy`` too), and inside a compiled graph where the pass put them (AOTAutograd
traces the rules into plain ops and functional collectives; the graph stays one graph). Each rank
runs the single-rank recompute ops on its shard ``[offset, offset + V/tp)``; the store rule is the
same forward and backward in one call.

Forward, per row (``z`` the rank's logits, ``V`` the whole vocabulary)::

    lse_r  = logsumexp(z)                                   the fused op, target ignored (+ lse_lo_r)
    zt_r   = z[t] if offset <= t < offset + V/tp else 0     one gathered weight row per row: O(N·D)
    sz_r   = Σ z   (label smoothing only; without softcap Σ z = scale·(x·ΣW + Σb): O(N·D))
    M      = all_reduce_max(lse_r);  [S, zt, sz] = all_reduce_sum([exp(lse_r - M + lse_lo_r), zt_r, sz_r])
    lse    = M + log S   (and its rounding residual lse_lo, as the single-rank op returns it)
    loss   = log S + (1-ε)(M - zt) + ε(M - sz/V) + z_loss·lse²      (0 on ignored rows)

The loss is formed relative to ``M``, never as ``lse - zt``, as the single-rank op does (when every
logit is huge the rounding of ``lse`` would swallow ``log S``). Two all-reduces of O(N) floats; no
``[N, V/tp]`` tensor beyond the op's own row chunks. The outputs ``(loss, lse, lse_lo)`` are
``Replicate`` DTensors.

Backward: the single-rank backward op on the shard, given the *global* lse (and lse_lo), computes
``g·(p - onehot) + c·p`` with the global softmax ``p``. Rows whose target lies in another shard are
passed as ignored with their ``g`` moved into ``c`` (no one-hot term here); label smoothing enters
as ``(1-ε)·g`` on the one-hot and ``ε·g`` on ``p``, and its uniform ``-ε·g/V`` term is a rank-one
update (hence no softcap with label smoothing). ``grad_hidden`` is returned as a ``Partial``
DTensor: DTensor sums it over the vocabulary ranks where the hidden states became a DTensor (an
all-reduce, or a reduce-scatter under sequence parallelism). ``grad_weight`` and ``grad_bias``
stay local (``Shard(0)``).

Supported layouts (anything else raises ``ValueError`` eagerly, and the pass declines it with the
same reason): a 2-D weight ``Shard(0)`` on exactly one mesh dim and ``Replicate`` on the others,
the vocabulary divisible by that dim's size, the bias (if any) placed like the weight, hidden
states and targets replicated (a plain target tensor counts as replicated), no label smoothing
together with a softcap.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from . import fallback, ops
from .options import compute_dtype, reduced, reduction_weights

_FWD, _BWD = ops.FORWARD, ops.BACKWARD


class Layout(NamedTuple):
    """Where this rank's vocabulary shard lies."""

    dim: int  # the mesh dim that shards the vocabulary
    group_name: str  # that dim's process group, for the functional collectives
    vocab: int  # V, the whole vocabulary
    offset: int  # the first vocabulary id of this rank's shard
    local_vocab: int  # V / tp


class LayoutError(ValueError):
    """A call whose tensors are not a vocabulary-parallel layout we run; ``reason`` says why (the
    pass declines with it, the ops raise it with their prefix)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def layout(hidden, weight, bias, target, label_smoothing: float = 0.0, softcap: Optional[float] = None) -> Layout:
    """The ``Layout`` of a vocabulary-parallel call; ``LayoutError`` with the reason when it is not
    one we run.

    Takes real or fake tensors; reads placements and shapes only (no communication, no guards)."""
    if not isinstance(weight, DTensor):
        raise LayoutError("the weight is not a DTensor")
    if weight.dim() != 2:
        raise LayoutError(f"the weight is not 2-D: {tuple(weight.shape)}")
    vocab_dims = [i for i, p in enumerate(weight.placements) if _is_shard(p, 0, 2)]
    others = [p for i, p in enumerate(weight.placements) if i not in vocab_dims]
    if len(vocab_dims) != 1 or not all(p.is_replicate() for p in others):
        raise LayoutError(f"the weight's placements {tuple(weight.placements)} are not Shard(0) (the vocabulary) "
                          "on one mesh dim and Replicate on the others (ColwiseParallel on the lm_head)")
    dim = vocab_dims[0]
    mesh = weight.device_mesh
    tp, vocab = mesh.size(dim), weight.shape[0]
    if not isinstance(vocab, int) or vocab % tp:
        raise LayoutError(f"the vocabulary V={vocab} is not divisible by the {tp} ranks that shard it")
    if not isinstance(hidden, DTensor):
        raise LayoutError("the hidden states are not a DTensor")
    if len(hidden.placements) != mesh.ndim or not all(p.is_replicate() for p in hidden.placements):
        raise LayoutError(f"the hidden states' placements {tuple(hidden.placements)} are not all Replicate")
    if bias is not None and (not isinstance(bias, DTensor) or tuple(bias.placements) != (
            *(Replicate() for _ in range(dim)), Shard(0), *(Replicate() for _ in range(dim + 1, mesh.ndim)))):
        raise LayoutError(f"the bias is not placed like the weight: {getattr(bias, 'placements', 'a plain tensor')}")
    if isinstance(target, DTensor) and not all(p.is_replicate() for p in target.placements):
        raise LayoutError(f"the targets' placements {tuple(target.placements)} are not all Replicate")
    if label_smoothing and softcap is not None:
        raise LayoutError("label smoothing together with a softcap (Σz over the vocabulary would need the kernel)")
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise LayoutError("this rank is not part of the weight's device mesh")
    local = vocab // tp
    return Layout(dim, mesh.get_group(dim).group_name, vocab, coordinate[dim] * local, local)


def _is_shard(p, dim: int, ndim: int) -> bool:
    return isinstance(p, Shard) and type(p) is Shard and p.dim % ndim == dim


def _check(*args) -> Layout:
    try:
        return layout(*args)
    except LayoutError as e:
        raise ValueError(f"inductor_xent: vocabulary-parallel cross-entropy: {e.reason}") from None


def _enter(hidden, weight, bias, target, label_smoothing, softcap) -> tuple:
    """Every rule's prologue: the layout (``ValueError`` when it is not one we run), then this rank's
    local tensors (x, w, b, t) of hidden, weight, bias and target."""
    lay = _check(hidden, weight, bias, target, label_smoothing, softcap)
    return lay, _local(hidden), _local(weight), _local(bias), _local(target)


def _no_logits(write_logits: bool) -> None:
    if write_logits:
        raise NotImplementedError("inductor_xent: vocabulary-parallel ops do not write the logits (write_logits)")


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _all_reduce(t: Tensor, op: str, lay: Layout) -> Tensor:
    """Functional all-reduce over the vocabulary ranks (traceable: Inductor sees it)."""
    out = torch.ops._c10d_functional.all_reduce.default(t, op, lay.group_name)
    return torch.ops._c10d_functional.wait_tensor.default(out)


def _placed(t: Tensor, like: DTensor, placements) -> DTensor:
    """``t`` as this rank's part of a DTensor on ``like``'s mesh (no communication)."""
    return DTensor.from_local(t, like.device_mesh, placements, run_check=False)


def _replicate(t: Tensor, like: DTensor) -> DTensor:
    return _placed(t, like, [Replicate()] * len(like.placements))


def _target_logit(x: Tensor, w: Tensor, b: Optional[Tensor], idx: Tensor, scale: float, softcap, cd) -> Tensor:
    """``z[n, idx[n]]`` for every row, in the compute dtype: one weight row per row, O(N·D)."""
    z = torch.linalg.vecdot(x.to(cd), w.index_select(0, idx).to(cd))
    if b is not None:
        z = z + b.index_select(0, idx).to(cd)
    z = z * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z


def _rows(t: Tensor, lay: Layout, ignore_index: int):
    """(valid, mine, local target): non-ignored rows, rows whose target is in this shard, and the
    target relative to the shard (``ignore_index`` where it is not in this shard)."""
    valid = t != ignore_index
    shifted = t - lay.offset
    mine = valid & (shifted >= 0) & (shifted < lay.local_vocab)
    return valid, mine, torch.where(mine, shifted, ignore_index)


# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------
def _forward(lay: Layout, x, w, b, t, ignore_index, eps, logit_scale, softcap, z_loss):
    """Local tensors in, per-row (loss, lse, lse_lo) out, the same on every vocabulary rank."""
    cd = compute_dtype(x.dtype)
    # the shard's logsumexp from the fused op; every target ignored, so its loss output is unused
    _, lse_r, lse_lo_r, _ = _FWD(x, w, b, torch.full_like(t, ignore_index), ignore_index, 0.0, logit_scale,
                                 softcap, 0.0)
    valid, mine, local_t = _rows(t, lay, ignore_index)
    zt = torch.where(mine, _target_logit(x, w, b, torch.where(mine, local_t, 0), logit_scale, softcap, cd), 0.0)
    m = _all_reduce(lse_r, "max", lay)
    parts = [torch.exp((lse_r - m) + lse_lo_r), zt]
    if eps:  # Σz of the shard; linear in z because there is no softcap (layout() checks)
        sz = x.to(cd) @ w.sum(0, dtype=cd)
        if b is not None:
            sz = sz + b.sum(dtype=cd)
        parts.append(sz * logit_scale)
    sums = _all_reduce(torch.stack(parts), "sum", lay)
    log_s = torch.log(sums[0])
    lse = m + log_s
    lse_lo = (m - lse) + log_s
    loss = log_s + (1 - eps) * (m - sums[1])
    if eps:
        loss = loss + eps * (m - sums[2] / lay.vocab)
    if z_loss:
        loss = loss + z_loss * lse.square()
    return torch.where(valid, loss, 0.0), lse, lse_lo


def forward(hidden, weight, bias, target, ignore_index, label_smoothing, logit_scale, softcap, z_loss,
            write_logits=False, skip_ignored=False):
    """``ops.FORWARD`` on DTensors: per-row (loss, lse, lse_lo), all Replicate DTensors, and an
    empty logits output (the pass never asks a vocabulary-parallel op for the logits).
    ``skip_ignored`` is a permission, not a duty: every row is computed here."""
    lay, x, w, b, t = _enter(hidden, weight, bias, target, label_smoothing, softcap)
    _no_logits(write_logits)
    fallback.check_targets(t, lay.vocab, ignore_index)  # real CPU targets only
    out = _forward(lay, x, w, b, t, ignore_index, label_smoothing, logit_scale, softcap, z_loss)
    return (*(_replicate(o, hidden) for o in out), _replicate(x.new_empty((0,)), hidden))


# ---------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------
def _backward(lay: Layout, g, h, x, w, b, t, lse, lse_lo, ignore_index, eps, logit_scale, softcap, z_loss, needs):
    """Local tensors in (``g``, ``h``: the incoming gradients of the per-row loss and lse; ``lse``,
    ``lse_lo``: the global ones), this rank's (grad_hidden share, grad_weight, grad_bias) out."""
    cd = compute_dtype(x.dtype)
    lse = lse.to(cd)
    valid, mine, local_t = _rows(t, lay, ignore_index)
    g = torch.where(valid, g.to(cd), 0.0)
    # coefficient of the softmax p: the lse gradient, the z-loss, and the share of g the op does not
    # apply itself (ε·g on this shard's targets; all of g where the target is in another shard)
    c = h.to(cd) + g * (1 - mine.to(cd) * (1 - eps))
    if z_loss:
        c = c + 2 * z_loss * lse * g
    need_h, need_w, need_b = needs
    gh, gw, gb = _BWD((1 - eps) * g, c, x, w, b, local_t, lse, lse_lo.to(cd), ignore_index, 0.0, logit_scale,
                      softcap, 0.0, need_h, need_w, need_b)
    if eps:  # the uniform -ε·g/V term on every logit (no softcap: layout() checks)
        k = (-eps * logit_scale / lay.vocab) * g
        if need_h:
            gh = (gh.to(cd) + k[:, None] * w.sum(0, dtype=cd)).to(gh.dtype)
        if need_w:
            gw = (gw.to(cd) + (k @ x.to(cd))[None, :]).to(gw.dtype)
        if need_b:
            gb = (gb.to(cd) + k.sum()).to(gb.dtype)
    return gh, gw, gb


def _grads(lay: Layout, hidden, weight, bias, grads, needs):
    """This rank's gradients as DTensors: grad_hidden Partial over the vocabulary ranks (DTensor
    sums it where the hidden states became a DTensor), grad_weight and grad_bias placed like weight
    and bias; an unneeded one is an empty Replicate DTensor."""
    gh, gw, gb = grads
    partial = [Replicate()] * len(hidden.placements)
    partial[lay.dim] = Partial()
    return (
        _placed(gh, hidden, partial) if needs[0] else _replicate(gh, hidden),
        _placed(gw, weight, weight.placements) if needs[1] else _replicate(gw, weight),
        _placed(gb, bias, bias.placements) if needs[2] else _replicate(gb, weight),
    )


def backward(grad_loss, grad_lse, hidden, weight, bias, target, lse, lse_lo, ignore_index, label_smoothing,
             logit_scale, softcap, z_loss, needs_hidden, needs_weight, needs_bias):
    """``ops.BACKWARD`` on DTensors (see ``_grads`` for the placements)."""
    lay, x, w, b, t = _enter(hidden, weight, bias, target, label_smoothing, softcap)
    needs = (needs_hidden, needs_weight, needs_bias and b is not None)
    grads = _backward(lay, _local(grad_loss), _local(grad_lse), x, w, b, t, _local(lse), _local(lse_lo),
                      ignore_index, label_smoothing, logit_scale, softcap, z_loss, needs)
    return _grads(lay, hidden, weight, bias, grads, needs)


def store(hidden, weight, bias, target, ignore_index, label_smoothing, logit_scale, softcap, z_loss, reduction,
          chunk_rows, budget, needs_hidden, needs_weight, needs_bias, write_logits=False):
    """``ops.STORE`` on DTensors: the reduced loss (a Replicate DTensor) and its gradients,
    from the recompute forward and backward above (8·N·D·V/tp per rank, not the single-rank store's
    6·N·D·V: there is no vocabulary-parallel store kernel; the pass always picks recompute here)."""
    lay, x, w, b, t = _enter(hidden, weight, bias, target, label_smoothing, softcap)
    _no_logits(write_logits)
    fallback.check_targets(t, lay.vocab, ignore_index)  # real CPU targets only
    opts = (ignore_index, label_smoothing, logit_scale, softcap, z_loss)
    rows, lse, lse_lo = _forward(lay, x, w, b, t, *opts)
    valid = t != ignore_index
    loss, g = reduced(rows.sum(), valid, reduction), reduction_weights(valid, reduction, rows.dtype)
    needs = (needs_hidden, needs_weight, needs_bias and b is not None)
    grads = _backward(lay, g, torch.zeros_like(lse), x, w, b, t, lse, lse_lo, *opts, needs)
    return (_replicate(loss, hidden), *_grads(lay, hidden, weight, bias, grads, needs),
            _replicate(x.new_empty((0,)), hidden))


# ---------------------------------------------------------------------------------------------
# registration: DTensor rules for the ops
# ---------------------------------------------------------------------------------------------
def _rule(impl):
    def rule(mode, func, types, args, kwargs):
        rest = func._schema.arguments[len(args):]
        return impl(*args, *(kwargs.get(a.name, a.default_value) for a in rest))

    return rule


torch.library.register_torch_dispatch(ops.FORWARD, DTensor, _rule(forward))
torch.library.register_torch_dispatch(ops.BACKWARD, DTensor, _rule(backward))
torch.library.register_torch_dispatch(ops.STORE, DTensor, _rule(store))


def replicate_like(t: Tensor, like: DTensor) -> DTensor:
    """``t`` (the same value on every rank) as a Replicate DTensor on ``like``'s mesh: what the pass
    puts where the original loss was a DTensor (``loss_parallel``)."""
    return _replicate(t, like)


__all__ = ["Layout", "LayoutError", "layout", "forward", "backward", "store", "replicate_like"]
