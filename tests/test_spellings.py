"""Spellings of real stacks between the lm_head and the loss (issue 23, item 4 and 5), each with the
project that writes it named: a per-row temperature tensor, modded-nanogpt's sigmoid softcap and a
number added inside a softcap, losses summed over row slices of one logits tensor, heads over
``logits.detach()``; and the declines that say what to change. Loss and every gradient (the
temperature's included) within torch's error of eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import inductor_xent

from .helpers import (
    B,
    Recorder,
    T,
    V,
    assert_parity,
    assert_within_torch_error,
    autocast_exact,
    autocast_loss_and_grads,
    autocast_representable,
    fused_ops,
    leaves,
    logits_sized,
    make_inputs,
)

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _inputs(seed=0):
    ins = make_inputs(seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    ins["temp"] = torch.rand(B, T, generator=g) + 0.5  # one temperature per token
    return ins


def _temp_token(x, W, y, temp, **_):
    """verl's engine: a per-token temperature tensor, ``logits / temperature.unsqueeze(-1)``."""
    z = F.linear(x, W).float() / temp.unsqueeze(-1)
    return F.cross_entropy(z.view(-1, V), y.view(-1))


def _temp_token_logprobs(x, W, yv, temp, **_):
    """The same as a log-prob head, the temperature cast to the logits' dtype (``.div(t.to(z.dtype))``)."""
    z = F.linear(x, W)
    z = z.div(temp.unsqueeze(-1).to(z.dtype))
    return z.log_softmax(-1).gather(-1, yv.unsqueeze(-1)).squeeze(-1).sum()


def _temp_sequence(x, W, y, temp, **_):
    """One temperature per sequence, ``[B, 1, 1]``, multiplied (an inverse temperature)."""
    z = F.linear(x, W) * (1.0 / temp[:, :1, None])
    return F.cross_entropy(z.flatten(0, 1), y.flatten())


def _temp_after_slice(x, W, y, temp, **_):
    """A shifted causal-LM slice before the per-row factor: the slice is replayed first."""
    z = F.linear(x, W)[:, :-1]
    z = z / temp[:, :-1, None]
    return F.cross_entropy(z.reshape(-1, V), y[:, 1:].reshape(-1), reduction="sum")


def _sigmoid_cap(x, W, y, **_):
    """modded-nanogpt train_gpt.py: ``30 * torch.sigmoid(logits.float() / 7.5)``."""
    z = 30 * torch.sigmoid(F.linear(x, W).float() / 7.5)
    return F.cross_entropy(z.view(-1, V), y.view(-1))


def _sigmoid_shift(x, W, y, **_):
    """modded-nanogpt, later record: ``23 * torch.sigmoid((logits + 5) / 7.5)``."""
    z = 23 * torch.sigmoid((F.linear(x, W).float() + 5) / 7.5)
    return F.cross_entropy(z.view(-1, V), y.view(-1))


def _tanh_shift(x, W, b, y, **_):
    """A number added inside a tanh softcap of a linear with a bias (and one subtracted after it)."""
    z = F.linear(x, W, b)
    z = 15.0 * torch.tanh((z - 2.5) / 15.0) - 1.0
    return F.cross_entropy(z.view(-1, V), y.view(-1), reduction="sum")


def _sigmoid_z_loss(x, W, y, **_):
    """A z-loss over sigmoid-capped logits: their logsumexp includes the cap's constant (a/2)."""
    z = 30 * torch.sigmoid(F.linear(x, W) / 7.5)
    zf = z.view(-1, V)
    return F.cross_entropy(zf, y.view(-1)) + 1e-3 * (torch.logsumexp(zf, -1) ** 2).mean()


def _slices_iadd(x, W, y, **_):
    """``total += F.cross_entropy(logits[s:e], t[s:e], reduction="sum")`` over row slices."""
    z, t = F.linear(x, W).view(-1, V), y.view(-1)
    total = torch.zeros(())
    for s in range(0, B * T, 5):
        total += F.cross_entropy(z[s:s + 5].float(), t[s:s + 5], reduction="sum")
    return total / (t != -100).sum()


def _split_sum(x, W, y, **_):
    """``sum(...)`` of per-chunk summed losses over ``logits.split(k)``."""
    z, t = F.linear(x, W).view(-1, V), y.view(-1)
    return sum(F.cross_entropy(a, b, reduction="sum") for a, b in zip(z.split(4), t.split(4)))


def _chunk_sum(x, W, y, **_):
    """Chunks of the sequence dimension, ``logits.chunk(2, dim=1)``, summed in a loop."""
    total = 0
    for a, b in zip(F.linear(x, W).chunk(2, dim=1), y.chunk(2, dim=1)):
        total = total + F.cross_entropy(a.reshape(-1, V), b.reshape(-1), reduction="sum")
    return total


def _detached_reference(x, W, yv, **_):
    """A loss and the log-probs of the same logits without gradient, through ``.detach()`` (what the
    grad-mode decline suggests instead of ``torch.no_grad()``)."""
    z = F.linear(x, W).float()
    ref = z.detach().log_softmax(-1).gather(-1, yv.unsqueeze(-1)).squeeze(-1)
    return F.cross_entropy(z.view(-1, V), yv.view(-1)) + 0.5 * ref.sum()


