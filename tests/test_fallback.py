"""The public function on CPU (the chunked fallback) against the oracle, on fresh random inputs."""

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import inductor_xent
from inductor_xent import config, fallback, ops, reference
from inductor_xent.options import LossOptions, compute_dtype

from .helpers import (
    LargestTensor,
    assert_gradient_within_torch_error,
    assert_within_torch_error,
    case_inputs,
    fallback_chunks,
    torch_same_dtype_loss,
)

# sizes: 0 (empty), 1, primes and odd numbers, so that no chunk or row count lines up
SIZES_N = st.sampled_from([0, 1, 2, 7, 13, 31, 64])
SIZES_D = st.sampled_from([1, 3, 8, 17])
SIZES_V = st.sampled_from([1, 2, 5, 31, 67])
IGNORE = st.sampled_from(["none", "some", "all", "block"])  # block: a whole leading run ignored


@st.composite
def cases(draw):
    n, d, v = draw(SIZES_N), draw(SIZES_D), draw(SIZES_V)
    return dict(
        n=n, d=d, v=v,
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64])),
        bias=draw(st.booleans()),
        three_d=draw(st.booleans()) and n % 2 == 0 and n > 0,
        non_contiguous=draw(st.booleans()),
        ignore=draw(IGNORE),
        ignore_index=draw(st.sampled_from([-100, -1, 0])),  # 0: a real class id that is ignored
        reduction=draw(st.sampled_from(["mean", "sum", "none"])),
        label_smoothing=draw(st.sampled_from([0.0, 0.1, 1.0])),
        logit_scale=draw(st.sampled_from([1.0, 0.37])),
        softcap=draw(st.sampled_from([None, 1.5, 30.0])),
        z_loss=draw(st.sampled_from([0.0, 1e-3])),
        chunk_bytes=draw(st.sampled_from([64, 1000, 8 * 2**20])),  # many chunks .. one chunk
        strategy=draw(st.sampled_from(["recompute", "store", "auto"])),  # store falls back where it cannot run
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _kw(c):
    return {k: c[k] for k in ("ignore_index", "reduction", "label_smoothing", "logit_scale", "softcap", "z_loss")}


def _ours_kw(c):
    return {**_kw(c), "strategy": c["strategy"]}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
# found by CI (V = 1: every exact gradient is 0, the recomputed logits' rounding is not)
@example(dict(n=7, d=17, v=1, dtype=torch.float32, bias=False, three_d=False, non_contiguous=True, ignore="some",
              ignore_index=-100, reduction="mean", label_smoothing=0.0, logit_scale=1.0, softcap=None, z_loss=0.0,
              chunk_bytes=64, strategy="recompute", seed=728974))
# and an empty one (N = 0: every gradient empty)
@example(dict(n=0, d=1, v=1, dtype=torch.float32, bias=False, three_d=False, non_contiguous=False, ignore="none",
              ignore_index=-100, reduction="sum", label_smoothing=0.0, logit_scale=1.0, softcap=None, z_loss=0.0,
              chunk_bytes=64, strategy="recompute", seed=0))
def test_matches_oracle(c):
    with fallback_chunks(c["chunk_bytes"]):  # the backward chunks as the forward did (helpers)
        _check_against_oracle(c)


