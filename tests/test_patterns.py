"""The pass on Dynamo graphs: which spellings it fuses (graph before/after, exact site counts, eager
parity of the loss and every gradient, no [N, V] tensor left) and which it must leave alone. The
spellings, declines and inputs are in helpers.py.
"""

from __future__ import annotations

import itertools
import random

import expecttest
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import AotEagerAndRecordGraphs
from torch._dynamo.utils import counters

import inductor_xent
from inductor_xent import ops, patterns
from inductor_xent.backend import inductor_xent as xent_backend

from .helpers import (
    DECLINES,
    SPELLINGS,
    B,
    D,
    Recorder,
    T,
    V,
    assert_parity,
    assert_within_torch_error,
    before_after,
    counting,
    fused_ops,
    leaves,
    logits_sized,
    make_inputs,
    printout,
    run_both,
    sources,
    targets,
)

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


# ---------------------------------------------------------------------------------------------
# fused spellings: graph and numbers
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_spelling_fuses_and_matches_eager(name):
    fn, pattern = SPELLINGS[name]
    rec = Recorder()
    assert_parity(fn, make_inputs(), rec, what=name)
    assert len(rec.before) == 1, "one graph, no graph break"
    assert sources(rec.before[0]), "the source ops are in the graph before the pass"
    assert fused_ops(rec.after[0]) == 1
    assert sources(rec.after[0]) == [], f"source ops left after the pass: {sources(rec.after[0])}"
    assert counters["inductor_xent"]["sites_fused"] == 1
    assert counters["inductor_xent"][f"fused.{pattern}"] == 1
    assert counters["inductor_xent"]["sites_declined"] == 0


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_no_logits_in_aot_graphs(name):
    """The point of the pass: the Dynamo graph holds [N, V] tensors, AOTAutograd's forward and
    backward graphs after the rewrite hold none (so the partitioner saves none), only our ops."""
    fn, _ = SPELLINGS[name]
    aot = AotEagerAndRecordGraphs()
    dynamo = []

    def backend(gm, example_inputs):
        dynamo.extend(logits_sized([gm]))
        patterns.run(gm)
        return aot(gm, example_inputs)

    torch.compile(fn, backend=backend)(**leaves(make_inputs())).backward()
    assert dynamo, "the check finds the logits of the unfused graph"
    assert len(aot.fw_graphs) == len(aot.bw_graphs) == 1
    assert logits_sized(aot.fw_graphs + aot.bw_graphs) == []
    fw, bw = targets(aot.fw_graphs[0]), targets(aot.bw_graphs[0])
    if name == "no_grad_lm_head":  # the loss carries no gradient: the op has no backward to run
        assert ops.FORWARD in fw and ops.BACKWARD not in bw
        return
    assert (ops.FORWARD in fw and ops.BACKWARD in bw) or ops.STORE in fw


@pytest.mark.parametrize("name", ["linear_bias_float_sum", "softcap", "transpose", "z_loss"])
def test_inference_no_grad(name):
    fn, _ = SPELLINGS[name]
    rec = Recorder()
    with torch.no_grad():
        assert_parity(fn, make_inputs(), rec, requires_grad=False, what=name)
    assert fused_ops(rec.after[0]) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_other_dtypes(dtype):
    """bf16 (the op keeps fp32 logits: at least as accurate as eager) and float64."""
    fn, _ = SPELLINGS["linear_bias_float_sum" if dtype == torch.bfloat16 else "bias_add"]
    rec = Recorder()
    le, ge, lc, gc, l64, g64 = run_both(fn, make_inputs(dtype), rec)
    assert fused_ops(rec.after[0]) == 1
    assert lc.dtype == le.dtype
    assert_within_torch_error(lc, le, l64, floor=1e-10 if dtype == torch.float64 else 1e-6, what="loss")
    for k in ge:
        assert gc[k].dtype == ge[k].dtype
        assert_within_torch_error(gc[k], ge[k], g64[k], floor=1e-10 if dtype == torch.float64 else 1e-6,
                                  what=f"grad {k}")


def test_vocab_scale_bf16_within_torch_error():
    """The per-vocabulary scale goes into the weight in bf16 (one rounding per weight entry where eager
    rounds each logit once): loss and every gradient, the scale's included, within torch's own error."""
    fn, _ = SPELLINGS["vocab_scale"]
    rec = Recorder()
    le, ge, lc, gc, l64, g64 = run_both(fn, make_inputs(torch.bfloat16), rec)
    assert rec.after[0].count(ops.FORWARD) == 1
    assert_within_torch_error(lc, le, l64, what="loss")
    for k in ge:
        assert gc[k].dtype == ge[k].dtype
        assert_within_torch_error(gc[k], ge[k], g64[k], what=f"grad {k}")


def test_partial_requires_grad():
    """Only the weight trains (frozen hidden states): no grad for x, weight grad exact."""
    fn, _ = SPELLINGS["linear_view_mean"]
    ins = make_inputs()
    rec = Recorder()
    results = []
    for f in (fn, torch.compile(fn, backend=rec)):
        W = ins["W"].clone().requires_grad_(True)
        loss = f(**dict(ins, W=W))
        loss.backward()
        results.append((loss.detach(), W.grad))
    torch.testing.assert_close(results[1][0], results[0][0])
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-6)
    assert fused_ops(rec.after[0]) == 1


def test_all_ignored_mean_is_nan_like_eager():
    fn, _ = SPELLINGS["linear_view_mean"]
    ins = make_inputs()
    ins["y"] = torch.full_like(ins["y"], -100)
    eager = fn(**ins)
    compiled = torch.compile(fn, backend=Recorder())(**ins)
    assert torch.isnan(eager) and torch.isnan(compiled)
    assert counters["inductor_xent"]["sites_fused"] == 1


