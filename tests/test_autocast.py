"""Mixed precision: sites under ``torch.autocast``, the way HF Trainer(bf16=True), accelerate,
Lightning's "bf16-mixed" and nanoGPT train. Autocast leaves no node at the matmul (the Dynamo graph
reads ``linear(h, W)`` of fp32 tensors whose example value is bf16); the pass casts the op's
operands to that dtype, as autocast would, and the loss is computed in fp32 as autocast's fp32 list
does for ``cross_entropy``.

The numbers: the inputs hold values that autocast's dtype represents exactly (``autocast_representable``),
so float64 eager on them is what autocast computes with exact arithmetic, and the loss and every
gradient must be within a multiple of eager autocast's own error from it (the project's rule). On
inputs that are not representable, float64 on the operands rounded as autocast rounds them
(``autocast_exact(..., rounded_to=)``) is far closer to the op (fp32 logits) than to eager autocast (bf16
logits): an op that skipped autocast's casts would miss that bound.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import inductor_xent
from inductor_xent import ops

from .helpers import (
    MATMUL_OPERANDS,
    SPELLINGS,
    Recorder,
    V,
    assert_within_torch_error,
    autocast_exact,
    autocast_loss_and_grads,
    autocast_representable,
    fused_ops,
    leaves,
    make_inputs,
    rel_err,
)

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

# every spelling fuses under autocast except a bias added after the matmul: autocast does not cast
# the add, so the logits are fp32 from a bf16 matmul plus an fp32 bias (declined: "mixed dtypes")
FUSED = sorted(set(SPELLINGS) - {"bias_add"})
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", FUSED)
def test_spelling_fuses_under_autocast_within_torch_error(name, dtype):
    fn, pattern = SPELLINGS[name]
    inputs = autocast_representable(make_inputs(), dtype)
    rec = Recorder()
    ours, ours_g = autocast_loss_and_grads(fn, leaves(inputs), autocast=dtype, backend=rec)
    same, same_g = autocast_loss_and_grads(fn, leaves(inputs), autocast=dtype)
    exact, exact_g = autocast_exact(fn, inputs)
    assert fused_ops(rec.after[0]) == 1, rec.code_after[0]
    assert counters["inductor_xent"][f"fused.{pattern}"] == 1 and counters["inductor_xent"]["sites_declined"] == 0
    assert ours.dtype == same.dtype
    # a loss with terms autocast leaves in its dtype (a logsumexp and its square summed in bf16/fp16 on
    # CPU, a bf16 product by a tensor scale) is exact to a fraction of that dtype's epsilon only: both
    # eager's rounding and ours land anywhere within it (test_op_computes_from_autocast_rounded_operands
    # has the tight bound, on spellings whose loss is fp32 from the logits on)
    assert_within_torch_error(ours, same, exact, floor=torch.finfo(dtype).eps / 8, what=f"{name} loss")
    assert set(ours_g) == set(same_g)
    for k in same_g:
        assert ours_g[k].dtype == same_g[k].dtype == inputs[k].dtype
        assert_within_torch_error(ours_g[k], same_g[k], exact_g[k], what=f"{name} grad {k}")


@pytest.mark.parametrize("name", ["linear_view_mean", "hf_causal_lm", "softcap", "nll_log_softmax", "z_loss",
                                  "linear_bias_float_sum"])
def test_op_computes_from_autocast_rounded_operands(name):
    """Against float64 on the operands autocast hands the matmul (x, W and a linear's bias rounded to
    bf16), the op is exact to fp32 (it keeps fp32 logits) where eager autocast is not (it rounds the
    logits to bf16): the op computes from the cast operands, not from the fp32 ones."""
    fn, _ = SPELLINGS[name]
    inputs = make_inputs()
    names = (*MATMUL_OPERANDS, "b") if name == "linear_bias_float_sum" else MATMUL_OPERANDS
    exact, _ = autocast_exact(fn, inputs, torch.bfloat16, names)
    ours, _ = autocast_loss_and_grads(fn, leaves(inputs), autocast=torch.bfloat16, backend=Recorder())
    same, _ = autocast_loss_and_grads(fn, leaves(inputs), autocast=torch.bfloat16)
    assert rel_err(ours, exact) < 1e-5 and rel_err(ours, exact) < rel_err(same, exact) / 10


def test_op_receives_autocast_dtype():
    """The op's hidden states and weight are bf16 casts of the fp32 parameters (in the graph after the
    pass), and the gradients reach the fp32 leaves in fp32."""
    fn, _ = SPELLINGS["linear_bias_float_sum"]
    rec = Recorder()
    ins = leaves(make_inputs())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.compile(fn, backend=rec)(**ins)
    loss.backward()
    (op,) = [n for n in rec.graphs[0].graph.nodes if n.target is ops.FORWARD]
    hidden, weight, bias = op.args[:3]
    assert [a.meta["example_value"].dtype for a in (hidden, weight, bias)] == [torch.bfloat16] * 3
    assert loss.dtype == torch.float32 and all(ins[k].grad.dtype == torch.float32 for k in ("x", "W", "b"))


def test_autocast_entered_inside_the_compiled_function():
    """``with torch.autocast(...)`` inside the function: Dynamo records enter/exit nodes around the
    lm_head; the op, placed before the loss after the region, gets the casts all the same."""
    def fn(x, W, b, y, **_):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = F.linear(x, W, b)
        return F.cross_entropy(logits.float().view(-1, V), y.view(-1))

    inputs = autocast_representable(make_inputs(), torch.bfloat16)
    rec = Recorder()
    ours, ours_g = autocast_loss_and_grads(fn, leaves(inputs), backend=rec)
    same, same_g = autocast_loss_and_grads(fn, leaves(inputs))
    exact, exact_g = autocast_exact(fn, inputs)
    assert fused_ops(rec.after[0]) == 1
    assert any("autocast" in str(t) for t in rec.after[0]), "the region's nodes stay"
    assert_within_torch_error(ours, same, exact, what="loss")
    for k in same_g:
        assert_within_torch_error(ours_g[k], same_g[k], exact_g[k], what=f"grad {k}")


def test_autocast_disabled_around_the_head():
    """An fp32 head inside an autocast region (``torch.autocast(..., enabled=False)`` around the
    lm_head, as models that keep their head in fp32 write it): no cast, fp32 exactness."""
    def fn(x, W, y, **_):
        with torch.autocast("cpu", enabled=False):
            logits = F.linear(x.float(), W.float())
        return F.cross_entropy(logits.view(-1, V), y.view(-1))

    inputs = make_inputs()
    rec = Recorder()
    ours, ours_g = autocast_loss_and_grads(fn, leaves(inputs), autocast=torch.bfloat16, backend=rec)
    exact, exact_g = autocast_exact(fn, inputs)
    assert fused_ops(rec.after[0]) == 1
    (op,) = [n for n in rec.graphs[0].graph.nodes if n.target is ops.FORWARD]
    assert op.args[0].meta["example_value"].dtype == torch.float32
    assert rel_err(ours, exact) < 1e-6
    for k in exact_g:
        assert rel_err(ours_g[k], exact_g[k]) < 1e-5, k


def test_bias_added_after_the_matmul_declines_under_autocast():
    fn, _ = SPELLINGS["bias_add"]
    inputs = make_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = inductor_xent.explain(fn, **leaves(inputs))
    assert [s.fused for s in report.sites] == [False]
    assert "mixed dtypes" in report.sites[0].reason and "added after the matmul" in report.sites[0].reason


@pytest.mark.parametrize("strategy", ["recompute", "store"])
def test_both_strategies_under_autocast(strategy):
    """store computes the gradients in the forward from the bf16 operands; recompute in the backward."""
    fn, _ = SPELLINGS["hf_causal_lm"]
    inputs = autocast_representable(make_inputs(), torch.bfloat16)
    rec = Recorder(**{"xent.strategy": strategy, "xent.store_budget": "1GiB"})
    ours, ours_g = autocast_loss_and_grads(fn, leaves(inputs), autocast=torch.bfloat16, backend=rec)
    same, same_g = autocast_loss_and_grads(fn, leaves(inputs), autocast=torch.bfloat16)
    exact, exact_g = autocast_exact(fn, inputs)
    op = ops.STORE if strategy == "store" else ops.FORWARD
    assert rec.after[0].count(op) == 1
    assert_within_torch_error(ours, same, exact, what="loss")
    for k in same_g:
        assert_within_torch_error(ours_g[k], same_g[k], exact_g[k], what=f"grad {k}")


def test_functional_api_follows_autocast():
    """``linear_cross_entropy`` / ``linear_log_probs`` called inside ``torch.autocast`` compute from
    the operands autocast would give ``F.linear`` (bf16 here), as the eager spelling does."""
    inputs = make_inputs()
    x, W, y = inputs["x"], inputs["W"], inputs["y"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = inductor_xent.linear_cross_entropy(x, W, y)
        lp = inductor_xent.linear_log_probs(x, W, inputs["yv"]).log_probs
    ref = inductor_xent.linear_cross_entropy(x.bfloat16(), W.bfloat16(), y)
    ref_lp = inductor_xent.linear_log_probs(x.bfloat16(), W.bfloat16(), inputs["yv"]).log_probs
    assert torch.equal(ours, ref) and torch.equal(lp, ref_lp)
    assert rel_err(ours, inductor_xent.linear_cross_entropy(x, W, y)) > 1e-5  # not the fp32 result


def test_functional_api_takes_bf16_activations_with_fp32_weights():
    """The mixed-precision training case: bf16 hidden states (a bf16 trunk under autocast) and an fp32
    master weight and bias. Inside ``torch.autocast`` that is one dtype after autocast's casts, as for
    ``F.linear``; the functional API gives the bf16 operands' values and the weight and bias their
    fp32 gradients. Outside autocast the dtypes differ and it says so."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, 16, generator=g).bfloat16().requires_grad_()
    W = torch.randn(40, 16, generator=g).requires_grad_()
    b = torch.randn(40, generator=g).requires_grad_()
    y = torch.randint(0, 40, (12,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = inductor_xent.linear_cross_entropy(x, W, y, bias=b)
        lp = inductor_xent.linear_log_probs(x, W, y, bias=b).log_probs
    grads = torch.autograd.grad(loss, (x, W, b))
    xr, Wr, br = (t.detach().bfloat16().requires_grad_() for t in (x, W, b))
    ref = inductor_xent.linear_cross_entropy(xr, Wr, y, bias=br)
    ref_lp = inductor_xent.linear_log_probs(xr, Wr, y, bias=br).log_probs
    ref_grads = torch.autograd.grad(ref, (xr, Wr, br))
    assert torch.equal(loss, ref) and torch.equal(lp, ref_lp)
    assert [t.dtype for t in grads] == [torch.bfloat16, torch.float32, torch.float32]
    for a, r in zip(grads, ref_grads):
        assert torch.equal(a, r.to(a.dtype))
    with pytest.raises(TypeError, match=r"weight.dtype \(torch.float32\) must equal hidden.dtype"):
        inductor_xent.linear_cross_entropy(x, W, y)



@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA")
@pytest.mark.parametrize("strategy", ["recompute", "store"])
def test_cuda_autocast_through_inductor(strategy):
    """On the GPU, the Triton kernels under ``torch.autocast("cuda", bfloat16)`` with fp32 parameters,
    compiled by Inductor: the op gets bf16 operands; loss and gradients within eager autocast's error."""
    g = torch.Generator(device="cuda").manual_seed(0)
    n, d, v = 1000, 256, 4099  # unaligned rows and vocabulary
    hidden = torch.randn(n, d, device="cuda", generator=g).bfloat16().float()
    weight = (torch.randn(v, d, device="cuda", generator=g) * (3 / d**0.5)).bfloat16().float()
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    y[::7] = -100

    def fn(h, w, y):
        return F.cross_entropy(F.linear(h, w).float(), y)

    ins = {"h": hidden, "w": weight, "y": y}
    rec = Recorder(**{"xent.inner": "inductor", "xent.strategy": strategy, "xent.store_budget": "1GiB"})
    ours, ours_g = autocast_loss_and_grads(fn, leaves(ins), autocast=torch.bfloat16, backend=rec)
    same, same_g = autocast_loss_and_grads(fn, leaves(ins), autocast=torch.bfloat16)
    exact, exact_g = autocast_exact(fn, ins)
    assert rec.after[0].count(ops.STORE if strategy == "store" else ops.FORWARD) == 1
    assert_within_torch_error(ours, same, exact, what="loss")
    for k in same_g:
        assert ours_g[k].dtype == torch.float32
        assert_within_torch_error(ours_g[k], same_g[k], exact_g[k], what=f"grad {k}")


def _rl_head(x, W, yv, adv, **_):
    """An actor's heads as RL code writes them: log-probs of the sampled tokens at a temperature and
    the entropy, weighted per token (advantages) and summed."""
    logp = F.log_softmax(F.linear(x, W).float() / 0.7, -1)
    lp = logp.gather(-1, yv[..., None]).squeeze(-1)
    return (lp * adv - 0.01 * (logp.exp() * logp).sum(-1)).sum()


@pytest.mark.parametrize("impl", [
    pytest.param("triton", marks=pytest.mark.skipif(torch.cuda.is_available(), reason=(
        "CPU tensors run the Triton kernels only interpreted (no GPU)"))),
    "chunked"])
def test_log_prob_store_under_autocast(impl, monkeypatch):
    """The log-prob op's store (issue 24) under autocast bf16 with fp32 parameters: the op gets the
    bf16 operands, keeps their exp-logits (the Triton kernels) or nothing (the chunked path), and the
    loss and both gradients are within eager autocast's error of float64."""
    monkeypatch.setenv("INDUCTOR_XENT_IMPL", impl)
    inputs = autocast_representable(make_inputs(), torch.bfloat16)
    ins = {k: inputs[k] for k in ("x", "W", "yv")}
    ins["adv"] = torch.randn(inputs["yv"].shape, generator=torch.Generator().manual_seed(3))
    rec = Recorder(**{"xent.strategy": "store", "xent.store_budget": "1GiB"})
    ours, ours_g = autocast_loss_and_grads(_rl_head, leaves(ins), autocast=torch.bfloat16, backend=rec)
    same, same_g = autocast_loss_and_grads(_rl_head, leaves(ins), autocast=torch.bfloat16)
    exact, exact_g = autocast_exact(_rl_head, ins)
    assert rec.after[0].count(ops.LOGPROB_STORE) == 1, rec.code_after[0]
    assert_within_torch_error(ours, same, exact, what="loss")
    for k in same_g:
        assert ours_g[k].dtype == torch.float32
        assert_within_torch_error(ours_g[k], same_g[k], exact_g[k], what=f"grad {k}")
