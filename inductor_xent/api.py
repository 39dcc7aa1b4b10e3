"""``linear_cross_entropy`` and ``linear_log_probs``: the public functions. Validate at the
boundary, then call the ops."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from . import config, ops, options
from . import strategy as strategies
from . import topk as _topk
from .options import FLOAT_DTYPES, REDUCTIONS, check_temperature, fold_temperature, reduced


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    bias: Optional[Tensor] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
    z_loss: float = 0.0,
    strategy: Optional[str] = None,
    store_budget: Optional[str | int] = None,
) -> Tensor:
    """Cross-entropy of a linear layer's output, without materialising the ``[N, V]`` logits.

    ``hidden`` is ``[..., D]``, ``weight`` ``[V, D]`` (as ``nn.Linear(D, V).weight``), ``target``
    the leading shape ``[...]`` of integer class ids, ``bias`` ``[V]`` or None. Exactly equal (up to
    rounding, computed more precisely) to::

        z = F.linear(hidden, weight, bias).float() * logit_scale       # float64 for float64 inputs
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        V = weight.shape[0]
        loss = F.cross_entropy(z.view(-1, V), target.view(-1), ignore_index=ignore_index,
                               reduction=reduction, label_smoothing=label_smoothing)
        # plus z_loss * logsumexp(z)**2 on every non-ignored row, reduced the same way

    except that the logits are accumulated and kept in float32 instead of being rounded to the
    input dtype first. Inside ``torch.autocast`` the operands are cast to autocast's dtype first,
    as autocast casts them for ``F.linear``. ``mean`` divides by the number of non-ignored targets
    (NaN when there are none, like PyTorch); ``none`` returns ``target``'s shape. The result is float32 for bfloat16,
    float16 and float32 inputs, float64 for float64 inputs.

    ``strategy`` (default ``INDUCTOR_XENT_STRATEGY``, else ``"auto"``) chooses how the gradients
    are computed: ``"recompute"`` keeps O(N) statistics and recomputes the logits in the backward
    (8·N·D·V FLOPs); ``"store"`` computes the gradients of the mean/sum loss in the forward from the
    same logits, one row chunk at a time, and the backward only scales them (6·N·D·V FLOPs, more
    memory); ``"auto"`` takes ``store`` when the reduction allows it and its extra memory fits
    ``store_budget`` (default ``INDUCTOR_XENT_STORE_BUDGET``, else ``"1x"``: the size of the
    logits in the input dtype; also bytes like ``"2GiB"``). See ``inductor_xent.strategy``.

    Targets outside ``[0, V)`` that are not ``ignore_index`` raise ``ValueError`` on CPU. On CUDA
    they are not checked (that would need a host synchronisation): such a row gets a finite but
    meaningless loss (its target logit is read as 0) and gradients as if it had no target.
    """
    hidden, weight, bias = _autocast(hidden, weight, bias)  # first: bf16 activations, fp32 master weights
    _validate(hidden, weight, target, bias, reduction, label_smoothing, logit_scale, softcap, z_loss)
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    target1d = target.reshape(-1)
    options = (int(ignore_index), float(label_smoothing), float(logit_scale),
               None if softcap is None else float(softcap), float(z_loss))
    needs, budget = _needs_and_budget(hidden, weight, bias, store_budget)
    smoothed = True if label_smoothing != 0 else False  # a branch: Dynamo guards a symbolic float (bool() would not)
    which = _choose(*_sizes(hidden2d, weight), hidden2d.dtype, weight.dtype, reduction, needs, smoothed,
                    softcap is not None, strategy, budget, hidden2d.device.type)
    if which == "store":  # chunks sized by the op at run time, from the budget
        # eagerly through store_consuming_gradients: the gradient outputs are dropped here, so the
        # backward may scale them in place (under torch.compile the traced backward never does)
        store = ops.STORE if torch.compiler.is_compiling() else ops.store_consuming_gradients
        loss, *_ = store(hidden2d, weight, bias, target1d, *options, reduction, 0, budget, *needs)
        return loss
    rows = ops.FORWARD(hidden2d, weight, bias, target1d, *options, False, True)[0]  # skip_ignored: lse unread
    if reduction == "none":
        return rows.view(target.shape)
    return reduced(rows.sum(), target1d != ignore_index, reduction)


class LogProbs(NamedTuple):
    """What ``linear_log_probs`` returns; every tensor has ``target``'s shape."""

    log_probs: Tensor  # float32 (float64 for float64 inputs); 0 on ignored rows
    entropy: Optional[Tensor]  # same dtype; 0 on ignored rows; None unless entropy=True
    argmax: Optional[Tensor]  # int64, every row (ignored ones too); None unless argmax=True


