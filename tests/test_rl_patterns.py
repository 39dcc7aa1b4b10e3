"""The pass on the spellings RL code writes: per-token log-probabilities of the sampled tokens at a
temperature, the entropy, token accuracy, and several of them over one lm_head (one op call). For
each: the graph (the op, exact site counts and head names, no [N, V] tensor in AOTAutograd's forward
and backward graphs), values and gradients for random upstream gradients against eager in float64,
float32 and bfloat16 within torch's own error; a GRPO step compiled with backend="inductor_xent";
what declines, with its reason.
"""

from __future__ import annotations

import expecttest
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import AotEagerAndRecordGraphs
from torch._dynamo.utils import counters

import inductor_xent
from inductor_xent import ops, patterns

from .helpers import (
    Recorder,
    V,
    assert_all_smaller,
    assert_within_torch_error,
    before_after,
    counting,
    fused_ops,
    logits_sized,
    make_inputs,
    sources,
    targets,
)
from .rl import check_grpo, eager_log_probs, grpo_batch, grpo_loss, grpo_problem

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

TEMP = 0.7  # a sampling temperature (a Python number: folded into the op's scale)


def _up(z):
    """``z.float()`` as models upcast their logits, float64 kept: the float64 run is the reference."""
    return z if z.dtype == torch.float64 else z.float()


# ---------------------------------------------------------------------------------------------
# spellings: name -> (fn(**_inputs()) -> tuple of outputs, explain's head, the op, which outputs
# are predictions (compared exactly, no gradient)); each fn names the inputs it reads (x, W, b, y,
# yv), the others go to ``**_``. y has ignore_index (-100) rows, yv not.
# ---------------------------------------------------------------------------------------------
def _gather_log_softmax(x, W, yv, **_):
    """torch.gather(F.log_softmax(logits / T, -1), -1, ids.unsqueeze(-1)).squeeze(-1)"""
    z = _up(F.linear(x, W))
    return (torch.gather(F.log_softmax(z / TEMP, -1), -1, yv.unsqueeze(-1)).squeeze(-1),)


def _method_gather(x, W, b, yv, **_):
    """The method spelling, bias, logits in the matmul dtype."""
    return ((F.linear(x, W, b) / TEMP).log_softmax(-1).gather(-1, yv[..., None]).squeeze(-1),)


def _neg_cross_entropy(x, W, y, **_):
    """-F.cross_entropy(reduction="none"): ignored rows are 0, as eager's."""
    z = _up(F.linear(x, W)) / TEMP
    return (-F.cross_entropy(z.view(-1, V), y.view(-1), reduction="none"),)


def _gather_minus_lse(x, W, b, yv, **_):
    z = _up(F.linear(x, W, b))
    return (z.gather(-1, yv[..., None]).squeeze(-1) - torch.logsumexp(z, -1),)


def _trl_fp32(x, W, yv, **_):
    """TRL's selective_log_softmax for fp32 logits: the logsumexp row by row, stacked."""
    logits = _up(F.linear(x, W)) / TEMP
    selected = torch.gather(logits, dim=-1, index=yv.unsqueeze(-1)).squeeze(-1)
    return (selected - torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits]),)


def _categorical(x, W, b, yv, **_):
    dist = torch.distributions.Categorical(logits=F.linear(x, W, b) / TEMP)
    return dist.log_prob(yv), dist.entropy()


def _verl_entropy(x, W, **_):
    """verl's entropy_from_logits: logsumexp minus the expected logit."""
    z = _up(F.linear(x, W))
    return (torch.logsumexp(z, dim=-1) - torch.sum(F.softmax(z, dim=-1) * z, dim=-1),)


def _p_log_p(x, W, b, **_):
    z = F.linear(x, W, b)
    return (-(F.softmax(z, -1) * F.log_softmax(z, -1)).sum(-1),)


