"""Several hidden states through one lm_head (issue 25, item 4): multi-token prediction's depths
(DeepSeek-V3, Qwen3-Next: the next token from ``h``, token k ahead from ``h_k = block_k(h_{k-1})``, each
with its cross-entropy through the shared head) become one op over all their rows, the weight read once
per tile. Values and gradients against eager and float64; what keeps the sites apart (an early use of
a loss, a write in between, another weight) leaves one op per site, still exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import inductor_xent
from inductor_xent import ops

from .helpers import (
    D,
    Recorder,
    V,
    assert_within_torch_error,
    autocast_exact,
    autocast_loss_and_grads,
    autocast_representable,
    fused_ops,
    leaves,
)

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

B, T = 2, 6


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=g)
    W = torch.randn(V, D, generator=g) * 0.5
    P = torch.randn(2, D, D, generator=g) / D**0.5  # the MTP blocks
    y = torch.randint(0, V, (B, T + 3), generator=g)
    y[0, :3] = -100  # a prompt
    return dict(x=x, W=W, P=P, y=y)


def _mtp(x, W, P, y, weights=(1.0, 0.3)):
    """DeepSeek-V3's MTP loss: the main head's next token, then depth k's token k ahead from
    ``h_k = tanh(h_{k-1} @ P_k)``, the depths' mean scaled by λ; every head the same lm_head."""
    loss = F.cross_entropy(F.linear(x, W).view(-1, V), y[:, 1:T + 1].reshape(-1))
    h, depths = x, []
    for k in range(2):
        h = torch.tanh(h @ P[k])
        logits = F.linear(h, W).float()
        depths.append(F.cross_entropy(logits.view(-1, V), y[:, k + 2:k + 2 + T].reshape(-1), reduction="sum")
                      / (y[:, k + 2:k + 2 + T] != -100).sum())
    return weights[0] * loss + weights[1] * sum(depths) / 2


def _log_probs_and_loss(x, W, P, y):
    """An RL-style pair: the main head's token log-probs (gather of log_softmax) and a second stream's
    log-probs through the same head, summed; the targets have no ignored rows."""
    yv = y.clamp(min=0)
    lp0 = F.log_softmax(F.linear(x, W), -1).gather(-1, yv[:, :T, None]).squeeze(-1)
    lp1 = F.log_softmax(F.linear(torch.tanh(x @ P[0]), W), -1).gather(-1, yv[:, 1:T + 1, None]).squeeze(-1)
    return -(lp0.mean() + 0.5 * lp1.mean())


def _early_use(x, W, P, y):
    """The main loss feeds the next depth's input (its detached value): the depth cannot be computed
    before it, so each site keeps its own op."""
    loss = F.cross_entropy(F.linear(x, W).view(-1, V), y[:, 1:T + 1].reshape(-1))
    h = torch.tanh(x @ P[0]) * (1 + 0 * loss.detach())
    return loss + F.cross_entropy(F.linear(h, W).view(-1, V), y[:, 2:T + 2].reshape(-1))


def _write_between(x, W, P, y):
    """The main head's targets written after its loss and before the depth's (``labels[:, :3] = -100``;
    evaluation under no_grad, where eager saves nothing the write could spoil): one op placed at the
    depth would read the written targets, so each site keeps its own op."""
    labels = y[:, 1:T + 1].clone()
    loss = F.cross_entropy(F.linear(x, W).view(-1, V), labels.view(-1))
    labels[:, :3] = -100
    return loss + F.cross_entropy(F.linear(torch.tanh(x @ P[0]), W).view(-1, V), y[:, 2:T + 2].reshape(-1))


def _two_weights(x, W, P, y):
    """Two lm_heads (the second ``W * 2``, another tensor): nothing shared."""
    loss = F.cross_entropy(F.linear(x, W).view(-1, V), y[:, 1:T + 1].reshape(-1))
    return loss + F.cross_entropy(F.linear(torch.tanh(x @ P[0]), W * 2).view(-1, V), y[:, 2:T + 2].reshape(-1))