def linear_log_probs(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
    ignore_index: int = -100,
    entropy: bool = False,
    argmax: bool = False,
    strategy: Optional[str] = None,
    store_budget: Optional[str | int] = None,
    top_k: Optional[int | Tensor] = None,
    top_p: Optional[float | Tensor] = None,
) -> LogProbs:
    """Per-token log-probabilities of ``target`` (and optionally the entropy and the argmax) of a
    linear layer's output at a sampling temperature, without materialising the ``[N, V]`` logits:
    the heads of RL fine-tuning (PPO, GRPO, DPO: ratios of new to old log-probabilities, an entropy
    bonus) and of evaluation (token accuracy).

    ``hidden`` is ``[..., D]``, ``weight`` ``[V, D]``, ``target`` ``[...]`` of integer class ids,
    ``bias`` ``[V]`` or None. Equal (up to rounding, computed more precisely) to::

        z = F.linear(hidden, weight, bias).float() * logit_scale       # float64 for float64 inputs
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        z = z / temperature
        logp = z.log_softmax(-1)
        valid = target != ignore_index
        log_probs = torch.where(valid, logp.gather(-1, target.where(valid, 0).unsqueeze(-1)).squeeze(-1), 0.0)
        #         = -F.cross_entropy(z.view(-1, V), target.view(-1), ignore_index=ignore_index,
        #                            reduction="none").view(target.shape)
        entropy = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
        argmax = z.argmax(-1)                          # token accuracy: (argmax == target) & valid

    except that the logits are accumulated and kept in float32 instead of being rounded to the
    input dtype first. Inside ``torch.autocast`` the operands are cast to autocast's dtype first,
    as autocast casts them for ``F.linear``. The temperature divides the logits after the softcap,
    as RL code divides a model's (already capped) logits. Ignored rows give 0 log-probability and 0 entropy and pass no
    gradient; ``argmax`` does not depend on the target and is given for every row (the first
    maximal column on ties, as ``torch.argmax``). ``log_probs`` and ``entropy`` are
    differentiable with any incoming gradient (per-token advantages, masks); ``argmax`` is not.
    Returns ``LogProbs(log_probs, entropy, argmax)`` with ``None`` for what was not asked for.

    ``strategy`` (default ``INDUCTOR_XENT_STRATEGY``, else ``"auto"``) chooses how the gradients are
    computed: ``"recompute"`` keeps O(N) statistics and the backward recomputes the logits (8·N·D·V
    FLOPs in all); ``"store"`` keeps the exp-logits of as many rows as ``store_budget`` holds (16
    bits each for 16-bit inputs, default ``"1x"``: the size of the logits in the input dtype; also
    bytes like ``"4GiB"``) and their backward forms the gradient from them with two GEMMs instead of
    three (6·N·D·V FLOPs for those rows); the other rows recompute. ``"auto"`` takes ``store`` on CUDA
    from D = 2048 up, where at least 1024 rows (or all) fit. Deterministic either way.
    Targets outside ``[0, V)`` that are not ``ignore_index`` raise ``ValueError`` on CPU; on CUDA
    they are not checked (a host synchronisation): such a row's log-probability is ``−lse`` (its
    target logit read as 0), its entropy and argmax are right, and its gradient is that of ``−lse``.

    ``top_k`` (an int, or an integer tensor of ``target``'s shape: one k per row) replays top-k
    sampling: the log-probabilities are over each row's kept set, its ``top_k`` largest logits,
    renormalised (``−inf`` where the target is outside it), and the entropy is that kept
    distribution's; the argmax is unchanged. Equal, with gradients, to eager's
    ``log_softmax(z.masked_fill(z < torch.topk(z, k).values[..., -1:], -inf))`` gathered at the
    target (ties at the k-th logit: eager keeps every tied column, this the k ``torch.topk``
    returns). It runs the top-k op (``topk.py``: row chunks, ``torch.topk`` over each chunk's
    logits; its backward recomputes them; ``strategy`` does not apply); a per-row ``top_k`` costs
    one host synchronisation (the op's k is the largest).

    ``top_p`` (in (0, 1]; or a floating tensor of ``target``'s shape, one per row, as a rollout
    engine's per-request sampling parameters, checked on CPU only) replays nucleus sampling: the kept
    set is each row's smallest prefix of
    logits, largest first, whose probability reaches ``top_p`` (after ``top_k`` when both are given,
    renormalised over the top-k first, as vLLM and HF apply them; a column is kept while the mass
    before it is below ``top_p``). The log-probs are over that set (``−inf`` outside it), with
    gradients as eager's masked log-softmax. It runs ``inductor_xent::linear_nucleus_logprob`` over
    row chunks (O(chunk·V) memory, no ``[N, V]`` tensor): a row whose 256 largest logits hold its kept
    set reads it from them, the others are sorted; its backward recomputes the logits (not sorting
    them: each row's kept set is rebuilt from the forward's edge column); ``entropy``
    and ``argmax`` are not computed with ``top_p`` (a ``ValueError``). A kept set decided within
    rounding of the rollout engine's (its mass at ``top_p`` exactly) may differ.
    """
    hidden, weight, bias = _autocast(hidden, weight, bias)  # first: bf16 activations, fp32 master weights
    _validate(hidden, weight, target, bias, "none", 0.0, logit_scale, softcap, 0.0)
    temperature = check_temperature(temperature)
    for name, flag in (("entropy", entropy), ("argmax", argmax)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    scale, cap = fold_temperature(float(logit_scale), None if softcap is None else float(softcap), float(temperature))
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    if top_p is not None:
        if entropy or argmax:
            raise ValueError("entropy and argmax are not computed with top_p: call linear_log_probs once more "
                             "without top_p for them")
        if isinstance(top_k, Tensor) and top_k.shape != target.shape:
            raise ValueError(f"a top_k tensor must have target's shape {tuple(target.shape)}, got {tuple(top_k.shape)}")
        if isinstance(top_p, Tensor) and top_p.shape != target.shape:
            raise ValueError(f"a top_p tensor must have target's shape {tuple(target.shape)}, got {tuple(top_p.shape)}")
        lp = _topk.nucleus(hidden2d, weight, bias, target.reshape(-1),
                           top_k.reshape(-1) if isinstance(top_k, Tensor) else top_k,
                           top_p.reshape(-1) if isinstance(top_p, Tensor) else top_p, scale, cap, int(ignore_index))
        return LogProbs(lp.view(target.shape), None, None)
    if top_k is not None:
        if isinstance(top_k, Tensor) and top_k.shape != target.shape:
            raise ValueError(f"a top_k tensor must have target's shape {tuple(target.shape)}, got {tuple(top_k.shape)}")
        lp, ent, arg = _topk.kept(hidden2d, weight, bias, target.reshape(-1),
                                  top_k.reshape(-1) if isinstance(top_k, Tensor) else top_k, scale, cap,
                                  int(ignore_index), entropy, argmax)
        shape = target.shape
        return LogProbs(lp.view(shape), ent.view(shape) if entropy else None, arg.view(shape) if argmax else None)
    args = (hidden2d, weight, bias, target.reshape(-1), int(ignore_index), scale, cap, entropy, argmax)
    needs, budget = _needs_and_budget(hidden, weight, bias, store_budget)
    if _choose_log_probs(*_sizes(hidden2d, weight), hidden2d.dtype, needs, strategy, budget,
                         hidden2d.device.type) == "store":  # rows sized by the op at run time, from the budget
        # eagerly through consuming_stored (e, m, st are dropped here: the backward may write dz
        # over e); compiled, DonatedScale does that where autograd donates e
        run = ops.LOGPROB_STORE if torch.compiler.is_compiling() else ops.consuming_stored
        log_probs, ent, arg, *_ = run(*args, 0, budget, not argmax)  # skip_ignored: no lse read here
    else:
        # skip_ignored: no lse read here; the argmax is every row's (documented above)
        log_probs, ent, arg, _, _ = ops.LOGPROB_FORWARD(*args, not argmax)
    shape = target.shape
    return LogProbs(log_probs.view(shape), ent.view(shape) if entropy else None, arg.view(shape) if argmax else None)


def _needs_and_budget(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], store_budget) -> tuple:
    """(which of hidden, weight, bias autograd will ask gradients for; the store budget as the op
    takes it, ``config``'s unless given, checked here for a clear error)."""
    grad = torch.is_grad_enabled()
    needs = (grad and hidden.requires_grad, grad and weight.requires_grad,
             grad and bias is not None and bias.requires_grad)
    if store_budget is not None:
        config.parse_budget(store_budget)
    return needs, str(store_budget) if store_budget is not None else config.store_budget()


