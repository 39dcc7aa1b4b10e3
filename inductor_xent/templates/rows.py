"""Row compaction: the valid rows first, a device-side count, and GEMMs that stop at the count.

A cross-entropy's ``ignore_index`` rows have zero loss and zero gradients, yet a dense head computes
their logits three times (forward, dz·W, dzᵀ·h). Here the rows are permuted so that the valid ones
come first (``compact``: a stable sort on the device, no host sync), and every kernel reads the
number of valid rows from a device scalar: programs past it do no work, so the cost follows the
valid rows while the shapes, the launches and the graph stay the same whatever the count (CUDA-graph
capturable; no recompiles).

``rows_mm_kernel`` is the GEMM of the two backward products with that bound:

    dH[r]  = dz[r, :] · W          r < count       (BOUND_M: row blocks past the count are skipped)
    dW    (+)= dz[:count]ᵀ · h[:count]             (BOUND_K: the K loop stops at the count)

with fp32 accumulation, written (or, with ACCUMULATE, added into ``out`` and rounded once) in the
output's dtype. A is [M, K] row-major, or with TRANS_A stored as [K, M] (dz for dzᵀ); B is [K, N],
or with TRANS_B stored as [N, K] (an lm_head weight for a row chunk's logits, h·Wᵀ).
Rows of dz in ``[count, roundup(count, BLOCK_K))`` must be zero (the dz kernels write zeros there,
``count_ptr`` semantics): the K loop runs whole BLOCK_K steps. Persistent (one program per SM walking
the output tiles in grouped order); with TMA descriptors the tile loop and the K loop are one
software-pipelined loop, as in the store forward.

FLOPs: 2·count·K·N (BOUND_M) or 2·M·N·count (BOUND_K); nothing is materialised beyond the output.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import config
from .common import cdiv, grouped_pid, logits_tile
from .configs import KernelConfig

# GEMM tiles (bf16/fp16, fp32); the K step must not exceed the dz kernels' row block (see above).
# GROUP_M 4 for 16-bit: H100, llama3-8b head, two runs favoured it over 8 (alone: dH 11.54 against
# 11.76 ms, dW 11.67 against 11.89; the 0 %-ignored CE step over 6 rotated rounds at the 700 W cap:
# 1.005x torch.compile against 1.011x); the tile order only, the same bits
ROWS_MM_CONFIG = {2: KernelConfig(128, 256, 64, 4, 8, 3, tma=True), 4: KernelConfig(64, 128, 32, 8, 4, 3)}
# 16-bit operands into an fp32 output (an fp32 accumulator: grad_hidden's in the recompute backward,
# grad_weight's under strategy.fp32_accumulate): the epilogue converts the fp32 [128, 256] tile through
# shared memory (128 KiB), which with three 48 KiB stages asks 278552 bytes, over the H100/H200's
# 232448 (the launch failed on the H200; sm_90 offline compile: 128x128 tiles, 4 stages: 196640)
ROWS_MM_FP32_OUT = KernelConfig(128, 128, 64, 8, 8, 4, tma=True)
ROWS_MM_INTERPRET = KernelConfig(16, 32, 16, 2, 4, 1)
assert ROWS_MM_FP32_OUT.block_k == ROWS_MM_CONFIG[2].block_k  # k_step: one K step per input dtype


@triton.jit
def rows_mm_kernel(
    # pointers: out (M, N) (+)= op(a) @ b (K, N); count (int32 scalar) bounds M or K; out_rows (M,)
    # int64: with HAS_OUT_ROWS row r of the product goes to out[out_rows[r]]
    out_ptr, a_ptr, b_ptr, count_ptr, out_rows_ptr,
    # sizes
    M, N, K,
    # strides (a's as stored: (M, K), or (K, M) with TRANS_A)
    stride_o_m, stride_o_n, stride_a_0, stride_a_1, stride_b_k, stride_b_n,
    # meta-parameters
    BOUND_M: tl.constexpr, TRANS_A: tl.constexpr, TRANS_B: tl.constexpr, ACCUMULATE: tl.constexpr,
    HAS_OUT_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr, DOT_UPCAST: tl.constexpr,
    USE_TMA: tl.constexpr, NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr,
):
    """Output tiles of op(a) @ b for rows (BOUND_M) or a contraction (BOUND_K) bounded by count.
    With USE_TMA a_ptr / b_ptr are TMA descriptors of [BLOCK_M, BLOCK_K] ([BLOCK_K, BLOCK_M] with
    TRANS_A) and [BLOCK_K, BLOCK_N] ([BLOCK_N, BLOCK_K] with TRANS_B) blocks; without, the strides are
    those of the [M, K] and [K, N] views, whatever the storage."""
    count = tl.load(count_ptr)
    if BOUND_M:
        m_eff = tl.minimum(count, M)
        k_end = K
    else:
        m_eff = M
        k_end = tl.minimum(cdiv(tl.minimum(count, K), BLOCK_K) * BLOCK_K, K)
    num_pid_m = cdiv(m_eff, BLOCK_M)
    num_pid_n = cdiv(N, BLOCK_N)
    tile_c = tl.program_id(0) - NUM_PROGRAMS  # the epilogue's tile counter (store.lce_store_fwd_kernel)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS, flatten=FLATTEN):
        pid_m, pid_n = grouped_pid(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
        if USE_TMA:
            for k in range(0, k_end, BLOCK_K):
                if TRANS_A:
                    a = a_ptr.load([k, off_m]).T
                else:
                    a = a_ptr.load([off_m, k])
                if TRANS_B:
                    b = b_ptr.load([off_n, k]).T
                else:
                    b = b_ptr.load([k, off_n])
                if DOT_UPCAST:
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        else:
            rows = tl.minimum(offs_m, M - 1).to(tl.int64)
            cols = tl.minimum(offs_n, N - 1).to(tl.int64)
            offs_k = tl.arange(0, BLOCK_K)
            stride_a_k = stride_a_0 if TRANS_A else stride_a_1
            stride_a_m = stride_a_1 if TRANS_A else stride_a_0
            a_ptrs = a_ptr + rows[:, None] * stride_a_m + offs_k[None, :].to(tl.int64) * stride_a_k
            b_ptrs = b_ptr + offs_k[:, None].to(tl.int64) * stride_b_k + cols[None, :] * stride_b_n
            acc = logits_tile(a_ptrs, b_ptrs, k_end, stride_a_k, stride_b_k, offs_k, BLOCK_M, BLOCK_N, BLOCK_K,
                              False, INPUT_PRECISION, NUM_STAGES, DOT_UPCAST)
        tile_c += NUM_PROGRAMS
        pid_m, pid_n = grouped_pid(tile_c, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = offs_m < m_eff
        mask = row_ok[:, None] & (offs_n < N)[None, :]
        if HAS_OUT_ROWS:
            out_rows = tl.load(out_rows_ptr + offs_m, mask=row_ok, other=0)
        else:
            out_rows = offs_m.to(tl.int64)
        out = out_ptr + out_rows[:, None] * stride_o_m + offs_n[None, :].to(tl.int64) * stride_o_n
        if ACCUMULATE:
            acc += tl.load(out, mask=mask, other=0.0).to(tl.float32)
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------
def compact(valid: Tensor) -> tuple[Tensor, Tensor]:
    """(order, count) for a (N,) bool mask: ``order`` (int64) lists the valid rows first, each group
    in increasing row order (a stable sort: the same permutation every time), and ``count`` is the
    number of valid rows as a (1,) int32 device tensor. No host sync."""
    order = torch.sort((~valid).to(torch.uint8), stable=True).indices
    return order, valid.sum(dtype=torch.int32).reshape(1)


def mm_config(dtype: torch.dtype, out_dtype: Optional[torch.dtype] = None) -> KernelConfig:
    """rows_mm_kernel's tiles for this input dtype and output dtype (ROWS_MM_CONFIG, ROWS_MM_FP32_OUT;
    the interpreter's small tile)."""
    if config.triton_interpret():
        return ROWS_MM_INTERPRET._replace(tma=True)  # the interpreter emulates descriptors: CI tests that path
    itemsize = min(torch.finfo(dtype).bits // 8, 4)
    if itemsize < 4 and out_dtype == torch.float32:
        return ROWS_MM_FP32_OUT
    return ROWS_MM_CONFIG[itemsize]


def k_step(dtype: torch.dtype) -> int:
    """The K step of rows_mm_kernel for this input dtype, whatever the output's: the dz kernels write
    zeros up to the count rounded up to it."""
    return mm_config(dtype).block_k


def mm_suits(dtype: torch.dtype) -> bool:
    """Whether rows_mm serves the gradient GEMMs of inputs of this dtype: 16-bit only. With fp32
    operands rows_mm_kernel sums the long vocabulary contraction of grad_hidden (dz·W, K = V) in one
    fp32 FMA chain per output, which measured 3-5x cuBLAS's error there (H200, V = 50257 to 256000:
    relative error 4e-6 to 7e-6 against torch's 1.1e-6 to 2.7e-6); fp32 heads keep cuBLAS's dense
    GEMMs."""
    return dtype != torch.float32


def compacts(dtype: torch.dtype) -> bool:
    """Whether the Triton launchers compact the rows of inputs of this dtype: where row skipping is on
    and rows_mm serves the dtype (``mm_suits``; the chunked CPU path skips the rows in every dtype)."""
    return config.skip_ignored_rows() and mm_suits(dtype)


def _tma_ok(cfg: KernelConfig, *tensors: Tensor) -> bool:
    """Hopper or later (or the interpreter), row-major operands with 16-byte aligned rows."""
    if not cfg.tma:
        return False
    dev = tensors[0].device
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] < 9:
        return False
    if dev.type == "cpu" and not config.triton_interpret():
        return False
    return all(t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
               for t in tensors)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def row_grads(dz: Tensor, weight: Tensor, hidden: Tensor, count: Tensor, out_rows: Tensor,
              grad_h: Optional[Tensor], need_w: bool, precision: str = "tf32") -> Optional[Tensor]:
    """The two backward products of compacted rows held in one ``dz`` (``[rows, V]``, the rows past
    ``count`` zero up to the next K step): ``grad_h[out_rows[r]] = dz[r]·W`` for ``r < count`` (the
    other rows of ``grad_h`` left as they were; skipped without ``grad_h``), and, with ``need_w``,
    the weight gradient ``dz[:count]ᵀ·hidden[:count]``, returned with the weight's strides where
    they are dense (a ``W.t()`` weight's gradient is the ``.t()`` of a contiguous one)."""
    if grad_h is not None:
        rows_mm(grad_h, dz, weight, count, out_rows=out_rows, bound="m", input_precision=precision)
    if not need_w:
        return None
    dense = weight.is_contiguous() or weight.t().is_contiguous()
    grad_w = torch.empty_like(weight) if dense else torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    rows_mm(grad_w, dz, hidden, count, bound="k", trans_a=True, input_precision=precision)
    return grad_w


