"""Spellings of real stacks between the lm_head and the loss (issue 23, item 4 and 5), each with the
project that writes it named: a per-row temperature tensor, modded-nanogpt's sigmoid softcap and a
number added inside a softcap, losses summed over row slices of one logits tensor, heads over
``logits.detach()``; and the declines that say what to change. Loss and every gradient (the
temperature's included) within torch's error of eager."""

from __future__ import annotations

import expecttest
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

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
    before_after,
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


def _musicgen(x, W, Wdv, y, yv, **_):
    """transformers' MusicgenForCausalLM: codebook heads stacked on dim 1, a loss per codebook
    ``logits[:, k]`` summed in a loop, over the number of codebooks (here two heads, the second a
    [D, V] weight used as x @ Wdv)."""
    logits = torch.stack([F.linear(x, W), x @ Wdv], dim=1)
    labels = torch.stack([y, yv], dim=-1)
    loss = torch.zeros([])
    for k in range(2):
        loss += F.cross_entropy(logits[:, k].contiguous().view(-1, V), labels[..., k].contiguous().view(-1))
    return loss / 2


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
    "musicgen": (_musicgen, 2, "one of several stacked heads"),
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


class TestPrintouts(expecttest.TestCase):
    """The graph before and after the pass (EXPECTTEST_ACCEPT=1 re-accepts; review the diff)."""

    def test_temperature_per_row(self):
        """``logits / temp.unsqueeze(-1)``: the hidden states are divided instead (the factor is per
        row); the op sees a logit scale of 1."""
        self.assertExpectedInline(before_after(_temp_token, _inputs()), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 7, 16]", L_W_: "f32[37, 16]", L_temp_: "f32[2, 7]", L_y_: "i64[2, 7]"):
        l_x_ = L_x_
        l_w_ = L_W_
        l_temp_ = L_temp_
        l_y_ = L_y_
        linear: "f32[2, 7, 37]" = torch._C._nn.linear(l_x_, l_w_);  l_x_ = l_w_ = None
        float_1: "f32[2, 7, 37]" = linear.float();  linear = None
        unsqueeze: "f32[2, 7, 1]" = l_temp_.unsqueeze(-1);  l_temp_ = None
        z: "f32[2, 7, 37]" = float_1 / unsqueeze;  float_1 = unsqueeze = None
        view: "f32[14, 37]" = z.view(-1, 37);  z = None
        view_1: "i64[14]" = l_y_.view(-1);  l_y_ = None
        cross_entropy: "f32[]" = torch.nn.functional.cross_entropy(view, view_1);  view = view_1 = None
        return (cross_entropy,)
# --- after the pass ---
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 7, 16]", L_W_: "f32[37, 16]", L_temp_: "f32[2, 7]", L_y_: "i64[2, 7]"):
        l_x_ = L_x_
        l_w_ = L_W_
        l_temp_ = L_temp_
        l_y_ = L_y_
        unsqueeze: "f32[2, 7, 1]" = l_temp_.unsqueeze(-1);  l_temp_ = None
        view_1: "i64[14]" = l_y_.view(-1);  l_y_ = None
        truediv_1: "f32[2, 7, 16]" = l_x_ / unsqueeze;  l_x_ = unsqueeze = None
        reshape: "f32[14, 16]" = truediv_1.reshape([-1, 16]);  truediv_1 = None
        linear_ce_fwd_default = torch.ops.inductor_xent.linear_ce_fwd.default(reshape, l_w_, None, view_1, -100, 0.0, 1.0, None, 0.0, skip_ignored = True);  reshape = l_w_ = None
        getitem: "f32[14]" = linear_ce_fwd_default[0]
        getitem_1: "f32[14]" = linear_ce_fwd_default[1];  linear_ce_fwd_default = getitem_1 = None
        ne: "b8[14]" = view_1 != -100;  view_1 = None
        sum_1: "i64[]" = ne.sum();  ne = None
        sum_2: "f32[]" = getitem.sum();  getitem = None
        truediv_2: "f32[]" = sum_2 / sum_1;  sum_2 = sum_1 = None
        return (truediv_2,)
