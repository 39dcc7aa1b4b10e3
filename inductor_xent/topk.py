"""Per-row top-k of an lm_head's logits or log-probs without the ``[N, V]`` logits (issue 25, item 2),
the log-probs renormalised over each row's top-k kept set built on it, and over a top-p (nucleus)
kept set (item 3: ``inductor_xent::linear_nucleus_logprob``: each row's kept set from its largest
logits where they hold it, else from the row sorted).

With ``u = softcap·tanh(z·scale/softcap)`` (``u = z·scale`` without a softcap; a temperature ``T``
is folded in as for the log-prob op, ``options.fold_temperature``) and ``z = hidden @ weight.T + bias``:

* values, indices: the ``k`` largest ``u`` of each row and their columns, largest first
  (``torch.topk(u, k)``), or with ``log_probs`` the ``k`` largest ``u − logsumexp(u)`` (the same
  columns: the log-softmax is monotone in ``u``);
* the kept-set log-prob of a target ``t`` over the top-k set ``K`` (``kept_log_probs``):
  ``u_t − logsumexp_K(u)`` where ``t ∈ K``, ``−inf`` where it is not (what eager's
  ``masked_fill(u < kth, −inf).log_softmax(-1).gather(...)`` gives, gradients included).

The op runs over row chunks sized from a memory budget: each chunk's logits come from one GEMM
(cuBLAS on CUDA: the same logits as eager's matmul) and a top-k over them in their own dtype
(the scale, softcap and log-softmax are increasing, so the raw logits' top-k columns are those of
any of them: eager's ``torch.topk(z, k)`` for the raw logits, up to the order of ties). On CUDA the
top-k reads each row's block maxima first (``row_topk``: blocks of ``BLOCK`` columns) and runs
``torch.topk`` over the k blocks with the largest maxima only, which hold every one of the row's k
largest values; the values are then scaled,
capped and normalised in the compute dtype, and a log-probs top-k takes each row's logsumexp in one
more pass over the chunk (compiled by Inductor on CUDA). Ties that rounding creates (eager's
``log_softmax`` of bf16 logits rounds the log-probs to bf16 too) may be broken differently from
eager's, as torch.topk documents no order among ties.

``inductor_xent::linear_topk(hidden, weight, bias, k, logit_scale, softcap, log_probs) -> (values,
indices, lse)``: values (N, k) in the compute dtype (fp32 for 16-bit inputs), indices (N, k) int64,
lse (N,) (empty (0,) without ``log_probs``; not differentiable). Differentiable in values; its
backward ``inductor_xent::linear_topk_bwd`` recomputes each chunk's logits (three GEMMs per chunk, as
eager's backward of the matmul after its own forward's) and scatters the incoming gradients at the
indices (minus the softmax times their sum for log-probs): deterministic, no atomics.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from . import config, options, strategy
from .ops import _without_autocast
from .options import compute_dtype

# a chunk's bytes per logit: the logits in the input dtype and two compute-dtype copies (the
# backward's u and dz; the forward keeps the logits and torch.topk's scratch)
BYTES_PER_LOGIT = 2 + 4 + 4
# a chunk's working set on a GPU: GEMMs of a few thousand rows run near cuBLAS's peak
CUDA_CHUNK_BYTES = 2 * 2**30
# columns per block of row_topk's prefilter (llama3's 128256 = 4008 blocks). H100, llama3-8b, k = 64,
# forward medians of 3 rounds: 32 columns 13.79 ms, 64 14.06, 128 14.10 (the GEMM 11.81; NOTES.md,
# wave 3 seventh session): fewer candidates (k·BLOCK) for the second torch.topk, more maxima for the first
BLOCK = 32


class TopK(NamedTuple):
    """``linear_topk``'s result, as ``torch.topk``'s: values and indices, each ``[..., k]``."""

    values: Tensor
    indices: Tensor


def by_blocks(z: Tensor, k: int) -> bool:
    """Whether ``row_topk`` reads block maxima by default: on CUDA, where the k blocks read at most a
    quarter of the row."""
    return z.is_cuda and _blocks_fit(z.shape[-1], k)


def _blocks_fit(v: int, k: int) -> bool:
    return k <= v // BLOCK and 4 * k * BLOCK <= v


def row_topk(z: Tensor, k: int, blocks: Optional[bool] = None, maxima: Optional[Tensor] = None,
             ) -> tuple[Tensor, Tensor]:
    """``torch.topk(z, k, dim=-1)`` of a 2-D ``z``: the same values, and columns holding them (among
    equal values any of them, as torch.topk documents no order among ties).

    ``blocks`` (default ``by_blocks``: on CUDA, where ``torch.topk`` of a 128k-column row costs 65 % of
    the logits GEMM) reads the maxima of blocks of ``BLOCK`` columns (``maxima``, when the caller has
    them: ``block_stats``), takes the ``k`` blocks with the largest
    maxima and ``torch.topk`` of their ``k·BLOCK`` values (and of the last, partial block's). Those
    blocks hold the k largest values: a block whose maximum ranks below k among the blocks' has k
    blocks at least as large, so k values at least as large. NaN counts as the largest value, as in
    torch.topk. Falls back to ``torch.topk`` of the whole row where the blocks would read more than a
    quarter of it."""
    n, v = z.shape
    whole = v // BLOCK
    if not (by_blocks(z, k) if blocks is None else blocks and _blocks_fit(v, k)):
        top = torch.topk(z, k, dim=-1)
        return top.values, top.indices
    tiles = z[:, : whole * BLOCK].unflatten(1, (whole, BLOCK))
    # (n, k) block numbers, in any order (the candidates' own top-k sorts)
    picked = torch.topk(tiles.amax(-1) if maxima is None else maxima, k, dim=-1, sorted=False).indices
    candidates = tiles.gather(1, picked[..., None].expand(n, k, BLOCK)).flatten(1)
    if whole * BLOCK < v:  # the partial block: always a candidate
        candidates = torch.cat([candidates, z[:, whole * BLOCK:]], 1)
    values, at = torch.topk(candidates, k, dim=-1)
    in_blocks = at < k * BLOCK
    block = picked.gather(1, torch.where(in_blocks, at // BLOCK, 0))
    columns = torch.where(in_blocks, block * BLOCK + at % BLOCK, at - k * BLOCK + whole * BLOCK)
    return values, columns


def chunk_budget(device: torch.device) -> int:
    """Bytes a chunk's working set may take: CUDA_CHUNK_BYTES on a GPU, the chunked CPU path's budget else."""
    return CUDA_CHUNK_BYTES if device.type == "cuda" else config.fallback_chunk_bytes


def chunk_rows(n: int, v: int, device: torch.device, per_logit: int = BYTES_PER_LOGIT) -> int:
    return max(1, min(n, chunk_budget(device) // max(1, v * per_logit)))


def _scaled(z: Tensor, logit_scale: float, softcap: Optional[float]) -> tuple[Tensor, Optional[Tensor]]:
    """(u, x): the scaled (and capped) logits in the compute dtype, and ``x = z·scale/softcap`` under
    a softcap (its derivative's ``sech²(x)``), else None."""
    u = z.to(compute_dtype(z.dtype))
    if logit_scale != 1.0:
        u = u * logit_scale
    if softcap is None:
        return u, None
    x = u / softcap
    return torch.tanh(x) * softcap, x


def _lse_of(z: Tensor, logit_scale: float, softcap: Optional[float]) -> Tensor:
    """logsumexp over each row of the scaled (and capped) logits, from the logits in their dtype."""
    return torch.logsumexp(_scaled(z, logit_scale, softcap)[0], dim=-1)


def block_stats(z: Tensor, logit_scale: float, softcap: Optional[float], log_probs: bool,
                ) -> tuple[Tensor, Optional[Tensor]]:
    """One pass over ``z`` (n, v) for ``row_topk`` and the log-probs: the maxima of its whole blocks of
    ``BLOCK`` columns (n, v // BLOCK) in z's dtype, and with ``log_probs`` each row's logsumexp of the
    scaled (and capped) logits, from each block's maximum and sum of exponentials (compiled on CUDA
    into one kernel reading the logits once: ``_for``)."""
    n, v = z.shape
    whole = v // BLOCK
    tiles = z[:, : whole * BLOCK].unflatten(1, (whole, BLOCK))
    top = tiles.amax(-1)
    if not log_probs:
        return top, None
    # u is increasing in z: a block's largest u is u of its largest z. An infinite maximum shifts by 0
    # (a block of -inf sums to 0 there, so contributes -inf; one holding +inf gives +inf)
    m = _scaled(top, logit_scale, softcap)[0]
    shift = torch.where(torch.isinf(m), 0.0, m)
    parts = shift + torch.log(torch.exp(_scaled(tiles, logit_scale, softcap)[0] - shift[..., None]).sum(-1))
    if whole * BLOCK < v:  # the partial last block
        rest = _scaled(z[:, whole * BLOCK:], logit_scale, softcap)[0]
        parts = torch.cat([parts, torch.logsumexp(rest, -1, keepdim=True)], 1)
    return top, torch.logsumexp(parts, -1)


_COMPILED: dict = {}


def _for(device: torch.device, fn):
    """``fn`` compiled once by Inductor on CUDA (``_lse_of``: one reduction over the 16-bit logits, no
    fp32 copy of the chunk; ``block_stats``: a persistent reduction per block); eager elsewhere."""
    if device.type != "cuda":
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = options.compiled_per_row(fn)  # one graph whatever the chunk's rows: the same bits
    return _COMPILED[fn]


def _forward(hidden, weight, bias, k: int, logit_scale: float, softcap: Optional[float], log_probs: bool):
    n, v = hidden.shape[0], weight.shape[0]
    cd = compute_dtype(hidden.dtype)
    values = hidden.new_empty((n, k), dtype=cd)
    indices = hidden.new_empty((n, k), dtype=torch.long)
    lse = hidden.new_empty((n,) if log_probs else (0,), dtype=cd)
    # the forward keeps only the chunk's logits (and the top-k's scratch over a fraction of them)
    step = chunk_rows(n, v, hidden.device, hidden.element_size() + 2)
    lse_fn, stats_fn = _for(hidden.device, _lse_of), _for(hidden.device, block_stats)
    for start in range(0, n, step):
        sl = slice(start, min(n, start + step))
        z = F.linear(hidden[sl], weight, bias)
        # the scale (positive), softcap and log-softmax are increasing in z, and the compute dtype holds
        # every value of z apart: the top-k of the raw logits picks the columns of eager's top-k of any
        # of them, in z's own dtype (half the bytes of an fp32 copy)
        if by_blocks(z, k):  # the block maxima and the logsumexp in one pass over the logits
            maxima, row_lse = stats_fn(z, logit_scale, softcap, log_probs)
            top_values, top_indices = row_topk(z, k, True, maxima)
        else:
            top_values, top_indices = row_topk(z, k, False)
            row_lse = lse_fn(z, logit_scale, softcap) if log_probs else None
        values[sl], indices[sl] = _scaled(top_values, logit_scale, softcap)[0], top_indices
        if log_probs:
            lse[sl] = row_lse
            values[sl] -= lse[sl, None]
    return values, indices, lse


def logits_rows(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], sl: slice, kept: Optional[Tensor] = None
                ) -> Tensor:
    """The logits of rows ``sl``: ``kept``'s for the rows it holds (the first ``len(kept)`` rows' logits,
    kept by a store forward), one GEMM for the others."""
    s = 0 if kept is None else kept.shape[0]
    if sl.stop <= s:
        return kept[sl]
    if sl.start >= s:
        return F.linear(hidden[sl], weight, bias)
    return torch.cat([kept[sl.start:], F.linear(hidden[s:sl.stop], weight, bias)])


def _backward(grad_values, hidden, weight, bias, indices, lse, logit_scale: float, softcap: Optional[float],
              log_probs: bool, needs: tuple[bool, bool, bool], run_sums=None, kept: Optional[Tensor] = None):
    """(grad_hidden, grad_weight, grad_bias) of ``values`` (the logits or log-probs at ``indices``):
    ``run_sums(indices, g)`` sums each row's incoming gradients over equal ids (gathered.py) where
    a row may hold an id twice (a top-k's never does); ``kept``: the first rows' logits, kept by the
    forward (``logits_rows``)."""
    g_all = grad_values.to(compute_dtype(hidden.dtype))
    dense_fn = _for(hidden.device, dense_dz)

    def dz_of(sl):
        # d(u_j − lse)/du = onehot_j − softmax(u): the softmax part over every column in one pass over
        # the recomputed logits, then the k columns' own values (computed whole in the compute dtype,
        # rounded once) written over it; the scale and the softcap's sech² applied in both
        z, g, idx = logits_rows(hidden, weight, bias, sl, kept), g_all[sl], indices[sl]
        total = g.sum(-1)
        if log_probs:
            dz = dense_fn(z, lse[sl], total, logit_scale, softcap)
        else:
            dz = torch.zeros_like(z)
        uk, xk = _scaled(z.gather(1, idx), logit_scale, softcap)
        gk = g if run_sums is None else run_sums(idx, g)  # equal ids write equal values
        dk = gk - torch.exp(uk - lse[sl, None]) * total[:, None] if log_probs else gk
        return dz.scatter_(1, idx, _dz_of_du(dk, xk, logit_scale).to(z.dtype)), None

    return _grads_from_du(hidden, weight, bias, needs, logit_scale, dz_of, gives_dz=True)


def _dz_of_du(du: Tensor, x: Optional[Tensor], logit_scale: float) -> Tensor:
    """dz = du·scale·sech²(x) (x: the softcap's argument; None without one)."""
    dz = du * logit_scale
    return dz if x is None else dz / torch.cosh(x).square()  # sech²(x): no cancellation where tanh saturates


def dense_dz(z: Tensor, lse: Tensor, total: Tensor, logit_scale: float, softcap: Optional[float]) -> Tensor:
    """The log-probs top-k's dz over every column, −softmax(u)·(sum of the row's incoming gradients),
    scaled and capped, in z's dtype (compiled on CUDA into one pass over the logits: ``_for``)."""
    u, x = _scaled(z, logit_scale, softcap)
    return _dz_of_du(-torch.exp(u - lse[:, None]) * total[:, None], x, logit_scale).to(z.dtype)


def _grads_from_du(hidden, weight, bias, needs: tuple[bool, bool, bool], logit_scale: float, du_of,
                   gives_dz: bool = False):
    """(grad_hidden, grad_weight, grad_bias) from each row chunk's ``du`` (the gradient with respect
    to the scaled, capped logits u, compute dtype): ``du_of(rows)`` gives it and the softcap's
    argument x (None without one). dz = du·scale·sech²(x) in the input dtype (``gives_dz``: ``du_of``
    gives dz itself), then dz @ W into the chunk's grad_hidden and dzᵀ @ h added into grad_weight (in
    fp32 where a 16-bit one would be rounded too often: strategy.fp32_accumulate); not-needed
    gradients are empty (0,)."""
    n, v = hidden.shape[0], weight.shape[0]
    cd = compute_dtype(hidden.dtype)
    step = chunk_rows(n, v, hidden.device)
    need_h, need_w, need_b = needs
    need_b = need_b and bias is not None
    grad_h = torch.empty_like(hidden) if need_h else hidden.new_empty(0)
    wide = strategy.fp32_accumulate(n, step, weight.element_size(), True)
    grad_w = torch.zeros(weight.shape, dtype=cd if wide else weight.dtype, device=weight.device) if need_w \
        else weight.new_empty(0)
    grad_b = torch.zeros(v, dtype=cd, device=weight.device) if need_b else weight.new_empty(0)
    for start in range(0, n, step):
        sl = slice(start, min(n, start + step))
        du, x = du_of(sl)
        if gives_dz:
            dz = du
        else:
            dz = du.mul_(logit_scale)
            if x is not None:
                dz *= x.cosh_().square_().reciprocal_()  # sech²(x), no cancellation where tanh saturates
            dz = dz.to(hidden.dtype)
        if need_h:
            grad_h[sl] = dz @ weight
        if need_w:
            if grad_w.dtype == dz.dtype:
                grad_w.addmm_(dz.t(), hidden[sl])
            elif dz.device.type == "cuda":
                torch.addmm(grad_w, dz.t(), hidden[sl], out_dtype=grad_w.dtype, out=grad_w)
            else:
                grad_w += dz.t().to(cd) @ hidden[sl].to(cd)
        if need_b:
            grad_b += dz.sum(0, dtype=cd)
    return grad_h, grad_w.to(weight.dtype), grad_b.to(bias.dtype) if need_b else grad_b


@torch.library.custom_op("inductor_xent::linear_topk", mutates_args=())
@_without_autocast
def linear_topk_fwd(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], k: int, logit_scale: float,
                    softcap: Optional[float], log_probs: bool) -> tuple[Tensor, Tensor, Tensor]:
    return _forward(hidden, weight, bias, k, logit_scale, softcap, log_probs)


