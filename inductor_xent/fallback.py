"""Chunked PyTorch implementation: CPU tensors, float64, and wherever the Triton kernels cannot run.

Both strategies walk the rows in chunks and never hold more than one chunk of ``rows x V`` logits
(plus its softmax and a buffer for the softcap derivative) at a time:

* ``recompute`` (``forward`` + ``backward``): the forward keeps per-row statistics only; the
  backward recomputes each chunk's logits from ``hidden``, ``weight`` and the saved logsumexp.
  8·N·D·V FLOPs, O(N + chunk) memory.
* ``store`` (``store``): one pass computes the loss and, from the same logits, the gradients of
  the reduced (mean or sum) loss; the backward only scales them by the incoming scalar gradient.
  6·N·D·V FLOPs; the gradients (and an fp32 accumulator for a low-precision weight) are held from
  forward to backward.

Gradient of the per-row loss w.r.t. the (capped) logits ``z`` of a row, with incoming gradients
``g`` (loss) and ``h`` (lse), ``p = softmax(z)``, ``ε`` = label_smoothing::

    dz = g·(p − (1 − ε)·onehot(t) − ε/V) + (2·z_loss·lse·g + h)·p

then times ``sech²(x)`` (``x`` the uncapped logit over ``softcap``) for softcapping and
``logit_scale`` for the scale. Ignored rows have ``g = 0`` (their loss is the constant 0) but still
pass ``h`` through.

Log-probabilities (``log_probs_forward`` and ``backward`` with an entropy): ``log_prob = z_t − lse
= −loss`` (no smoothing, no z-loss; a temperature is folded into the scale and cap,
``options.fold_temperature``), so its gradient is the loss's with ``g`` negated. The entropy
``H = lse − Σ p·z`` is computed relative to the row max, ``H = log s − Σ e^{z−m}(z − m) / s``
(``s = Σ e^{z−m}``: no cancellation when every logit is large), and its gradient with an incoming
``e`` per row is::

    dH/dz_j = −p_j·(log p_j + H)        (Σ_j dH/dz_j = H − H = 0)

added to dz before the softcap and scale factors, with ``log p = (z − lse) − lse_lo``.

Precision: the loss is computed relative to the row maximum ``m``,
``log Σexp(z − m) + (1 − ε)(m − z_t) + ε(m − mean z)``, never as ``lse − z_t``: when every logit
is large (2^24) the rounding of ``lse`` would swallow the ``log Σ`` term. The backward rebuilds the
softmax as ``exp((z − lse) − lse_lo)`` from the logsumexp and its rounding residual ``lse_lo``
(``lse + lse_lo`` is the logsumexp to twice the working precision), for the same reason.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from . import config
from .options import LossOptions, compute_dtype, reduced, reduction_weights


def chunk_rows(num_rows: int, vocab: int, dtype: torch.dtype) -> int:
    """Rows per chunk so that one chunk of logits fits in ``config.fallback_chunk_bytes``."""
    itemsize = torch.finfo(dtype).bits // 8
    return max(1, min(num_rows, config.fallback_chunk_bytes // max(1, vocab * itemsize)))


def _chunk_logits(h: Tensor, w: Tensor, b: Optional[Tensor], opts: LossOptions,
                  raw_out: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
    """Logits of one row chunk in the compute dtype, and the uncapped ``x = z_raw / softcap`` when
    capped (the backward's ``sech²(x)``; ``None`` otherwise). ``raw_out`` (the rows of the op's
    logits output) receives ``h @ w.T + b`` rounded to its dtype, before the scale and softcap."""
    z = torch.mm(h, w.t()) if b is None else torch.addmm(b, h, w.t())
    if raw_out is not None:
        raw_out.copy_(z)
    if opts.logit_scale != 1.0:
        z.mul_(opts.logit_scale)
    if opts.softcap is None:
        return z, None
    x = z.div_(opts.softcap)
    return torch.tanh(x).mul_(opts.softcap), x


def _sech2_(x: Tensor) -> Tensor:
    """``1 − tanh²(x)`` in place as ``1 / cosh²(x)``: no cancellation where tanh saturates (the
    difference form loses every digit there), and cosh overflowing to inf gives the exact 0."""
    return x.cosh_().square_().reciprocal_()


def _upcast(hidden: Tensor, weight: Tensor, bias: Optional[Tensor]):
    cd = compute_dtype(hidden.dtype)
    return cd, weight.to(cd), None if bias is None else bias.to(cd)


def _row_stats(z: Tensor, t: Tensor, valid: Tensor, opts: LossOptions) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, lse, lse_lo) of one chunk of logits, all (rows,); see the module docstring."""
    eps = opts.label_smoothing
    m = z.amax(dim=-1)
    log_s = (z - m.unsqueeze(1)).exp_().sum(dim=-1).log_()
    lse = m + log_s
    lse_lo = (m - lse) + log_s
    z_t = z.gather(1, torch.where(valid, t, 0).unsqueeze(1)).squeeze(1)
    loss = log_s + (1 - eps) * (m - z_t)
    if eps != 0.0:
        loss += eps * (m - z.mean(dim=-1))
    if opts.z_loss != 0.0:
        loss += opts.z_loss * lse.square()
    return torch.where(valid, loss, 0.0), lse, lse_lo