@pytest.mark.parametrize("name, skips", [("linear_view_mean", True), ("z_loss", False)])
def test_recompute_op_skips_ignored_rows_unless_their_lse_is_read(name, skips):
    """The recompute op is told to skip the ignored rows (``skip_ignored``) where nothing in the graph
    reads its lse; a z-loss over a logsumexp of every row reads it, so there every row is computed.
    The loss and gradients equal eager's either way (make_inputs ignores some rows)."""
    fn, _ = SPELLINGS[name]
    ins = make_inputs()
    rec = Recorder(**{"xent.strategy": "recompute"})
    assert_parity(fn, ins, rec)
    (op,) = [n for n in rec.graphs[0].graph.nodes if n.target is ops.FORWARD]
    assert len(op.args) == 9 and op.kwargs == ({"skip_ignored": True} if skips else {})


class _Head(torch.nn.Module):
    """nn.Linear + nn.CrossEntropyLoss modules, as a model would hold them."""

    def __init__(self):
        super().__init__()
        self.lm_head = torch.nn.Linear(D, V, bias=True)
        self.loss = torch.nn.CrossEntropyLoss(ignore_index=-100, label_smoothing=0.1)

    def forward(self, x, y):
        return self.loss(self.lm_head(x).view(-1, V), y.view(-1))


def test_modules_linear_and_cross_entropy_loss():
    """nn.Linear (bias) + nn.CrossEntropyLoss(label_smoothing): parameters are graph inputs."""
    torch.manual_seed(0)
    head, ins = _Head(), make_inputs()
    rec = Recorder()
    results = []
    for f in (head, torch.compile(head, backend=rec)):
        head.zero_grad(set_to_none=True)
        x = ins["x"].clone().requires_grad_(True)
        loss = f(x, ins["y"])
        loss.backward()
        results.append([loss.detach(), x.grad, head.lm_head.weight.grad, head.lm_head.bias.grad])
    for c, e in zip(results[1], results[0]):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)
    assert fused_ops(rec.after[0]) == 1 and torch.nn.functional.cross_entropy not in rec.after[0]
    assert counters["inductor_xent"]["fused.lm_head_cross_entropy"] == 1


def test_two_sites_in_one_graph():
    """Two heads (e.g. a multi-token-prediction model): each fused, exact count 2."""
    def fn(x, W, Wdv, y, yv, **_):
        a = F.cross_entropy(F.linear(x, W).view(-1, V), y.view(-1))
        c = F.cross_entropy((x @ Wdv).view(-1, V), yv.view(-1))
        return a + c
    rec = Recorder()
    assert_parity(fn, make_inputs(), rec, what="two sites")
    assert fused_ops(rec.after[0]) == 2
    assert counters["inductor_xent"]["sites_fused"] == 2


# ---------------------------------------------------------------------------------------------
# declines: no rewrite, identical results, a reason
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(DECLINES))
def test_declines_with_reason(name):
    fn, words = DECLINES[name]
    rec = Recorder()
    le, ge, lc, gc = run_both(fn, make_inputs(), rec, fp64=False)
    assert fused_ops(rec.after[0]) == 0
    assert rec.code_after[0] == rec.code_before[0], "a declined site leaves the graph untouched"
    torch.testing.assert_close(lc, le)
    for k in ge:
        torch.testing.assert_close(gc[k], ge[k])
    assert counters["inductor_xent"]["sites_declined"] == 1
    assert counters["inductor_xent"]["sites_fused"] == 0
    report = inductor_xent.explain(fn, **make_inputs())
    assert [s.fused for s in report.sites] == [False]
    assert words in report.sites[0].reason, report.sites[0].reason


def test_inplace_update_through_a_view_declines():
    """The op reads the hidden states where the loss is: an in-place update of a view of them in
    between (here of the buffer behind ``h.view``) must keep the site unfused. Forward only: eager
    autograd refuses the mutation of a saved tensor anyway."""

    def fn(x, W, y):
        h = x.detach().clone()
        logits = F.linear(h.view(-1, D), W)
        h.mul_(3)
        return F.cross_entropy(logits, y.view(-1))

    inputs = make_inputs()
    args = (inputs["x"], inputs["W"], inputs["y"])
    with torch.no_grad():
        want = fn(*args)
        got = torch.compile(fn, backend=xent_backend, options={"xent.inner": "aot_eager"})(*args)
    torch.testing.assert_close(got, want)
    assert counters["inductor_xent"]["sites_fused"] == 0
    assert counters["inductor_xent"]["sites_declined"] == 1
    report = inductor_xent.explain(fn, *args)
    assert "Tensor.mul_ writes the hidden states" in report.sites[0].reason, report.sites[0].reason


def test_returned_logits_are_written_by_the_op():
    """Logits the compiled function returns next to the loss fuse by default: the op writes them (no
    linear is left in the graph), with or without allow_escaping_logits (which is for other users in
    the graph: tests/test_escape.py); values and gradients as eager when the caller uses them."""
    def fn(x, W, y, **_):
        logits = F.linear(x, W)
        return F.cross_entropy(logits.float().view(-1, V), y.view(-1)), logits
    ins = make_inputs()
    site = inductor_xent.explain(fn, **ins).sites[0]
    assert site.fused and site.logits_returned and "returned logits written by the op" in site.reason, site.reason
    for options in ({}, {"xent.allow_escaping_logits": True}):
        torch._dynamo.reset()
        counters.clear()
        rec = Recorder(**options)
        eager, compiled = [], []
        for f, out in ((fn, eager), (torch.compile(fn, backend=rec), compiled)):
            L = leaves(ins)
            loss, logits = f(**L)
            (loss + logits.sum() * 1e-3).backward()
            out += [loss.detach(), logits.detach(), L["x"].grad, L["W"].grad]
        for a, c in zip(eager, compiled):
            torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-5)
        assert fused_ops(rec.after[0]) == 1
        assert torch._C._nn.linear not in rec.after[0], "the op writes the returned logits"
        assert counters["inductor_xent"]["sites_fused"] == 1


def test_not_a_site():
    """Cross-entropy of something that is not a matmul output: no site, nothing reported."""
    def fn(z, y):
        return F.cross_entropy(z.view(-1, V) * 2.0, y.view(-1))
    ins = make_inputs()
    rec = Recorder()
    torch.compile(fn, backend=rec)(torch.randn(B, T, V), ins["y"])
    assert rec.code_after[0] == rec.code_before[0]
    assert counters["inductor_xent"]["sites_fused"] == counters["inductor_xent"]["sites_declined"] == 0


