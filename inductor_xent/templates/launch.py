"""Launchers of the fused linear + cross-entropy kernels: check, allocate, launch.

``forward``, ``backward``, ``store`` and ``log_probs_forward`` are what ``ops.py`` calls for CUDA
tensors (and for CPU tensors under ``TRITON_INTERPRET=1``). None synchronises with the host
(CUDA-graph capturable), none copies ``weight`` (strides go to the kernels; ``W_dv.t()`` works as
is), and all are deterministic: the vocabulary splits are combined in a fixed order and no kernel
uses atomics.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
from torch import Tensor

from .. import compat, config
from ..options import KERNEL_DTYPES, LossOptions, reduced, reduction_weights
from . import configs, rows
from .backward import accumulate_grad_hidden, grad_weight_chunk, lce_dlogits_kernel
from .configs import KernelConfig
from .forward import lce_combine_kernel, lce_fwd_kernel
from .store import lce_logprob_dz_kernel, lce_store_dz_kernel, lce_store_fwd_kernel, scale_kernel

COMBINE_BLOCK = 16  # rows per combine program
COMBINE_GROUP = 64  # splits per step of the combine (H200, 4096 rows, 1002 splits: 0.044 ms; 32 x 32 0.069,
# one split per step 0.26)
E_ROW_ALIGN = 64  # elements: 128 bytes in 16 bits
DLOGITS_PERSISTENT = True  # the dlogits kernel: one program per SM walking the tiles (False: one per tile)


def unsupported_reason(hidden: Tensor) -> Optional[str]:
    """None when the kernels can run on ``hidden``'s device and dtype, else a one-line reason."""
    if hidden.dtype not in KERNEL_DTYPES:
        return f"dtype {hidden.dtype} is not one of bfloat16, float16, float32"
    if hidden.device.type == "cuda":
        return None
    if hidden.device.type == "cpu":
        if config.triton_interpret():
            return None
        return "CPU tensors need TRITON_INTERPRET=1 (set before triton kernels are defined)"
    return f"device {hidden.device.type!r} is not supported (CUDA, or CPU under TRITON_INTERPRET=1)"


def _input_precision(dtype: torch.dtype) -> str:
    """IEEE fp32 dots for fp32 inputs unless the user allowed TF32 for matmuls, as torch does (by either
    of torch's APIs: compat.tf32_matmuls)."""
    if dtype == torch.float32 and not compat.tf32_matmuls():
        return "ieee"
    return "tf32"


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tma_ok(cfg: KernelConfig, hidden: Tensor, weight: Tensor) -> bool:
    """TMA descriptors need Hopper or later, row-major operands and 16-byte aligned rows; a
    ``W_dv.t()`` weight or an odd D takes the pointer path."""
    if not cfg.tma:
        return False
    if hidden.device.type == "cuda":
        if torch.cuda.get_device_capability(hidden.device)[0] < 9:
            return False
    elif not config.triton_interpret():  # the interpreter emulates descriptors (CI tests this path)
        return False
    return all(
        x.stride(1) == 1 and (x.stride(0) * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0
        for x in (hidden, weight)
    )


def _operands(cfg: KernelConfig, hidden: Tensor, weight: Tensor, use_tma: bool):
    """(hidden, weight) as the kernels take them: tensors, or TMA descriptors of one tile each."""
    if not use_tma:
        return hidden, weight
    from triton.tools.tensor_descriptor import TensorDescriptor

    return (TensorDescriptor.from_tensor(hidden, [cfg.block_m, cfg.block_k]),
            TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k]))


def _smoothing_coefs(opts: LossOptions, vocab: int) -> tuple[float, float]:
    """(the target's coefficient (1 − ε) + ε/V, every other column's ε/V), in double here."""
    eps = float(opts.label_smoothing)
    return (1.0 - eps) + eps / vocab, eps / vocab


def _options(opts: LossOptions) -> tuple[float, float]:
    """(logit_scale, softcap) as kernel scalars; softcap is unused when None."""
    return float(opts.logit_scale), 1.0 if opts.softcap is None else float(opts.softcap)


# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------
def forward(
    hidden: Tensor,  # (N, D)
    weight: Tensor,  # (V, D)
    bias: Optional[Tensor],  # (V,)
    target: Tensor,  # (N,) int64
    opts: LossOptions,
    *,
    cfg: Optional[KernelConfig] = None,  # the benchmark's --sweep; the table's choice otherwise
    logits: Optional[Tensor] = None,  # (N, V): receives hidden @ weight.T + bias (write_logits)
    skip_ignored: bool = False,  # nobody reads the ignored rows' lse: their logits are not computed
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row loss (0 on ignored rows), logsumexp and its rounding residual (every row), (N,) fp32.
    With ``skip_ignored``, where the backward compacts too (``rows.compacts``: 16-bit inputs; it
    then never reads an ignored row's lse) and no logits are written, the valid rows go first on
    the device and the row blocks past their count exit at once: an ignored row's loss, lse and
    lse_lo are 0. The same bits for the valid rows (same tiles, same vocabulary split)."""
    n = hidden.shape[0]
    v = weight.shape[0]
    dev = hidden.device
    loss, lse, lse_lo = (torch.empty(n, dtype=torch.float32, device=dev) for _ in range(3))
    if n == 0:
        return loss, lse, lse_lo
    cfg = cfg or configs.forward_config(hidden.dtype)
    if skip_ignored and logits is None and rows.compacts(hidden.dtype):
        _valid_rows_pass(hidden, weight, bias, target, opts, cfg, (loss, lse, lse_lo))
    else:
        _forward_pass(hidden, weight, bias, target, opts, cfg, *_splits(cfg, hidden, v), (loss, lse, lse_lo),
                      logits=logits)
    return loss, lse, lse_lo


def _valid_rows_pass(hidden, weight, bias, target, opts, cfg, outs, entropy=None, argmax=None) -> None:
    """``_forward_pass`` over the valid rows alone, graph-safe: they go first on the device
    (rows.compact), the row blocks past their count exit at once, and ``outs`` (and ``entropy``,
    ``argmax``) receive the valid rows' values in row order, 0 on the ignored rows. The vocabulary
    split is the one of all N rows: a valid row's values are the bits of the dense pass."""
    order, count = rows.compact(target != opts.ignore_index)
    h, t = hidden.index_select(0, order), target.index_select(0, order)
    extra = {k: x for k, x in (("entropy", entropy), ("argmax", argmax)) if x is not None}
    dest = (*outs, *extra.values())
    tmp = [torch.empty_like(x) for x in dest]
    _forward_pass(h, weight, bias, t, opts, cfg, *_splits(cfg, hidden, weight.shape[0]), tuple(tmp[:3]),
                  count=count, **dict(zip(extra, tmp[3:])))
    for x, y in zip(dest, _in_row_order(tmp, order, count)):
        x.copy_(y)


def _in_row_order(values, order: Tensor, count: Tensor) -> list[Tensor]:
    """Per-row values of compacted rows (row r is row ``order[r]``) back in row order, 0 on the rows
    past ``count`` (whatever their memory held); empty tensors (an output not asked for) as they are."""
    kept = torch.arange(order.shape[0], device=order.device) < count
    return [torch.zeros_like(x).index_copy_(0, order, torch.where(kept, x, 0)) if x.numel() else x
            for x in values]


def log_probs_forward(
    hidden: Tensor,  # (N, D)
    weight: Tensor,  # (V, D)
    bias: Optional[Tensor],  # (V,)
    target: Tensor,  # (N,) int64
    opts: LossOptions,  # no label smoothing or z-loss; the temperature folded in
    need_entropy: bool,
    need_argmax: bool,
    *,
    cfg: Optional[KernelConfig] = None,
    skip_ignored: bool = False,  # nobody reads the ignored rows' lse: their logits are not computed
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(log_probs, entropy, argmax, lse, lse_lo), (N,) each: the forward kernel with the entropy
    and argmax partials; log_probs = −loss. entropy (fp32) and argmax (int64) are (0,) where not
    asked for. ``skip_ignored`` as ``forward``'s: an ignored row's values are 0, its argmax too (the
    caller reads no ignored row's argmax)."""
    n = hidden.shape[0]
    dev = hidden.device
    loss, lse, lse_lo = (torch.empty(n, dtype=torch.float32, device=dev) for _ in range(3))
    entropy = torch.empty(n if need_entropy else 0, dtype=torch.float32, device=dev)
    argmax = torch.empty(n if need_argmax else 0, dtype=torch.long, device=dev)
    if n > 0:
        cfg = cfg or configs.forward_config(hidden.dtype)
        if skip_ignored and rows.compacts(hidden.dtype):
            _valid_rows_pass(hidden, weight, bias, target, opts, cfg, (loss, lse, lse_lo),
                             entropy if need_entropy else None, argmax if need_argmax else None)
        else:
            _forward_pass(hidden, weight, bias, target, opts, cfg, *_splits(cfg, hidden, weight.shape[0]),
                          (loss, lse, lse_lo), entropy=entropy if need_entropy else None,
                          argmax=argmax if need_argmax else None)
    return loss.neg_(), entropy, argmax, lse, lse_lo


def _splits(cfg: KernelConfig, hidden: Tensor, v: int) -> tuple[int, int]:
    """(splits, tiles per split) of the forward's vocabulary walk (configs.vocab_split's model,
    or the config's fixed split_tiles, or configs.BATCH_INVARIANT_TILES under config.batch_invariant)."""
    n = hidden.shape[0]
    num_tiles = triton.cdiv(v, cfg.block_n)
    split_tiles = cfg.split_tiles or (configs.BATCH_INVARIANT_TILES if config.batch_invariant() else 0)
    if split_tiles:  # a fixed split: a row's partials and their combine order do not depend on N
        tiles_per_split = min(split_tiles, num_tiles)
        return triton.cdiv(num_tiles, tiles_per_split), tiles_per_split
    return configs.vocab_split(triton.cdiv(n, cfg.block_m), num_tiles, _num_sms(hidden.device) * cfg.ctas_per_sm,
                               num_rows=n)


def _forward_pass(hidden, weight, bias, target, opts, cfg, splits, tiles_per_split, outs, e=None, st=None,
                  entropy=None, argmax=None, logits=None, count=None, e_sech2=True):
    """The forward kernel and the split combine into ``outs`` = (loss, lse, lse_lo) of these rows;
    with ``e`` (the store forward, store.lce_store_fwd_kernel: one split per tile) also the
    exp-logit tiles, and ``st`` the target's sech² under a softcap; with ``entropy`` / ``argmax``
    those of every row; with ``logits`` the raw logit tiles (acc + bias, in its dtype); with
    ``count`` (a (1,) int32 device tensor) only the row blocks holding the first count rows
    (rows.py); ``e_sech2`` False keeps E free of the softcap's sech² (the log-prob op's store).
    Returns the partials (their plane 0 holds each split's row max)."""
    n, d = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    target = target.contiguous()
    bias = None if bias is None else bias.contiguous()
    need_sum_z = opts.label_smoothing != 0.0
    need_st = e is not None and opts.softcap is not None
    need_entropy, need_argmax = entropy is not None, argmax is not None
    part = torch.empty((3 + need_sum_z + need_st + need_entropy, splits, n), dtype=torch.float32, device=dev)
    arg_part = torch.empty((splits, n) if need_argmax else (0,), dtype=torch.int32, device=dev)
    logit_scale, softcap = _options(opts)
    use_tma = _tma_ok(cfg, hidden, weight)
    h_op, w_op = _operands(cfg, hidden, weight, use_tma)
    if e is not None:
        programs = min(_num_sms(dev), triton.cdiv(n, cfg.block_m) * splits)
        lce_store_fwd_kernel[(programs,)](
            h_op, w_op, bias, target, part, arg_part, e, logits, count,
            n, v, d, hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), e.stride(0),
            0 if logits is None else logits.stride(0),
            logit_scale, softcap,
            HAS_BIAS=bias is not None, HAS_SOFTCAP=opts.softcap is not None, NEED_SUM_Z=need_sum_z,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            EVEN_K=d % cfg.block_k == 0, INPUT_PRECISION=_input_precision(hidden.dtype),
            NUM_STAGES=cfg.num_stages, DOT_UPCAST=config.triton_interpret(), USE_TMA=use_tma,
            NUM_PROGRAMS=programs, FLATTEN=use_tma,  # pointer loads in a flattened loop: 2x slower (NOTES.md)
            HAS_SCALE=logit_scale != 1.0, EVEN_M=n % cfg.block_m == 0, EVEN_V=v % cfg.block_n == 0,
            WRITE_LOGITS=logits is not None, HAS_COUNT=count is not None,
            NEED_ENTROPY=need_entropy, NEED_ARGMAX=need_argmax, E_SECH2=e_sech2,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    else:
        lce_fwd_kernel[(triton.cdiv(n, cfg.block_m) * splits,)](
            h_op, w_op, bias, target, part, arg_part, logits, count,
            n, v, d, tiles_per_split, splits,
            hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
            0 if logits is None else logits.stride(0),
            logit_scale, softcap,
            HAS_BIAS=bias is not None, HAS_SOFTCAP=opts.softcap is not None, NEED_SUM_Z=need_sum_z,
            NEED_ENTROPY=need_entropy, NEED_ARGMAX=need_argmax,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            EVEN_K=d % cfg.block_k == 0, INPUT_PRECISION=_input_precision(hidden.dtype),
            NUM_STAGES=cfg.num_stages, DOT_UPCAST=config.triton_interpret(), USE_TMA=use_tma,
            HAS_SCALE=logit_scale != 1.0, EVEN_V=v % cfg.block_n == 0, WRITE_LOGITS=logits is not None,
            HAS_COUNT=count is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    loss, lse, lse_lo = outs
    lce_combine_kernel[(triton.cdiv(n, COMBINE_BLOCK),)](
        part, arg_part, target, loss, lse, lse_lo, st, entropy, argmax,
        n, v, splits,
        int(opts.ignore_index), float(opts.label_smoothing), float(opts.z_loss),
        NEED_SUM_Z=need_sum_z, NEED_ST=need_st, NEED_ENTROPY=need_entropy, NEED_ARGMAX=need_argmax,
        BLOCK=COMBINE_BLOCK, GROUP=COMBINE_GROUP,
    )
    return part


# ---------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------
def _grad_weight_buffer(weight: Tensor, needed: bool) -> Tensor:
    """grad_weight with weight's strides when they are dense (a [D, V] model weight passed as
    ``W_dv.t()`` gets a gradient whose ``.t()`` is contiguous: no copy in AccumulateGrad)."""
    if not needed:
        return weight.new_empty((0,))
    if weight.is_contiguous() or weight.t().is_contiguous():
        return torch.empty_like(weight)
    return torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)


def _weight_grads(weight: Tensor, bias: Optional[Tensor], need_w: bool, need_b: bool,
                  add_to: Optional[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """(grad_weight, grad_bias): ``add_to``'s buffers (other rows' gradients, added into), else new
    ones (uninitialised; empty (0,) where not needed)."""
    if add_to is not None:
        return add_to
    v = weight.shape[0]
    return _grad_weight_buffer(weight, need_w), torch.empty(
        (v,) if need_b else (0,), dtype=weight.dtype if bias is None else bias.dtype, device=weight.device)


def backward(
    grad_loss: Tensor,  # (N,)
    grad_lse: Tensor,  # (N,)
    hidden: Tensor,  # (N, D)
    weight: Tensor,  # (V, D)
    bias: Optional[Tensor],  # (V,)
    target: Tensor,  # (N,) int64
    lse: Tensor,  # (N,) float32
    lse_lo: Tensor,  # (N,) float32
    opts: LossOptions,
    needs: tuple[bool, bool, bool],
    *,
    grad_entropy: Optional[Tensor] = None,  # (N,): the log-prob op's entropy term, with entropy
    entropy: Optional[Tensor] = None,  # (N,) float32
    cfg: Optional[KernelConfig] = None,
    stored: Optional[tuple[Tensor, Tensor, Tensor]] = None,  # (e (N, V), m (tiles, N), st): log_probs_store's
    add_to: Optional[tuple[Tensor, Tensor]] = None,  # (grad_weight, grad_bias) of other rows, added into
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_hidden, grad_weight, grad_bias) in the dtypes of hidden, weight, bias; a gradient not
    in ``needs`` is an empty (0,) tensor and is not computed. With ``grad_entropy`` the entropy's
    gradient ``−grad_entropy·p·(log p + entropy)`` joins dz (backward.py). With ``stored`` (the
    log-prob op's exp-logits of these rows, their tile maxima and target sech², log_probs_store)
    dz comes from them (store.lce_logprob_dz_kernel) instead of recomputed logits: two GEMMs, not
    three. With ``add_to`` these rows' weight and bias gradients are added into those buffers (the
    sum rounded once; needed ones only) and returned as them."""
    need_h, need_w, need_b = needs
    need_b = need_b and bias is not None
    n, d = hidden.shape
    v = weight.shape[0]
    grad_h = torch.empty((n, d) if need_h else (0,), dtype=hidden.dtype, device=hidden.device)
    grad_w, grad_b = _weight_grads(weight, bias, need_w, need_b, add_to)
    if n == 0 or not (need_h or need_w or need_b):
        if add_to is None:
            grad_w.zero_()
            grad_b.zero_()
        return grad_h, grad_w, grad_b
    add = add_to is not None

    cfg = cfg or configs.dlogits_config(hidden.dtype)
    if stored is not None:  # the pointwise dz kernel, on the store forward's tiles (its maxima are per tile)
        cfg = configs.store_dz_config(configs.store_config(hidden.dtype))
    # (N,) and (V,) vectors: a mean's grad_loss arrives expanded (stride 0); copies are tiny
    grad_loss, grad_lse, target, lse, lse_lo = (t.contiguous() for t in (grad_loss, grad_lse, target, lse, lse_lo))
    has_entropy = grad_entropy is not None
    if has_entropy:
        grad_entropy, entropy = grad_entropy.contiguous(), entropy.contiguous()
    bias = None if bias is None else bias.contiguous()
    precision = _input_precision(hidden.dtype)
    fp32_acc = need_h and hidden.dtype != torch.float32
    if stored is None:
        chunk = configs.dlogits_chunk(n, d, v, hidden.element_size(), fp32_acc, cfg.block_n)
    else:
        chunk = configs.stored_chunk(n, v, hidden.element_size(), cfg.block_n)
    num_m = triton.cdiv(n, cfg.block_m)
    # Under the interpreter the kernel writes fp32 and torch rounds: Triton 3.6's interpreter casts
    # fp32 -> bf16 by truncation (measured: mean relative error 2.8e-3 against 1.4e-3 for
    # round-to-nearest), which would double the gradients' error. On the GPU the cast is RNE.
    dz_dtype = torch.float32 if config.triton_interpret() else hidden.dtype
    dz_buf = torch.empty((n, chunk), dtype=dz_dtype, device=hidden.device)
    dbias = torch.empty((num_m, chunk) if need_b else (0, 0), dtype=torch.float32, device=hidden.device)
    acc = None
    if need_h:
        acc = torch.zeros((n, d), dtype=torch.float32, device=hidden.device) if fp32_acc else grad_h.zero_()
    logit_scale, softcap = _options(opts)
    acc_cfg = configs.acc_mm_config(hidden.dtype)
    # rows.py: the rows with an incoming gradient first (the others' dz is exactly 0: an ignored row
    # with no lse or entropy term), and the dlogits kernel and both GEMMs stop at their count
    skip = rows.compacts(hidden.dtype)
    if skip:
        valid = target != opts.ignore_index
        live = (valid & (grad_loss != 0)) | (grad_lse != 0)
        if has_entropy:
            live |= valid & (grad_entropy != 0)
        order, count = rows.compact(live)
        hidden, target, lse, lse_lo, grad_loss, grad_lse = (
            t.index_select(0, order) for t in (hidden, target, lse, lse_lo, grad_loss, grad_lse))
        if has_entropy:
            grad_entropy, entropy = grad_entropy.index_select(0, order), entropy.index_select(0, order)
    use_tma = _tma_ok(cfg, hidden, weight)
    h_op, w_op = _operands(cfg, hidden, weight, use_tma)

    for v0 in range(0, v, chunk):
        cols = min(chunk, v - v0)
        dz = dz_buf[:, :cols]
        tiles = num_m * triton.cdiv(cols, cfg.block_n)
        programs = min(tiles, _num_sms(hidden.device)) if DLOGITS_PERSISTENT else tiles
        if skip and need_b:
            dbias.zero_()  # the row blocks past the count are not visited
        if stored is not None:
            _stored_dz(stored, order if skip else None, target, lse, lse_lo, grad_loss, grad_lse, grad_entropy,
                       entropy, dz, dbias, count if skip else None, v, v0, cols, opts, cfg)
        else:
            lce_dlogits_kernel[(programs,)](
                h_op, w_op, bias, target, lse, lse_lo, grad_loss, grad_lse, grad_entropy, entropy, dz, dbias,
                count if skip else None,
                n, v, d, v0, cols,
                hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
                dz.stride(0), dbias.stride(0),
                int(opts.ignore_index), *_smoothing_coefs(opts, v), logit_scale, softcap, float(opts.z_loss),
                HAS_BIAS=bias is not None, HAS_SOFTCAP=opts.softcap is not None, NEED_DBIAS=need_b,
                HAS_ENTROPY=has_entropy,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                EVEN_K=d % cfg.block_k == 0, INPUT_PRECISION=precision, NUM_STAGES=cfg.num_stages,
                DOT_UPCAST=config.triton_interpret(), USE_TMA=use_tma, NUM_PROGRAMS=programs,
                HAS_SCALE=logit_scale != 1.0, EVEN_M=n % cfg.block_m == 0, EVEN_C=cols % cfg.block_n == 0,
                HAS_COUNT=skip,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )
        dz = dz.to(hidden.dtype)
        if skip:
            if need_w:
                rows.rows_mm(grad_w[v0:v0 + cols], dz, hidden, count, bound="k", trans_a=True, accumulate=add,
                             input_precision=precision)
            if need_h:
                rows.rows_mm(acc, dz, weight[v0:v0 + cols], count, out_rows=order, bound="m", accumulate=True,
                             input_precision=precision)
        else:
            if need_w:
                grad_weight_chunk(grad_w[v0:v0 + cols], dz, hidden, accumulate=add)
            if need_h:
                accumulate_grad_hidden(acc, dz, weight[v0:v0 + cols], acc_cfg, precision)
        if need_b:
            if add:
                grad_b[v0:v0 + cols] += dbias[:, :cols].sum(dim=0)
            else:
                grad_b[v0:v0 + cols] = dbias[:, :cols].sum(dim=0)
    if fp32_acc:
        grad_h.copy_(acc)
    return grad_h, grad_w, grad_b


def _stored_dz(stored, order, target, lse, lse_lo, grad_loss, grad_lse, grad_entropy, entropy, dz, dbias, count,
               v, v0, cols, opts, cfg):
    """dz of columns [v0, v0 + cols) from the log-prob op's stored exp-logits (backward's ``stored``)."""
    e, m, st = stored
    n = dz.shape[0]
    lce_logprob_dz_kernel[(triton.cdiv(n, cfg.block_m) * triton.cdiv(cols, cfg.block_n),)](
        e, m, st if opts.softcap is not None else None, order, target, lse, lse_lo, grad_loss, grad_lse,
        grad_entropy, entropy, dz, dbias, count,
        n, e.shape[0], v, v0, cols,
        e.stride(0), dz.stride(0), dbias.stride(0),
        int(opts.ignore_index), *_options(opts),
        HAS_SOFTCAP=opts.softcap is not None, HAS_ENTROPY=grad_entropy is not None, HAS_ORDER=order is not None,
        NEED_DBIAS=dbias.numel() > 0, HAS_COUNT=count is not None,
        COUNT_ALIGN=rows.k_step(dz.dtype) if count is not None else 1,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
    )


# ---------------------------------------------------------------------------------------------
# log-probabilities, strategy store: the exp-logits of the first S rows kept for the backward
# ---------------------------------------------------------------------------------------------
def e_dtype(dtype: torch.dtype) -> torch.dtype:
    """The stored exp-logits' dtype: fp16 for 16-bit inputs (values in (0, 1]: 11 significant bits
    where bf16 keeps 8), fp32 for fp32 inputs and under the interpreter (whose fp32 -> 16-bit casts
    truncate)."""
    return torch.float32 if config.triton_interpret() or dtype == torch.float32 else torch.float16


def store_tile(dtype: torch.dtype) -> int:
    """The store forward's vocabulary tile for this input dtype (its partials are per tile)."""
    return configs.store_config(dtype).block_n


def stored_empty(like: Tensor, s, v, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Uninitialised ``e`` and ``m`` of log_probs_store for ``s`` stored rows: e (s, V) in
    ``e_dtype`` with its rows E_ROW_ALIGN elements apart (aligned rows: cuBLAS runs 2-5x slower on an
    unaligned leading dimension, launch.store), m (tiles, s) fp32. ``s`` and ``v`` may be SymInts
    (the op's fake): no negative floor division."""
    tile = store_tile(dtype)
    e = like.new_empty_strided((s, v), ((v + E_ROW_ALIGN - 1) // E_ROW_ALIGN * E_ROW_ALIGN, 1), dtype=e_dtype(dtype))
    return e, like.new_empty(((v + tile - 1) // tile, s), dtype=torch.float32)


def log_probs_store(
    hidden: Tensor,  # (N, D)
    weight: Tensor,  # (V, D)
    bias: Optional[Tensor],  # (V,)
    target: Tensor,  # (N,) int64
    opts: LossOptions,  # no label smoothing or z-loss; the temperature folded in
    need_entropy: bool,
    need_argmax: bool,
    store_rows: int,  # S: the first S rows keep their exp-logits (0 <= S <= N)
    skip_ignored: bool = False,  # nobody reads the ignored rows' lse: their logits are not computed
    *,
    count: Optional[Tensor] = None,  # (1,) int32: only the first count rows are computed (compacted)
) -> tuple[Tensor, ...]:
    """``log_probs_forward``'s five outputs, plus what the backward of the first ``store_rows`` rows
    needs instead of recomputing their logits: ``e`` (S, V) their exp-logits E = exp(z − m_tile) per
    vocabulary tile (``e_dtype``, rows padded: ``stored_empty``), ``m`` (tiles, S) the tile maxima and ``st``
    (S,) the target's sech² under a softcap (else (0,)). The first S rows run the store forward
    (store.lce_store_fwd_kernel, E written from the tile's exp: the GEMM and one [S, V] store in 16
    bits), the other rows the forward kernel. 2·N·D·V FLOPs, as the recompute forward.
    With ``skip_ignored`` where ``store_skips`` says so, the valid rows go first on the device, the
    first S of them keep their exp-logits and neither kernel computes a row past their count; the
    per-row outputs come back in row order (0 on the ignored rows), ``e``, ``m`` and ``st`` stay in
    the valid-first order, which ``log_probs_store_backward(compacted=True)`` finds again."""
    if store_skips(skip_ignored, hidden.dtype):
        order, valid_count = rows.compact(target != opts.ignore_index)
        out = log_probs_store(hidden.index_select(0, order), weight, bias, target.index_select(0, order), opts,
                              need_entropy, need_argmax, store_rows, count=valid_count)
        return (*_in_row_order(out[:5], order, valid_count), *out[5:])
    n = hidden.shape[0]
    v = weight.shape[0]
    dev = hidden.device
    s = max(0, min(int(store_rows), n))
    loss, lse, lse_lo = (torch.empty(n, dtype=torch.float32, device=dev) for _ in range(3))
    entropy = torch.empty(n if need_entropy else 0, dtype=torch.float32, device=dev)
    argmax = torch.empty(n if need_argmax else 0, dtype=torch.long, device=dev)
    e, m = stored_empty(hidden, s, v, hidden.dtype)
    st = torch.empty(s if opts.softcap is not None else 0, dtype=torch.float32, device=dev)
    for lo, hi, keep in ((0, s, True), (s, n, False)):
        if hi <= lo:
            continue
        sl = slice(lo, hi)
        extra = dict(entropy=entropy[sl] if need_entropy else None, argmax=argmax[sl] if need_argmax else None)
        outs = (loss[sl], lse[sl], lse_lo[sl])
        # with a count (compacted rows) each part computes its rows below it only
        part_count = None if count is None else (count - lo).clamp_(0, hi - lo).to(torch.int32)
        if keep:  # the stored rows: one split per vocabulary tile, E and the target's sech²
            cfg = configs.store_config(hidden.dtype)
            part = _forward_pass(hidden[sl], weight, bias, target[sl], opts, cfg, m.shape[0], 1, outs,
                                 e=e, st=st if opts.softcap is not None else None, e_sech2=False, count=part_count,
                                 **extra)
            m.copy_(part[0])
        else:
            cfg = configs.forward_config(hidden.dtype)
            _forward_pass(hidden[sl], weight, bias, target[sl], opts, cfg, *_splits(cfg, hidden[sl], v), outs,
                          count=part_count, **extra)
    return loss.neg_(), entropy, argmax, lse, lse_lo, e, m, st


def log_probs_store_backward(
    grad_loss: Tensor,  # (N,): −grad_log_probs
    grad_lse: Tensor,  # (N,)
    hidden: Tensor,  # (N, D)
    weight: Tensor,  # (V, D)
    bias: Optional[Tensor],  # (V,)
    target: Tensor,  # (N,) int64
    lse: Tensor,  # (N,) float32
    lse_lo: Tensor,  # (N,) float32
    opts: LossOptions,
    needs: tuple[bool, bool, bool],
    *,
    grad_entropy: Optional[Tensor],  # (N,) with entropy, or None
    entropy: Optional[Tensor],  # (N,) float32
    e: Tensor,  # (S, V) log_probs_store's
    m: Tensor,  # (tiles, S)
    st: Tensor,  # (S,) or (0,)
    in_place: bool = False,  # e is dropped after this backward: dz may be written over it
    compacted: bool = False,  # e holds the valid-first rows (log_probs_store's skip_ignored)
) -> tuple[Tensor, Tensor, Tensor]:
    """The log-prob op's gradients with its first S = e.shape[0] rows' dz from their stored
    exp-logits (``backward`` with ``stored``: two GEMMs) and the other rows' from recomputed logits
    (``backward``: three). Where both parts run, the recomputed rows go first and the stored rows'
    weight and bias gradients are added into theirs (``add_to``: one [V, D] buffer; each sum
    rounded once, the rounding of two row chunks: strategy.py's rule). ``in_place``: the stored
    rows' dz is written over ``e`` (``_stored_in_place``: two whole-vocabulary GEMMs, no chunks).
    ``compacted``: the forward put the valid rows first (the same stable order, found again from the
    target here): every per-row input follows it, and grad_hidden goes back through it. e's rows past
    the valid count were never written: the in-place backward stops at the count (``_stored_in_place``),
    the chunked one reads only rows with an incoming gradient (``backward``'s compaction)."""
    if compacted and e.shape[0] > 0:
        order, count = rows.compact(target != opts.ignore_index)
        pick = [None if x is None else x.index_select(0, order)
                for x in (grad_loss, grad_lse, hidden, target, lse, lse_lo, grad_entropy, entropy)]
        gl, gs, h, t, ls, ll, ge, en = pick
        grads = _store_backward_parts(gl, gs, h, weight, bias, t, ls, ll, opts, needs, ge, en, (e, m, st), in_place,
                                      count)
        if needs[0]:
            grads = (torch.empty_like(grads[0]).index_copy_(0, order, grads[0]), *grads[1:])
        return grads
    return _store_backward_parts(grad_loss, grad_lse, hidden, weight, bias, target, lse, lse_lo, opts, needs,
                                 grad_entropy, entropy, (e, m, st), in_place, None)


def _store_backward_parts(grad_loss, grad_lse, hidden, weight, bias, target, lse, lse_lo, opts, needs, grad_entropy,
                          entropy, stored, in_place, count) -> tuple[Tensor, Tensor, Tensor]:
    """``log_probs_store_backward`` in row order of ``e``: the recomputed rows, then the stored ones;
    ``count`` the valid rows of a compacted ``e``."""
    e, m, st = stored
    n, s = hidden.shape[0], e.shape[0]
    grads = None
    for lo, hi, kept in ((s, n, False), (0, s, True)):
        if hi <= lo and (hi > 0 or grads is not None):  # (no rows at all: one empty call below)
            continue
        sl = slice(lo, hi)
        ent = dict(grad_entropy=None if grad_entropy is None else grad_entropy[sl],
                   entropy=None if entropy is None else entropy[sl])
        add_to = None if grads is None else grads[1:]
        if kept and in_place and hi > lo:
            part = _stored_in_place(grad_loss[sl], grad_lse[sl], hidden[sl], weight, bias, target[sl], lse[sl],
                                    lse_lo[sl], opts, needs, (e, m, st), add_to, count=count, **ent)
        else:
            part = backward(grad_loss[sl], grad_lse[sl], hidden[sl], weight, bias, target[sl], lse[sl], lse_lo[sl],
                            opts, needs, stored=(e, m, st) if kept else None, add_to=add_to, **ent)
        # the stored rows come first in grad_hidden
        grads = part if grads is None else (torch.cat((part[0], grads[0])) if needs[0] else part[0], *part[1:])
    return grads


def store_skips(skip_ignored: bool, dtype: torch.dtype) -> bool:
    """Whether ``log_probs_store`` with these arguments computes the valid rows alone (and keeps
    them valid-first): asked to, and rows the backward compacts."""
    return skip_ignored and rows.compacts(dtype)


def _stored_in_place(grad_loss, grad_lse, hidden, weight, bias, target, lse, lse_lo, opts, needs, stored, add_to,
                     *, grad_entropy, entropy, count=None) -> tuple[Tensor, Tensor, Tensor]:
    """``backward`` with ``stored`` for a stored ``e`` nobody reads after this backward: dz of every
    stored row and column is written over e (the same element size: fp16 exp-logits become bf16 dz,
    fp32 stay fp32; each tile is read before it is written), then grad_hidden = dz @ W and
    grad_weight (+)= dzᵀ @ hidden are two whole-vocabulary GEMMs (``rows.rows_mm`` or cuBLAS, fp32
    accumulation, each result rounded once) instead of ``backward``'s vocabulary chunks adding into
    an fp32 [N, D] accumulator. Every row is walked: rows with no incoming gradient get a zero dz (no
    row compaction: a compacted dz could not overwrite its own rows). No memory beyond the gradients
    and, with a bias, the [N/BLOCK_M, V] fp32 column partials. With ``count`` (the forward compacted
    the rows, valid first: e's rows past the count were never written) the dz kernel stops at the
    count (zeros up to the next K step) and both GEMMs stop at it too: the other rows' grad_hidden is
    0. Without it 16-bit rows take the same GEMMs over every row, so that the pass, which compacts
    nothing where no row is ignored, gives the functional API's bits (the API compacts 16-bit rows
    unless asked for the argmax); fp32 rows keep cuBLAS's (``rows.mm_suits``)."""
    e, m, st = stored
    need_h, need_w, need_b = needs
    need_b = need_b and bias is not None
    n, d = hidden.shape
    v = weight.shape[0]
    cfg = configs.store_dz_config(configs.store_config(hidden.dtype))
    # the interpreter's dz is fp32 (backward's rounding note), as are its exp-logits (e_dtype)
    dz = e.view(torch.float32 if config.triton_interpret() else hidden.dtype)
    num_m = triton.cdiv(n, cfg.block_m)
    dbias = torch.empty((num_m, v) if need_b else (0, 0), dtype=torch.float32, device=hidden.device)
    grad_loss, grad_lse, target, lse, lse_lo = (t.contiguous() for t in (grad_loss, grad_lse, target, lse, lse_lo))
    if grad_entropy is not None:
        grad_entropy, entropy = grad_entropy.contiguous(), entropy.contiguous()
    _stored_dz(stored, None, target, lse, lse_lo, grad_loss, grad_lse, grad_entropy, entropy, dz, dbias, count,
               v, 0, v, opts, cfg)
    dz = dz.to(hidden.dtype)
    every = count is None and rows.mm_suits(hidden.dtype)  # none ignored: rows_mm over the full count
    if every:
        count = torch.full((1,), n, dtype=torch.int32, device=hidden.device)
    if count is not None:
        precision = _input_precision(hidden.dtype)
        grad_h = (torch.empty if every else torch.zeros)((n, d) if need_h else (0,), dtype=hidden.dtype,
                                                          device=hidden.device)
        grad_w, grad_b = _weight_grads(weight, bias, need_w, need_b, add_to)
        if need_h:
            rows.rows_mm(grad_h, dz, weight, count, bound="m", input_precision=precision)
        if need_w:
            rows.rows_mm(grad_w, dz, hidden, count, bound="k", trans_a=True, accumulate=add_to is not None,
                         input_precision=precision)
        _bias_grad(grad_b, dbias, need_b, add_to)
        return grad_h, grad_w, grad_b
    grad_h = torch.empty((n, d) if need_h else (0,), dtype=hidden.dtype, device=hidden.device)
    if need_h:
        _mm_into(grad_h, dz, weight, accumulate=False)
    grad_w, grad_b = _weight_grads(weight, bias, need_w, need_b, add_to)
    if need_w:
        grad_weight_chunk(grad_w, dz, hidden, accumulate=add_to is not None)
    _bias_grad(grad_b, dbias, need_b, add_to)
    return grad_h, grad_w, grad_b


def _bias_grad(grad_b, dbias, need_b, add_to) -> None:
    """The bias gradient from the dz kernel's per-row-block column partials, added where ``add_to``."""
    if need_b:
        col = dbias.sum(dim=0)
        grad_b.copy_(grad_b.float() + col if add_to is not None else col)


# ---------------------------------------------------------------------------------------------
# store: loss and gradients in one pass over row chunks
# ---------------------------------------------------------------------------------------------
def _mm_into(out: Tensor, a: Tensor, b: Tensor, accumulate: bool) -> None:
    """out (+)= a @ b with fp32 accumulation and one rounding to out's dtype (cuBLAS on CUDA; on
    CPU tensors, interpreter tests only, in fp32 and copied)."""
    if out.device.type == "cpu" and out.dtype != torch.float32:
        prod = a.float() @ b.float()
        out.copy_(out.float() + prod if accumulate else prod)
    elif accumulate:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)


SCALE_BLOCK = 8192


def scaled(g: Tensor, s: Tensor, in_place: bool = False) -> Tensor:
    """``g * s`` for a gradient ``g`` and a 0-dim upstream gradient ``s`` (store's backward), the
    same bits, in one blocked pass where ``g``'s storage is dense (any dense strides: the result
    keeps them); ``g * s`` otherwise. ``in_place``: into ``g`` itself (returned), and on the GPU no
    memory traffic at all when ``s`` is 1, which the kernel reads on the device (no host sync)."""
    if g.numel() == 0 or s.numel() != 1 or not _dense(g):
        return g.mul_(s) if in_place else g * s
    # the interpreter truncates fp32 -> 16-bit casts (backward's dz_dtype): fp32 there, torch rounds
    interpret = config.triton_interpret() and g.dtype != torch.float32
    direct = in_place and not interpret
    out = g if direct else torch.empty_like(g, dtype=torch.float32 if interpret else g.dtype)
    scale_kernel[(triton.cdiv(g.numel(), SCALE_BLOCK),)](g, out, s.reshape(()), g.numel(), BLOCK=SCALE_BLOCK,
                                                         IN_PLACE=direct, num_warps=8)
    if interpret:
        return g.copy_(out) if in_place else out.to(g.dtype)
    return out


def _dense(t: Tensor) -> bool:
    """Whether ``t`` fills its storage span without gaps or overlaps (any order of strides), so that
    an elementwise pass can walk it as flat memory and ``empty_like`` gives the same layout."""
    if t.dim() == 2 and t.t().is_contiguous():
        return True
    return t.is_contiguous()


def store(
    hidden: Tensor,  # (N, D)
    weight: Tensor,  # (V, D)
    bias: Optional[Tensor],  # (V,)
    target: Tensor,  # (N,) int64
    opts: LossOptions,
    reduction: str,  # "mean" | "sum"
    chunk_rows: int,  # rows per chunk (0: all rows at once)
    needs: tuple[bool, bool, bool],
    *,
    fp32_accumulate: bool,  # grad_weight accumulates over the chunks in an fp32 [V, D] buffer
    cfg: Optional[KernelConfig] = None,
    logits: Optional[Tensor] = None,  # (N, V): receives hidden @ weight.T + bias (write_logits)
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The reduced loss (0-dim fp32) and its gradients (hidden, weight, bias) from one pass over row
    chunks (store.py has the steps); a gradient not in ``needs`` is an empty (0,) tensor.
    ``fp32_accumulate`` is the caller's decision (the op's: ``strategy.fp32_accumulate``, the precision
    rule; the benchmark's ``--store-options``); without it grad_weight is accumulated in its own dtype."""
    need_h, need_w, need_b = needs
    need_b = need_b and bias is not None
    n, d = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    grad_h = torch.empty((n, d) if need_h else (0,), dtype=hidden.dtype, device=dev)
    grad_w = _grad_weight_buffer(weight, need_w)
    b_dtype = weight.dtype if bias is None else bias.dtype
    grad_b = torch.zeros((v,) if need_b else (0,), dtype=torch.float32, device=dev)
    target = target.contiguous()
    valid = target != opts.ignore_index
    g = reduction_weights(valid, reduction, torch.float32)  # d(reduced loss) / d(row loss)
    rows_loss, lse, lse_lo = (torch.empty(n, dtype=torch.float32, device=dev) for _ in range(3))
    if n == 0:
        grad_w.zero_()
        return reduced(rows_loss.sum(), valid, reduction), grad_h, grad_w, grad_b.to(b_dtype)

    cfg = cfg or configs.store_config(hidden.dtype)
    chunk = min(n, chunk_rows or n)
    num_tiles = triton.cdiv(v, cfg.block_n)
    fp32_acc = fp32_accumulate and need_w
    acc_w = torch.zeros(weight.shape, dtype=torch.float32, device=dev) if fp32_acc else None
    interpret = config.triton_interpret()
    e_type = e_dtype(hidden.dtype)  # fp16 for 16-bit inputs, fp32 for fp32 and under the interpreter
    # rows padded to a multiple of E_ROW_ALIGN elements: cuBLAS runs dz·W and dzᵀ·h 2-5x slower
    # on an unaligned leading dimension (V = 50257: the dW GEMM took 13 ms instead of ~3)
    e_buf = torch.empty((chunk, -(-v // E_ROW_ALIGN) * E_ROW_ALIGN), dtype=e_type, device=dev)[:, :v]
    dz_dtype = e_type if interpret else hidden.dtype
    need_st = opts.softcap is not None
    st = torch.empty(n if need_st else 0, dtype=torch.float32, device=dev)
    dz_cfg = configs.store_dz_config(cfg)
    dbias = torch.empty((triton.cdiv(chunk, dz_cfg.block_m), v) if need_b else (0, 0), dtype=torch.float32,
                        device=dev)
    acc_cfg = configs.acc_mm_config(hidden.dtype)
    precision = _input_precision(hidden.dtype)
    # rows.py: the valid rows first and each chunk's count of them on the device; every kernel and
    # both GEMMs stop there (not with logits to return: those need every row)
    skip = logits is None and rows.compacts(hidden.dtype)
    if skip:
        order, count = rows.compact(valid)
        hidden, target, g = (t.index_select(0, order) for t in (hidden, target, g))
        counts = (count - torch.arange(0, n, chunk, device=dev, dtype=torch.int32)).clamp_(0, chunk)
        if need_h:
            grad_h.zero_()  # the ignored rows' gradient; the valid rows are written through `order`
    # one chunk of compacted rows: its two products are the gradients (rows.row_grads makes grad_weight)
    whole = skip and chunk >= n and not fp32_acc
    if whole and need_w:
        grad_w = None

    for i, r0 in enumerate(range(0, n, chunk)):
        sl = slice(r0, min(n, r0 + chunk))
        m = sl.stop - sl.start
        h_c, t_c = hidden[sl], target[sl]
        cnt = counts[i:i + 1] if skip else None
        e = e_buf[:m]
        part = _forward_pass(h_c, weight, bias, t_c, opts, cfg, num_tiles, 1,
                             (rows_loss[sl], lse[sl], lse_lo[sl]), e=e, st=st[sl] if need_st else None,
                             logits=None if logits is None else logits[sl], count=cnt)
        dz = e.view(dz_dtype) if dz_dtype.itemsize == e_type.itemsize else e
        lce_store_dz_kernel[(triton.cdiv(m, dz_cfg.block_m) * num_tiles,)](
            e, dz, part, t_c, lse[sl], lse_lo[sl], st[sl] if need_st else None, g[sl], dbias, cnt,
            m, v,
            e.stride(0), dz.stride(0), dbias.stride(0),
            int(opts.ignore_index), *_smoothing_coefs(opts, v), float(opts.label_smoothing), float(opts.logit_scale),
            float(opts.z_loss),
            HAS_SOFTCAP=need_st, NEED_DBIAS=need_b,
            BLOCK_M=dz_cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=dz_cfg.group_m,
            HAS_COUNT=skip, COUNT_ALIGN=rows.k_step(hidden.dtype) if skip else 1,
            num_warps=dz_cfg.num_warps,
        )
        dz = dz.to(hidden.dtype)
        if whole:
            made = rows.row_grads(dz, weight, h_c, cnt, order, grad_h if need_h else None, need_w, precision)
            grad_w = made if need_w else grad_w
        elif skip:
            if need_h:
                rows.rows_mm(grad_h, dz, weight, cnt, out_rows=order[sl], bound="m", input_precision=precision)
            if need_w:
                rows.rows_mm(acc_w if fp32_acc else grad_w, dz, h_c, cnt, bound="k", trans_a=True, accumulate=i > 0,
                             input_precision=precision)
        else:
            if need_h:
                _mm_into(grad_h[sl], dz, weight, accumulate=False)
            if need_w:
                if fp32_acc:
                    accumulate_grad_hidden(acc_w, dz.t(), h_c, acc_cfg, precision)
                else:
                    _mm_into(grad_w, dz.t(), h_c, accumulate=i > 0)
        if need_b:
            grad_b += dbias[: triton.cdiv(m, dz_cfg.block_m)].sum(dim=0)
    if fp32_acc:
        grad_w.copy_(acc_w)
    return reduced(rows_loss.sum(), valid, reduction), grad_h, grad_w, grad_b.to(b_dtype)
