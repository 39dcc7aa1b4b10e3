"""Row masks downstream of a log-probs site (patterns/_masked.py, issue 24): RL losses that mask their
per-token terms after the head (TRL's GRPO, verl's masked_mean, where / masked_fill spellings) get an
op that skips the rows every mask zeroes.

Each skipping case is checked where a computed masked row would show: those rows' hidden states
overflow any logit (eager's reference gets finite ones: its masked rows' terms are multiplied by 0), and the
rollout's log-probs there are -89.5, so that a masked row's stand-in log-prob 0 overflows exp() in
fp32 (eager's own, about -4, does not): loss and gradients must still be eager's. Then the sites
whose values reach the output without a mask, which compute every row and say why.
"""

from __future__ import annotations

import functools
import operator

import expecttest
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import inductor_xent
from inductor_xent import ops

from .helpers import Recorder, before_after, counting

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

TEMP = 0.7
B, S, D, V = 3, 11, 16, 53  # V prime: no tile divides it; 33 rows, 13 of them masked (one row all masked)
OLD_MASKED = -89.5  # exp(0 - OLD_MASKED) is inf in fp32, exp(-4 - OLD_MASKED) is not


def _problem(dtype=torch.float32, seed=0, bsz=B, device="cpu"):
    """(h, W, ids, old, adv, mask): random hidden states and weight, sampled ids, the rollout's
    log-probs, one advantage per sequence (negative: a masked row's overflow would win the
    maximum), a completion mask with padding at the ends, row 1 all padding."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(bsz, S, D, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(V, D, generator=g, dtype=torch.float64) * 0.3).to(dtype)
    ids = torch.randint(0, V, (bsz, S), generator=g)
    mask = torch.ones(bsz, S, dtype=torch.long)
    mask[0, 7:] = 0
    mask[1, :] = 0
    mask[1, 2:5] = 1
    mask[2, 9:] = 0
    old = -torch.rand(bsz, S, generator=g, dtype=torch.float64) * 3 - 2
    old[mask == 0] = OLD_MASKED
    adv = -torch.rand(bsz, 1, generator=g, dtype=torch.float64) - 0.1
    return tuple(x.to(device) for x in (h, w, ids, old.to(dtype), adv.to(dtype), mask))


def _poison(h, rows):
    """``h`` with its ``rows`` set to a quarter of the dtype's largest value: a row the op computes
    overflows its logits (inf, then NaN), a row it skips is never read (a GEMM may multiply one by
    the 0 of an alignment pad: 0, not NaN, as eager's ignored rows would be)."""
    out = h.clone()
    out[rows] = torch.finfo(h.dtype).max / 4
    return out


def _up(z):
    """``z.float()`` as models upcast their logits, float64 kept: the float64 run is the reference."""
    return z if z.dtype == torch.float64 else z.float()


def _lp(h, w, ids):
    """TRL's selective_log_softmax for fp32 logits: the gather minus the logsumexp."""
    z = _up(h @ w.t()) / TEMP
    return z.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, -1)


def _pg(lp, old, adv):
    ratio = torch.exp(lp - old)
    return torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2))


# ---------------------------------------------------------------------------------------------
# skipped: name -> loss(h, w, ids, old, adv, mask)
# ---------------------------------------------------------------------------------------------
def _trl_grpo(h, w, ids, old, adv, mask):
    """TRL's GRPO loss: the clipped ratio as TRL writes it (-torch.min of two products), a k3 KL to
    the reference policy added after it, per sequence the masked sum over the mask's count, the mean."""
    lp = _lp(h, w, ids)
    coef_1 = torch.exp(lp - old)
    coef_2 = torch.clamp(coef_1, 0.8, 1.2)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    ref = old + 0.1  # the reference policy's log-probs
    per_token = per_token + 0.04 * (torch.exp(ref - lp) - (ref - lp) - 1)
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def _where_bool(h, w, ids, old, adv, mask):
    """torch.where(mask, x, 0) of a boolean mask, a token-level mean."""
    keep = mask.bool()
    return torch.where(keep, _pg(_lp(h, w, ids), old, adv), 0.0).sum() / keep.sum()


def _masked_fill(h, w, ids, old, adv, mask):
    """x.masked_fill(~mask, 0), the mask cast inside the loss (after the head: moved before the op)."""
    per_token = _pg(_lp(h, w, ids), old, adv)
    return per_token.masked_fill(~mask.bool(), 0.0).sum() / mask.sum()


def _verl_entropy_bonus(h, w, ids, old, adv, mask):
    """verl's actor: log-probs and entropy of one log_softmax (one log-probs op), masked_mean of the
    clipped surrogate minus an entropy bonus, the mask cast to the values' dtype."""
    logp = (_up(F.linear(h, w)) / TEMP).log_softmax(-1)
    lp = logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    m = mask.to(lp.dtype)
    return (_pg(lp, old, adv) * m).sum() / m.sum() - 0.01 * (entropy * m).sum() / m.sum()