# ---------------------------------------------------------------------------------------------
# dynamic shapes: no guard, recompile or graph break of our own
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["hf_causal_lm", "slice_seq", "z_loss", "transpose"])
def test_dynamic_batch_no_extra_recompiles(name):
    """Automatic dynamic: batch 2, 3, 4. Frames compiled must equal what plain AOT compilation
    (no pass) needs, and the numbers stay exact on each size."""
    fn, _ = SPELLINGS[name]
    counts = []
    for backend in (counting(Recorder()), counting(Recorder(**{"xent.enable": False}))):
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(fn, backend=backend)
        for batch in (2, 3, 4):
            ins = make_inputs(batch=batch, seed=batch)
            torch.testing.assert_close(compiled(**ins), fn(**ins), rtol=1e-5, atol=1e-6)
        counts.append((backend.frame_count, sum(counters["graph_break"].values())))
    assert counts[0] == counts[1]
    assert counts[0][0] == 2, "static first, then one dynamic recompile"


def test_mark_dynamic_one_compile():
    fn, _ = SPELLINGS["linear_bias_float_sum"]
    backend = counting(Recorder())
    compiled = torch.compile(fn, backend=backend)
    for batch in (2, 5):
        ins = make_inputs(batch=batch, seed=batch)
        torch._dynamo.mark_dynamic(ins["x"], 0)
        torch._dynamo.mark_dynamic(ins["y"], 0)
        torch._dynamo.mark_dynamic(ins["yv"], 0)
        torch.testing.assert_close(compiled(**ins), fn(**ins), rtol=1e-5, atol=1e-5)
    assert backend.frame_count == 1
    assert fused_ops(backend.backend.after[0]) == 1


# ---------------------------------------------------------------------------------------------
# printouts of the intricate rewrites: the Dynamo graph before and after the pass, as text, so any
# change to a rewrite fails here (EXPECTTEST_ACCEPT=1 re-accepts; review the diff). The printouts
# are the same on torch 2.11 and 2.13 (helpers.printout normalises them), so both run them.
# ---------------------------------------------------------------------------------------------
def _softcap_scale_bias(x, W, b, y, **_):
    """Cohere's logit_scale and Gemma 2's softcap on a linear with a bias, upcast, mean."""
    z = torch.tanh((F.linear(x, W, b) * 0.5) / 3.0) * 3.0
    return F.cross_entropy(z.float().view(-1, V), y.view(-1))


def _sliced_softcap_none(x, W, y, **_):
    """Next-token logits sliced off the lm_head output (the slice moves onto the hidden states),
    softcapped, per-row losses."""
    z = torch.tanh(F.linear(x, W)[:, :-1] / 2.0) * 2.0
    return F.cross_entropy(z.float().reshape(-1, V), y[:, 1:].reshape(-1), reduction="none")


def _z_loss_late_targets(x, W, y, **_):
    """A z-loss logsumexp first, the shifted labels computed after it: the op takes the logsumexp's
    place, so the labels' computation moves above it."""
    z = F.linear(x, W).float().view(-1, V)
    lse = torch.logsumexp(z, -1)
    t = F.pad(y, (0, 1), value=-100)[:, 1:].reshape(-1)
    return F.cross_entropy(z, t) + 1e-2 * lse.pow(2).mean()


class TestPrintouts(expecttest.TestCase):
    def test_hf_causal_lm_num_items_in_batch(self):
        """transformers' ForCausalLMLoss: upcast, view, sum over pad-shifted labels / num_items_in_batch."""
        self.assertExpectedInline(before_after(SPELLINGS["hf_causal_lm"][0]), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 7, 16]", L_W_: "f32[37, 16]", L_y_: "i64[2, 7]", L_n_: "i64[]"):
        l_x_ = L_x_
        l_w_ = L_W_
        l_y_ = L_y_
        l_n_ = L_n_
        linear: "f32[2, 7, 37]" = torch._C._nn.linear(l_x_, l_w_);  l_x_ = l_w_ = None
        logits: "f32[2, 7, 37]" = linear.float();  linear = None
        labels: "i64[2, 8]" = torch._C._nn.pad(l_y_, (0, 1), 'constant', -100);  l_y_ = None
        getitem: "i64[2, 7]" = labels[(Ellipsis, slice(1, None, None))];  labels = None
        shift: "i64[2, 7]" = getitem.contiguous();  getitem = None
        view: "f32[14, 37]" = logits.view(-1, 37);  logits = None
        view_1: "i64[14]" = shift.view(-1);  shift = None
        to: "i64[14]" = view_1.to(device(type='cpu'));  view_1 = None
        loss: "f32[]" = torch.nn.functional.cross_entropy(view, to, ignore_index = -100, reduction = 'sum');  view = to = None
        truediv: "f32[]" = loss / l_n_;  loss = l_n_ = None
        return (truediv,)
# --- after the pass ---
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 7, 16]", L_W_: "f32[37, 16]", L_y_: "i64[2, 7]", L_n_: "i64[]"):
        l_x_ = L_x_
        l_w_ = L_W_
        l_y_ = L_y_
        l_n_ = L_n_
        labels: "i64[2, 8]" = torch._C._nn.pad(l_y_, (0, 1), 'constant', -100);  l_y_ = None
        getitem: "i64[2, 7]" = labels[(Ellipsis, slice(1, None, None))];  labels = None
        shift: "i64[2, 7]" = getitem.contiguous();  getitem = None
        view_1: "i64[14]" = shift.view(-1);  shift = None
        to: "i64[14]" = view_1.to(device(type='cpu'));  view_1 = None
        reshape: "f32[14, 16]" = l_x_.reshape([-1, 16]);  l_x_ = None
        linear_ce_fwd_default = torch.ops.inductor_xent.linear_ce_fwd.default(reshape, l_w_, None, to, -100, 0.0, 1.0, None, 0.0, skip_ignored = True);  reshape = l_w_ = to = None
        getitem_1: "f32[14]" = linear_ce_fwd_default[0]
        getitem_2: "f32[14]" = linear_ce_fwd_default[1];  linear_ce_fwd_default = getitem_2 = None
        sum_1: "f32[]" = getitem_1.sum();  getitem_1 = None
        truediv: "f32[]" = sum_1 / l_n_;  sum_1 = l_n_ = None
        return (truediv,)