def _log_probs_entropy(x, W, yv, **_):
    """Both from one log_softmax at T, p = logp.exp(): verl / OpenRLHF's actor."""
    logp = F.log_softmax(_up(F.linear(x, W)) / TEMP, dim=-1)
    return logp.gather(-1, yv.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _verl_actor(x, W, b, y, **_):
    """-cross_entropy(reduction="none") and verl's entropy of the same logits."""
    z = _up(F.linear(x, W, b)) / TEMP
    log_probs = -F.cross_entropy(z.view(-1, V), y.view(-1), reduction="none").view(y.shape)
    return log_probs, torch.logsumexp(z, dim=-1) - torch.sum(F.softmax(z, dim=-1) * z, dim=-1)


def _accuracy(x, W, y, **_):
    """Masked token accuracy from the argmax."""
    mask = y != -100
    return (((F.linear(x, W).argmax(-1) == y) & mask).float().sum() / mask.sum(),)


def _all_three(x, W, yv, **_):
    """Log-probs and entropy at T, accuracy of the argmax before T (the same argmax), a z-loss on
    the lse of the same logits: one op call."""
    z = _up(F.linear(x, W))
    zt = z / TEMP
    logp = zt.log_softmax(-1)
    lp = logp.gather(-1, yv[..., None]).squeeze(-1)
    entropy = -(F.softmax(zt, -1) * logp).sum(-1, keepdim=True)
    accuracy = (z.argmax(-1) == yv).float().mean()
    return lp, entropy, accuracy, torch.logsumexp(zt, -1).square()


def _argmax_first(x, W, b, yv, **_):
    """The accuracy first in the graph, of the logits before the temperature; the targets of the
    log-probs computed after the entropy (the op, placed before its first head, hoists them)."""
    z = F.linear(x, W, b)
    accuracy = (z.argmax(-1) == yv).float().mean()
    logp = (z / TEMP).log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return accuracy, entropy, logp.gather(-1, (yv + 0).unsqueeze(-1)).squeeze(-1)


def _sft_and_entropy(x, W, b, y, **_):
    """An SFT loss (mean, ignore_index) and the entropy of every row logged next to it: the
    ignored rows keep their entropy."""
    z = _up(F.linear(x, W, b))
    loss = F.cross_entropy(z.view(-1, V), y.view(-1))
    logp = z.log_softmax(-1)
    return loss, -(logp.exp() * logp).sum(-1)


def _softcap_temperature(x, W, yv, **_):
    """Gemma 2's softcap in the model, the temperature in the RL code."""
    z = _up(torch.tanh(F.linear(x, W) / 3.0) * 3.0) / TEMP
    logp = z.log_softmax(-1)
    return logp.gather(-1, yv[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1), z.argmax(-1, keepdim=True)


def _entropy_no_grad(x, W, yv, **_):
    """TRL's GRPO: the entropy logged under no_grad, the log-probs trained; one op runs with gradient,
    its entropy detached (eager's has no gradient)."""
    logp = F.log_softmax(F.linear(x, W) / TEMP, -1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, yv[..., None]), entropy


def _entropy_no_grad_in_loss(x, W, yv, **_):
    """The no_grad entropy added to the trained value: its gradient must not reach x or W."""
    z = _up(F.linear(x, W))
    logp = z.log_softmax(-1)
    lp = logp.gather(-1, yv[..., None]).squeeze(-1)
    with torch.no_grad():
        entropy = torch.logsumexp(z, -1) - (F.softmax(z, -1) * z).sum(-1)
    return (lp + 0.5 * entropy,)


def _accuracy_no_grad(x, W, b, y, **_):
    """An SFT loss and TRL's token accuracy under no_grad (argmax, masked by the labels)."""
    z = _up(F.linear(x, W, b))
    loss = F.cross_entropy(z.view(-1, V), y.view(-1), ignore_index=-100)
    with torch.no_grad():
        mask = y != -100
        accuracy = ((z.argmax(-1) == y) & mask).sum() / mask.sum()
    return loss, accuracy


def _lse_no_grad(x, W, y, **_):
    """A z-loss trained, the logsumexp also logged under no_grad."""
    z = _up(F.linear(x, W))
    loss = F.cross_entropy(z.view(-1, V), y.view(-1)) + 1e-4 * torch.logsumexp(z, -1).square().mean()
    with torch.no_grad():
        logged = torch.logsumexp(z, -1).mean()
    return loss, logged


def _temperature_made_under_no_grad(x, W, yv, **_):
    """The per-row temperature computed inside the no_grad block that holds the first head: the op
    stays inside the block, after it (not before the block, where the temperature does not exist)."""
    z = F.linear(x, W)
    with torch.no_grad():
        zt = z / torch.full_like(yv, 2, dtype=z.dtype)[..., None]
        entropy = -(zt.softmax(-1) * zt.log_softmax(-1)).sum(-1)
    return entropy, zt.log_softmax(-1).gather(-1, yv[..., None])


FWD, LP = ops.FORWARD, ops.LOGPROB_FORWARD
SPELLINGS = {
    "gather_log_softmax": (_gather_log_softmax, "log_probs", FWD, ()),
    "method_gather_bias": (_method_gather, "log_probs", FWD, ()),
    "neg_cross_entropy_none": (_neg_cross_entropy, "cross_entropy", FWD, ()),
    "gather_minus_logsumexp": (_gather_minus_lse, "log_probs", FWD, ()),
    "trl_fp32_stacked_logsumexp": (_trl_fp32, "log_probs", FWD, ()),
    "categorical": (_categorical, "log_probs+entropy", LP, ()),
    "verl_entropy": (_verl_entropy, "entropy", LP, ()),
    "p_log_p": (_p_log_p, "entropy", LP, ()),
    "log_probs_entropy": (_log_probs_entropy, "log_probs+entropy", LP, ()),
    "verl_actor": (_verl_actor, "cross_entropy+entropy", LP, ()),
    "accuracy": (_accuracy, "argmax", LP, (0,)),
    "all_three_and_z_loss": (_all_three, "log_probs+entropy+argmax", LP, (2,)),
    "argmax_first": (_argmax_first, "log_probs+entropy+argmax", LP, (0,)),
    "sft_and_entropy": (_sft_and_entropy, "cross_entropy+entropy", LP, ()),
    "softcap_temperature": (_softcap_temperature, "log_probs+entropy+argmax", LP, (2,)),
    "entropy_under_no_grad": (_entropy_no_grad, "log_probs+entropy", LP, ()),
    "entropy_no_grad_in_loss": (_entropy_no_grad_in_loss, "log_probs+entropy", LP, ()),
    "accuracy_under_no_grad": (_accuracy_no_grad, "cross_entropy+argmax", LP, (1,)),
    "logsumexp_logged_under_no_grad": (_lse_no_grad, "cross_entropy", FWD, ()),
    "temperature_made_under_no_grad": (_temperature_made_under_no_grad, "log_probs+entropy", LP, ()),
}


def _inputs(dtype=torch.float32, seed=0):
    ins = make_inputs(dtype, seed)
    return {k: ins[k] for k in ("x", "W", "b", "y", "yv")}


def _run(fn, ins, backend=None, autocast=None):
    """fn's outputs and the gradients of sum(out * g) (g random, one per differentiable output)
    with respect to x, W and b; compiled with ``backend`` when given; the forward under
    ``torch.autocast("cpu", autocast)`` when given."""
    leaves = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in ins.items()}
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        outs = (torch.compile(fn, backend=backend) if backend else fn)(**leaves)
    g = torch.Generator().manual_seed(1)
    upstream = [(o * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype)).sum()
                for o in outs if o.requires_grad]
    params = [leaves[k] for k in ("x", "W", "b")]
    grads = torch.autograd.grad(sum(upstream), params, allow_unused=True) if upstream else [None] * 3
    return [o.detach() for o in outs], [torch.zeros_like(p) if gr is None else gr for p, gr in zip(params, grads)]