# name -> (fn, fused ops, words of the fused reason)
FUSED = {
    "temp_token": (_temp_token, 1, "per-row temperature"),
    "temp_token_logprobs": (_temp_token_logprobs, 1, "per-row temperature"),
    "temp_sequence": (_temp_sequence, 1, "per-row temperature"),
    "temp_after_slice": (_temp_after_slice, 1, "per-row temperature"),
    "sigmoid_cap": (_sigmoid_cap, 1, "softcap=15, sigmoid softcap: 15 added after it"),
    "sigmoid_shift": (_sigmoid_shift, 1, "5 added before the softcap"),
    "tanh_shift": (_tanh_shift, 1, "-2.5 added before the softcap"),
    "sigmoid_z_loss": (_sigmoid_z_loss, 1, "logsumexp mapped onto the op's lse"),
    "slices_iadd": (_slices_iadd, 3, "one op per row slice"),
    "split_sum": (_split_sum, 4, "one op per row slice"),
    "chunk_sum": (_chunk_sum, 2, "one op per row slice"),
    "detached_reference": (_detached_reference, 1, "logits.detach() heads without gradient"),
}


@pytest.mark.parametrize("name", sorted(FUSED))
def test_spelling_fuses_with_eager_values_and_gradients(name):
    fn, n_ops, words = FUSED[name]
    ins = _inputs()
    report = inductor_xent.explain(fn, **ins)
    assert report.fused_count == len(report.sites) == n_ops, str(report)
    assert words in report.sites[0].reason, report.sites[0].reason
    rec = Recorder()
    assert_parity(fn, ins, rec, what=name)
    assert fused_ops(rec.after[0]) == n_ops
    assert not logits_sized(rec.graphs, rows=4), "no [N, V] tensor is left in the graph"


def test_temperature_tensor_gets_its_gradient():
    """The per-row factor multiplies the hidden states in the graph: autograd gives the temperature
    its gradient (asserted against eager by assert_parity; here: that there is one)."""
    ins = {k: v.requires_grad_(v.is_floating_point()) for k, v in _inputs().items()}
    torch.compile(_temp_token, backend="inductor_xent")(**ins).backward()
    assert ins["temp"].grad is not None and ins["temp"].grad.abs().sum() > 0


def test_row_factor_computed_from_the_logits_declines():
    def fn(x, W, y, **_):
        z = F.linear(x, W)
        return F.cross_entropy((z / z.detach().amax(-1, keepdim=True)).view(-1, V), y.view(-1))

    report = inductor_xent.explain(fn, **_inputs())
    assert report.fused_count == 0 and "per row by a tensor computed from the logits" in report.sites[0].reason


def test_row_factor_after_the_softcap_declines():
    def fn(x, W, y, temp, **_):
        z = 30.0 * torch.tanh(F.linear(x, W) / 30.0) / temp.unsqueeze(-1)
        return F.cross_entropy(z.view(-1, V), y.view(-1))

    report = inductor_xent.explain(fn, **_inputs())
    assert report.fused_count == 0 and "per-row tensor after the softcap" in report.sites[0].reason


def test_loss_compiled_apart_from_its_lm_head_names_the_function():
    """torchtune's ``compile_loss``: the loss module is compiled alone, the logits are its argument."""
    def chunked_loss(logits, labels):
        return F.cross_entropy(logits.float().view(-1, V), labels.view(-1))

    ins = make_inputs()
    report = inductor_xent.explain(chunked_loss, F.linear(ins["x"], ins["W"]).bfloat16(), ins["y"])
    reason = report.sites[0].reason
    assert "an argument of the compiled function chunked_loss" in reason and "graph break" not in reason, reason


def test_graph_break_between_lm_head_and_loss_names_the_line():
    def fn(x, W, y):
        logits = F.linear(x, W)
        torch._dynamo.graph_break()
        return F.cross_entropy(logits.float().view(-1, V), y.view(-1))

    ins = make_inputs()
    reason = inductor_xent.explain(fn, ins["x"], ins["W"], ins["y"]).sites[0].reason
    assert "a graph break separates the lm_head matmul from the loss (Dynamo resumes fn at line" in reason, reason


def test_grad_mode_decline_suggests_detach():
    def fn(x, W, yv, **_):
        z = F.linear(x, W)
        loss = F.cross_entropy(z.view(-1, V), yv.view(-1))
        with torch.no_grad():
            ref = z.log_softmax(-1).gather(-1, yv.unsqueeze(-1))
        return loss + ref.sum()

    report = inductor_xent.explain(fn, **make_inputs())
    assert any(".detach()" in s.reason and "no_grad" in s.reason for s in report.sites), str(report)


@pytest.mark.parametrize("name", ["temp_token", "temp_token_logprobs", "sigmoid_shift", "slices_iadd"])
def test_spelling_fuses_under_autocast_within_torch_error(name):
    """Under ``torch.autocast(bfloat16)`` (HF Trainer bf16=True): the per-row factor multiplies the fp32
    hidden states before autocast's cast, the constant bias is the op's in bf16."""
    fn, n_ops, _ = FUSED[name]
    inputs = autocast_representable(_inputs(), torch.bfloat16)
    rec = Recorder()
    ours, ours_g = autocast_loss_and_grads(fn, leaves(inputs), autocast=torch.bfloat16, backend=rec)
    same, same_g = autocast_loss_and_grads(fn, leaves(inputs), autocast=torch.bfloat16)
    exact, exact_g = autocast_exact(fn, inputs)
    assert fused_ops(rec.after[0]) == n_ops, rec.code_after[0]
    eps = torch.finfo(torch.bfloat16).eps
    assert_within_torch_error(ours, same, exact, floor=eps / 8, what=f"{name} loss")
    assert set(ours_g) == set(same_g)
    for k in same_g:
        assert_within_torch_error(ours_g[k], same_g[k], exact_g[k], what=f"{name} grad {k}")