""")

    def test_sliced_logits(self):
        self.assertExpectedInline(before_after(_sliced_softcap_none), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 7, 16]", L_W_: "f32[37, 16]", L_y_: "i64[2, 7]"):
        l_x_ = L_x_
        l_w_ = L_W_
        l_y_ = L_y_
        linear: "f32[2, 7, 37]" = torch._C._nn.linear(l_x_, l_w_);  l_x_ = l_w_ = None
        getitem: "f32[2, 6, 37]" = linear[(slice(None, None, None), slice(None, -1, None))];  linear = None
        truediv: "f32[2, 6, 37]" = getitem / 2.0;  getitem = None
        tanh: "f32[2, 6, 37]" = torch.tanh(truediv);  truediv = None
        z: "f32[2, 6, 37]" = tanh * 2.0;  tanh = None
        float_1: "f32[2, 6, 37]" = z.float();  z = None
        reshape: "f32[12, 37]" = float_1.reshape(-1, 37);  float_1 = None
        getitem_1: "i64[2, 6]" = l_y_[(slice(None, None, None), slice(1, None, None))];  l_y_ = None
        reshape_1: "i64[12]" = getitem_1.reshape(-1);  getitem_1 = None
        cross_entropy: "f32[12]" = torch.nn.functional.cross_entropy(reshape, reshape_1, reduction = 'none');  reshape = reshape_1 = None
        return (cross_entropy,)
# --- after the pass ---
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 7, 16]", L_W_: "f32[37, 16]", L_y_: "i64[2, 7]"):
        l_x_ = L_x_
        l_w_ = L_W_
        l_y_ = L_y_
        getitem_1: "i64[2, 6]" = l_y_[(slice(None, None, None), slice(1, None, None))];  l_y_ = None
        reshape_1: "i64[12]" = getitem_1.reshape(-1);  getitem_1 = None
        getitem_2: "f32[2, 6, 16]" = l_x_[(slice(None, None, None), slice(None, -1, None))];  l_x_ = None
        reshape_2: "f32[12, 16]" = getitem_2.reshape([-1, 16]);  getitem_2 = None
        linear_ce_fwd_default = torch.ops.inductor_xent.linear_ce_fwd.default(reshape_2, l_w_, None, reshape_1, -100, 0.0, 1.0, 2.0, 0.0, skip_ignored = True);  reshape_2 = l_w_ = None
        getitem_3: "f32[12]" = linear_ce_fwd_default[0]
        getitem_4: "f32[12]" = linear_ce_fwd_default[1];  linear_ce_fwd_default = getitem_4 = None
        view_as: "f32[12]" = getitem_3.view_as(reshape_1);  getitem_3 = reshape_1 = None
        return (view_as,)
""")

    def test_softcap_scale_bias(self):
        self.assertExpectedInline(before_after(_softcap_scale_bias), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 7, 16]", L_W_: "f32[37, 16]", L_b_: "f32[37]", L_y_: "i64[2, 7]"):
        l_x_ = L_x_
        l_w_ = L_W_
        l_b_ = L_b_
        l_y_ = L_y_
        linear: "f32[2, 7, 37]" = torch._C._nn.linear(l_x_, l_w_, l_b_);  l_x_ = l_w_ = l_b_ = None
        mul: "f32[2, 7, 37]" = linear * 0.5;  linear = None
        truediv: "f32[2, 7, 37]" = mul / 3.0;  mul = None
        tanh: "f32[2, 7, 37]" = torch.tanh(truediv);  truediv = None
        z: "f32[2, 7, 37]" = tanh * 3.0;  tanh = None
        float_1: "f32[2, 7, 37]" = z.float();  z = None
        view: "f32[14, 37]" = float_1.view(-1, 37);  float_1 = None
        view_1: "i64[14]" = l_y_.view(-1);  l_y_ = None
        cross_entropy: "f32[]" = torch.nn.functional.cross_entropy(view, view_1);  view = view_1 = None
        return (cross_entropy,)
# --- after the pass ---
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 7, 16]", L_W_: "f32[37, 16]", L_b_: "f32[37]", L_y_: "i64[2, 7]"):
        l_x_ = L_x_
        l_w_ = L_W_
        l_b_ = L_b_
        l_y_ = L_y_
        view_1: "i64[14]" = l_y_.view(-1);  l_y_ = None
        reshape: "f32[14, 16]" = l_x_.reshape([-1, 16]);  l_x_ = None
        linear_ce_fwd_default = torch.ops.inductor_xent.linear_ce_fwd.default(reshape, l_w_, l_b_, view_1, -100, 0.0, 0.5, 3.0, 0.0, skip_ignored = True);  reshape = l_w_ = l_b_ = None
        getitem: "f32[14]" = linear_ce_fwd_default[0]
        getitem_1: "f32[14]" = linear_ce_fwd_default[1];  linear_ce_fwd_default = getitem_1 = None
        ne: "b8[14]" = view_1 != -100;  view_1 = None
        sum_1: "i64[]" = ne.sum();  ne = None
        sum_2: "f32[]" = getitem.sum();  getitem = None
        truediv_1: "f32[]" = sum_2 / sum_1;  sum_2 = sum_1 = None
        return (truediv_1,)