# ---------------------------------------------------------------------------------------------
# fused: the graph
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_fuses_into_one_op_call(name):
    fn, head, op, _ = SPELLINGS[name]
    rec = Recorder()
    torch.compile(fn, backend=rec)(**_inputs())
    assert len(rec.before) == 1, "one graph, no graph break"
    assert sources(rec.before[0]), "the source ops are in the graph before the pass"
    assert fused_ops(rec.after[0]) == 1 and rec.after[0].count(op) == 1
    assert sources(rec.after[0]) == [], f"source ops left after the pass: {sources(rec.after[0])}"
    assert counters["inductor_xent"]["sites_fused"] == 1 and counters["inductor_xent"]["sites_declined"] == 0
    report = inductor_xent.explain(fn, **_inputs())
    assert [(s.fused, s.head) for s in report.sites] == [(True, head)], str(report)
    assert head in str(report)


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_no_logits_in_aot_graphs(name):
    """The Dynamo graph holds [N, V] tensors; AOTAutograd's forward and backward graphs after the
    rewrite hold none: the partitioner saves no logits, the backward is our op's."""
    fn, _, op, _ = SPELLINGS[name]
    aot, dynamo = AotEagerAndRecordGraphs(), []

    def backend(gm, example_inputs):
        dynamo.extend(logits_sized([gm]))
        patterns.run(gm)
        return aot(gm, example_inputs)

    outs = torch.compile(fn, backend=backend)(**{k: v.requires_grad_(v.is_floating_point())
                                                 for k, v in _inputs().items()})
    assert dynamo, "the check finds the logits of the unfused graph"
    trained = [o.sum() for o in outs if o.requires_grad]
    if trained:
        sum(trained).backward()
    assert logits_sized(aot.fw_graphs + aot.bw_graphs) == []
    assert op in targets(aot.fw_graphs[0])
    backward = ops.BACKWARD if op is FWD else ops.LOGPROB_BACKWARD
    assert [backward in targets(g) for g in aot.bw_graphs] == [True] * bool(trained)