def rows_mm(
    out: Tensor,  # (M, N): written, or with accumulate added into
    a: Tensor,  # (M, K), or (K, M) with trans_a
    b: Tensor,  # (K, N): row-major, or the .t() of a row-major (N, K) (then read as stored: TRANS_B)
    count: Tensor,  # (1,) int32: bounds M (bound="m") or K (bound="k")
    *,
    out_rows: Optional[Tensor] = None,  # (M,) int64: row r of the product goes to out[out_rows[r]]
    bound: str,
    trans_a: bool = False,
    accumulate: bool = False,
    input_precision: str = "tf32",
    cfg: Optional[KernelConfig] = None,
    flatten: Optional[bool] = None,
) -> None:
    """out (+)= op(a) @ b over the first ``count`` rows of the product (bound "m": the other rows of
    ``out`` are left as they were) or the first ``count`` rows of the contraction (bound "k"), fp32
    accumulate, one rounding."""
    m, n = (out_rows.shape[0], out.shape[1]) if out_rows is not None else out.shape
    k = a.shape[0] if trans_a else a.shape[1]
    if m == 0 or n == 0:
        return
    if config.triton_interpret() and out.dtype != torch.float32:
        # the interpreter truncates fp32 -> 16-bit casts (backward.py's dz_dtype): fp32 here, torch rounds
        wide = out.float()
        rows_mm(wide, a, b, count, out_rows=out_rows, bound=bound, trans_a=trans_a, accumulate=accumulate,
                input_precision=input_precision, cfg=cfg, flatten=flatten)
        out.copy_(wide)
        return
    cfg = cfg or mm_config(a.dtype, out.dtype)
    trans_b = b.stride(0) == 1 and b.stride(1) != 1  # b = W.t() of a row-major W
    use_tma = _tma_ok(cfg, a, b.t() if trans_b else b)
    a_op, b_op = a, b
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        a_op = TensorDescriptor.from_tensor(a, [cfg.block_k, cfg.block_m] if trans_a else [cfg.block_m, cfg.block_k])
        b_op = TensorDescriptor.from_tensor(b.t() if trans_b else b,
                                            [cfg.block_n, cfg.block_k] if trans_b else [cfg.block_k, cfg.block_n])
    programs = min(_num_sms(out.device), triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n))
    rows_mm_kernel[(programs,)](
        out, a_op, b_op, count, out_rows,
        m, n, k,
        out.stride(0), out.stride(1), a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        BOUND_M=bound == "m", TRANS_A=trans_a, TRANS_B=trans_b and use_tma, ACCUMULATE=accumulate,
        HAS_OUT_ROWS=out_rows is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        INPUT_PRECISION=input_precision, NUM_STAGES=cfg.num_stages, DOT_UPCAST=config.triton_interpret(),
        USE_TMA=use_tma, NUM_PROGRAMS=programs, FLATTEN=use_tma if flatten is None else (flatten and use_tma),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