def _dlogits_(z: Tensor, x: Optional[Tensor], lse: Tensor, lse_lo: Tensor, t: Tensor, valid: Tensor,
              g: Tensor, c: Tensor, opts: LossOptions, ent_g: Optional[Tensor] = None,
              ent: Optional[Tensor] = None) -> Tensor:
    """dz of one chunk, computed in place of the logits ``z`` (and of ``x``); ``g`` is the loss's
    incoming gradient (0 on ignored rows), ``c`` the softmax's coefficient from the lse terms;
    ``ent_g`` the entropy's incoming gradient (0 on ignored rows) and ``ent`` the entropy, or None."""
    eps, vocab = opts.label_smoothing, z.shape[1]
    log_p = z.sub_(lse.unsqueeze(1)).sub_(lse_lo.unsqueeze(1))  # in place of the logits
    ent_term = None
    if ent_g is not None:  # e·dH/dz = −e·p·(log p + H), kept in log_p's buffer
        p = log_p.exp()
        ent_term = log_p.add_(ent.unsqueeze(1)).mul_(p).mul_(ent_g.unsqueeze(1))
    else:
        p = log_p.exp_()  # softmax, in place of the logits
    # dz = (g + c)·(p − coef) + c·coef, coef = (1 − ε)·onehot + ε/V (0 on ignored rows): the smoothed
    # target's coefficient is one constant ((1 − ε) + ε/V, rounded once: 1 at V = 1) subtracted once,
    # and c·p is kept apart from g·(p − onehot) (folded into g·(1 + 2·z_loss·lse) the small z-loss
    # term rounds against 1, and where p ≈ onehot that is the whole gradient)
    idx = torch.where(valid, t, 0).unsqueeze(1)
    ok = valid.to(p.dtype).unsqueeze(1)
    rest, hit = ok * (eps / vocab), ok * ((1 - eps) + eps / vocab)
    p_t = p.gather(1, idx)
    d = p.sub_(rest) if eps != 0.0 else p
    d.scatter_(1, idx, torch.where(valid.unsqueeze(1), p_t - hit, p_t))
    d.mul_((g + c).unsqueeze(1))
    if eps != 0.0:
        d.add_(c.unsqueeze(1) * rest)  # every column; the target's remaining (1 − ε) next
    d.scatter_add_(1, idx, c.unsqueeze(1) * ok * (1 - eps))
    if ent_term is not None:
        d.sub_(ent_term)
    if x is not None:
        d.mul_(_sech2_(x))
    if opts.logit_scale != 1.0:
        d.mul_(opts.logit_scale)
    return d


Grads = tuple[Tensor, Tensor, Tensor]  # (grad_hidden, grad_weight, grad_bias)


def _live_rows(live: Tensor) -> Optional[Tensor]:
    """The indices of the rows that ``live`` marks, where they are fewer than all rows and reading
    them costs no host sync (CPU tensors): the other rows' loss and gradients are exactly 0, so
    their logits are never computed (``config.skip_ignored_rows``). None: walk every row."""
    if not config.skip_ignored_rows() or live.device.type != "cpu" or is_fake(live):
        return None
    idx = live.nonzero().squeeze(1)
    return None if idx.numel() == live.numel() else idx


def _row_chunks(n: int, step: int, live: Optional[Tensor]) -> list:
    """The row chunks to walk: slices of all ``n`` rows, or chunks of the row indices ``live``."""
    if live is None:
        return [slice(start, start + step) for start in range(0, n, step)]
    return [live[start:start + step] for start in range(0, live.numel(), step)]


def _grad_buffers(hidden: Tensor, weight: Tensor, cd: torch.dtype, needs: tuple[bool, bool, bool],
                  skipped: bool = False) -> Grads:
    """(grad_hidden in hidden's dtype, written one row chunk at a time (zeros first where rows are
    ``skipped``); the grad_weight and grad_bias accumulators in the compute dtype, rounded once by
    ``_rounded``); an empty (0,) for each one not in ``needs``."""
    need_h, need_w, need_b = needs
    return ((torch.zeros if skipped else torch.empty)(
                (hidden.shape[0], hidden.shape[1]) if need_h else (0,), dtype=hidden.dtype, device=hidden.device),
            torch.zeros(weight.shape if need_w else (0,), dtype=cd, device=weight.device),
            torch.zeros((weight.shape[0],) if need_b else (0,), dtype=cd, device=weight.device))