class TestPrintouts(expecttest.TestCase):
    """The graph before and after the pass (EXPECTTEST_ACCEPT=1 re-accepts; review the diff)."""

    def test_log_probs_and_entropy(self):
        """Two heads of one log_softmax at T: one log-probs op with the entropy, the temperature in
        its logit scale; the log-probs viewed as the gather's [B, T, 1], the entropy as the rows'."""
        self.assertExpectedInline(before_after(_log_probs_entropy, _inputs()), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 7, 16]", L_W_: "f32[37, 16]", L_yv_: "i64[2, 7]"):
        l_x_ = L_x_
        l_w_ = L_W_
        l_yv_ = L_yv_
        linear: "f32[2, 7, 37]" = torch._C._nn.linear(l_x_, l_w_);  l_x_ = l_w_ = None
        float_1: "f32[2, 7, 37]" = linear.float();  linear = None
        truediv: "f32[2, 7, 37]" = float_1 / 0.7;  float_1 = None
        logp: "f32[2, 7, 37]" = torch.nn.functional.log_softmax(truediv, dim = -1);  truediv = None
        unsqueeze: "i64[2, 7, 1]" = l_yv_.unsqueeze(-1);  l_yv_ = None
        gather: "f32[2, 7, 1]" = logp.gather(-1, unsqueeze);  unsqueeze = None
        squeeze: "f32[2, 7]" = gather.squeeze(-1);  gather = None
        exp: "f32[2, 7, 37]" = logp.exp()
        mul: "f32[2, 7, 37]" = exp * logp;  exp = logp = None
        sum_1: "f32[2, 7]" = mul.sum(-1);  mul = None
        neg: "f32[2, 7]" = -sum_1;  sum_1 = None
        return (squeeze, neg)
# --- after the pass ---
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 7, 16]", L_W_: "f32[37, 16]", L_yv_: "i64[2, 7]"):
        l_x_ = L_x_
        l_w_ = L_W_
        l_yv_ = L_yv_
        unsqueeze: "i64[2, 7, 1]" = l_yv_.unsqueeze(-1);  l_yv_ = None
        flatten: "f32[14, 16]" = l_x_.flatten(0, -2)
        reshape: "i64[14]" = unsqueeze.reshape(-1)
        linear_logprob_fwd_default = torch.ops.inductor_xent.linear_logprob_fwd.default(flatten, l_w_, None, reshape, -2147483648, 1.4285714285714286, None, True, False);  flatten = l_w_ = reshape = None
        getitem: "f32[14]" = linear_logprob_fwd_default[0]
        view_as: "f32[2, 7, 1]" = getitem.view_as(unsqueeze);  getitem = unsqueeze = None
        getitem_1: "f32[14]" = linear_logprob_fwd_default[1];  linear_logprob_fwd_default = None
        size = l_x_.size();  l_x_ = None
        getitem_2 = size[slice(None, -1, None)];  size = None
        view: "f32[2, 7]" = getitem_1.view(getitem_2);  getitem_1 = getitem_2 = None
        squeeze: "f32[2, 7]" = view_as.squeeze(-1);  view_as = None
        return (squeeze, view)
""")


# ---------------------------------------------------------------------------------------------
# fused: the numbers
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_values_and_gradients_within_torch_error(name, dtype):
    """Every output and the gradients w.r.t. hidden, weight and bias for random upstream gradients,
    against float64 eager, within a multiple of eager's own error in ``dtype``; predictions
    (argmax) equal float64 eager's."""
    fn, _, _, predictions = SPELLINGS[name]
    ins = _inputs(dtype)
    rec = Recorder()
    ours, ours_g = _run(fn, ins, rec)
    same, same_g = _run(fn, ins)
    exact, exact_g = _run(fn, {k: v.double() if v.is_floating_point() else v for k, v in ins.items()})
    assert fused_ops(rec.after[0]) == 1
    floor = 1e-10 if dtype == torch.float64 else 1e-6
    for i, (a, s, e) in enumerate(zip(ours, same, exact)):
        assert a.dtype == s.dtype and a.shape == s.shape, f"output {i}: {a.dtype}{tuple(a.shape)}"
        if i in predictions:
            assert torch.equal(a.double(), e.double()), f"output {i}: {a} != {e}"
        else:
            assert_within_torch_error(a, s, e, floor=floor, what=f"{name} output {i}")
    for what, a, s, e in zip(("x", "W", "b"), ours_g, same_g, exact_g):
        assert a.dtype == s.dtype
        assert_within_torch_error(a, s, e, floor=floor, what=f"{name} grad {what}")


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_under_autocast_within_torch_error(name):
    """Under ``torch.autocast`` (bf16) with fp32 parameters, as RL trainers run: every head fuses
    into one op call from the bf16 casts of the operands, every output and gradient within a
    multiple of eager autocast's error from float64 on those values (the inputs are bf16-representable,
    so float64 on them is what autocast computes exactly); argmax equal to float64's."""
    fn, _, _, predictions = SPELLINGS[name]
    ins = {k: v.bfloat16().float() if v.is_floating_point() else v for k, v in _inputs().items()}
    rec = Recorder()
    ours, ours_g = _run(fn, ins, rec, autocast=torch.bfloat16)
    same, same_g = _run(fn, ins, autocast=torch.bfloat16)
    exact, exact_g = _run(fn, {k: v.double() if v.is_floating_point() else v for k, v in ins.items()})
    assert fused_ops(rec.after[0]) == 1 and counters["inductor_xent"]["sites_declined"] == 0
    floor = torch.finfo(torch.bfloat16).eps / 8  # outputs autocast leaves in bf16 (a logsumexp on CPU)
    for i, (a, s, e) in enumerate(zip(ours, same, exact)):
        assert a.dtype == s.dtype and a.shape == s.shape, f"output {i}: {a.dtype}{tuple(a.shape)}"
        if i in predictions:
            assert torch.equal(a.double(), e.double()), f"output {i}: {a} != {e}"
        else:
            assert_within_torch_error(a, s, e, floor=floor, what=f"{name} output {i}")
    for what, a, s, e in zip(("x", "W", "b"), ours_g, same_g, exact_g):
        assert a.dtype == s.dtype == torch.float32
        assert_within_torch_error(a, s, e, floor=1e-6, what=f"{name} grad {what}")