def _check_against_oracle(c):
    h, w, b, y = case_inputs(c)
    params = [t for t in (h, w, b) if t is not None]
    ours = inductor_xent.linear_cross_entropy(h, w, y, bias=b, **_ours_kw(c))
    exact = reference.linear_cross_entropy(*(t.double() for t in (h, w)), y,
                                           bias=None if b is None else b.double(), **_kw(c))
    same = torch_same_dtype_loss(h, w, y, b, **_kw(c))
    assert ours.dtype == compute_dtype(c["dtype"])
    assert ours.shape == same.shape
    if ours.numel() == 0 or torch.isnan(exact).all():  # empty or all-ignored mean: PyTorch's answer
        torch.testing.assert_close(ours.double(), exact, equal_nan=True)
        torch.testing.assert_close(same.double(), exact, equal_nan=True)
        return
    floor = 1e-12 if c["dtype"] == torch.float64 else 1e-6
    assert_within_torch_error(ours, same, exact, floor=floor, what="loss")
    # any incoming gradient: a random one for 'none'
    gout = torch.randn(ours.shape, generator=torch.Generator().manual_seed(c["seed"] + 1))
    if c["strategy"] != "recompute" and c["dtype"] in (torch.float16, torch.bfloat16):
        # store's backward scales gradients already rounded to the input dtype: a scalar upstream
        # gradient that is not a power of two (training passes 1, or a power-of-two loss scale)
        # rounds them once more, one ulp where torch rounds once (README, "Strategies")
        gout = torch.full(ours.shape, 2.0 ** (c["seed"] % 5 - 2))
    g_ours = torch.autograd.grad(ours, params, gout.to(ours.dtype))
    g_same = torch.autograd.grad(same, params, gout.to(same.dtype))
    g_exact = torch.autograd.grad(exact, params, gout.double())
    for name, a, s, e in zip(("hidden", "weight", "bias"), g_ours, g_same, g_exact):
        assert a.dtype == s.dtype and a.shape == s.shape
        assert_gradient_within_torch_error(a, s, e, h, w, floor=floor, what=f"grad_{name}")


