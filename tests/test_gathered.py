"""An lm_head's log-probs (or logits) at given ids per row (inductor_xent/gathered.py): the student's
side of top-k distillation from stored teacher ids. ``linear_gather`` against ``reference.py`` and
eager's gather over materialised logits (float64 oracle, tolerance relative to torch's own error)
over several row chunks, ids repeated in a row included; the ops' schemas; errors; the pass on the
spellings users write (fused, no ``[N, V]`` tensor in AOTAutograd's graphs, eager's values and
gradients) and its declines; on a GPU the same in bf16 (cuda-marked)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import inductor_xent
from inductor_xent import gathered, reference

from .helpers import assert_all_smaller, assert_within_torch_error, fallback_chunks, recorded_pass

N, D, V, K = 45, 24, 1031, 9  # V over the pass's MIN_VOCAB (fewer columns: a router's); N not a chunk multiple
CUDA = torch.cuda.is_available()
OPTIONS = {  # name -> (logit_scale, softcap, temperature)
    "plain": (1.0, None, 1.0),
    "temperature": (1.0, None, 0.7),
    "scale_softcap": (1.3, 4.0, 0.8),
}


def _inputs(seed=0, bias=True, k=K):
    """Hidden [3, 15, D], weight, bias, ids [3, 15, k] with repeats in some rows (an id twice, one
    row holding a single id k times) and the first and last columns."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(3, N // 3, D, generator=g)
    w = torch.randn(V, D, generator=g) * 0.5
    b = torch.randn(V, generator=g) if bias else None
    ids = torch.randint(0, V, (3, N // 3, k), generator=g)
    ids[0, :5, 2] = ids[0, :5, 0]  # an id twice in a row: both positions' gradients add
    ids[1, 3] = 7  # one id k times
    ids[2, 0, :2] = torch.tensor([0, V - 1])
    return h, w, b, ids


def _leaves(ts, dtype=None):
    return [None if t is None else t.detach().to(dtype or t.dtype).requires_grad_() for t in ts]


def _grads(out, leaves, g):
    return torch.autograd.grad(out, [t for t in leaves if t is not None], g)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("log_probs", [False, True])
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_linear_gather_matches_reference(name, log_probs, bias):
    """Values and gradients (random upstream gradients, so repeated ids' sums are checked) within
    torch's own error against float64, over 7 row chunks of the chunked op."""
    scale, cap, temp = OPTIONS[name]
    h, w, b, ids = _inputs(seed=len(name), bias=bias)
    g = torch.randn(ids.shape, generator=torch.Generator().manual_seed(7))
    kw = dict(log_probs=log_probs, temperature=temp, logit_scale=scale, softcap=cap)
    results = []
    for dtype in (torch.float64, torch.float32):
        lv = _leaves((h, w, b), dtype)
        ref = reference.linear_gather(lv[0], lv[1], ids, bias=lv[2], **kw)
        results.append((ref, _grads(ref, lv, g.to(dtype))))
    lv = _leaves((h, w, b))
    with fallback_chunks(V * 4 * 7):  # 7 rows a chunk: 7 chunks
        ours = inductor_xent.linear_gather(lv[0], lv[1], ids, bias=lv[2], **kw)
        our_grads = _grads(ours, lv, g)
    (exact, exact_grads), (same, same_grads) = results
    assert ours.dtype == torch.float32 and ours.shape == ids.shape
    assert_within_torch_error(ours, same, exact, what="values")
    for what, a, s, e in zip(("hidden", "weight", "bias"), our_grads, same_grads, exact_grads):
        assert_within_torch_error(a, s, e, what=what)


def test_reference_is_eagers_gather():
    """The oracle is what users write: the log-softmax (or logits) gathered at the ids."""
    h, w, b, ids = _inputs(seed=1)
    z = F.linear(h, w, b) * 1.3
    z = 4.0 * torch.tanh(z / 4.0) / 0.8
    got = reference.linear_gather(h, w, ids, bias=b, log_probs=True, temperature=0.8, logit_scale=1.3, softcap=4.0)
    torch.testing.assert_close(got, F.log_softmax(z, -1).gather(-1, ids))


def test_repeated_ids_sum_in_one_order():
    """An id held k times by a row gets the sum of its k gradients, the same bits each call (the
    sums run in one fixed order), and as eager's scatter of them to the float64 precision."""
    ids = torch.tensor([[3, 1, 3, 2, 3, 1], [0, 1, 2, 3, 4, 5]])
    g = torch.tensor([[1.0, 2.0, 4.0, 8.0, 16.0, 32.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    got = gathered._run_sums(ids, g)
    assert torch.equal(got, torch.tensor([[21.0, 34.0, 21.0, 8.0, 21.0, 34.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]]))
    h, w, b, idx = _inputs(seed=3)
    up = torch.randn(idx.shape, generator=torch.Generator().manual_seed(4))
    runs = []
    for _ in range(2):
        lv = _leaves((h, w, b))
        runs.append(_grads(inductor_xent.linear_gather(lv[0], lv[1], idx, bias=lv[2], log_probs=True), lv, up))
    assert all(torch.equal(a, c) for a, c in zip(*runs))


@pytest.mark.parametrize("index, error, words", [
    (lambda ids: ids.int(), TypeError, "index must be an int64 tensor"),
    (lambda ids: ids[:, :-1], ValueError, "with the rows of hidden"),
    (lambda ids: ids.reshape(-1, K), ValueError, "with the rows of hidden"),
    (lambda ids: ids.float(), TypeError, "index must be an int64 tensor"),
])
def test_linear_gather_rejects(index, error, words):
    h, w, b, ids = _inputs()
    with pytest.raises(error, match=words):
        inductor_xent.linear_gather(h, w, index(ids), bias=b)


@pytest.mark.parametrize("kw, error, words", [
    (dict(softcap=0.0), ValueError, "softcap must be None or a finite number > 0"),
    (dict(softcap=-3.0), ValueError, "softcap must be None or a finite number > 0"),
    (dict(logit_scale=float("nan")), ValueError, "logit_scale must be finite"),
    (dict(temperature=0.0), ValueError, "temperature must be a finite number > 0"),
    (dict(integer=True), TypeError, "hidden must be a floating-point tensor"),
])
def test_linear_gather_rejects_options(kw, error, words):
    h, w, b, ids = _inputs()
    if kw.pop("integer", False):
        h, w, b = h.long(), w.long(), None
    with pytest.raises(error, match=words):
        inductor_xent.linear_gather(h, w, ids, bias=b, **kw)


@pytest.mark.parametrize("log_probs", [False, True])
@pytest.mark.parametrize("bad", [V, -1])
def test_out_of_range_ids_raise_as_eagers_gather(bad, log_probs):
    """An id outside [0, V) raises, a negative one too (Python's indexing would wrap it to the last
    column; the logits' path reads only the k weight rows)."""
    h, w, b, ids = _inputs()
    ids[0, 0, 0] = bad
    with pytest.raises((RuntimeError, IndexError), match="out of (bounds|range)"):
        inductor_xent.linear_gather(h, w, ids, bias=b, log_probs=log_probs)


def test_no_columns():
    """k = 0: an empty result, as eager's gather gives (compiled: no site, eager's gather runs)."""
    h, w, b, _ = _inputs()
    ids = torch.empty(3, N // 3, 0, dtype=torch.long)
    assert inductor_xent.linear_gather(h, w, ids, bias=b, log_probs=True).shape == ids.shape
    fn = lambda x, W, i: F.log_softmax(x @ W.t(), -1).gather(-1, i)  # noqa: E731
    assert inductor_xent.explain(fn, h, w, ids).sites == []


@pytest.mark.parametrize("log_probs, budget", [(False, "0"), (True, "0"), (True, "1x"), (True, "0.47x")])
def test_opcheck_gather_ops(log_probs, budget):
    """The ops' schemas, fake shapes and autograd registration, with and without kept logits."""
    h, w, b, ids = _inputs(seed=2)
    h2, idx = h.reshape(-1, D), ids.reshape(-1, K)
    args = (h2.requires_grad_(), w.requires_grad_(), b, idx, 1.2, 3.0, log_probs, 0, budget)
    torch.library.opcheck(gathered.GATHER, args)
    values, lse, kept = gathered.GATHER(*args)
    assert values.shape == (N, K) and lse.shape == ((N,) if log_probs else (0,))
    assert kept.shape == ({"0": 0, "1x": N, "0.47x": 21}[budget], V)
    grad_args = (torch.randn(N, K), h2.detach(), w.detach(), b, idx, lse, kept, 1.2, 3.0, log_probs, True, True, True)
    torch.library.opcheck(gathered.GATHER_BACKWARD, grad_args)


@pytest.mark.parametrize("budget", ["1x", "0.47x"])
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_store_keeps_the_logits_for_the_backward(name, budget, monkeypatch):
    """strategy="store": the forward keeps the logits of the rows the budget holds (all at 1x; 21 of
    45 at 0.47x, a backward chunk straddling their end) and the backward computes no logits for them;
    values and gradients as recompute's and within torch's own error."""
    scale, cap, temp = OPTIONS[name]
    h, w, b, ids = _inputs(seed=3 + len(name))
    g = torch.randn(ids.shape, generator=torch.Generator().manual_seed(8))
    kw = dict(log_probs=True, temperature=temp, logit_scale=scale, softcap=cap)
    lv = _leaves((h, w, b), torch.float64)
    exact = reference.linear_gather(lv[0], lv[1], ids, bias=lv[2], **kw)
    exact_grads = _grads(exact, lv, g.double())
    lv = _leaves((h, w, b))
    same = reference.linear_gather(lv[0], lv[1], ids, bias=lv[2], **kw)
    same_grads = _grads(same, lv, g)
    results, gemm_rows = {}, {}
    for how in ("recompute", "store"):
        lv = _leaves((h, w, b))
        with fallback_chunks(V * 4 * 7):  # forward chunks of 4 rows, backward chunks of 2
            out = inductor_xent.linear_gather(lv[0], lv[1], ids, bias=lv[2], strategy=how, store_budget=budget, **kw)
            rows = []
            monkeypatch.setattr(F, "linear", functools.partial(_counted, rows, F.linear))
            results[how] = out, _grads(out, lv, g)
            monkeypatch.undo()
        gemm_rows[how] = sum(rows)
    assert gemm_rows == {"recompute": N, "store": 0 if budget == "1x" else N - 21}
    for a, r in zip([results["store"][0], *results["store"][1]], [results["recompute"][0], *results["recompute"][1]]):
        torch.testing.assert_close(a, r)  # fp32's own tolerance: mm(out=) may round apart from F.linear
    ours, our_grads = results["store"]
    assert_within_torch_error(ours, same, exact, what="values")
    for what, a, s_, e in zip(("hidden", "weight", "bias"), our_grads, same_grads, exact_grads):
        assert_within_torch_error(a, s_, e, what=what)


def _counted(rows: list, linear, x, *args):
    rows.append(x.shape[0])
    return linear(x, *args)


def test_gather_strategy_choice():
    """choose_gather: store on CUDA under auto (at any D), on CPU when asked; recompute for the logits
    alone, without gradients, or when the budget holds too few rows; explain's words."""
    from inductor_xent import strategy as st

    def pick(**kw):
        args = dict(needs=(True, True, False), log_probs=True, device="cuda")
        return st.choose_gather(8192, 768, 50257, torch.bfloat16, **{**args, **kw})

    plan = pick()
    assert plan.strategy == "store" and plan.chunk_rows == 8192
    assert plan.describe() == "store (logits of 8192 of 8192 rows kept for the backward, ~785 MiB)"
    assert pick(budget="0.5x").chunk_rows == 4096
    assert pick(device="cpu").strategy == "recompute" and "CUDA only" in pick(device="cpu").reason
    assert pick(device="cpu", strategy="store").strategy == "store"
    assert "reads no logits" in pick(log_probs=False).reason
    assert "no gradient" in pick(needs=(False, False, False)).reason
    assert "over the budget" in pick(budget="90MiB").reason and pick(budget="100MiB").chunk_rows == 1043
    assert pick(strategy="recompute").reason == "strategy='recompute'"


def test_linear_gather_compiles_into_one_op():
    """Under torch.compile (fullgraph) the API is one op in the graph, with eager's results."""
    h, w, b, ids = _inputs(seed=4)

    def fn(h, w, b, ids):
        return inductor_xent.linear_gather(h, w, ids, bias=b, log_probs=True, temperature=0.9).sum(-1)

    torch._dynamo.reset()
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(h, w, b, ids)
    torch.testing.assert_close(got, fn(h, w, b, ids))


# ---------------------------------------------------------------------------------------------
# the pass: a gather of several columns of the log-probs, the probabilities or the logits
# ---------------------------------------------------------------------------------------------
def _topk_kd(x, W, ids, t_lp, mask):
    """Top-k distillation from a teacher's stored top-k (ids and log-probs): the forward KL over the
    teacher's k ids at T = 2, a masked mean over the tokens (DistillKit's and verl's spelling)."""
    s_lp = F.log_softmax(F.linear(x, W).float() / 2.0, dim=-1).gather(-1, ids)
    kl = (t_lp.exp() * (t_lp - s_lp)).sum(-1)
    return (kl * mask).sum() / mask.sum() * 4.0


def _topk_kd_renormalised(x, W, ids, t_lp, mask):
    """The student's logits at the teacher's ids, renormalised over those k (torch.gather form)."""
    s = torch.gather(F.linear(x, W), -1, ids)
    return F.kl_div(F.log_softmax(s / 2.0, -1), t_lp, log_target=True, reduction="batchmean")


def _probs_at_ids(x, W, ids, t_lp, mask):
    """The student's probabilities at the ids (a soft cross-entropy's other half)."""
    p = torch.softmax(x @ W.t(), dim=-1).gather(-1, ids)
    return -(p * t_lp).sum()


def _ce_and_topk_kd(x, W, ids, t_lp, mask):
    """The hard-label loss and the top-k distillation over one student's logits: the cross-entropy
    op and the gather op, the logits never formed."""
    z = F.linear(x, W)
    y = ids[..., 0]
    ce = F.cross_entropy(z.view(-1, z.shape[-1]), y.view(-1))
    s_lp = torch.gather(F.log_softmax(z / 2.0, dim=-1), -1, ids)
    return 0.5 * ce + 0.5 * (t_lp.exp() * (t_lp - s_lp)).sum(-1).mean() * 4.0


def _topk_kd_then_ce(x, W, ids, t_lp, mask):
    """The distillation first, at its temperature, then the hard-label loss at T = 1: the site's op
    reads the cross-entropy's logits, the gather op its own scale."""
    z = x @ W.t()
    s_lp = F.log_softmax(z / 2.0, -1).gather(-1, ids)
    kd = (t_lp.exp() * (t_lp - s_lp)).sum(-1).mean()
    return kd + F.cross_entropy(z.flatten(0, 1), ids[..., 0].flatten())


def _slim(x, W, ids, t_lp, mask):
    """DistillKit's SlimEstimator: the student's logits of flattened rows gathered at the teacher's
    stored ids, viewed back, both renormalised over the k at T, the KL over the k, a masked mean."""
    z = F.linear(x, W)
    b, s, k = ids.shape
    picked = torch.gather(z.view(b * s, -1), 1, ids.view(b * s, k)).view(b, s, k)
    loss = F.kl_div(F.log_softmax(picked / 2.0, dim=-1), F.softmax(t_lp / 2.0, dim=-1), reduction="none").sum(-1)
    return (loss * mask).sum() / mask.sum().clamp(min=1)


SPELLINGS = {"topk_kd": (_topk_kd, "gather op (k=9, of the log-probs)"),
             "distillkit_slim": (_slim, "gather op (k=9, of the logits)"),
             "topk_kd_then_ce": (_topk_kd_then_ce, "gather op (k=9, of the log-probs), reduction=mean"),
             "renormalised": (_topk_kd_renormalised, "gather op (k=9, of the logits)"),
             "probs": (_probs_at_ids, "gather op (k=9, of the probs)"),
             "ce_and_topk_kd": (_ce_and_topk_kd, "gather op (k=9, of the log-probs)")}


def _kd_inputs(seed):
    h, w, _, ids = _inputs(seed=seed, bias=False)
    g = torch.Generator().manual_seed(seed + 1)
    t_lp = torch.log_softmax(torch.randn(ids.shape, generator=g) * 2, -1)
    mask = (torch.rand(ids.shape[:-1], generator=g) > 0.3).float()
    return h, w, ids, t_lp, mask


def _verl_forward_kl_topk(x, W, ids, t_lp, mask):
    """verl's compute_forward_kl_topk (on-policy distillation): one log_softmax read by a top-k of the
    student (overlap diagnostics) and the gather at the teacher's ids, clamped, the KL per token."""
    student_log_probs = F.log_softmax(F.linear(x, W), dim=-1)
    student_topk_ids = torch.topk(student_log_probs, k=ids.shape[-1], dim=-1).indices
    s_lp = torch.gather(student_log_probs, dim=-1, index=ids)
    student_mass = s_lp.exp().sum(dim=-1)
    s_lp, t = s_lp.clamp_min(-10.0), t_lp.clamp_min(-10.0)
    losses = (t.exp() * (t - s_lp)).sum(-1)
    overlap = (ids.unsqueeze(-1) == student_topk_ids.unsqueeze(-2)).any(dim=-1).sum(-1)
    return (losses * mask).sum() / mask.sum(), overlap, student_mass.detach()


@pytest.mark.usefixtures("fresh_dynamo")
def test_verl_topk_kd_fuses_to_the_topk_and_gather_ops():
    """verl's spelling: one site, the top-k op and the gather op over one lm_head; the loss and its
    gradients, the overlap counts and masses as eager's."""
    args = _kd_inputs(25)
    (site,) = inductor_xent.explain(_verl_forward_kl_topk, *args).sites
    assert site.fused and "top-k op (k=9, of the log-probs), gather op (k=9, of the log-probs)" in site.reason, site
    assert "strategy recompute (store cannot run: no gradient is needed)" in site.reason
    with pytest.MonkeyPatch.context() as mp:  # with gradients: the gather op keeps the logits, the top-k recomputes
        mp.setenv("INDUCTOR_XENT_STRATEGY", "store")
        (site,) = inductor_xent.explain(_verl_forward_kl_topk, *_leaves(args[:2]), *args[2:]).sites
    assert "strategy store (logits of 45 of 45 rows kept for the backward" in site.reason, site
    assert "log-probs op" not in site.reason, site  # no log-probs op runs: the gather op keeps the logits
    assert "; the top-k op recomputes the logits in its backward)" in site.reason, site
    torch._dynamo.reset()
    lv, le = _leaves(args[:2]), _leaves(args[:2])
    got = torch.compile(_verl_forward_kl_topk, backend="inductor_xent")(*lv, *args[2:])
    want = _verl_forward_kl_topk(*le, *args[2:])
    assert torch.equal(got[1], want[1])
    for a, b in zip(got[::2], want[::2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for ga, gb in zip(torch.autograd.grad(got[0], lv), torch.autograd.grad(want[0], le)):
        torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-6)


def _fuses_as_eager(fn, words, args, rtol, atol):
    report = inductor_xent.explain(fn, *args)
    (site,) = report.sites
    assert site.fused and words in site.reason, report
    compiled, aot, sites = recorded_pass(fn)
    lv, le = _leaves(args[:2]), _leaves(args[:2])
    got = compiled(*lv, *args[2:])
    want = fn(*le, *args[2:])
    assert [x.fused for x in sites] == [True]
    assert any(gathered.GATHER in {n.target for n in g.graph.nodes} for g in aot.fw_graphs)
    assert_all_smaller(aot.fw_graphs + aot.bw_graphs, N * V)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    for ga, gb in zip(torch.autograd.grad(got, lv), torch.autograd.grad(want, le)):
        torch.testing.assert_close(ga, gb, rtol=rtol * 10, atol=atol)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_gather_spellings_fuse_with_eager_results(name):
    """The spelling compiled with the backend: fused (explain names the gather op), no [N, V] tensor
    in AOTAutograd's graphs, the loss and gradients as eager's."""
    fn, words = SPELLINGS[name]
    _fuses_as_eager(fn, words, _kd_inputs(21), 1e-5, 1e-6)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("name", ["topk_kd", "ce_and_topk_kd"])
def test_the_pass_keeps_the_gathers_logits_under_store(name, monkeypatch):
    """strategy store: a site whose only head is a gather of log-probs gets the op that keeps its
    logits (the one [N, V] tensor of the graphs, its budget's), eager's loss and gradients; beside a
    cross-entropy (whose op has a strategy of its own) the gather op keeps nothing."""
    monkeypatch.setenv("INDUCTOR_XENT_STRATEGY", "store")
    fn = SPELLINGS[name][0]
    args = _kd_inputs(31)
    compiled, aot, sites = recorded_pass(fn)
    lv, le = _leaves(args[:2]), _leaves(args[:2])
    got, want = compiled(*lv, *args[2:]), fn(*le, *args[2:])
    assert [x.fused for x in sites] == [True]
    (call,) = [n for g in aot.fw_graphs for n in g.graph.nodes if n.target is gathered.GATHER]
    kept = call.meta["val"][2]
    assert tuple(kept.shape) == ((N, V) if name == "topk_kd" else (0, V))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for ga, gb in zip(torch.autograd.grad(got, lv), torch.autograd.grad(want, le)):
        torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-6)


@pytest.mark.usefixtures("fresh_dynamo")
def test_dynamic_k_is_one_graph():
    """dynamic=True: k symbolic too, one graph for every k (the op's rows and columns read from the ids)."""
    fn = lambda x, W, i: F.log_softmax(x @ W.t(), -1).gather(-1, i)  # noqa: E731
    from torch._dynamo.utils import counters

    compiled = torch.compile(fn, backend="inductor_xent", dynamic=True)
    for seed, k in ((30, 4), (31, 7)):
        h, w, _, ids = _inputs(seed=seed, bias=False, k=k)
        torch.testing.assert_close(compiled(h, w, ids), fn(h, w, ids), rtol=1e-5, atol=1e-5)
    assert counters["inductor_xent"]["sites_fused"] == 1


@pytest.mark.usefixtures("fresh_dynamo")
def test_topk_kd_fuses_under_autocast():
    """bf16 autocast around the compiled call (HF Trainer's bf16=True): the operands cast as
    autocast casts F.linear's, the gradients reach the fp32 leaves; within bf16 rounding of eager's."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _fuses_as_eager(_topk_kd, "autocast: operands cast to bfloat16", _kd_inputs(22), 2e-2, 1e-3)


def _minus_logsumexp(x, W, ids, t_lp, mask):
    z = F.linear(x, W)
    return (z - torch.logsumexp(z, -1, keepdim=True)).gather(-1, ids).sum()


def _sparse_grad(x, W, ids, t_lp, mask):
    return torch.gather(F.log_softmax(F.linear(x, W), -1), -1, ids, sparse_grad=True).sum()


def _fewer_rows(x, W, ids, t_lp, mask):
    return F.log_softmax(F.linear(x, W), -1).gather(-1, ids[:, :-1]).sum()


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("fn, words", [(_minus_logsumexp, "spell it log_softmax"), (_sparse_grad, "sparse_grad"),
                                       (_fewer_rows, "does not cover the logits' rows")])
def test_gather_declines_with_reason(fn, words):
    (site,) = inductor_xent.explain(fn, *_kd_inputs(23)).sites
    assert not site.fused and site.head == "gathered" and words in site.reason, site


@pytest.mark.usefixtures("fresh_dynamo")
def test_router_gather_is_no_candidate():
    """A gather over fewer columns than patterns.topk.MIN_VOCAB (a router's experts) is left alone."""
    h, _, _, _ = _inputs(seed=24)
    gate = torch.randn(8, D)
    picked = torch.randint(0, 8, (3, N // 3, 2))

    def route(x, g, i):
        return torch.gather(F.softmax(F.linear(x, g), dim=-1), -1, i).sum()

    assert inductor_xent.explain(route, h, gate, picked).sites == []


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_matmuls_columns_not_normalised_after_are_no_candidate():
    """Inkling's relative-position bias: a [D, 1024] table's columns gathered per query and key
    position, added to the attention scores: no vocabulary head (nothing normalises the k after), so
    no site; the renormalised spelling is one."""
    h, _, _, ids = _inputs(seed=26, bias=False)
    table = torch.randn(D, 1024)

    def position_bias(x, proj, i):
        return (x @ proj).gather(-1, i.clamp(max=1023)).masked_fill(i > 1023, 0.0).sum()

    def renormalised(x, proj, i):
        return F.log_softmax((x @ proj).gather(-1, i.clamp(max=1023)).float() / 2.0, -1).sum()

    assert inductor_xent.explain(position_bias, h, table, ids).sites == []
    (site,) = inductor_xent.explain(renormalised, h, table, ids).sites
    assert site.fused and "gather op (k=9, of the logits)" in site.reason, site


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (the cuBLAS logits)")
@pytest.mark.parametrize("log_probs, how", [(False, "auto"), (True, "auto"), (True, "recompute")])
def test_linear_gather_cuda_bf16(log_probs, how):
    """bf16 on the GPU, a vocabulary of 32000 and k = 64 over several chunks: values and gradients
    within torch's own error (eager: the bf16 matmul upcast to fp32, as users write it); the
    log-probs with the logits kept (auto on CUDA: store) and recomputed."""
    g = torch.Generator().manual_seed(5)
    n, d, v, k = 1024, 256, 32000, 64
    h = torch.randn(n, d, generator=g).cuda()
    w = (torch.randn(v, d, generator=g) * 0.2).cuda()
    ids = torch.randint(0, v, (n, k), generator=g).cuda()
    ids[:, 1] = ids[:, 0]  # repeats
    up = torch.randn(n, k, generator=g).cuda()
    results = []
    for dtype in (torch.float64, torch.bfloat16):
        lv = _leaves((h, w), dtype)
        z = F.linear(*lv).float() if dtype == torch.bfloat16 else F.linear(*lv)
        ref = (F.log_softmax(z, -1) if log_probs else z).gather(-1, ids)
        results.append((ref, _grads(ref, lv, up.to(ref.dtype))))
    lv = _leaves((h, w), torch.bfloat16)
    from inductor_xent import topk

    old = topk.CUDA_CHUNK_BYTES
    topk.CUDA_CHUNK_BYTES = 300 * v * topk.BYTES_PER_LOGIT  # 300 rows a chunk
    try:
        ours = inductor_xent.linear_gather(lv[0], lv[1], ids, log_probs=log_probs, strategy=how)
        our_grads = _grads(ours, lv, up)
    finally:
        topk.CUDA_CHUNK_BYTES = old
    (exact, exact_grads), (same, same_grads) = results
    assert_within_torch_error(ours, same, exact, what="values")
    for what, a, s, e in zip(("hidden", "weight"), our_grads, same_grads, exact_grads):
        assert_within_torch_error(a, s, e, what=what)
