"""Knowledge distillation between two lm_heads without either ``[N, V]`` logits tensor (on CUDA one
``[N, V]`` tensor of the student's gradient logits instead, below).

A student head (hidden ``[N, Ds]``, weight ``[V, Ds]``) and a teacher head (``[N, Dt]``, ``[V, Dt]``,
``Dt`` may differ) over one vocabulary; per row, with ``u = z * scale`` (a temperature ``T`` is
``scale = 1/T``), ``q = softmax(u_student)``, ``p = softmax(u_teacher)``:

* ``forward_kl``: ``KL(p ‖ q) = Σ p (log p − log q)`` (Hinton's KD; ``F.kl_div(log q, p)``),
* ``reverse_kl``: ``KL(q ‖ p) = Σ q (log q − log p)``,
* ``jsd``: ``β KL(p ‖ m) + (1 − β) KL(q ‖ m)``, ``m = β p + (1 − β) q`` (TRL's GKD and its limits:
  β → 0 is forward KL, β → 1 reverse KL; ``0 < β < 1`` here),

0 on rows whose ``target`` is ``ignore_index`` (when a target is given); reduced by ``reduction``:
``none`` (per row), ``sum``, ``mean`` (over the rows not ignored), ``batchmean`` (the sum over the
number of rows, as ``F.kl_div`` on a 2-D input). Users multiply by ``T**2`` themselves (Hinton).

The op runs over row chunks (``chunk_rows``, sized from a memory budget): each chunk computes both
heads' logits with one GEMM each, the divergence and, for a reduced loss, its gradient with respect
to the student logits right away (``du``), turned into the student's hidden and weight gradients by
two more GEMMs: four GEMMs in all, as torch.compile's graph. The backward only scales those
gradients by the incoming scalar. ``none`` (per-row incoming gradients) recomputes the chunks in the
backward instead. The teacher gets gradients only when its inputs require them (then two more GEMMs
per chunk).

The weight gradient sums over every row, and a row's gradient is known only once its whole
vocabulary is seen, so the chunks either add their share into an fp32 ``[V, Ds]`` accumulator (a
read-modify-write of it per chunk, GEMMs of a chunk's rows) or keep the student's gradient logits
``dz`` of every row in the logits' dtype (``keeps_dz``: on CUDA when only the student trains, its
weight included, and ``N·V`` of them fit the store budget): then each chunk's student GEMM writes
into its rows of ``dz``, the chunk's math turns them into the gradient in place, and the hidden and
weight gradients are one GEMM each over all rows at the end (as
torch.compile's, rounded once), with only the teacher's logits of one chunk (as large as the weight
gradient, within 128 and 512 MiB) besides. A third way, recomputing the teacher's logits in a
backward, would cost its GEMM (the largest of the four) twice.

Under ``torch.autocast`` (fp32 master weights, bf16 activations) ``linear_distillation_loss`` casts
each head's operands as autocast casts ``F.linear``'s, and the pass inserts the same casts; the ops
run with autocast off (``ops._without_autocast``), so every GEMM, the kept path's ``out=`` ones
included, computes in the operands' one dtype, and the gradients reach the fp32 weights through the
casts, as in eager autocast.

``inductor_xent::linear_distill_fwd(hs, ws, bs, ht, wt, bt, target, ignore_index, kind, beta,
scale_s, scale_t, reduction, needs, soft_weight=1.0, hard_weight=0.0, mask_divergence=True,
store_budget="") -> (loss, gh_s, gw_s, gb_s, gh_t, gw_t, gb_t)``: the loss ((N,) or 0-dim float32)
and, for a reduced loss, the gradients (empty where not needed; not differentiable);
``inductor_xent::linear_distill_bwd(grad_rows, ...)`` the per-row case's backward. The loss is
``soft_weight`` times the divergence plus ``hard_weight`` times the student's hard-label
cross-entropy of ``target`` (its raw logits, the mean over the labelled rows; per row for
``none``), both from the same chunk of student logits; ``mask_divergence`` False counts every
row's divergence, the unlabelled ones too (the pass's ``α·CE + β·KD``, whose KD has no mask);
``store_budget`` is ``keeps_dz``'s (``""``: the configured one).
"""