@pytest.mark.parametrize("bias", [False, True])
def test_gradcheck_float64(bias, small_chunks):
    g = torch.Generator().manual_seed(3)
    h = torch.randn(9, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(13, 5, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(13, dtype=torch.float64, generator=g, requires_grad=True) if bias else None
    y = torch.randint(0, 13, (9,), generator=g)
    y[2] = -100
    inputs = (h, w) + ((b,) if bias else ())

    def fn(h, w, b=None):
        return inductor_xent.linear_cross_entropy(
            h, w, y, bias=b, reduction="none", label_smoothing=0.2, logit_scale=0.8, softcap=2.5, z_loss=1e-2)

    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("strategy", ["recompute", "store"])
def test_one_class_smoothing_z_loss(strategy):
    """V = 1 with label smoothing and z-loss (a case hypothesis found): the gradient is the z-loss
    term alone, and p − (1 − ε) − ε/V must not leave a rounding residue (it did: 0.1 relative)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, 1, generator=g, requires_grad=True)
    w = torch.randn(1, 1, generator=g, requires_grad=True)
    y = torch.zeros(1, dtype=torch.long)
    kw = dict(label_smoothing=0.1, z_loss=1e-3)
    ours = torch.autograd.grad(inductor_xent.linear_cross_entropy(h, w, y, strategy=strategy, **kw), (h, w))
    exact = torch.autograd.grad(reference.linear_cross_entropy(h.double(), w.double(), y, **kw), (h, w))
    same = torch.autograd.grad(torch_same_dtype_loss(h, w, y, **kw), (h, w))
    for a, s, e in zip(ours, same, exact):
        assert_within_torch_error(a, s, e, k=4.0, floor=1e-7, what="grad")


def test_lse_output_gradient(small_chunks):
    """The op's lse output is differentiable (the pass maps a user's separate logsumexp onto it)."""
    g = torch.Generator().manual_seed(4)
    h = torch.randn(11, 6, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(19, 6, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.randint(0, 19, (11,), generator=g)
    y[::2] = -100  # ignored rows still have an lse, and its gradient

    def fn(h, w):
        loss, lse, _, _ = ops.FORWARD(h, w, None, y, -100, 0.1, 1.0, 1.7, 0.0)
        return loss.sum() + (lse**2).sum()

    assert torch.autograd.gradcheck(fn, (h, w))


@pytest.mark.parametrize("strategy", ["recompute", "store"])
def test_never_materialises_logits(monkeypatch, strategy):
    """Forward and backward never create a tensor with more than one chunk of rows x V elements."""
    n, d, v = 512, 16, 4099
    monkeypatch.setattr(config, "fallback_chunk_bytes", 64 * v * 4)  # 64 rows of fp32 logits
    h = torch.randn(n, d, requires_grad=True)
    w = torch.randn(v, d, requires_grad=True)
    y = torch.randint(0, v, (n,))
    with LargestTensor() as mode:
        loss = inductor_xent.linear_cross_entropy(h, w, y, softcap=5.0, z_loss=1e-4, strategy=strategy)
        loss.backward()
    assert mode.largest <= 64 * v, f"a tensor of {mode.largest} elements exists; one chunk is {64 * v}"
    # and the chunking did not change the answer
    torch.testing.assert_close(loss, reference.linear_cross_entropy(h, w, y, softcap=5.0, z_loss=1e-4))


def test_chunk_rows_bounded():
    assert fallback.chunk_rows(4096, 32768, torch.float32) * 32768 * 4 <= config.fallback_chunk_bytes
    assert fallback.chunk_rows(10, 10**9, torch.float32) == 1  # at least one row
    assert fallback.chunk_rows(3, 5, torch.float64) == 3


def test_forward_computes_no_gradient(monkeypatch):
    """No gradient work in the forward: the backward op runs only when backward() is called."""
    calls = []
    real = fallback.backward
    monkeypatch.setattr(fallback, "backward", lambda *a, **k: calls.append(1) or real(*a, **k))
    h = torch.randn(8, 4, requires_grad=True)
    w = torch.randn(10, 4, requires_grad=True)
    loss = inductor_xent.linear_cross_entropy(h, w, torch.randint(0, 10, (8,)), strategy="recompute")
    assert calls == []
    loss.backward()
    assert calls == [1]


def test_options_tuple_defaults_match_public_defaults():
    assert LossOptions() == LossOptions(-100, 0.0, 1.0, None, 0.0)


@pytest.mark.parametrize("strategy", ["store", "recompute"])
def test_ignored_rows_are_never_computed(strategy, monkeypatch):
    """The chunked path computes no logits for an ignored row, forward or backward, with either
    strategy (the recompute forward's op returns no lse anyone reads here: ``skip_ignored``): NaN
    hidden states there leave the loss and the gradients finite, equal to those of the valid rows
    alone. With INDUCTOR_XENT_SKIP_IGNORED=0 every row is computed and grad_weight turns NaN: this
    test fails if the rows are not skipped."""
    g = torch.Generator().manual_seed(31)
    h = torch.randn(29, 8, generator=g)
    w = torch.randn(67, 8, generator=g, requires_grad=True)
    t = torch.randint(0, 67, (29,), generator=g)
    t[::3] = -100
    h[t == -100] = float("nan")

    def run(h, t):
        hh = h.clone().requires_grad_()
        w.grad = None
        loss = inductor_xent.linear_cross_entropy(hh, w, t, reduction="sum", strategy=strategy)
        loss.backward()
        return loss.detach(), hh.grad, w.grad.clone()

    loss, gh, gw = run(h, t)
    keep = t != -100
    loss_v, gh_v, gw_v = run(h[keep], t[keep])
    assert torch.allclose(loss, loss_v) and torch.allclose(gw, gw_v) and torch.allclose(gh[keep], gh_v)
    assert torch.equal(gh[~keep], torch.zeros_like(gh[~keep]))

    def lse():  # the recompute forward op's: 0 on the ignored rows, whose logits are never computed
        return ops.FORWARD(h, w.detach(), None, t, -100, 0.0, 1.0, None, 0.0, False, True)[1]

    assert torch.equal(lse()[~keep], torch.zeros_like(lse()[~keep])) and lse()[keep].isfinite().all()
    monkeypatch.setenv("INDUCTOR_XENT_SKIP_IGNORED", "0")
    assert run(h, t)[2].isnan().any() and lse()[~keep].isnan().all()
