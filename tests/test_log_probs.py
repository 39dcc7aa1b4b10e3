"""``linear_log_probs`` on CPU (the chunked path): against the oracle and against eager PyTorch with
random upstream gradients, a GRPO loss, argmax ties, errors, memory, and torch.compile."""

import math
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import inductor_xent
from inductor_xent import config, fallback, reference
from inductor_xent.options import LossOptions

from .helpers import (
    LargestTensor,
    assert_all_smaller,
    assert_gradient_within_torch_error,
    assert_within_torch_error,
    case_inputs,
    fallback_chunks,
)
from .rl import check_grpo, eager_log_probs, grpo_batch, grpo_loss, grpo_problem


@st.composite
def cases(draw):
    n = draw(st.sampled_from([0, 1, 7, 13, 31, 64]))  # 0 (empty), 1, primes: no chunk lines up
    return dict(
        n=n,
        d=draw(st.sampled_from([1, 3, 17])),
        v=draw(st.sampled_from([1, 2, 31, 67])),  # 1: log-prob and entropy are 0
        dtype=draw(st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16])),
        bias=draw(st.booleans()),
        three_d=draw(st.booleans()) and n % 2 == 0 and n > 0,
        non_contiguous=draw(st.booleans()),
        ignore=draw(st.sampled_from(["none", "some", "all", "block"])),
        ignore_index=draw(st.sampled_from([-100, 0])),  # 0: a real class id that is ignored
        temperature=draw(st.sampled_from([1.0, 0.6, 1.7])),
        logit_scale=draw(st.sampled_from([1.0, 0.37])),
        softcap=draw(st.sampled_from([None, 1.5, 30.0])),  # 1.5 bites, 30 hardly
        chunk_bytes=draw(st.sampled_from([64, 8 * 2**20])),  # many chunks .. one chunk
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _kw(c):
    return {k: c[k] for k in ("temperature", "logit_scale", "softcap", "ignore_index")}


def assert_argmax_is_a_maximum(argmax, hidden, weight, bias, target, kw, *, rtol=1e-5):
    """Our argmax picks a column whose float64 logit is the row max up to rounding (an exact tie
    test is test_argmax_ties_take_the_first_column): a different pick means a wrong column."""
    z = reference.logits(hidden.detach().double().reshape(-1, hidden.shape[-1]), weight.detach().double(),
                         None if bias is None else bias.detach().double(),
                         LossOptions(kw["ignore_index"], 0.0, kw["logit_scale"], kw["softcap"], 0.0))
    top = z.amax(-1)
    picked = z.gather(-1, argmax.reshape(-1, 1)).squeeze(-1)
    assert torch.all(picked >= top - rtol * (1 + top.abs())), "argmax is not a row maximum"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
# found on the H200 box when the backward ran with other chunks than the forward (helpers.fallback_chunks)
@example(dict(n=7, d=3, v=31, dtype=torch.float32, bias=True, three_d=False, non_contiguous=True, ignore="none",
              ignore_index=-100, temperature=1.0, logit_scale=1.0, softcap=None, chunk_bytes=64, seed=0))
# found on an H100 (the bias gradient's rows cancel: _cancellation_floors)
@example(dict(n=13, d=1, v=2, dtype=torch.float32, bias=True, three_d=False, non_contiguous=False, ignore="some",
              ignore_index=0, temperature=1.7, logit_scale=0.37, softcap=1.5, chunk_bytes=64, seed=626719))
# found on an H100 (the Triton backward, V = 1: every exact gradient is 0)
@example(dict(n=7, d=17, v=1, dtype=torch.float32, bias=False, three_d=False, non_contiguous=False, ignore="block",
              ignore_index=-100, temperature=1.0, logit_scale=1.0, softcap=None, chunk_bytes=64, seed=34))
def test_matches_oracle_with_random_upstream_gradients(c):
    """log_probs, entropy and their gradients for per-token upstream gradients (advantages,
    masks) against float64, within a multiple of eager PyTorch's own error in the same dtype."""
    with fallback_chunks(c["chunk_bytes"]):  # the backward chunks as the forward did (helpers)
        _check_random_upstream_gradients(c)