@pytest.mark.parametrize("name", ["entropy_under_no_grad", "entropy_no_grad_in_loss", "accuracy_under_no_grad",
                                  "logsumexp_logged_under_no_grad", "temperature_made_under_no_grad"])
def test_heads_under_no_grad_carry_no_gradient(name):
    """A head computed inside ``torch.no_grad()`` next to trained ones: the op runs with gradient
    (before the block, where the lm_head is), and each output carries a gradient exactly where eager's
    does (the no_grad heads' values are detached)."""
    fn = SPELLINGS[name][0]
    ins = {k: v.requires_grad_(v.is_floating_point()) for k, v in _inputs().items()}
    rec = Recorder()
    got, want = torch.compile(fn, backend=rec)(**ins), fn(**ins)
    assert fused_ops(rec.after[0]) == 1 and counters["inductor_xent"]["sites_declined"] == 0
    assert [o.requires_grad for o in got] == [o.requires_grad for o in want]
    assert "_set_grad_enabled" in rec.code_after[0], "the no_grad block stays around what it held"
    (site,) = inductor_xent.explain(fn, **ins).sites
    assert "heads inside a grad-mode switch (torch.no_grad()) without gradient" in site.reason, site.reason


def test_logits_under_no_grad_scaled_by_a_trained_parameter_decline():
    """Logits computed under ``torch.no_grad()``, then a loss trained through a learnable temperature
    (a 0-d parameter): the op would run in the matmul's mode, without gradient, and lose the
    temperature's. The site declines and says why; the graph is eager's, the gradient too."""
    ins = _inputs()
    x, W, y = ins["x"].requires_grad_(), ins["W"], ins["yv"]
    t = torch.tensor(1.3, requires_grad=True)

    def fn(x, W, y, t):
        with torch.no_grad():
            logits = F.linear(x, W)
        return F.cross_entropy((logits * t).flatten(0, -2), y.flatten(), ignore_index=-100)

    (site,) = inductor_xent.explain(fn, x, W, y, t).sites
    assert not site.fused and "the grad mode changes between the lm_head matmul and a head that trains" in site.reason
    rec = Recorder()
    got = torch.compile(fn, backend=rec)(x, W, y, t)
    assert fused_ops(rec.after[0]) == 0
    want = fn(x, W, y, t)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got, t)[0], torch.autograd.grad(want, t)[0])


def test_ignored_rows_keep_their_entropy():
    """A cross-entropy with ignore_index next to an entropy: one log-probs op that ignores no row,
    so the entropy of an ignored row is eager's (not 0), and its cross-entropy row is 0."""
    ins = _inputs()
    (lp, ent), _ = _run(_verl_actor, ins, Recorder())
    ignored = ins["y"] == -100
    assert ignored.any() and torch.all(lp[ignored] == 0) and torch.all(ent[ignored] > 0.1)
    torch.testing.assert_close(ent, _verl_actor(**ins)[1])


def test_targets_out_of_range_raise_like_eager():
    """A target outside [0, V) (not an ignore_index): eager's gather raises on CPU, so does the op."""
    ins = _inputs()
    ins["yv"][0, 2] = V
    with pytest.raises(RuntimeError, match="out of bounds"):
        _log_probs_entropy(**ins)
    with pytest.raises(ValueError, match=rf"target values \[{V}\] are outside \[0, {V}\)"):
        torch.compile(_log_probs_entropy, backend=Recorder())(**ins)
    assert counters["inductor_xent"]["sites_fused"] == 1


