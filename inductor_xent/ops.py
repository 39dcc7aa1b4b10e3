"""The ``inductor_xent`` operators in ``torch.library``; op names live here and nowhere else
(other modules use ``FORWARD``, ``BACKWARD``, ``STORE``, ``STORE_SCALE``, ``STORE_SCALE_``,
``LOGPROB_FORWARD``, ``LOGPROB_BACKWARD``, ``LOGPROB_STORE``, ``LOGPROB_STORE_BACKWARD(_)``, and
``DISTILL_FORWARD`` / ``DISTILL_BACKWARD`` and ``DISTILL_RECOMPUTE`` / ``DISTILL_RECOMPUTE_BACKWARD``, the
two-lm_head distillation ops that ``distill.py`` defines next to their chunked implementation).

Strategy ``recompute`` (strategy.py):

* ``inductor_xent::linear_ce_fwd(hidden, weight, bias, target, <options>, write_logits=False,
  skip_ignored=False) -> (loss, lse, lse_lo, logits)``: per-row loss (0 on ignored rows), logsumexp, and the logsumexp's
  rounding residual (``lse + lse_lo`` is the logsumexp to twice the working precision; not
  differentiable), each (N,), float32 (float64 for float64 inputs); with ``write_logits`` also the
  raw logits ``hidden @ weight.T + bias`` (N, V) in the inputs' dtype, written by the forward from
  the tiles it computes anyway (else an empty (0,)); not differentiable: the pass attaches their
  gradient outside the compiled graph (escape.py), where it costs nothing unless used. With
  ``skip_ignored`` (the caller reads no ignored row's lse: the API, and the pass where no z-loss or
  logsumexp of the graph reads the op's) an ignored row's logits are not computed wherever the
  backward skips it too, and its loss, lse and lse_lo are 0.
* ``inductor_xent::linear_ce_bwd(grad_loss, grad_lse, hidden, weight, bias, target, lse, lse_lo,
  <options>, needs_hidden, needs_weight, needs_bias) -> (grad_hidden, grad_weight, grad_bias)``:
  always three tensors; one that is not needed is empty, shape (0,).

The forward's autograd formula calls the backward op, so under ``torch.compile`` AOTAutograd sees
two opaque nodes and the partitioner saves ``hidden, weight, bias, target, lse, lse_lo``: never the
logits.

Strategy ``store``:

* ``inductor_xent::linear_ce_store(hidden, weight, bias, target, <options>, reduction, chunk_rows,
  budget, needs_hidden, needs_weight, needs_bias, write_logits=False) -> (loss, grad_hidden,
  grad_weight, grad_bias, logits)`` (``logits`` as ``linear_ce_fwd``'s):
  the reduced loss (0-dim; ``reduction`` is "mean" or "sum") and, computed in the same pass over
  the logits, its gradients (not differentiable outputs; empty where not needed). ``chunk_rows`` 0
  sizes the row chunks at run time from ``budget`` (strategy.chunk_rows), so a dynamic N is
  chunked for its real size and eager and compiled calls chunk alike. Its autograd formula scales
  the gradients by the incoming scalar gradient: no backward pass over the logits at all. Called
  through ``store_consuming_gradients`` (the functional API, which discards the gradient outputs)
  its eager backward on the Triton path scales them in place unless the graph is retained; called
  directly, it leaves the outputs its caller holds as they were.
* ``inductor_xent::store_scale(g, s) -> Tensor`` (``g * s``) is that backward as AOTAutograd traces
  it, and ``inductor_xent::store_scale_(g!, s)`` its in-place form: in a compiled backward whose
  saved gradients autograd donates (frees after it: no ``retain_graph``), the post-grad pass
  ``inductor_pass.DonatedScale`` swaps one for the other, so an upstream 1 moves no memory there
  either.

Log-probabilities (``linear_log_probs``; RL and evaluation heads), strategy ``recompute``:

* ``inductor_xent::linear_logprob_fwd(hidden, weight, bias, target, ignore_index, logit_scale,
  softcap, need_entropy, need_argmax, skip_ignored=False) -> (log_probs, entropy, argmax, lse,
  lse_lo)``: per row ``z_t − lse`` and the entropy ``−Σ p log p`` (both 0 on ignored rows; compute
  dtype), the argmax (int64, every row, the first maximal column), lse and its residual. ``entropy``
  and ``argmax`` are empty (0,) when not asked for. ``skip_ignored`` as ``linear_ce_fwd``'s (an
  ignored row's argmax is 0 then: the caller reads none). A temperature is folded into ``logit_scale`` and ``softcap``
  by the caller (``options.fold_temperature``). Differentiable in log_probs, entropy and lse.
* ``inductor_xent::linear_logprob_bwd(grad_log_probs, grad_entropy, grad_lse, hidden, weight, bias,
  target, lse, lse_lo, entropy, ignore_index, logit_scale, softcap, needs_hidden, needs_weight,
  needs_bias) -> (grad_hidden, grad_weight, grad_bias)``: ``grad_entropy`` and ``entropy`` are both
  None (no entropy term) or both (N,).

Log-probabilities, strategy ``store`` (per-token incoming gradients: the gradients cannot be formed
in the forward, so the forward keeps what the backward's dz needs instead of the logits):

* ``inductor_xent::linear_logprob_store(hidden, weight, bias, target, ignore_index, logit_scale,
  softcap, need_entropy, need_argmax, store_rows, budget, skip_ignored=False) -> (log_probs, entropy,
  argmax, lse, lse_lo, e, m, st)``: ``linear_logprob_fwd``'s outputs, plus for the first S rows
  (``store_rows`` when positive, else as many as ``budget`` holds: ``strategy.logprob_store_rows``,
  an expression in a dynamic N) their exp-logits ``e`` (S, V; rows 64 elements apart; fp16 for
  16-bit inputs), the vocabulary tiles' maxima ``m`` (tiles, S) and the target's sech² ``st`` (S,)
  under a softcap; not differentiable. The chunked path keeps nothing: (0, 0), (0, 0), (0,).
  ``skip_ignored`` as ``linear_logprob_fwd``'s; where the Triton kernels skip, the stored rows are
  the first S *valid* rows (valid rows first, in row order: ``launch.store_skips``) and ``e``'s rows
  past their count are never written; the autograd backward passes ``compacted``.
* ``inductor_xent::linear_logprob_store_bwd(<linear_logprob_bwd's tensors>, e, m, st, <options>,
  needs_hidden, needs_weight, needs_bias, compacted=False)``: the S stored rows' dz from ``e`` (two
  GEMMs), the others' from recomputed logits (three); ``compacted``: ``e`` came from a skipping
  forward (the order is found again from the target).
* ``inductor_xent::linear_logprob_store_bwd_(<the same>)`` may write over ``e`` (``e!``): the stored
  rows' dz goes there and their two GEMMs run over the whole vocabulary at once. The eager backward
  of ``consuming_stored`` (the functional API, which drops ``e``) calls it unless the graph is
  retained; ``inductor_pass.DonatedScale`` puts it in a compiled backward where autograd donates
  ``e``.

All are plain ``custom_op``s: Inductor calls them as fallback kernels, which launch our Triton
kernels on CUDA. No op synchronises with the host (the mean's denominator stays on the device).
"""