""")

    def test_weight_dv(self):
        """A [D, V] weight: the op gets its strided view W.t()."""
        self.assertExpectedInline(before_after(SPELLINGS["weight_dv"][0]), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 7, 16]", L_Wdv_: "f32[16, 37]", L_y_: "i64[2, 7]"):
        l_x_ = L_x_
        l_wdv_ = L_Wdv_
        l_y_ = L_y_
        matmul: "f32[2, 7, 37]" = torch.matmul(l_x_, l_wdv_);  l_x_ = l_wdv_ = None
        flatten: "f32[14, 37]" = matmul.flatten(0, 1);  matmul = None
        flatten_1: "i64[14]" = l_y_.flatten();  l_y_ = None
        cross_entropy: "f32[]" = torch.nn.functional.cross_entropy(flatten, flatten_1);  flatten = flatten_1 = None
        return (cross_entropy,)
# --- after the pass ---
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 7, 16]", L_Wdv_: "f32[16, 37]", L_y_: "i64[2, 7]"):
        l_x_ = L_x_
        l_wdv_ = L_Wdv_
        l_y_ = L_y_
        flatten_1: "i64[14]" = l_y_.flatten();  l_y_ = None
        flatten_2: "f32[14, 16]" = l_x_.flatten(0, 1);  l_x_ = None
        t: "f32[37, 16]" = l_wdv_.t();  l_wdv_ = None
        linear_ce_fwd_default = torch.ops.inductor_xent.linear_ce_fwd.default(flatten_2, t, None, flatten_1, -100, 0.0, 1.0, None, 0.0, skip_ignored = True);  flatten_2 = t = None
        getitem: "f32[14]" = linear_ce_fwd_default[0]
        getitem_1: "f32[14]" = linear_ce_fwd_default[1];  linear_ce_fwd_default = getitem_1 = None
        ne: "b8[14]" = flatten_1 != -100;  flatten_1 = None
        sum_1: "i64[]" = ne.sum();  ne = None
        sum_2: "f32[]" = getitem.sum();  getitem = None
        truediv: "f32[]" = sum_2 / sum_1;  sum_2 = sum_1 = None
        return (truediv,)
""")

    def test_one_hot(self):
        """-(one_hot * log_softmax).sum(-1): the op's per-row loss, negated, replaces the sum."""
        self.assertExpectedInline(before_after(SPELLINGS["one_hot"][0]), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_yv_: "i64[2, 7]", L_W_: "f32[37, 16]", L_x_: "f32[2, 7, 16]"):
        l_yv_ = L_yv_
        l_w_ = L_W_
        l_x_ = L_x_
        one_hot: "i64[2, 7, 37]" = torch._C._nn.one_hot(l_yv_, 37);  l_yv_ = None
        float_1: "f32[2, 7, 37]" = one_hot.float();  one_hot = None
        t: "f32[16, 37]" = l_w_.t();  l_w_ = None
        matmul: "f32[2, 7, 37]" = l_x_ @ t;  l_x_ = t = None
        log_softmax: "f32[2, 7, 37]" = torch.nn.functional.log_softmax(matmul, dim = -1);  matmul = None
        mul: "f32[2, 7, 37]" = float_1 * log_softmax;  float_1 = log_softmax = None
        sum_1: "f32[2, 7]" = mul.sum(-1);  mul = None
        mean: "f32[]" = sum_1.mean();  sum_1 = None
        neg: "f32[]" = -mean;  mean = None
        return (neg,)
# --- after the pass ---
class GraphModule(torch.nn.Module):
    def forward(self, L_yv_: "i64[2, 7]", L_W_: "f32[37, 16]", L_x_: "f32[2, 7, 16]"):
        l_yv_ = L_yv_
        l_w_ = L_W_
        l_x_ = L_x_
        flatten: "f32[14, 16]" = l_x_.flatten(0, -2);  l_x_ = None
        reshape: "i64[14]" = l_yv_.reshape(-1)
        linear_ce_fwd_default = torch.ops.inductor_xent.linear_ce_fwd.default(flatten, l_w_, None, reshape, -2147483648, 0.0, 1.0, None, 0.0);  flatten = l_w_ = reshape = None
        getitem: "f32[14]" = linear_ce_fwd_default[0]
        getitem_1: "f32[14]" = linear_ce_fwd_default[1];  linear_ce_fwd_default = getitem_1 = None
        view_as: "f32[2, 7]" = getitem.view_as(l_yv_);  getitem = l_yv_ = None
        neg_1: "f32[2, 7]" = -view_as;  view_as = None
        mean: "f32[]" = neg_1.mean();  neg_1 = None
        neg: "f32[]" = -mean;  mean = None
        return (neg,)
""")

    def test_z_loss(self):
        """A z-loss logsumexp of the same logits reads the op's lse, viewed as the logits' rows."""
        self.assertExpectedInline(before_after(SPELLINGS["z_loss"][0]), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 7, 16]", L_W_: "f32[37, 16]", L_y_: "i64[2, 7]"):
        l_x_ = L_x_
        l_w_ = L_W_
        l_y_ = L_y_
        linear: "f32[2, 7, 37]" = torch._C._nn.linear(l_x_, l_w_);  l_x_ = l_w_ = None
        logits: "f32[2, 7, 37]" = linear.float();  linear = None
        view: "f32[14, 37]" = logits.view(-1, 37)
        view_1: "i64[14]" = l_y_.view(-1);  l_y_ = None
        ce: "f32[]" = torch.nn.functional.cross_entropy(view, view_1);  view = view_1 = None
        logsumexp: "f32[2, 7]" = torch.logsumexp(logits, dim = -1);  logits = None
        pow_1: "f32[2, 7]" = logsumexp.pow(2);  logsumexp = None
        mean: "f32[]" = pow_1.mean();  pow_1 = None
        mul: "f32[]" = 0.01 * mean;  mean = None
        add: "f32[]" = ce + mul;  ce = mul = None
        return (add,)
# --- after the pass ---
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 7, 16]", L_W_: "f32[37, 16]", L_y_: "i64[2, 7]"):
        l_x_ = L_x_
        l_w_ = L_W_
        l_y_ = L_y_
        view_1: "i64[14]" = l_y_.view(-1);  l_y_ = None
        reshape: "f32[14, 16]" = l_x_.reshape([-1, 16])
        linear_ce_fwd_default = torch.ops.inductor_xent.linear_ce_fwd.default(reshape, l_w_, None, view_1, -100, 0.0, 1.0, None, 0.0);  reshape = l_w_ = None
        getitem: "f32[14]" = linear_ce_fwd_default[0]
        getitem_1: "f32[14]" = linear_ce_fwd_default[1];  linear_ce_fwd_default = None
        ne: "b8[14]" = view_1 != -100;  view_1 = None
        sum_1: "i64[]" = ne.sum();  ne = None
        sum_2: "f32[]" = getitem.sum();  getitem = None
        truediv: "f32[]" = sum_2 / sum_1;  sum_2 = sum_1 = None
        size = l_x_.size();  l_x_ = None
        getitem_2 = size[slice(None, -1, None)];  size = None
        view_2: "f32[2, 7]" = getitem_1.view(getitem_2);  getitem_1 = getitem_2 = None
        pow_1: "f32[2, 7]" = view_2.pow(2);  view_2 = None
        mean: "f32[]" = pow_1.mean();  pow_1 = None
        mul: "f32[]" = 0.01 * mean;  mean = None
        add: "f32[]" = truediv + mul;  truediv = mul = None
        return (add,)
""")

    def test_store(self):
        """The store strategy forced: one op returns the reduced loss (its gradients computed in the
        same pass); the division by num_items_in_batch stays the graph's."""
        options = {"xent.strategy": "store", "xent.store_budget": "1GiB"}
        self.assertExpectedInline(before_after(SPELLINGS["hf_causal_lm"][0], leaves(make_inputs()), **options), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 7, 16]", L_W_: "f32[37, 16]", L_y_: "i64[2, 7]", L_n_: "i64[]"):
        l_x_ = L_x_
        l_w_ = L_W_
        l_y_ = L_y_
        l_n_ = L_n_
        linear: "f32[2, 7, 37]" = torch._C._nn.linear(l_x_, l_w_);  l_x_ = l_w_ = None
        logits: "f32[2, 7, 37]" = linear.float();  linear = None
        labels: "i64[2, 8]" = torch._C._nn.pad(l_y_, (0, 1), 'constant', -100);  l_y_ = None
        getitem: "i64[2, 7]" = labels[(Ellipsis, slice(1, None, None))];  labels = None
        shift: "i64[2, 7]" = getitem.contiguous();  getitem = None
        view: "f32[14, 37]" = logits.view(-1, 37);  logits = None
        view_1: "i64[14]" = shift.view(-1);  shift = None
        to: "i64[14]" = view_1.to(device(type='cpu'));  view_1 = None
        loss: "f32[]" = torch.nn.functional.cross_entropy(view, to, ignore_index = -100, reduction = 'sum');  view = to = None
        truediv: "f32[]" = loss / l_n_;  loss = l_n_ = None
        return (truediv,)