@pytest.mark.parametrize("name", ["all_three_and_z_loss", "verl_entropy", "categorical"])
def test_dynamic_batch_no_extra_recompiles(name):
    """Automatic dynamic on the batch: frames compiled as without the pass, every one fused, values
    exact on each size (the op's rows and the head shapes are read in the graph, not guarded)."""
    fn = SPELLINGS[name][0]
    counts = []
    for enable in (True, False):
        torch._dynamo.reset()
        counters.clear()
        backend = counting(Recorder(**{"xent.enable": enable}))
        compiled = torch.compile(fn, backend=backend)
        for batch in (2, 3, 4):
            ins = make_inputs(batch=batch, seed=batch)
            ins = {k: ins[k] for k in ("x", "W", "b", "y", "yv")}
            for a, e in zip(compiled(**ins), fn(**ins)):
                torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)
        counts.append((backend.frame_count, counters["inductor_xent"]["sites_fused"]))
    assert counts == [(2, 2), (2, 0)], "static first, then one dynamic recompile; both fused"


def test_real_inductor_compiles_the_rewrite():
    """Inductor (not aot_eager) compiles a rewritten graph with every head: same numbers."""
    fn = SPELLINGS["all_three_and_z_loss"][0]
    ins = _inputs()
    ours, ours_g = _run(fn, ins, Recorder(**{"xent.inner": "inductor"}))
    same, same_g = _run(fn, ins)
    assert counters["inductor_xent"]["sites_fused"] == 1
    for a, s in zip(ours + ours_g, same + same_g):
        torch.testing.assert_close(a, s, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# a GRPO step in plain torch, compiled
# ---------------------------------------------------------------------------------------------
def _grpo_step(h, w, y, old, ref, advantages, mask):
    """verl / TRL's actor loss from the model's logits: log-probs and entropy at the sampling
    temperature (rl.eager_log_probs), the clipped surrogate, a k3 KL penalty, an entropy bonus,
    the response mask; and the token accuracy logged next to it."""
    lp, ent, argmax = eager_log_probs(h, w, y, temperature=TEMP)
    loss = grpo_loss(lp, ent, old, ref, advantages, mask)
    return loss, ((argmax == y) & mask).sum() / mask.sum()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_grpo_log_probs_fused_and_exact(dtype):
    """rl.check_grpo on the eager log-probs / entropy spelling compiled with our pass."""
    h, w, y, batch = grpo_problem(dtype)
    kw = dict(temperature=TEMP)
    rec = Recorder()
    check_grpo(torch.compile(lambda hh, ww: eager_log_probs(hh, ww, y, **kw)[:2], backend=rec), h, w, y, kw, batch,
               k=4.0, floor=1e-12 if dtype == torch.float64 else 1e-6)
    assert [fused_ops(t) for t in rec.after] == [1]
    assert counters["inductor_xent"]["sites_declined"] == 0


def _whole_step_problem(seed, bsz=2, seq=11, d=16, v=97):
    """(hidden, weight, the step's other arguments) of _grpo_step: a rollout's log-probs, offsets, advantages, mask."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(bsz, seq, d, generator=g, requires_grad=True)
    w = (torch.randn(v, d, generator=g) * (3 / d**0.5)).requires_grad_()
    y = torch.randint(0, v, (bsz, seq), generator=g)
    batch = grpo_batch(bsz, seq, seed=seed + 1)
    with torch.no_grad():
        rollout = eager_log_probs(h, w, y, temperature=TEMP)[0]
    return h, w, (y, rollout + batch["old_offset"], rollout + batch["ref_offset"], batch["advantages"], batch["mask"])


def _check_whole_step(h, w, args, **options):
    """_grpo_step compiled with the pass (``options`` its strategy knobs) then AOTAutograd's graphs
    recorded: loss, accuracy and gradients as eager's. Returns (the recorder, the pass's sites)."""
    aot, sites = AotEagerAndRecordGraphs(), []

    def backend(gm, example_inputs):
        sites.extend(patterns.run(gm, **options))
        return aot(gm, example_inputs)

    loss, acc = torch.compile(_grpo_step, backend=backend)(h, w, *args)
    got = torch.autograd.grad(loss, (h, w))
    want_loss, want_acc = _grpo_step(h, w, *args)
    torch.testing.assert_close(loss, want_loss)
    assert torch.equal(acc, want_acc)
    for a, b in zip(got, torch.autograd.grad(want_loss, (h, w))):
        torch.testing.assert_close(a, b)
    return aot, sites


def test_grpo_step_compiled_whole():
    """The whole step compiled: one log-probs op for log-probs, entropy and accuracy; loss,
    accuracy and gradients as eager's; no [N, V] tensor in AOTAutograd's graphs."""
    bsz, seq, v = 2, 11, 97
    h, w, args = _whole_step_problem(3)
    aot, _ = _check_whole_step(h, w, args)
    assert counters["inductor_xent"]["sites_fused"] == 1
    assert [targets(gr).count(ops.LOGPROB_FORWARD) for gr in aot.fw_graphs] == [1]
    assert_all_smaller(aot.fw_graphs + aot.bw_graphs, bsz * seq * v)


@pytest.mark.parametrize("impl", [
    pytest.param("triton", marks=pytest.mark.skipif(torch.cuda.is_available(), reason=(
        "CPU tensors run the Triton kernels only interpreted (no GPU); on a GPU test_gpu_kernels runs the store "
        "op"))),
    "chunked"])
def test_grpo_step_compiled_whole_store(impl, monkeypatch):
    """The same step with strategy store (issue 24): the log-probs op keeps the exp-logits of every
    row (the Triton kernels, interpreted) or nothing (the chunked path) and the backward is its store
    backward op; loss, accuracy and gradients as eager's."""
    monkeypatch.setenv("INDUCTOR_XENT_IMPL", impl)
    h, w, args = _whole_step_problem(5)
    aot, sites = _check_whole_step(h, w, args, strategy="store", store_budget="1GiB")
    (site,) = sites
    assert site.strategy == "store" and "exp-logits of 22 of 22 rows" in site.strategy_reason, site
    assert [targets(gr).count(ops.LOGPROB_STORE) for gr in aot.fw_graphs] == [1]
    assert [targets(gr).count(ops.LOGPROB_STORE_BACKWARD) for gr in aot.bw_graphs] == [1]


