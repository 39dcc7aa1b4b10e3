"""The oracle itself agrees with PyTorch's F.cross_entropy in float64 (and with a hand formula for
the terms PyTorch lacks: z-loss, softcap); its log-probabilities, entropy and argmax agree with
F.cross_entropy, torch.distributions.Categorical and torch.argmax."""

import pytest
import torch
import torch.nn.functional as F

from inductor_xent import reference
from inductor_xent.options import LossOptions


def _inputs(n=29, d=11, v=37, seed=0):  # prime sizes: nothing lines up with a block
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, dtype=torch.float64, generator=g)
    w = torch.randn(v, d, dtype=torch.float64, generator=g)
    b = torch.randn(v, dtype=torch.float64, generator=g)
    y = torch.randint(0, v, (n,), generator=g)
    y[::4] = -100
    return h, w, b, y


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.3, 1.0])  # 1.0: the loss is pure smoothing
def test_matches_cross_entropy(reduction, label_smoothing):
    h, w, b, y = _inputs()
    got = reference.linear_cross_entropy(h, w, y, bias=b, reduction=reduction, label_smoothing=label_smoothing)
    want = F.cross_entropy(F.linear(h, w, b), y, reduction=reduction, label_smoothing=label_smoothing)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_custom_ignore_index_and_3d():
    h, w, b, y = _inputs(n=24)
    y = torch.where(y == -100, 5, y)  # class 5 is the ignored one here
    got = reference.linear_cross_entropy(h.view(4, 6, -1), w, y.view(4, 6), ignore_index=5)
    want = F.cross_entropy(F.linear(h, w), y, ignore_index=5)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_z_loss_softcap_scale_by_hand():
    h, w, b, y = _inputs()
    opts = LossOptions(-100, 0.0, 0.5, 2.0, 1e-2)
    rows, lse = reference.loss_rows(h, w, b, y, opts)
    z = 2.0 * torch.tanh((h @ w.T + b) * 0.5 / 2.0)
    want_lse = z.exp().sum(-1).log()
    valid = y != -100
    want = (want_lse - z[torch.arange(len(y)), y.clamp(min=0)] + 1e-2 * want_lse**2) * valid
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rows, want, rtol=1e-12, atol=1e-12)


def test_all_ignored_mean_is_nan_sum_is_zero():
    h, w, b, y = _inputs()
    y[:] = -100
    assert torch.isnan(reference.linear_cross_entropy(h, w, y))
    assert reference.linear_cross_entropy(h, w, y, reduction="sum").item() == 0.0


@pytest.mark.parametrize("temperature, softcap", [(1.0, None), (0.6, None), (1.7, 2.0)])
def test_log_probs_entropy_argmax(temperature, softcap):
    """log_probs = −cross_entropy(reduction='none') of z/T, entropy = Categorical(logits=z/T)'s,
    where z is capped before the temperature divides it; ignored rows give 0."""
    h, w, b, y = _inputs()
    lp, ent, arg = reference.linear_log_probs(h.view(29, 1, -1), w, y.view(29, 1), bias=b, temperature=temperature,
                                              logit_scale=0.9, softcap=softcap)
    z = F.linear(h, w, b) * 0.9
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    valid = y != -100
    assert lp.shape == ent.shape == arg.shape == (29, 1)
    torch.testing.assert_close(lp.view(-1), -F.cross_entropy(z, y, reduction="none"), rtol=1e-12, atol=1e-12)
    want_ent = torch.where(valid, torch.distributions.Categorical(logits=z).entropy(), 0.0)
    torch.testing.assert_close(ent.view(-1), want_ent, rtol=1e-12, atol=1e-12)
    assert torch.equal(arg.view(-1), z.argmax(-1))