# --- after the pass ---
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 7, 16]", L_W_: "f32[37, 16]", L_y_: "i64[2, 7]", L_n_: "i64[]"):
        l_x_ = L_x_
        l_w_ = L_W_
        l_y_ = L_y_
        l_n_ = L_n_
        labels: "i64[2, 8]" = torch._C._nn.pad(l_y_, (0, 1), 'constant', -100);  l_y_ = None
        getitem: "i64[2, 7]" = labels[(Ellipsis, slice(1, None, None))];  labels = None
        shift: "i64[2, 7]" = getitem.contiguous();  getitem = None
        view_1: "i64[14]" = shift.view(-1);  shift = None
        to: "i64[14]" = view_1.to(device(type='cpu'));  view_1 = None
        reshape: "f32[14, 16]" = l_x_.reshape([-1, 16]);  l_x_ = None
        linear_ce_store_default = torch.ops.inductor_xent.linear_ce_store.default(reshape, l_w_, None, to, -100, 0.0, 1.0, None, 0.0, 'sum', 0, '1GiB', True, True, False);  reshape = l_w_ = to = None
        getitem_1: "f32[]" = linear_ce_store_default[0];  linear_ce_store_default = None
        truediv: "f32[]" = getitem_1 / l_n_;  getitem_1 = l_n_ = None
        return (truediv,)
""")

    def test_targets_hoisted_above_the_op(self):
        self.assertExpectedInline(before_after(_z_loss_late_targets), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 7, 16]", L_W_: "f32[37, 16]", L_y_: "i64[2, 7]"):
        l_x_ = L_x_
        l_w_ = L_W_
        l_y_ = L_y_
        linear: "f32[2, 7, 37]" = torch._C._nn.linear(l_x_, l_w_);  l_x_ = l_w_ = None
        float_1: "f32[2, 7, 37]" = linear.float();  linear = None
        z: "f32[14, 37]" = float_1.view(-1, 37);  float_1 = None
        lse: "f32[14]" = torch.logsumexp(z, -1)
        pad: "i64[2, 8]" = torch._C._nn.pad(l_y_, (0, 1), 'constant', -100);  l_y_ = None
        getitem: "i64[2, 7]" = pad[(slice(None, None, None), slice(1, None, None))];  pad = None
        t: "i64[14]" = getitem.reshape(-1);  getitem = None
        cross_entropy: "f32[]" = torch.nn.functional.cross_entropy(z, t);  z = t = None
        pow_1: "f32[14]" = lse.pow(2);  lse = None
        mean: "f32[]" = pow_1.mean();  pow_1 = None
        mul: "f32[]" = 0.01 * mean;  mean = None
        add: "f32[]" = cross_entropy + mul;  cross_entropy = mul = None
        return (add,)
# --- after the pass ---
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 7, 16]", L_W_: "f32[37, 16]", L_y_: "i64[2, 7]"):
        l_x_ = L_x_
        l_w_ = L_W_
        l_y_ = L_y_
        pad: "i64[2, 8]" = torch._C._nn.pad(l_y_, (0, 1), 'constant', -100);  l_y_ = None
        getitem: "i64[2, 7]" = pad[(slice(None, None, None), slice(1, None, None))];  pad = None
        t: "i64[14]" = getitem.reshape(-1);  getitem = None
        reshape_1: "f32[14, 16]" = l_x_.reshape([-1, 16]);  l_x_ = None
        linear_ce_fwd_default = torch.ops.inductor_xent.linear_ce_fwd.default(reshape_1, l_w_, None, t, -100, 0.0, 1.0, None, 0.0);  reshape_1 = l_w_ = None
        getitem_1: "f32[14]" = linear_ce_fwd_default[0]
        getitem_2: "f32[14]" = linear_ce_fwd_default[1];  linear_ce_fwd_default = None
        ne: "b8[14]" = t != -100;  t = None
        sum_1: "i64[]" = ne.sum();  ne = None
        sum_2: "f32[]" = getitem_1.sum();  getitem_1 = None
        truediv: "f32[]" = sum_2 / sum_1;  sum_2 = sum_1 = None
        pow_1: "f32[14]" = getitem_2.pow(2);  getitem_2 = None
        mean: "f32[]" = pow_1.mean();  pow_1 = None
        mul: "f32[]" = 0.01 * mean;  mean = None
        add: "f32[]" = truediv + mul;  truediv = mul = None
        return (add,)
""")

    def test_vocab_scale_folded_into_the_weight(self):
        """Dory's per-vocabulary scale ``logits * s``: the op gets ``W * s[:, None]``, no logit scale."""
        self.assertExpectedInline(before_after(SPELLINGS["vocab_scale"][0]), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 7, 16]", L_W_: "f32[37, 16]", L_b_: "f32[37]", L_y_: "i64[2, 7]"):
        l_x_ = L_x_
        l_w_ = L_W_
        l_b_ = L_b_
        l_y_ = L_y_
        linear: "f32[2, 7, 37]" = torch._C._nn.linear(l_x_, l_w_);  l_x_ = l_w_ = None
        float_1: "f32[2, 7, 37]" = linear.float();  linear = None
        mul: "f32[2, 7, 37]" = float_1 * l_b_;  float_1 = l_b_ = None
        view: "f32[14, 37]" = mul.view(-1, 37);  mul = None
        view_1: "i64[14]" = l_y_.view(-1);  l_y_ = None
        cross_entropy: "f32[]" = torch.nn.functional.cross_entropy(view, view_1);  view = view_1 = None
        return (cross_entropy,)
