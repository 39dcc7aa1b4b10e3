"""The ``store`` strategy's dlogits kernel: the softmax gradient from the stored exp-logits.

Per row chunk the store strategy runs (launch.store):

1. ``lce_fwd_kernel`` in store mode, one vocabulary tile per program: the per-(row, tile) partials
   (tile max ``m_t``, sum-exp, target logit, Σz, the target's sech²) and the tile
   ``E = exp(z − m_t)`` (times sech² of the capped argument under a softcap), fp16 for bf16/fp16
   inputs (E ∈ (0, 1]: fp16 keeps 11 bits where bf16 keeps 8), fp32 for fp32 inputs;
2. ``lce_combine_kernel``: loss, lse, lse_lo per row;
3. ``lce_store_dz_kernel`` (this file), in place over E: with ``r = exp((m_t − lse) − lse_lo)`` the
   softmax is ``p = E·r`` and

       oh = (1 − ε)·onehot(t)·sech²(x_t) + ε/V       (ε/V only without a softcap; 0 on ignored rows)
       dz = ((g + c)·(E·r − oh) + c·oh) · logit_scale,   c = 2·z_loss·lse·g

   written in the input dtype over E (same size), plus per-row-block column sums for grad_bias;
4. cuBLAS: grad_hidden[chunk] = dz·W (one GEMM, complete for these rows) and
   grad_weight += dzᵀ·h (fp32 accumulate inside the GEMM).

2·N·D·V FLOPs per GEMM, three GEMMs: 6·N·D·V in all. The E tile is written from registers that
the forward computes anyway (it is the online logsumexp's exp), so the forward costs what the
recompute strategy's forward costs plus one [N, V] store in 16 bits.

**Folded** (no label smoothing, no z-loss, no bias gradient; fp32, or bf16 in one row chunk:
launch.folds says why): steps 3 and 4 become

3. ``E`` is written relative to one reference per row, ``R* = max(ref, M − E_CLAMP)`` with ``ref``
   the target's logit (computed before the forward) and ``M`` the row max, so that the softmax is
   ``p = E·exp(R* − lse)`` for every column (E ≤ exp(E_CLAMP): no overflow). The kernel writes each
   tile relative to ``max(ref, m_t − E_CLAMP)``; the rows where this differs between tiles (a
   loss over E_CLAMP) are rescaled in place by ``lce_store_fold_kernel``, which also writes each
   target column as ``dz_t / scale``, so that ``dz = scale·E`` holds on every column and
   ``p_t − 1`` is taken in fp32, not after the GEMM (no cancellation);
4. cuBLAS on E as it is: grad_hidden[chunk] = scale·(E·W) (fp32 output, scaled, rounded once) and
   grad_weight += Eᵀ·(scale·h).

No pass over [N, V] between the forward and the GEMMs (the dz kernel reads and writes 4 bytes per
logit: ~1 ms at 8192 × 128256).

A softcap with label smoothing is not offered (strategy.py): the ε/V term needs sech² of every
column, and E underflows (to 0) for columns far below the tile max, which loses their z.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import LOG2E, add_combine, cdiv, grouped_pid, max_combine

# The folded path's E is at most exp(E_CLAMP) (exp(40) ~ 2e17: E·W sums over V stay far from the
# fp32/bf16 range, and scale ≥ g·exp(−E_CLAMP − log V) stays normal); a row whose loss exceeds it
# is rescaled in place (lce_store_fold_kernel), so any loss is exact, only such rows cost a pass.
E_CLAMP = 40.0


@triton.jit
def lce_store_dz_kernel(
    # pointers: e (input, [N, V] exp-logits) and dz (output, the same memory in the input dtype)
    e_ptr, dz_ptr, part_ptr, target_ptr, lse_ptr, lse_lo_ptr, st_ptr, grad_ptr, dbias_ptr,
    # sizes
    N, V,
    # strides
    stride_e_n, stride_dz_n, stride_db_m,
    # loss options (hit_coef = (1 − ε) + ε/V and rest_coef = ε/V, computed in double on the host)
    ignore_index, hit_coef, rest_coef, label_smoothing, logit_scale, z_loss,
    # meta-parameters
    HAS_SOFTCAP: tl.constexpr, NEED_DBIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile; BLOCK_N is the forward's tile, so the tile's max is part[0]."""
    num_tiles = cdiv(V, BLOCK_N)
    pid_m, pid_n = grouped_pid(tl.program_id(0), cdiv(N, BLOCK_M), num_tiles, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = offs_m < N
    rows = tl.minimum(offs_m, N - 1).to(tl.int64)
    offs_v = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = offs_v < V
    live = row_mask[:, None] & col_mask[None, :]

    tgt = tl.load(target_ptr + rows)
    lse = tl.load(lse_ptr + rows)
    lse_lo = tl.load(lse_lo_ptr + rows)
    m_t = tl.load(part_ptr + pid_n.to(tl.int64) * N + rows)
    g = tl.where(tgt != ignore_index, tl.load(grad_ptr + rows), 0.0)
    c = 2.0 * z_loss * lse * g
    r = tl.exp2(((m_t - lse) - lse_lo) * LOG2E)

    e = tl.load(e_ptr + rows[:, None] * stride_e_n + offs_v[None, :], mask=live, other=0.0).to(tl.float32)
    valid = tgt != ignore_index
    hit = (offs_v[None, :] == tgt[:, None]) & valid[:, None]
    if HAS_SOFTCAP:  # no smoothing here (strategy.py): the target's coefficient times its sech²
        st = tl.load(st_ptr + rows)
        oh = tl.where(hit, ((1.0 - label_smoothing) * st)[:, None], 0.0)
    else:
        oh = tl.where(hit, hit_coef, rest_coef)
        oh = tl.where(valid[:, None], oh, 0.0)
    dz = ((g + c)[:, None] * (e * r[:, None] - oh) + c[:, None] * oh) * logit_scale
    dz = tl.where(live, dz, 0.0)
    tl.store(dz_ptr + rows[:, None] * stride_dz_n + offs_v[None, :], dz.to(dz_ptr.dtype.element_ty), mask=live)
    if NEED_DBIAS:
        tl.store(dbias_ptr + pid_m.to(tl.int64) * stride_db_m + offs_v, tl.reduce(dz, 0, add_combine),
                 mask=col_mask)


@triton.jit
def lce_store_fold_kernel(
    # pointers: e ([N, V], rewritten in place), the forward's partials (plane 0: each tile's row max)
    e_ptr, part_ptr, target_ptr, ref_ptr, r_star_ptr, e_target_ptr,
    # sizes
    N, V,
    # strides
    stride_e_n,
    # options
    ignore_index, e_clamp,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of E (BLOCK_N: the forward's tile): the rows whose tiles were
    written relative to different references are brought to R* (a factor <= 1), then the targets
    that fall in this tile get their column value. Most programs only read 3·BLOCK_M numbers."""
    pid_m = tl.program_id(0) // cdiv(V, BLOCK_N)
    pid_n = tl.program_id(0) % cdiv(V, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = offs_m < N
    rows = tl.minimum(offs_m, N - 1).to(tl.int64)
    tgt = tl.load(target_ptr + rows)
    valid = (tgt != ignore_index) & row_mask
    ref = tl.load(ref_ptr + rows)
    r_star = tl.load(r_star_ptr + rows)
    v0 = pid_n * BLOCK_N
    rescale = valid & (r_star > ref)
    if tl.reduce(rescale.to(tl.int32), 0, max_combine) > 0:
        offs_v = v0 + tl.arange(0, BLOCK_N)
        r_t = tl.maximum(ref, tl.load(part_ptr + pid_n.to(tl.int64) * N + rows) - e_clamp)
        f = tl.exp2((r_t - r_star) * LOG2E)
        at = e_ptr + rows[:, None] * stride_e_n + offs_v[None, :]
        live = rescale[:, None] & (offs_v[None, :] < V)
        e = tl.load(at, mask=live, other=0.0).to(tl.float32)
        tl.store(at, (e * f[:, None]).to(e_ptr.dtype.element_ty), mask=live)
    here = valid & (tgt >= v0) & (tgt < v0 + BLOCK_N)
    if tl.reduce(here.to(tl.int32), 0, max_combine) > 0:
        value = tl.load(e_target_ptr + rows)
        tl.store(e_ptr + rows * stride_e_n + tl.where(here, tgt, 0), value.to(e_ptr.dtype.element_ty), mask=here)