def _run(fn, ins, backend=None, dtype=torch.float32):
    leaf = {k: v.detach().to(dtype).requires_grad_() for k, v in ins.items() if v.is_floating_point()}
    f = torch.compile(fn, backend=backend) if backend else fn
    loss = f(**leaf, y=ins["y"])
    loss.backward()  # .grad: None where no gradient reaches (an optimizer skips it), not zeros
    return [loss.detach(), *(p.grad for p in leaf.values())]


def _check(fn, rec, seed=0):
    ins = _inputs(seed)
    ours, same, exact = _run(fn, ins, rec), _run(fn, ins), _run(fn, ins, dtype=torch.float64)
    for name, a, s, e in zip(("loss", "grad x", "grad W", "grad P"), ours, same, exact):
        assert (a is None) == (s is None), f"{fn.__name__} {name}: a gradient where eager has none, or none"
        if s is not None:
            assert_within_torch_error(a, s, e, what=f"{fn.__name__} {name}")


def _detached_depth(x, W, P, y):
    """A depth's loss logged from ``logits.detach()`` next to the trained main loss: no gradient reaches
    that depth's block (``P`` gets none at all, as eager gives none), so it keeps its own op."""
    loss = F.cross_entropy(F.linear(x, W).view(-1, V), y[:, 1:T + 1].reshape(-1))
    logged = F.cross_entropy(F.linear(torch.tanh(x @ P[0]), W).detach().view(-1, V), y[:, 2:T + 2].reshape(-1))
    return loss + logged


# name -> (fn, sites, ops after the rewrite)
CASES = {
    "mtp": (_mtp, 3, 1),
    "log_probs": (_log_probs_and_loss, 2, 1),
    "early_use": (_early_use, 2, 2),
    "two_weights": (_two_weights, 2, 2),
    "detached_depth": (_detached_depth, 2, 2),
}