from __future__ import annotations

import contextvars
import functools
from typing import Optional

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import compat, config, fallback, strategy
from .options import KERNEL_DTYPES, LossOptions, compute_dtype


def use_triton(hidden: Tensor) -> bool:
    """Which implementation runs for these inputs (see ``config.impl``)."""
    mode = config.impl()
    if mode == "chunked" or hidden.dtype not in KERNEL_DTYPES:
        return False
    if mode == "triton":
        return True
    return hidden.device.type == "cuda" and _triton_kernels() is not None


@functools.cache
def _triton_kernels():
    """The launcher module, or None when Triton cannot be imported here."""
    try:
        from .templates import launch
    except ImportError:
        return None
    return launch


def _kernels(hidden: Tensor):
    launch = _triton_kernels()
    if launch is None:
        raise RuntimeError(
            "INDUCTOR_XENT_IMPL=triton, but the Triton kernels cannot be imported here: install "
            "triton (and set TRITON_INTERPRET=1 for CPU tensors), or use INDUCTOR_XENT_IMPL=auto"
        )
    reason = launch.unsupported_reason(hidden)
    if reason:
        raise RuntimeError(f"the Triton kernels cannot run these inputs: {reason}")
    return launch


def _implementation(hidden: Tensor):
    """What runs an op on these inputs: the Triton launchers (``templates/launch.py``) or the chunked
    path (``fallback.py``), which take the same arguments for forward, backward and
    log_probs_forward."""
    return _kernels(hidden) if use_triton(hidden) else fallback


def _without_autocast(impl):
    """``impl`` run with autocast off for its inputs' device. Inductor calls the op's implementation
    while the caller's ``torch.autocast`` is still active (it is ambient around the compiled call),
    and the chunked path's fp32 matmuls would otherwise run in bfloat16. The op's inputs already
    carry the dtypes autocast chose (the pass casts them)."""

    @functools.wraps(impl)
    def run(*args, **kwargs):
        device = next(a.device.type for a in args if isinstance(a, Tensor))
        if not torch.is_autocast_enabled(device):
            return impl(*args, **kwargs)
        with torch.autocast(device, enabled=False):
            return impl(*args, **kwargs)

    return run


