"""An lm_head's log-probs (or logits) at given vocabulary ids per row, without the ``[N, V]`` logits:
the student's side of top-k distillation from a stored teacher top-k
(``F.log_softmax(s / T, -1).gather(-1, teacher_ids)``, ids ``[..., k]``), and of any loss that reads
a few columns of each row (a candidate set, a kept set given by ids).

With ``u = softcap·tanh(z·scale/softcap)`` (``u = z·scale`` without a softcap; a temperature is
folded in as for the log-prob op, ``options.fold_temperature``) and ``z = hidden @ weight.T + bias``,
the values are ``u[n, index[n, j]]``, minus each row's ``logsumexp(u)`` with ``log_probs``.

Log-probs need each row's logsumexp, so every logit: the op runs over the top-k op's row chunks
(topk.py), each chunk's logits from one GEMM (cuBLAS on CUDA: the same logits as eager's matmul),
the chunk's columns gathered and its logsumexp in one more pass over the chunk (compiled by Inductor
on CUDA). The backward writes ``dz`` whole, ``−softmax(u)·Σ_j g_j`` on every column, the incoming
gradients added at the gathered columns, then ``dz @ W`` and ``dzᵀ @ h``. Its logits come from the
forward where it kept them (strategy ``store``: the first S rows' logits in the inputs' dtype, as
many rows as the store budget holds, ``strategy.choose_gather``; two GEMMs per chunk, eager's work)
or are recomputed (``recompute``: three GEMMs per chunk, 4/3 of eager's work, O(chunk) memory).

The logits alone need only their k columns (``_picked_logits``): k dot products per row, each summed
in the compute dtype and rounded once to the inputs' dtype, as the GEMM rounds eager's logits
(N·k·D multiply-adds: k/V of the GEMM's; the k weight rows of a chunk of rows gathered, then one
batched product). Their backward (``_picked_backward``) is one GEMM, against eager's two: the hidden
states' gradient from the k weight rows of each row, the weight's ``dzᵀ @ h`` over chunks of
vocabulary columns of a ``dz`` that holds the k gradients of each row.

An id that appears twice in a row gets both gradients, as eager's gather gives them: each row's
gradients are summed over equal ids in a fixed order (``_run_sums``), so the result is
deterministic, with no atomics.

``inductor_xent::linear_gather(hidden, weight, bias, index, logit_scale, softcap, log_probs,
store_rows=0, budget="0") -> (values, lse, kept)``: values ``(N, k)`` in the compute dtype (fp32 for
16-bit inputs), lse ``(N,)`` (empty ``(0,)`` without ``log_probs``), kept ``(S, V)`` in the inputs'
dtype: the logits of the first S rows (``store_rows`` when positive, else as many as ``budget``
holds, ``strategy.gather_store_rows``; 0 without ``log_probs`` or at a budget of 0); lse and kept are
not differentiable. Ids outside ``[0, V)`` raise, as eager's gather does (a device-side assert on
CUDA; on CPU an IndexError where only the k columns are read). Its backward is
``inductor_xent::linear_gather_bwd(grad_values, hidden, weight, bias, index, lse, kept, logit_scale,
softcap, log_probs, needs_hidden, needs_weight, needs_bias) -> (grad_hidden, grad_weight, grad_bias)``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import config, strategy, topk
from .ops import _without_autocast
from .options import compute_dtype


def _forward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], index: Tensor, logit_scale: float,
             softcap: Optional[float], log_probs: bool, stored: int) -> tuple[Tensor, Tensor, Tensor]:
    n, v, k = hidden.shape[0], weight.shape[0], index.shape[1]
    cd = compute_dtype(hidden.dtype)
    values = hidden.new_empty((n, k), dtype=cd)
    lse = hidden.new_empty((n,) if log_probs else (0,), dtype=cd)
    kept = hidden.new_empty((stored, v))  # the first rows' logits, for the backward (store)
    if not log_probs:  # the k logits of each row alone: k dot products, no GEMM over the vocabulary
        for sl, z, _ in _picked_logits(hidden, weight, bias, index):
            values[sl] = topk._scaled(z, logit_scale, softcap)[0]
        return values, lse, kept
    step = topk.chunk_rows(n, v, hidden.device, hidden.element_size() + 2)  # the chunk's logits, the lse's pass
    lse_fn = topk._for(hidden.device, topk._lse_of)
    edges = sorted({*range(0, n, step), stored} - {n}) + [n]  # no chunk straddles the kept rows' end
    for start, stop in zip(edges, edges[1:]):
        sl = slice(start, stop)
        if stop <= stored:  # the GEMM's logits written where the backward reads them
            z = kept[sl]
            if bias is None:
                torch.mm(hidden[sl], weight.t(), out=z)
            else:
                torch.addmm(bias, hidden[sl], weight.t(), out=z)
        else:
            z = F.linear(hidden[sl], weight, bias)
        lse[sl] = lse_fn(z, logit_scale, softcap)
        values[sl] = topk._scaled(z.gather(1, index[sl]), logit_scale, softcap)[0] - lse[sl, None]
    return values, lse, kept


# bytes of weight rows ``_picked_logits`` gathers at once: enough rows for the batched dot products to
# run at the memory's speed, a fraction of a chunk of logits
PICKED_BYTES = 2**28


def _picked_rows(n: int, k: int, d: int, itemsize: int, device: torch.device) -> int:
    """Rows per chunk of ``_picked_logits``: their k weight rows within PICKED_BYTES (and within the
    chunked path's budget on CPU)."""
    return max(1, min(n, min(PICKED_BYTES, topk.chunk_budget(device)) // max(1, itemsize * k * d)))


def _rows(t: Tensor, index: Tensor) -> Tensor:
    """``t[index]`` for ids in ``[0, len(t))``, raising on any other (a negative id would wrap in Python's
    indexing; eager's gather raises on it)."""
    return t.index_select(0, index.reshape(-1)).view(*index.shape, *t.shape[1:])


def _picked_logits(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], index: Tensor):
    """(row slice, z, weight rows) per row chunk: the logits at ``index`` (``z[n, j] = hidden[n] ·
    weight[index[n, j]] + bias[index[n, j]]``) in the inputs' dtype, each a batched dot product in
    the inputs' dtype (summed in the compute dtype and rounded once, as the logits GEMM rounds its
    output, the bias added before that rounding as addmm adds it); and the chunk's gathered weight
    rows ``(r, k, D)`` (the backward's hidden-state gradient reads them)."""
    n, k, d = hidden.shape[0], index.shape[1], hidden.shape[1]
    step = _picked_rows(n, k, d, hidden.element_size(), hidden.device)
    for start in range(0, n, step):
        sl = slice(start, min(n, start + step))
        rows = _rows(weight, index[sl])  # (r, k, D)
        h = hidden[sl, :, None]
        z = torch.bmm(rows, h) if bias is None else torch.baddbmm(_rows(bias, index[sl])[:, :, None], rows, h)
        yield sl, z[:, :, 0], rows


# the weight gradient's dz block is at least one column wider than its chunk of vocabulary (a spare
# column for the ids of other chunks), its width a multiple of this: rows 16-byte aligned for the GEMM
# (an odd row stride would leave cuBLAS no tensor-core kernel for the transposed block)
_ALIGN = 8


def _picked_backward(grad_values: Tensor, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], index: Tensor,
                     logit_scale: float, softcap: Optional[float], needs: tuple[bool, bool, bool]):
    """The gradients of the logits at ``index`` (no logsumexp): dz is ``g·scale·sech²`` at the k
    columns of each row and 0 elsewhere, in the logits' dtype (as eager's). The hidden states'
    gradient is k weight rows per row (``Σ_j dz[n, j]·weight[index[n, j]]``, a batched product in the
    inputs' dtype); the weight's, dzᵀ @ hidden, one GEMM per chunk of vocabulary columns over a dz
    written there (each column's rows summed by the GEMM: no atomics; an id repeated in a row written
    once with its gradients' sum, ``_run_sums``); the bias's, that dz's column sums. One GEMM in all,
    against eager's two."""
    n, v = hidden.shape[0], weight.shape[0]
    cd = compute_dtype(hidden.dtype)
    need_h, need_w, need_b = needs
    need_b = need_b and bias is not None
    g = grad_values.to(cd)
    dz = torch.empty_like(g, dtype=hidden.dtype)
    grad_h = torch.empty_like(hidden) if need_h else hidden.new_empty(0)
    for sl, z, rows in _picked_logits(hidden, weight, bias, index):  # one gather of each chunk's weight rows
        _, x = topk._scaled(z, logit_scale, softcap)
        dz[sl] = topk._dz_of_du(g[sl], x, logit_scale)
        if need_h:
            torch.bmm(dz[sl, None, :], rows, out=grad_h[sl, None, :])
    grad_w = weight.new_empty(0)
    grad_b = weight.new_empty(0) if not need_b else torch.zeros(v, dtype=cd, device=weight.device)
    if need_w or need_b:
        grad_w = torch.empty_like(weight) if need_w else grad_w
        dz_in = _run_sums(index, dz.to(cd)).to(hidden.dtype)  # equal ids' sums, rounded once
        cols = max(1, min(v, topk.chunk_budget(hidden.device) // max(1, n * hidden.element_size()) - _ALIGN))
        for c0 in range(0, v, cols):
            c1 = min(v, c0 + cols)
            block = hidden.new_zeros((n, (c1 - c0 + _ALIGN) // _ALIGN * _ALIGN))
            at = torch.where((index >= c0) & (index < c1), index - c0, c1 - c0)
            block.scatter_(1, at, dz_in)  # equal ids of a row write equal sums
            if need_w:
                torch.mm(block[:, : c1 - c0].t(), hidden, out=grad_w[c0:c1])
            if need_b:
                grad_b[c0:c1] = block[:, : c1 - c0].sum(0, dtype=cd)
    return grad_h, grad_w, grad_b.to(bias.dtype) if need_b else grad_b


def _run_sums(index: Tensor, g: Tensor) -> Tensor:
    """Per position of each row, the sum of ``g`` over the row's positions holding the same id (``g``
    itself where the ids differ), summed in one fixed order: the row's ids sorted (stable), a
    segmented scan over them (log2(k) steps), each segment's total read back at its positions."""
    k = index.shape[1]
    if k < 2:
        return g
    ids, order = torch.sort(index, dim=1, stable=True)
    acc = g.gather(1, order)
    start = torch.ones_like(ids, dtype=torch.bool)
    start[:, 1:] = ids[:, 1:] != ids[:, :-1]  # a segment of equal ids starts here
    shift = 1
    while shift < k:  # (start, sum) pairs combined as a segmented inclusive scan (Hillis-Steele)
        prev_sum, prev_start = acc[:, :-shift], start[:, :-shift]
        acc = torch.cat([acc[:, :shift], torch.where(start[:, shift:], acc[:, shift:], acc[:, shift:] + prev_sum)], 1)
        start = torch.cat([start[:, :shift], start[:, shift:] | prev_start], 1)
        shift *= 2
    last = torch.searchsorted(ids, ids, right=True) - 1  # each segment's total sits at its last position
    return torch.empty_like(g).scatter_(1, order, acc.gather(1, last))


@torch.library.custom_op("inductor_xent::linear_gather", mutates_args=())
@_without_autocast
def linear_gather_fwd(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], index: Tensor, logit_scale: float,
                      softcap: Optional[float], log_probs: bool, store_rows: int = 0, budget: str = "0",
                      ) -> tuple[Tensor, Tensor, Tensor]:
    return _forward(hidden, weight, bias, index, logit_scale, softcap, log_probs,
                    _stored(hidden, weight, log_probs, store_rows, budget))


def _stored(hidden: Tensor, weight: Tensor, log_probs: bool, store_rows: int, budget: str):
    """S, the rows whose logits the forward keeps (a SymInt under a dynamic N): none for the logits
    alone (their backward reads no logits), else ``strategy.gather_store_rows``."""
    if not log_probs or (store_rows <= 0 and config.parse_budget(budget)[1] == 0):
        return 0
    return strategy.gather_store_rows(hidden.shape[0], weight.shape[0], hidden.dtype, budget, store_rows)


@linear_gather_fwd.register_fake
def _(hidden, weight, bias, index, logit_scale, softcap, log_probs, store_rows=0, budget="0"):
    n, cd = hidden.shape[0], compute_dtype(hidden.dtype)
    return (hidden.new_empty((n, index.shape[1]), dtype=cd), hidden.new_empty((n,) if log_probs else (0,), dtype=cd),
            hidden.new_empty((_stored(hidden, weight, log_probs, store_rows, budget), weight.shape[0])))


@torch.library.custom_op("inductor_xent::linear_gather_bwd", mutates_args=())
@_without_autocast
def linear_gather_bwd(grad_values: Tensor, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], index: Tensor,
                      lse: Tensor, kept: Tensor, logit_scale: float, softcap: Optional[float], log_probs: bool,
                      needs_hidden: bool, needs_weight: bool, needs_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    needs = (needs_hidden, needs_weight, needs_bias)
    if not log_probs:
        return _picked_backward(grad_values, hidden, weight, bias, index, logit_scale, softcap, needs)
    return topk._backward(grad_values, hidden, weight, bias, index, lse, logit_scale, softcap, log_probs, needs,
                          _run_sums, kept)


@linear_gather_bwd.register_fake
def _(grad_values, hidden, weight, bias, index, lse, kept, logit_scale, softcap, log_probs, needs_hidden, needs_weight,
      needs_bias):
    return topk._fake_grads(hidden, weight, bias, needs_hidden, needs_weight, needs_bias)


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, index, logit_scale, softcap, log_probs, *_ = inputs
    ctx.save_for_backward(hidden, weight, bias, index, output[1], output[2])
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.set_materialize_grads(False)
    ctx.options = (logit_scale, softcap, log_probs)


def _autograd_backward(ctx, grad_values, _grad_lse, _grad_kept):
    hidden, weight, bias, index, lse, kept = ctx.saved_tensors
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    need_b = need_b and bias is not None
    if grad_values is None or not (need_h or need_w or need_b):
        return (None,) * 9
    gh, gw, gb = linear_gather_bwd(grad_values, hidden, weight, bias, index, lse, kept, *ctx.options, need_h, need_w,
                                   need_b)
    return gh if need_h else None, gw if need_w else None, gb if need_b else None, *(None,) * 6


linear_gather_fwd.register_autograd(_autograd_backward, setup_context=_setup_context)

GATHER = torch.ops.inductor_xent.linear_gather.default
GATHER_BACKWARD = torch.ops.inductor_xent.linear_gather_bwd.default


def check_index(index: Tensor, hidden: Tensor) -> None:
    """ValueError / TypeError naming what is wrong with the ids of ``linear_gather``."""
    if not isinstance(index, Tensor) or index.dtype != torch.long:
        raise TypeError(f"index must be an int64 tensor, got {getattr(index, 'dtype', type(index).__name__)}")
    if index.dim() != hidden.dim() or index.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(f"index must be [..., k] with the rows of hidden {tuple(hidden.shape[:-1])}, got "
                         f"{tuple(index.shape)}")
    if index.device != hidden.device:
        raise ValueError(f"index is on {index.device}, hidden on {hidden.device}")


def linear_gather(
    hidden: Tensor,
    weight: Tensor,
    index: Tensor,
    *,
    bias: Optional[Tensor] = None,
    log_probs: bool = False,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
    strategy: Optional[str] = None,
    store_budget: Optional[str | int] = None,
) -> Tensor:
    """The logits (``log_probs``: the log-probabilities) of each row at the vocabulary ids
    ``index[..., k]``, without the ``[..., V]`` logits (module docstring). Equal, up to rounding, to::

        z = F.linear(hidden, weight, bias).float() * logit_scale      # then the softcap, / temperature
        (F.log_softmax(z, -1) if log_probs else z).gather(-1, index)

    The result is ``[..., k]`` in the compute dtype (fp32 for 16-bit inputs) and differentiable
    (an id repeated in a row gets both gradients, as eager's gather gives them). Inside
    ``torch.autocast`` the operands are cast as autocast casts them for ``F.linear``.

    ``strategy`` / ``store_budget`` (``config``'s unless given) as for ``linear_log_probs``: with
    ``log_probs``, ``store`` keeps the logits of as many rows as the budget holds for the backward
    (two GEMMs for them instead of three; ``strategy.choose_gather``), ``auto`` on CUDA."""
    from .api import _autocast, _needs_and_budget  # (api imports topk, which this module imports)

    hidden, weight, bias = _autocast(hidden, weight, bias)  # as F.linear under torch.autocast
    topk._check_head(hidden, weight, bias)
    check_index(index, hidden)
    scale, cap = topk._scale_and_cap(temperature, logit_scale, softcap)
    needs, budget = _needs_and_budget(hidden, weight, bias, store_budget)
    store = _choose(int(weight.shape[1]), int(weight.shape[0]), hidden.dtype, needs, bool(log_probs), strategy,
                    budget, hidden.device.type) == "store"
    k = index.shape[-1]
    h2 = hidden.reshape(-1, hidden.shape[-1])
    values, _, _ = GATHER(h2, weight, bias, index.reshape(h2.shape[0], k), scale, cap, bool(log_probs), 0,
                          budget if store else "0")
    return values.reshape(*hidden.shape[:-1], k)


@torch.compiler.assume_constant_result
def _choose(d, v, dtype, needs, log_probs, which, budget, device):
    """``strategy.choose_gather``'s strategy, planned for a dynamic N (api._sizes: eager and compiled
    calls plan alike; the op sizes what it keeps for the real N), a constant under torch.compile."""
    return strategy.choose_gather(None, d, v, dtype, needs=needs, log_probs=log_probs, strategy=which, budget=budget,
                                  device=device).strategy