@pytest.mark.parametrize("strategy", ["recompute", "store"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_sites_of_one_weight_share_one_op(name, strategy):
    fn, sites, n_ops = CASES[name]
    rec = Recorder(**{"xent.strategy": strategy, "xent.store_budget": "1GiB"})
    _check(fn, rec)
    assert counters["inductor_xent"]["sites_fused"] == sites and counters["inductor_xent"]["sites_declined"] == 0
    assert fused_ops(rec.after[0]) == n_ops
    if n_ops == 1:
        (op,) = [t for t in rec.after[0] if t in (ops.LOGPROB_FORWARD, ops.LOGPROB_STORE)]
        assert torch.cat in rec.after[0], "the hidden states of every site in one call"


def test_a_write_between_keeps_the_sites_apart():
    ins = _inputs()
    rec = Recorder()
    with torch.no_grad():
        ours = torch.compile(_write_between, backend=rec)(ins["x"], ins["W"], ins["P"], ins["y"])
        same = _write_between(ins["x"], ins["W"], ins["P"], ins["y"])
        labels = ins["y"][:, 1:T + 1].clone()
        labels[:, :3] = -100
        moved = _write_between(ins["x"], ins["W"], ins["P"], torch.cat([ins["y"][:, :1], labels, ins["y"][:, T + 1:]], 1))
    torch.testing.assert_close(ours, same)
    assert not torch.allclose(same, moved), "the loss read after the write differs (else this test cannot fail)"
    assert counters["inductor_xent"]["sites_fused"] == 2 and fused_ops(rec.after[0]) == 2
    report = inductor_xent.explain(_write_between, ins["x"], ins["W"], ins["P"], ins["y"])
    assert "writes the targets between the sites" in report.sites[0].reason, str(report)


@pytest.mark.parametrize("name, words", [("early_use", "the last site's inputs depend on it"),
                                         ("two_weights", None)])
def test_explain_says_why_sites_of_one_weight_keep_their_own_ops(name, words):
    fn = CASES[name][0]
    ins = _inputs()
    report = inductor_xent.explain(fn, **{k: v.requires_grad_() for k, v in ins.items() if v.is_floating_point()},
                                   y=ins["y"])
    assert report.fused_count == 2, str(report)
    for site in report.sites:
        if words is None:  # two weights: nothing to share
            assert "its own op" not in site.reason, site.reason
        else:
            assert "its own op, not one with the other sites of this lm_head weight" in site.reason, site.reason
            assert words in site.reason, site.reason


def test_explain_names_the_shared_op():
    ins = _inputs()
    leaf = {k: v.requires_grad_() for k, v in ins.items() if v.is_floating_point()}
    report = inductor_xent.explain(_mtp, **leaf, y=ins["y"])
    assert report.fused_count == 3, str(report)
    assert all("one log-probs op for the rows of 3 sites" in s.reason for s in report.sites), str(report)


@pytest.mark.parametrize("seed", [1, 2])
def test_mtp_fresh_inputs_and_all_ignored_depth(seed):
    """Fresh random inputs; then a depth whose every target is ignored (its mean is 0/0 = nan, as eager's)."""
    _check(_mtp, Recorder(), seed)
    ins = _inputs(seed)
    ins["y"][:, 3:] = -100
    ours, same = _run(_mtp, ins, Recorder()), _run(_mtp, ins)
    torch.testing.assert_close(ours[0], same[0], equal_nan=True)


def test_mtp_under_autocast_and_through_install():
    """bf16 autocast around the compiled loss (HF Trainer's bf16=True, fp32 parameters): the sites still
    share one op, loss and gradients within torch's error of float64 (eager autocast the yardstick, inputs
    that autocast casts without rounding); the same through ``install()`` and ``backend="inductor"``."""
    inputs = autocast_representable(_inputs(), torch.bfloat16)
    same, same_g = autocast_loss_and_grads(_mtp, leaves(inputs), autocast=torch.bfloat16)
    exact, exact_g = autocast_exact(_mtp, inputs)
    rec = Recorder()
    for backend in (rec, "inductor"):
        if backend == "inductor":  # install(): the pass in front of Inductor's compile_fx
            torch._dynamo.reset()
            counters.clear()
            inductor_xent.install()
        ours, ours_g = autocast_loss_and_grads(_mtp, leaves(inputs), autocast=torch.bfloat16, backend=backend)
        assert_within_torch_error(ours, same, exact, floor=torch.finfo(torch.bfloat16).eps / 8, what="mtp loss")
        for k in same_g:
            assert_within_torch_error(ours_g[k], same_g[k], exact_g[k], what=f"mtp grad {k}")
        assert counters["inductor_xent"]["sites_fused"] == 3
    assert fused_ops(rec.after[0]) == 1


CUDA = torch.cuda.is_available()


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (the Triton log-probs op and its store)")
@pytest.mark.parametrize("strategy", ["recompute", "store"])
def test_mtp_cuda_bf16(strategy):
    """bf16 on the GPU, 3 sites of 512 rows over V = 32000 (the shared op's Triton kernels, its store
    keeping the exp-logits of every row): loss and every gradient within torch's own error of float64."""
    g = torch.Generator().manual_seed(3)
    d, v, n = 256, 32000, 512

    def fn(x, W, P, y):
        loss = F.cross_entropy(F.linear(x, W).float(), y[0])
        h, depths = x, []
        for k in range(2):
            h = torch.tanh(h @ P[k])
            depths.append(F.cross_entropy(F.linear(h, W).float(), y[k + 1]))
        return loss + 0.3 * sum(depths) / 2

    ins = dict(x=torch.randn(n, d, generator=g), W=torch.randn(v, d, generator=g) * 0.1,
               P=torch.randn(2, d, d, generator=g) / d**0.5)
    y = torch.randint(0, v, (3, n), generator=g)
    y[1, :100] = -100
    results = []
    for dtype, backend in ((torch.float64, None), (torch.bfloat16, None), (torch.bfloat16, "rec")):
        leaf = [t.to("cuda", dtype).requires_grad_() for t in ins.values()]
        rec = Recorder(**{"xent.strategy": strategy, "xent.store_budget": "1GiB", "xent.inner": "inductor"})
        f = torch.compile(fn, backend=rec) if backend else fn
        loss = f(*leaf, y.cuda())
        results.append([loss.detach(), *torch.autograd.grad(loss, leaf)])
    exact, same, ours = results
    for name, a, s, e in zip(("loss", "grad x", "grad W", "grad P"), ours, same, exact):
        assert_within_torch_error(a.double(), s.double(), e, what=f"mtp cuda {strategy} {name}")
    assert fused_ops(rec.after[0]) == 1
    want = ops.LOGPROB_STORE if strategy == "store" else ops.LOGPROB_FORWARD
    assert want in rec.after[0]