def _opts(ignore_index: int, label_smoothing: float, logit_scale: float, softcap: Optional[float], z_loss: float):
    return LossOptions(ignore_index, label_smoothing, logit_scale, softcap, z_loss)


# ---------------------------------------------------------------------------------------------
# recompute: forward
# ---------------------------------------------------------------------------------------------
@torch.library.custom_op("inductor_xent::linear_ce_fwd", mutates_args=())
@_without_autocast
def linear_ce_fwd(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    target: Tensor,
    ignore_index: int,
    label_smoothing: float,
    logit_scale: float,
    softcap: Optional[float],
    z_loss: float,
    write_logits: bool = False,
    skip_ignored: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    opts = _opts(ignore_index, label_smoothing, logit_scale, softcap, z_loss)
    fallback.check_targets(target, weight.shape[0], ignore_index)  # on CPU only (no host sync)
    logits = _logits_output(hidden, weight, write_logits)
    out = logits if write_logits else None
    return (*_implementation(hidden).forward(hidden, weight, bias, target, opts, logits=out,
                                             skip_ignored=skip_ignored), logits)


@linear_ce_fwd.register_fake
def _(hidden, weight, bias, target, ignore_index, label_smoothing, logit_scale, softcap, z_loss, write_logits=False,
      skip_ignored=False):
    cd = compute_dtype(hidden.dtype)
    n = hidden.shape[0]
    return (*(hidden.new_empty((n,), dtype=cd) for _ in range(3)), _logits_output(hidden, weight, write_logits))


def _logits_output(hidden: Tensor, weight: Tensor, write_logits: bool) -> Tensor:
    """The ``logits`` output: ``hidden @ weight.T + bias`` in the inputs' dtype, (N, V), when
    ``write_logits`` (the forward kernel writes each tile it computes anyway: no second GEMM), else
    an empty (0,). The pass asks for it where the compiled function returns the logits too."""
    return hidden.new_empty((hidden.shape[0], weight.shape[0]) if write_logits else (0,))


# ---------------------------------------------------------------------------------------------
# recompute: backward
# ---------------------------------------------------------------------------------------------
@torch.library.custom_op("inductor_xent::linear_ce_bwd", mutates_args=())
@_without_autocast
def linear_ce_bwd(
    grad_loss: Tensor,
    grad_lse: Tensor,
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    target: Tensor,
    lse: Tensor,
    lse_lo: Tensor,
    ignore_index: int,
    label_smoothing: float,
    logit_scale: float,
    softcap: Optional[float],
    z_loss: float,
    needs_hidden: bool,
    needs_weight: bool,
    needs_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    opts = _opts(ignore_index, label_smoothing, logit_scale, softcap, z_loss)
    needs = (needs_hidden, needs_weight, needs_bias and bias is not None)
    return _implementation(hidden).backward(grad_loss, grad_lse, hidden, weight, bias, target, lse, lse_lo, opts,
                                            needs)


def _grad_fakes(hidden, weight, bias, needs_hidden, needs_weight, needs_bias):
    grad_b_shape = weight.shape[:1] if needs_bias and bias is not None else (0,)
    return (
        hidden.new_empty(hidden.shape if needs_hidden else (0,)),
        weight.new_empty(weight.shape if needs_weight else (0,)),
        weight.new_empty(grad_b_shape, dtype=weight.dtype if bias is None else bias.dtype),
    )


@linear_ce_bwd.register_fake
def _(grad_loss, grad_lse, hidden, weight, bias, target, lse, lse_lo, ignore_index, label_smoothing,
      logit_scale, softcap, z_loss, needs_hidden, needs_weight, needs_bias):
    return _grad_fakes(hidden, weight, bias, needs_hidden, needs_weight, needs_bias)


# ---------------------------------------------------------------------------------------------
# recompute: autograd (the forward's derivative is our backward op)
# ---------------------------------------------------------------------------------------------
def _setup_context(ctx, inputs, output):
    hidden, weight, bias, target, *options = inputs
    ctx.save_for_backward(hidden, weight, bias, target, output[1], output[2])
    # the logits output carries no gradient here: the pass hands the returned logits to
    # escape.EscapedLogits, whose backward runs only when the caller uses them
    ctx.mark_non_differentiable(output[2], output[3])
    ctx.options = options[:5]  # ignore_index ... z_loss (not write_logits, skip_ignored)
    ctx.num_inputs = len(inputs)


def _backward(ctx, grad_loss, grad_lse, _grad_lse_lo, _grad_logits):
    hidden, weight, bias, target, lse, lse_lo = ctx.saved_tensors
    if grad_loss is None:
        grad_loss = torch.zeros_like(lse)
    if grad_lse is None:
        grad_lse = torch.zeros_like(lse)
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    grad_h, grad_w, grad_b = linear_ce_bwd(
        grad_loss, grad_lse, hidden, weight, bias, target, lse, lse_lo, *ctx.options,
        need_h, need_w, need_b and bias is not None,
    )
    return (
        grad_h if need_h else None,
        grad_w if need_w else None,
        grad_b if need_b and bias is not None else None,
        *(None,) * (ctx.num_inputs - 3),
    )


linear_ce_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# store: loss and gradients in one pass
# ---------------------------------------------------------------------------------------------
@torch.library.custom_op("inductor_xent::linear_ce_store", mutates_args=())
@_without_autocast
def linear_ce_store(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    target: Tensor,
    ignore_index: int,
    label_smoothing: float,
    logit_scale: float,
    softcap: Optional[float],
    z_loss: float,
    reduction: str,
    chunk_rows: int,
    budget: str,
    needs_hidden: bool,
    needs_weight: bool,
    needs_bias: bool,
    write_logits: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    opts = _opts(ignore_index, label_smoothing, logit_scale, softcap, z_loss)
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_ce_store: reduction must be 'mean' or 'sum', got {reduction!r}")
    if chunk_rows <= 0:  # within the budget at this N; over it (MIN_CHUNK_ROWS) if nothing fits
        n, (v, d) = hidden.shape[0], weight.shape
        chunk_rows = strategy.chunk_rows(n, v, d, hidden.dtype, weight.dtype, needs_weight, budget) or min(
            max(n, 1), strategy.MIN_CHUNK_ROWS)
    fallback.check_targets(target, weight.shape[0], ignore_index)  # on CPU only (no host sync)
    needs = (needs_hidden, needs_weight, needs_bias and bias is not None)
    logits = _logits_output(hidden, weight, write_logits)
    out = logits if write_logits else None
    if use_triton(hidden):
        # the precision rule decided here, with the chunks the launcher will take (the chunked path
        # accumulates in its compute dtype, fp32 or fp64, always)
        fp32_acc = strategy.fp32_accumulate(hidden.shape[0], chunk_rows, weight.element_size(), needs_weight)
        return (*_kernels(hidden).store(hidden, weight, bias, target, opts, reduction, chunk_rows, needs,
                                        fp32_accumulate=fp32_acc, logits=out), logits)
    return (*fallback.store(hidden, weight, bias, target, opts, reduction, needs, logits=out), logits)


@linear_ce_store.register_fake
def _(hidden, weight, bias, target, ignore_index, label_smoothing, logit_scale, softcap, z_loss, reduction,
      chunk_rows, budget, needs_hidden, needs_weight, needs_bias, write_logits=False):
    loss = hidden.new_empty((), dtype=compute_dtype(hidden.dtype))
    return (loss, *_grad_fakes(hidden, weight, bias, needs_hidden, needs_weight, needs_bias),
            _logits_output(hidden, weight, write_logits))


# set by store_consuming_gradients / consuming_stored around one call of the op, read by its setup_context
_OUTPUTS_CONSUMED = contextvars.ContextVar("inductor_xent_outputs_consumed", default=False)


def store_consuming_gradients(*args) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``linear_ce_store(*args)`` for a caller that drops the three gradient outputs at once: the
    eager backward may then scale them in place (no copy; no memory traffic at all on the GPU for
    an upstream 1), since nobody else can see them. Eager only (a context variable)."""
    token = _OUTPUTS_CONSUMED.set(True)
    try:
        return STORE(*args)
    finally:
        _OUTPUTS_CONSUMED.reset(token)


def _store_setup_context(ctx, inputs, output):
    _, grad_h, grad_w, grad_b, logits = output
    ctx.consumed = _OUTPUTS_CONSUMED.get()  # the caller dropped the gradient outputs
    ctx.save_for_backward(grad_h, grad_w, grad_b)
    ctx.mark_non_differentiable(grad_h, grad_w, grad_b, logits)  # logits: see _setup_context
    # the three gradient outputs get no incoming gradient: without this autograd fills a zero one
    # for each (the weight gradient's size: 1 GiB at llama3-8b, 0.33 ms on the H200)
    ctx.set_materialize_grads(False)
    ctx.computed = tuple(inputs[12:15])  # needs_hidden, needs_weight, needs_bias


def _store_backward(ctx, grad_loss, *_unused):
    if grad_loss is None:  # not materialised (setup_context): nothing flows into the loss
        return (None,) * 16
    grads = []
    for name, want, computed, g in zip(("hidden", "weight", "bias"), ctx.needs_input_grad[:3], ctx.computed,
                                       ctx.saved_tensors):
        if not want:
            grads.append(None)
        elif not computed:
            raise RuntimeError(f"inductor_xent: strategy 'store' computed no gradient for {name} in the forward "
                               f"(needs_{name}=False) but autograd asks for one")
        else:  # 0-dim grad_loss: the result keeps g's dtype, rounded once
            grads.append(_scaled(g, grad_loss, ctx.consumed))
    return (*grads, *(None,) * 13)


def _scaled(g: Tensor, grad_loss: Tensor, consumed: bool) -> Tensor:
    """``g * grad_loss``: eagerly on the Triton path a blocked kernel (launch.scaled: the same bits,
    ~4x faster than torch's mixed-dtype product), in place over the saved gradient when its caller
    dropped it (``consumed``) and autograd frees the graph after this backward: then nobody else
    sees it, and on the GPU ``loss.backward()``'s upstream 1 moves no memory. Traced (AOTAutograd)
    it is the ``store_scale`` op, which inductor_pass.DonatedScale runs in place where autograd
    donates the saved gradient to the compiled backward."""
    if not _concrete(g, grad_loss):
        # traced (fake / functional tensors) the op; a tensor subclass (DTensor) keeps torch's product
        subclass = any(is_traceable_wrapper_subclass(t) for t in (g, grad_loss))
        return g * grad_loss if subclass else STORE_SCALE(g, grad_loss)
    if not use_triton(g):
        return g * grad_loss
    return _kernels(g).scaled(g, grad_loss, in_place=consumed and not compat.graph_retained())


@torch.library.custom_op("inductor_xent::store_scale", mutates_args=())
@_without_autocast
def store_scale(g: Tensor, s: Tensor) -> Tensor:
    """``g * s`` for a saved gradient ``g`` and the 0-dim upstream gradient ``s``, out of place:
    store's backward as AOTAutograd traces it."""
    return _kernels(g).scaled(g, s) if use_triton(g) else g * s


@store_scale.register_fake
def _(g, s):
    return torch.empty_like(g)


@torch.library.custom_op("inductor_xent::store_scale_", mutates_args=("g",))
@_without_autocast
def store_scale_(g: Tensor, s: Tensor) -> None:
    """``g *= s`` (the same bits as ``store_scale``); on the GPU nothing is read or written when
    ``s`` is 1. Only inductor_pass.DonatedScale puts it in a graph, over a donated saved gradient."""
    if use_triton(g):
        _kernels(g).scaled(g, s, in_place=True)
    else:
        g.mul_(s)


def _concrete(*tensors: Tensor) -> bool:
    """Plain tensors outside any tracing: a Triton launch needs data pointers, and AOTAutograd
    traces this backward with fake / functional tensors under a dispatch mode."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return (not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None
            and all(type(t) is Tensor for t in tensors))


linear_ce_store.register_autograd(_store_backward, setup_context=_store_setup_context)

# ---------------------------------------------------------------------------------------------
# log-probabilities: forward, backward, autograd
# ---------------------------------------------------------------------------------------------
def _lp_opts(ignore_index: int, logit_scale: float, softcap: Optional[float]) -> LossOptions:
    return LossOptions(ignore_index, 0.0, logit_scale, softcap, 0.0)


@torch.library.custom_op("inductor_xent::linear_logprob_fwd", mutates_args=())
@_without_autocast
def linear_logprob_fwd(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    target: Tensor,
    ignore_index: int,
    logit_scale: float,
    softcap: Optional[float],
    need_entropy: bool,
    need_argmax: bool,
    skip_ignored: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    opts = _lp_opts(ignore_index, logit_scale, softcap)
    fallback.check_targets(target, weight.shape[0], ignore_index)  # on CPU only (no host sync)
    return _implementation(hidden).log_probs_forward(hidden, weight, bias, target, opts, need_entropy, need_argmax,
                                                     skip_ignored=skip_ignored)


@linear_logprob_fwd.register_fake
def _(hidden, weight, bias, target, ignore_index, logit_scale, softcap, need_entropy, need_argmax,
      skip_ignored=False):
    return _lp_fakes(hidden, need_entropy, need_argmax)


def _lp_fakes(hidden: Tensor, need_entropy: bool, need_argmax: bool) -> tuple[Tensor, ...]:
    """(log_probs, entropy, argmax, lse, lse_lo) as both log-prob forward ops return them."""
    cd = compute_dtype(hidden.dtype)
    n = hidden.shape[0]
    return (
        hidden.new_empty((n,), dtype=cd),
        hidden.new_empty((n if need_entropy else 0,), dtype=cd),
        hidden.new_empty((n if need_argmax else 0,), dtype=torch.long),
        hidden.new_empty((n,), dtype=cd),
        hidden.new_empty((n,), dtype=cd),
    )


@torch.library.custom_op("inductor_xent::linear_logprob_bwd", mutates_args=())
@_without_autocast
def linear_logprob_bwd(
    grad_log_probs: Tensor,
    grad_entropy: Optional[Tensor],
    grad_lse: Tensor,
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    target: Tensor,
    lse: Tensor,
    lse_lo: Tensor,
    entropy: Optional[Tensor],
    ignore_index: int,
    logit_scale: float,
    softcap: Optional[float],
    needs_hidden: bool,
    needs_weight: bool,
    needs_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    _check_entropy_pair(grad_entropy, entropy, "linear_logprob_bwd")
    opts = _lp_opts(ignore_index, logit_scale, softcap)
    needs = (needs_hidden, needs_weight, needs_bias and bias is not None)
    # log_prob = −loss (no smoothing, no z-loss): the loss's backward with the gradient negated
    args = (-grad_log_probs, grad_lse, hidden, weight, bias, target, lse, lse_lo, opts, needs)
    return _implementation(hidden).backward(*args, grad_entropy=grad_entropy, entropy=entropy)


def _check_entropy_pair(grad_entropy: Optional[Tensor], entropy: Optional[Tensor], name: str) -> None:
    if (grad_entropy is None) != (entropy is None):
        raise ValueError(f"{name}: grad_entropy and entropy must both be tensors or both be None, got "
                         f"grad_entropy={'None' if grad_entropy is None else 'a tensor'}, "
                         f"entropy={'None' if entropy is None else 'a tensor'}")


@linear_logprob_bwd.register_fake
def _(grad_log_probs, grad_entropy, grad_lse, hidden, weight, bias, target, lse, lse_lo, entropy, ignore_index,
      logit_scale, softcap, needs_hidden, needs_weight, needs_bias):
    return _grad_fakes(hidden, weight, bias, needs_hidden, needs_weight, needs_bias)


def _lp_setup_context(ctx, inputs, output):
    hidden, weight, bias, target, ignore_index, logit_scale, softcap, need_entropy, *_ = inputs
    _, entropy, argmax, lse, lse_lo = output
    ctx.save_for_backward(hidden, weight, bias, target, lse, lse_lo, entropy)
    ctx.mark_non_differentiable(argmax, lse_lo)
    ctx.set_materialize_grads(False)  # an unused entropy costs no entropy term in the backward
    ctx.options = (ignore_index, logit_scale, softcap)
    ctx.need_entropy = need_entropy
    ctx.num_inputs = len(inputs)  # nine, or ten with skip_ignored


def _lp_backward(ctx, grad_log_probs, grad_entropy, _grad_argmax, grad_lse, _grad_lse_lo):
    return _lp_grads(ctx, LOGPROB_BACKWARD, ctx.saved_tensors, grad_log_probs, grad_entropy, grad_lse,
                     extra=ctx.num_inputs - 9)


def _lp_grads(ctx, op, saved, grad_log_probs, grad_entropy, grad_lse, stored=(), extra=0, tail=()):
    """The log-prob ops' autograd backward: ``op`` (LOGPROB_BACKWARD, or LOGPROB_STORE_BACKWARD with
    the ``stored`` tensors) on the saved (hidden, weight, bias, target, lse, lse_lo, entropy); the
    forward has ``extra`` more arguments than the recompute op's nine."""
    hidden, weight, bias, target, lse, lse_lo, entropy = saved
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    need_b = need_b and bias is not None
    if grad_log_probs is None:
        grad_log_probs = torch.zeros_like(lse)
    if grad_lse is None:
        grad_lse = torch.zeros_like(lse)
    if grad_entropy is None or not ctx.need_entropy:
        grad_entropy, entropy = None, None
    grad_h, grad_w, grad_b = op(
        grad_log_probs, grad_entropy, grad_lse, hidden, weight, bias, target, lse, lse_lo, entropy, *stored,
        *ctx.options, need_h, need_w, need_b, *tail,
    )
    return (
        grad_h if need_h else None,
        grad_w if need_w else None,
        grad_b if need_b else None,
        *(None,) * (6 + extra),
    )


linear_logprob_fwd.register_autograd(_lp_backward, setup_context=_lp_setup_context)


# ---------------------------------------------------------------------------------------------
# log-probabilities, strategy store: the first S rows' exp-logits kept for the backward
# ---------------------------------------------------------------------------------------------
@torch.library.custom_op("inductor_xent::linear_logprob_store", mutates_args=())
@_without_autocast
def linear_logprob_store(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    target: Tensor,
    ignore_index: int,
    logit_scale: float,
    softcap: Optional[float],
    need_entropy: bool,
    need_argmax: bool,
    store_rows: int,
    budget: str,
    skip_ignored: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    opts = _lp_opts(ignore_index, logit_scale, softcap)
    fallback.check_targets(target, weight.shape[0], ignore_index)  # on CPU only (no host sync)
    if not use_triton(hidden):  # the chunked path keeps nothing: its backward recomputes every row
        return (*fallback.log_probs_forward(hidden, weight, bias, target, opts, need_entropy, need_argmax,
                                            skip_ignored=skip_ignored),
                *_stored_fakes(hidden, weight, softcap, 0))
    rows = strategy.logprob_store_rows(hidden.shape[0], weight.shape[0], hidden.dtype, budget, store_rows)
    return _kernels(hidden).log_probs_store(hidden, weight, bias, target, opts, need_entropy, need_argmax, rows,
                                            skip_ignored)


def _stored_fakes(hidden: Tensor, weight: Tensor, softcap: Optional[float], rows) -> tuple[Tensor, Tensor, Tensor]:
    """Empty tensors of the shapes of linear_logprob_store's ``e``, ``m``, ``st`` for ``rows`` stored
    rows (a SymInt under a dynamic N); (0, 0), (0, 0), (0,) where nothing is kept."""
    if isinstance(rows, int) and rows == 0:
        return hidden.new_empty((0, 0)), hidden.new_empty((0, 0), dtype=torch.float32), \
            hidden.new_empty((0,), dtype=torch.float32)
    e, m = _kernels(hidden).stored_empty(hidden, rows, weight.shape[0], hidden.dtype)
    return e, m, hidden.new_empty((rows if softcap is not None else 0,), dtype=torch.float32)


@linear_logprob_store.register_fake
def _(hidden, weight, bias, target, ignore_index, logit_scale, softcap, need_entropy, need_argmax, store_rows, budget,
      skip_ignored=False):
    rows = strategy.logprob_store_rows(hidden.shape[0], weight.shape[0], hidden.dtype, budget, store_rows) \
        if use_triton(hidden) else 0
    return (*_lp_fakes(hidden, need_entropy, need_argmax), *_stored_fakes(hidden, weight, softcap, rows))


def _lp_store_bwd_op(in_place: bool):
    """The log-prob store's backward as a custom op's function (one signature for both ops below)."""

    @_without_autocast
    def op(
        grad_log_probs: Tensor,
        grad_entropy: Optional[Tensor],
        grad_lse: Tensor,
        hidden: Tensor,
        weight: Tensor,
        bias: Optional[Tensor],
        target: Tensor,
        lse: Tensor,
        lse_lo: Tensor,
        entropy: Optional[Tensor],
        e: Tensor,
        m: Tensor,
        st: Tensor,
        ignore_index: int,
        logit_scale: float,
        softcap: Optional[float],
        needs_hidden: bool,
        needs_weight: bool,
        needs_bias: bool,
        compacted: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor]:
        return _lp_store_bwd(grad_log_probs, grad_entropy, grad_lse, hidden, weight, bias, target, lse, lse_lo,
                             entropy, e, m, st, ignore_index, logit_scale, softcap, needs_hidden, needs_weight,
                             needs_bias, in_place=in_place, compacted=compacted)

    op.__name__ = op.__qualname__ = "linear_logprob_store_bwd" + ("_" if in_place else "")
    return op


linear_logprob_store_bwd = torch.library.custom_op("inductor_xent::linear_logprob_store_bwd", mutates_args=())(
    _lp_store_bwd_op(False))
# ``linear_logprob_store_bwd`` that may write over ``e`` (its dz goes there on the Triton path: two
# whole-vocabulary GEMMs and no dz buffer). Only for an ``e`` nobody reads afterwards: the eager backward
# of ``consuming_stored`` calls without ``retain_graph``, and inductor_pass.DonatedScale where autograd
# donates ``e`` to a compiled backward.
linear_logprob_store_bwd_ = torch.library.custom_op("inductor_xent::linear_logprob_store_bwd_",
                                                    mutates_args=("e",))(_lp_store_bwd_op(True))


def _lp_store_bwd(grad_log_probs, grad_entropy, grad_lse, hidden, weight, bias, target, lse, lse_lo, entropy, e, m,
                  st, ignore_index, logit_scale, softcap, needs_hidden, needs_weight, needs_bias, in_place=False,
                  compacted=False):
    if e.shape[0] == 0:  # nothing kept (the chunked path): every row recomputes
        return linear_logprob_bwd(grad_log_probs, grad_entropy, grad_lse, hidden, weight, bias, target, lse, lse_lo,
                                  entropy, ignore_index, logit_scale, softcap, needs_hidden, needs_weight, needs_bias)
    _check_entropy_pair(grad_entropy, entropy, "linear_logprob_store_bwd")
    opts = _lp_opts(ignore_index, logit_scale, softcap)
    needs = (needs_hidden, needs_weight, needs_bias and bias is not None)
    return _kernels(hidden).log_probs_store_backward(-grad_log_probs, grad_lse, hidden, weight, bias, target, lse,
                                                     lse_lo, opts, needs, grad_entropy=grad_entropy, entropy=entropy,
                                                     e=e, m=m, st=st, in_place=in_place, compacted=compacted)


def _lp_store_bwd_fake(grad_log_probs, grad_entropy, grad_lse, hidden, weight, bias, target, lse, lse_lo, entropy, e,
                       m, st, ignore_index, logit_scale, softcap, needs_hidden, needs_weight, needs_bias,
                       compacted=False):
    return _grad_fakes(hidden, weight, bias, needs_hidden, needs_weight, needs_bias)


linear_logprob_store_bwd.register_fake(_lp_store_bwd_fake)
linear_logprob_store_bwd_.register_fake(_lp_store_bwd_fake)


def consuming_stored(*args) -> tuple[Tensor, ...]:
    """``linear_logprob_store(*args)`` for a caller that drops the stored outputs ``e, m, st`` (the
    functional API): the eager backward on the Triton path may then write dz over ``e``
    (``linear_logprob_store_bwd_``) unless the graph is retained. Eager only (a context variable);
    called directly, the op leaves the ``e`` its caller holds as it was."""
    token = _OUTPUTS_CONSUMED.set(True)
    try:
        return LOGPROB_STORE(*args)
    finally:
        _OUTPUTS_CONSUMED.reset(token)


def _lp_store_setup_context(ctx, inputs, output):
    hidden, weight, bias, target, ignore_index, logit_scale, softcap, need_entropy, need_argmax, *rest = inputs
    _, entropy, argmax, lse, lse_lo, e, m, st = output
    ctx.consumed = _OUTPUTS_CONSUMED.get()  # the caller dropped e, m, st
    ctx.num_inputs = len(inputs)  # eleven, or twelve with skip_ignored
    # e, m, st hold the valid rows first (launch.log_probs_store): the backward must know
    skip_ignored = len(rest) > 2 and rest[2]
    ctx.compacted = skip_ignored and use_triton(hidden) and _kernels(hidden).store_skips(True, hidden.dtype)
    ctx.save_for_backward(hidden, weight, bias, target, lse, lse_lo, entropy, e, m, st)
    ctx.mark_non_differentiable(argmax, lse_lo, e, m, st)
    ctx.set_materialize_grads(False)
    ctx.options = (ignore_index, logit_scale, softcap)
    ctx.need_entropy = need_entropy


def _lp_store_backward(ctx, grad_log_probs, grad_entropy, _grad_argmax, grad_lse, *_unused):
    hidden, weight, bias, target, lse, lse_lo, entropy, e, m, st = ctx.saved_tensors
    # eagerly, dz over e where nobody reads e again; traced, DonatedScale decides (donation)
    in_place = ctx.consumed and _concrete(e) and use_triton(hidden) and not compat.graph_retained()
    op = LOGPROB_STORE_BACKWARD_ if in_place else LOGPROB_STORE_BACKWARD
    return _lp_grads(ctx, op, (hidden, weight, bias, target, lse, lse_lo, entropy),
                     grad_log_probs, grad_entropy, grad_lse, stored=(e, m, st), extra=ctx.num_inputs - 9,
                     tail=(True,) if ctx.compacted else ())


linear_logprob_store.register_autograd(_lp_store_backward, setup_context=_lp_store_setup_context)

FORWARD = torch.ops.inductor_xent.linear_ce_fwd.default
BACKWARD = torch.ops.inductor_xent.linear_ce_bwd.default
STORE = torch.ops.inductor_xent.linear_ce_store.default
STORE_SCALE = torch.ops.inductor_xent.store_scale.default
STORE_SCALE_ = torch.ops.inductor_xent.store_scale_.default
LOGPROB_FORWARD = torch.ops.inductor_xent.linear_logprob_fwd.default
LOGPROB_BACKWARD = torch.ops.inductor_xent.linear_logprob_bwd.default
LOGPROB_STORE = torch.ops.inductor_xent.linear_logprob_store.default
LOGPROB_STORE_BACKWARD = torch.ops.inductor_xent.linear_logprob_store_bwd.default
LOGPROB_STORE_BACKWARD_ = torch.ops.inductor_xent.linear_logprob_store_bwd_.default

# the distillation ops (two lm_heads): defined with their implementation in distill.py
from . import distill  # noqa: E402, F401 - registers them

DISTILL_FORWARD = torch.ops.inductor_xent.linear_distill_fwd.default
DISTILL_BACKWARD = torch.ops.inductor_xent.linear_distill_bwd.default
DISTILL_RECOMPUTE = torch.ops.inductor_xent.linear_distill_recompute_fwd.default
DISTILL_RECOMPUTE_BACKWARD = torch.ops.inductor_xent.linear_distill_recompute_bwd.default