def _accumulate_(grads: Grads, needs: tuple[bool, bool, bool], rows, d: Tensor, h: Tensor, w: Tensor) -> None:
    """One row chunk's share of the gradients, from its dlogits ``d`` (rows, V) and its hidden states
    ``h`` (rows, D), both in the compute dtype like ``w``: dH = d·W, dW += dᵀ·h, db += Σ_rows d."""
    grad_h, grad_w, grad_b = grads
    need_h, need_w, need_b = needs
    if need_h:
        grad_h[rows] = torch.mm(d, w).to(grad_h.dtype)
    if need_w:
        grad_w.addmm_(d.t(), h)
    if need_b:
        grad_b += d.sum(dim=0)


def _rounded(grads: Grads, weight: Tensor, bias: Optional[Tensor]) -> Grads:
    """The gradients in the dtypes of hidden, weight and bias (the accumulators rounded once)."""
    grad_h, grad_w, grad_b = grads
    return grad_h, grad_w.to(weight.dtype), grad_b.to(weight.dtype if bias is None else bias.dtype)


def forward(
    hidden: Tensor,  # (N, D)
    weight: Tensor,  # (V, D)
    bias: Optional[Tensor],  # (V,)
    target: Tensor,  # (N,)
    opts: LossOptions,
    logits: Optional[Tensor] = None,  # (N, V): receives the raw logits (write_logits)
    skip_ignored: bool = False,  # nobody reads the ignored rows' lse: their logits are not computed
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row loss, logsumexp and its rounding residual, all (N,) in the compute dtype. With
    ``skip_ignored``, where the backward skips them too (``_live_rows``: CPU) and no logits are
    written, an ignored row's three values are 0 and its logits are never computed."""
    n, vocab = hidden.shape[0], weight.shape[0]
    cd, w, b = _upcast(hidden, weight, bias)
    live = _live_rows(target != opts.ignore_index) if skip_ignored and logits is None else None
    new = torch.empty if live is None else torch.zeros
    loss, lse, lse_lo = (new(n, dtype=cd, device=hidden.device) for _ in range(3))
    for rows in _row_chunks(n, chunk_rows(n, vocab, cd), live):
        z, _ = _chunk_logits(hidden[rows].to(cd), w, b, opts, None if logits is None else logits[rows])
        t = target[rows]
        loss[rows], lse[rows], lse_lo[rows] = _row_stats(z, t, t != opts.ignore_index, opts)
    return loss, lse, lse_lo


def log_probs_forward(
    hidden: Tensor,  # (N, D)
    weight: Tensor,  # (V, D)
    bias: Optional[Tensor],  # (V,)
    target: Tensor,  # (N,)
    opts: LossOptions,  # no label smoothing or z-loss; the temperature folded in
    need_entropy: bool,
    need_argmax: bool,
    skip_ignored: bool = False,  # nobody reads the ignored rows' lse: their logits are not computed
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(log_probs, entropy, argmax, lse, lse_lo), (N,) each; log_probs and entropy 0 on ignored
    rows, argmax (int64) of every row; entropy and argmax empty (0,) where not asked for. With
    ``skip_ignored``, as ``forward``'s: an ignored row's lse, lse_lo and argmax are 0 too."""
    n, vocab = hidden.shape[0], weight.shape[0]
    cd, w, b = _upcast(hidden, weight, bias)
    dev = hidden.device
    live = _live_rows(target != opts.ignore_index) if skip_ignored else None
    new = torch.empty if live is None else torch.zeros
    log_probs, lse, lse_lo = (new(n, dtype=cd, device=dev) for _ in range(3))
    entropy = new(n if need_entropy else 0, dtype=cd, device=dev)
    argmax = new(n if need_argmax else 0, dtype=torch.long, device=dev)
    for rows in _row_chunks(n, chunk_rows(n, vocab, cd), live):
        z, _ = _chunk_logits(hidden[rows].to(cd), w, b, opts)
        t = target[rows]
        valid = t != opts.ignore_index
        if need_argmax:
            argmax[rows] = z.argmax(dim=-1)  # the first maximal column, as torch.argmax
        m = z.amax(dim=-1)
        z_t = z.gather(1, torch.where(valid, t, 0).unsqueeze(1)).squeeze(1)
        d = z.sub_(m.unsqueeze(1))  # z − m, in place of the logits
        e = d.exp()
        s = e.sum(dim=-1)
        log_s = s.log()
        row_lse = m + log_s
        lse[rows], lse_lo[rows] = row_lse, (m - row_lse) + log_s
        log_probs[rows] = torch.where(valid, (z_t - m) - log_s, 0.0)  # relative to m, as the loss
        if need_entropy:
            entropy[rows] = torch.where(valid, log_s - e.mul_(d).sum(dim=-1) / s, 0.0)
    return log_probs, entropy, argmax, lse, lse_lo


def backward(
    grad_loss: Tensor,  # (N,)
    grad_lse: Tensor,  # (N,)
    hidden: Tensor,  # (N, D)
    weight: Tensor,  # (V, D)
    bias: Optional[Tensor],  # (V,)
    target: Tensor,  # (N,)
    lse: Tensor,  # (N,)
    lse_lo: Tensor,  # (N,)
    opts: LossOptions,
    needs: tuple[bool, bool, bool],
    grad_entropy: Optional[Tensor] = None,  # (N,): with entropy, the log-prob op's entropy term
    entropy: Optional[Tensor] = None,  # (N,)
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients for (hidden, weight, bias); an empty tensor stands for each one not in ``needs``."""
    n, vocab = hidden.shape[0], weight.shape[0]
    cd, w, b = _upcast(hidden, weight, bias)
    valid = target != opts.ignore_index
    g = torch.where(valid, grad_loss.to(cd), 0.0)
    c = 2 * opts.z_loss * lse.to(cd) * g + grad_lse.to(cd)
    ent_g = None if grad_entropy is None else torch.where(valid, grad_entropy.to(cd), 0.0)
    ent = None if entropy is None else entropy.to(cd)
    # a row with no incoming gradient (an ignored row without an lse term) has dz = 0 exactly
    live = _live_rows((g != 0) | (c != 0) | (False if ent_g is None else ent_g != 0))
    grads = _grad_buffers(hidden, weight, cd, needs, skipped=live is not None)
    for rows in _row_chunks(n, chunk_rows(n, vocab, cd), live):
        h = hidden[rows].to(cd)
        z, x = _chunk_logits(h, w, b, opts)
        d = _dlogits_(z, x, lse[rows].to(cd), lse_lo[rows].to(cd), target[rows], valid[rows], g[rows], c[rows],
                      opts, None if ent_g is None else ent_g[rows], None if ent is None else ent[rows])
        _accumulate_(grads, needs, rows, d, h, w)
    return _rounded(grads, weight, bias)


def store(
    hidden: Tensor,  # (N, D)
    weight: Tensor,  # (V, D)
    bias: Optional[Tensor],  # (V,)
    target: Tensor,  # (N,)
    opts: LossOptions,
    reduction: str,  # "mean" | "sum"
    needs: tuple[bool, bool, bool],
    logits: Optional[Tensor] = None,  # (N, V): receives the raw logits (write_logits)
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The reduced loss (0-dim, compute dtype) and its gradients w.r.t. (hidden, weight, bias), all
    from one pass over the logits (the ``store`` strategy); an empty tensor stands for each
    gradient not in ``needs``. The weight and bias gradients accumulate over the row chunks in the
    compute dtype (float32 or float64) and are rounded once."""
    n, vocab = hidden.shape[0], weight.shape[0]
    cd, w, b = _upcast(hidden, weight, bias)
    valid = target != opts.ignore_index
    g = reduction_weights(valid, reduction, cd)  # d(reduced loss) / d(row loss); 0 on ignored rows
    live = None if logits is not None else _live_rows(valid)  # returned logits need every row
    grads = _grad_buffers(hidden, weight, cd, needs, skipped=live is not None)
    total = torch.zeros((), dtype=cd, device=hidden.device)
    for rows in _row_chunks(n, chunk_rows(n, vocab, cd), live):
        h = hidden[rows].to(cd)
        t, ok = target[rows], valid[rows]
        z, x = _chunk_logits(h, w, b, opts, None if logits is None else logits[rows])
        loss, lse, lse_lo = _row_stats(z, t, ok, opts)
        total += loss.sum()
        if not any(needs):
            continue
        c = 2 * opts.z_loss * lse * g[rows]
        d = _dlogits_(z, x, lse, lse_lo, t, ok, g[rows], c, opts)
        _accumulate_(grads, needs, rows, d, h, w)
    return (reduced(total, valid, reduction), *_rounded(grads, weight, bias))


def check_targets(target: Tensor, vocab: int, ignore_index: int) -> None:
    """Raise ``ValueError`` for a target outside ``[0, vocab)`` that is not ``ignore_index``.

    Reads the values, so it checks real CPU tensors only: on CUDA that would be a host sync, and a
    fake tensor (tracing) has no values; every other target passes unchecked."""
    if target.device.type != "cpu" or is_fake(target):
        return
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bool(bad.any()):
        values = torch.unique(target[bad])[:8].tolist()
        raise ValueError(
            f"target values {values} are outside [0, {vocab}) and are not ignore_index={ignore_index}"
        )