@linear_topk_fwd.register_fake
def _(hidden, weight, bias, k, logit_scale, softcap, log_probs):
    n, cd = hidden.shape[0], compute_dtype(hidden.dtype)
    return (hidden.new_empty((n, k), dtype=cd), hidden.new_empty((n, k), dtype=torch.long),
            hidden.new_empty((n,) if log_probs else (0,), dtype=cd))


@torch.library.custom_op("inductor_xent::linear_topk_bwd", mutates_args=())
@_without_autocast
def linear_topk_bwd(grad_values: Tensor, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], indices: Tensor,
                    lse: Tensor, logit_scale: float, softcap: Optional[float], log_probs: bool, needs_hidden: bool,
                    needs_weight: bool, needs_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    return _backward(grad_values, hidden, weight, bias, indices, lse, logit_scale, softcap, log_probs,
                     (needs_hidden, needs_weight, needs_bias))


@linear_topk_bwd.register_fake
def _(grad_values, hidden, weight, bias, indices, lse, logit_scale, softcap, log_probs, needs_hidden, needs_weight,
      needs_bias):
    return _fake_grads(hidden, weight, bias, needs_hidden, needs_weight, needs_bias)


def _fake_grads(hidden, weight, bias, needs_hidden: bool, needs_weight: bool, needs_bias: bool) -> tuple:
    """A backward's (grad_hidden, grad_weight, grad_bias) as fakes: empty (0,) where not needed."""
    return (hidden.new_empty(hidden.shape) if needs_hidden else hidden.new_empty(0),
            weight.new_empty(weight.shape) if needs_weight else weight.new_empty(0),
            bias.new_empty(bias.shape) if needs_bias and bias is not None else weight.new_empty(0))


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, k, logit_scale, softcap, log_probs = inputs
    _, indices, lse = output
    ctx.save_for_backward(hidden, weight, bias, indices, lse)
    ctx.mark_non_differentiable(indices, lse)
    ctx.set_materialize_grads(False)
    ctx.options = (logit_scale, softcap, log_probs)