""")

    def test_sigmoid_shift(self):
        """``23 * sigmoid((z + 5) / 7.5)`` is ``11.5 + 11.5 * tanh((z + 5) / 15)``: the 5 becomes a
        bias of the op, the rest its logit scale (11.5 / 15) and softcap (11.5); the added 11.5 does
        not change the loss."""
        self.assertExpectedInline(before_after(_sigmoid_shift, _inputs()), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 7, 16]", L_W_: "f32[37, 16]", L_y_: "i64[2, 7]"):
        l_x_ = L_x_
        l_w_ = L_W_
        l_y_ = L_y_
        linear: "f32[2, 7, 37]" = torch._C._nn.linear(l_x_, l_w_);  l_x_ = l_w_ = None
        float_1: "f32[2, 7, 37]" = linear.float();  linear = None
        add: "f32[2, 7, 37]" = float_1 + 5;  float_1 = None
        truediv: "f32[2, 7, 37]" = add / 7.5;  add = None
        sigmoid: "f32[2, 7, 37]" = torch.sigmoid(truediv);  truediv = None
        z: "f32[2, 7, 37]" = 23 * sigmoid;  sigmoid = None
        view: "f32[14, 37]" = z.view(-1, 37);  z = None
        view_1: "i64[14]" = l_y_.view(-1);  l_y_ = None
        cross_entropy: "f32[]" = torch.nn.functional.cross_entropy(view, view_1);  view = view_1 = None
        return (cross_entropy,)
# --- after the pass ---
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 7, 16]", L_W_: "f32[37, 16]", L_y_: "i64[2, 7]"):
        l_x_ = L_x_
        l_w_ = L_W_
        l_y_ = L_y_
        view_1: "i64[14]" = l_y_.view(-1);  l_y_ = None
        reshape: "f32[14, 16]" = l_x_.reshape([-1, 16]);  l_x_ = None
        new_full: "f32[37]" = l_w_.new_full((37,), 5.0)
        linear_ce_fwd_default = torch.ops.inductor_xent.linear_ce_fwd.default(reshape, l_w_, new_full, view_1, -100, 0.0, 0.7666666666666666, 11.5, 0.0, skip_ignored = True);  reshape = l_w_ = new_full = None
        getitem: "f32[14]" = linear_ce_fwd_default[0]
        getitem_1: "f32[14]" = linear_ce_fwd_default[1];  linear_ce_fwd_default = getitem_1 = None
        ne: "b8[14]" = view_1 != -100;  view_1 = None
        sum_1: "i64[]" = ne.sum();  ne = None
        sum_2: "f32[]" = getitem.sum();  getitem = None
        truediv_1: "f32[]" = sum_2 / sum_1;  sum_2 = sum_1 = None
        return (truediv_1,)
""")

    def test_slices_iadd(self):
        """``total += cross_entropy(z[s:e], t[s:e], reduction="sum")``: one op per row slice, on the
        same slice of the hidden states, each summed into the total as before."""
        self.assertExpectedInline(before_after(_slices_iadd, _inputs()), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 7, 16]", L_W_: "f32[37, 16]", L_y_: "i64[2, 7]"):
        l_x_ = L_x_
        l_w_ = L_W_
        l_y_ = L_y_
        linear: "f32[2, 7, 37]" = torch._C._nn.linear(l_x_, l_w_);  l_x_ = l_w_ = None
        z: "f32[14, 37]" = linear.view(-1, 37);  linear = None
        t: "i64[14]" = l_y_.view(-1);  l_y_ = None
        total: "f32[]" = torch.zeros(())
        getitem: "f32[5, 37]" = z[slice(0, 5, None)]
        float_1: "f32[5, 37]" = getitem.float();  getitem = None
        getitem_1: "i64[5]" = t[slice(0, 5, None)]
        cross_entropy: "f32[]" = torch.nn.functional.cross_entropy(float_1, getitem_1, reduction = 'sum');  float_1 = getitem_1 = None
        total += cross_entropy;  total_1: "f32[]" = total;  total = cross_entropy = None
        getitem_2: "f32[5, 37]" = z[slice(5, 10, None)]
        float_2: "f32[5, 37]" = getitem_2.float();  getitem_2 = None
        getitem_3: "i64[5]" = t[slice(5, 10, None)]
        cross_entropy_1: "f32[]" = torch.nn.functional.cross_entropy(float_2, getitem_3, reduction = 'sum');  float_2 = getitem_3 = None
        total_1 += cross_entropy_1;  total_2: "f32[]" = total_1;  total_1 = cross_entropy_1 = None
        getitem_4: "f32[4, 37]" = z[slice(10, 15, None)];  z = None
        float_3: "f32[4, 37]" = getitem_4.float();  getitem_4 = None
        getitem_5: "i64[4]" = t[slice(10, 15, None)]
        cross_entropy_2: "f32[]" = torch.nn.functional.cross_entropy(float_3, getitem_5, reduction = 'sum');  float_3 = getitem_5 = None
        total_2 += cross_entropy_2;  total_3: "f32[]" = total_2;  total_2 = cross_entropy_2 = None
        ne: "b8[14]" = t != -100;  t = None
        sum_1: "i64[]" = ne.sum();  ne = None
        truediv: "f32[]" = total_3 / sum_1;  total_3 = sum_1 = None
        return (truediv,)
