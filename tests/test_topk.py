"""Per-row top-k of an lm_head (inductor_xent/topk.py, issue 25 items 2 and 3): ``linear_topk``'s
values, indices and gradients against eager ``torch.topk`` over materialised logits (float64
oracle, tolerance relative to torch's own error), in several row chunks, and the kept-set
log-probs ``linear_log_probs(..., top_k=)`` against eager's masked log-softmax; the ops' schemas;
errors; on a GPU the same in bf16 (cuda-marked)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import inductor_xent
from inductor_xent import topk

from .helpers import assert_within_torch_error, fallback_chunks

N, D, V = 45, 24, 1031  # V over the pass's MIN_VOCAB (fewer columns: a router's top-k)
CUDA = torch.cuda.is_available()


def _inputs(seed=0, dtype=torch.float32, device="cpu", bias=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(3, N // 3, D, generator=g)
    w = torch.randn(V, D, generator=g) * 0.5
    b = torch.randn(V, generator=g) if bias else None
    y = torch.randint(0, V, (3, N // 3), generator=g)
    y[0, :4] = -100
    return [None if t is None else t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
            for t in (h, w, b)] + [y.to(device)]


def _eager_logits(h, w, b, scale, cap, temperature, dtype=None):
    """The logits as users compute them: the matmul in the inputs' dtype, then in ``dtype``."""
    z = F.linear(h, w, b)
    z = z.to(dtype or (torch.float64 if h.dtype == torch.float64 else torch.float32)) * scale
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    return z / temperature


def _leaves(ts, dtype=None):
    return [None if t is None else t.detach().to(dtype or t.dtype).requires_grad_() for t in ts]


def _grads(out, leaves, g, retain=False):
    return torch.autograd.grad(out, [t for t in leaves if t is not None], g, retain_graph=retain)


OPTIONS = {  # name -> (logit_scale, softcap, temperature)
    "plain": (1.0, None, 1.0),
    "temperature": (1.0, None, 0.7),
    "scale_softcap": (1.3, 4.0, 0.8),
}