# --- after the pass ---
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 7, 16]", L_W_: "f32[37, 16]", L_b_: "f32[37]", L_y_: "i64[2, 7]"):
        l_x_ = L_x_
        l_w_ = L_W_
        l_b_ = L_b_
        l_y_ = L_y_
        reshape_1: "f32[37, 1]" = l_b_.reshape((-1, 1));  l_b_ = None
        mul_1: "f32[37, 16]" = l_w_ * reshape_1;  l_w_ = reshape_1 = None
        view_1: "i64[14]" = l_y_.view(-1);  l_y_ = None
        reshape: "f32[14, 16]" = l_x_.reshape([-1, 16]);  l_x_ = None
        linear_ce_fwd_default = torch.ops.inductor_xent.linear_ce_fwd.default(reshape, mul_1, None, view_1, -100, 0.0, 1.0, None, 0.0, skip_ignored = True);  reshape = mul_1 = None
        getitem: "f32[14]" = linear_ce_fwd_default[0]
        getitem_1: "f32[14]" = linear_ce_fwd_default[1];  linear_ce_fwd_default = getitem_1 = None
        ne: "b8[14]" = view_1 != -100;  view_1 = None
        sum_1: "i64[]" = ne.sum();  ne = None
        sum_2: "f32[]" = getitem.sum();  getitem = None
        truediv: "f32[]" = sum_2 / sum_1;  sum_2 = sum_1 = None
        return (truediv,)
""")

    def test_leading_permutation(self):
        """ProphetNet's ``logits.transpose(0, 1)``: the permutation moves onto the hidden states."""
        self.assertExpectedInline(before_after(SPELLINGS["prophetnet_transpose"][0]), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 7, 16]", L_W_: "f32[37, 16]", L_y_: "i64[2, 7]"):
        l_x_ = L_x_
        l_w_ = L_W_
        l_y_ = L_y_
        linear: "f32[2, 7, 37]" = torch._C._nn.linear(l_x_, l_w_);  l_x_ = l_w_ = None
        transpose: "f32[7, 2, 37]" = linear.transpose(0, 1);  linear = None
        z: "f32[7, 2, 37]" = transpose.contiguous();  transpose = None
        view: "f32[14, 37]" = z.view(-1, 37);  z = None
        lp: "f32[14, 37]" = torch.nn.functional.log_softmax(view, dim = -1, dtype = torch.float32);  view = None
        transpose_1: "i64[7, 2]" = l_y_.transpose(0, 1);  l_y_ = None
        reshape: "i64[14]" = transpose_1.reshape(-1);  transpose_1 = None
        nll_loss: "f32[]" = torch.nn.functional.nll_loss(lp, reshape);  lp = reshape = None
        return (nll_loss,)
# --- after the pass ---
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 7, 16]", L_W_: "f32[37, 16]", L_y_: "i64[2, 7]"):
        l_x_ = L_x_
        l_w_ = L_W_
        l_y_ = L_y_
        transpose_1: "i64[7, 2]" = l_y_.transpose(0, 1);  l_y_ = None
        reshape: "i64[14]" = transpose_1.reshape(-1);  transpose_1 = None
        permute: "f32[7, 2, 16]" = l_x_.permute((1, 0, 2));  l_x_ = None
        reshape_1: "f32[14, 16]" = permute.reshape([-1, 16]);  permute = None
        linear_ce_fwd_default = torch.ops.inductor_xent.linear_ce_fwd.default(reshape_1, l_w_, None, reshape, -100, 0.0, 1.0, None, 0.0, skip_ignored = True);  reshape_1 = l_w_ = None
        getitem: "f32[14]" = linear_ce_fwd_default[0]
        getitem_1: "f32[14]" = linear_ce_fwd_default[1];  linear_ce_fwd_default = getitem_1 = None
        ne: "b8[14]" = reshape != -100;  reshape = None
        sum_1: "i64[]" = ne.sum();  ne = None
        sum_2: "f32[]" = getitem.sum();  getitem = None
        truediv: "f32[]" = sum_2 / sum_1;  sum_2 = sum_1 = None
        return (truediv,)