# --- after the pass ---
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 7, 16]", L_W_: "f32[37, 16]", L_y_: "i64[2, 7]"):
        l_x_ = L_x_
        l_w_ = L_W_
        l_y_ = L_y_
        t: "i64[14]" = l_y_.view(-1);  l_y_ = None
        total: "f32[]" = torch.zeros(())
        getitem_1: "i64[5]" = t[slice(0, 5, None)]
        reshape: "f32[14, 16]" = l_x_.reshape([-1, 16])
        getitem_6: "f32[5, 16]" = reshape[slice(0, 5, None)];  reshape = None
        linear_ce_fwd_default = torch.ops.inductor_xent.linear_ce_fwd.default(getitem_6, l_w_, None, getitem_1, -100, 0.0, 1.0, None, 0.0, skip_ignored = True);  getitem_6 = getitem_1 = None
        getitem_7: "f32[5]" = linear_ce_fwd_default[0]
        getitem_8: "f32[5]" = linear_ce_fwd_default[1];  linear_ce_fwd_default = getitem_8 = None
        sum_2: "f32[]" = getitem_7.sum();  getitem_7 = None
        total += sum_2;  total_1: "f32[]" = total;  total = sum_2 = None
        getitem_3: "i64[5]" = t[slice(5, 10, None)]
        reshape_1: "f32[14, 16]" = l_x_.reshape([-1, 16])
        getitem_9: "f32[5, 16]" = reshape_1[slice(5, 10, None)];  reshape_1 = None
        linear_ce_fwd_default_1 = torch.ops.inductor_xent.linear_ce_fwd.default(getitem_9, l_w_, None, getitem_3, -100, 0.0, 1.0, None, 0.0, skip_ignored = True);  getitem_9 = getitem_3 = None
        getitem_10: "f32[5]" = linear_ce_fwd_default_1[0]
        getitem_11: "f32[5]" = linear_ce_fwd_default_1[1];  linear_ce_fwd_default_1 = getitem_11 = None
        sum_3: "f32[]" = getitem_10.sum();  getitem_10 = None
        total_1 += sum_3;  total_2: "f32[]" = total_1;  total_1 = sum_3 = None
        getitem_5: "i64[4]" = t[slice(10, 15, None)]
        reshape_2: "f32[14, 16]" = l_x_.reshape([-1, 16]);  l_x_ = None
        getitem_12: "f32[4, 16]" = reshape_2[slice(10, 15, None)];  reshape_2 = None
        linear_ce_fwd_default_2 = torch.ops.inductor_xent.linear_ce_fwd.default(getitem_12, l_w_, None, getitem_5, -100, 0.0, 1.0, None, 0.0, skip_ignored = True);  getitem_12 = l_w_ = getitem_5 = None
        getitem_13: "f32[4]" = linear_ce_fwd_default_2[0]
        getitem_14: "f32[4]" = linear_ce_fwd_default_2[1];  linear_ce_fwd_default_2 = getitem_14 = None
        sum_4: "f32[]" = getitem_13.sum();  getitem_13 = None
        total_2 += sum_4;  total_3: "f32[]" = total_2;  total_2 = sum_4 = None
        ne: "b8[14]" = t != -100;  t = None
        sum_1: "i64[]" = ne.sum();  ne = None
        truediv: "f32[]" = total_3 / sum_1;  total_3 = sum_1 = None
        return (truediv,)