def _lp_entropy_at_temp(x, W, yv):
    logp = F.log_softmax(F.linear(x, W).float() / TEMP, -1)
    return torch.gather(logp, -1, yv[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


@pytest.mark.slow(s=30)
def test_rl_site_under_the_backend_gives_the_functional_apis_bits(monkeypatch):
    """The RL head (log-probs and entropy at a temperature, every row) with the log-prob op's store:
    the pass's site (no ignored row, so no row compaction; its backward writes dz over the exp-logits
    autograd donates) and ``linear_log_probs`` (which compacts the rows) give the same bits, values
    and gradients. Their in-place backwards ran different GEMMs before (cuBLAS's against rows_mm's:
    bench rl's pass 5 ms slower than the API on an H100, its weight gradient other bits). The Triton
    kernels run interpreted on CPU tensors."""
    from inductor_xent.templates import launch

    monkeypatch.setenv("INDUCTOR_XENT_IMPL", "triton")
    monkeypatch.setenv("INDUCTOR_XENT_STRATEGY", "store")
    monkeypatch.setenv("INDUCTOR_XENT_STORE_BUDGET", "1GiB")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(41)
    n, d, v = 128, 64, 300
    x = torch.randn(n, d, generator=g).to(device, torch.bfloat16)
    W = (torch.randn(v, d, generator=g) / d**0.5).to(device, torch.bfloat16)
    yv = torch.randint(0, v, (n,), generator=g).to(device)
    ups = [torch.randn(n, generator=g).to(device) for _ in range(2)]
    seen, real = [], launch.log_probs_store_backward

    def spy(*args, **kw):
        seen.append((kw["in_place"], kw["compacted"]))
        return real(*args, **kw)

    monkeypatch.setattr(launch, "log_probs_store_backward", spy)

    def results(fn):
        xr, Wr = x.clone().requires_grad_(), W.clone().requires_grad_()
        lp, ent = fn(xr, Wr, yv)
        return (lp.detach(), ent.detach(), *torch.autograd.grad((lp, ent), (xr, Wr), ups))

    def api(xr, Wr, yv):
        out = inductor_xent.linear_log_probs(xr, Wr, yv, temperature=TEMP, entropy=True)
        return out.log_probs, out.entropy

    fused = counters["inductor_xent"]["sites_fused"]
    compiled = results(torch.compile(_lp_entropy_at_temp, backend="inductor_xent"))
    assert counters["inductor_xent"]["sites_fused"] == fused + 1
    want = results(api)
    assert seen == [(True, False), (True, True)], seen  # both in place; the API's rows compacted
    for name, a, b in zip(("log_probs", "entropy", "grad_hidden", "grad_weight"), compiled, want):
        assert torch.equal(a, b), name


# ---------------------------------------------------------------------------------------------
# declines: the graph untouched, eager's numbers, the reason
# ---------------------------------------------------------------------------------------------
def _tensor_temperature(x, W, yv, **_):
    return (F.log_softmax(F.linear(x, W) / torch.tensor(TEMP), -1).gather(-1, yv[..., None]),)


def _softmax_over_time(x, W, **_):
    z = F.linear(x, W)
    return (-(F.softmax(z, 1) * F.log_softmax(z, 1)).sum(1),)


def _log_softmax_over_time(x, W, yv, **_):
    return (F.log_softmax(F.linear(x, W), 1).gather(-1, yv[..., None]),)


def _log_of_softmax(x, W, **_):
    p = F.softmax(F.linear(x, W), -1)
    return (-(p * torch.log(p)).sum(-1),)


def _in_place_temperature(x, W, yv, **_):
    z = F.linear(x, W)
    z.div_(TEMP)
    return (z.log_softmax(-1).gather(-1, yv[..., None]),)


def _two_temperatures(x, W, yv, **_):
    """The entropy at T = 1 and the log-probs at T: two different sets of logits."""
    z = F.linear(x, W)
    logp = F.log_softmax(z, -1)
    return (z / TEMP).log_softmax(-1).gather(-1, yv[..., None]), -(logp.exp() * logp).sum(-1)



def _trl_bf16_loop(x, W, yv, **_):
    """TRL's selective_log_softmax for bf16 logits: log_softmax row by row, stacked."""
    out = []
    for row_logits, row_ids in zip(F.linear(x, W) / TEMP, yv):
        out.append(F.log_softmax(row_logits, -1).gather(-1, row_ids.unsqueeze(-1)).squeeze(-1))
    return (torch.stack(out),)


def _smoothing_and_entropy(x, W, y, **_):
    z = F.linear(x, W)
    logp = z.log_softmax(-1)
    return F.cross_entropy(z.view(-1, V), y.view(-1), label_smoothing=0.1), -(logp.exp() * logp).sum(-1)


def _smoothing_and_rows(x, W, y, **_):
    """A smoothed loss and the plain per-row cross-entropy of the same logits: one op has one smoothing."""
    z = F.linear(x, W).view(-1, V)
    return F.cross_entropy(z, y.view(-1), label_smoothing=0.1), F.cross_entropy(z, y.view(-1), reduction="none")


def _two_targets(x, W, yv, **_):
    logp = F.linear(x, W).log_softmax(-1)
    return logp.gather(-1, yv[..., None]), -(logp.exp() * logp).sum(-1), logp.gather(-1, yv.flip(0)[..., None])


def _argmax_of_negated(x, W, yv, **_):
    """Log-probs of z * -1 / T (a negative scale) next to z.argmax: not the op's argmax."""
    z = F.linear(x, W)
    return (z * -1.0 / TEMP).log_softmax(-1).gather(-1, yv[..., None]), (z.argmax(-1) == yv).float().mean()


def _stacked_out_of_order(x, W, yv, **_):
    """The rows' logsumexps stacked in another order than the rows: not the logsumexp of the logits
    (no site at all: the gather of raw logits is none)."""
    z = F.linear(x, W)
    lse = torch.stack([torch.logsumexp(row, -1) for row in reversed(list(z))])
    return (z.gather(-1, yv[..., None]).squeeze(-1) - lse,)


# name -> (fn, words of the reason, sites declined)
DECLINES = {
    "argmax_of_negated_logits": (_argmax_of_negated, "read different logits", 1),
    "stacked_logsumexp_out_of_order": (_stacked_out_of_order, "", 0),
    "temperature_tensor": (_tensor_temperature, "not one factor per row", 1),
    "softmax_over_time": (_softmax_over_time, "softmax / log_softmax over dim 1, not the vocabulary", 1),
    "log_softmax_over_time": (_log_softmax_over_time, "log_softmax over dim 1, not the vocabulary", 1),
    "log_of_softmax": (_log_of_softmax, "torch.log of a softmax", 1),
    "in_place_temperature": (_in_place_temperature, "Tensor.div_ writes", 1),
    "two_temperatures": (_two_temperatures, "read different logits", 1),
    "label_smoothing_and_entropy": (_smoothing_and_entropy, "label smoothing in a cross-entropy next to", 1),
    "label_smoothing_and_rows": (_smoothing_and_rows, "label smoothing in a cross-entropy next to", 1),
    "two_targets": (_two_targets, "read different targets", 1),
}


@pytest.mark.parametrize("name", sorted(DECLINES))
def test_declines_with_reason(name):
    fn, words, n = DECLINES[name]
    rec = Recorder()
    ins = _inputs()
    got, want = _run(fn, ins, rec), _run(fn, ins)
    assert fused_ops(rec.after[0]) == 0
    assert rec.code_after[0] == rec.code_before[0], "a declined site leaves the graph untouched"
    for a, e in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(a, e)
    assert counters["inductor_xent"]["sites_declined"] == n and counters["inductor_xent"]["sites_fused"] == 0
    report = inductor_xent.explain(fn, **ins)
    assert [s.fused for s in report.sites] == [False] * n
    assert all(words in s.reason for s in report.sites), str(report)
