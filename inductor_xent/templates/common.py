"""``@triton.jit`` helpers shared by the forward, backward and store kernels: the logit tile (a
matmul over D with the epilogue bias, scale and softcap), the program-id grouping, and reductions.

The kernels use only Triton builtins and these helpers, never ``triton.language.standard``'s jit
functions (``tl.cdiv``, ``tl.sum``, ``tl.max``, ``tl.zeros``): those are created when
``triton.language`` is first imported, so a process that imported triton before setting
``TRITON_INTERPRET=1`` (a test session where torch._inductor loaded first) would hold
compiled-mode versions that the interpreter refuses to call. ``tl.reduce`` with our own combine
functions generates the same code.
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

# tanh below this |x| comes from an odd polynomial (Cephes' tanhf: relative error ~1e-7 there),
# above it from exp: 1 - 2/(e^{2|x|} + 1) has no cancellation once tanh(|x|) >= 0.55. The single
# exp formula everywhere loses ~1e-5 relative near 0 (1 - 2/(e^{2x}+1) cancels).
TANH_POLY_BELOW = tl.constexpr(0.625)


@triton.jit
def add_combine(a, b):
    return a + b


@triton.jit
def max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def min_combine(a, b):
    return tl.minimum(a, b)


@triton.jit
def cdiv(a, b):
    return (a + b - 1) // b


@triton.jit
def softcap_tanh(x):
    """(tanh(x), sech²(x)) in fp32 from one exp, both to a few ulp relative: sech² = 4u/(1+u)² with
    u = e^{-2|x|} does not cancel where tanh saturates (1 - tanh² there loses every digit)."""
    ax = tl.abs(x)
    u = tl.exp2(ax * (-2.0 * LOG2E))
    one_u = 1.0 + u
    big = (1.0 - u) / one_u
    s = x * x
    poly = ((((-5.70498872745e-3 * s + 2.06390887954e-2) * s - 5.37397155531e-2) * s + 1.33314422036e-1) * s
            - 3.33332819422e-1) * s * ax + ax
    t = tl.where(ax < TANH_POLY_BELOW, poly, big)
    t = tl.where(x < 0.0, -t, t)
    return t, 4.0 * u / (one_u * one_u)


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
        if DOT_UPCAST:
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
        acc = tma_dot_step(h_desc, w_desc, off_m, off_v, k, acc, INPUT_PRECISION, DOT_UPCAST)
    return acc


@triton.jit
def tma_dot_step(h_desc, w_desc, off_m, off_v, k, acc, INPUT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """acc + hidden[off_m:, k:] @ weight[off_v:, k:].T for one BLOCK_K step through TMA descriptors."""
    a = h_desc.load([off_m, k])
    b = w_desc.load([off_v, k])
    if DOT_UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b.T, acc, input_precision=INPUT_PRECISION)


@triton.jit
def tile_logits(
    hidden_ptr, weight_ptr, off_m, rows, off_v, offs_v, D, stride_h_n, stride_h_d, stride_w_v, stride_w_d, V,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr, DOT_UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
):
    """The raw logit tile hidden[rows] @ weight[off_v : off_v + BLOCK_N].T (fp32), through TMA
    descriptors (hidden_ptr / weight_ptr are descriptors then) or clamped pointers."""
    if USE_TMA:
        acc = logits_tile_tma(hidden_ptr, weight_ptr, off_m, off_v, D,
                              BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION, NUM_STAGES, DOT_UPCAST)
    else:
        cols = tl.minimum(offs_v, V - 1).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        h_ptrs = hidden_ptr + rows[:, None] * stride_h_n + offs_k[None, :] * stride_h_d
        w_ptrs = weight_ptr + cols[None, :] * stride_w_v + offs_k[:, None] * stride_w_d
        acc = logits_tile(h_ptrs, w_ptrs, D, stride_h_d, stride_w_d, offs_k,
                          BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, INPUT_PRECISION, NUM_STAGES, DOT_UPCAST)
    return acc


@triton.jit
def loop_tile_logits(
    hidden_ptr, weight_ptr, off_m, off_v, N, V, D, stride_h_n, stride_h_d, stride_w_v, stride_w_d,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr, DOT_UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
):
    """tile_logits for the tile loop of a persistent kernel: with TMA the D loop is a plain loop
    (the kernel's tl.range(flatten=True) pipelines the loop nest across tiles), with pointers
    tile_logits' pipelined D loop over clamped rows and columns."""
    if USE_TMA:
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
        for k in range(0, D, BLOCK_K):
            acc = tma_dot_step(hidden_ptr, weight_ptr, off_m, off_v, k, acc, INPUT_PRECISION, DOT_UPCAST)
    else:
        rows = tl.minimum(off_m + tl.arange(0, BLOCK_M), N - 1).to(tl.int64)
        acc = tile_logits(hidden_ptr, weight_ptr, off_m, rows, off_v, off_v + tl.arange(0, BLOCK_N), D,
                          stride_h_n, stride_h_d, stride_w_v, stride_w_d, V,
                          BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, INPUT_PRECISION, NUM_STAGES, DOT_UPCAST, False)
    return acc


@triton.jit
def apply_epilogue(acc, bias_ptr, offs_v, col_mask, logit_scale, softcap,
                   HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SCALE: tl.constexpr):
    """(z, dz/dz_raw without the scale) with z = softcap * tanh((acc + bias) * logit_scale / softcap):
    the second is sech² of the capped argument, and 1.0 when there is no cap. HAS_SCALE False
    (logit_scale is 1) skips the product: x · 1 is x (EPILOGUE_NOTE)."""
    z = acc
    if HAS_BIAS:
        b = tl.load(bias_ptr + offs_v, mask=col_mask, other=0.0).to(tl.float32)
        z = z + b[None, :]
    if HAS_SCALE:
        z = z * logit_scale
    sech2 = 1.0
    if HAS_SOFTCAP:
        t, sech2 = softcap_tanh(z / softcap)
        z = softcap * t
    return z, sech2


@triton.jit
def store_raw_logits(logits_ptr, acc, bias_ptr, rows, offs_v, row_mask, col_mask, stride_l_n,
                     HAS_BIAS: tl.constexpr, EVEN: tl.constexpr):
    """logits[rows, offs_v] = acc + bias, rounded once to the output's dtype: the tile as the
    model's lm_head (a GEMM with fp32 accumulation and a bias epilogue) gives it, for a compiled
    function that returns the logits too. ``rows`` are clamped in bounds; EVEN: no mask needed."""
    raw = acc
    if HAS_BIAS:
        raw = raw + tl.load(bias_ptr + offs_v, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out = logits_ptr + rows[:, None] * stride_l_n + offs_v[None, :]
    if EVEN:
        tl.store(out, raw.to(logits_ptr.dtype.element_ty))
    else:
        tl.store(out, raw.to(logits_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


# EPILOGUE_NOTE. The kernels' epilogues run on the warps that issue the tile's MMAs (one CTA per SM).
# sm_90 SASS of the store forward (offline compile, 128x256 tile, 8 warps: 128 logits per thread)
# had ~20 instructions per logit in its epilogue, four of them the target's one-hot (a 64-bit
# compare, an AND with the column mask, a select) and two the column mask and the scale; the dlogits
# kernel's masked stores were scalar. The kernels take each row's target column in the tile once
# (target_slot: a 32-bit compare per logit, no mask) and compile the masks (EVEN_V, EVEN_M, EVEN_C)
# and the scale (HAS_SCALE) out where they are no-ops: store forward 2615 -> 2035 instructions per
# tile and thread, dlogits 3748 -> 2116. The same bits (H200 A/B against the previous kernels, four
# option sets), and only 0-1.3 % less time (recompute forward 0.987x at gemma2-2b's shape; the rest
# within the spread): the epilogue was not the bottleneck the count suggested. Skipping the one-hot in
# tiles where no row has its target (a CTA-wide "any row?" reduction and a branch) made the forwards
# 2-7 % slower and was dropped: no barrier in the epilogue (benchmarks/NOTES.md, eighth session).


@triton.jit
def target_slot(tgt, off_v, V, valid, BLOCK_N: tl.constexpr):
    """Each row's target column within the tile [off_v, off_v + BLOCK_N) as int32, or -1 where the
    target is not in it, is past V or the row is not ``valid``: ``tl.arange(0, BLOCK_N)[None, :] ==
    slot[:, None]`` is then the tile's one-hot with a 32-bit compare per logit and no column mask
    (EPILOGUE_NOTE)."""
    t = tgt - off_v
    inside = (t >= 0) & (t < BLOCK_N) & (tgt < V) & valid
    return tl.where(inside, t, -1).to(tl.int32)