def _check_random_upstream_gradients(c):
    h, w, b, y = case_inputs(c)
    params = [t for t in (h, w, b) if t is not None]
    ours = inductor_xent.linear_log_probs(h, w, y, bias=b, entropy=True, argmax=True, **_kw(c))
    up = [None if t is None else t.double() for t in (h, w, b)]
    exact = reference.linear_log_probs(up[0], up[1], y, bias=up[2], **_kw(c))
    same = eager_log_probs(h, w, y, bias=b, **_kw(c))
    cd = reference.compute_dtype(c["dtype"])
    assert ours.log_probs.dtype == ours.entropy.dtype == cd and ours.argmax.dtype == torch.long
    assert ours.log_probs.shape == ours.entropy.shape == ours.argmax.shape == y.shape
    valid = y != c["ignore_index"]
    assert torch.all(ours.log_probs[~valid] == 0) and torch.all(ours.entropy[~valid] == 0)
    if y.numel() == 0:
        return
    assert_argmax_is_a_maximum(ours.argmax, h, w, b, y, _kw(c))
    floor = 1e-12 if c["dtype"] == torch.float64 else 1e-6
    for name, a, s, e in zip(("log_probs", "entropy"), ours[:2], same[:2], exact[:2]):
        assert_within_torch_error(a, s, e, floor=floor, what=name)
    g = torch.Generator().manual_seed(c["seed"] + 1)
    g_lp, g_ent = torch.randn(y.shape, generator=g), torch.randn(y.shape, generator=g)

    def grads(lp, ent):
        return torch.autograd.grad((lp * g_lp.to(lp.dtype) + ent * g_ent.to(ent.dtype)).sum(), params)

    floors = _cancellation_floors(up, y, g_lp, g_ent, _kw(c), cd)
    for name, a, s, e in zip(("hidden", "weight", "bias"), grads(*ours[:2]), grads(*same[:2]), grads(*exact[:2])):
        assert a.dtype == s.dtype and a.shape == s.shape
        assert_gradient_within_torch_error(a, s, e, h, w, floor=max(floor, floors[name]), what=f"grad_{name}")


