"""Knowledge distillation between two lm_heads without either ``[N, V]`` logits tensor (on CUDA one
``[N, V]`` tensor of the student's gradient logits instead, below).

A student head (hidden ``[N, Ds]``, weight ``[V, Ds]``) and a teacher head (``[N, Dt]``, ``[V, Dt]``,
``Dt`` may differ) over one vocabulary; per row, with ``u = z * scale`` (a temperature ``T`` is
``scale = 1/T``; a head with a softcap ``c`` has ``u = c·tanh(z/c) * scale``, Gemma 2's capped logits
over the temperature), ``q = softmax(u_student)``, ``p = softmax(u_teacher)``:

* ``forward_kl``: ``KL(p ‖ q) = Σ p (log p − log q)`` (Hinton's KD; ``F.kl_div(log q, p)``),
* ``reverse_kl``: ``KL(q ‖ p) = Σ q (log q − log p)``,
* ``jsd``: ``β KL(p ‖ m) + (1 − β) KL(q ‖ m)``, ``m = β p + (1 − β) q`` (TRL's GKD and its limits:
  β → 0 is forward KL, β → 1 reverse KL; ``0 < β < 1`` here),
* ``soft_ce``: the cross-entropy of the student against the teacher's probabilities, ``−Σ p log q``
  (torchtune's ``ForwardKLLoss``: forward KL plus the teacher's entropy, the same student gradient),

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
gradient, within 128 and 512 MiB) besides.

With a target whose ignored rows carry nothing (a masked divergence) and biasless 16-bit heads on
CUDA (``skips_rows``), the kept path computes the labelled rows only: they are moved first on the
device and every GEMM, both heads' logits per chunk and the two gradients, stops at their count
(templates/rows.py; no host sync). So do the accumulating chunks (their hidden states' gradients
written through the row order, the weights' added up) and the recompute below, in both passes (its
backward for a frozen teacher). On CPU every path runs on the labelled rows alone (``_host_rows``:
``nonzero`` waits for no device there), whatever the heads' dtype and biases.

A store budget of 0 (``recomputes``: ``store_budget=0``, ``strategy="recompute"``) keeps neither:
the forward runs over row chunks and keeps per row only the two log-sum-exps and what the
divergence's gradient needs of the whole row (``STATS``); the backward runs over column chunks of
the vocabulary, recomputing both heads' logits of those columns for every row, so each chunk's
weight-gradient rows are whole (one GEMM, rounded once) and only the hidden states' gradients add
up over the chunks (in fp32, ``[N, D]``). Memory O(N·D + chunk); time: both heads' GEMMs twice
(about 1.6× torch.compile's at a teacher twice the student's width).

Under ``torch.autocast`` (fp32 master weights, bf16 activations) ``linear_distillation_loss`` casts
each head's operands as autocast casts ``F.linear``'s, and the pass inserts the same casts; the ops
run with autocast off (``ops._without_autocast``), so every GEMM, the kept path's ``out=`` ones
included, computes in the operands' one dtype, and the gradients reach the fp32 weights through the
casts, as in eager autocast.

``inductor_xent::linear_distill_fwd(hs, ws, bs, ht, wt, bt, target, ignore_index, kind, beta,
scale_s, scale_t, reduction, needs, soft_weight=1.0, hard_weight=0.0, mask_divergence=True,
store_budget="", softcap_s=None, softcap_t=None) -> (loss, gh_s, gw_s, gb_s, gh_t, gw_t, gb_t)``: the
loss ((N,) or 0-dim float32) and, for a reduced loss, the gradients (empty where not needed; not differentiable);
``inductor_xent::linear_distill_bwd(grad_rows, ...)`` the per-row case's backward. The loss is
``soft_weight`` times the divergence plus ``hard_weight`` times the student's hard-label
cross-entropy of ``target`` (its raw logits, capped by ``softcap_s``; the mean over the labelled rows;
per row for ``none``), both from the same chunk of student logits; ``mask_divergence`` False counts every
row's divergence, the unlabelled ones too (the pass's ``α·CE + β·KD``, whose KD has no mask);
``store_budget`` is ``keeps_dz``'s (``""``: the configured one); ``softcap_s`` / ``softcap_t`` each head's
softcap (None: none), the cross-entropy reading the student's capped logits.

``inductor_xent::linear_distill_recompute_fwd(<linear_distill_fwd's arguments but store_budget>) ->
(loss, stats)``: the loss and ``[N, STATS]`` per-row statistics; its autograd formula calls
``inductor_xent::linear_distill_recompute_bwd(grad_div, grad_ce, stats, hs, ws, bs, ht, wt, bt, target,
kind, beta, scale_s, scale_t, needs, softcap_s=None, softcap_t=None) -> (gh_s, gw_s, gb_s, gh_t, gw_t,
gb_t)`` with each divergence row's and cross-entropy row's incoming gradient (the reduction's weights
folded in). The functional API and the pass call it where ``recomputes``.
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
from .templates import rows as compaction
from .templates.configs import KernelConfig

Kind = Literal["forward_kl", "reverse_kl", "jsd", "soft_ce"]
KINDS = ("forward_kl", "reverse_kl", "jsd", "soft_ce")
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


def _capped(z: Tensor, cap: Optional[float], slope: bool = True) -> tuple[Tensor, Optional[Tensor]]:
    """(``cap·tanh(z/cap)``, with ``slope`` its derivative ``1 − tanh²(z/cap)``, else None) for a head's
    softcap (its raw logits capped before the temperature, as Gemma 2's model caps them); ``(z, None)``
    without one."""
    if cap is None:
        return z, None
    t = torch.tanh(z / cap)
    return t * cap, (1 - t * t) if slope else None


def _rows(kind: str, beta: float, us: Tensor, ut: Tensor, grad_s: bool, grad_t: bool):
    """Per row of one chunk (fp32 scaled logits ``us``, ``ut``): the divergence, and its gradients
    with respect to ``us`` and ``ut`` (None where not asked)."""
    ls, lt = torch.log_softmax(us, -1), torch.log_softmax(ut, -1)
    q, p = ls.exp(), lt.exp()
    rows, gs, gt, js_s, js_t = _divergence(kind, beta, ls, lt, q, p)
    return (rows, *_du(kind, beta, ls, lt, q, p, rows, gs, gt, js_s, js_t, grad_s, grad_t))


def _mixture_logs(beta: float, ls: Tensor, lt: Tensor):
    """jsd: ``log q − log m`` and ``log p − log m`` for the mixture ``m = β p + (1 − β) q``."""
    lm = torch.logaddexp(lt + math.log(beta), ls + math.log1p(-beta))
    return ls - lm, lt - lm


def _divergence(kind: str, beta: float, ls: Tensor, lt: Tensor, q: Tensor, p: Tensor):
    """Per row, from the log-probabilities ``ls`` (student), ``lt`` (teacher) and their
    probabilities: (the divergence, and for jsd ``gs = log q − log m``, ``gt = log p − log m`` and the
    row sums ``Σ q·gs``, ``Σ p·gt``; None for the KLs)."""
    if kind == "forward_kl":
        return (p * (lt - ls)).sum(-1), None, None, None, None
    if kind == "reverse_kl":
        return (q * (ls - lt)).sum(-1), None, None, None, None
    if kind == "soft_ce":
        return -(p * ls).sum(-1), None, None, None, None
    gs, gt = _mixture_logs(beta, ls, lt)
    js_s, js_t = (q * gs).sum(-1), (p * gt).sum(-1)
    return beta * js_t + (1 - beta) * js_s, gs, gt, js_s, js_t


def _du(kind: str, beta: float, ls: Tensor, lt: Tensor, q: Tensor, p: Tensor, rows: Tensor, gs, gt, js_s, js_t,
        grad_s: bool, grad_t: bool):
    """The divergence's gradients with respect to the scaled logits of the student and the teacher
    (None where not asked), from ``_divergence``'s per-row values (``rows``, and jsd's row sums: a
    chunk of columns needs only those, not the whole row)."""
    du_s = du_t = None
    if kind == "forward_kl":
        if grad_s:
            du_s = q - p
        if grad_t:
            du_t = p * (lt - ls - rows[:, None])
    elif kind == "reverse_kl":
        if grad_s:
            du_s = q * (ls - lt - rows[:, None])
        if grad_t:
            du_t = p - q
    elif kind == "soft_ce":  # the student's as forward KL's; d/du_t of −Σ p·log q is −p (log q + rows)
        if grad_s:
            du_s = q - p
        if grad_t:
            du_t = -p * (ls + rows[:, None])
    else:  # d/dq of the divergence is (1 − β)(log q − log m), through the softmax; p's alike with β
        if grad_s:
            du_s = (1 - beta) * q * (gs - js_s[:, None])
        if grad_t:
            du_t = beta * p * (gt - js_t[:, None])
    return du_s, du_t


def _chunk_math(zs: Tensor, zt: Tensor, g: Optional[Tensor], valid: Optional[Tensor], kind: str, beta: float,
                scale_s: float, scale_t: float, grad_s: bool, grad_t: bool, target: Optional[Tensor] = None,
                g_ce: Optional[Tensor] = None, ce_valid: Optional[Tensor] = None, unwritten: bool = False,
                caps: tuple = (None, None)):
    """One chunk's rows (0 where not ``valid``) and the gradients with respect to the two heads'
    logits ``zs``, ``zt`` (in their dtype; None where not asked), for incoming row gradients ``g``.
    With ``target`` also the student's hard-label cross-entropy rows ``lse(zs) − zs[target]`` (its
    raw logits, capped but no temperature; 0 where not ``ce_valid``), returned third, and with ``g_ce`` (its
    rows' gradients) their gradient ``softmax(zs) − onehot`` joins the student's. ``unwritten``: the
    logits of rows not ``valid`` may be any bits (a count-bounded GEMM left them), so their gradients
    are set to exactly 0 (a product with a 0 weight would keep a NaN). ``caps``: each head's softcap
    (``_capped``, before its scale; the cross-entropy reads the student's capped logits)."""
    work = compute_dtype(zs.dtype)
    (cs, ds), (ct, dt) = _capped(zs.to(work), caps[0], grad_s), _capped(zt.to(work), caps[1], grad_t)
    rows, du_s, du_t = _rows(kind, beta, cs * scale_s, ct * scale_t, grad_s, grad_t)
    if valid is not None:
        rows = torch.where(valid, rows, 0.0)
        g = None if g is None else torch.where(valid, g, 0.0)
    ce = du_ce = None
    if target is not None:
        ls1 = torch.log_softmax(cs, -1)
        t = torch.where(ce_valid, target, 0)[:, None]
        ce = torch.where(ce_valid, -ls1.gather(1, t)[:, 0], 0.0)
        if g_ce is not None and grad_s:
            g_ce = torch.where(ce_valid, g_ce, 0.0)[:, None]
            du_ce = (ls1.exp() * g_ce).scatter_add_(1, t, -g_ce)
    dz_s = None if du_s is None else du_s * (g * scale_s)[:, None]  # d/dz = d/du * scale
    if du_ce is not None:
        dz_s = du_ce if dz_s is None else dz_s + du_ce
    dz_t = None if du_t is None else du_t * (g * scale_t)[:, None]
    dz_s, dz_t = _through_caps(dz_s, ds), _through_caps(dz_t, dt)
    if unwritten and valid is not None:  # exactly 0, whatever the logits (a count-bounded GEMM left them)
        dz_s = None if dz_s is None else torch.where(valid[:, None], dz_s, 0.0)
        dz_t = None if dz_t is None else torch.where(valid[:, None], dz_t, 0.0)
    return rows, None if dz_s is None else dz_s.to(zs.dtype), ce, None if dz_t is None else dz_t.to(zt.dtype)


def _chunk_math_into(dz: Tensor, zt: Tensor, g: Tensor, valid: Optional[Tensor], kind: str, beta: float,
                     scale_s: float, scale_t: float, target: Optional[Tensor] = None, g_ce: Optional[Tensor] = None,
                     ce_valid: Optional[Tensor] = None, unwritten: bool = False, caps: tuple = (None, None)):
    """``_chunk_math`` for ``keeps_dz``: ``dz`` holds the chunk's student logits and gets their
    gradient in place (0 on the rows not ``valid``); returns the rows (and the cross-entropy rows or
    None)."""
    rows, dz_s, ce, _ = _chunk_math(dz, zt, g, valid, kind, beta, scale_s, scale_t, True, False, target, g_ce,
                                    ce_valid, unwritten, caps)
    dz.copy_(dz_s)
    return rows, ce


def _through_caps(dz: Optional[Tensor], dcap: Optional[Tensor]) -> Optional[Tensor]:
    """A gradient with respect to the capped logits as one with respect to the raw ones."""
    return dz if dz is None or dcap is None else dz * dcap


_fused = {}


def _math_for(device: torch.device, fn=None):
    """A chunk's math (``fn``, by default ``_chunk_math``): on CUDA compiled once by Inductor into a
    few fused kernels (eager PyTorch would make a dozen passes over each [rows, V] chunk); eager
    elsewhere."""
    fn = fn or _chunk_math
    if device.type != "cuda":
        return fn
    if fn not in _fused:
        _fused[fn] = options.compiled_per_row(fn)
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
            ce_grad: Optional[Tensor] = None, mask_divergence: bool = True, store_budget: str = "",
            caps: tuple = (None, None)):
    """The loss rows (and with ``ce`` the student's hard-label cross-entropy rows, else None) and,
    when ``row_grad`` (the incoming gradient of each divergence row) is given, the gradients
    ``needs`` asks for (hs, ws, bs, ht, wt, bt); ``ce_grad`` those of the cross-entropy rows.
    ``mask_divergence`` False: the divergence of every row, the target's ignored ones included.
    ``store_budget``: ``keeps_dz``'s; ``caps``: the heads' softcaps (``_chunk_math``)."""
    n, v = hs.shape[0], ws.shape[0]
    work = compute_dtype(hs.dtype)
    rows_out = torch.empty(n, device=hs.device, dtype=work)
    ce_out = torch.empty(n, device=hs.device, dtype=work) if ce else None
    skip = skips_rows(hs, ws, bs, ht, wt, bt, target, mask_divergence)  # (a frozen head: LoRA; a trained teacher)
    idx = None if skip or target is None else _host_rows(target != ignore_index, mask_divergence)
    if idx is not None:  # on CPU: the labelled rows alone, the others' rows and hidden gradients 0
        sub = [None if t is None else t.index_select(0, idx) for t in (hs, ht, target, row_grad, ce_grad)]
        rows, ce_rows, grads = _chunks(sub[0], ws, bs, sub[1], wt, bt, sub[2], ignore_index, kind, beta, scale_s,
                                       scale_t, sub[3], needs, ce, sub[4], mask_divergence, store_budget, caps)
        for i in (0, 3):
            grads[i] = _scattered(grads[i], idx, n)
        return _scattered(rows, idx, n), _scattered(ce_rows, idx, n), grads
    keep = keeps_dz(n, v, hs.dtype, hs.device, row_grad is not None, needs, store_budget)
    if keep:
        return _kept_dz_chunks(hs, ws, bs, ht, wt, bt, target, ignore_index, kind, beta, scale_s, scale_t, row_grad,
                               needs, rows_out, ce_out, ce_grad, mask_divergence, caps)
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
    dtypes = [None if t is None else t.dtype for t in (hs, ws, bs, ht, wt, bt)]
    if skip:  # the labelled rows first: the chunks write these, the hidden states' gradients through `order`
        order, _, counts, (hs, ht, target, row_grad, ce_grad) = _compact(
            target != ignore_index, step, hs, ht, target, row_grad, ce_grad)
        rows_all, ce_all = rows_out, ce_out
        rows_out, ce_out = torch.empty_like(rows_all), None if ce_all is None else torch.empty_like(ce_all)
        bufs = [torch.empty(min(n, step), v, dtype=t.dtype, device=t.device) for t in (hs, ht)]
    for i, start in enumerate(range(0, n, step)):
        sl = slice(start, min(n, start + step))
        if skip:  # rows past the chunk's count: logits not written, gradients 0 (the math's `valid`)
            zs, zt = (b[:sl.stop - sl.start] for b in bufs)
            _bounded_logits(zs, zt, hs[sl], ws, ht[sl], wt, counts[i:i + 1])
        else:
            zs, zt = F.linear(hs[sl], ws, bs), F.linear(ht[sl], wt, bt)
        labelled = None if target is None else (target[sl] != ignore_index)
        valid = labelled if mask_divergence else None
        g = None if row_grad is None else row_grad[sl]
        rows, dz_s, ce_rows, dz_t = math_fn(zs, zt, g, valid, kind, beta, scale_s, scale_t, grad_s, grad_t,
                                            target[sl] if ce else None, None if ce_grad is None else ce_grad[sl],
                                            labelled if ce else None, skip, caps)
        del zs, zt
        rows_out[sl] = rows
        if ce:
            ce_out[sl] = ce_rows
        for dz, (h, w, b), first in ((dz_s, (hs, ws, bs), 0), (dz_t, (ht, wt, bt), 3)):
            if dz is None:
                continue
            if skip:  # biasless heads
                cnt = counts[i:i + 1]
                if needs[first]:
                    compaction.rows_mm(grads[first], dz, w, cnt, out_rows=order[sl], bound="m")
                if needs[first + 1]:
                    compaction.rows_mm(grads[first + 1], dz, h[sl], cnt, bound="k", trans_a=True, accumulate=True)
                continue
            if needs[first]:
                grads[first][sl] = dz @ w
            if needs[first + 1]:
                _acc_mm(grads[first + 1], dz.t(), h[sl])
            if needs[first + 2] and b is not None:
                grads[first + 2] += dz.sum(0, dtype=grads[first + 2].dtype)
    if skip:
        rows_all.index_copy_(0, order, rows_out)
        if ce:
            ce_all.index_copy_(0, order, ce_out)
        rows_out, ce_out = rows_all, ce_all
    for i, dtype in enumerate(dtypes):
        if grads[i] is not None:
            grads[i] = grads[i].to(dtype)
    return rows_out, ce_out, grads


# the row chunks' logits GEMMs where skips_rows (rows_mm, TRANS_B): grouped 8 row blocks at a time (H100,
# 2048 rows x D 4096 / 8192 x V 128256: 2.86-3.01 / 5.83-5.90 ms against cuBLAS's 2.79-3.12 / 6.08-6.60
# and rows_mm's default (4 row blocks) 3.00-3.07 / 6.13-6.98)
LOGITS_CONFIG = KernelConfig(128, 256, 64, 8, 8, 3, tma=True)


def skips_rows(hs: Tensor, ws: Tensor, bs: Optional[Tensor], ht: Tensor, wt: Tensor, bt: Optional[Tensor],
               target: Optional[Tensor], mask_divergence: bool) -> bool:
    """Whether the chunks (kept, accumulating, and the recompute's, its backward for a frozen teacher)
    compute the labelled rows only (templates/rows.py, ``compaction``: moved first on the device, every GEMM stopping at
    their count, no host sync): a target whose ignored rows carry
    no divergence (``mask_divergence``) and no cross-entropy, biasless 16-bit heads
    (``rows.compacts``), on CUDA (or in Triton's interpreter)."""
    if target is None or not mask_divergence or bs is not None or bt is not None:
        return False
    if hs.device.type != "cuda" and not config.triton_interpret():
        return False
    return hs.dtype == ht.dtype and compaction.compacts(hs.dtype)


def _compact(live: Tensor, step: int, *tensors):
    """The ``live`` rows first (``compaction.compact``: a stable sort on the device, no host sync):
    (order, their count, each ``step``-row chunk's count of them, the tensors' rows in that order;
    None stays None)."""
    order, count = compaction.compact(live)
    starts = torch.arange(0, live.shape[0], max(step, 1), device=live.device, dtype=torch.int32)
    counts = (count - starts).clamp_(0, max(step, 1))
    return order, count, counts, [None if t is None else t.index_select(0, order) for t in tensors]


def _bounded_logits(zs: Tensor, zt: Tensor, hs: Tensor, ws: Tensor, ht: Tensor, wt: Tensor, count: Tensor) -> None:
    """Both heads' logits of the first ``count`` rows into ``zs`` and ``zt`` (the other rows left as
    they were), each weight read as stored (rows_mm's TRANS_B)."""
    cfg = None if config.triton_interpret() else LOGITS_CONFIG
    compaction.rows_mm(zs, hs, ws.t(), count, bound="m", cfg=cfg)
    compaction.rows_mm(zt, ht, wt.t(), count, bound="m", cfg=cfg)


def _host_rows(live: Tensor, enabled: bool = True) -> Optional[Tensor]:
    """Where no graph-safe compaction is needed (CPU tensors: ``nonzero`` waits for no device) and
    some rows are not ``live``: the live rows' indices, for a call on those rows alone; else None.
    ``INDUCTOR_XENT_SKIP_IGNORED=0`` turns it off with the GPU paths' skipping."""
    if not enabled or live.device.type != "cpu" or not config.skip_ignored_rows() or bool(live.all()):
        return None
    return live.nonzero().squeeze(1)


def _scattered(part: Optional[Tensor], idx: Tensor, n: int) -> Optional[Tensor]:
    """``part``'s rows at ``idx`` of ``n`` rows, zeros elsewhere."""
    if part is None:
        return None
    return part.new_zeros((n, *part.shape[1:])).index_copy_(0, idx, part)


def _kept_dz_chunks(hs, ws, bs, ht, wt, bt, target, ignore_index: int, kind: str, beta: float, scale_s: float,
                    scale_t: float, row_grad: Tensor, needs: tuple, rows_out: Tensor, ce_out: Optional[Tensor],
                    ce_grad: Optional[Tensor], mask_divergence: bool, caps: tuple = (None, None)):
    """``_chunks`` when ``keeps_dz``: the student's gradient logits of every row in one ``[N, V]``
    tensor (each chunk's GEMM writes its logits there, its math their gradient over them), the
    student's gradients from all of it at the end. Where ``skips_rows``, the labelled rows first and
    nothing computed past their count: the chunks' two GEMMs, the gradients' two."""
    n, v = hs.shape[0], ws.shape[0]
    dz = torch.empty(n, v, dtype=hs.dtype, device=hs.device)
    step = chunk_rows(n, v, hs.device, teacher_itemsize=ht.element_size(),
                      weight_grad_bytes=ws.numel() * ws.element_size())
    math_fn = _math_for(hs.device, _chunk_math_into)
    skip = skips_rows(hs, ws, bs, ht, wt, bt, target, mask_divergence)
    if skip:
        order, count, counts, (hs, ht, target, row_grad, ce_grad) = _compact(
            target != ignore_index, step, hs, ht, target, row_grad, ce_grad)
        zt_buf = torch.empty(min(n, step), v, dtype=ht.dtype, device=ht.device)
        rows_all, ce_all = rows_out, ce_out  # written through `order` at the end
        rows_out, ce_out = torch.empty_like(rows_all), None if ce_all is None else torch.empty_like(ce_all)
    for i, start in enumerate(range(0, n, step)):
        sl = slice(start, min(n, start + step))
        part = dz[sl]
        if skip:  # rows past the chunk's count stay as they were: the math zeroes their gradient
            zt = zt_buf[:part.shape[0]]
            _bounded_logits(part, zt, hs[sl], ws, ht[sl], wt, counts[i:i + 1])
        else:
            if bs is None:
                torch.mm(hs[sl], ws.t(), out=part)
            else:
                torch.addmm(bs, hs[sl], ws.t(), out=part)
            zt = F.linear(ht[sl], wt, bt)
        labelled = None if target is None else (target[sl] != ignore_index)
        rows_out[sl], ce_rows = math_fn(part, zt, row_grad[sl], labelled if mask_divergence else None, kind, beta,
                                        scale_s, scale_t, target[sl] if ce_out is not None else None,
                                        None if ce_grad is None else ce_grad[sl],
                                        labelled if ce_out is not None else None, skip, caps)
        del zt
        if ce_out is not None:
            ce_out[sl] = ce_rows
    if skip:
        del zt_buf, ht  # before the gradients' peak
        rows_all.index_copy_(0, order, rows_out)
        if ce_all is not None:
            ce_all.index_copy_(0, order, ce_out)
        gh = torch.zeros(n, hs.shape[1], dtype=hs.dtype, device=hs.device) if needs[0] else None
        gw = compaction.row_grads(dz, ws, hs, count, order, gh, needs[1])
        return rows_all, ce_all, [gh, gw, None, None, None, None]
    gh = (dz @ ws).to(hs.dtype) if needs[0] else None  # whole GEMMs: a chunk's rows would not fill the GPU
    gw = (dz.t() @ hs).to(ws.dtype) if needs[1] else None
    gb = dz.sum(0, dtype=compute_dtype(dz.dtype)).to(bs.dtype) if needs[2] and bs is not None else None
    return rows_out, ce_out, [gh, gw, gb, None, None, None]


# ---------------------------------------------------------------------------------------------
# recompute (a store budget of 0): the forward keeps per-row statistics only; the backward
# recomputes both heads' logits over column chunks of the vocabulary
# ---------------------------------------------------------------------------------------------
# per row: the log-sum-exps of both heads' scaled logits, the divergence, jsd's Σ q·(log q − log m)
# and Σ p·(log p − log m), and the log-sum-exp of the student's raw (capped) logits (the cross-entropy's)
STATS = 6
# a chunk's 16-bit tensors on a GPU: the forward's both heads' logits of a row chunk, the backward's
# both heads' logits of a column chunk and the student's gradient logits (the fused math keeps no
# other [rows, columns] tensor); the hidden states' fp32 gradients come on top. H100, the bench_distill
# shape: row chunks of 128, 256 and 640 rows took 148, 120 and 114 ms fwd+bwd (the forward's GEMMs
# want rows); 256 MiB gives 512 rows and 5376 columns there (benchmarks/RESULTS.md)
RECOMPUTE_CHUNK_BYTES = 256 * 2**20


def recomputes(needs, budget: str = "") -> bool:
    """Whether the op keeps nothing for its backward but per-row statistics (``recompute``): when
    gradients are asked for and the store budget is 0 (``store_budget=0``; ``budget`` ``""`` is the
    configured one: ``INDUCTOR_XENT_STRATEGY=recompute``, ``INDUCTOR_XENT_STORE_BUDGET=0``; the pass
    gives ``"0"`` for ``xent.strategy="recompute"``). Independent of the sizes: the pass and the
    functional API choose the op from it."""
    if not any(needs):
        return False
    if not budget and config.strategy() == "recompute":
        return True
    return config.parse_budget(budget or config.store_budget())[1] == 0


def recompute_slice(count: int, across: int, device: torch.device, itemsize: int = 2, tensors: int = 2) -> int:
    """How many of ``count`` rows (the forward) or vocabulary columns (the backward) one recompute
    chunk takes, each ``across`` logits wide: on CUDA ``tensors`` tensors of ``itemsize`` bytes within
    RECOMPUTE_CHUNK_BYTES, else ``config.fallback_chunk_bytes`` at CHUNK_TENSORS fp32 tensors (the
    eager math); whole 128-wide GEMM tiles where more than 128 fit."""
    if device.type == "cuda":
        k = RECOMPUTE_CHUNK_BYTES // max(1, across * itemsize * tensors)
    else:
        k = config.fallback_chunk_bytes // max(1, across * 4 * CHUNK_TENSORS)
    return max(1, min(count, k - k % 128 if k >= 128 else k))


def _stats_math(zs: Tensor, zt: Tensor, valid: Optional[Tensor], kind: str, beta: float, scale_s: float,
                scale_t: float, target: Optional[Tensor] = None, ce_valid: Optional[Tensor] = None,
                caps: tuple = (None, None)):
    """The recompute forward on a chunk of rows: (the divergence rows, 0 where not ``valid``; with
    ``target`` the cross-entropy rows, 0 where not ``ce_valid``, else None; the ``[rows, STATS]``
    statistics); ``caps``: ``_chunk_math``'s."""
    work = compute_dtype(zs.dtype)
    zw, ztw = _capped(zs.to(work), caps[0], False)[0], _capped(zt.to(work), caps[1], False)[0]
    us, ut = zw * scale_s, ztw * scale_t
    lse_s, lse_t = us.logsumexp(-1), ut.logsumexp(-1)
    ls, lt = us - lse_s[:, None], ut - lse_t[:, None]
    rows, _, _, js_s, js_t = _divergence(kind, beta, ls, lt, ls.exp(), lt.exp())
    zero = torch.zeros_like(rows)
    ce, lse_raw = None, zero
    if target is not None:
        lse_raw = zw.logsumexp(-1)
        ce = torch.where(ce_valid, lse_raw - zw.gather(1, torch.where(ce_valid, target, 0)[:, None])[:, 0], 0.0)
    stats = torch.stack([lse_s, lse_t, rows, zero if js_s is None else js_s, zero if js_t is None else js_t,
                         lse_raw], 1)
    return rows if valid is None else torch.where(valid, rows, 0.0), ce, stats


def _recompute_math(zs: Tensor, zt: Tensor, stats: Tensor, g: Tensor, g_ce: Optional[Tensor], col: Optional[Tensor],
                    kind: str, beta: float, scale_s: float, scale_t: float, grad_s: bool, grad_t: bool,
                    live: Optional[Tensor] = None, caps: tuple = (None, None)):
    """The recompute backward on a chunk of columns of every row: the gradients with respect to both
    heads' logits of those columns (in their dtype; None where not asked) from the forward's
    statistics. ``g``: each divergence row's incoming gradient (0 where not counted); ``g_ce``: each
    cross-entropy row's (0 where unlabelled) or None; ``col``: each row's target column within the
    chunk (the one-hot's; none outside ``[0, columns)``); ``live``: the rows whose gradients are
    computed (the others exactly 0, whatever their logits: a count-bounded GEMM did not write them);
    ``caps``: ``_chunk_math``'s."""
    work = compute_dtype(zs.dtype)
    (zw, ds), (ztw, dt) = _capped(zs.to(work), caps[0], grad_s), _capped(zt.to(work), caps[1], grad_t)
    ls, lt = zw * scale_s - stats[:, 0:1], ztw * scale_t - stats[:, 1:2]
    gs, gt = _mixture_logs(beta, ls, lt) if kind == "jsd" else (None, None)
    du_s, du_t = _du(kind, beta, ls, lt, ls.exp(), lt.exp(), stats[:, 2], gs, gt, stats[:, 3], stats[:, 4], grad_s,
                     grad_t)
    dz_s = None if du_s is None else du_s * (g * scale_s)[:, None]  # d/dz = d/du * scale
    if g_ce is not None and grad_s:
        inside = (col >= 0) & (col < zs.shape[1])
        du_ce = ((zw - stats[:, 5:6]).exp() * g_ce[:, None]).scatter_add(
            1, torch.where(inside, col, 0)[:, None], torch.where(inside, -g_ce, 0.0)[:, None])
        dz_s = du_ce if dz_s is None else dz_s + du_ce
    dz_t = None if du_t is None else du_t * (g * scale_t)[:, None]
    dz_s, dz_t = _through_caps(dz_s, ds), _through_caps(dz_t, dt)
    if live is not None:
        dz_s = None if dz_s is None else torch.where(live[:, None], dz_s, 0.0)
        dz_t = None if dz_t is None else torch.where(live[:, None], dz_t, 0.0)
    return None if dz_s is None else dz_s.to(zs.dtype), None if dz_t is None else dz_t.to(zt.dtype)


def _recompute_forward(hs, ws, bs, ht, wt, bt, target, ignore_index: int, kind: str, beta: float, scale_s: float,
                       scale_t: float, ce: bool, mask_divergence: bool, caps: tuple = (None, None)):
    """The divergence rows, the cross-entropy rows (with ``ce``, else None) and the statistics, over
    row chunks of both heads' logits; where ``skips_rows``, of the labelled rows only (the others'
    rows and statistics 0); ``caps``: the heads' softcaps."""
    n, v = hs.shape[0], ws.shape[0]
    work = compute_dtype(hs.dtype)
    out = [torch.empty(n, device=hs.device, dtype=work), torch.empty(n, device=hs.device, dtype=work) if ce else None,
           torch.empty(n, STATS, device=hs.device, dtype=work)]  # the rows, the cross-entropy rows, the statistics
    math_fn = _math_for(hs.device, _stats_math)
    step = recompute_slice(n, v, hs.device, hs.element_size(), 2)  # both heads' logits
    skip = skips_rows(hs, ws, bs, ht, wt, bt, target, mask_divergence)
    idx = None if skip or target is None else _host_rows(target != ignore_index, mask_divergence)
    if idx is not None:  # on CPU: the labelled rows alone, the others' rows and statistics 0
        sub = [t.index_select(0, idx) for t in (hs, ht, target)]
        parts = _recompute_forward(sub[0], ws, bs, sub[1], wt, bt, sub[2], ignore_index, kind, beta, scale_s, scale_t,
                                   ce, mask_divergence, caps)
        return tuple(_scattered(t, idx, n) for t in parts)
    rows_out, ce_out, stats = out
    if skip:  # the labelled rows first; the chunks write these, scattered back at the end
        order, _, counts, (hs, ht, target) = _compact(target != ignore_index, step, hs, ht, target)
        rows_out, ce_out, stats = (None if t is None else torch.empty_like(t) for t in out)
        bufs = [torch.empty(min(n, step), v, dtype=t.dtype, device=t.device) for t in (hs, ht)]
    for i, start in enumerate(range(0, n, step)):
        sl = slice(start, min(n, start + step))
        if skip:
            zs, zt = (b[:sl.stop - sl.start] for b in bufs)
            _bounded_logits(zs, zt, hs[sl], ws, ht[sl], wt, counts[i:i + 1])
        else:
            zs, zt = F.linear(hs[sl], ws, bs), F.linear(ht[sl], wt, bt)
        labelled = None if target is None else (target[sl] != ignore_index)
        rows_out[sl], ce_rows, stats[sl] = math_fn(zs, zt, labelled if mask_divergence else None, kind, beta,
                                                   scale_s, scale_t, target[sl] if ce else None,
                                                   labelled if ce else None, caps)
        del zs, zt
        if ce:
            ce_out[sl] = ce_rows
    if not skip:
        return rows_out, ce_out, stats
    del bufs
    stats.masked_fill_((target == ignore_index)[:, None], 0.0)  # their logits were never computed
    for whole, part in zip(out, (rows_out, ce_out, stats)):
        if whole is not None:
            whole.index_copy_(0, order, part)
    return tuple(out)


def _recompute_grads(grad_div: Tensor, grad_ce: Optional[Tensor], stats: Tensor, hs, ws, bs, ht, wt, bt,
                     target: Optional[Tensor], kind: str, beta: float, scale_s: float, scale_t: float, needs,
                     caps: tuple = (None, None)) -> list:
    """The gradients ``needs`` asks for (hs, ws, bs, ht, wt, bt; None elsewhere), over column chunks
    of the vocabulary: each chunk's weight (and bias) gradient rows are whole (one GEMM over every
    row, rounded once); the hidden states' sum over the chunks in fp32. ``caps``: the heads' softcaps."""
    n, v = hs.shape[0], ws.shape[0]
    work = compute_dtype(hs.dtype)
    heads = ((hs, ws, bs), (ht, wt, bt))
    grads = [None] * 6
    for first, (h, w, b) in zip((0, 3), heads):
        if needs[first]:
            grads[first] = torch.zeros(h.shape, device=h.device, dtype=work)
        if needs[first + 1]:
            grads[first + 1] = torch.zeros_like(w) if n == 0 else torch.empty_like(w)
        if needs[first + 2] and b is not None:
            grads[first + 2] = torch.zeros_like(b) if n == 0 else torch.empty_like(b)
    grad_s, grad_t = any(needs[:3]), any(needs[3:])
    math_fn = _math_for(hs.device, _recompute_math)
    step = recompute_slice(v, n, hs.device, hs.element_size(), 3) if n else v  # both heads' logits and dz
    # the rows with an incoming gradient first, every GEMM stopping at their count: a frozen teacher's
    # backward under skips_rows (the forward's condition, the mask read from the gradients)
    skip = n > 0 and not grad_t and skips_rows(hs, ws, bs, ht, wt, bt, target, True)
    has_grad = None  # the rows with an incoming gradient: where skipping on the GPU, or on CPU
    if n and (skip or hs.device.type == "cpu"):
        has_grad = grad_div != 0 if grad_ce is None else (grad_div != 0) | (grad_ce != 0)
    idx = None if skip or has_grad is None else _host_rows(has_grad)
    if idx is not None:  # on CPU: the rows with an incoming gradient alone, the others' hidden gradients 0
        sub = [None if t is None else t.index_select(0, idx) for t in (grad_div, grad_ce, stats, hs, ht, target)]
        grads = _recompute_grads(sub[0], sub[1], sub[2], sub[3], ws, bs, sub[4], wt, bt, sub[5], kind, beta, scale_s,
                                 scale_t, needs, caps)
        for i in (0, 3):
            grads[i] = _scattered(grads[i], idx, n)
        return grads
    live = None
    if skip:
        order, count, _, (hs, ht, stats, grad_div, grad_ce, target) = _compact(
            has_grad, n, hs, ht, stats, grad_div, grad_ce, target)
        live = torch.arange(n, device=hs.device) < count
        bufs = [torch.empty(n, min(v, step), dtype=t.dtype, device=t.device) for t in (hs, ht)]
    for start in range(0, v if n else 0, step):
        cols = slice(start, min(v, start + step))
        if skip:
            zs, zt = (b[:, :cols.stop - cols.start] for b in bufs)
            _bounded_logits(zs, zt, hs, ws[cols], ht, wt[cols], count)
        else:
            zs = F.linear(hs, ws[cols], None if bs is None else bs[cols])
            zt = F.linear(ht, wt[cols], None if bt is None else bt[cols])
        col = None if grad_ce is None else target - start
        dzs = math_fn(zs, zt, stats, grad_div, grad_ce, col, kind, beta, scale_s, scale_t, grad_s, grad_t, live, caps)
        del zs, zt
        for dz, (h, w, _), first in zip(dzs, heads, (0, 3)):
            if dz is None:
                continue
            if skip:  # the student's only (a frozen teacher); rows past the count are 0 in dz
                if grads[0] is not None:
                    compaction.rows_mm(grads[0], dz, ws[cols], count, out_rows=order, bound="m", accumulate=True)
                if grads[1] is not None:
                    compaction.rows_mm(grads[1][cols], dz, hs, count, bound="k", trans_a=True)
                continue
            if grads[first] is not None:
                _acc_mm(grads[first], dz, w[cols])
            if grads[first + 1] is not None:
                torch.mm(dz.t(), h, out=grads[first + 1][cols])
            if grads[first + 2] is not None:
                grads[first + 2][cols] = dz.sum(0, dtype=work)
    for i in (0, 3):
        if grads[i] is not None:
            grads[i] = grads[i].to(heads[i // 3][0].dtype)
    return grads


def _valid(target: Optional[Tensor], ignore_index: int, n: int, device) -> Tensor:
    return torch.ones(n, dtype=torch.bool, device=device) if target is None else target != ignore_index


def _masks(target: Optional[Tensor], ignore_index: int, n: int, device, mask_divergence: bool):
    """(the labelled rows, the rows whose divergence counts): every row's without a target or
    without ``mask_divergence``."""
    labelled = _valid(target, ignore_index, n, device)
    return labelled, labelled if mask_divergence else _valid(None, ignore_index, n, device)


def _row_weights(valid: Tensor, reduction: str, dtype: torch.dtype) -> Tensor:
    """d(reduced loss) / d(row): ``options.reduction_weights``, and 1 / N on every row for ``batchmean``."""
    if reduction == "batchmean":
        return torch.full(valid.shape, 1.0 / max(valid.shape[0], 1), dtype=dtype, device=valid.device)
    return options.reduction_weights(valid, reduction, dtype)


def _row_grads(labelled: Tensor, valid: Tensor, reduction: str, dtype: torch.dtype, soft_weight: float,
               hard_weight: float):
    """The reduced loss's gradient with respect to each divergence row (0 where not ``valid``) and
    each cross-entropy row (the mean over the labelled rows; None without one)."""
    row_grad = torch.where(valid, _row_weights(valid, reduction, dtype) * soft_weight, 0.0)
    ce_grad = options.reduction_weights(labelled, "mean", dtype) * hard_weight if hard_weight != 0.0 else None
    return row_grad, ce_grad


def _reduced_loss(rows: Tensor, ce_rows: Optional[Tensor], labelled: Tensor, valid: Tensor, reduction: str,
                  soft_weight: float, hard_weight: float) -> Tensor:
    """soft_weight · the reduced divergence (+ hard_weight · the mean cross-entropy)."""
    if reduction == "batchmean":
        loss = rows.sum() / max(rows.shape[0], 1)
    else:
        loss = options.reduced(rows.sum(), valid, reduction)
    loss = loss * soft_weight
    return loss if ce_rows is None else loss + options.reduced(ce_rows.sum(), labelled, "mean") * hard_weight


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
                       softcap_s: Optional[float] = None, softcap_t: Optional[float] = None,
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    _check_weights(target, soft_weight, hard_weight, softcap_s, softcap_t)
    ce = hard_weight != 0.0
    mixing = dict(ce=ce, mask_divergence=mask_divergence, store_budget=store_budget, caps=(softcap_s, softcap_t))
    if reduction == "none":
        rows, ce_rows, _ = _chunks(hs, ws, bs, ht, wt, bt, target, ignore_index, kind, beta, scale_s, scale_t, None,
                                   needs, **mixing)
        return (_mixed(rows, ce_rows, soft_weight, hard_weight), *(_empty(t, hs) for t in (hs, ws, bs, ht, wt, bt)))
    # the reduced loss: the gradient of each row is known now
    labelled, valid = _masks(target, ignore_index, hs.shape[0], hs.device, mask_divergence)
    row_grad, ce_grad = _row_grads(labelled, valid, reduction, compute_dtype(hs.dtype), soft_weight, hard_weight)
    rows, ce_rows, grads = _chunks(hs, ws, bs, ht, wt, bt, target, ignore_index, kind, beta, scale_s, scale_t,
                                   row_grad, needs, ce_grad=ce_grad, **mixing)
    loss = _reduced_loss(rows, ce_rows, labelled, valid, reduction, soft_weight, hard_weight)
    return (loss, *(g if g is not None else _empty(t, hs) for g, t in zip(grads, (hs, ws, bs, ht, wt, bt))))


def _check_weights(target: Optional[Tensor], soft_weight: float, hard_weight: float,
                   softcap_s: Optional[float] = None, softcap_t: Optional[float] = None) -> None:
    if hard_weight != 0.0 and target is None:
        raise ValueError("a hard-label cross-entropy (hard_weight != 0) needs the target")
    for name, x in (("soft_weight", soft_weight), ("hard_weight", hard_weight)):
        if not options.finite(x):
            raise ValueError(f"{name} must be finite, got {x}")
    for name, cap in (("softcap_s", softcap_s), ("softcap_t", softcap_t)):
        if cap is not None and not (options.finite(cap) and cap > 0):
            raise ValueError(f"{name} must be None or a finite number > 0, got {cap}")


def _mixed(rows: Tensor, ce_rows: Optional[Tensor], soft_weight: float, hard_weight: float) -> Tensor:
    """Per row: soft_weight · divergence + hard_weight · cross-entropy."""
    rows = rows * soft_weight if soft_weight != 1.0 else rows
    return rows if ce_rows is None else rows + ce_rows * hard_weight


@linear_distill_fwd.register_fake
def _(hs, ws, bs, ht, wt, bt, target, ignore_index, kind, beta, scale_s, scale_t, reduction, needs, soft_weight=1.0,
      hard_weight=0.0, mask_divergence=True, store_budget="", softcap_s=None, softcap_t=None):
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
                       softcap_s: Optional[float] = None, softcap_t: Optional[float] = None,
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    g = grad_rows.to(compute_dtype(hs.dtype))
    ce = hard_weight != 0.0
    _, _, grads = _chunks(hs, ws, bs, ht, wt, bt, target, ignore_index, kind, beta, scale_s, scale_t,
                          g * soft_weight, needs, ce=ce, ce_grad=g * hard_weight if ce else None,
                          mask_divergence=mask_divergence, store_budget=store_budget, caps=(softcap_s, softcap_t))
    return tuple(g if g is not None else _empty(t, hs) for g, t in zip(grads, (hs, ws, bs, ht, wt, bt)))


@linear_distill_bwd.register_fake
def _(grad_rows, hs, ws, bs, ht, wt, bt, target, ignore_index, kind, beta, scale_s, scale_t, needs, soft_weight=1.0,
      hard_weight=0.0, mask_divergence=True, store_budget="", softcap_s=None, softcap_t=None):
    return _fake_grads((hs, ws, bs, ht, wt, bt), needs)


def _fake_grads(inputs, needs) -> tuple:
    """A backward's gradients as fakes: each needed one shaped as its input, the others empty."""
    hs = inputs[0]
    return tuple(t.new_empty(t.shape) if (need and t is not None) else (t if t is not None else hs).new_empty(0)
                 for t, need in zip(inputs, needs))


def _keep_options(ctx, inputs, defaults: tuple) -> None:
    """The forward op's non-tensor arguments on ``ctx``: ``options`` (ignore_index, kind, beta,
    scale_s, scale_t, needs), ``reduction``, ``weights`` (the trailing arguments, ``defaults`` where
    not given) and ``n_inputs``."""
    ignore_index, kind, beta, scale_s, scale_t, reduction, needs, *weights = inputs[7:]
    ctx.options = (ignore_index, kind, beta, scale_s, scale_t, list(needs))
    ctx.reduction = reduction
    ctx.weights = (*weights, *defaults[len(weights):])
    ctx.n_inputs = len(inputs)


def _setup_context(ctx, inputs, output):
    # (soft_weight, hard_weight, mask_divergence, store_budget, softcap_s, softcap_t), the defaults where not given
    _keep_options(ctx, inputs, (1.0, 0.0, True, "", None, None))
    if ctx.reduction == "none":
        ctx.save_for_backward(*inputs[:7])
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
        grads = [g * grad_loss.to(g.dtype) if _present(g) else g for g in saved]
    out = [g if (need and _present(g)) else None for g, need in zip(grads, needs)]
    return (*out, *(None,) * (ctx.n_inputs - 6))


def _present(g: Tensor) -> bool:
    """A gradient the forward formed, not its empty stand-in; without guarding on a row count that is
    data-dependent (hidden states indexed by a boolean mask: an unbacked size, which is not 0)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return not statically_known_true(g.numel() == 0)


linear_distill_fwd.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("inductor_xent::linear_distill_recompute_fwd", mutates_args=())
@_without_autocast
def linear_distill_recompute_fwd(hs: Tensor, ws: Tensor, bs: Optional[Tensor], ht: Tensor, wt: Tensor,
                                 bt: Optional[Tensor], target: Optional[Tensor], ignore_index: int, kind: str,
                                 beta: float, scale_s: float, scale_t: float, reduction: str, needs: list[bool],
                                 soft_weight: float = 1.0, hard_weight: float = 0.0, mask_divergence: bool = True,
                                 softcap_s: Optional[float] = None, softcap_t: Optional[float] = None,
                                 ) -> tuple[Tensor, Tensor]:
    _check_weights(target, soft_weight, hard_weight, softcap_s, softcap_t)
    rows, ce_rows, stats = _recompute_forward(hs, ws, bs, ht, wt, bt, target, ignore_index, kind, beta, scale_s,
                                              scale_t, hard_weight != 0.0, mask_divergence, (softcap_s, softcap_t))
    if reduction == "none":
        return _mixed(rows, ce_rows, soft_weight, hard_weight), stats
    labelled, valid = _masks(target, ignore_index, hs.shape[0], hs.device, mask_divergence)
    return _reduced_loss(rows, ce_rows, labelled, valid, reduction, soft_weight, hard_weight), stats


@linear_distill_recompute_fwd.register_fake
def _(hs, ws, bs, ht, wt, bt, target, ignore_index, kind, beta, scale_s, scale_t, reduction, needs, soft_weight=1.0,
      hard_weight=0.0, mask_divergence=True, softcap_s=None, softcap_t=None):
    dt = compute_dtype(hs.dtype)
    return (hs.new_empty(hs.shape[:1] if reduction == "none" else (), dtype=dt),
            hs.new_empty((hs.shape[0], STATS), dtype=dt))


@torch.library.custom_op("inductor_xent::linear_distill_recompute_bwd", mutates_args=())
@_without_autocast
def linear_distill_recompute_bwd(grad_div: Tensor, grad_ce: Optional[Tensor], stats: Tensor, hs: Tensor, ws: Tensor,
                                 bs: Optional[Tensor], ht: Tensor, wt: Tensor, bt: Optional[Tensor],
                                 target: Optional[Tensor], kind: str, beta: float, scale_s: float, scale_t: float,
                                 needs: list[bool], softcap_s: Optional[float] = None,
                                 softcap_t: Optional[float] = None,
                                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    grads = _recompute_grads(grad_div, grad_ce, stats, hs, ws, bs, ht, wt, bt, target, kind, beta, scale_s, scale_t,
                             needs, (softcap_s, softcap_t))
    return tuple(g if g is not None else _empty(t, hs) for g, t in zip(grads, (hs, ws, bs, ht, wt, bt)))


@linear_distill_recompute_bwd.register_fake
def _(grad_div, grad_ce, stats, hs, ws, bs, ht, wt, bt, target, kind, beta, scale_s, scale_t, needs, softcap_s=None,
      softcap_t=None):
    return _fake_grads((hs, ws, bs, ht, wt, bt), needs)


def _recompute_setup_context(ctx, inputs, output):
    _keep_options(ctx, inputs, (1.0, 0.0, True, None, None))
    ctx.save_for_backward(*inputs[:7], output[1])


def _recompute_backward(ctx, grad_loss, _grad_stats):
    ignore_index, kind, beta, scale_s, scale_t, needs = ctx.options
    reduction = ctx.reduction
    soft_weight, hard_weight, mask_divergence, *caps = ctx.weights
    hs, ws, bs, ht, wt, bt, target, stats = ctx.saved_tensors
    work = compute_dtype(hs.dtype)
    labelled, valid = _masks(target, ignore_index, hs.shape[0], hs.device, mask_divergence)
    g = grad_loss.to(work)
    if reduction == "none":  # the rows are soft · divergence + hard · cross-entropy
        grad_div = torch.where(valid, g * soft_weight, 0.0)
        grad_ce = torch.where(labelled, g * hard_weight, 0.0) if hard_weight != 0.0 else None
    else:
        row_grad, ce_grad = _row_grads(labelled, valid, reduction, work, soft_weight, hard_weight)
        grad_div, grad_ce = row_grad * g, None if ce_grad is None else ce_grad * g
    grads = linear_distill_recompute_bwd(grad_div, grad_ce, stats, hs, ws, bs, ht, wt, bt, target, kind, beta,
                                         scale_s, scale_t, needs, *caps)
    out = [gr if (need and _present(gr)) else None for gr, need in zip(grads, needs)]
    return (*out, *(None,) * (ctx.n_inputs - 6))


linear_distill_recompute_fwd.register_autograd(_recompute_backward, setup_context=_recompute_setup_context)


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
    student_softcap: Optional[float] = None,
    teacher_softcap: Optional[float] = None,
) -> Tensor:
    """The divergence between a student and a teacher lm_head (module docstring), without the
    ``[N, V]`` logits of either (on CUDA one ``[N, V]`` tensor of the student's gradient logits
    instead, within ``store_budget``: ``keeps_dz``), times ``soft_weight``; with ``hard_weight`` plus that times the
    student's hard-label cross-entropy ``F.cross_entropy(student_logits, target,
    ignore_index=ignore_index)`` (its raw logits, capped by ``student_softcap``, no temperature; the mean
    over the labelled rows,
    per row for ``reduction="none"``), computed in the same pass over the student's logits (Hinton's
    ``α·CE + (1 − α)·T²·KD``: ``hard_weight=α, soft_weight=(1 − α)·T**2``). Equal, up to rounding, to::

        s = F.linear(student_hidden, student_weight, student_bias).float() / temperature
        t = F.linear(teacher_hidden, teacher_weight, teacher_bias).float() / temperature
        # with student_softcap c (teacher_softcap alike): s = c * torch.tanh(F.linear(...).float() / c) / temperature
        rows = F.kl_div(s.log_softmax(-1), t.log_softmax(-1), log_target=True, reduction="none").sum(-1)
        # (forward_kl; soft_ce: -(t.softmax(-1) * s.log_softmax(-1)).sum(-1); 0 where target ==
        # ignore_index), then reduced by ``reduction``

    ``*_hidden`` are ``[..., D]`` with the same leading shape (``target`` too, when given); a head's
    hidden, weight and bias in one dtype, or inside ``torch.autocast``, which casts them as it casts
    ``F.linear``'s (fp32 master weights then get fp32 gradients through the casts). The
    teacher gets gradients where its tensors require them (call it on ``.detach()``-ed tensors, or
    under ``torch.no_grad()`` for the teacher's forward, to train the student only).
    ``store_budget`` (bytes, ``"2GiB"``, or a fraction of the logits, ``"0.5x"``; default
    ``INDUCTOR_XENT_STORE_BUDGET``, else ``"1x"``): how large the kept gradient logits may be; a
    smaller nonzero budget keeps none (the chunks then add into an fp32 ``[V, Ds]`` weight-gradient
    accumulator); ``0`` (or ``INDUCTOR_XENT_STRATEGY=recompute``) keeps only per-row statistics and
    recomputes both heads in the backward over vocabulary chunks: the least memory (an fp32 ``[N, D]``
    per trained head and one chunk), both heads' GEMMs twice. ``student_softcap`` / ``teacher_softcap``
    cap that head's logits, ``c·tanh(z/c)``, before the temperature (Gemma 2's
    ``final_logit_softcapping``, as its model's ``logits`` are capped); the hard-label cross-entropy
    reads the student's capped logits, as Gemma 2's loss does."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    for name, x in (("soft_weight", soft_weight), ("hard_weight", hard_weight)):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not options.finite(x):
            raise ValueError(f"{name} must be a finite number, got {x!r}")
    if hard_weight != 0 and target is None:
        raise ValueError("hard_weight needs the target (the hard labels)")
    if kind == "jsd" and not 0.0 < beta < 1.0:
        raise ValueError(f"jsd needs 0 < beta < 1 (beta 0 is forward_kl, 1 reverse_kl), got {beta}")
    options.check_temperature(temperature)
    for name, cap in (("student_softcap", student_softcap), ("teacher_softcap", teacher_softcap)):
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float))
                                or not (options.finite(cap) and cap > 0)):
            raise ValueError(f"{name} must be None or a finite number > 0, got {cap!r}")
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
    options.check_head_dtypes(student_hidden, student_weight, student_bias, "student")
    options.check_head_dtypes(teacher_hidden, teacher_weight, teacher_bias, "teacher")
    hs, ht = student_hidden.reshape(-1, student_hidden.shape[-1]), teacher_hidden.reshape(-1, teacher_hidden.shape[-1])
    t1 = None if target is None else target.reshape(-1)
    needs = [bool(x is not None and x.requires_grad and torch.is_grad_enabled())
             for x in (hs, student_weight, student_bias, ht, teacher_weight, teacher_bias)]
    budget = "" if store_budget is None else str(store_budget)
    args = (hs, student_weight, student_bias, ht, teacher_weight, teacher_bias, t1, ignore_index, kind, float(beta),
            1.0 / temperature, 1.0 / temperature, reduction, needs, float(soft_weight), float(hard_weight), True)
    caps = {} if student_softcap is None and teacher_softcap is None else dict(
        softcap_s=None if student_softcap is None else float(student_softcap),
        softcap_t=None if teacher_softcap is None else float(teacher_softcap))
    out = (linear_distill_recompute_fwd(*args, **caps) if recomputes(needs, budget) else
           linear_distill_fwd(*args, budget, **caps))[0]
    return out.reshape(lead) if reduction == "none" else out