def _per_token_advantages(h, w, ids, old, adv, mask):
    """PPO with per-token advantages ([B, S]: a multiply by a tensor of the rows' shape is a gate
    too, then the mask): a k3 KL penalty reads the log-probs outside the advantages' gate."""
    lp = _lp(h, w, ids)
    adv_tok = adv.expand_as(old)  # an input of the rows' shape
    d = old - lp
    per_token = _pg(lp, old, adv_tok) + 0.04 * (torch.exp(d) - d - 1)
    return (per_token * mask).sum() / mask.sum()


def _ignore_index_then_mask(h, w, ids, old, adv, mask):
    """tests/rl.py's eager_log_probs: ``torch.where(ids != -100, picked, 0)`` (a gate of its own), then
    the mask: a row is skipped where either zeroes it."""
    valid = ids != -100
    logp = (_up(F.linear(h, w)) / TEMP).log_softmax(-1)
    lp = torch.where(valid, logp.gather(-1, torch.where(valid, ids, 0).unsqueeze(-1)).squeeze(-1), 0.0)
    return (_pg(lp, old, adv) * mask).sum() / mask.sum()


def _openrlhf_actor(h, w, ids, old, adv, mask):
    """OpenRLHF's log_probs_from_logits (minus a cross-entropy with reduction="none": its default
    ignore_index -100 on no row) and masked_mean over the action mask."""
    z = _up(F.linear(h, w)) / TEMP
    lp = -F.cross_entropy(z.view(-1, z.size(-1)), ids.view(-1), reduction="none").view(ids.shape)
    return (_pg(lp, old, adv) * mask).sum(-1).div(mask.sum(-1).clamp(min=1)).mean()


def _verl_vanilla(h, w, ids, old, adv, mask):
    """verl's compute_policy_loss_vanilla (dual-clip PPO) with its logged metrics, masked_mean
    over the response mask; the advantages per token, 0 on the padding as verl's GAE leaves them."""
    lp = _lp(h, w, ids)
    adv = adv.expand_as(old) * mask

    def masked_mean(x, m):
        return (x * m).sum() / (m.sum() + 1e-8)

    neg_kl = torch.clamp(lp - old, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    ppo_kl = masked_mean(-neg_kl, mask)
    pg_losses1 = -adv * ratio
    pg_losses2 = -adv * torch.clamp(ratio, 0.8, 1.2)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), mask)
    pg_losses3 = -adv * 3.0
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (adv < 0).float(), mask)
    pg_losses = torch.where(adv < 0, clip_pg_losses2, clip_pg_losses1)
    return masked_mean(pg_losses, mask) + 0 * (ppo_kl + pg_clipfrac + pg_clipfrac_lower)


def _clip_fraction(h, w, ids, old, adv, mask):
    """The loss and a logged metric as verl and TRL compute it, ``&`` with a boolean mask a gate too:
    the fraction of the kept tokens whose ratio was clipped."""
    lp = _lp(h, w, ids)
    ratio = torch.exp(lp - old)
    clipped = ((ratio > 1.2) | (ratio < 0.8)) & mask.bool()
    return (_pg(lp, old, adv) * mask).sum() / mask.sum() + 0 * clipped.sum() / mask.sum()


def _where_not_keyword(h, w, ids, old, adv, mask):
    """torch.where(torch.logical_not(input=pad), x, 0): a keyword argument in the mask's spelling."""
    pad = mask == 0
    return torch.where(torch.logical_not(input=pad), _pg(_lp(h, w, ids), old, adv), 0.0).sum()


def _gather_then_index(h, w, ids, old, adv, mask):
    """The gathered column dropped by indexing, ``torch.gather(logp, -1, ids[..., None])[..., 0]``
    (bench rl's spelling), and a boolean mask."""
    logp = F.log_softmax(_up(F.linear(h, w)) / TEMP, -1)
    lp = torch.gather(logp, -1, ids[..., None])[..., 0]
    return (_pg(lp, old, adv) * mask.bool()).sum() / mask.sum()


SKIPPED = {f.__name__.lstrip("_"): f for f in (_trl_grpo, _where_bool, _masked_fill, _verl_entropy_bonus,
                                               _per_token_advantages, _ignore_index_then_mask, _clip_fraction,
                                               _where_not_keyword, _openrlhf_actor, _verl_vanilla,
                                               _gather_then_index)}


def _op_calls(gm) -> list:
    return [n for n in gm.graph.nodes if n.target in (ops.FORWARD, ops.LOGPROB_FORWARD, ops.LOGPROB_STORE)]


def _grads(fn, h, w, args):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(h, w, *args)
    return [loss.detach(), *torch.autograd.grad(loss, (h, w))]


def _store(monkeypatch):
    """The store strategy, with a budget that holds every row at these shapes (on CPU ``auto`` recomputes)."""
    monkeypatch.setenv("INDUCTOR_XENT_STRATEGY", "store")
    monkeypatch.setenv("INDUCTOR_XENT_STORE_BUDGET", "4x")