""")


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


def test_reference_under_no_grad_fuses_without_gradient():
    """A loss and the log-probs of the same logits inside ``torch.no_grad()`` (a reference policy's, say),
    summed into what is trained: one op, run before the block with gradient; the reference's value is
    detached, so its gradient reaches neither input (as eager's)."""
    def fn(x, W, yv, **_):
        z = F.linear(x, W)
        loss = F.cross_entropy(z.view(-1, V), yv.view(-1))
        with torch.no_grad():
            ref = z.log_softmax(-1).gather(-1, yv.unsqueeze(-1))
        return loss + ref.sum()

    rec = Recorder()
    assert_parity(fn, make_inputs(), rec, what="no_grad reference")
    assert fused_ops(rec.after[0]) == 1 and counters["inductor_xent"]["sites_declined"] == 0
    assert inductor_xent.explain(fn, **make_inputs()).sites[0].fused


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


def test_temperature_written_after_its_use_declines():
    """The op reads the per-row temperature where it is placed (at the loss): a write to it in between
    would change what it computes, so the site declines (eager divided by the old values)."""
    def fn(x, W, y, temp, **_):
        z = F.linear(x, W) / temp.unsqueeze(-1)
        temp.mul_(2.0)
        return F.cross_entropy(z.view(-1, V), y.view(-1))

    ins = _inputs()
    report = inductor_xent.explain(fn, **{k: v.clone() for k, v in ins.items()})
    assert report.fused_count == 0 and "per-row temperature" in report.sites[0].reason, str(report)


def test_add_with_alpha_is_not_a_shift():
    """``torch.add(z, k, alpha)`` adds ``alpha * k``: not folded as a shift by ``k``."""
    def fn(x, W, y, **_):
        z = torch.tanh(torch.add(F.linear(x, W), 5.0, 3.0) / 15.0) * 15.0
        return F.cross_entropy(z.view(-1, V), y.view(-1))

    ins = make_inputs()
    report = inductor_xent.explain(fn, **ins)
    assert report.fused_count == 0, str(report)
    torch.testing.assert_close(torch.compile(fn, backend="inductor_xent")(**ins), fn(**ins))


@pytest.mark.parametrize("strategy", ["recompute", "store"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_reduced_loss_of_detached_logits_has_no_gradient(strategy, reduction):
    """A cross-entropy of ``logits.detach()`` (a logged loss next to a trained term) reduced to a scalar:
    fused, its value as eager's and no gradient through it (the weight's .grad stays None, as eager's;
    the op's reduced output used to carry one)."""
    ins = _inputs()

    def fn(x, W, y, **_):
        logged = F.cross_entropy(F.linear(x, W).detach().view(-1, V), y.view(-1), reduction=reduction)
        return logged + x.square().sum()

    results = []
    for backend in (Recorder(**{"xent.strategy": strategy, "xent.store_budget": "1GiB"}), None):
        leaf = {k: ins[k].detach().clone().requires_grad_() for k in ("x", "W")}
        loss = (torch.compile(fn, backend=backend) if backend else fn)(**leaf, y=ins["y"])
        loss.backward()
        results.append((loss.detach(), leaf["x"].grad, leaf["W"].grad))
        if backend is not None:
            assert fused_ops(backend.after[0]) == 1
    (ours, ours_gx, ours_gw), (want, want_gx, want_gw) = results
    torch.testing.assert_close(ours, want)
    torch.testing.assert_close(ours_gx, want_gx)
    assert want_gw is None and ours_gw is None, "a gradient through the detached logits"