@torch.compiler.assume_constant_result
def _choose_log_probs(n, d, v, dtype, needs, which, budget, device):
    """``strategy.choose_log_probs``'s strategy, a constant under torch.compile (as ``_choose``)."""
    return strategies.choose_log_probs(n, d, v, dtype, needs=needs, strategy=which, budget=budget,
                                       device=device).strategy


def _autocast(hidden: Tensor, weight: Tensor, bias: Optional[Tensor]) -> tuple:
    """The operands as ``F.linear`` gets them inside ``torch.autocast`` for their device: each floating
    tensor in autocast's dtype, except float64 (which autocast never casts); anything else as it came
    (``_validate`` names it). The loss stays in fp32, as autocast computes ``cross_entropy``."""
    if not isinstance(hidden, Tensor) or not torch.is_autocast_enabled(hidden.device.type):
        return hidden, weight, bias
    dtype = torch.get_autocast_dtype(hidden.device.type)

    def cast(t):
        castable = isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float64
        return t.to(dtype) if castable else t

    return cast(hidden), cast(weight), cast(bias)


def _validate(hidden, weight, target, bias, reduction, label_smoothing, logit_scale, softcap, z_loss):
    for name, t in (("hidden", hidden), ("weight", weight), ("target", target)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, Tensor):
        raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if hidden.dtype not in FLOAT_DTYPES:
        raise TypeError(f"hidden must be float64, float32, bfloat16 or float16, got {hidden.dtype}")
    options.check_head_dtypes(hidden, weight, bias)
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(
            f"target must hold integer class ids, got dtype {target.dtype} "
            "(probability targets are not supported)"
        )
    if hidden.dim() < 1 or weight.dim() != 2:
        raise ValueError(
            f"expected hidden [..., D] and weight [V, D], got hidden {tuple(hidden.shape)} and "
            f"weight {tuple(weight.shape)}"
        )
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden's last dimension ({hidden.shape[-1]}) must equal weight's second dimension "
            f"({weight.shape[1]}): hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} [V, D]"
        )
    if weight.shape[0] == 0:
        raise ValueError("weight has no rows: the vocabulary V must be at least 1")
    if target.shape != hidden.shape[:-1]:
        raise ValueError(
            f"target's shape {tuple(target.shape)} must equal hidden's leading shape "
            f"{tuple(hidden.shape[:-1])} (hidden is {tuple(hidden.shape)})"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must have shape ({weight.shape[0]},) [V], got {tuple(bias.shape)}")
    devices = {t.device for t in (hidden, weight, target, bias) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"hidden, weight, target and bias must be on one device, got {sorted(map(str, devices))}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(map(repr, REDUCTIONS))}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if not options.finite(logit_scale):
        raise ValueError(f"logit_scale must be finite, got {logit_scale}")
    if softcap is not None and not (options.finite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap}")
    if not (options.finite(z_loss) and z_loss >= 0):
        raise ValueError(f"z_loss must be a finite number >= 0, got {z_loss}")


def _sizes(hidden2d, weight):
    """(N, D, V) for planning, N always None (planned as strategy.DYNAMIC_ROWS). Under torch.compile
    a dynamic N must neither be guarded nor cause recompiles, and Dynamo shows a SymInt to the traced
    code as an int, so the two cannot be told apart there; eager calls plan the same way so that an
    eager and a compiled call of the same function take the same strategy and give the same bits
    (on the H200 an eager call at N = 1000 planned recompute where the compiled one planned store).
    The op sizes its store chunks for the real N. D and V are parameters' sizes (static)."""
    return None, int(weight.shape[1]), int(weight.shape[0])


@torch.compiler.assume_constant_result
def _choose(n, d, v, dtype, weight_dtype, reduction, needs, smoothed: bool, capped: bool, which, budget, device):
    """``strategy.choose``'s strategy; under torch.compile Dynamo runs it once while tracing and keeps
    the result as a constant (its arguments are all Python constants). Of the label smoothing and the
    softcap the choice reads only whether there are any (``store_unsupported``): flags, so that a float
    Dynamo made symbolic (a function default under ``dynamic=True``) is no argument here."""
    return strategies.choose(n, d, v, dtype, weight_dtype, reduction=reduction, needs=needs,
                             label_smoothing=1.0 if smoothed else 0.0, softcap=1.0 if capped else None,
                             strategy=which, budget=budget, device=device).strategy