def _autograd_backward(ctx, grad_values, *_unused):
    hidden, weight, bias, indices, lse = ctx.saved_tensors
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    need_b = need_b and bias is not None
    if grad_values is None or not (need_h or need_w or need_b):
        return (None,) * 7
    gh, gw, gb = linear_topk_bwd(grad_values, hidden, weight, bias, indices, lse, *ctx.options, need_h, need_w, need_b)
    return gh if need_h else None, gw if need_w else None, gb if need_b else None, None, None, None, None


linear_topk_fwd.register_autograd(_autograd_backward, setup_context=_setup_context)

TOPK = torch.ops.inductor_xent.linear_topk.default
TOPK_BACKWARD = torch.ops.inductor_xent.linear_topk_bwd.default


# ---------------------------------------------------------------------------------------------
# top-p (nucleus) kept sets: a prefix of each row's logits in descending order, its logsumexp
# ---------------------------------------------------------------------------------------------
# The kept set of an LLM's row rarely reaches past its few hundred largest logits (top_p <= 0.95 at
# T <= 1), yet sorting every row of 128k columns costs ten logits GEMMs. A row whose NUCLEUS_CANDIDATES
# largest logits can hold its kept set reads it from them (row_topk: no sort); the others, flat rows
# among them, sort the whole row. Both give the same set: a prefix's mass depends on its values only.
NUCLEUS_CANDIDATES = 256
# a sorted row's bytes per column: its values in the compute dtype, sorted, their columns, and the
# kept prefix's probabilities, sums and masks (_sorted_edges)
SORT_BYTES_PER_LOGIT = 32
# Where a row's kept set goes on past the candidates (flat rows, at p < 1, without top_k or a softcap),
# its edge value is found by bisection over the row's values instead of a sort, on these devices:
# BISECT_STEPS passes of one compiled reduction over its 16-bit logits (``_bisected_edges``). H100,
# Llama-3 8B head, 8192 rows, T 0.7, p 0.9 (bench_topk --methods cublas,nucleus_ours,nucleus_bisect):
# flat rows (logit std 1, kept sets of ~56k columns) forward 100.6 ms against the sort's 152.1, forward +
# backward 152.5 against 194.7, 4948 MiB against 3360 at the peak; LLM-like rows (std 4, a few rows past
# the candidates) 16.22 against 16.29 ms. On CPU the sort is the cheaper one (each step is an eager pass
# over fp32 copies: 3-8x the sort's time on this project's CPU). A set decided within rounding of p may
# end one column off the sort's (its mass is summed in another order): 1-3 rows of 300 flat bf16 rows on
# CPU; none of 8192 against the fp32 spelling's in the GPU runs above.
BISECT_DEVICES: tuple = ("cuda",)
BISECT_STEPS = 33  # an fp32 order key spans 2**32 values: 32 halvings, one more to spare


