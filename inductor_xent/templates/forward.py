"""Forward kernels: the loss and logsumexp of every row without writing the ``[N, V]`` logits.

For a row block of ``hidden`` (N, D) and a vocabulary range, a program computes the logit tiles
``z = epilogue(hidden @ weight[v:v+BN].T)`` with ``tl.dot`` into an fp32 accumulator and folds each
tile into per-row running values, all in registers:

    m    running max of z                   s  = sum exp(z - m)   (online logsumexp)
    zt   the target's logit (0 if the target is not in this range)
    sz   sum of z (only with label smoothing)
    st   sech² of the target's capped argument (store.lce_store_fwd_kernel with a softcap)
    a    sum exp(z - m)·(z - m)   (only for the entropy: log-probabilities op)
    i    the first column where z == m  (only for the argmax; int32, its own [S, N] buffer)

Those are written per (row, vocabulary split) to a ``[P, S, N]`` fp32 buffer and a tiny combine
kernel reduces the S splits in a fixed order (deterministic; no atomics):

    lse  = M + log(Σ_s s_s·exp(m_s − M)),  M = max_s m_s;   lse_lo = (M − lse) + log(Σ…)
    loss = log(Σ…) + (1 − ε)(M − zt) + ε(M − sz/V) + z_loss·lse²       (0 where target == ignore)
    H    = log S − A/S,  S = Σ_s s_s·exp(m_s − M),  A = Σ_s exp(m_s − M)·(a_s + (m_s − M)·s_s)
    argmax = i of the first split whose m_s is M

The entropy ``H = lse − Σ p·z`` is kept relative to the max, ``Σ p·(z − m) = A/S``: every term of A
is ≤ 0 (no cancellation) and a large common logit (2^24) does not swallow it. A moves with the
running max like s: ``a ← exp(m − m')·(a + (m − m')·s)``. The argmax keeps the first column at the
max: within a tile the smallest index where z equals the tile max, across tiles and splits (in
increasing column order) only a strictly larger max replaces it, as ``torch.argmax`` on ties.

The loss is taken relative to M, not as lse − zt: with every logit at 2^24 the fp32 rounding of lse
swallows the log term (loss 2.0 instead of log 8). ``lse_lo`` is lse's rounding residual; the
backward rebuilds the softmax from ``(z − lse) − lse_lo`` for the same reason.

The store strategy's forward (``store.lce_store_fwd_kernel``, one split per vocabulary tile)
writes the same partials, and the combine below reduces them.

FLOPs: 2·N·D·V in the matmul, ~10 per logit in the epilogue. Memory written: 4·P·S·N + 12·N bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    LOG2E,
    M_INIT,
    add_combine,
    apply_epilogue,
    cdiv,
    grouped_pid,
    max_combine,
    min_combine,
    store_raw_logits,
    target_slot,
    tile_logits,
)


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@triton.jit
def lce_fwd_kernel(
    # pointers
    hidden_ptr, weight_ptr, bias_ptr, target_ptr, part_ptr, arg_ptr, logits_ptr, count_ptr,
    # sizes
    N, V, D, tiles_per_split, num_splits,
    # strides
    stride_h_n, stride_h_d, stride_w_v, stride_w_d, stride_l_n,
    # loss options
    logit_scale, softcap,
    # meta-parameters
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, NEED_SUM_Z: tl.constexpr,
    NEED_ENTROPY: tl.constexpr, NEED_ARGMAX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
    DOT_UPCAST: tl.constexpr, USE_TMA: tl.constexpr, HAS_SCALE: tl.constexpr, EVEN_V: tl.constexpr,
    WRITE_LOGITS: tl.constexpr, HAS_COUNT: tl.constexpr,
):
    """One (row block, vocabulary split): partials m, s, zt[, sz][, a] into part[P, num_splits, N],
    and with NEED_ARGMAX the split's argmax into arg[num_splits, N] (int32); with WRITE_LOGITS each
    raw tile (acc + bias) into logits[N, V] in its dtype (escape.py: the returned logits). With USE_TMA, hidden_ptr and
    weight_ptr are TMA descriptors of [BLOCK_M, BLOCK_K] and [BLOCK_N, BLOCK_K] blocks (row-major,
    16-byte aligned operands; the launcher decides). With HAS_COUNT (count_ptr: a (1,) int32 device
    scalar, the rows compacted first: rows.compact) a row block past the first count rows exits at
    once and writes no partials."""
    pid_m, pid_s = grouped_pid(tl.program_id(0), cdiv(N, BLOCK_M), num_splits, GROUP_M)
    if HAS_COUNT:
        if pid_m * BLOCK_M >= tl.load(count_ptr):
            return

    # ---- rows: clamp out-of-range rows onto row N-1 so loads need no row mask -----------------
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = offs_m < N
    rows = tl.minimum(offs_m, N - 1).to(tl.int64)
    tgt = tl.load(target_ptr + rows)

    m_i = tl.full((BLOCK_M,), M_INIT, dtype=tl.float32)
    s_i = tl.full((BLOCK_M,), 0.0, dtype=tl.float32)
    zt_i = tl.full((BLOCK_M,), 0.0, dtype=tl.float32)
    sz_i = tl.full((BLOCK_M,), 0.0, dtype=tl.float32)
    a_i = tl.full((BLOCK_M,), 0.0, dtype=tl.float32)
    arg_i = tl.full((BLOCK_M,), 0, dtype=tl.int32)

    # ---- walk this split's vocabulary tiles ---------------------------------------------------
    v_begin = pid_s * tiles_per_split * BLOCK_N
    v_end = tl.minimum(v_begin + tiles_per_split * BLOCK_N, V)
    for v0 in range(v_begin, v_end, BLOCK_N):
        offs_v = v0 + tl.arange(0, BLOCK_N)
        col_mask = offs_v < V
        acc = tile_logits(hidden_ptr, weight_ptr, pid_m * BLOCK_M, rows, v0, offs_v, D,
                          stride_h_n, stride_h_d, stride_w_v, stride_w_d, V,
                          BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, INPUT_PRECISION, NUM_STAGES, DOT_UPCAST, USE_TMA)
        if WRITE_LOGITS:
            store_raw_logits(logits_ptr, acc, bias_ptr, rows, offs_v, row_mask, col_mask, stride_l_n, HAS_BIAS,
                             False)
        z, _ = apply_epilogue(acc, bias_ptr, offs_v, col_mask, logit_scale, softcap, HAS_BIAS, HAS_SOFTCAP,
                              HAS_SCALE)

        # ---- target logit, sum of logits, online logsumexp ---------------------------------
        # The reductions that need the unmasked z come first, so that z is dead once it is masked:
        # one [BLOCK_M, BLOCK_N] fp32 tile live instead of two (ptxas, sm_90, 128x256 tile, 8
        # warps: 104 bytes of stack -> 0; on the H200 70 spilled registers -> see NOTES.md).
        hit = tl.arange(0, BLOCK_N)[None, :] == target_slot(tgt, v0, V, tgt == tgt, BLOCK_N)[:, None]
        zt_i += tl.reduce(tl.where(hit, z, 0.0), 1, add_combine)
        if NEED_SUM_Z:
            sz_i += tl.reduce(tl.where(col_mask[None, :], z, 0.0), 1, add_combine)
        if not EVEN_V:
            z = tl.where(col_mask[None, :], z, float("-inf"))
        tile_max = tl.reduce(z, 1, max_combine)
        m_new = tl.maximum(m_i, tile_max)
        if NEED_ARGMAX:  # the tile's first column at its max; an earlier tile keeps a tie
            tile_arg = tl.reduce(tl.where(z == tile_max[:, None], offs_v[None, :], V), 1, min_combine)
            arg_i = tl.where(tile_max > m_i, tile_arg, arg_i)
        e = tl.exp2((z - m_new[:, None]) * LOG2E)
        rescale = tl.exp2((m_i - m_new) * LOG2E)
        if NEED_ENTROPY:  # Σ e^{z−m}(z − m) relative to the running max (masked columns: e = 0)
            ez = tl.where(col_mask[None, :], e * (z - m_new[:, None]), 0.0)
            a_i = rescale * (a_i + (m_i - m_new) * s_i) + tl.reduce(ez, 1, add_combine)
        s_i = s_i * rescale + tl.reduce(e, 1, add_combine)
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
    if NEED_ENTROPY:
        out += plane
        tl.store(out, a_i, mask=row_mask)
    if NEED_ARGMAX:
        tl.store(arg_ptr + pid_s.to(tl.int64) * N + offs_m, arg_i, mask=row_mask)


# N not specialised: Triton compiles another variant for an N divisible by 16, and on an H100 that
# variant's lse and entropy differ in the last bit for some rows (300 rows alone against the same
# rows in 4096, identical partials; 304 and 320 agreed): one variant for every N keeps a row's result
# independent of the batch (INDUCTOR_XENT_BATCH_INVARIANT, tests/test_gpu_kernels.py)
@triton.jit(do_not_specialize=["N"])
def lce_combine_kernel(
    # pointers
    part_ptr, arg_part_ptr, target_ptr, loss_ptr, lse_ptr, lse_lo_ptr, st_ptr, entropy_ptr, argmax_ptr,
    # sizes
    N, V, num_splits,
    # loss options
    ignore_index, label_smoothing, z_loss,
    # meta-parameters
    NEED_SUM_Z: tl.constexpr, NEED_ST: tl.constexpr, NEED_ENTROPY: tl.constexpr, NEED_ARGMAX: tl.constexpr,
    BLOCK: tl.constexpr, GROUP: tl.constexpr,
):
    """Reduce the splits of BLOCK rows into loss, lse and lse_lo (and, with NEED_ST, the target's
    sech² into st; with NEED_ENTROPY the entropy, 0 on ignored rows; with NEED_ARGMAX the argmax,
    int64, of every row). GROUP splits at a time, in split order: a [GROUP, BLOCK] load per
    partial, a tree reduction over the group, then the group joins the running values. The store
    strategy has one split per vocabulary tile (1002 at V = 128256 with 128-column tiles): one split
    at a time was a chain of dependent loads (H200: 0.13 ms per 4096 rows and 501 splits)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    plane = num_splits * N
    m = tl.full((BLOCK,), M_INIT, dtype=tl.float32)
    s = tl.full((BLOCK,), 0.0, dtype=tl.float32)
    zt = tl.full((BLOCK,), 0.0, dtype=tl.float32)
    sz = tl.full((BLOCK,), 0.0, dtype=tl.float32)
    st = tl.full((BLOCK,), 0.0, dtype=tl.float32)
    a = tl.full((BLOCK,), 0.0, dtype=tl.float32)
    arg = tl.full((BLOCK,), 0, dtype=tl.int32)
    # compensated (Kahan) sums across groups: a plain running sum over store's 2000 splits at
    # V = 256000 loses ~1e-6 of the loss; within a group the tree reduction's error grows with log(GROUP)
    s_c = tl.full((BLOCK,), 0.0, dtype=tl.float32)
    sz_c = tl.full((BLOCK,), 0.0, dtype=tl.float32)
    for g0 in range(0, num_splits, GROUP):
        split = g0 + tl.arange(0, GROUP)
        live = (split < num_splits)[:, None] & mask[None, :]
        idx = split.to(tl.int64)[:, None] * N + offs[None, :]  # (split, row) within a plane
        m_s = tl.load(part_ptr + idx, mask=live, other=M_INIT)
        s_s = tl.load(part_ptr + plane + idx, mask=live, other=0.0)
        m_g = tl.reduce(m_s, 0, max_combine)
        r_s = tl.exp2((m_s - m_g[None, :]) * LOG2E)
        s_g = tl.reduce(s_s * r_s, 0, add_combine)
        m_new = tl.maximum(m, m_g)
        rescale = tl.exp2((m - m_new) * LOG2E)
        r_g = tl.exp2((m_g - m_new) * LOG2E)
        if NEED_ENTROPY:  # the group's A relative to its max, then both sides moved to the new max
            a_s = tl.load(part_ptr + (3 + NEED_SUM_Z + NEED_ST) * plane + idx, mask=live, other=0.0)
            a_g = tl.reduce(r_s * (a_s + (m_s - m_g[None, :]) * s_s), 0, add_combine)
            a = rescale * (a + (m - m_new) * s) + r_g * (a_g + (m_g - m_new) * s_g)
        if NEED_ARGMAX:  # the group's first split at its max; an earlier group keeps a tie
            first = tl.reduce(tl.where(m_s == m_g[None, :], split[:, None], num_splits), 0, min_combine)
            arg_s = tl.load(arg_part_ptr + idx, mask=live, other=0)
            arg_g = tl.reduce(tl.where(split[:, None] == first[None, :], arg_s, 0), 0, add_combine)
            arg = tl.where(m_g > m, arg_g, arg)
        s = s * rescale
        s_c = s_c * rescale
        y = s_g * r_g - s_c
        total = s + y
        s_c = (total - s) - y
        s = total
        m = m_new
        zt += tl.reduce(tl.load(part_ptr + 2 * plane + idx, mask=live, other=0.0), 0, add_combine)  # one split: exact
        if NEED_SUM_Z:
            y = tl.reduce(tl.load(part_ptr + 3 * plane + idx, mask=live, other=0.0), 0, add_combine) - sz_c
            total = sz + y
            sz_c = (total - sz) - y
            sz = total
        if NEED_ST:
            st += tl.reduce(tl.load(part_ptr + (3 + NEED_SUM_Z) * plane + idx, mask=live, other=0.0), 0,
                            add_combine)
    s = tl.where(mask, s, 1.0)  # rows past N: no log(0)
    log_s = tl.log(s)
    lse = m + log_s
    lse_lo = (m - lse) + log_s
    loss = log_s + (1.0 - label_smoothing) * (m - zt) + z_loss * lse * lse
    if NEED_SUM_Z:
        loss += label_smoothing * (m - sz / V)
    tgt = tl.load(target_ptr + offs, mask=mask, other=ignore_index)
    loss = tl.where(tgt != ignore_index, loss, 0.0)
    tl.store(loss_ptr + offs, loss, mask=mask)
    tl.store(lse_ptr + offs, lse, mask=mask)
    tl.store(lse_lo_ptr + offs, lse_lo, mask=mask)
    if NEED_ST:
        tl.store(st_ptr + offs, st, mask=mask)
    if NEED_ENTROPY:
        tl.store(entropy_ptr + offs, tl.where(tgt != ignore_index, log_s - a / s, 0.0), mask=mask)
    if NEED_ARGMAX:
        tl.store(argmax_ptr + offs, arg.to(tl.int64), mask=mask)
