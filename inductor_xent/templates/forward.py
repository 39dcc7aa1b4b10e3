"""Forward kernels: the loss and logsumexp of every row without writing the ``[N, V]`` logits.

For a row block of ``hidden`` (N, D) and a vocabulary range, a program computes the logit tiles
``z = epilogue(hidden @ weight[v:v+BN].T)`` with ``tl.dot`` into an fp32 accumulator and folds each
tile into four per-row running values, all in registers:

    m    running max of z                   s  = sum exp(z - m)   (online logsumexp)
    zt   the target's logit (0 if the target is not in this range)
    sz   sum of z (only with label smoothing)

Those four are written per (row, vocabulary split) to a ``[4, S, N]`` fp32 buffer and a tiny combine
kernel reduces the S splits in a fixed order (deterministic; no atomics):

    lse  = M + log(sum_s s_s * exp(m_s - M)),  M = max_s m_s
    loss = lse - (1 - eps) * zt - eps * sz / V + z_loss * lse^2       (0 where target == ignore)

FLOPs: 2·N·D·V in the matmul, ~10 per logit in the epilogue. Memory written: 16·S·N + 8·N bytes.
The epilogue is ``z = softcap * tanh((acc + bias) * logit_scale / softcap)``; tanh is written with
exp (no libdevice, so the interpreter runs it).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
# Running max before any column is seen: finite, so that exp(m_old - m_new) of an empty split is
# exp(0) * 0 rather than exp(-inf + inf) = NaN; far below any logit a float32 can make useful.
M_INIT = tl.constexpr(-1.0e30)
# DOT_UPCAST (a constexpr of every matmul kernel) is True only under TRITON_INTERPRET=1: Triton
# 3.6's interpreter multiplies the raw uint16 storage of bf16 operands in tl.dot (a 16x16 bf16 dot
# came out 2.7e10 off), so there the operands go to fp32 first. A bf16 x bf16 product is exact in
# fp32, so this is the same math as the tensor cores up to the order of the sum.


# ---------------------------------------------------------------------------------------------
# helpers shared with backward.py
#
# The kernels use only Triton builtins and these helpers, never triton.language.standard's
# jit functions (tl.cdiv, tl.sum, tl.max, tl.zeros): those are created when triton.language is
# first imported, so a process that imported triton before setting TRITON_INTERPRET=1 (a test
# session where torch._inductor loaded first) would hold compiled-mode versions that the
# interpreter refuses to call. tl.reduce with our own combine functions generates the same code.
# ---------------------------------------------------------------------------------------------
@triton.jit
def add_combine(a, b):
    return a + b


@triton.jit
def max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def cdiv(a, b):
    return (a + b - 1) // b


@triton.jit
def tanh_via_exp(x):
    """tanh(x) = 1 - 2 / (exp(2x) + 1); exp overflowing to inf gives exactly +-1."""
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def grouped_pid(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Map a linear program id to (row block, column block) so that consecutive programs share
    column blocks (the W tiles) across GROUP_M row blocks: W is read from DRAM num_pid_m/GROUP_M
    times instead of num_pid_m times, and a group's hidden blocks stay in L2."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def logits_tile(
    h_ptrs, w_ptrs, D, stride_h_d, stride_w_d, offs_k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    """acc[BLOCK_M, BLOCK_N] = hidden_rows @ weight_cols.T over the whole D, fp32 accumulate.
    ``h_ptrs`` is [BLOCK_M, BLOCK_K], ``w_ptrs`` [BLOCK_K, BLOCK_N], both at k = 0; rows and
    columns were clamped in bounds by the caller, so only the D tail needs a mask."""
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for k in tl.range(0, D, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            a = tl.load(h_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_mask = offs_k < D - k
            a = tl.load(h_ptrs, mask=k_mask[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
        if DOT_UPCAST:  # see DOT_UPCAST below
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        h_ptrs += BLOCK_K * stride_h_d
        w_ptrs += BLOCK_K * stride_w_d
    return acc


@triton.jit
def logits_tile_tma(h_desc, w_desc, off_m, off_v, D,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    INPUT_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """logits_tile through TMA descriptors (Hopper's bulk tensor copies): rows, columns and the D
    tail out of bounds read as zeros, and no address arithmetic is held in registers."""
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for k in tl.range(0, D, BLOCK_K, num_stages=NUM_STAGES):
        a = h_desc.load([off_m, k])
        b = w_desc.load([off_v, k])
        if DOT_UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b.T, acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit
def apply_epilogue(acc, bias_ptr, offs_v, col_mask, logit_scale, softcap,
                   HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """(z, tanh) with z = softcap * tanh((acc + bias) * logit_scale / softcap); tanh is the
    capped fraction (needed by the backward's chain rule), z itself when there is no cap."""
    z = acc
    if HAS_BIAS:
        b = tl.load(bias_ptr + offs_v, mask=col_mask, other=0.0).to(tl.float32)
        z = z + b[None, :]
    z = z * logit_scale
    t = z
    if HAS_SOFTCAP:
        t = tanh_via_exp(z / softcap)
        z = softcap * t
    return z, t


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@triton.jit
def lce_fwd_kernel(
    # pointers
    hidden_ptr, weight_ptr, bias_ptr, target_ptr, part_ptr,
    # sizes
    N, V, D, tiles_per_split, num_splits,
    # strides
    stride_h_n, stride_h_d, stride_w_v, stride_w_d,
    # loss options
    logit_scale, softcap,
    # meta-parameters
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, NEED_SUM_Z: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
    FLATTEN: tl.constexpr, DOT_UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
):
    """One (row block, vocabulary split): partials m, s, zt, sz into part[4, num_splits, N].
    With USE_TMA, hidden_ptr and weight_ptr are TMA descriptors of [BLOCK_M, BLOCK_K] and
    [BLOCK_N, BLOCK_K] blocks (row-major, 16-byte aligned operands; the launcher decides)."""
    pid_m, pid_s = grouped_pid(tl.program_id(0), cdiv(N, BLOCK_M), num_splits, GROUP_M)

    # ---- rows: clamp out-of-range rows onto row N-1 so loads need no row mask -----------------
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = offs_m < N
    rows = tl.minimum(offs_m, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    if not USE_TMA:
        h_base = hidden_ptr + rows[:, None] * stride_h_n + offs_k[None, :] * stride_h_d
    tgt = tl.load(target_ptr + rows)

    m_i = tl.full((BLOCK_M,), M_INIT, dtype=tl.float32)
    s_i = tl.full((BLOCK_M,), 0.0, dtype=tl.float32)
    zt_i = tl.full((BLOCK_M,), 0.0, dtype=tl.float32)
    sz_i = tl.full((BLOCK_M,), 0.0, dtype=tl.float32)

    # ---- walk this split's vocabulary tiles ---------------------------------------------------
    v_begin = pid_s * tiles_per_split * BLOCK_N
    v_end = tl.minimum(v_begin + tiles_per_split * BLOCK_N, V)
    for v0 in tl.range(v_begin, v_end, BLOCK_N, flatten=FLATTEN):
        offs_v = v0 + tl.arange(0, BLOCK_N)
        col_mask = offs_v < V
        if USE_TMA:
            acc = logits_tile_tma(hidden_ptr, weight_ptr, pid_m * BLOCK_M, v0, D,
                                  BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION, NUM_STAGES, DOT_UPCAST)
        else:
            cols = tl.minimum(offs_v, V - 1).to(tl.int64)
            w_ptrs = weight_ptr + cols[None, :] * stride_w_v + offs_k[:, None] * stride_w_d
            acc = logits_tile(h_base, w_ptrs, D, stride_h_d, stride_w_d, offs_k,
                              BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, INPUT_PRECISION, NUM_STAGES, DOT_UPCAST)
        z, _ = apply_epilogue(acc, bias_ptr, offs_v, col_mask, logit_scale, softcap, HAS_BIAS, HAS_SOFTCAP)

        # ---- target logit, sum of logits, online logsumexp ---------------------------------
        # The reductions that need the unmasked z come first, so that z is dead once it is masked:
        # one [BLOCK_M, BLOCK_N] fp32 tile live instead of two (ptxas, sm_90, 128x256 tile, 8
        # warps: 104 bytes of stack -> 0; on the H200 70 spilled registers -> see NOTES.md).
        hit = (offs_v[None, :] == tgt[:, None]) & col_mask[None, :]
        zt_i += tl.reduce(tl.where(hit, z, 0.0), 1, add_combine)
        if NEED_SUM_Z:
            sz_i += tl.reduce(tl.where(col_mask[None, :], z, 0.0), 1, add_combine)
        z = tl.where(col_mask[None, :], z, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(z, 1, max_combine))
        s_i = s_i * tl.exp2((m_i - m_new) * LOG2E) + tl.reduce(tl.exp2((z - m_new[:, None]) * LOG2E), 1, add_combine)
        m_i = m_new

    # ---- partials ------------------------------------------------------------------------------
    # planes of num_splits * N floats; pointer increments keep the offsets 64-bit
    plane = num_splits * N
    out = part_ptr + pid_s.to(tl.int64) * N + offs_m
    tl.store(out, m_i, mask=row_mask)
    out += plane
    tl.store(out, s_i, mask=row_mask)
    out += plane
    tl.store(out, zt_i, mask=row_mask)
    if NEED_SUM_Z:
        out += plane
        tl.store(out, sz_i, mask=row_mask)


@triton.jit
def lce_combine_kernel(
    # pointers
    part_ptr, target_ptr, loss_ptr, lse_ptr,
    # sizes
    N, V, num_splits,
    # loss options
    ignore_index, label_smoothing, z_loss,
    # meta-parameters
    NEED_SUM_Z: tl.constexpr, BLOCK: tl.constexpr,
):
    """Reduce the splits of BLOCK rows, in split order, into loss and lse."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    plane = num_splits * N
    m = tl.full((BLOCK,), M_INIT, dtype=tl.float32)
    s = tl.full((BLOCK,), 0.0, dtype=tl.float32)
    zt = tl.full((BLOCK,), 0.0, dtype=tl.float32)
    sz = tl.full((BLOCK,), 0.0, dtype=tl.float32)
    p_m = part_ptr + offs  # pointer increments keep the offsets 64-bit
    p_s = p_m + plane
    p_zt = p_s + plane
    p_sz = p_zt + plane
    for _ in range(0, num_splits):
        m_s = tl.load(p_m, mask=mask, other=M_INIT)
        s_s = tl.load(p_s, mask=mask, other=1.0)  # masked lanes: lse = M_INIT, no log(0)
        m_new = tl.maximum(m, m_s)
        s = s * tl.exp2((m - m_new) * LOG2E) + s_s * tl.exp2((m_s - m_new) * LOG2E)
        m = m_new
        zt += tl.load(p_zt, mask=mask, other=0.0)
        if NEED_SUM_Z:
            sz += tl.load(p_sz, mask=mask, other=0.0)
        p_m += N
        p_s += N
        p_zt += N
        p_sz += N
    lse = m + tl.log(s)
    loss = lse - (1.0 - label_smoothing) * zt + z_loss * lse * lse
    if NEED_SUM_Z:
        loss -= label_smoothing * sz / V
    tgt = tl.load(target_ptr + offs, mask=mask, other=ignore_index)
    loss = tl.where(tgt != ignore_index, loss, 0.0)
    tl.store(loss_ptr + offs, loss, mask=mask)
    tl.store(lse_ptr + offs, lse, mask=mask)