def _kept_sorted(s: Tensor, k_rows: Optional[Tensor], p_rows: Optional[Tensor], top_p: float,
                 lse: Optional[Tensor] = None) -> Tensor:
    """The kept mask over one chunk's logits sorted in descending order (``s``, compute dtype): the
    first ``k_rows`` columns of each row (all without it), then of those the smallest prefix whose
    renormalised probability reaches the row's ``p_rows`` (without it ``top_p``; a column is kept
    while the mass before it is below it: the first always; HF's and vLLM's rule, ``cumsum(ascending)
    <= 1 − top_p`` removed). A row's p of 1 keeps every column, as a float ``top_p`` of 1 does.
    ``lse``: each row's logsumexp over all its columns, where ``s`` holds only its largest ones
    (without ``k_rows``; with it, ``s`` holds at least the first ``k_rows``)."""
    keep = torch.ones_like(s, dtype=torch.bool)
    if k_rows is not None:
        keep &= torch.arange(s.shape[1], device=s.device)[None, :] < k_rows[:, None]
    if p_rows is not None or top_p < 1.0:
        if lse is None or k_rows is not None:
            p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)
        else:
            p = torch.exp(s - lse[:, None])
        keep &= (p.cumsum(-1) - p) < _bound(p_rows, top_p, s.dtype)
    keep[:, 0] = True  # the largest column always (a p <= 0 would keep none)
    return keep


def _bound(p_rows: Optional[Tensor], top_p: float, dtype: torch.dtype) -> Union[float, Tensor]:
    """The kept mass of each row, (r, 1) (a row's p of 1 keeps every column), or ``top_p``."""
    return top_p if p_rows is None else torch.where(p_rows >= 1.0, float("inf"), p_rows.to(dtype))[:, None]


def _row_p(p_rows: Optional[Tensor], top_p: float, like: Tensor) -> Tensor:
    """Each row's p, (r,) in ``like``'s dtype: ``p_rows``, or ``top_p`` for every row."""
    return torch.full_like(like, top_p) if p_rows is None else p_rows.to(like.dtype)