""")


def test_pass_is_idempotent_and_lints():
    """Running the pass again on a rewritten graph finds nothing more."""
    fn, _ = SPELLINGS["hf_causal_lm"]
    rec = Recorder()
    torch.compile(fn, backend=rec)(**make_inputs())
    gm = rec.graphs[0]
    assert patterns.run(gm) == []
    gm.graph.lint()


def test_internal_error_declines_instead_of_failing(monkeypatch):
    """A bug in an idiom's analysis must not break the user's compile: the site is left alone."""
    from inductor_xent.patterns import lm_head_cross_entropy

    def broken(node):
        if node.target is F.cross_entropy:
            raise RuntimeError("boom")
        return None

    monkeypatch.setattr(lm_head_cross_entropy, "match", broken)
    fn, _ = SPELLINGS["linear_view_mean"]
    rec = Recorder()
    ins = make_inputs()
    torch.testing.assert_close(torch.compile(fn, backend=rec)(**ins), fn(**ins))
    assert rec.code_after[0] == rec.code_before[0]
    assert counters["inductor_xent"]["sites_declined"] == 1


# ---------------------------------------------------------------------------------------------
# "in any combination": a fixed random sample of (matmul, logits transform, cast, slice, loss,
# z-loss) combinations, each fused exactly once and exact
# ---------------------------------------------------------------------------------------------
def _matmul(kind, x, W, Wdv, b):
    if kind == "linear":
        return F.linear(x, W)
    if kind == "linear_bias":
        return F.linear(x, W, b)
    if kind == "matmul_T_bias_add":
        return x @ W.T + b
    if kind == "mm_view":
        return torch.mm(x.reshape(-1, D), W.t()).view(x.shape[0], x.shape[1], V)
    if kind == "einsum":
        return torch.einsum("btd,vd->btv", x, W)
    return torch.matmul(x, Wdv)  # [D, V] weight


def _transform(kind, z):
    if kind == "scale":
        return z * 0.7
    if kind == "softcap":
        return torch.tanh(z / 5.0) * 5.0
    if kind == "scale_softcap":
        return torch.tanh((z / 2.0) / 5.0) * 5.0
    return z


def _loss(kind, z, t, tv):
    if kind == "ce_mean":
        return F.cross_entropy(z.reshape(-1, V), t.reshape(-1))
    if kind == "ce_sum_smoothing":
        return F.cross_entropy(z.reshape(-1, V), t.reshape(-1), reduction="sum", label_smoothing=0.1)
    if kind == "ce_none_masked":
        mask = (t != -100).reshape(-1)
        return (F.cross_entropy(z.reshape(-1, V), t.reshape(-1), reduction="none") * mask).sum() / mask.sum()
    if kind == "ce_transposed":
        return F.cross_entropy(z.transpose(1, 2), t)
    if kind == "nll":
        return F.nll_loss(F.log_softmax(z, -1).reshape(-1, V), t.reshape(-1))
    if kind == "lse_gather":
        return (torch.logsumexp(z, -1) - z.gather(-1, tv[..., None]).squeeze(-1)).mean()
    if kind == "one_hot":
        return -(F.one_hot(tv, V) * F.log_softmax(z, -1)).sum(-1).mean()
    return -(z.log_softmax(-1).gather(-1, tv[..., None])).mean()  # logprob_gather


_AXES = dict(
    matmul=["linear", "linear_bias", "matmul_T_bias_add", "mm_view", "einsum", "weight_dv"],
    transform=["none", "scale", "softcap", "scale_softcap"],
    cast=[False, True],
    slice_seq=[False, True],
    loss=["ce_mean", "ce_sum_smoothing", "ce_none_masked", "ce_transposed", "nll", "lse_gather", "one_hot",
          "logprob_gather"],
    z_loss=[False, True],
)
_ALL = [dict(zip(_AXES, values)) for values in itertools.product(*_AXES.values())]
COMBOS = random.Random(0).sample(_ALL, 24)


def _combination(combo):
    def fn(x, W, Wdv, b, y, yv, **_):
        z = _transform(combo["transform"], _matmul(combo["matmul"], x, W, Wdv, b))
        t, tv = y, yv
        if combo["slice_seq"]:
            z, t, tv = z[:, :-1], y[:, 1:], yv[:, 1:]
        if combo["cast"]:
            z = z.float()
        loss = _loss(combo["loss"], z, t, tv)
        if combo["z_loss"]:
            loss = loss + 1e-2 * torch.logsumexp(z, -1).pow(2).mean()
        return loss
    return fn


@pytest.mark.parametrize("combo", COMBOS[:6], ids=lambda c: "-".join(str(v) for v in c.values()))
def test_combinations_dynamic_true(combo):
    """dynamic=True: every size symbolic, the weight's D and V included; two batch sizes."""
    fn = _combination(combo)
    frames = []
    for enable in (True, False):
        torch._dynamo.reset()
        counters.clear()
        backend = counting(Recorder(**{"xent.enable": enable}))
        compiled = torch.compile(fn, backend=backend, dynamic=True)
        for batch in (2, 3):
            ins = make_inputs(batch=batch, seed=batch)
            torch.testing.assert_close(compiled(**ins), fn(**ins), rtol=1e-5, atol=1e-5)
        frames.append(backend.frame_count)
        if enable:
            assert counters["inductor_xent"]["sites_fused"] == frames[0] and fused_ops(backend.backend.after[0]) == 1
    assert frames[0] == frames[1]


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_combinations(combo):
    fn = _combination(combo)
    rec = Recorder()
    assert_parity(fn, make_inputs(), rec, what=str(combo))
    assert fused_ops(rec.after[0]) == 1
    assert sources(rec.after[0]) == []
    assert counters["inductor_xent"]["sites_fused"] == 1 and counters["inductor_xent"]["sites_declined"] == 0


def test_call_module_linear_declines_with_reason():
    """torch 2.11 with inline_inbuilt_nn_modules=False shows nn.Linear as call_module: declined
    with what to change (simulated with symbolic_trace plus fake example values)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(D, V)

        def forward(self, x, y):
            return F.cross_entropy(self.lm_head(x).float().view(-1, V), y.view(-1))

    gm = torch.fx.symbolic_trace(M())
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    ins = make_inputs()
    FakeTensorProp(gm, mode).propagate(mode.from_tensor(ins["x"]), mode.from_tensor(ins["y"]))
    for node in gm.graph.nodes:
        node.meta["example_value"] = node.meta.get("val")
    before = printout(gm)
    (site,) = patterns.run(gm)
    assert not site.fused and "inline_inbuilt_nn_modules" in site.reason
    assert printout(gm) == before