from __future__ import annotations

import math
from typing import Literal, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import config, options, strategy
from .ops import _without_autocast  # (ops imports this module at its end, after defining it)
from .options import compute_dtype

Kind = Literal["forward_kl", "reverse_kl", "jsd"]
KINDS = ("forward_kl", "reverse_kl", "jsd")
REDUCTIONS = ("none", "sum", "mean", "batchmean")
# fp32 tensors of a chunk's width alive at once (both heads' logits, log-probs, probabilities, du)
CHUNK_TENSORS = 8
# a chunk's working set on a GPU: large row blocks keep the GEMMs efficient. H200, bf16, student
# 8192 x 4096, teacher D 8192, V 128256, Hinton KD fwd+bwd against torch.compile's 70.3 ms / 4946 MiB:
# 1 GiB 112.8 ms; 2 GiB 84.7; 4 GiB 73.9 ms / 2217 MiB; 8 GiB 70.1 ms / 3050 MiB (benchmarks/RESULTS.md)
CUDA_CHUNK_BYTES = 4 * 2**30
# keeps_dz: the teacher's logits of one chunk are the only [rows, V] tensor besides the kept dz (a
# chunk's math is one compiled kernel family that reads dz's rows and the teacher's and writes dz in
# place). A chunk no larger than the student's weight gradient raises no peak (the end, dz and that
# gradient, is higher); it is that size within these bounds (128 MiB may exceed a small one). H100,
# the bench_distill shape (weight gradient 1002 MiB), fwd+bwd against torch.compile's 68.27 ms:
# 128 MiB 70.64 ms, 256 MiB 67.88, 512 MiB 67.22, each 2132 extra MiB (3 interleaved rounds:
# 1.034x, 1.014x, 0.979x)
TEACHER_CHUNK_BYTES = 512 * 2**20
MIN_TEACHER_CHUNK_BYTES = 128 * 2**20
# where keeps_dz may keep them (the chunked CPU path bounds its memory by config.fallback_chunk_bytes)
KEEP_DZ_DEVICES = ("cuda",)