def _prefix_edges(s: Tensor, keep_sorted: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(count, logsumexp, edge value) of each row's kept prefix of ``s`` (sorted in descending
    order; the prefix up to ``keep_sorted``'s first dropped column)."""
    count = torch.where(keep_sorted.all(1), keep_sorted.shape[1], (~keep_sorted).int().argmax(1))[:, None]
    cols = torch.arange(s.shape[1], device=s.device)[None, :]
    lse = torch.logsumexp(s.masked_fill(cols >= count, float("-inf")), dim=-1)
    return count, lse, s.gather(1, count - 1)[:, 0]


def _sorted_edges(u: Tensor, k_rows, p_rows, top_p, lse_all: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(logsumexp over the kept set, its last column in the stable descending order) of each row of
    ``u``, from the whole rows sorted (``lse_all``: their logsumexp, when known)."""
    s, order = torch.sort(u, dim=-1, descending=True, stable=True)  # stable: ties in column order
    count, lse, _ = _prefix_edges(s, _kept_sorted(s, k_rows, p_rows, top_p, lse_all))
    return lse, order.gather(1, count - 1)[:, 0]


def _candidate_rows(z: Tensor, scale, k_rows, p_rows, top_p, width: int) -> tuple[Tensor, Tensor, Tensor]:
    """(which rows' ``width`` largest logits may hold their kept set, each row's logsumexp, the
    maxima of its blocks of ``BLOCK`` columns for ``row_topk``, in z's dtype), from one pass over the
    logits ``z`` in their dtype (``block_stats``, compiled on CUDA; ``scale``: the logit scale and
    softcap). With ``k_rows``, rows of k <= width; without it, rows of p < 1 whose largest probability
    times width reaches p (else the first width columns hold less than p: the set goes on). Rows
    holding NaN or +inf sort whole, as eager does."""
    maxima, lse = _for(z.device, block_stats)(z, *scale, True)
    if k_rows is not None:
        maybe = k_rows <= width
    else:
        top = maxima.amax(-1)
        if maxima.shape[1] * BLOCK < z.shape[1]:  # the partial last block
            top = torch.maximum(top, z[:, maxima.shape[1] * BLOCK:].amax(-1))
        top = _scaled(top, *scale)[0]
        p = _row_p(p_rows, top_p, lse)
        maybe = (p < 1.0) & (width * torch.exp(top - lse) >= 0.99 * p)
    return maybe & torch.isfinite(lse), lse, maxima


def _candidate_edges(z: Tensor, scale, lse_all: Tensor, maxima: Tensor, maybe: Tensor, k_rows, p_rows, top_p,
                     width: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(logsumexp over the kept set, its edge column or -1, the edge's value, how many columns of that
    value the set keeps, found) of each row of the scaled logits ``u = _scaled(z, *scale)`` from its
    ``width`` largest logits; ``found`` is False where the kept set may go on past them or the row is
    not ``maybe`` (``_candidate_rows``; such rows' other values mean nothing). The edge column
    is the kept columns' last in the stable descending order: among those of the edge's value, the
    ``ties``-th in column order. It is read from the candidates' columns where the last candidate is
    below the edge (so every column of the edge's value is a candidate: u is nondecreasing in z, so a
    column of u above the last candidate's has z above it too), else left -1 (``_edge_columns`` ranks
    the whole row). The candidates come from z in its own dtype (the scale and softcap keep its order);
    only they are scaled."""
    s, columns = row_topk(z, width, maxima=maxima)  # largest first; among equal values any of their columns
    s = _scaled(s, *scale)[0]
    count, lse, edge_value = _prefix_edges(s, _kept_sorted(s, k_rows, p_rows, top_p, lse_all))
    found = maybe & (count[:, 0] < width) if k_rows is None else maybe
    tied = s == edge_value[:, None]
    ties = (tied & (torch.arange(width, device=z.device)[None, :] < count)).sum(1)
    ranked = torch.where(tied, columns, z.shape[1]).sort(-1).values  # the tied columns in column order
    edge = ranked.gather(1, (ties - 1).clamp_min(0)[:, None])[:, 0]  # (0 ties: a NaN row, sorted)
    return lse, torch.where(s[:, -1] < edge_value, edge, -1), edge_value, ties, found


def _edge_columns(u: Tensor, edge_value: Tensor, ties: Tensor) -> Tensor:
    """The last kept column in the stable descending order of each row of ``u``: among the columns
    equal to the edge's value, the one whose rank in column order is the number of them kept."""
    return _tied_column(u == edge_value[:, None], ties)


def _tied_column(tied: Tensor, ties: Tensor) -> Tensor:
    """Each row's column where the ``ties``-th True of ``tied`` is (its rank in column order)."""
    rank = tied.cumsum(-1, dtype=torch.int32)
    return (rank < ties[:, None]).sum(-1)


def _capturing(t: Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _nucleus_edges(z: Tensor, scale, k_rows, p_rows, top_p) -> tuple[Tensor, Tensor]:
    """(logsumexp over the kept set, the kept set's last column in the stable descending order) of
    each row of one chunk's logits ``z`` (in their dtype; ``scale``: the logit scale and softcap):
    from its largest logits where they hold the kept set, else sorted (every row while a CUDA graph is
    captured: choosing the rows reads their count on the host). Every row's candidates are read
    (``_candidate_edges``), then one host synchronisation counts the rows whose edge ties are ranked
    over the whole row and the rows that sort; only those are scaled whole (copies in the compute
    dtype), the sorted ones a sub-chunk at a time (``_sorted_rows``)."""
    width = NUCLEUS_CANDIDATES
    if width >= z.shape[1] or _capturing(z):
        return _sorted_rows(z, None, scale, k_rows, p_rows, top_p)
    maybe, lse_all, maxima = _candidate_rows(z, scale, k_rows, p_rows, top_p, width)
    lse, edge, edge_value, ties, found = _candidate_edges(z, scale, lse_all, maxima, maybe, k_rows, p_rows, top_p,
                                                          width)
    ranked = found & (edge < 0)  # ties that may reach past the candidates: ranked over the row
    rest = ~found
    bisect = rest & _bisectable(z, scale, k_rows, p_rows, top_p, lse_all)
    # the ranked rows, the rows that sort, the rows that bisect (a stable sort of their kinds), and
    # their counts
    kind = torch.where(ranked, 0, torch.where(found, 3, torch.where(bisect, 2, 1))).to(torch.uint8)
    order = torch.sort(kind, stable=True).indices
    n_ranked, n_sorted, n_bisect = torch.stack([ranked.sum(), (rest & ~bisect).sum(), bisect.sum()]).tolist()
    if n_ranked:  # (the one host sync above)
        r = order[:n_ranked]
        edge[r] = _edge_columns(_scaled(z[r], *scale)[0], edge_value[r], ties[r])
    if n_sorted:
        r = order[n_ranked:n_ranked + n_sorted]
        lse[r], edge[r] = _sorted_rows(z, r, scale, k_rows, p_rows, top_p, lse_all)
    if n_bisect:
        r = order[n_ranked + n_sorted:n_ranked + n_sorted + n_bisect]
        lse[r], edge[r] = _bisected_rows(z, r, scale[0], _rows(p_rows, r), top_p, lse_all[r])
    return lse, edge


def _bisectable(z: Tensor, scale, k_rows, p_rows, top_p, lse_all: Tensor) -> Tensor:
    """Which rows may find their kept set by bisection (``BISECT_DEVICES``): rows of p < 1 and a finite
    logsumexp, where there is no per-row k (the set is then a prefix of the top-k's) nor softcap
    (bisection compares scaled logits computed in a compiled pass: only a multiplication gives eager's
    bits there) and the compute dtype is fp32 (the order key's width)."""
    if (z.device.type not in BISECT_DEVICES or k_rows is not None or scale[1] is not None
            or compute_dtype(z.dtype) != torch.float32):
        return torch.zeros_like(lse_all, dtype=torch.bool)
    return (_row_p(p_rows, top_p, lse_all) < 1.0) & torch.isfinite(lse_all)


def _key(t: Tensor) -> Tensor:
    """fp32 values as int64 keys in the same order (the bits, the negatives' magnitude bits flipped)."""
    i = t.contiguous().view(torch.int32).long()
    return torch.where(i >= 0, i, i ^ 0x7FFFFFFF)


def _unkey(k: Tensor) -> Tensor:
    return torch.where(k >= 0, k, k ^ 0x7FFFFFFF).int().view(torch.float32)


def mass_at_least(z: Tensor, lse: Tensor, t: Tensor, logit_scale: float) -> Tensor:
    """Each row's probability mass over its columns whose scaled logit ``u = z·scale`` is at least
    ``t`` (compiled on CUDA into one reduction over the 16-bit logits: ``_for``)."""
    u = _scaled(z, logit_scale, None)[0]  # fp32 (bisection runs where that is the compute dtype)
    return torch.where(u >= t[:, None], torch.exp(u - lse[:, None]), 0.0).sum(-1)


def _bisected_rows(z: Tensor, rows: Tensor, logit_scale: float, p_rows: Optional[Tensor], top_p: float,
                   lse_all: Tensor) -> tuple[Tensor, Tensor]:
    """``_bisected_edges`` of the ``rows`` of ``z``, a sub-chunk at a time."""
    count = rows.shape[0]
    step = chunk_rows(count, z.shape[1], z.device)
    lse, edge = lse_all.new_empty((count,)), lse_all.new_empty((count,), dtype=torch.long)
    p = _row_p(p_rows, top_p, lse_all)
    for start in range(0, count, step):
        sl = slice(start, min(count, start + step))
        lse[sl], edge[sl] = _bisected_edges(z[rows[sl]], logit_scale, p[sl], lse_all[sl])
    return lse, edge


def _bisected_edges(z: Tensor, logit_scale: float, p: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """(logsumexp over the kept set, its edge column) of each row from its edge value τ: the largest
    value whose mass at or above it reaches p (the mass M(t) of the columns of u >= t falls as t rises
    and changes only at the row's values, so bisection over the values' order keys ends on one of them:
    the value of the last column the stable descending order keeps). The columns above τ are kept, and
    of the columns equal to τ, in column order, as many as the mass before each stays below p. M is
    summed in one fixed order, so it falls with t in floating point too; it is not eager's cumulative
    sum, so a set decided within rounding of p may end one column off eager's (as on a rollout engine).
    No sort: BISECT_STEPS reductions over the logits, then one pass for the ties' ranks."""
    mass = _for(z.device, mass_at_least)
    u_max, u_min = (_scaled(x, logit_scale, None)[0] for x in (z.amax(-1), z.amin(-1)))
    lo, hi = _key(u_min), _key(u_max) + 1  # M(lo) = 1 >= p; M(hi) = 0 < p
    for _ in range(BISECT_STEPS):
        mid = (lo + hi) // 2
        ok = mass(z, lse, _unkey(mid), logit_scale) >= p
        lo, hi = torch.where(ok, mid, lo), torch.where(ok, hi, mid)
    tau = _unkey(lo)
    above = mass(z, lse, _unkey(lo + 1), logit_scale)  # the columns above tau (the next value up): < p
    tied = _scaled(z, logit_scale, None)[0] == tau[:, None]  # (the fp32 copy freed at once)
    p_tau = torch.exp(tau - lse)
    ties = torch.minimum(torch.ceil((p - above) / p_tau).clamp_min(1).long(), tied.sum(-1))
    return lse + torch.log(above + ties * p_tau), _tied_column(tied, ties)


def _sorted_rows(z: Tensor, rows: Optional[Tensor], scale, k_rows, p_rows, top_p, lse_all: Optional[Tensor] = None,
                 ) -> tuple[Tensor, Tensor]:
    """``_sorted_edges`` of the ``rows`` of ``z`` (all of them where None), scaled and sorted a
    sub-chunk at a time (``SORT_BYTES_PER_LOGIT``: a sorted row holds its values, their columns and the
    prefix's masks and sums, several times the 16-bit logits the forward's chunk is sized for)."""
    count = z.shape[0] if rows is None else rows.shape[0]
    step = chunk_rows(count, z.shape[1], z.device, SORT_BYTES_PER_LOGIT)
    lse = z.new_empty((count,), dtype=compute_dtype(z.dtype))
    edge = z.new_empty((count,), dtype=torch.long)
    for start in range(0, count, step):
        sl = slice(start, min(count, start + step))
        r = sl if rows is None else rows[sl]
        lse[sl], edge[sl] = _sorted_edges(_scaled(z[r], *scale)[0], _rows(k_rows, r), _rows(p_rows, r), top_p,
                                          _rows(lse_all, r))
    return lse, edge


def _nucleus_chunk(hidden, weight, bias, target, k_rows, p_rows, top_p, logit_scale, softcap, ignore_index):
    """The forward of one row chunk: (the target's scaled logit, lse over the kept set, the kept set's
    edge column, the target kept, valid). The kept set is a prefix of the stable descending order (its first ``count``
    columns, ``_kept_sorted`` up to its first dropped column), so it is also every column above the
    edge column's value or equal to it at or before that column (``_kept``): the backward rebuilds it
    from the recomputed logits and the edge column without sorting. (The edge's column, not its
    value: a backward that chunks the rows otherwise rounds the logits otherwise.)"""
    z = F.linear(hidden, weight, bias)  # in its dtype: only the rows that sort are copied in the compute dtype
    scale = (logit_scale, softcap)
    lse, edge_col = _nucleus_edges(z, scale, k_rows, p_rows, top_p)
    valid = target != ignore_index
    t = torch.where(valid, target, 0)[:, None]
    u_t = _scaled(z.gather(1, t), *scale)[0]
    hit = _kept(u_t, _scaled(z.gather(1, edge_col[:, None]), *scale)[0][:, 0], edge_col, t)[:, 0] & valid
    return u_t[:, 0], lse, edge_col, hit, valid


def _kept(u: Tensor, edge_value: Tensor, edge_col: Tensor, cols: Optional[Tensor] = None) -> Tensor:
    """Which of ``u``'s columns (``cols``: their indices, default all) are in the kept prefix whose
    last column in the stable descending order is ``edge_col`` with value ``edge_value`` (per row).
    NaN sorts above every number (``torch.sort``'s order): NaN columns are kept before any other, and
    an edge of NaN keeps the NaN columns up to its own."""
    if cols is None:
        cols = torch.arange(u.shape[1], device=u.device)[None, :]
    value, col = edge_value[:, None], edge_col[:, None]
    nan = u.isnan()
    return torch.where(value.isnan(), nan & (cols <= col), nan | (u > value) | ((u == value) & (cols <= col)))


def _rows(t: Optional[Tensor], sl: Union[slice, Tensor]) -> Optional[Tensor]:
    return None if t is None else t[sl]


def _nucleus_forward(hidden, weight, bias, target, k_rows, p_rows, top_p, logit_scale, softcap, ignore_index):
    """(log-probs over the kept sets, their logsumexp, the kept sets' edge columns), (N,) each."""
    n, v = hidden.shape[0], weight.shape[0]
    cd = compute_dtype(hidden.dtype)
    out = hidden.new_empty((n,), dtype=cd)
    lse_all = hidden.new_empty((n,), dtype=cd)
    edge_col = hidden.new_empty((n,), dtype=torch.long)
    # a chunk holds its logits in their dtype and the candidates' scratch (the rows that sort more: _sorted_rows)
    step = chunk_rows(n, v, hidden.device, hidden.element_size() + 2)
    for start in range(0, n, step):
        sl = slice(start, min(n, start + step))
        u_t, lse, edge, hit, valid = _nucleus_chunk(hidden[sl], weight, bias, target[sl], _rows(k_rows, sl),
                                                    _rows(p_rows, sl), top_p, logit_scale, softcap, ignore_index)
        rows = torch.where(hit, u_t - lse, float("-inf"))
        out[sl] = torch.where(valid, rows, 0.0)
        lse_all[sl] = lse
        edge_col[sl] = edge
    return out, lse_all, edge_col


def _nucleus_backward(grad, hidden, weight, bias, target, lse, edge_col, logit_scale, softcap, ignore_index, needs):
    """d(log-prob over the kept set)/d(inputs) with the kept set a constant (as eager's masked_fill):
    du = g·(onehot(t)·[t kept] − p_kept), p_kept = softmax over the kept columns, 0 elsewhere. The
    kept set comes from the forward's edge column (``_kept``): the logits are recomputed, not sorted;
    each chunk's dz comes from its logits in one pass (``nucleus_dz``, compiled on CUDA without a
    softcap: ``_nucleus_dz_for``)."""
    cd = compute_dtype(hidden.dtype)
    g_all = grad.to(cd)
    dz_fn = _nucleus_dz_for(hidden.device, softcap)

    def dz_of(sl):
        valid = target[sl] != ignore_index
        g = torch.where(valid, g_all[sl], 0.0)  # an ignored row's gradient is 0: its target any column
        t = torch.where(valid, target[sl], 0)
        return dz_fn(F.linear(hidden[sl], weight, bias), edge_col[sl], lse[sl].to(cd), g, t, logit_scale,
                     softcap), None

    return _grads_from_du(hidden, weight, bias, needs, logit_scale, dz_of, gives_dz=True)


def _nucleus_dz_for(device: torch.device, softcap: Optional[float]):
    """``nucleus_dz`` compiled on CUDA (``_for``), eager under a softcap: the kept set compares scaled
    logits, and the forward scaled them eagerly; without a softcap the scale is one multiplication,
    the same bits compiled, but Inductor's tanh is not torch's to the last bit, and where tanh
    saturates that decides which columns tie with the edge (seen on CPU: other kept sets)."""
    return nucleus_dz if softcap is not None else _for(device, nucleus_dz)


def nucleus_dz(z: Tensor, edge_col: Tensor, lse: Tensor, g: Tensor, t: Tensor, logit_scale: float,
               softcap: Optional[float]) -> Tensor:
    """dz of one chunk's logits ``z`` for the kept-set log-probs: du = g·([column is t] − p) over the
    kept columns (the prefix up to ``edge_col``, ``_kept``; p = exp(u − lse)), 0 elsewhere, then times
    the scale and the softcap's sech², in z's dtype (compiled on CUDA into one pass over the logits:
    ``_for``; the edge's value is read from the same scaled logits, so the kept set is the one the
    forward's edge column names)."""
    u, x = _scaled(z, logit_scale, softcap)
    keep = _kept(u, u.gather(1, edge_col[:, None])[:, 0], edge_col)
    cols = torch.arange(z.shape[1], device=z.device)[None, :]
    gr = g[:, None]
    du = torch.where(keep, torch.where(cols == t[:, None], gr, 0.0) - torch.exp(u - lse[:, None]) * gr, 0.0)
    return _dz_of_du(du, x, logit_scale).to(z.dtype)


@torch.library.custom_op("inductor_xent::linear_nucleus_logprob", mutates_args=())
@_without_autocast
def linear_nucleus_logprob(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                           k_rows: Optional[Tensor], p_rows: Optional[Tensor], top_p: float, logit_scale: float,
                           softcap: Optional[float], ignore_index: int) -> tuple[Tensor, Tensor, Tensor]:
    """(log-probs over each row's top-k / top-p kept set, the kept set's logsumexp, its last column in
    the stable descending order), (N,) each; the nucleus mass is each row's ``p_rows`` (N,), or
    ``top_p`` for every row without it."""
    return _nucleus_forward(hidden, weight, bias, target, k_rows, p_rows, top_p, logit_scale, softcap, ignore_index)


@linear_nucleus_logprob.register_fake
def _(hidden, weight, bias, target, k_rows, p_rows, top_p, logit_scale, softcap, ignore_index):
    cd = compute_dtype(hidden.dtype)
    rows = hidden.shape[:1]
    return hidden.new_empty(rows, dtype=cd), hidden.new_empty(rows, dtype=cd), hidden.new_empty(rows, dtype=torch.long)


@torch.library.custom_op("inductor_xent::linear_nucleus_logprob_bwd", mutates_args=())
@_without_autocast
def linear_nucleus_logprob_bwd(grad: Tensor, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                               lse: Tensor, edge_col: Tensor, logit_scale: float, softcap: Optional[float],
                               ignore_index: int, needs_hidden: bool, needs_weight: bool,
                               needs_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    return _nucleus_backward(grad, hidden, weight, bias, target, lse, edge_col, logit_scale, softcap, ignore_index,
                             (needs_hidden, needs_weight, needs_bias))


@linear_nucleus_logprob_bwd.register_fake
def _(grad, hidden, weight, bias, target, lse, edge_col, logit_scale, softcap, ignore_index, needs_hidden,
      needs_weight, needs_bias):
    return _fake_grads(hidden, weight, bias, needs_hidden, needs_weight, needs_bias)


def _nucleus_setup_context(ctx, inputs, output):
    hidden, weight, bias, target, k_rows, p_rows, top_p, logit_scale, softcap, ignore_index = inputs
    _, lse, edge_col = output
    ctx.save_for_backward(hidden, weight, bias, target, lse, edge_col)
    ctx.mark_non_differentiable(lse, edge_col)
    ctx.set_materialize_grads(False)
    ctx.options = (logit_scale, softcap, ignore_index)


def _nucleus_autograd_backward(ctx, grad, *_unused):
    hidden, weight, bias, target, lse, edge_col = ctx.saved_tensors
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    need_b = need_b and bias is not None
    if grad is None or not (need_h or need_w or need_b):
        return (None,) * 10
    gh, gw, gb = linear_nucleus_logprob_bwd(grad, hidden, weight, bias, target, lse, edge_col, *ctx.options, need_h,
                                            need_w, need_b)
    return gh if need_h else None, gw if need_w else None, gb if need_b else None, *(None,) * 7


linear_nucleus_logprob.register_autograd(_nucleus_autograd_backward, setup_context=_nucleus_setup_context)
NUCLEUS = torch.ops.inductor_xent.linear_nucleus_logprob.default


def _check_k(k, v: int, name: str = "k") -> int:
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"{name} must be an int, got {type(k).__name__}")
    if not 1 <= k <= v:
        raise ValueError(f"{name} must be in [1, V] = [1, {v}], got {k}")
    return k


def _check_head(hidden: Tensor, weight: Tensor, bias: Optional[Tensor]) -> None:
    if not hidden.is_floating_point():
        raise TypeError(f"hidden must be a floating-point tensor, got {hidden.dtype}")
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden [..., D] and weight [V, D] do not match: {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    options.check_head_dtypes(hidden, weight, bias)


def _scale_and_cap(temperature, logit_scale, softcap) -> tuple[float, Optional[float]]:
    if not options.finite(float(logit_scale)):
        raise ValueError(f"logit_scale must be finite, got {logit_scale}")
    if softcap is not None and not (options.finite(float(softcap)) and float(softcap) > 0):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap}")
    return options.fold_temperature(float(logit_scale), None if softcap is None else float(softcap),
                                    options.check_temperature(temperature))


def linear_topk(
    hidden: Tensor,
    weight: Tensor,
    k: int,
    *,
    bias: Optional[Tensor] = None,
    log_probs: bool = False,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
) -> TopK:
    """The ``k`` largest logits of each row (``log_probs``: log-probabilities) and their vocabulary
    ids, largest first, without the ``[..., V]`` logits (module docstring). Equal, up to rounding
    and the order among ties, to::

        z = F.linear(hidden, weight, bias).float() * logit_scale      # then the softcap, / temperature
        torch.topk(F.log_softmax(z, -1) if log_probs else z, k)

    ``values`` are in the compute dtype (fp32 for 16-bit inputs) and differentiable; ``indices``
    int64; both ``[..., k]``. Inside ``torch.autocast`` the operands are cast as autocast casts them
    for ``F.linear``."""
    from .api import _autocast  # (api imports this module)

    hidden, weight, bias = _autocast(hidden, weight, bias)  # as F.linear under torch.autocast
    _check_head(hidden, weight, bias)
    k = _check_k(k, weight.shape[0])
    scale, cap = _scale_and_cap(temperature, logit_scale, softcap)
    h2 = hidden.reshape(-1, hidden.shape[-1])
    values, indices, _ = TOPK(h2, weight, bias, k, scale, cap, bool(log_probs))
    lead = hidden.shape[:-1]
    return TopK(values.reshape(*lead, k), indices.reshape(*lead, k))


def check_top_k(top_k: Union[int, Tensor], target: Tensor, v: int) -> int:
    """The largest k of ``top_k`` (one int, or one per row of ``target``: read with one host
    synchronisation), or ValueError / TypeError naming what is wrong."""
    if not isinstance(top_k, Tensor):
        return _check_k(top_k, v, "top_k")
    if top_k.shape != target.shape or top_k.dtype == torch.bool or top_k.is_floating_point() or top_k.is_complex():
        raise ValueError(f"a top_k tensor must hold integers, one per row of target {tuple(target.shape)}; "
                         f"got {top_k.dtype} {tuple(top_k.shape)}")
    lo, hi = (int(x) for x in torch.aminmax(top_k))
    if lo < 1 or hi > v:
        raise ValueError(f"every top_k must be in [1, V] = [1, {v}], got values in [{lo}, {hi}]")
    return hi


def nucleus(hidden2d: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
            top_k: Optional[Union[int, Tensor]], top_p: Union[float, Tensor], logit_scale: float,
            softcap: Optional[float], ignore_index: int) -> Tensor:
    """``linear_log_probs(..., top_p=)`` on 2-D inputs: the log-prob of ``target`` over each row's
    kept set, its ``top_k`` largest logits (all without ``top_k``) and of those the smallest prefix
    whose renormalised probability reaches ``top_p`` (one number, or a floating tensor of
    ``target``'s shape: one per row, as a rollout engine's per-request sampling parameters;
    ``_kept_sorted``); −inf where the target is outside it, 0 on ignored rows (the op
    ``inductor_xent::linear_nucleus_logprob``: each row chunk's logits sorted, O(chunk · V) memory)."""
    p_rows = check_top_p(top_p, target)
    k_rows = None
    if top_k is not None:
        check_top_k(top_k, target, weight.shape[0])
        k_rows = top_k.to(device=hidden2d.device, dtype=torch.long) if isinstance(top_k, Tensor) else \
            torch.full(target.shape, top_k, dtype=torch.long, device=hidden2d.device)
    if p_rows is not None:
        p_rows = p_rows.to(device=hidden2d.device, dtype=torch.float32)
    return NUCLEUS(hidden2d, weight, bias, target, k_rows, p_rows, 1.0 if p_rows is not None else float(top_p),
                   logit_scale, softcap, ignore_index)[0]


def check_top_p(top_p: Union[float, Tensor], target: Tensor) -> Optional[Tensor]:
    """None for a number in (0, 1]; a tensor's (N,) rows for a floating tensor of ``target``'s shape
    (its values checked, in (0, 1], where they can be read without a host synchronisation: on CPU);
    else ValueError naming what is wrong."""
    if isinstance(top_p, Tensor):
        if top_p.shape != target.shape or not top_p.is_floating_point():
            raise ValueError(f"a top_p tensor must hold floats, one per row of target {tuple(target.shape)}; "
                             f"got {top_p.dtype} {tuple(top_p.shape)}")
        if top_p.device.type == "cpu" and not is_fake(top_p) and top_p.numel():
            bad = ~((top_p > 0) & (top_p <= 1))
            if bool(bad.any()):
                raise ValueError(f"every top_p must be in (0, 1], got {top_p[bad][:8].tolist()}")
        return top_p.reshape(-1)
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be a number in (0, 1] or a tensor of one per row, got {top_p!r}")
    return None


def kept(hidden2d: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, top_k: Union[int, Tensor],
         logit_scale: float, softcap: Optional[float], ignore_index: int, need_entropy: bool,
         need_argmax: bool) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """``linear_log_probs(..., top_k=)`` on 2-D inputs (a temperature folded into ``logit_scale`` and
    ``softcap``): per row the log-probability of ``target`` under the distribution restricted to the
    row's ``top_k`` largest logits and renormalised (``−inf`` where the target is outside that kept
    set, 0 on ignored rows), that distribution's entropy (0 on ignored rows) and its top column.
    ``top_k`` is one int or one per row ((N,), each in [1, V]: the op runs at the largest, read
    with one host synchronisation). Gradients as eager's masked log-softmax gives them (the
    target's column where it is kept, the logsumexp's to every kept column)."""
    k = check_top_k(top_k, target, weight.shape[0])
    values, indices, _ = TOPK(hidden2d, weight, bias, k, logit_scale, softcap, False)
    if isinstance(top_k, Tensor):
        kept_cols = torch.arange(k, device=values.device)[None, :] < top_k.to(values.device)[:, None]
        values = values.masked_fill(~kept_cols, float("-inf"))
    rows = kept_from_top(values, indices, target, ignore_index)
    entropy = None
    if need_entropy:  # −Σ p log p over the kept columns (p = 0 outside them)
        logp = values - torch.logsumexp(values, dim=-1, keepdim=True)
        p = logp.exp()
        entropy = torch.where(target != ignore_index, -(p * logp.masked_fill(p == 0, 0.0)).sum(-1), 0.0)
    return rows, entropy, indices[:, 0] if need_argmax else None


def kept_from_top(values: Tensor, indices: Tensor, target: Tensor, ignore_index: int) -> Tensor:
    """Per row, the log-probability of ``target`` under the distribution over the columns ``indices``
    with logits ``values`` (−inf values: not kept), renormalised: ``u_t − logsumexp(values)`` where
    the target is among them, −inf where it is not, 0 where ``target == ignore_index``. Gradients as
    eager's masked log-softmax: the target's column where it is kept, the logsumexp's to every kept
    column. (The pass emits it after the top-k op for the kept-set spelling, patterns/topk.py.)"""
    valid = target != ignore_index
    hit = (indices == torch.where(valid, target, -1)[:, None]) & (values > float("-inf"))
    # u_t where the target is kept (−inf where not): its gradient flows to that column alone
    picked = torch.where(hit.any(-1), values.masked_fill(~hit, 0.0).sum(-1), float("-inf"))
    rows = picked - torch.logsumexp(values, dim=-1)
    return torch.where(valid, rows, 0.0)