@pytest.mark.parametrize("strategy", ["auto", "store"])
@pytest.mark.parametrize("name", sorted(SKIPPED))
def test_masked_rows_skipped(name, strategy, monkeypatch):
    """One op call that skips the masked rows (its ids NO_IGNORE there, skip_ignored), explain says
    so; loss and gradients as eager's with the masked rows' hidden states poisoned. With
    ``store`` every site is the log-probs op's store (per-token gradients: the cross-entropy op
    stores a reduced loss only)."""
    if strategy == "store":
        _store(monkeypatch)
    fn = SKIPPED[name]
    h, w, ids, old, adv, mask = _problem()
    skipped = mask == 0
    if name == "ignore_index_then_mask":  # two rows the mask keeps, ignored by their ids
        ids[2, :2] = -100
        skipped |= ids == -100
    rec = Recorder()
    poisoned = _poison(h, skipped)
    ours = _grads(torch.compile(fn, backend=rec), poisoned, w, (ids, old, adv, mask))
    (op,) = _op_calls(rec.graphs[0])
    assert op.kwargs.get("skip_ignored") is True, op.format_node()
    assert (op.target is ops.LOGPROB_STORE) == (strategy == "store"), op.format_node()
    want = _grads(fn, h, w, (ids, old, adv, mask))
    assert torch.isfinite(want[0]), "eager's loss is finite on the finite problem"
    for a, b, what in zip(ours, want, ("loss", "grad_hidden", "grad_weight")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, what=what: f"{what}: {m}")
    assert torch.equal(ours[1][skipped], torch.zeros_like(ours[1][skipped])), "no gradient on skipped rows"
    leaves = (h.detach().requires_grad_(), w.detach().requires_grad_())  # a step's: store needs a gradient
    (site,) = inductor_xent.explain(fn, *leaves, ids, old, adv, mask).sites
    assert site.fused and "masked rows skipped in forward and backward" in site.reason, site.reason
    assert "`mask`" in site.reason or "`~pad`" in site.reason, site.reason
    assert ("log-probs op" in site.reason and "strategy store" in site.reason) == (strategy == "store"), site.reason


def _check_within_torch_error(fn, problem, backend, autocast=None, floor=1e-6):
    """``fn`` compiled with ``backend`` on ``problem`` with the masked rows' hidden states poisoned:
    loss and gradients within 4x eager's (same dtype, same autocast) error against float64 eager."""
    h, w, ids, old, adv, mask = problem
    if autocast is not None:  # what autocast hands the matmul, exactly: float64 eager computes from the same
        h, w = h.to(autocast).to(h.dtype), w.to(autocast).to(w.dtype)
    poisoned = _poison(h, mask == 0)
    device = h.device.type

    def grads(f, hh, ww, args):
        with torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            return _grads(f, hh, ww, args)

    ours = grads(torch.compile(fn, backend=backend), poisoned, w, (ids, old, adv, mask))
    want = grads(fn, h, w, (ids, old, adv, mask))
    exact = _grads(fn, h.double(), w.double(), (ids, old.double(), adv.double(), mask))
    assert counters["inductor_xent"]["sites_fused"] == 1
    for a, b, x, what in zip(ours, want, exact, ("loss", "grad_hidden", "grad_weight")):
        assert a.dtype == b.dtype, what
        err, torch_err = (a.double() - x).abs().max().item(), (b.double() - x).abs().max().item()
        assert err <= 4 * torch_err + floor, (what, err, torch_err)


@pytest.mark.parametrize("dtype,impl", [
    (torch.float64, "chunked"),  # the CPU chunks walk the valid rows only
    (torch.bfloat16, "chunked"),
    pytest.param(torch.bfloat16, "triton", marks=pytest.mark.skipif(torch.cuda.is_available(), reason=(
        "CPU tensors run the Triton kernels only interpreted; on a GPU test_masked_rows_cuda runs them"))),
])
def test_masked_rows_skipped_other_dtypes(dtype, impl, monkeypatch):
    """float64 and bfloat16; bfloat16 also through the Triton kernels (interpreted), which compact
    the valid rows first on the device: the log-probs op with the entropy, eager's loss and
    gradients within its own rounding. On the Triton kernels also TRL's loss (log-probs only) under
    ``store``: the log-probs op's store kernels keep the compacted rows' exp-logits."""
    monkeypatch.setenv("INDUCTOR_XENT_IMPL", impl)
    _check_within_torch_error(_verl_entropy_bonus, _problem(dtype), "inductor_xent",
                              floor=1e-12 if dtype == torch.float64 else 1e-6)
    if impl == "triton":
        _store(monkeypatch)
        counters.clear()
        _check_within_torch_error(_trl_grpo, _problem(dtype), "inductor_xent")