def chunk_rows(n: int, v: int, device: torch.device, teacher_itemsize: int = 0, weight_grad_bytes: int = 0) -> int:
    """Rows per chunk; with ``teacher_itemsize`` (``keeps_dz``) those whose teacher logits fit the
    student's weight gradient (``weight_grad_bytes``) within MIN_TEACHER_CHUNK_BYTES and
    TEACHER_CHUNK_BYTES."""
    if teacher_itemsize:
        budget = min(TEACHER_CHUNK_BYTES, max(MIN_TEACHER_CHUNK_BYTES, weight_grad_bytes))
        rows = budget // max(1, v * teacher_itemsize)
        return max(1, min(n, rows - rows % 128 if rows >= 128 else rows))  # whole GEMM tiles
    budget = CUDA_CHUNK_BYTES if device.type == "cuda" else config.fallback_chunk_bytes
    return max(1, min(n, budget // max(1, v * 4 * CHUNK_TENSORS)))


def keeps_dz(n: int, v: int, dtype: torch.dtype, device: torch.device, with_grads: bool, needs,
             budget: str = "") -> bool:
    """Whether the chunks keep the student's gradient logits of every row (module docstring): on CUDA
    (``KEEP_DZ_DEVICES``), when they form gradients (a reduced loss's forward, a per-row loss's
    backward) for the student only, its weight's among them (the hidden states' alone are whole in
    each chunk), and the ``[N, V]`` gradient logits in ``dtype`` fit ``budget`` (``""``:
    ``config.store_budget()``, by default their own size, what torch.compile keeps of the logits,
    and none under ``INDUCTOR_XENT_STRATEGY=recompute``; the pass gives ``xent.store_budget``, and
    ``"0"`` for ``xent.strategy="recompute"``)."""
    if device.type not in KEEP_DZ_DEVICES or not with_grads or not needs[1] or any(needs[3:]):
        return False
    if not budget and config.strategy() == "recompute":  # INDUCTOR_XENT_STRATEGY keeps nothing either
        return False
    kind, amount = config.parse_budget(budget or config.store_budget())
    size = n * v * torch.finfo(dtype).bits // 8
    return size <= (amount * size if kind == "logits" else amount)


def _rows(kind: str, beta: float, us: Tensor, ut: Tensor, grad_s: bool, grad_t: bool):
    """Per row of one chunk (fp32 scaled logits ``us``, ``ut``): the divergence, and its gradients
    with respect to ``us`` and ``ut`` (None where not asked)."""
    ls, lt = torch.log_softmax(us, -1), torch.log_softmax(ut, -1)
    q, p = ls.exp(), lt.exp()
    du_s = du_t = None
    if kind == "forward_kl":
        diff = lt - ls
        rows = (p * diff).sum(-1)
        if grad_s:
            du_s = q - p
        if grad_t:
            du_t = p * (diff - rows[:, None])
    elif kind == "reverse_kl":
        diff = ls - lt
        rows = (q * diff).sum(-1)
        if grad_s:
            du_s = q * (diff - rows[:, None])
        if grad_t:
            du_t = p - q
    else:
        lm = torch.logaddexp(lt + math.log(beta), ls + math.log1p(-beta))
        gt, gs = lt - lm, ls - lm
        rows = beta * (p * gt).sum(-1) + (1 - beta) * (q * gs).sum(-1)
        if grad_s:  # d/dq of the divergence is (1 - β)(log q - log m), through the softmax
            gs = (1 - beta) * gs
            du_s = q * (gs - (q * gs).sum(-1, keepdim=True))
        if grad_t:
            gt = beta * gt
            du_t = p * (gt - (p * gt).sum(-1, keepdim=True))
    return rows, du_s, du_t


def _chunk_math(zs: Tensor, zt: Tensor, g: Optional[Tensor], valid: Optional[Tensor], kind: str, beta: float,
                scale_s: float, scale_t: float, grad_s: bool, grad_t: bool, target: Optional[Tensor] = None,
                g_ce: Optional[Tensor] = None, ce_valid: Optional[Tensor] = None):
    """One chunk's rows (0 where not ``valid``) and the gradients with respect to the two heads'
    logits ``zs``, ``zt`` (in their dtype; None where not asked), for incoming row gradients ``g``.
    With ``target`` also the student's hard-label cross-entropy rows ``lse(zs) − zs[target]`` (its
    raw logits, no temperature; 0 where not ``ce_valid``), returned third, and with ``g_ce`` (its
    rows' gradients) their gradient ``softmax(zs) − onehot`` joins the student's."""
    work = compute_dtype(zs.dtype)
    rows, du_s, du_t = _rows(kind, beta, zs.to(work) * scale_s, zt.to(work) * scale_t, grad_s, grad_t)
    if valid is not None:
        rows = torch.where(valid, rows, 0.0)
        g = None if g is None else torch.where(valid, g, 0.0)
    ce = None
    if target is not None:
        ls1 = torch.log_softmax(zs.to(work), -1)
        t = torch.where(ce_valid, target, 0)[:, None]
        ce = torch.where(ce_valid, -ls1.gather(1, t)[:, 0], 0.0)
        if g_ce is not None and grad_s:
            g_ce = torch.where(ce_valid, g_ce, 0.0)[:, None]
            du_ce = (ls1.exp() * g_ce).scatter_add_(1, t, -g_ce)
            du_s = du_ce if du_s is None else du_s * (g * scale_s)[:, None] + du_ce
            return rows, du_s.to(zs.dtype), ce, None if du_t is None else (du_t * (g * scale_t)[:, None]).to(zt.dtype)
    dz_s = None if du_s is None else (du_s * (g * scale_s)[:, None]).to(zs.dtype)  # d/dz = d/du * scale
    dz_t = None if du_t is None else (du_t * (g * scale_t)[:, None]).to(zt.dtype)
    return rows, dz_s, ce, dz_t


def _chunk_math_into(dz: Tensor, zt: Tensor, g: Tensor, valid: Optional[Tensor], kind: str, beta: float,
                     scale_s: float, scale_t: float, target: Optional[Tensor] = None, g_ce: Optional[Tensor] = None,
                     ce_valid: Optional[Tensor] = None):
    """``_chunk_math`` for ``keeps_dz``: ``dz`` holds the chunk's student logits and gets their
    gradient in place; returns the rows (and the cross-entropy rows or None)."""
    rows, dz_s, ce, _ = _chunk_math(dz, zt, g, valid, kind, beta, scale_s, scale_t, True, False, target, g_ce,
                                    ce_valid)
    dz.copy_(dz_s)
    return rows, ce


_fused = {}


def _compiled(fn):
    """``fn`` compiled by Inductor with the rows of every tensor argument dynamic (they are all per
    row): one graph for every chunk size, where a static graph per last-chunk size would reach
    Dynamo's recompile limit within eight batch sizes (and fail under ``fullgraph``)."""
    compiled = torch.compile(fn, dynamic=False, fullgraph=True)

    def call(*args):
        for a in args:
            if isinstance(a, Tensor) and a.dim() and a.shape[0] > 1:  # 0 and 1 rows specialise anyway
                torch._dynamo.mark_dynamic(a, 0)
        return compiled(*args)
    return call


def _math_for(device: torch.device, into: bool = False):
    """The chunk math: on CUDA compiled once by Inductor into a few fused kernels (eager PyTorch would
    make a dozen passes over each [rows, V] chunk; ``into``: the last of them writes dz over the
    student's logits); eager elsewhere."""
    fn = _chunk_math_into if into else _chunk_math
    if device.type != "cuda":
        return fn
    if fn not in _fused:
        _fused[fn] = _compiled(fn)
    return _fused[fn]


def _acc_mm(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b, with fp32 accumulation into an fp32 ``acc`` from 16-bit ``a``, ``b`` on CUDA."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif a.device.type == "cuda":
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += (a.to(acc.dtype) @ b.to(acc.dtype))


def _chunks(hs, ws, bs, ht, wt, bt, target, ignore_index: int, kind: str, beta: float, scale_s: float,
            scale_t: float, row_grad: Optional[Tensor], needs: tuple, ce: bool = False,
            ce_grad: Optional[Tensor] = None, mask_divergence: bool = True, store_budget: str = ""):
    """The loss rows (and with ``ce`` the student's hard-label cross-entropy rows, else None) and,
    when ``row_grad`` (the incoming gradient of each divergence row) is given, the gradients
    ``needs`` asks for (hs, ws, bs, ht, wt, bt); ``ce_grad`` those of the cross-entropy rows.
    ``mask_divergence`` False: the divergence of every row, the target's ignored ones included.
    ``store_budget``: ``keeps_dz``'s."""
    n, v = hs.shape[0], ws.shape[0]
    work = compute_dtype(hs.dtype)
    rows_out = torch.empty(n, device=hs.device, dtype=work)
    ce_out = torch.empty(n, device=hs.device, dtype=work) if ce else None
    keep = keeps_dz(n, v, hs.dtype, hs.device, row_grad is not None, needs, store_budget)
    if keep:
        return _kept_dz_chunks(hs, ws, bs, ht, wt, bt, target, ignore_index, kind, beta, scale_s, scale_t, row_grad,
                               needs, rows_out, ce_out, ce_grad, mask_divergence)
    step = chunk_rows(n, v, hs.device)
    grads = [None] * 6
    if row_grad is not None:
        for i, (t, need) in enumerate(zip((hs, ws, bs, ht, wt, bt), needs)):
            if need and t is not None:
                # the hidden states' chunks are disjoint; a weight's and a bias's gradient sum over the
                # chunks, in fp32 when a 16-bit one would be rounded too often (strategy.fp32_accumulate)
                wide = i not in (0, 3) and strategy.fp32_accumulate(n, step, t.element_size(), True)
                grads[i] = torch.zeros(t.shape, device=t.device, dtype=work if wide else t.dtype)
    grad_s, grad_t = row_grad is not None and any(needs[:3]), row_grad is not None and any(needs[3:])
    math_fn = _math_for(hs.device)
    for start in range(0, n, step):
        sl = slice(start, min(n, start + step))
        zs, zt = F.linear(hs[sl], ws, bs), F.linear(ht[sl], wt, bt)
        labelled = None if target is None else (target[sl] != ignore_index)
        valid = labelled if mask_divergence else None
        g = None if row_grad is None else row_grad[sl]
        rows, dz_s, ce_rows, dz_t = math_fn(zs, zt, g, valid, kind, beta, scale_s, scale_t, grad_s, grad_t,
                                            target[sl] if ce else None, None if ce_grad is None else ce_grad[sl],
                                            labelled if ce else None)
        del zs, zt
        rows_out[sl] = rows
        if ce:
            ce_out[sl] = ce_rows
        for dz, (h, w, b), first in ((dz_s, (hs, ws, bs), 0), (dz_t, (ht, wt, bt), 3)):
            if dz is None:
                continue
            if needs[first]:
                grads[first][sl] = dz @ w
            if needs[first + 1]:
                _acc_mm(grads[first + 1], dz.t(), h[sl])
            if needs[first + 2] and b is not None:
                grads[first + 2] += dz.sum(0, dtype=grads[first + 2].dtype)
    for i, t in enumerate((hs, ws, bs, ht, wt, bt)):
        if grads[i] is not None:
            grads[i] = grads[i].to(t.dtype)
    return rows_out, ce_out, grads


def _kept_dz_chunks(hs, ws, bs, ht, wt, bt, target, ignore_index: int, kind: str, beta: float, scale_s: float,
                    scale_t: float, row_grad: Tensor, needs: tuple, rows_out: Tensor, ce_out: Optional[Tensor],
                    ce_grad: Optional[Tensor], mask_divergence: bool):
    """``_chunks`` when ``keeps_dz``: the student's gradient logits of every row in one ``[N, V]``
    tensor (each chunk's GEMM writes its logits there, its math their gradient over them), the
    student's gradients from all of it at the end."""
    n, v = hs.shape[0], ws.shape[0]
    dz = torch.empty(n, v, dtype=hs.dtype, device=hs.device)
    step = chunk_rows(n, v, hs.device, teacher_itemsize=ht.element_size(),
                      weight_grad_bytes=ws.numel() * ws.element_size())
    math_fn = _math_for(hs.device, into=True)
    for start in range(0, n, step):
        sl = slice(start, min(n, start + step))
        part = dz[sl]
        if bs is None:
            torch.mm(hs[sl], ws.t(), out=part)
        else:
            torch.addmm(bs, hs[sl], ws.t(), out=part)
        zt = F.linear(ht[sl], wt, bt)
        labelled = None if target is None else (target[sl] != ignore_index)
        rows_out[sl], ce_rows = math_fn(part, zt, row_grad[sl], labelled if mask_divergence else None, kind, beta,
                                        scale_s, scale_t, target[sl] if ce_out is not None else None,
                                        None if ce_grad is None else ce_grad[sl],
                                        labelled if ce_out is not None else None)
        del zt
        if ce_out is not None:
            ce_out[sl] = ce_rows
    gh = (dz @ ws).to(hs.dtype) if needs[0] else None  # whole GEMMs: a chunk's rows would not fill the GPU
    gw = (dz.t() @ hs).to(ws.dtype) if needs[1] else None
    gb = dz.sum(0, dtype=compute_dtype(dz.dtype)).to(bs.dtype) if needs[2] and bs is not None else None
    return rows_out, ce_out, [gh, gw, gb, None, None, None]


def _valid(target: Optional[Tensor], ignore_index: int, n: int, device) -> Tensor:
    return torch.ones(n, dtype=torch.bool, device=device) if target is None else target != ignore_index


def _row_weights(valid: Tensor, reduction: str, dtype: torch.dtype) -> Tensor:
    """d(reduced loss) / d(row): ``options.reduction_weights``, and 1 / N on every row for ``batchmean``."""
    if reduction == "batchmean":
        return torch.full(valid.shape, 1.0 / max(valid.shape[0], 1), dtype=dtype, device=valid.device)
    return options.reduction_weights(valid, reduction, dtype)


def _reduced(rows: Tensor, valid: Tensor, reduction: str) -> Tensor:
    if reduction == "batchmean":
        return rows.sum() / max(rows.shape[0], 1)
    return options.reduced(rows.sum(), valid, reduction)


def _empty(t: Optional[Tensor], like: Tensor) -> Tensor:
    return (t if t is not None else like).new_empty(0)


# the return annotations written out (no alias, no tuple[Tensor, ...]): torch.library infers the schema
# from them, evaluated in the globals of ops._without_autocast's wrapper
@torch.library.custom_op("inductor_xent::linear_distill_fwd", mutates_args=())
@_without_autocast
def linear_distill_fwd(hs: Tensor, ws: Tensor, bs: Optional[Tensor], ht: Tensor, wt: Tensor, bt: Optional[Tensor],
                       target: Optional[Tensor], ignore_index: int, kind: str, beta: float, scale_s: float,
                       scale_t: float, reduction: str, needs: list[bool], soft_weight: float = 1.0,
                       hard_weight: float = 0.0, mask_divergence: bool = True, store_budget: str = "",
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    _check_weights(target, soft_weight, hard_weight)
    ce = hard_weight != 0.0
    mixing = dict(ce=ce, mask_divergence=mask_divergence, store_budget=store_budget)
    if reduction == "none":
        rows, ce_rows, _ = _chunks(hs, ws, bs, ht, wt, bt, target, ignore_index, kind, beta, scale_s, scale_t, None,
                                   needs, **mixing)
        return (_mixed(rows, ce_rows, soft_weight, hard_weight), *(_empty(t, hs) for t in (hs, ws, bs, ht, wt, bt)))
    # the reduced loss: the gradient of each row is known now
    labelled = _valid(target, ignore_index, hs.shape[0], hs.device)
    valid = labelled if mask_divergence else _valid(None, ignore_index, hs.shape[0], hs.device)
    work = compute_dtype(hs.dtype)
    row_grad = _row_weights(valid, reduction, work) * soft_weight
    ce_grad = options.reduction_weights(labelled, "mean", work) * hard_weight if ce else None
    rows, ce_rows, grads = _chunks(hs, ws, bs, ht, wt, bt, target, ignore_index, kind, beta, scale_s, scale_t,
                                   row_grad, needs, ce_grad=ce_grad, **mixing)
    loss = _reduced(rows, valid, reduction) * soft_weight
    if ce:
        loss = loss + options.reduced(ce_rows.sum(), labelled, "mean") * hard_weight
    return (loss, *(g if g is not None else _empty(t, hs) for g, t in zip(grads, (hs, ws, bs, ht, wt, bt))))


def _check_weights(target: Optional[Tensor], soft_weight: float, hard_weight: float) -> None:
    if hard_weight != 0.0 and target is None:
        raise ValueError("a hard-label cross-entropy (hard_weight != 0) needs the target")
    for name, x in (("soft_weight", soft_weight), ("hard_weight", hard_weight)):
        if not math.isfinite(x):
            raise ValueError(f"{name} must be finite, got {x}")


def _mixed(rows: Tensor, ce_rows: Optional[Tensor], soft_weight: float, hard_weight: float) -> Tensor:
    """Per row: soft_weight · divergence + hard_weight · cross-entropy."""
    rows = rows * soft_weight if soft_weight != 1.0 else rows
    return rows if ce_rows is None else rows + ce_rows * hard_weight


@linear_distill_fwd.register_fake
def _(hs, ws, bs, ht, wt, bt, target, ignore_index, kind, beta, scale_s, scale_t, reduction, needs, soft_weight=1.0,
      hard_weight=0.0, mask_divergence=True, store_budget=""):
    dt = compute_dtype(hs.dtype)
    loss = hs.new_empty(hs.shape[:1] if reduction == "none" else (), dtype=dt)
    grads = [t.new_empty(t.shape) if (need and t is not None and reduction != "none") else
             (t if t is not None else hs).new_empty(0) for t, need in zip((hs, ws, bs, ht, wt, bt), needs)]
    return (loss, *grads)


@torch.library.custom_op("inductor_xent::linear_distill_bwd", mutates_args=())
@_without_autocast
def linear_distill_bwd(grad_rows: Tensor, hs: Tensor, ws: Tensor, bs: Optional[Tensor], ht: Tensor, wt: Tensor,
                       bt: Optional[Tensor], target: Optional[Tensor], ignore_index: int, kind: str, beta: float,
                       scale_s: float, scale_t: float, needs: list[bool], soft_weight: float = 1.0,
                       hard_weight: float = 0.0, mask_divergence: bool = True, store_budget: str = "",
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    g = grad_rows.to(compute_dtype(hs.dtype))
    ce = hard_weight != 0.0
    _, _, grads = _chunks(hs, ws, bs, ht, wt, bt, target, ignore_index, kind, beta, scale_s, scale_t,
                          g * soft_weight, needs, ce=ce, ce_grad=g * hard_weight if ce else None,
                          mask_divergence=mask_divergence, store_budget=store_budget)
    return tuple(g if g is not None else _empty(t, hs) for g, t in zip(grads, (hs, ws, bs, ht, wt, bt)))


@linear_distill_bwd.register_fake
def _(grad_rows, hs, ws, bs, ht, wt, bt, target, ignore_index, kind, beta, scale_s, scale_t, needs, soft_weight=1.0,
      hard_weight=0.0, mask_divergence=True, store_budget=""):
    return tuple(t.new_empty(t.shape) if (need and t is not None) else (t if t is not None else hs).new_empty(0)
                 for t, need in zip((hs, ws, bs, ht, wt, bt), needs))


def _setup_context(ctx, inputs, output):
    hs, ws, bs, ht, wt, bt, target, ignore_index, kind, beta, scale_s, scale_t, reduction, needs, *weights = inputs
    ctx.options = (ignore_index, kind, beta, scale_s, scale_t, list(needs))
    # (soft_weight, hard_weight, mask_divergence, store_budget), the defaults where not given
    ctx.weights = (*weights, *(1.0, 0.0, True, "")[len(weights):])
    ctx.n_inputs = len(inputs)
    ctx.reduction = reduction
    if reduction == "none":
        ctx.save_for_backward(hs, ws, bs, ht, wt, bt, target)
    else:
        ctx.save_for_backward(*output[1:])


def _backward(ctx, grad_loss, *_grads):
    ignore_index, kind, beta, scale_s, scale_t, needs = ctx.options
    saved = ctx.saved_tensors
    if ctx.reduction == "none":
        hs, ws, bs, ht, wt, bt, target = saved
        grads = linear_distill_bwd(grad_loss, hs, ws, bs, ht, wt, bt, target, ignore_index, kind, beta,
                                   scale_s, scale_t, needs, *ctx.weights)
    else:
        grads = [g * grad_loss.to(g.dtype) if g.numel() else g for g in saved]
    out = [g if (need and g.numel()) else None for g, need in zip(grads, needs)]
    return (*out, *(None,) * (ctx.n_inputs - 6))


linear_distill_fwd.register_autograd(_backward, setup_context=_setup_context)


def linear_distillation_loss(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    target: Optional[Tensor] = None,
    *,
    student_bias: Optional[Tensor] = None,
    teacher_bias: Optional[Tensor] = None,
    kind: Kind = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
    reduction: str = "batchmean",
    soft_weight: float = 1.0,
    hard_weight: float = 0.0,
    store_budget: Optional[str | int] = None,
) -> Tensor:
    """The divergence between a student and a teacher lm_head (module docstring), without the
    ``[N, V]`` logits of either (on CUDA one ``[N, V]`` tensor of the student's gradient logits
    instead, within ``store_budget``: ``keeps_dz``), times ``soft_weight``; with ``hard_weight`` plus that times the
    student's hard-label cross-entropy ``F.cross_entropy(student_logits, target,
    ignore_index=ignore_index)`` (its raw logits, no temperature; the mean over the labelled rows,
    per row for ``reduction="none"``), computed in the same pass over the student's logits (Hinton's
    ``α·CE + (1 − α)·T²·KD``: ``hard_weight=α, soft_weight=(1 − α)·T**2``). Equal, up to rounding, to::

        s = F.linear(student_hidden, student_weight, student_bias).float() / temperature
        t = F.linear(teacher_hidden, teacher_weight, teacher_bias).float() / temperature
        rows = F.kl_div(s.log_softmax(-1), t.log_softmax(-1), log_target=True, reduction="none").sum(-1)
        # (forward_kl; 0 where target == ignore_index), then reduced by ``reduction``

    ``*_hidden`` are ``[..., D]`` with the same leading shape (``target`` too, when given); a head's
    hidden, weight and bias in one dtype, or inside ``torch.autocast``, which casts them as it casts
    ``F.linear``'s (fp32 master weights then get fp32 gradients through the casts). The
    teacher gets gradients where its tensors require them (call it on ``.detach()``-ed tensors, or
    under ``torch.no_grad()`` for the teacher's forward, to train the student only).
    ``store_budget`` (bytes, ``"2GiB"``, or a fraction of the logits, ``"0.5x"``; default
    ``INDUCTOR_XENT_STORE_BUDGET``, else ``"1x"``): how large the kept gradient logits may be; ``0``
    keeps none (the chunks then add into an fp32 weight-gradient accumulator)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    for name, x in (("soft_weight", soft_weight), ("hard_weight", hard_weight)):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise ValueError(f"{name} must be a finite number, got {x!r}")
    if hard_weight != 0 and target is None:
        raise ValueError("hard_weight needs the target (the hard labels)")
    if kind == "jsd" and not 0.0 < beta < 1.0:
        raise ValueError(f"jsd needs 0 < beta < 1 (beta 0 is forward_kl, 1 reverse_kl), got {beta}")
    options.check_temperature(temperature)
    if store_budget is not None:
        config.parse_budget(store_budget)
    if student_weight.dim() != 2 or teacher_weight.dim() != 2 or student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(f"the weights must be [V, D] with one vocabulary: student {tuple(student_weight.shape)}, "
                         f"teacher {tuple(teacher_weight.shape)}")
    lead = student_hidden.shape[:-1]
    if teacher_hidden.shape[:-1] != lead or (target is not None and target.shape != lead):
        raise ValueError(f"student hidden {tuple(student_hidden.shape)}, teacher hidden {tuple(teacher_hidden.shape)}"
                         f" and target {None if target is None else tuple(target.shape)} need one leading shape")
    if student_hidden.shape[-1] != student_weight.shape[1] or teacher_hidden.shape[-1] != teacher_weight.shape[1]:
        raise ValueError("each hidden's last dimension must be its weight's D")
    from .api import _autocast  # (api imports ops, which imports this module)

    # each head's operands as F.linear gets them under torch.autocast; differentiable casts, so an fp32
    # master weight gets its gradient in fp32, as in eager autocast
    student_hidden, student_weight, student_bias = _autocast(student_hidden, student_weight, student_bias)
    teacher_hidden, teacher_weight, teacher_bias = _autocast(teacher_hidden, teacher_weight, teacher_bias)
    _check_dtypes("student", student_hidden, student_weight, student_bias)
    _check_dtypes("teacher", teacher_hidden, teacher_weight, teacher_bias)
    hs, ht = student_hidden.reshape(-1, student_hidden.shape[-1]), teacher_hidden.reshape(-1, teacher_hidden.shape[-1])
    t1 = None if target is None else target.reshape(-1)
    needs = [bool(x is not None and x.requires_grad and torch.is_grad_enabled())
             for x in (hs, student_weight, student_bias, ht, teacher_weight, teacher_bias)]
    out = linear_distill_fwd(hs, student_weight, student_bias, ht, teacher_weight, teacher_bias, t1, ignore_index,
                             kind, float(beta), 1.0 / temperature, 1.0 / temperature, reduction, needs,
                             float(soft_weight), float(hard_weight), True,
                             "" if store_budget is None else str(store_budget))[0]
    return out.reshape(lead) if reduction == "none" else out


def _check_dtypes(head: str, hidden: Tensor, weight: Tensor, bias: Optional[Tensor]) -> None:
    """A head's operands in one dtype (after autocast's casts), as ``F.linear`` needs them: the op's
    GEMMs, and the kept gradient logits' ``out=`` GEMMs, take them as they are."""
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        raise TypeError(f"the {head}'s hidden, weight and bias need one dtype (or torch.autocast to cast them), got "
                        f"{hidden.dtype}, {weight.dtype}{'' if bias is None else ', ' + str(bias.dtype)}")