def _cancellation_floors(up, y, g_lp, g_ent, kw, cd) -> dict:
    """Each gradient is a sum over rows (weight, bias) or columns (hidden) of terms built from the
    exact per-row logit gradients dz; where those terms cancel, a few ulps of the compute dtype on
    their magnitudes is a large error relative to the small sum, whatever the order of summation (seen:
    the bias gradient of 13 rows, V = 2, the terms' magnitudes 35× the sum's; ours 1.96e-6 against
    eager's lucky 1.9e-7, 0.5 ulp of the terms). The floor: 8 ulps of the compute dtype on the terms'
    magnitudes, relative to the exact gradient's norm."""
    h64, w64, b64 = up
    v = w64.shape[0]
    rows = b64.detach().expand(y.numel(), v).clone() if b64 is not None else torch.zeros(y.numel(), v,
                                                                                           dtype=torch.float64)
    rows.requires_grad_()
    lp, ent, _ = reference.linear_log_probs(h64.detach(), w64.detach(), y, bias=rows, **kw)
    (dz,) = torch.autograd.grad((lp * g_lp.double() + ent * g_ent.double()).sum(), [rows])
    a, ha, wa = dz.abs(), h64.detach().reshape(-1, h64.shape[-1]).abs(), w64.detach().abs()
    eps = torch.finfo(cd).eps

    def floor(terms, exact):
        norm = exact.norm().item()
        return 0.0 if norm == 0 else 8 * eps * terms.norm().item() / norm

    return {"hidden": floor(a @ wa, dz @ w64.detach()), "weight": floor(a.t() @ ha, dz.t() @ h64.detach().reshape(
        -1, h64.shape[-1])), "bias": floor(a.sum(0), dz.sum(0))}


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("softcap", [None, 2.5])
def test_gradcheck_float64(bias, softcap, small_chunks):
    g = torch.Generator().manual_seed(3)
    h = torch.randn(9, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(13, 5, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(13, dtype=torch.float64, generator=g, requires_grad=True) if bias else None
    y = torch.randint(0, 13, (9,), generator=g)
    y[2] = -100

    def fn(h, w, b=None):
        out = inductor_xent.linear_log_probs(h, w, y, bias=b, temperature=0.7, logit_scale=0.8, softcap=softcap,
                                             entropy=True)
        return out.log_probs, out.entropy

    assert torch.autograd.gradcheck(fn, (h, w) + ((b,) if bias else ()))


def test_lse_output_gradient(small_chunks):
    """The op's lse output is differentiable too (as linear_ce_fwd's: a later pass may map a
    separate logsumexp of the same logits onto it)."""
    g = torch.Generator().manual_seed(4)
    h = torch.randn(11, 6, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(19, 6, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.randint(0, 19, (11,), generator=g)
    y[::2] = -100

    def fn(h, w):
        lp, ent, _, lse, _ = torch.ops.inductor_xent.linear_logprob_fwd(h, w, None, y, -100, 1.3, 2.0, True, False)
        return lp.sum() + (ent * torch.arange(11.0, dtype=torch.float64)).sum() + (lse**2).sum()

    assert torch.autograd.gradcheck(fn, (h, w))


# ---------------------------------------------------------------------------------------------
# a GRPO loss in plain torch on our per-token log-probabilities
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature, softcap", [(1.0, None), (0.7, 30.0)])  # Gemma-2's cap, sampled at 0.7
def test_grpo_loss_matches_eager(dtype, temperature, softcap):
    """The clipped surrogate with a KL penalty, an entropy bonus and a response mask, on
    [batch, seq] tokens: loss and gradients against float64, within a multiple of eager's error."""
    h, w, y, batch = grpo_problem(dtype)
    batch["mask"][1, 5] = False  # a token with a target that only the mask drops: no gradient either
    kw = dict(temperature=temperature, softcap=softcap)
    check_grpo(lambda hh, ww: inductor_xent.linear_log_probs(hh, ww, y, entropy=True, **kw)[:2], h, w, y, kw, batch,
               k=4.0, floor=1e-12 if dtype == torch.float64 else 1e-6)


# ---------------------------------------------------------------------------------------------
# argmax, ignored rows, edge cases
# ---------------------------------------------------------------------------------------------
def test_argmax_ties_take_the_first_column(small_chunks):
    """Exact ties (duplicated weight rows) resolve to the smallest index, as torch.argmax, across
    row chunks; token accuracy from it."""
    d, v = 4, 50
    w = torch.randn(v, d) * 0.01
    w[[7, 20, 41], 0] = 5.0  # rows with hidden e0: ties at 7, 20, 41
    w[[33, 34], 1] = 5.0  # rows with hidden e1: ties at 33, 34
    h = torch.zeros(6, d)
    h[:3, 0] = 1.0
    h[3:, 1] = 1.0
    y = torch.tensor([7, 20, -100, 34, 33, 0])
    out = inductor_xent.linear_log_probs(h, w, y, argmax=True, temperature=0.5)
    assert out.argmax.tolist() == [7, 7, 7, 33, 33, 33]
    assert out.argmax.tolist() == F.linear(h, w).argmax(-1).tolist()
    correct = (out.argmax == y) & (y != -100)
    assert correct.tolist() == [True, False, False, False, True, False]
    assert out.entropy is None


def test_ignored_rows_give_zero_and_no_gradient():
    g = torch.Generator().manual_seed(5)
    h = torch.randn(8, 6, generator=g, requires_grad=True)
    w = torch.randn(17, 6, generator=g, requires_grad=True)
    y = torch.randint(0, 17, (8,), generator=g)
    y[[1, 4, 5]] = -100
    out = inductor_xent.linear_log_probs(h, w, y, entropy=True)
    assert torch.all(out.log_probs[[1, 4, 5]] == 0) and torch.all(out.entropy[[1, 4, 5]] == 0)
    (out.log_probs * 3.0 + out.entropy * -2.0).sum().backward()
    assert torch.all(h.grad[[1, 4, 5]] == 0) and h.grad[[0, 2, 3, 6, 7]].abs().sum(-1).min() > 0


def test_one_class_and_uniform_logits():
    """V = 1: log-prob 0, entropy 0, zero gradients. Equal logits (all 2^24): log-prob −log V,
    entropy log V exactly (relative to the max: lse − Σp·z would cancel to 0 or 2 here), and a
    zero entropy gradient (dH/dz = −p·(log p + H) = 0 for a uniform p)."""
    h = torch.randn(5, 3, requires_grad=True)
    out = inductor_xent.linear_log_probs(h, torch.randn(1, 3), torch.zeros(5, dtype=torch.long), entropy=True)
    assert torch.all(out.log_probs == 0) and torch.all(out.entropy == 0)
    h1 = torch.ones(3, 1, requires_grad=True)
    w1 = torch.full((8, 1), 2.0**24, requires_grad=True)
    out = inductor_xent.linear_log_probs(h1, w1, torch.tensor([0, 3, 7]), entropy=True)
    torch.testing.assert_close(out.log_probs, torch.full((3,), -math.log(8)), rtol=1e-6, atol=0)
    torch.testing.assert_close(out.entropy, torch.full((3,), math.log(8)), rtol=1e-6, atol=0)
    gw, = torch.autograd.grad(out.entropy.sum(), w1)
    assert torch.all(gw == 0)


def test_peaked_distribution_entropy_is_as_accurate_as_eager():
    """One logit 30 above 63 others: H = 1.8e-10. lse − Σp·z (both 30 in fp32) gives 0; ours,
    relative to the max, is as accurate as eager's −Σ p·log p (both 3% off: fp32 cannot hold
    s = 1 + 6e-12, so the −p_max·log p_max part is lost by either)."""
    h = torch.tensor([[1.0]], dtype=torch.float32)
    w = torch.zeros(64, 1)
    w[5] = 30.0
    y = torch.tensor([5])
    ours = inductor_xent.linear_log_probs(h, w, y, entropy=True).entropy
    same = eager_log_probs(h, w, y)[1]
    exact = reference.linear_log_probs(h.double(), w.double(), y)[1]
    assert exact.item() > 1e-10 and ours.item() > 0.9 * exact.item()
    assert_within_torch_error(ours, same, exact, k=1.0, floor=0.0, what="entropy")


@pytest.mark.parametrize("shape", [(0,), (3, 0)])
def test_empty_input(shape):
    h = torch.randn(*shape, 4, requires_grad=True)
    out = inductor_xent.linear_log_probs(h, torch.randn(10, 4), torch.zeros(shape, dtype=torch.long), entropy=True,
                                         argmax=True)
    assert out.log_probs.shape == out.entropy.shape == out.argmax.shape == shape
    (out.log_probs.sum() + out.entropy.sum()).backward()
    assert h.grad.shape == h.shape


def test_unused_entropy_costs_no_entropy_term(monkeypatch):
    """entropy=True but only the log-probs reach the loss: the backward gets no entropy term."""
    seen = []
    real = fallback.backward
    monkeypatch.setattr(fallback, "backward", lambda *a, **k: seen.append(k["grad_entropy"]) or real(*a, **k))
    h = torch.randn(6, 4, requires_grad=True)
    out = inductor_xent.linear_log_probs(h, torch.randn(10, 4), torch.randint(0, 10, (6,)), entropy=True)
    out.log_probs.sum().backward()
    assert seen == [None]
    out = inductor_xent.linear_log_probs(h, torch.randn(10, 4), torch.randint(0, 10, (6,)), entropy=True)
    out.entropy.sum().backward()
    assert seen[1] is not None


def test_never_materialises_logits(monkeypatch):
    """Forward and backward (log-probs and entropy) never create more than one chunk of rows x V."""
    n, d, v = 512, 16, 4099
    monkeypatch.setattr(config, "fallback_chunk_bytes", 64 * v * 4)  # 64 rows of fp32 logits
    h = torch.randn(n, d, requires_grad=True)
    w = torch.randn(v, d, requires_grad=True)
    y = torch.randint(0, v, (n,))
    g = torch.randn(n)
    with LargestTensor() as mode:
        out = inductor_xent.linear_log_probs(h, w, y, softcap=5.0, temperature=0.9, entropy=True, argmax=True)
        (out.log_probs * g + 0.01 * out.entropy).sum().backward()
    assert mode.largest <= 64 * v, f"a tensor of {mode.largest} elements exists; one chunk is {64 * v}"


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------
H, W, Y = torch.randn(6, 4), torch.randn(10, 4), torch.tensor([1, 2, 3, -100, 9, 0])


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(temperature=0.0), ValueError, "temperature must be a finite number > 0, got 0.0"),
    (dict(temperature=-1.0), ValueError, "temperature must be a finite number > 0, got -1.0"),
    (dict(temperature=float("nan")), ValueError, "temperature must be a finite number > 0, got nan"),
    (dict(temperature=float("inf")), ValueError, "temperature must be a finite number > 0, got inf"),
    (dict(temperature="hot"), TypeError, "temperature must be a number, got str"),
    (dict(temperature=torch.tensor(1.0)), TypeError, "temperature must be a number, got Tensor"),
    (dict(entropy="yes"), TypeError, "entropy must be True or False, got 'yes'"),
    (dict(argmax=1), TypeError, "argmax must be True or False, got 1"),
    (dict(softcap=0.0), ValueError, "softcap must be None or a finite number > 0, got 0.0"),
    (dict(logit_scale=float("nan")), ValueError, "logit_scale must be finite, got nan"),
    (dict(target=torch.tensor([1, 2, 10, -100, 9, 0])), ValueError,
     "target values [10] are outside [0, 10) and are not ignore_index=-100"),
    (dict(target=torch.tensor([1, -5, 3, -100, 9, 0])), ValueError, "target values [-5] are outside [0, 10)"),
    (dict(target=torch.tensor([1, 2, 3])), ValueError, "target's shape (3,) must equal hidden's leading shape (6,)"),
    (dict(target=Y.float()), TypeError, "target must hold integer class ids, got dtype torch.float32"),
    (dict(bias=torch.randn(9)), ValueError, "bias must have shape (10,) [V], got (9,)"),
])
def test_errors_name_the_values(kwargs, error, message):
    args = dict(hidden=H, weight=W, target=Y)
    args.update(kwargs)
    positional = [args.pop(k) for k in ("hidden", "weight", "target")]
    with pytest.raises(error, match=re.escape(message)):
        inductor_xent.linear_log_probs(*positional, **args)


def test_backward_op_needs_entropy_with_its_gradient():
    h, w = H.clone(), W.clone()
    _, ent, _, lse, lse_lo = torch.ops.inductor_xent.linear_logprob_fwd(h, w, None, Y, -100, 1.0, None, True, False)
    with pytest.raises(ValueError, match="grad_entropy and entropy must both be tensors or both be None"):
        torch.ops.inductor_xent.linear_logprob_bwd(torch.ones(6), torch.ones(6), torch.zeros(6), h, w, None, Y, lse,
                                                   lse_lo, None, -100, 1.0, None, True, True, False)


# ---------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------
def _grpo_step(h, w, y, batch):
    out = inductor_xent.linear_log_probs(h, w, y, temperature=0.7, entropy=True, argmax=True)
    lp = out.log_probs
    loss = grpo_loss(lp, out.entropy, lp.detach() + batch["old_offset"], lp.detach() + batch["ref_offset"],
                     batch["advantages"], batch["mask"])
    accuracy = ((out.argmax == y) & batch["mask"]).sum() / batch["mask"].sum()
    return loss, accuracy


def test_compile_fullgraph_dynamic_no_recompile():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(_grpo_step, backend=counter, fullgraph=True)
    for seq in (8, 12, 20):  # the second size triggers automatic dynamic; the third must reuse it
        g = torch.Generator().manual_seed(seq)
        h = torch.randn(2, seq, 8, generator=g, requires_grad=True)
        w = torch.randn(37, 8, generator=g, requires_grad=True)
        y = torch.randint(0, 37, (2, seq), generator=g)
        batch = grpo_batch(2, seq, seed=seq)
        loss, acc = fn(h, w, y, batch)
        loss.backward()
        want, want_acc = _grpo_step(h, w, y, batch)
        torch.testing.assert_close(loss, want)
        torch.testing.assert_close(acc, want_acc)
        torch.testing.assert_close(h.grad, torch.autograd.grad(want, h)[0])
    assert counter.frame_count == 2, counter.frame_count
    torch._dynamo.reset()


def test_compile_inductor_cpu_matches_eager_and_saves_no_logits():
    """Real Inductor on CPU: same loss and gradients as eager; the backward graph's inputs hold no
    [N, V] tensor (the partitioner saves hidden, weight, lse and the entropy, never the logits)."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    bsz, seq, d, v = 2, 16, 8, 1009
    g = torch.Generator().manual_seed(1)
    h = torch.randn(bsz, seq, d, generator=g, requires_grad=True)
    w = torch.randn(v, d, generator=g, requires_grad=True)
    y = torch.randint(0, v, (bsz, seq), generator=g)
    batch = grpo_batch(bsz, seq, seed=2)
    torch._dynamo.reset()
    loss, _ = torch.compile(_grpo_step, backend="inductor", fullgraph=True)(h, w, y, batch)
    got = torch.autograd.grad(loss, (h, w))
    want, _ = _grpo_step(h, w, y, batch)
    torch.testing.assert_close(loss, want)
    for a, b in zip(got, torch.autograd.grad(want, (h, w))):
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()
    rec = AotEagerAndRecordGraphs()
    loss, _ = torch.compile(_grpo_step, backend=rec, fullgraph=True)(h, w, y, batch)
    loss.backward()
    (fw,), (bw,) = rec.fw_graphs, rec.bw_graphs
    assert_all_smaller((fw, bw), bsz * seq * v)
    assert torch.ops.inductor_xent.linear_logprob_bwd.default in {node.target for node in bw.graph.nodes}
    torch._dynamo.reset()