@pytest.mark.parametrize("log_probs", [False, True])
@pytest.mark.parametrize("name", sorted(OPTIONS))
@pytest.mark.parametrize("k", [1, 17])
def test_linear_topk_matches_eager(name, log_probs, k):
    """Indices equal eager's topk of the fp32 logits (random logits: no ties), values and gradients
    within torch's own error against float64, over several row chunks of the chunked op."""
    scale, cap, temp = OPTIONS[name]
    h, w, b, _ = _inputs(seed=k)
    g = torch.randn(3, N // 3, k, generator=torch.Generator().manual_seed(7))
    results = []
    for dtype in (torch.float64, torch.float32):
        lv = _leaves((h, w, b), dtype)
        z = _eager_logits(*lv, scale, cap, temp)
        ref = torch.topk(F.log_softmax(z, -1) if log_probs else z, k)
        results.append((ref, _grads(ref.values, lv, g.to(dtype))))
    lv = _leaves((h, w, b))
    with fallback_chunks(V * 4 * 7):  # 7 rows a chunk: 7 chunks
        ours = inductor_xent.linear_topk(lv[0], lv[1], k, bias=lv[2], log_probs=log_probs, temperature=temp,
                                         logit_scale=scale, softcap=cap)
        our_grads = _grads(ours.values, lv, g)
    (exact, exact_grads), (same, same_grads) = results
    assert torch.equal(ours.indices, exact.indices) and torch.equal(ours.indices, same.indices)
    assert ours.values.dtype == torch.float32 and ours.values.shape == (3, N // 3, k)
    assert_within_torch_error(ours.values, same.values, exact.values, what="values")
    for name_, a, s, e in zip(("hidden", "weight", "bias"), our_grads, same_grads, exact_grads):
        assert_within_torch_error(a, s, e, what=name_)


def test_linear_topk_raw_logits_are_eagers_topk_bitwise():
    """Without a scale, softcap or temperature the top-k of the raw logits is torch.topk of the same
    matmul's output: the same bits, ties included (bf16 logits tie often)."""
    h, w, b, _ = _inputs(seed=3, dtype=torch.bfloat16)
    h = (h * 4).round() / 4  # coarse values: many tied logits
    ours = inductor_xent.linear_topk(h, w, 9, bias=b)
    ref = torch.topk(F.linear(h, w, b), 9)
    assert torch.equal(ours.indices, ref.indices)
    assert torch.equal(ours.values, ref.values.float())


def _kept_eager(h, w, b, y, k, temp, cap, dtype=None):
    """Top-k sampling replayed the way trainers spell it: the logits below the k-th set to −inf,
    then the log-softmax at the target; and the entropy of that distribution."""
    u = _eager_logits(h, w, b, 1.0, cap, temp, dtype)
    srt = u.sort(-1, descending=True).values
    kth = srt[..., k - 1: k] if isinstance(k, int) else srt.gather(-1, (k - 1).unsqueeze(-1))
    logp = u.masked_fill(u < kth, float("-inf")).log_softmax(-1)
    valid = y != -100
    lp = torch.where(valid, logp.gather(-1, y.where(valid, 0).unsqueeze(-1)).squeeze(-1), 0.0)
    p = logp.exp()
    ent = torch.where(valid, -(p * logp.masked_fill(p == 0, 0.0)).sum(-1), 0.0)
    return lp, ent, u.argmax(-1)


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("cap", [None, 5.0])
def test_kept_set_log_probs_match_eager(per_row, cap):
    """linear_log_probs(top_k=) against eager's masked log-softmax: log-probs (−inf where the target
    is not kept), the kept distribution's entropy, the argmax, and gradients through all of them,
    the −inf rows' included (eager pushes the kept logits down there too)."""
    h, w, b, y = _inputs(seed=11)
    gen = torch.Generator().manual_seed(12)
    k = torch.randint(1, 40, y.shape, generator=gen) if per_row else 30
    g_lp, g_ent = torch.randn(2, *y.shape, generator=gen)
    results = []
    for dtype in (torch.float64, torch.float32):
        lv = _leaves((h, w, b), dtype)
        lp, ent, arg = _kept_eager(*lv, y, k, 0.7, cap)
        fin = torch.isfinite(lp)
        loss = (torch.where(fin, lp, 0.0) * g_lp.to(dtype)).sum() + (ent * g_ent.to(dtype)).sum()
        results.append((lp, ent, arg, _grads(loss, lv, None), fin))
    lv = _leaves((h, w, b))
    with fallback_chunks(V * 4 * 10):
        out = inductor_xent.linear_log_probs(lv[0], lv[1], y, bias=lv[2], temperature=0.7, softcap=cap, top_k=k,
                                             entropy=True, argmax=True)
        fin = torch.isfinite(out.log_probs)
        loss = (torch.where(fin, out.log_probs, 0.0) * g_lp).sum() + (out.entropy * g_ent).sum()
        ours = _grads(loss, lv, None)
    (e_lp, e_ent, e_arg, e_grads, e_fin), (s_lp, s_ent, _, s_grads, _) = results
    assert torch.equal(fin, e_fin) and (~fin).any() and fin.any()  # some targets outside the kept set
    assert torch.all(out.log_probs[~fin] == float("-inf"))
    assert torch.equal(out.argmax, e_arg)
    assert_within_torch_error(out.log_probs[fin], s_lp[fin], e_lp[fin], what="log_probs")
    assert_within_torch_error(out.entropy, s_ent, e_ent, what="entropy")
    for name, a, s, e in zip(("hidden", "weight", "bias"), ours, s_grads, e_grads):
        assert_within_torch_error(a, s, e, what=name)


def test_kept_set_of_every_column_is_the_plain_log_probs():
    """top_k = V keeps everything: the plain log-probs (a check that the kept set's renormalisation
    is the full logsumexp there)."""
    h, w, b, y = _inputs(seed=13)
    kept = inductor_xent.linear_log_probs(h, w, y, bias=b, temperature=1.3, top_k=V, entropy=True)
    plain = inductor_xent.linear_log_probs(h, w, y, bias=b, temperature=1.3, entropy=True)
    torch.testing.assert_close(kept.log_probs, plain.log_probs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kept.entropy, plain.entropy, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad, error, words", [
    (dict(k=0), ValueError, "k must be in [1, V]"),
    (dict(k=V + 1), ValueError, "k must be in [1, V]"),
    (dict(k=2.0), TypeError, "k must be an int"),
    (dict(temperature=0.0), ValueError, "temperature must be a finite number > 0, got 0.0"),
    (dict(temperature=float("inf")), ValueError, "temperature must be a finite number > 0, got inf"),
    (dict(temperature="hot"), TypeError, "temperature must be a number, got str"),
    (dict(weight_dtype=torch.float64), TypeError, "weight.dtype .torch.float64. must equal hidden.dtype"),
])
def test_linear_topk_rejects(bad, error, words):
    h, w, b, _ = _inputs()
    if "weight_dtype" in bad:
        w = w.to(bad["weight_dtype"])
    with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
        inductor_xent.linear_topk(h, w, bad.get("k", 3), bias=b, temperature=bad.get("temperature", 1.0))


@pytest.mark.parametrize("top_k, words", [
    (0, "top_k must be in"),
    (torch.zeros(3, N // 3, dtype=torch.long), "every top_k must be in"),
    (torch.full((3, N // 3), V + 1), "every top_k must be in"),
    (torch.ones(N), "must have target's shape"),
    (torch.ones(3, N // 3), "must hold integers"),
])
def test_kept_set_rejects(top_k, words):
    h, w, b, y = _inputs()
    with pytest.raises(ValueError, match=words):
        inductor_xent.linear_log_probs(h, w, y, bias=b, top_k=top_k)


@pytest.mark.parametrize("log_probs", [False, True])
def test_opcheck_topk_ops(log_probs):
    """The ops' schemas, fake shapes and autograd registration."""
    h, w, b, _ = _inputs(seed=2)
    h2 = h.reshape(-1, D)
    args = (h2.requires_grad_(), w.requires_grad_(), b, 6, 1.2, 3.0, log_probs)
    torch.library.opcheck(topk.TOPK, args)
    values, indices, lse = topk.TOPK(*args)
    assert lse.shape == ((N,) if log_probs else (0,))
    grad_args = (torch.randn(N, 6), h2.detach(), w.detach(), b, indices, lse, 1.2, 3.0, log_probs, True, True, True)
    torch.library.opcheck(topk.TOPK_BACKWARD, grad_args)


def test_linear_topk_compiles_into_one_op():
    """Under torch.compile (fullgraph) the API is one op in the graph, with eager's results."""
    h, w, b, _ = _inputs(seed=4)

    def fn(h, w, b):
        out = inductor_xent.linear_topk(h, w, 5, bias=b, log_probs=True, temperature=0.9)
        return out.values.sum(-1), out.indices

    torch._dynamo.reset()
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(h, w, b)
    want = fn(h, w, b)
    torch.testing.assert_close(got[0], want[0])
    assert torch.equal(got[1], want[1])


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (the cuBLAS logits and torch.topk of the GPU)")
@pytest.mark.parametrize("log_probs", [False, True])
def test_linear_topk_cuda_bf16(log_probs):
    """bf16 on the GPU, a vocabulary of 32000 and k = 64 over several chunks: eager's top-k values of
    the fp32-upcast logits at our indices (ties in any order), values and gradients within torch's
    own error (one upstream gradient per row: tied columns ordered differently get the same one;
    per-position gradients are checked on CPU)."""
    g = torch.Generator().manual_seed(5)
    n, d, v, k = 1024, 256, 32000, 64
    h = torch.randn(n, d, generator=g).cuda()
    w = (torch.randn(v, d, generator=g) * 0.2).cuda()
    up = torch.randn(n, 1, generator=g).expand(n, k).contiguous().cuda()  # tied columns: the same gradient
    results = []
    for dtype in (torch.float64, torch.bfloat16):
        lv = _leaves((h, w), dtype)
        z = F.linear(*lv).float() if dtype == torch.bfloat16 else F.linear(*lv)
        full = F.log_softmax(z, -1) if log_probs else z
        ref = torch.topk(full, k)
        results.append((ref, _grads(ref.values, lv, up.to(ref.values.dtype))))
    full = full.detach()
    lv = _leaves((h, w), torch.bfloat16)
    old = topk.CUDA_CHUNK_BYTES
    topk.CUDA_CHUNK_BYTES = 300 * v * topk.BYTES_PER_LOGIT  # 300 rows a chunk
    try:
        ours = inductor_xent.linear_topk(lv[0], lv[1], k, log_probs=log_probs)
        our_grads = _grads(ours.values, lv, up)
    finally:
        topk.CUDA_CHUNK_BYTES = old
    (exact, exact_grads), (same, same_grads) = results
    # the columns: eager's top-k values at ours (bf16 logits tie often; torch.topk orders ties as it likes)
    assert torch.equal(full.gather(-1, ours.indices), same.values)
    assert_within_torch_error(ours.values, same.values, exact.values, what="values")
    for name, a, s, e in zip(("hidden", "weight"), our_grads, same_grads, exact_grads):
        assert_within_torch_error(a, s, e, what=name)


# ---------------------------------------------------------------------------------------------
# the pass: torch.topk over the logits, their log_softmax or softmax
# ---------------------------------------------------------------------------------------------
def _topk_log_probs(x, W, y):
    """A student's top-k log-probs at a temperature (top-k distillation), values and ids returned."""
    v, i = torch.topk(F.log_softmax(F.linear(x, W).float() / 0.7, -1), 6)
    return v.exp().sum(-1).mean() + v.mean(), i


def _loss_and_topk_accuracy(x, W, y):
    """The training loss and a top-3 accuracy over the same logits: two ops, one matmul erased."""
    z = F.linear(x, W)
    loss = F.cross_entropy(z.view(-1, z.shape[-1]), y.view(-1))
    hit = (z.topk(3, dim=-1).indices == y[..., None]).any(-1)
    return loss, hit.float().mean()


def _softmax_topk_values(x, W, y):
    top = F.softmax(x @ W.t(), dim=-1).topk(4, sorted=False)
    return (top.values * 2).sum(), top.indices


def _kept_masked_fill(x, W, y):
    """Top-k sampling replayed as trainers write it: the logits below the k-th set to −inf, then the
    log-softmax at the sampled ids (−inf where an id is outside the kept set)."""
    u = F.linear(x, W).float() / 0.7
    kth = torch.topk(u, 400).values[..., -1:]
    lp = u.masked_fill(u < kth, float("-inf")).log_softmax(-1).gather(-1, y[..., None]).squeeze(-1)
    return torch.where(torch.isfinite(lp), lp, 0.0).sum(), lp.detach()


def _kept_where(x, W, y):
    """The same with torch.where, ``[0][..., -1, None]`` and the functional forms."""
    u = F.linear(x, W)
    kth = torch.topk(u, 300, dim=-1)[0][..., -1, None]
    lp = torch.gather(F.log_softmax(torch.where(u < kth, float("-inf"), u), dim=-1), -1, y.unsqueeze(-1))
    return (torch.where(torch.isfinite(lp), lp, 0.0) * 0.5).sum(), lp.detach()


def _loss_and_tempered_topk(x, W, y):
    """The loss at temperature 1 and a top-k of the log-probs at T = 0.7 over the same matmul (KD
    metrics): two ops, each with its own scale."""
    z = F.linear(x, W)
    loss = F.cross_entropy(z.view(-1, z.shape[-1]), y.view(-1))
    v, i = torch.topk(F.log_softmax(z.float() / 0.7, -1), 5)
    return loss + 0.1 * v.sum(), i


def _sigmoid_topk(x, W, y):
    """modded-nanogpt's sigmoid softcap (a tanh cap plus a constant 15): the raw top-k values carry
    the constant."""
    z = 30 * torch.sigmoid(F.linear(x, W) / 7.5)
    top = torch.topk(z, 5)
    return top.values.sum(), top.indices


def _hf_top_p(x, W, y, top_p=0.8, keep_last=True, top_k=None):
    """Nucleus sampling replayed as HF's TopPLogitsWarper spells it (at T = 0.7; after its
    TopKLogitsWarper with ``top_k``), then the log-probs of the sampled ids over the kept set."""
    u = F.linear(x, W).float() / 0.7
    if top_k is not None:
        u = u.masked_fill(u < torch.topk(u, top_k)[0][..., -1, None], -float("inf"))
    sorted_logits, sorted_indices = torch.sort(u, descending=False)
    cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    sorted_indices_to_remove = cumulative_probs <= (1 - top_p)
    if keep_last:
        sorted_indices_to_remove[..., -1:] = 0
    indices_to_remove = sorted_indices_to_remove.scatter(2, sorted_indices, sorted_indices_to_remove)
    lp = u.masked_fill(indices_to_remove, -float("inf")).log_softmax(-1).gather(-1, y[..., None]).squeeze(-1)
    return torch.where(torch.isfinite(lp), lp, 0.0).sum(), lp.detach()


SPELLINGS = {"log_probs": (_topk_log_probs, "top-k op (k=6, of the log-probs)"),
             "hf_top_p": (_hf_top_p, "nucleus op (top_p=0.8) for the log-probs over the kept set"),
             "loss_and_tempered_topk": (_loss_and_tempered_topk, "top-k op (k=5, of the log-probs)"),
             "sigmoid_topk": (_sigmoid_topk, "top-k op (k=5, of the logits)"),
             "kept_masked_fill": (_kept_masked_fill, "top-k op (k=400) for the log-probs over the kept set"),
             "kept_where": (_kept_where, "top-k op (k=300) for the log-probs over the kept set"),
             "with_loss": (_loss_and_topk_accuracy, "top-k op (k=3, of the logits)"),
             "softmax": (_softmax_topk_values, "top-k op (k=4, of the probs)")}


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_topk_spellings_fuse_with_eager_results(name):
    """The spelling compiled with the backend: fused (explain says the top-k op), no [N, V] tensor
    in AOTAutograd's graphs, values, ids and gradients as eager's."""
    from .helpers import assert_all_smaller

    fn, words = SPELLINGS[name]
    h, w, _, y = _inputs(seed=21)
    y = y.clamp(min=0)
    report = inductor_xent.explain(fn, h, w, y)
    (site,) = report.sites
    assert site.fused and words in site.reason, report
    from .helpers import recorded_pass

    compiled, aot, sites = recorded_pass(fn)
    lv, le = _leaves((h, w)), _leaves((h, w))
    got, want = compiled(lv[0], lv[1], y), fn(le[0], le[1], y)
    assert [x.fused for x in sites] == [True]
    assert any({topk.TOPK, topk.NUCLEUS} & {n.target for n in g.graph.nodes} for g in aot.fw_graphs)
    assert_all_smaller(aot.fw_graphs + aot.bw_graphs, N * V)
    for a, b in zip(got, want):
        if not a.is_floating_point():  # sorted=False: eager's order is unspecified, ours sorted
            assert torch.equal(a, b) if name != "softmax" else torch.equal(a.sort(-1).values, b.sort(-1).values)
        elif a.requires_grad:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            for ga, gb in zip(torch.autograd.grad(a, lv[:2]), torch.autograd.grad(b, le[:2])):
                torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-6)
        else:
            torch.testing.assert_close(a, b)


def _smallest(x, W, y):
    return torch.topk(F.linear(x, W), 3, largest=False).values.sum()


def _minus_logsumexp(x, W, y):
    z = F.linear(x, W)
    return torch.topk(z - torch.logsumexp(z, -1, keepdim=True), 3).values.sum()


def _into_out(x, W, y):
    values = torch.empty(x.shape[0], x.shape[1], 3)
    indices = torch.empty(x.shape[0], x.shape[1], 3, dtype=torch.long)
    torch.topk(F.linear(x, W), 3, out=(values, indices))
    return values.sum()


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("fn, words", [(_smallest, "largest=False"), (_minus_logsumexp, "spell it log_softmax"),
                                       (_into_out, "out=")])
def test_topk_declines_with_reason(fn, words):
    h, w, _, y = _inputs(seed=22)
    (site,) = inductor_xent.explain(fn, h, w, y).sites
    assert not site.fused and words in site.reason, site


@pytest.mark.usefixtures("fresh_dynamo")
def test_router_topk_is_no_candidate():
    """A mixture-of-experts router's top-k (softmax over 8 experts, Mixtral's spelling) is left alone
    and not reported: fewer columns than patterns.topk.MIN_VOCAB are no vocabulary."""
    h, _, _, _ = _inputs(seed=23)
    gate = torch.randn(8, D)

    def route(x, g):
        weights, experts = torch.topk(F.softmax(F.linear(x, g), dim=-1, dtype=torch.float), 2, dim=-1)
        return weights.sum(), experts

    assert inductor_xent.explain(route, h, gate).sites == []


# ---------------------------------------------------------------------------------------------
# top-p (nucleus) kept sets: linear_log_probs(..., top_p=)
# ---------------------------------------------------------------------------------------------
def _nucleus_eager(h, w, b, y, top_p, top_k, temperature, dtype=None):
    """HF's TopKLogitsWarper then TopPLogitsWarper (sort ascending, remove cumulative ≤ 1 − p, keep
    the last), then the log-softmax at the target."""
    u = _eager_logits(h, w, b, 1.0, None, temperature, dtype)
    if top_k is not None:
        srt = u.sort(-1, descending=True).values
        kth = srt[..., top_k - 1: top_k] if isinstance(top_k, int) else srt.gather(-1, (top_k - 1).unsqueeze(-1))
        u = u.masked_fill(u < kth, float("-inf"))
    s, idx = torch.sort(u, descending=False)
    # vLLM's per-request p: one per row, against each row's cumulative mass
    bound = (1 - top_p).unsqueeze(-1).to(s.dtype) if isinstance(top_p, torch.Tensor) else 1 - top_p
    remove = s.softmax(-1).cumsum(-1) <= bound
    remove[..., -1] = False
    u = u.masked_fill(remove.scatter(-1, idx, remove), float("-inf"))
    return u.log_softmax(-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("top_p, top_k", [(0.8, None), (0.5, 40), (0.95, "per_row"), (1.0, None), ("per_row", None),
                                          ("per_row", "per_row")])
@pytest.mark.parametrize("bisect", [False, True])
def test_nucleus_log_probs_match_eager(top_p, top_k, bisect, monkeypatch):
    """Log-probs over each row's top-p (after top-k) kept set against HF's warpers written out:
    −inf on the same rows, values and gradients (the −inf rows' too: eager pushes the kept logits
    down there) within torch's own error, over several row chunks. A per-row p (a tensor, vLLM's
    per-request parameter) includes rows at p = 1 (every column kept). ``bisect``: the rows past the
    candidates bisected (topk.BISECT_DEVICES) instead of sorted."""
    if bisect:
        monkeypatch.setattr(topk, "BISECT_DEVICES", ("cpu", "cuda"))
    h, w, b, _ = _inputs(seed=31)
    gen = torch.Generator().manual_seed(32)
    with torch.no_grad():  # ids mostly sampled near the top (inside the kept sets), some not
        y = torch.topk(F.linear(h, w, b), 6).indices[..., 2]
        y[0] = torch.randint(0, V, y[0].shape, generator=gen)
    k = torch.randint(1, 60, y.shape, generator=gen) if top_k == "per_row" else top_k
    if top_p == "per_row":
        top_p = torch.rand(y.shape, generator=gen) * 0.9 + 0.05
        top_p.view(-1)[::5] = 1.0
    g = torch.randn(y.shape, generator=gen)
    results = []
    for dtype in (torch.float64, torch.float32):
        lv = _leaves((h, w, b), dtype)
        lp = _nucleus_eager(*lv, y, top_p, k, 0.7, dtype)
        results.append((lp, _grads((lp.where(torch.isfinite(lp), 0.0) * g.to(dtype)).sum(), lv, None, True),
                        _grads((lp * g.to(dtype)).sum(), lv, None)))
    lv = _leaves((h, w, b))
    with fallback_chunks(V * 12 * 7):  # 7 rows a chunk
        lp = inductor_xent.linear_log_probs(lv[0], lv[1], y, bias=lv[2], temperature=0.7, top_p=top_p,
                                            top_k=k).log_probs
        ours = _grads((lp.where(torch.isfinite(lp), 0.0) * g).sum(), lv, None, True), _grads((lp * g).sum(), lv, None)
    (e_lp, *e_grads), (s_lp, *s_grads) = results
    fin = torch.isfinite(e_lp)
    assert torch.equal(torch.isfinite(lp), fin) and fin.any() and (
        (~fin).any() if isinstance(top_p, torch.Tensor) or top_p < 1.0 else fin.all())
    assert torch.all(lp[~fin] == float("-inf"))
    assert_within_torch_error(lp[fin], s_lp[fin], e_lp[fin], what="log_probs")
    for which in range(2):
        for name, a, s, e in zip(("hidden", "weight", "bias"), ours[which], s_grads[which], e_grads[which]):
            assert_within_torch_error(a, s, e, what=f"{name} ({'finite rows' if which == 0 else 'all rows'})")


def test_nucleus_rejects():
    h, w, b, y = _inputs()
    for bad in (0.0, 1.5, True):
        with pytest.raises(ValueError, match="top_p must be a number in"):
            inductor_xent.linear_log_probs(h, w, y, bias=b, top_p=bad)
    for bad, words in ((torch.full(y.shape, 0.9)[..., :-1], "must have target's shape"),
                       (torch.ones(y.shape, dtype=torch.long), "must hold floats"),
                       (torch.full(y.shape, 0.9).index_fill_(-1, torch.tensor([1]), 0.0), r"every top_p must be in \(0, 1\]"),
                       (torch.full(y.shape, 1.5), r"every top_p must be in \(0, 1\]")):
        with pytest.raises(ValueError, match=words):
            inductor_xent.linear_log_probs(h, w, y, bias=b, top_p=bad)
    with pytest.raises(ValueError, match="not computed with top_p"):
        inductor_xent.linear_log_probs(h, w, y, bias=b, top_p=0.9, entropy=True)


@pytest.mark.parametrize("top_p", [1.0, 0.999])
def test_nucleus_tie_at_the_edge_same_columns_in_the_backward(top_p):
    """Logits tied across the kept set's edge (weight rows duplicated; a per-row top_k splitting the
    tie): the kept set is the stable descending order's prefix (a tie's lower columns first) in the
    forward, and the backward, which rebuilds it from the forward's edge without sorting, keeps the
    same columns: values and gradients as float64 eager's log-softmax over that prefix."""
    g = torch.Generator().manual_seed(51)
    n, v = 12, 40
    h = torch.randn(n, D, generator=g, dtype=torch.float64)
    w = torch.randn(v, D, generator=g, dtype=torch.float64) * 0.05  # flat: top_p 0.999 keeps all the top-k
    w[20:30] = w[10]  # column 10 ties with columns 20..29 in every row
    with torch.no_grad():
        u = F.linear(h, w)
        assert torch.equal(u[:, 10:11].expand(n, 10), u[:, 20:30]), "the tie must be exact"
        order = torch.sort(u, dim=-1, descending=True, stable=True).indices
        k = (order == 10).int().argmax(-1) + 4  # column 10 and the first three of its ties: 20, 21, 22
        kept = torch.zeros(n, v, dtype=torch.bool).scatter_(1, order, torch.arange(v)[None, :] < k[:, None])
        assert kept[:, [10, 20, 21, 22]].all() and not kept[:, 23:30].any()
    y = torch.where(torch.arange(n) % 2 == 0, 22, 23)  # kept, and a tied column outside the set
    gy = torch.randn(n, generator=g, dtype=torch.float64)
    lv = _leaves((h, w))
    lp = inductor_xent.linear_log_probs(lv[0], lv[1], y, top_k=k, top_p=top_p).log_probs
    ours = _grads((lp.where(torch.isfinite(lp), 0.0) * gy).sum(), lv, None)
    le = _leaves((h, w))
    want = F.linear(*le).masked_fill(~kept, float("-inf")).log_softmax(-1).gather(1, y[:, None])[:, 0]
    assert torch.equal(torch.isfinite(lp), y == 22) and torch.equal(torch.isfinite(want), y == 22)
    torch.testing.assert_close(lp[y == 22], want[y == 22])
    for a, b in zip(ours, _grads((want.where(torch.isfinite(want), 0.0) * gy).sum(), le, None)):
        torch.testing.assert_close(a, b)


def test_nucleus_backward_chunked_otherwise_keeps_the_same_columns():
    """The backward chunks the rows when it runs (``config.fallback_chunk_bytes`` may change in
    between): 1-row chunks (a gemv) in the forward and 64-row chunks (a gemm) in the backward round the
    logits otherwise. The kept set is rebuilt from the edge's column, not its value: the gradients
    stay those of one chunking, to rounding."""
    g = torch.Generator().manual_seed(0)
    n, d, v = 64, 256, 300
    h = torch.randn(n, d, generator=g)
    w = torch.randn(v, d, generator=g) * 0.1
    y = torch.topk(F.linear(h, w), 3).indices[:, 0]
    gy = torch.linspace(0.5, 1.5, n)

    def grad_h(fwd_bytes, bwd_bytes):
        hh = h.clone().requires_grad_()
        with fallback_chunks(fwd_bytes):
            lp = inductor_xent.linear_log_probs(hh, w, y, top_p=0.5).log_probs
        with fallback_chunks(bwd_bytes):
            return torch.autograd.grad((lp.where(torch.isfinite(lp), 0.0) * gy).sum(), hh)[0]

    one_row, many = v * 10, 8 * 2**20
    torch.testing.assert_close(grad_h(one_row, many), grad_h(one_row, one_row), rtol=1e-5, atol=1e-6)


def test_nucleus_nan_logits_propagate_as_eager():
    """A NaN logit column (one NaN weight entry; a row's target on it): torch.sort puts NaN first, so it
    is in every row's kept set, and the log-prob there and the weight and bias gradients are NaN as
    eager's HF warper makes them, not silently 0."""
    g = torch.Generator().manual_seed(0)
    n, d, v = 24, 16, 50
    h = torch.randn(n, d, generator=g).requires_grad_()
    w = torch.randn(v, d, generator=g) * 0.5
    w[13, 0] = float("nan")
    w.requires_grad_()
    b = (torch.randn(v, generator=g) * 0.3).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g)
    y[0] = 13
    lp = inductor_xent.linear_log_probs(h, w, y, bias=b, top_p=0.8).log_probs
    assert lp[0].isnan()
    gw, gb = torch.autograd.grad(lp.where(lp.isfinite(), 0.0).sum(), (w, b))
    assert gw.isnan().any() and gb.isnan().any()


def _nucleus_rows(seed=0):
    """A chunk of rows of every kind the nucleus op meets: peaked (kept sets of a few columns), flat
    (most of the row), integer logits (ties everywhere, across the edge too), middling (tens of
    columns), a row whose set ends in a tie across the 16th candidate, a -inf column (a bias) and a
    NaN row; per-row p with rows at 1, and a target column per row."""
    g = torch.Generator().manual_seed(seed)
    n, d, v = 96, 16, 4096  # on CUDA, row_topk reads 16 blocks of 32 columns (a quarter of the row at most)
    h = torch.randn(n, d, generator=g)
    w = torch.randn(v, d, generator=g)
    h[:32] *= 3.0  # peaked rows
    h[32:56] *= 0.05  # flat rows
    h[56:80] = torch.randint(-2, 3, (24, d), generator=g).float()  # integer logits: ties
    h[80:90] *= 0.3  # kept sets of tens of columns: past 16 candidates that looked as if they might hold them
    w_int = torch.randint(-2, 3, (v, d), generator=g).float()
    # row 95: one column of 85 % of the mass, then 30 tied columns of 0.45 % each, so that at p = 0.9 the
    # set ends inside a tie that goes on past 16 candidates (its edge ranked over the whole row)
    for weight in (w, w_int):
        weight[:, 15] = 0.0
        weight[0, 15], weight[6:36, 15] = 8.645, 4.974
    h[56:80, 15] = 0.0  # the integer rows stay integer
    h[95] = 0.0
    h[95, 15] = 1.0
    b = torch.zeros(v)
    b[5] = float("-inf")
    h[90, 3] = float("nan")
    p = torch.rand(n, generator=g) * 0.9 + 0.05
    p[::7] = 1.0
    p[95] = 0.9
    y = torch.randint(0, v, (n,), generator=g)
    return h, w, w_int, b, y, p


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("which", ["top_p", "per_row_p", "per_row_k"])
def test_nucleus_largest_logits_give_the_sorted_rows_kept_sets(monkeypatch, which, device):
    """Each row's kept set read from its largest logits (``NUCLEUS_CANDIDATES``, 16 here) is the one
    sorting the whole row gives: the same edge column (the stable order's, ties included), logsumexp
    and log-probs to rounding, on rows of every kind in one chunk; every path taken (rows found among
    the candidates, their edge read from the candidates' columns or, where its ties may reach past
    them, ranked over the row; and rows that go on past them or cannot use them)."""
    if device == "cuda" and not CUDA:
        pytest.skip("needs a CUDA GPU (row_topk's block maxima there)")
    h, w, w_int, b, y, p = (t.to(device) for t in _nucleus_rows())
    found, ranked = [], []
    real, real_rank = topk._candidate_edges, topk._edge_columns

    def spy(*args):
        out = real(*args)
        found.append(int(out[-1].sum()))
        return out

    def spy_rank(u, *args):
        ranked.append(u.shape[0])
        return real_rank(u, *args)

    monkeypatch.setattr(topk, "_candidate_edges", spy)
    monkeypatch.setattr(topk, "_edge_columns", spy_rank)
    counts = []
    k_rows = torch.randint(1, 30, y.shape, generator=torch.Generator().manual_seed(3)).to(device) \
        if which == "per_row_k" else None
    if k_rows is not None:
        k_rows[95] = 14  # row 95's set (13 columns) inside its top 16, its tie going on past them
    p_rows = p if which != "top_p" else None
    for weight in (w, w_int):
        args = (h, weight, b, y, k_rows, p_rows, 0.9, 1 / 0.7, None, -100)
        monkeypatch.setattr(topk, "NUCLEUS_CANDIDATES", 10**9)
        whole = topk.NUCLEUS(*args)
        monkeypatch.setattr(topk, "NUCLEUS_CANDIDATES", 16)
        found.clear()
        ranked.clear()
        part = topk.NUCLEUS(*args)
        assert 0 < sum(found) < len(h) - 1, found  # some rows from the candidates, not all
        counts.append((sum(found), sum(ranked)))
        assert torch.equal(part[2], whole[2]), (part[2] != whole[2]).nonzero()
        for a, e in zip(part[:2], whole[:2]):
            torch.testing.assert_close(a, e, rtol=2e-6, atol=2e-6, equal_nan=True)
    assert any(r for _, r in counts) and any(r < f for f, r in counts), counts  # both ways to the edge


@pytest.mark.cuda
def test_nucleus_under_cuda_graph_capture_sorts_every_row():
    """Choosing the rows that the candidates hold reads a count on the host, which a CUDA graph's
    capture forbids: captured, the op sorts every row, and replayed it gives the kept sets (edge
    columns) of the uncaptured op, which read most rows from the candidates, and its values to
    rounding."""
    if not CUDA:
        pytest.skip("needs a CUDA GPU (torch.cuda.graph)")
    h, w, _, b, y, p = (t.cuda() for t in _nucleus_rows())
    args = (h, w, b, y, None, p, 0.9, 1 / 0.7, None, -100)
    want = topk.NUCLEUS(*args)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graph asks
        topk.NUCLEUS(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = topk.NUCLEUS(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got[2], want[2])
    for a, e in zip(got[:2], want[:2]):
        torch.testing.assert_close(a, e, rtol=2e-6, atol=2e-6, equal_nan=True)


@pytest.mark.parametrize("per_row_p", [False, True])
def test_opcheck_nucleus_ops(per_row_p):
    h, w, b, y = _inputs(seed=33)
    h2, y1 = h.reshape(-1, D), y.reshape(-1)
    k_rows = torch.full((N,), 30)
    p_rows = torch.rand(N, generator=torch.Generator().manual_seed(34)) * 0.9 + 0.05 if per_row_p else None
    args = (h2.requires_grad_(), w.requires_grad_(), b, y1, k_rows, p_rows, 0.9, 1.2, 4.0, -100)
    torch.library.opcheck(topk.NUCLEUS, args)
    _, lse, edge_col = topk.NUCLEUS(*args)
    torch.library.opcheck(torch.ops.inductor_xent.linear_nucleus_logprob_bwd.default,
                          (torch.randn(N), h2.detach(), w.detach(), b, y1, lse, edge_col, 1.2, 4.0, -100, True, True,
                           True))


@pytest.mark.usefixtures("fresh_dynamo")
def test_topk_under_autocast_matches_eager_autocast():
    """Under torch.autocast (bf16, fp32 parameters): linear_topk casts as F.linear does, and the pass
    fuses a loss with a top-k at a temperature; values and gradients within eager autocast's error
    against float64 of the bf16-rounded operands, the top-k ids those of eager's bf16 logits."""
    h, w, _, y = _inputs(seed=41)
    y = y.clamp(min=0)
    g = torch.randn(3, N // 3, 5, generator=torch.Generator().manual_seed(42))

    def spelled(x, W):
        return torch.topk(F.log_softmax(F.linear(x, W).float() / 0.7, -1), 5)

    lv64 = _leaves((h.to(torch.bfloat16), w.to(torch.bfloat16)), torch.float64)
    exact = spelled(*lv64)
    exact_g = _grads(exact.values, lv64, g.double())
    for name, run in (("api", lambda x, W: inductor_xent.linear_topk(x, W, 5, log_probs=True, temperature=0.7)),
                      ("pass", torch.compile(spelled, backend="inductor_xent"))):
        lv, le = _leaves((h, w)), _leaves((h, w))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours, same = run(*lv), spelled(*le)
        # the ids of the same bf16 logits (float64's may order near-ties that bf16 rounding made otherwise)
        assert torch.equal(ours.indices, same.indices), name
        assert_within_torch_error(ours.values, same.values, exact.values, what=f"{name} values")
        for wn, a, s, e in zip(("hidden", "weight"), _grads(ours.values, lv, g), _grads(same.values, le, g), exact_g):
            assert a.dtype == torch.float32, (name, wn)
            assert_within_torch_error(a, s, e, what=f"{name} grad {wn}")


# ---------------------------------------------------------------------------------------------
# row_topk: the block-maxima prefilter (on CUDA by default; forced here on CPU)
# ---------------------------------------------------------------------------------------------
def _row_cases():
    g = torch.Generator().manual_seed(11)
    n, v = 24, 40 * topk.BLOCK + 37  # a partial last block
    normal = torch.randn(n, v, generator=g).bfloat16()
    ties = torch.randint(0, 4, (n, v), generator=g).float()  # every value tied hundreds of times
    clustered = torch.randn(n, v, generator=g)
    clustered[:, 2 * topk.BLOCK: 3 * topk.BLOCK] += 10  # all of the top-k in one block
    edge = torch.randn(n, v, generator=g)
    edge[:, -30:] += 10  # all of the top-k in the partial block
    special = torch.randn(n, v, generator=g)
    special[0, 5], special[1, :] = float("nan"), float("-inf")
    special[2, 7] = float("inf")
    return {"normal_bf16": normal, "ties": ties, "clustered": clustered, "partial_block": edge, "special": special}


@pytest.mark.parametrize("k", [1, 2, 10])
@pytest.mark.parametrize("case", sorted(_row_cases()))
def test_row_topk_by_blocks_is_torch_topk(case, k):
    """The prefilter's values are torch.topk's exactly (NaN first, ties, a top-k inside one block or the
    partial one), its columns hold them, and they are distinct columns of the row."""
    z = _row_cases()[case]
    assert 4 * k * topk.BLOCK <= z.shape[1], "the blocks' path, not the fallback"
    values, columns = topk.row_topk(z, k, blocks=True)
    want = torch.topk(z, k, dim=-1)
    torch.testing.assert_close(values, want.values, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(z.gather(1, columns), values, equal_nan=True, rtol=0, atol=0)
    assert (columns.sort(-1).values.diff(dim=-1) > 0).all(), "a column twice"


def test_row_topk_falls_back_when_blocks_read_most_of_the_row():
    z = torch.randn(3, 4 * topk.BLOCK)
    for k in (2, 4):  # 2 blocks of 4 read half the row; 4 > 4 blocks' quarter
        values, columns = topk.row_topk(z, k, blocks=True)
        want = torch.topk(z, k, dim=-1)
        assert torch.equal(values, want.values) and torch.equal(columns, want.indices)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (row_topk's default path there)")
@pytest.mark.parametrize("k", [1, 64, 256])
def test_row_topk_cuda_default_is_torch_topk(k):
    """On CUDA, llama3's vocabulary in bf16 (and heavy ties: logits rounded to a coarse grid): the block
    path's values are torch.topk's exactly, its columns hold them."""
    g = torch.Generator().manual_seed(k)
    z = (torch.randn(512, 128256, generator=g) * 3).bfloat16().cuda()
    for logits in (z, (z * 4).round().bfloat16()):
        values, columns = topk.row_topk(logits, k)
        want = torch.topk(logits, k, dim=-1)
        assert torch.equal(values, want.values)
        assert torch.equal(logits.gather(1, columns), values)


@pytest.mark.parametrize("scale, cap", [(1.0, None), (1 / 0.7, None), (0.5, 3.0)])
@pytest.mark.parametrize("case", ["normal_bf16", "partial_block", "special"])
def test_block_stats_are_the_maxima_and_logsumexp(case, scale, cap):
    """block_stats' one pass: each whole block's maximum exactly, and each row's logsumexp of the scaled
    (capped) logits within rounding of torch's over the whole row (-inf and +inf rows included)."""
    z = _row_cases()[case]
    maxima, lse = topk.block_stats(z, scale, cap, True)
    whole = z.shape[1] // topk.BLOCK
    want_max = z[:, : whole * topk.BLOCK].unflatten(1, (whole, topk.BLOCK)).amax(-1)
    torch.testing.assert_close(maxima, want_max, equal_nan=True, rtol=0, atol=0)
    u = z.double() * scale if cap is None else torch.tanh(z.double() * scale / cap) * cap
    torch.testing.assert_close(lse.double(), torch.logsumexp(u, -1), equal_nan=True, rtol=1e-6, atol=1e-5)
    assert topk.block_stats(z, scale, cap, False)[1] is None


@pytest.mark.parametrize("log_probs", [False, True])
def test_linear_topk_through_blocks_matches_eager(log_probs, monkeypatch):
    """The forward's block path (the CUDA default) forced on CPU: values as eager's top-k of the scaled
    log-probs, columns holding them; gradients as eager's."""
    monkeypatch.setattr(topk, "by_blocks", lambda z, k: topk._blocks_fit(z.shape[-1], k))
    g = torch.Generator().manual_seed(4)
    n, d, v, k = 40, 16, 20 * topk.BLOCK + 5, 4
    h, w = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g)
    up = torch.randn(n, k, generator=g)
    outs = []
    for dtype in (torch.float64, torch.float32):
        lv = _leaves((h, w), dtype)
        if dtype == torch.float64:
            u = F.linear(*lv) / 0.7
            ref = torch.topk(F.log_softmax(u, -1) if log_probs else u, k)
        else:
            ref = inductor_xent.linear_topk(lv[0], lv[1], k, log_probs=log_probs, temperature=0.7)
        outs.append((ref, _grads(ref.values, lv, up.to(dtype))))
    (exact, exact_grads), (ours, our_grads) = outs
    assert torch.equal(ours.indices, exact.indices)
    torch.testing.assert_close(ours.values.double(), exact.values, rtol=1e-5, atol=1e-5)
    for a, e in zip(our_grads, exact_grads):
        torch.testing.assert_close(a.double(), e, rtol=1e-4, atol=1e-5)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("keep_last, top_k", [(True, None), (False, None), (True, 100)])
def test_hf_top_p_replay_fuses_with_eager_log_probs(keep_last, top_k):
    """HF's top-p warper over the logits at T = 0.7 (after its top-k warper: one op), ids sampled from
    eager's kept set (and a few from outside it: −inf): the nucleus op's log-probs and gradients as
    eager's, the −inf at the same rows."""
    h, w, _, y = _inputs(seed=8)
    with torch.no_grad():  # ids the rollout could have sampled: from eager's nucleus distribution
        u = F.linear(h, w).float() / 0.7
        s, order = torch.sort(u, descending=True)
        if top_k is not None:
            s[..., top_k:] = -float("inf")
        p = s.softmax(-1)
        kept = (p.cumsum(-1) - p) < 0.8
        probs = torch.zeros_like(u).scatter(-1, order, torch.where(kept, p, 0.0))
        y = torch.multinomial(probs.flatten(0, 1), 1, generator=torch.Generator().manual_seed(2)).view(y.shape)
        y[0, :3] = order[0, :3, -1]  # the smallest logits: outside the kept set
    fn = functools.partial(_hf_top_p, keep_last=keep_last, top_k=top_k)
    report = inductor_xent.explain(fn, h, w, y)
    words = "nucleus op (top_p=0.8" + (f", top_k={top_k})" if top_k else ")")
    assert report.fused_count == 1 and len(report.sites) == 1 and words in report.sites[0].reason, report
    lv, le = _leaves((h, w)), _leaves((h, w))
    got, want = torch.compile(fn, backend="inductor_xent")(lv[0], lv[1], y), fn(le[0], le[1], y)
    assert torch.equal(torch.isinf(got[1]), torch.isinf(want[1])) and torch.isinf(want[1]).sum() == 3
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    for ga, gb in zip(torch.autograd.grad(got[0], lv[:2]), torch.autograd.grad(want[0], le[:2])):
        torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-5)


def _per_row_top_p(x, W, y, p, spelling):
    """HF's warper with one top_p per row (a rollout engine's per-request parameter), at T = 0.7."""
    u = F.linear(x, W).float() / 0.7
    sorted_logits, sorted_indices = torch.sort(u, descending=False)
    cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    bound = (1 - p)[..., None] if spelling == "rsub_then_none" else 1 - p.unsqueeze(-1)
    remove = cumulative_probs <= bound
    remove[..., -1:] = 0
    lp = u.masked_fill(remove.scatter(-1, sorted_indices, remove), -float("inf")).log_softmax(-1)
    lp = lp.gather(-1, y[..., None]).squeeze(-1)
    return torch.where(torch.isfinite(lp), lp, 0.0).sum(), lp.detach()


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("spelling", ["rsub_then_none", "unsqueeze_then_rsub"])
def test_per_row_top_p_replay_fuses_with_eager_log_probs(spelling):
    """The warper's bound ``1 - p`` with one p per row (rows at p = 1 among them): the nucleus op with
    the rows' masses, log-probs and gradients as eager's, the −inf at the same rows; also one p per
    sequence (broadcast over its tokens) and a p that requires grad (a comparison passes none); a
    bound other than ``1 - p`` is no site."""
    h, w, _, y = _inputs(seed=9)
    p = torch.rand(y.shape, generator=torch.Generator().manual_seed(3)) * 0.85 + 0.1
    p[:, ::4] = 1.0
    with torch.no_grad():  # ids sampled from each row's nucleus
        u = F.linear(h, w).float() / 0.7
        s, order = torch.sort(u, descending=True)
        q = s.softmax(-1)
        kept = (q.cumsum(-1) - q) < p[..., None]
        probs = torch.zeros_like(u).scatter(-1, order, torch.where(kept, q, 0.0))
        y = torch.multinomial(probs.flatten(0, 1), 1, generator=torch.Generator().manual_seed(4)).view(y.shape)
        y[0, 1:3] = order[0, 1:3, -1]  # the smallest logits: outside the kept set (rows at p < 1)
    fn = functools.partial(_per_row_top_p, spelling=spelling)
    report = inductor_xent.explain(fn, h, w, y, p)
    assert report.fused_count == 1 and "nucleus op (top_p=per row)" in report.sites[0].reason, report
    lv, le = _leaves((h, w)), _leaves((h, w))
    got, want = torch.compile(fn, backend="inductor_xent")(lv[0], lv[1], y, p), fn(le[0], le[1], y, p)
    assert torch.equal(torch.isinf(got[1]), torch.isinf(want[1])) and torch.isinf(want[1]).sum() == 2
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    for ga, gb in zip(torch.autograd.grad(got[0], lv[:2]), torch.autograd.grad(want[0], le[:2])):
        torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-5)
    for other in (p.clone().requires_grad_(), p[:, :1]):  # a p with grad; one p per sequence
        got, want = torch.compile(fn, backend="inductor_xent")(h, w, y, other), fn(h, w, y, other)
        assert torch.equal(torch.isinf(got[1]), torch.isinf(want[1]))
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
        assert "nucleus op (top_p=per row)" in inductor_xent.explain(fn, h, w, y, other).sites[0].reason

    def shifted(x, W, y, p):  # 0.95 - p: not the warper's bound
        u = F.linear(x, W).float() / 0.7
        sorted_logits, sorted_indices = torch.sort(u, descending=False)
        remove = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (0.95 - p)[..., None]
        u = u.masked_fill(remove.scatter(-1, sorted_indices, remove), -float("inf"))
        return u.log_softmax(-1).gather(-1, y[..., None]).squeeze(-1)

    assert not any(site.fused and "nucleus" in site.reason for site in inductor_xent.explain(shifted, h, w, y, p).sites)


def _vllm_top_p(x, W, y, p):
    """vLLM's apply_top_k_top_p (top-p part) as a no-grad replay writes it: into the sorted logits,
    a cumsum with out=, the sorted logits scattered back (autograd refuses the out=: no grad)."""
    s, order = (F.linear(x, W).float() / 0.7).sort(dim=-1, descending=False)
    probs = s.softmax(dim=-1)
    mass = torch.cumsum(probs, dim=-1, out=probs)
    removed = mass <= 1 - p.unsqueeze(dim=1)
    removed[:, -1] = False
    s.masked_fill_(removed, -float("inf"))
    u = s.scatter(dim=-1, index=order, src=s)
    return u.log_softmax(-1).gather(-1, y[:, None]).squeeze(-1)


@pytest.mark.usefixtures("fresh_dynamo")
def test_vllm_top_p_declines_and_says_what_fuses():
    h, w, _, y = _inputs(seed=10)
    h2, y1 = h.reshape(-1, D), y.reshape(-1).clamp(min=0)
    p = torch.full(y1.shape, 0.9)
    with torch.no_grad():
        report = inductor_xent.explain(_vllm_top_p, h2, w, y1, p)
    assert report.fused_count == 0 and report.sites, report
    assert "vLLM's apply_top_k_top_p" in report.sites[0].reason and "top_p=" in report.sites[0].reason, report


@pytest.mark.usefixtures("fresh_dynamo")
def test_top_p_spellings_the_op_does_not_run_are_left_alone():
    """``min_tokens_to_keep=2`` (``[..., -2:] = 0``) and a sort in descending order: no site, eager's
    results."""
    def keep_two(x, W, y):
        u = F.linear(x, W)
        s, i = torch.sort(u, descending=False)
        remove = s.softmax(dim=-1).cumsum(dim=-1) <= 0.2
        remove[..., -2:] = 0
        return u.masked_fill(remove.scatter(2, i, remove), -float("inf")).log_softmax(-1).gather(-1, y[..., None])

    h, w, _, y = _inputs(seed=9)
    y = y.clamp(min=0)
    report = inductor_xent.explain(keep_two, h, w, y)
    assert report.fused_count == 0, report
    torch.testing.assert_close(torch.compile(keep_two, backend="inductor_xent")(h, w, y), keep_two(h, w, y))


def test_bench_topk_cpu_dry_run_with_nucleus(tmp_path, capsys):
    """bench_topk.py's dry run (tiny shapes on CPU) with the opt-in nucleus methods: every row timed
    forward and forward + backward, and the bench's eager warper agrees with ours on its own inputs;
    an unknown method is an error naming the known ones."""
    import json

    from benchmarks import bench_topk

    methods = ["cublas", "ours", "nucleus_eager", "nucleus_ours", "nucleus_sort", "nucleus_bisect"]
    assert bench_topk.main(["--device", "cpu", "--methods", ",".join(methods), "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bench_topk.json").read_text())["rows"]
    assert [r["method"] for r in rows] == methods
    assert all(r["fwd_ms"] > 0 for r in rows) and all(r["fwd_bwd_ms"] > 0 for r in rows[1:])
    for r in rows[2:]:  # the kept-set rows' errors against the fp32 spelling: bf16's, the same kept targets
        assert 0 < r["err_lp"] < 0.05 and 0 < r["err_dh"] < 0.1 and 0 < r["err_dw"] < 0.1, r
        assert r["kept_differ"] == 0, r
    assert "err_dh" not in rows[1]
    g = torch.Generator().manual_seed(5)
    h, w = torch.randn(20, 16, generator=g), torch.randn(300, 16, generator=g) * 0.3
    ids = torch.randint(0, 300, (20,), generator=g)  # even rows: an id near the top (kept)
    ids[::2] = torch.topk(F.linear(h, w), 3).indices[::2, 1]
    fns = bench_topk.methods(8)
    eager, ours = fns["nucleus_eager"](h, w, ids), fns["nucleus_ours"](h, w, ids)
    fin = torch.isfinite(eager)
    assert torch.equal(torch.isfinite(ours), fin) and fin.any() and (~fin).any()
    torch.testing.assert_close(ours[fin], eager[fin], rtol=1e-5, atol=1e-5)
    with pytest.raises(SystemExit):
        bench_topk.main(["--device", "cpu", "--methods", "ours,fastest"])
    assert "unknown methods ['fastest']" in capsys.readouterr().err


@pytest.mark.usefixtures("fresh_dynamo")
def test_chunk_statistics_compile_one_graph_for_every_chunk_size(monkeypatch):
    """On CUDA a chunk's statistics (``block_stats``, the logsumexp, the top-k's dz: ``topk._for``) are
    compiled with the rows dynamic from the first call: chunks of 5, 6 and 7 rows reuse one graph, and
    a chunk size gives the same bits in the process's first call as later. Dynamo's own switch to
    dynamic rows at the second size gave the first call other kernels: on an H100 the nucleus op's
    first call kept other sets than its later calls. (Here on the tensors' own device.)"""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(topk, "_COMPILED", {})
    fn = topk._for(torch.device("cuda"), topk.block_stats)
    g = torch.Generator().manual_seed(12)
    z = {rows: torch.randn(rows, 40 * topk.BLOCK + 7, generator=g).bfloat16().to("cuda" if CUDA else "cpu") for rows in (5, 6, 7)}
    graphs = counters["stats"]["unique_graphs"]
    outs = [fn(z[rows], 1 / 0.7, 30.0, True) for rows in (5, 6, 7, 5)]
    assert counters["stats"]["unique_graphs"] == graphs + 1
    for a, b in zip(outs[0], outs[3]):
        assert torch.equal(a, b)
    want = topk.block_stats(z[5], 1 / 0.7, 30.0, True)
    torch.testing.assert_close(outs[0][1], want[1])
    assert torch.equal(outs[0][0], want[0])


@pytest.mark.usefixtures("fresh_dynamo")
def test_nucleus_dz_compiled_is_eagers(monkeypatch):
    """The nucleus backward's dz pass compiled as on CUDA (``topk._nucleus_dz_for``; here on the
    tensors' own device) keeps the sets the forward's edge columns name and gives eager's dz to
    rounding, on rows of every kind (ties across the edge, a NaN row, a -inf column), in chunks of two
    sizes. Under a softcap it stays eager: compiled, tanh's saturation tied other columns with the edge
    (checked: the compiled pass's sets differ there, so the choice matters)."""
    dev = "cuda" if CUDA else "cpu"
    h, w, w_int, b, y, p = (t.to(dev) for t in _nucleus_rows())
    monkeypatch.setattr(topk, "_COMPILED", {})
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(dev)
    assert topk._nucleus_dz_for(torch.device("cuda"), 3.0) is topk.nucleus_dz
    differs = []
    for softcap, fn in ((None, topk._nucleus_dz_for(torch.device("cuda"), None)),
                        (3.0, topk._for(torch.device("cuda"), topk.nucleus_dz))):
        assert fn is not topk.nucleus_dz
        for weight in (w, w_int):
            _, lse, edge = topk.NUCLEUS(h, weight, b, y, None, p, 0.9, 1 / 0.7, softcap, -100)
            z = F.linear(h, weight, b)
            for sl in (slice(0, 50), slice(50, len(y))):
                args = (z[sl], edge[sl], lse[sl], g[sl], y[sl].clamp_min(0), 1 / 0.7, softcap)
                got, want = fn(*args), topk.nucleus_dz(*args)
                same_sets = torch.equal(got != 0, want != 0)
                if softcap is not None:
                    differs.append(not same_sets)
                    continue
                assert same_sets, "the kept sets"
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, equal_nan=True)
                assert got.isnan().any() == (sl.start == 50)  # row 90's NaN
    assert any(differs) or CUDA, "compiled under a softcap kept eager's sets: the eager fallback is moot here"


def test_order_keys_sort_as_their_floats():
    x = torch.tensor([-float("inf"), -3.5, -1e-30, -0.0, 0.0, 1e-40, 2.0, 3e38, float("inf")])
    k = topk._key(x)
    assert (k.diff() > 0).all() and torch.equal(topk._unkey(k), x)
    assert torch.equal(topk._unkey(k[3:5]).abs(), torch.zeros(2))  # -0 and +0: two keys, one value


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("compiled", [False, True])
def test_nucleus_bisection_gives_the_sorted_rows_kept_sets(monkeypatch, compiled, device):
    """The rows past the candidates bisected (``topk.BISECT_DEVICES``; the mass reduction eager or
    compiled as on CUDA) keep the sets the sorted rows keep, on rows of every kind (flat, integer
    logits with ties across the edge, a -inf column; a NaN row and rows at p = 1 still sort): the same
    edge columns on these rows, logsumexp and log-probs to rounding. (A set decided within rounding of
    p may end one column off: not on these rows.)"""
    if device == "cuda" and not CUDA:
        pytest.skip("needs a CUDA GPU")
    from inductor_xent import options

    h, w, w_int, b, y, p = (t.to(device) for t in _nucleus_rows())
    bisected, real = [], topk._bisected_edges

    def spy(z, *args):
        bisected.append(z.shape[0])
        return real(z, *args)

    monkeypatch.setattr(topk, "_bisected_edges", spy)
    if compiled:
        torch._dynamo.reset()
        monkeypatch.setattr(topk, "_COMPILED", {})
        monkeypatch.setattr(topk, "_for", lambda dev, fn: topk._COMPILED.setdefault(fn, options.compiled_per_row(fn)))
    # bf16 too: its logits take few values, so flat rows' sets end inside ties (the bisection counts them)
    for hh, weight, bb in ((h, w, b), (h, w_int, b), (h.bfloat16(), w.bfloat16(), b.bfloat16())):
        for p_rows in (None, p):
            args = (hh, weight, bb, y, None, p_rows, 0.9, 1 / 0.7, None, -100)
            monkeypatch.setattr(topk, "NUCLEUS_CANDIDATES", 10**9)
            whole = topk.NUCLEUS(*args)
            monkeypatch.setattr(topk, "NUCLEUS_CANDIDATES", 16)
            monkeypatch.setattr(topk, "BISECT_DEVICES", ("cpu", "cuda"))
            bisected.clear()
            part = topk.NUCLEUS(*args)
            monkeypatch.setattr(topk, "BISECT_DEVICES", ())
            assert sum(bisected) > 10, bisected
            assert torch.equal(part[2], whole[2]), (part[2] != whole[2]).nonzero()
            for a, e in zip(part[:2], whole[:2]):
                torch.testing.assert_close(a, e, rtol=2e-6, atol=2e-6, equal_nan=True)
    if compiled:
        torch._dynamo.reset()