def test_masked_rows_skipped_under_autocast():
    """fp32 parameters under torch.autocast("cpu", bfloat16), as HF Trainer's bf16=True runs them: the
    op gets bf16 operands and skips the masked rows; eager autocast's numbers within its error."""
    _check_within_torch_error(_trl_grpo, _problem(), "inductor_xent", autocast=torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA")
@pytest.mark.parametrize("strategy", ["auto", "store"])
@pytest.mark.parametrize("name", ["trl_grpo", "verl_entropy_bonus", "gather_then_index"])
def test_masked_rows_cuda(name, strategy, monkeypatch):
    """On the GPU under autocast (bf16 operands: the compacted Triton kernels), through Inductor:
    the masked rows poisoned, eager autocast's loss and gradients within its error; ``store``: the
    log-probs op's store kernels."""
    if strategy == "store":
        _store(monkeypatch)
    problem = _problem(torch.float32, device="cuda")
    rec = Recorder(**{"xent.inner": "inductor"})
    _check_within_torch_error(SKIPPED[name], problem, rec, autocast=torch.bfloat16)
    (op,) = _op_calls(rec.graphs[0])
    assert op.kwargs.get("skip_ignored") is True
    assert (op.target is ops.LOGPROB_STORE) == (strategy == "store"), op.format_node()


def test_masked_rows_dynamic_batch():
    """Automatic dynamic over three batch sizes: the static graph, then one dynamic graph (the mask's
    shape compared with the values' without a guard), both skipping, eager's values."""
    rec = Recorder()
    backend = counting(rec)
    f = torch.compile(_trl_grpo, backend=backend)
    for bsz in (3, 4, 5):
        h, w, ids, old, adv, mask = _problem(seed=bsz, bsz=bsz)
        torch.testing.assert_close(f(h, w, ids, old, adv, mask), _trl_grpo(h, w, ids, old, adv, mask))
    assert backend.frame_count == 2 and counters["inductor_xent"]["sites_fused"] == 2
    assert [op.kwargs.get("skip_ignored") for g in rec.graphs for op in _op_calls(g)] == [True, True]


def test_skip_ignored_off_applies_no_mask(monkeypatch):
    """INDUCTOR_XENT_SKIP_IGNORED=0: every row computed (eager's semantics to the last NaN), and the
    reason says why."""
    monkeypatch.setenv("INDUCTOR_XENT_SKIP_IGNORED", "0")
    h, w, ids, old, adv, mask = _problem()
    rec = Recorder()
    ours = _grads(torch.compile(_trl_grpo, backend=rec), h, w, (ids, old, adv, mask))
    (op,) = _op_calls(rec.graphs[0])
    assert "skip_ignored" not in op.kwargs
    for a, b in zip(ours, _grads(_trl_grpo, h, w, (ids, old, adv, mask))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    (site,) = inductor_xent.explain(_trl_grpo, h, w, ids, old, adv, mask).sites
    assert "every row computed (INDUCTOR_XENT_SKIP_IGNORED=0)" in site.reason, site.reason


# ---------------------------------------------------------------------------------------------
# every row computed: name -> (fn, what explain's reason says)
# ---------------------------------------------------------------------------------------------
def _returned(h, w, ids, old, adv, mask):
    lp = _lp(h, w, ids)
    return (_pg(lp, old, adv) * mask).sum() / mask.sum(), lp


def _unmasked_mean(h, w, ids, old, adv, mask):
    return _pg(_lp(h, w, ids), old, adv).mean()


def _mask_per_sequence(h, w, ids, old, adv, mask):
    """A [B, 1] mask broadcast over the tokens: not the rows' shape, no gate."""
    return (_pg(_lp(h, w, ids), old, adv) * mask[:, :1]).sum()


def _argmax_accuracy(h, w, ids, old, adv, mask, gate=True):
    """GRPO's loss and the token accuracy of its argmax, masked alike (``gate``; else the mean argmax,
    read on every row)."""
    z = _up(h @ w.t()) / TEMP
    lp = z.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    pred = z.argmax(-1)
    acc = ((pred == ids) & mask.bool()).sum() if gate else pred.float().mean()
    return (_pg(lp, old, adv) * mask).sum() / mask.sum(), acc


def _labels(ids, mask):
    return torch.where(mask.bool(), ids, -100)


def _sft_accuracy(h, w, ids, old, adv, mask):
    """An SFT loss (ignore_index on the masked rows) and the accuracy masked by the labels."""
    y = _labels(ids, mask)
    z = _up(h @ w.t())
    valid = y != -100
    acc = ((z.argmax(-1) == y) & valid).sum() / valid.sum()
    return F.cross_entropy(z.flatten(0, 1), y.flatten()), acc


def _sft_accuracy_unmasked(h, w, ids, old, adv, mask):
    """The accuracy as argmax == labels alone: an ignored label (negative) never equals an argmax."""
    y = _labels(ids, mask)
    z = _up(h @ w.t())
    return F.cross_entropy(z.flatten(0, 1), y.flatten(), reduction="sum"), (z.argmax(-1) == y).float().sum()


def _sft_accuracy_no_grad(h, w, ids, old, adv, mask):
    """TRL's SFT token accuracy under no_grad, after the loss."""
    y = _labels(ids, mask)
    z = _up(h @ w.t())
    loss = F.cross_entropy(z.flatten(0, 1), y.flatten())
    with torch.no_grad():
        valid = y != -100
        acc = ((z.argmax(-1) == y) & valid).sum() / valid.sum()
    return loss, acc


ARGMAX = {f.__name__.lstrip("_"): f for f in (_argmax_accuracy, _sft_accuracy, _sft_accuracy_unmasked,
                                              _sft_accuracy_no_grad)}


def _outs_and_grads(fn, h, w, args):
    """(loss, accuracy, grad_hidden, grad_weight) of ``fn`` (loss and accuracy)."""
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss, acc = fn(h, w, *args)
    return [loss.detach(), acc, *torch.autograd.grad(loss, (h, w))]


def _check_argmax_site(fn, problem, backend, autocast=None, exact_acc=True):
    """``fn`` compiled with ``backend``, the masked rows' hidden states poisoned: the accuracy equal to
    eager's (``exact_acc``; else within one prediction), loss and gradients within 4x eager's error
    (same dtype, same autocast) against float64 eager."""
    h, w, ids, old, adv, mask = problem
    if autocast is not None:
        h, w = h.to(autocast).to(h.dtype), w.to(autocast).to(w.dtype)
    device = h.device.type

    def run(f, hh, ww, args):
        with torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            return _outs_and_grads(f, hh, ww, args)

    ours = run(torch.compile(fn, backend=backend), _poison(h, mask == 0), w, (ids, old, adv, mask))
    want = run(fn, h, w, (ids, old, adv, mask))
    exact = _outs_and_grads(fn, h.double(), w.double(), (ids, old.double(), adv.double(), mask))
    if exact_acc:
        assert torch.equal(ours[1], want[1]), (ours[1], want[1])
    else:  # (bf16 logits round near-ties: the op's argmax is that of its fp32 logits)
        assert (ours[1].double() - want[1].double()).abs().item() <= 1.0 / mask.sum().item() + 1e-6
    for a, b, x, what in zip(ours[::2] + ours[3:], want[::2] + want[3:], exact[::2] + exact[3:],
                             ("loss", "grad_hidden", "grad_weight")):
        assert a.dtype == b.dtype, what
        err, torch_err = (a.double() - x).abs().max().item(), (b.double() - x).abs().max().item()
        assert err <= 4 * torch_err + 1e-6, (what, err, torch_err)


@pytest.mark.parametrize("strategy", ["auto", "store"])
@pytest.mark.parametrize("name", sorted(ARGMAX))
def test_argmax_under_a_row_mask_skipped(name, strategy, monkeypatch):
    """An argmax (token accuracy) next to the loss, read only through the loss's row mask, through the
    labels' ignore_index (``argmax == labels`` is False wherever a label is negative) or both: one
    log-probs op that skips those rows (their argmax 0 stands in, as their log-prob does); the
    accuracy equal to eager's, loss and gradients as eager's, with those rows poisoned."""
    if strategy == "store":
        _store(monkeypatch)
    fn = ARGMAX[name]
    h, w, ids, old, adv, mask = _problem()
    rec = Recorder()
    ours = _outs_and_grads(torch.compile(fn, backend=rec), _poison(h, mask == 0), w, (ids, old, adv, mask))
    (op,) = _op_calls(rec.graphs[0])
    assert op.kwargs.get("skip_ignored") is True, op.format_node()
    assert op.args[8] is True, "the op computes the argmax"
    want = _outs_and_grads(fn, h, w, (ids, old, adv, mask))
    assert torch.equal(ours[1], want[1]), (ours[1], want[1])
    for a, b, what in zip(ours[::2] + ours[3:], want[::2] + want[3:], ("loss", "grad_hidden", "grad_weight")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, what=what: f"{what}: {m}")
    leaves = (h.detach().requires_grad_(), w.detach().requires_grad_())
    (site,) = inductor_xent.explain(fn, *leaves, ids, old, adv, mask).sites
    assert site.fused and "argmax" in site.head and "masked rows skipped" in site.reason, site.reason


class _AsDunders(Recorder):
    """A Recorder that first rewrites the graph's Python operators as the tensor methods torch 2.11's
    Dynamo records for some of them (``argmax.__eq__(y)``, ``eq & valid`` as ``__and__``)."""

    def __call__(self, gm, example_inputs):
        names = {operator.eq: "__eq__", operator.ne: "__ne__", operator.and_: "__and__", operator.mul: "__mul__"}
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in names and isinstance(node.args[0], torch.fx.Node):
                node.op, node.target = "call_method", names[node.target]
        gm.recompile()
        return super().__call__(gm, example_inputs)


@pytest.mark.parametrize("name", ["sft_accuracy", "argmax_accuracy"])
def test_argmax_mask_walk_reads_operators_as_dunder_methods(name):
    """The mask walk and the gates read ``a.__eq__(b)`` as ``a == b`` (torch 2.11's Dynamo spelling of
    the accuracy's comparison, under which these sites computed every row): the rows are skipped."""
    h, w, ids, old, adv, mask = _problem()
    rec = _AsDunders()
    fn = ARGMAX[name]
    ours = _outs_and_grads(torch.compile(fn, backend=rec), _poison(h, mask == 0), w, (ids, old, adv, mask))
    assert "__eq__" in rec.code_before[0]
    (op,) = _op_calls(rec.graphs[0])
    assert op.kwargs.get("skip_ignored") is True, op.format_node()
    want = _outs_and_grads(fn, h, w, (ids, old, adv, mask))
    assert torch.equal(ours[1], want[1]), (ours[1], want[1])
    torch.testing.assert_close(ours[0], want[0], rtol=1e-5, atol=1e-6)


def _hf_loss_shifted_accuracy(h, w, y):
    """transformers' causal-LM loss (labels padded with -100 and shifted: every row of the logits) and
    the token accuracy of ``logits[..., :-1, :]`` against ``labels[..., 1:]``, as a training step
    spells it: two row sets of one lm_head."""
    z = _up(h @ w.t())
    labels = F.pad(y, (0, 1), value=-100)[..., 1:]
    loss = F.cross_entropy(z.flatten(0, 1), labels.flatten(), ignore_index=-100)
    shift = y[..., 1:]
    valid = shift != -100
    return loss, ((z[..., :-1, :].argmax(-1) == shift) & valid).sum() / valid.sum()


def test_accuracy_of_shifted_logits_next_to_the_padded_loss():
    """The argmax of a row slice next to a loss over every row: two sites (the argmax's own op, one
    forward GEMM over its valid rows), not a decline of both; the rows no label reads poisoned, the
    loss and gradients as eager's, the accuracy equal."""
    h, w, ids, old, adv, mask = _problem()
    y = _labels(ids, mask)
    unread = F.pad(y, (0, 1), value=-100)[..., 1:] == -100
    rec = Recorder()
    ours = _outs_and_grads(torch.compile(_hf_loss_shifted_accuracy, backend=rec), _poison(h, unread), w, (y,))
    ops_ = _op_calls(rec.graphs[0])
    assert [op.target for op in ops_] == [ops.FORWARD, ops.LOGPROB_FORWARD], [op.format_node() for op in ops_]
    assert all(op.kwargs.get("skip_ignored") is True for op in ops_)
    assert counters["inductor_xent"]["sites_fused"] == 2 and counters["inductor_xent"]["sites_declined"] == 0
    want = _outs_and_grads(_hf_loss_shifted_accuracy, h, w, (y,))
    assert torch.equal(ours[1], want[1]), (ours[1], want[1])
    for a, b, what in zip(ours[::2] + ours[3:], want[::2] + want[3:], ("loss", "grad_hidden", "grad_weight")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, what=what: f"{what}: {m}")
    sites = inductor_xent.explain(_hf_loss_shifted_accuracy, h, w, y).sites
    assert [(s.fused, s.head) for s in sites] == [(True, "cross_entropy"), (True, "argmax")], str(sites)


@pytest.mark.parametrize("impl", [
    "chunked",
    pytest.param("triton", marks=pytest.mark.skipif(torch.cuda.is_available(), reason=(
        "CPU tensors run the Triton kernels only interpreted; on a GPU test_argmax_under_a_row_mask_cuda runs them"))),
])
def test_argmax_under_a_row_mask_bf16(impl, monkeypatch):
    """bfloat16 (the Triton kernels interpreted: the compacted forward with the argmax partials, and
    under ``store`` the compacted store forward): the accuracy within one prediction of eager's (ties
    of bf16 logits), loss and gradients within eager's error."""
    monkeypatch.setenv("INDUCTOR_XENT_IMPL", impl)
    for strategy in ("auto", "store"):
        if strategy == "store":
            _store(monkeypatch)
        counters.clear()
        torch._dynamo.reset()
        _check_argmax_site(_sft_accuracy, _problem(torch.bfloat16), "inductor_xent", exact_acc=False)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA")
@pytest.mark.parametrize("strategy", ["auto", "store"])
@pytest.mark.parametrize("name", ["argmax_accuracy", "sft_accuracy_no_grad"])
def test_argmax_under_a_row_mask_cuda(name, strategy, monkeypatch):
    """On the GPU under autocast (bf16 operands: the compacted Triton kernels with the argmax), through
    Inductor: the masked rows poisoned, eager autocast's numbers."""
    if strategy == "store":
        _store(monkeypatch)
    rec = Recorder(**{"xent.inner": "inductor"})
    _check_argmax_site(ARGMAX[name], _problem(torch.float32, device="cuda"), rec, autocast=torch.bfloat16,
                       exact_acc=False)
    (op,) = _op_calls(rec.graphs[0])
    assert op.kwargs.get("skip_ignored") is True
    assert (op.target is ops.LOGPROB_STORE) == (strategy == "store"), op.format_node()


def _mask_from_values(h, w, ids, old, adv, mask):
    """A "mask" computed from the log-probs themselves gates nothing."""
    lp = _lp(h, w, ids)
    return (lp * (lp > -4).float()).sum()


def _mask_under_no_grad(h, w, ids, old, adv, mask):
    """Per-token weights computed after the head under no_grad: moving them before the op would take
    them out of the no_grad block (they would get a gradient)."""
    lp = _lp(h, w, ids)
    with torch.no_grad():
        weight = torch.sigmoid(h.sum(-1)) * mask
    return -(lp * weight).sum() / mask.sum()


def _mask_after_autocast(h, w, ids, old, adv, mask):
    """An fp32 mask computed after an autocast block that holds the head: moved before the op, it would
    be computed in bf16."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp = _lp(h, w, ids)
    weight = torch.nn.functional.linear(h, w[:1]).squeeze(-1) * mask
    return (torch.exp(lp - lp.detach()) * weight).sum()


def _integer_division(h, w, ids, old, adv, mask):
    """An integer division of the values before the mask: a skipped row's stand-in 0 would raise."""
    lp = _lp(h, w, ids)
    k = (lp * 1e6).to(torch.long)
    q = torch.div(torch.full_like(k, 1000), k, rounding_mode="floor")
    return (lp * mask).sum() + (q * mask).sum()


def _dtype_view(h, w, ids, old, adv, mask):
    """lp.view(torch.int16): two elements per row, not a row-major view of the rows."""
    lp = _lp(h, w, ids)
    bits = torch.where(torch.cat([mask, mask], -1).bool(), lp.view(torch.int16), 0)
    return (lp * mask).sum() + bits.sum() * 0


def _shifted_index(h, w, ids, old, adv, mask):
    """``lp[:, 1:]``: an indexing that drops rows is not a view of every row (the mask's rows would
    not line up with the values'), so nothing gates the values."""
    lp = _lp(h, w, ids)
    return (_pg(lp, old, adv)[:, 1:] * mask[:, 1:]).sum()


COMPUTED = {
    "shifted_index": (_shifted_index, "reads the values before a row mask"),
    "mask_under_no_grad": (_mask_under_no_grad, "a grad-mode or autocast switch"),
    "mask_after_autocast": (_mask_after_autocast, "a grad-mode or autocast switch"),
    "integer_division": (_integer_division, "reads the values before a row mask"),
    "dtype_view": (_dtype_view, "reads the values before a row mask"),
    "returned": (_returned, "the values are returned by the compiled function"),
    "unmasked_mean": (_unmasked_mean, "reads the values before a row mask"),
    "mask_per_sequence": (_mask_per_sequence, "reads the values before a row mask"),
    "argmax_read_unmasked": (lambda h, w, ids, old, adv, mask: _argmax_accuracy(h, w, ids, old, adv, mask, gate=False),
                             "reads the values before a row mask"),
    "mask_from_values": (_mask_from_values, "reads the values before a row mask"),
    # a learned weight's gradient on a skipped row would be made of the stand-in log-prob
    "advantages_require_grad": (_trl_grpo, "which requires grad"),
}


@pytest.mark.parametrize("name", sorted(COMPUTED))
def test_rows_without_a_mask_computed(name):
    """Fused, every row computed (no skip_ignored), explain says why; eager's values."""
    fn, why = COMPUTED[name]
    h, w, ids, old, adv, mask = _problem()
    if name == "advantages_require_grad":
        adv.requires_grad_()
    old = old.clamp(min=-5.0)  # no row is masked for the op: eager's finite terms everywhere
    rec = Recorder()
    ours = torch.compile(fn, backend=rec)(h, w, ids, old, adv, mask)
    (op,) = _op_calls(rec.graphs[0])
    assert "skip_ignored" not in op.kwargs, op.format_node()
    want = fn(h, w, ids, old, adv, mask)
    for a, b in zip(ours if isinstance(ours, tuple) else (ours,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    (site,) = inductor_xent.explain(fn, h, w, ids, old, adv, mask).sites
    assert site.fused and "every row computed (" in site.reason and why in site.reason, site.reason


def test_random_mask_after_the_head_not_moved():
    """A mask drawn at random after the head (token dropout of the loss) would be drawn before the
    op's other random calls if moved: every row computed, and the reason says so."""

    def fn(h, w, ids, old, adv, mask):
        lp = _lp(h, w, ids)
        keep = (torch.rand_like(old) > 0.5) & mask.bool()
        return torch.where(keep, _pg(lp, old, adv), 0.0).sum()

    rec = Recorder()
    torch.compile(fn, backend=rec)(*_problem())
    (op,) = _op_calls(rec.graphs[0])
    assert "skip_ignored" not in op.kwargs, op.format_node()
    (site,) = inductor_xent.explain(fn, *_problem()).sites
    assert "every row computed (the row mask" in site.reason and "more than pure calls" in site.reason, site.reason


class TestPrintouts(expecttest.TestCase):
    """The rewritten graph, pinned (EXPECTTEST_ACCEPT=1 re-accepts; review the diff)."""

    def test_two_masks(self):
        """where(ids != -100, ...) then the mask: the op's ids NO_IGNORE where either zeroes the row,
        the masks' conditions in graph order (the same graph every run), the multiply gate sealed."""
        h, w, ids, old, adv, mask = (x[:1, :4] if x.dim() > 1 and x.shape[0] == B else x for x in _problem())
        w = w[:7]
        ids = ids % 7
        inputs = dict(h=h, w=w, ids=ids, old=old, adv=adv, mask=mask)
        after = before_after(_ignore_index_then_mask, inputs).split("# --- after the pass ---\n")[1]
        self.assertExpectedInline(after, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_ids_: "i64[1, 4]", L_h_: "f32[1, 4, 16]", L_w_: "f32[7, 16]", L_old_: "f32[1, 4]", L_adv_: "f32[1, 1]", L_mask_: "i64[1, 4]"):
        l_ids_ = L_ids_
        l_h_ = L_h_
        l_w_ = L_w_
        l_old_ = L_old_
        l_adv_ = L_adv_
        l_mask_ = L_mask_
        valid: "b8[1, 4]" = l_ids_ != -100
        where: "i64[1, 4]" = torch.where(valid, l_ids_, 0);  l_ids_ = None
        unsqueeze: "i64[1, 4, 1]" = where.unsqueeze(-1);  where = None
        flatten: "f32[4, 16]" = l_h_.flatten(0, -2);  l_h_ = None
        reshape: "i64[4]" = unsqueeze.reshape(-1)
        logical_not: "b8[1, 4]" = torch.logical_not(valid)
        reshape_1: "b8[4]" = logical_not.reshape(-1);  logical_not = None
        eq: "b8[1, 4]" = l_mask_ == 0
        reshape_2: "b8[4]" = eq.reshape(-1);  eq = None
        logical_or: "b8[4]" = torch.logical_or(reshape_1, reshape_2);  reshape_1 = reshape_2 = None
        where_2: "i64[4]" = torch.where(logical_or, -2147483648, reshape);  logical_or = reshape = None
        linear_ce_fwd_default = torch.ops.inductor_xent.linear_ce_fwd.default(flatten, l_w_, None, where_2, -2147483648, 0.0, 1.4285714285714286, None, 0.0, skip_ignored = True);  flatten = l_w_ = where_2 = None
        getitem: "f32[4]" = linear_ce_fwd_default[0]
        getitem_1: "f32[4]" = linear_ce_fwd_default[1];  linear_ce_fwd_default = getitem_1 = None
        view_as: "f32[1, 4, 1]" = getitem.view_as(unsqueeze);  getitem = unsqueeze = None
        neg_2: "f32[1, 4, 1]" = -view_as;  view_as = None
        squeeze: "f32[1, 4]" = neg_2.squeeze(-1);  neg_2 = None
        lp: "f32[1, 4]" = torch.where(valid, squeeze, 0.0);  valid = squeeze = None
        sub: "f32[1, 4]" = lp - l_old_;  lp = l_old_ = None
        ratio: "f32[1, 4]" = torch.exp(sub);  sub = None
        neg: "f32[1, 1]" = -l_adv_
        mul: "f32[1, 4]" = neg * ratio;  neg = None
        neg_1: "f32[1, 1]" = -l_adv_;  l_adv_ = None
        clamp: "f32[1, 4]" = torch.clamp(ratio, 0.8, 1.2);  ratio = None
        mul_1: "f32[1, 4]" = neg_1 * clamp;  neg_1 = clamp = None
        maximum: "f32[1, 4]" = torch.maximum(mul, mul_1);  mul = mul_1 = None
        mul_2: "f32[1, 4]" = maximum * l_mask_;  maximum = None
        eq_1: "b8[1, 4]" = l_mask_ == 0
        masked_fill: "f32[1, 4]" = mul_2.masked_fill(eq_1, 0);  mul_2 = eq_1 = None
        sum_1: "f32[]" = masked_fill.sum();  masked_fill = None
        sum_2: "i64[]" = l_mask_.sum();  l_mask_ = None
        truediv_1: "f32[]" = sum_1 / sum_2;  sum_1 = sum_2 = None
        return (truediv_1,)
""")


# ---------------------------------------------------------------------------------------------
# per-token sites under store: the log-probs op, its ignore_index rows skipped as the cross-entropy op's
# ---------------------------------------------------------------------------------------------
def _ce_none(h, w, ids, adv, z_loss=0.0):
    """OpenRLHF's log-probs (minus a cross-entropy with reduction "none") with the prompt's labels
    -100 and no mask after the head: the ignored rows' values are the op's 0; a z-loss reads every
    row's logsumexp."""
    z = _up(F.linear(h, w)) / TEMP
    lp = -F.cross_entropy(z.flatten(0, 1), ids.flatten(), reduction="none").view(ids.shape)
    loss = -(lp * adv).sum()
    return loss + z_loss * torch.logsumexp(z, -1).square().sum() if z_loss else loss


@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
@pytest.mark.parametrize("strategy", ["auto", "store"])
def test_ignore_index_rows_of_a_per_token_site(strategy, z_loss, monkeypatch):
    """A cross-entropy with reduction "none" (per-token gradients): on CPU ``auto`` keeps the
    cross-entropy op, ``store`` takes the log-probs op's store. Either skips the -100 rows (poisoned
    here) unless a logsumexp of the graph reads them (then computed, not poisoned, and explain
    says so); eager's loss and gradients."""
    if strategy == "store":
        _store(monkeypatch)
    h, w, ids, _, adv, mask = _problem()
    ids = torch.where(mask.bool(), ids, -100)
    skipped = ids == -100
    fn = functools.partial(_ce_none, z_loss=z_loss)
    rec = Recorder()
    ours = _grads(torch.compile(fn, backend=rec), _poison(h, skipped) if not z_loss else h, w, (ids, adv))
    (op,) = _op_calls(rec.graphs[0])
    assert (op.target is ops.LOGPROB_STORE) == (strategy == "store"), op.format_node()
    assert (op.kwargs.get("skip_ignored") is True) == (not z_loss), op.format_node()
    for a, b in zip(ours, _grads(fn, h, w, (ids, adv))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    leaves = (h.detach().requires_grad_(), w.detach().requires_grad_())
    (site,) = inductor_xent.explain(fn, *leaves, ids, adv).sites
    why = "ignored rows computed in the forward (a logsumexp" if z_loss else "ignored rows skipped in forward and backward"
    assert why in site.reason, site.reason
    assert ("log-probs op" in site.reason) == (strategy == "store"), site.reason
