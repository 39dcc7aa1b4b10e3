"""Bad input gets a clear error naming the values; edge cases behave exactly like PyTorch."""

import re

import pytest
import torch
import torch.nn.functional as F

import inductor_xent

H = torch.randn(6, 4)
W = torch.randn(10, 4)
Y = torch.tensor([1, 2, 3, -100, 9, 0])


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(weight=torch.randn(10, 5)), ValueError, "hidden's last dimension (4) must equal weight's second dimension (5)"),
        (dict(weight=torch.randn(10)), ValueError, "expected hidden [..., D] and weight [V, D]"),
        (dict(target=torch.tensor([1, 2, 3])), ValueError, "target's shape (3,) must equal hidden's leading shape (6,)"),
        (dict(target=Y.float()), TypeError, "target must hold integer class ids, got dtype torch.float32"),
        (dict(target=torch.ones(6, dtype=torch.bool)), TypeError, "target must hold integer class ids"),
        (dict(reduction="avg"), ValueError, "reduction must be one of 'mean', 'sum', 'none', got 'avg'"),
        (dict(label_smoothing=1.5), ValueError, "label_smoothing must be in [0, 1], got 1.5"),
        (dict(label_smoothing=-0.1), ValueError, "label_smoothing must be in [0, 1], got -0.1"),
        (dict(bias=torch.randn(9)), ValueError, "bias must have shape (10,) [V], got (9,)"),
        (dict(softcap=0.0), ValueError, "softcap must be None or a finite number > 0, got 0.0"),
        (dict(softcap=-3.0), ValueError, "softcap must be None or a finite number > 0, got -3.0"),
        (dict(z_loss=float("nan")), ValueError, "z_loss must be a finite number >= 0, got nan"),
        (dict(logit_scale=float("inf")), ValueError, "logit_scale must be finite, got inf"),
        (dict(weight=torch.randn(10, 4, dtype=torch.float64)), TypeError, "weight.dtype (torch.float64) must equal hidden.dtype (torch.float32)"),
        (dict(hidden=H.to(torch.int32)), TypeError, "hidden must be float64, float32, bfloat16 or float16, got torch.int32"),
        (dict(hidden=H.numpy()), TypeError, "hidden must be a torch.Tensor, got ndarray"),
        (dict(weight=torch.randn(0, 4)), ValueError, "the vocabulary V must be at least 1"),
        (dict(target=torch.tensor([1, 2, 10, -100, 9, 0])), ValueError, "target values [10] are outside [0, 10) and are not ignore_index=-100"),
        (dict(target=torch.tensor([1, -5, 3, -100, 9, 0])), ValueError, "target values [-5] are outside [0, 10)"),
    ],
)
def test_errors_name_the_values(kwargs, error, message):
    args = dict(hidden=H, weight=W, target=Y)
    args.update(kwargs)
    positional = [args.pop(k) for k in ("hidden", "weight", "target")]
    with pytest.raises(error, match=re.escape(message)):
        inductor_xent.linear_cross_entropy(*positional, **args)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(0,), (3, 0)])  # empty, and empty with a 2-D leading shape
def test_empty_input_like_pytorch(reduction, shape):
    h = torch.randn(*shape, 4, requires_grad=True)
    y = torch.zeros(shape, dtype=torch.long)
    got = inductor_xent.linear_cross_entropy(h, W, y, reduction=reduction)
    want = F.cross_entropy(F.linear(h, W).reshape(-1, 10), y.reshape(-1), reduction=reduction)
    assert got.shape == (want.shape if reduction != "none" else y.shape)
    torch.testing.assert_close(got.reshape(-1), want.reshape(-1), equal_nan=True)
    if reduction != "mean":
        got.sum().backward()
        assert h.grad.shape == h.shape


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_like_pytorch(reduction):
    h = torch.randn(6, 4, requires_grad=True)
    y = torch.full((6,), -100)
    got = inductor_xent.linear_cross_entropy(h, W, y, reduction=reduction)
    want = F.cross_entropy(F.linear(h, W), y, reduction=reduction)
    torch.testing.assert_close(got, want, equal_nan=True)
    if reduction != "mean":
        got.sum().backward()
        assert torch.count_nonzero(h.grad) == 0


def test_impl_env_var(monkeypatch):
    monkeypatch.setenv("INDUCTOR_XENT_IMPL", "fast")
    with pytest.raises(ValueError, match=re.escape("INDUCTOR_XENT_IMPL='fast'; expected one of auto, triton, reference")):
        inductor_xent.linear_cross_entropy(H, W, Y)
    monkeypatch.setenv("INDUCTOR_XENT_IMPL", "reference")
    torch.testing.assert_close(inductor_xent.linear_cross_entropy(H, W, Y), F.cross_entropy(H @ W.T, Y))
