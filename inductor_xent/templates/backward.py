"""Backward kernels: dlogits for one vocabulary chunk, and the GEMM accumulation policy.

The backward walks the vocabulary in chunks of Vc columns (``configs.dlogits_chunk``). Per chunk:

1. ``lce_dlogits_kernel`` recomputes the chunk's logits (2·N·D·Vc FLOPs, ``tl.dot`` into fp32) and
   writes the gradient of the loss w.r.t. the raw linear output, in the input dtype, ``[N, Vc]``:

       p  = exp((z − lse) − lse_lo)
       dz = g·(p − (1 − ε)·onehot(t) − ε/V) + (2·z_loss·lse·g + h)·p
       dz ×= sech²(x) if softcapped (x the capped argument);  dz ×= logit_scale

   with g = grad_loss (0 on ignored rows) and h = grad_lse; plus, for grad_bias, one fp32 column
   sum of dz per row block (``[num_row_blocks, Vc]``, reduced by a deterministic ``sum(0)``).
   The log-probabilities op (log_prob = −loss, ε = z_loss = 0) passes g = −grad_log_probs and,
   with HAS_ENTROPY, the entropy H and its incoming gradient a (0 on ignored rows):

       dz −= a·p·(log p + H)          (dH/dz_j = −p_j·(log p_j + H), H = −Σ p log p)

   before the softcap and scale factors, with log p = (z − lse) − lse_lo, the exponent of p.
2. grad_weight[chunk] = dzᵀ · hidden: one full-D GEMM written straight into grad_weight (cuBLAS,
   fp32 accumulate): the precision of a single GEMM, no accumulation across chunks.
3. grad_hidden += dz · weight[chunk] into an fp32 ``[N, D]`` accumulator (cuBLAS ``addmm`` with
   ``out_dtype=float32`` where this torch has it for the input dtype; else ``lce_acc_mm_kernel``),
   cast to the input dtype once at the end.

Total 8·N·D·V FLOPs with the forward (the logits are recomputed, never stored); extra memory
N·D·4 + N·Vc·itemsize bytes (192 MiB at the llama3-8b shape). Deterministic: no atomics.
dz is rounded to the input dtype before the two GEMMs exactly as in PyTorch's own backward of
``F.linear(...).float()``, so the gradients have the same rounding as torch.compile's.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import config as _config
from .common import LOG2E, add_combine, apply_epilogue, cdiv, grouped_pid, loop_tile_logits, target_slot
from .configs import KernelConfig


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@triton.jit
def lce_dlogits_kernel(
    # pointers
    hidden_ptr, weight_ptr, bias_ptr, target_ptr, lse_ptr, lse_lo_ptr, grad_loss_ptr, grad_lse_ptr,
    grad_ent_ptr, ent_ptr, dz_ptr, dbias_ptr, count_ptr,
    # sizes: this chunk is columns [v_start, v_start + chunk) of the V-column vocabulary
    N, V, D, v_start, chunk,
    # strides
    stride_h_n, stride_h_d, stride_w_v, stride_w_d, stride_dz_n, stride_db_m,
    # loss options (hit_coef = (1 − ε) + ε/V and rest_coef = ε/V, computed in double on the host)
    ignore_index, hit_coef, rest_coef, logit_scale, softcap, z_loss,
    # meta-parameters
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, NEED_DBIAS: tl.constexpr, HAS_ENTROPY: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
    DOT_UPCAST: tl.constexpr, USE_TMA: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    HAS_SCALE: tl.constexpr, EVEN_M: tl.constexpr, EVEN_C: tl.constexpr, HAS_COUNT: tl.constexpr,
):
    """The [BLOCK_M, BLOCK_N] tiles of dz for the chunk, NUM_PROGRAMS programs walking them in
    grouped order (persistent: one program per SM; with TMA operands the tile loop and the D loop
    are flattened into one pipelined loop, so the next tile's copies overlap this tile's epilogue,
    as in store.lce_store_fwd_kernel); each tile's column sums into dbias[pid_m]. With USE_TMA,
    hidden_ptr and weight_ptr are TMA descriptors (see lce_fwd_kernel). With HAS_COUNT only the row
    blocks holding the first count[0] rows (the live rows, moved first: rows.py), and dz is 0 on the
    rows past the count in the last of them (rows.rows_mm_kernel's K loop reads those)."""
    n_live = N
    if HAS_COUNT:
        n_live = tl.minimum(tl.load(count_ptr), N)
    num_pid_m = cdiv(n_live, BLOCK_M)
    num_pid_n = cdiv(chunk, BLOCK_N)
    tile_c = tl.program_id(0) - NUM_PROGRAMS  # the epilogue's tile counter (store.lce_store_fwd_kernel)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS, flatten=USE_TMA):
        # ---- recompute the logits tile -----------------------------------------------------
        pid_m, pid_n = grouped_pid(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = loop_tile_logits(hidden_ptr, weight_ptr, pid_m * BLOCK_M, v_start + pid_n * BLOCK_N, N, V, D,
                               stride_h_n, stride_h_d, stride_w_v, stride_w_d, BLOCK_M, BLOCK_N, BLOCK_K,
                               EVEN_K, INPUT_PRECISION, NUM_STAGES, DOT_UPCAST, USE_TMA)

        tile_c += NUM_PROGRAMS
        pid_m, pid_n = grouped_pid(tile_c, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = offs_m < N
        rows = tl.minimum(offs_m, N - 1).to(tl.int64)
        offs_c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # column within the chunk
        offs_v = v_start + offs_c
        col_mask = (offs_c < chunk) & (offs_v < V)
        z, sech2 = apply_epilogue(acc, bias_ptr, offs_v, col_mask, logit_scale, softcap, HAS_BIAS, HAS_SOFTCAP,
                                  HAS_SCALE)

        # ---- dz = g·q + c·p with q = p − coef and c = 2·z_loss·lse·g + h ----------------------
        # written (g + c)·q + c·coef: one tile live, and c is never rounded against g (the folded
        # g·(1 + 2·z_loss·lse) loses the z-loss term where p ≈ onehot, e.g. V = 1).
        # p = exp((z − lse) − lse_lo): z − lse is exact near the row max, lse_lo restores the
        # rounding of lse (all logits 2^24: without it every p is off by e^0.08).
        tgt = tl.load(target_ptr + rows)
        lse = tl.load(lse_ptr + rows)
        lse_lo = tl.load(lse_lo_ptr + rows)
        g = tl.where(tgt != ignore_index, tl.load(grad_loss_ptr + rows).to(tl.float32), 0.0)
        c = 2.0 * z_loss * lse * g + tl.load(grad_lse_ptr + rows).to(tl.float32)
        log_p = (z - lse[:, None]) - lse_lo[:, None]
        p = tl.exp2(log_p * LOG2E)
        # coef = (1 − ε)·onehot + ε/V on valid rows, 0 on ignored ones; hit_coef = (1 − ε) + ε/V is
        # one constant rounded once (1 at V = 1: p − coef is then exactly 0, not p − 0.9 − 0.1). The
        # one-hot is a 32-bit compare against each row's column in this tile (common.target_slot)
        valid = tgt != ignore_index
        coef = tl.where(tl.arange(0, BLOCK_N)[None, :] == target_slot(tgt, v_start + pid_n * BLOCK_N, V, valid,
                                                                      BLOCK_N)[:, None],
                        hit_coef, tl.where(valid, rest_coef, 0.0)[:, None])
        dz = (g + c)[:, None] * (p - coef) + c[:, None] * coef
        if HAS_ENTROPY:  # the entropy's gradient −a·p·(log p + H); a is 0 on ignored rows
            a_ent = tl.where(valid, tl.load(grad_ent_ptr + rows).to(tl.float32), 0.0)
            ent = tl.load(ent_ptr + rows)
            dz -= (a_ent[:, None] * p) * (log_p + ent[:, None])
        if HAS_SOFTCAP:
            dz *= sech2
        if HAS_SCALE:
            dz *= logit_scale
        if HAS_COUNT:
            dz = tl.where((offs_m < n_live)[:, None], dz, 0.0)
        out = dz_ptr + rows[:, None] * stride_dz_n + offs_c[None, :]
        if EVEN_M and EVEN_C:  # every row and column of every tile is live
            tl.store(out, dz.to(dz_ptr.dtype.element_ty))
        else:
            live = row_mask[:, None] & col_mask[None, :]
            dz = tl.where(live, dz, 0.0)
            tl.store(out, dz.to(dz_ptr.dtype.element_ty), mask=live)
        if NEED_DBIAS:
            tl.store(dbias_ptr + pid_m.to(tl.int64) * stride_db_m + offs_c, tl.reduce(dz, 0, add_combine),
                     mask=offs_c < chunk)


@triton.jit
def lce_acc_mm_kernel(
    # pointers: acc (M, K) fp32 += a (M, R) @ b (R, K)
    acc_ptr, a_ptr, b_ptr,
    # sizes
    M, K, R,
    # strides
    stride_acc_m, stride_acc_k, stride_a_m, stride_a_r, stride_b_r, stride_b_k,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    """fp32 accumulate-GEMM for grad_hidden (BLOCK_N tiles K = D, BLOCK_K steps R = Vc)."""
    pid_m, pid_n = grouped_pid(tl.program_id(0), cdiv(M, BLOCK_M), cdiv(K, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_m, M - 1).to(tl.int64)
    cols = tl.minimum(offs_n, K - 1).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_a_m + offs_r[None, :] * stride_a_r
    b_ptrs = b_ptr + cols[None, :] * stride_b_k + offs_r[:, None] * stride_b_r
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for r in tl.range(0, R, BLOCK_K, num_stages=NUM_STAGES):
        r_mask = offs_r < R - r
        a = tl.load(a_ptrs, mask=r_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=r_mask[:, None], other=0.0)
        if DOT_UPCAST:  # the interpreter's bf16 tl.dot is wrong: see forward.py
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_a_r
        b_ptrs += BLOCK_K * stride_b_r
    mask = (offs_m < M)[:, None] & (offs_n < K)[None, :]
    out = acc_ptr + rows[:, None] * stride_acc_m + cols[None, :] * stride_acc_k
    tl.store(out, tl.load(out, mask=mask) + acc, mask=mask)


# ---------------------------------------------------------------------------------------------
# GEMM accumulation policy
# ---------------------------------------------------------------------------------------------
@functools.cache
def _cublas_fp32_out(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(..., out_dtype=torch.float32)`` runs for ``dtype`` inputs here
    (aten::addmm.dtype: CUDA, bf16/fp16, torch >= 2.8). Probed once on 1x1 tensors; no sync."""
    if device.type != "cuda":
        return False
    try:
        one = torch.ones((1, 1), device=device, dtype=dtype)
        torch.addmm(torch.zeros((1, 1), device=device), one, one, out_dtype=torch.float32)
    except (RuntimeError, TypeError):
        return False
    return True


def accumulate_grad_hidden(
    acc: Tensor,  # (N, D) float32, updated in place
    dz: Tensor,  # (N, Vc) input dtype
    w: Tensor,  # (Vc, D) input dtype
    cfg: KernelConfig,
    input_precision: str,
) -> None:
    """acc += dz @ w with fp32 accumulation and an fp32 result (never rounded to the input dtype)."""
    if dz.dtype == torch.float32:
        acc.addmm_(dz, w)  # fp32 GEMM; honours torch's TF32 setting (compat.tf32_matmuls) like torch
    elif _cublas_fp32_out(dz.device, dz.dtype):
        torch.addmm(acc, dz, w, out_dtype=torch.float32, out=acc)
    else:
        n, d = acc.shape
        grid = (triton.cdiv(n, cfg.block_m) * triton.cdiv(d, cfg.block_n),)
        lce_acc_mm_kernel[grid](
            acc, dz, w, n, d, dz.shape[1],
            acc.stride(0), acc.stride(1), dz.stride(0), dz.stride(1), w.stride(0), w.stride(1),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            INPUT_PRECISION=input_precision, NUM_STAGES=cfg.num_stages,
            DOT_UPCAST=_config.triton_interpret(),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )


def grad_weight_chunk(
    out: Tensor,  # (Vc, D) weight dtype: rows of grad_weight
    dz: Tensor,  # (N, Vc) input dtype
    hidden: Tensor,  # (N, D)
    accumulate: bool = False,
) -> None:
    """out (+)= dzᵀ @ hidden: one GEMM over all N rows with fp32 accumulation (``out`` added in
    fp32 too), rounded once."""
    if dz.device.type == "cpu" and dz.dtype != torch.float32:  # CPU (interpreter tests) only
        prod = torch.mm(dz.t().float(), hidden.float())
        out.copy_(out.float() + prod if accumulate else prod)
    elif accumulate:
        out.addmm_(dz.t(), hidden)
    else:
        torch.mm(dz.t(), hidden, out=out)
