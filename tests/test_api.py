"""Bad input gets a clear error naming the values; edge cases behave exactly like PyTorch."""

import re

import pytest
import torch
import torch.nn.functional as F

import inductor_xent

H = torch.randn(6, 4)
W = torch.randn(10, 4)
Y = torch.tensor([1, 2, 3, -100, 9, 0])


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(weight=torch.randn(10, 5)), ValueError, "hidden's last dimension (4) must equal weight's second dimension (5)"),
        (dict(weight=torch.randn(10)), ValueError, "expected hidden [..., D] and weight [V, D]"),
        (dict(target=torch.tensor([1, 2, 3])), ValueError, "target's shape (3,) must equal hidden's leading shape (6,)"),
        (dict(target=Y.float()), TypeError, "target must hold integer class ids, got dtype torch.float32"),
        (dict(target=torch.ones(6, dtype=torch.bool)), TypeError, "target must hold integer class ids"),
        (dict(reduction="avg"), ValueError, "reduction must be one of 'mean', 'sum', 'none', got 'avg'"),
        (dict(label_smoothing=1.5), ValueError, "label_smoothing must be in [0, 1], got 1.5"),
        (dict(label_smoothing=-0.1), ValueError, "label_smoothing must be in [0, 1], got -0.1"),
        (dict(bias=torch.randn(9)), ValueError, "bias must have shape (10,) [V], got (9,)"),
        (dict(softcap=0.0), ValueError, "softcap must be None or a finite number > 0, got 0.0"),
        (dict(softcap=-3.0), ValueError, "softcap must be None or a finite number > 0, got -3.0"),
        (dict(z_loss=float("nan")), ValueError, "z_loss must be a finite number >= 0, got nan"),
        (dict(logit_scale=float("inf")), ValueError, "logit_scale must be finite, got inf"),
        (dict(weight=torch.randn(10, 4, dtype=torch.float64)), TypeError, "weight.dtype (torch.float64) must equal hidden.dtype (torch.float32)"),
        (dict(hidden=H.to(torch.int32)), TypeError, "hidden must be float64, float32, bfloat16 or float16, got torch.int32"),
        (dict(hidden=H.numpy()), TypeError, "hidden must be a torch.Tensor, got ndarray"),
        (dict(weight=torch.randn(0, 4)), ValueError, "the vocabulary V must be at least 1"),
        (dict(target=torch.tensor([1, 2, 10, -100, 9, 0])), ValueError, "target values [10] are outside [0, 10) and are not ignore_index=-100"),
        (dict(target=torch.tensor([1, -5, 3, -100, 9, 0])), ValueError, "target values [-5] are outside [0, 10)"),
        (dict(strategy="fast"), ValueError, "strategy must be one of 'auto', 'recompute', 'store', got 'fast'"),
        (dict(store_budget=-1), ValueError, "store budget -1 must be a finite number >= 0"),
        (dict(store_budget="lots"), ValueError, "store budget 'lots': expected bytes (e.g. 2147483648, '2GiB', '512MiB')"),
    ],
)
def test_errors_name_the_values(kwargs, error, message):
    args = dict(hidden=H, weight=W, target=Y)
    args.update(kwargs)
    positional = [args.pop(k) for k in ("hidden", "weight", "target")]
    with pytest.raises(error, match=re.escape(message)):
        inductor_xent.linear_cross_entropy(*positional, **args)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(0,), (3, 0)])  # empty, and empty with a 2-D leading shape
def test_empty_input_like_pytorch(reduction, shape):
    h = torch.randn(*shape, 4, requires_grad=True)
    y = torch.zeros(shape, dtype=torch.long)
    got = inductor_xent.linear_cross_entropy(h, W, y, reduction=reduction)
    want = F.cross_entropy(F.linear(h, W).reshape(-1, 10), y.reshape(-1), reduction=reduction)
    assert got.shape == (want.shape if reduction != "none" else y.shape)
    torch.testing.assert_close(got.reshape(-1), want.reshape(-1), equal_nan=True)
    if reduction != "mean":
        got.sum().backward()
        assert h.grad.shape == h.shape


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_like_pytorch(reduction):
    h = torch.randn(6, 4, requires_grad=True)
    y = torch.full((6,), -100)
    got = inductor_xent.linear_cross_entropy(h, W, y, reduction=reduction)
    want = F.cross_entropy(F.linear(h, W), y, reduction=reduction)
    torch.testing.assert_close(got, want, equal_nan=True)
    if reduction != "mean":
        got.sum().backward()
        assert torch.count_nonzero(h.grad) == 0


def test_impl_env_var(monkeypatch):
    monkeypatch.setenv("INDUCTOR_XENT_IMPL", "fast")
    with pytest.raises(ValueError, match=re.escape("INDUCTOR_XENT_IMPL='fast'; expected one of auto, triton, chunked")):
        inductor_xent.linear_cross_entropy(H, W, Y)
    monkeypatch.setenv("INDUCTOR_XENT_IMPL", "chunked")
    torch.testing.assert_close(inductor_xent.linear_cross_entropy(H, W, Y), F.cross_entropy(H @ W.T, Y))
    monkeypatch.setenv("INDUCTOR_XENT_IMPL", "reference")  # the old name: same path, and a deprecation warning
    with pytest.warns(DeprecationWarning, match="INDUCTOR_XENT_IMPL=chunked"):
        torch.testing.assert_close(inductor_xent.linear_cross_entropy(H, W, Y), F.cross_entropy(H @ W.T, Y))


@pytest.mark.parametrize("name, value, message", [
    ("INDUCTOR_XENT_STRATEGY", "fastest", "strategy must be one of 'auto', 'recompute', 'store', got 'fastest'"),
    ("INDUCTOR_XENT_STORE_BUDGET", "-2GiB", "store budget '-2GiB' must be a finite number >= 0"),
])
def test_strategy_env_errors(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        inductor_xent.linear_cross_entropy(H.requires_grad_(), W, Y)


@pytest.mark.parametrize("strategy", ["auto", "recompute", "store"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_strategies_agree(strategy, reduction):
    """Every strategy gives the same loss and gradients (store falls back to recompute for 'none')."""
    h = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(10, 4, dtype=torch.float64, requires_grad=True)
    got = inductor_xent.linear_cross_entropy(h, w, Y, reduction=reduction, z_loss=1e-3, strategy=strategy)
    want = F.cross_entropy(F.linear(h, w), Y, reduction=reduction) + (
        1e-3 * torch.where(Y != -100, torch.logsumexp(F.linear(h, w), -1) ** 2, 0.0)).__getattribute__(
        {"mean": "sum", "sum": "sum", "none": "clone"}[reduction])() / ({"mean": 5, "sum": 1, "none": 1}[reduction])
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got.sum(), (h, w)), torch.autograd.grad(want.sum(), (h, w))):
        torch.testing.assert_close(a, b)


def test_budget_too_small_falls_back_to_recompute():
    from inductor_xent import strategy

    plan = strategy.choose(8192, 4096, 128256, torch.bfloat16, torch.bfloat16, reduction="mean",
                           needs=(True, True, False), strategy="auto", budget="16MiB")
    assert plan.strategy == "recompute" and "over the budget of 16 MiB" in plan.reason
    plan = strategy.choose(8192, 4096, 128256, torch.bfloat16, torch.bfloat16, reduction="mean",
                           needs=(True, True, False), strategy="auto", budget="4GiB")
    # the fewest chunks (one: 8192 rows) that fit 4 GiB
    assert plan.strategy == "store" and plan.chunk_rows == 8192 and plan.extra_bytes <= 4 * 2**30
    plan = strategy.choose(8192, 4096, 128256, torch.bfloat16, torch.bfloat16, reduction="mean",
                           needs=(True, True, False), strategy="auto", budget="1x")
    # 1x (the bf16 logits) fits two balanced chunks, not one; a bf16 weight gradient rounded twice
    assert plan.strategy == "store" and plan.chunk_rows == 4096 and not plan.fp32_accumulate
    plan = strategy.choose(8192, 4096, 128256, torch.bfloat16, torch.bfloat16, reduction="mean",
                           needs=(True, True, False), strategy="auto", budget="0.5x")
    # 0.5x would take more than LOWP_ACCUMULATE_CHUNKS chunks, and then the fp32 accumulator does not fit
    assert plan.strategy == "recompute"
    plan = strategy.choose(8192, 4096, 128256, torch.bfloat16, torch.bfloat16, reduction="none",
                           needs=(True, True, False), strategy="store")
    assert plan.strategy == "recompute" and "reduction='none'" in plan.reason


def test_auto_takes_recompute_at_small_hidden_size_on_cuda():
    """gpt2's D = 768: store lost to recompute on the H200 (18.3 against 12.0 ms), so ``auto`` does
    not take it on CUDA below strategy.STORE_MIN_D_CUDA; asked for by name it still runs, and the
    CPU path (no such measurement) keeps the budget rule."""
    from inductor_xent import strategy

    args = (16384, 768, 50257, torch.bfloat16, torch.bfloat16)
    kw = dict(reduction="mean", needs=(True, True, False), budget="1x")
    small = strategy.choose(*args, strategy="auto", device="cuda", **kw)
    assert small.strategy == "recompute" and "D = 768 < 2048" in small.reason, small
    assert strategy.choose(*args, strategy="store", device="cuda", **kw).strategy == "store"
    assert strategy.choose(*args, strategy="auto", device="cpu", **kw).strategy == "store"
    big = strategy.choose(8192, 2304, 256000, torch.bfloat16, torch.bfloat16, strategy="auto", device="cuda", **kw)
    assert big.strategy == "store", big


def test_log_probs_strategy_plan():
    """The log-prob op's store (issue 24) at the Qwen2.5-7B head: under the default budget (1x, the
    bf16 logits) all but the rows whose tile maxima overflow it keep their exp-logits; 8 GiB keeps
    every row; too small a budget, a small D or the CPU under auto, or no gradient: recompute."""
    from inductor_xent import strategy

    args = (16384, 3584, 152064, torch.bfloat16)
    kw = dict(needs=(True, True, False), device="cuda")
    plan = strategy.choose_log_probs(*args, budget="1x", **kw)
    per_row = 152064 * 2 + 594 * 4 + 4  # fp16 exp-logits, a max per 256-column tile, the target's sech²
    assert plan.strategy == "store" and plan.planned_rows == 16384 and plan.extra_bytes == plan.chunk_rows * per_row
    assert plan.chunk_rows == 16384 * 152064 * 2 // per_row == 16256  # the 128 rows whose share the tile maxima take
    assert plan.extra_bytes <= 16384 * 152064 * 2
    assert "exp-logits of 16256 of 16384 rows" in plan.describe()
    assert strategy.choose_log_probs(*args, budget="8GiB", **kw).chunk_rows == 16384
    small = strategy.choose_log_probs(*args, budget="16MiB", **kw)
    assert small.strategy == "recompute" and "over the budget of 16 MiB" in small.reason, small
    assert "D = 768 < 2048" in strategy.choose_log_probs(16384, 768, 50257, torch.bfloat16, **kw).reason
    assert strategy.choose_log_probs(16384, 768, 50257, torch.bfloat16, strategy="store", **kw).strategy == "store"
    cpu = strategy.choose_log_probs(*args, needs=(True, True, False), device="cpu")
    assert cpu.strategy == "recompute" and "CUDA only" in cpu.reason
    assert strategy.choose_log_probs(*args, needs=(False, False, False), device="cuda").strategy == "recompute"


def test_batch_invariant_log_probs_recompute(monkeypatch):
    """Under INDUCTOR_XENT_BATCH_INVARIANT=1 the log-prob op recomputes, even asked for store: the
    rows store keeps are a budget's share of N, so a row's path (and bits) would follow the batch."""
    from inductor_xent import strategy

    monkeypatch.setenv("INDUCTOR_XENT_BATCH_INVARIANT", "1")
    plan = strategy.choose_log_probs(16384, 3584, 152064, torch.bfloat16, needs=(True, True, False), strategy="store")
    assert plan.strategy == "recompute" and "batch-invariant" in plan.reason, plan
    monkeypatch.setenv("INDUCTOR_XENT_BATCH_INVARIANT", "maybe")
    with pytest.raises(ValueError, match="INDUCTOR_XENT_BATCH_INVARIANT='maybe'"):
        strategy.choose_log_probs(16384, 3584, 152064, torch.bfloat16, needs=(True, True, False))


@pytest.mark.parametrize("impl", ["triton", "chunked"])
def test_log_probs_store_strategy_agrees_with_recompute(impl, monkeypatch):
    """linear_log_probs(strategy="store") gives the recompute strategy's values and gradients, through
    the store op (the Triton kernels keep the exp-logits of every row: the budget holds the
    strategy.MIN_CHUNK_ROWS rows the plan asks for; the chunked path keeps none), eagerly and compiled
    (test_templates and test_ops cover a partial store)."""
    monkeypatch.setenv("INDUCTOR_XENT_IMPL", impl)
    dev = "cuda" if impl == "triton" and torch.cuda.is_available() else "cpu"  # Triton: the GPU, or interpreted
    g = torch.Generator().manual_seed(7)
    h = torch.randn(3, 10, 8, generator=g).to(dev).requires_grad_()
    w = torch.randn(61, 8, generator=g).to(dev).requires_grad_()
    y = torch.randint(0, 61, (3, 10), generator=g).to(dev)
    y[0, :4] = -100
    from inductor_xent import strategy

    budget = strategy.MIN_CHUNK_ROWS * strategy.logprob_row_bytes(61, 4)
    kw = dict(temperature=0.7, softcap=4.0, entropy=True, argmax=True)
    ups = [torch.randn(3, 10, generator=g).to(dev) for _ in range(2)]

    def run(fn):
        out = fn(h, w)
        return [out.log_probs, out.entropy, out.argmax, *torch.autograd.grad(
            (out.log_probs * ups[0] + out.entropy * ups[1]).sum(), (h, w))]

    store = run(lambda a, b: inductor_xent.linear_log_probs(a, b, y, strategy="store", store_budget=budget, **kw))
    recompute = run(lambda a, b: inductor_xent.linear_log_probs(a, b, y, strategy="recompute", **kw))
    compiled = run(torch.compile(lambda a, b: inductor_xent.linear_log_probs(
        a, b, y, strategy="store", store_budget=budget, **kw), backend="aot_eager", fullgraph=True))
    for a, b, c in zip(store, recompute, compiled):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c, a, rtol=0, atol=0)
    out = inductor_xent.linear_log_probs(h, w, y, strategy="store", store_budget=budget, **kw)
    node = out.log_probs.grad_fn.next_functions[0][0]  # under the view to the target's shape
    assert "linear_logprob_store" in type(node).__name__, type(node).__name__


@pytest.mark.parametrize("compiled", [False, True])
def test_log_probs_store_skips_ignored_rows(compiled, monkeypatch):
    """(issue 24) linear_log_probs(strategy="store") on 16-bit inputs computes the valid rows alone,
    forward and backward (the Triton kernels keep the valid rows' exp-logits first; eagerly the
    backward writes dz over them, compiled it runs the out-of-place op): NaN in the ignored rows'
    hidden states leaves the valid rows' log-probs, entropy and gradients those of the valid rows
    alone, and the ignored rows' outputs and hidden gradient 0; the store forward ran on a count of
    rows. With skipping off the forward computes those rows and the in-place backward walks them:
    NaN spreads into the weight gradient."""
    monkeypatch.setenv("INDUCTOR_XENT_IMPL", "triton")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    block = 128 if dev == "cuda" else 16  # whole row blocks of valid rows (rows_mm reads up to its K step)
    g = torch.Generator().manual_seed(8)
    h = torch.randn(3 * block, 16, generator=g).to(dev, torch.bfloat16)
    w = torch.randn(97, 16, generator=g).to(dev, torch.bfloat16).requires_grad_()
    y = torch.randint(0, 97, (3 * block,), generator=g).to(dev)
    y[torch.arange(3 * block, device=dev) % 3 == 1] = -100
    keep = y != -100
    h[~keep] = float("nan")
    h.requires_grad_()
    ups = [torch.randn(3 * block, generator=g).to(dev) for _ in range(2)]
    kw = dict(temperature=0.7, entropy=True, strategy="store", store_budget=2**30)
    from inductor_xent.templates import launch

    counted = []  # whether each store forward computed a count of rows (its recursive call, compacted)
    store = launch.log_probs_store
    monkeypatch.setattr(launch, "log_probs_store", lambda *a, **k: counted.append("count" in k) or store(*a, **k))

    def run(hh, yy, ua, ub):
        fn = lambda a, b: inductor_xent.linear_log_probs(a, b, yy, **kw)  # noqa: E731
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True) if compiled else fn
        out = fn(hh, w)
        return [out.log_probs, out.entropy, *torch.autograd.grad(
            (out.log_probs * ua + out.entropy * ub).float().sum(), (hh, w))]

    lp, ent, gh, gw = run(h, y, *ups)
    assert counted == [False, True], counted
    h_v = h.detach()[keep].requires_grad_()
    lp_v, ent_v, gh_v, gw_v = run(h_v, y[keep], *(u[keep] for u in ups))
    for ours, alone in ((lp, lp_v), (ent, ent_v), (gh, gh_v)):
        torch.testing.assert_close(ours[keep], alone)
        assert torch.equal(ours[~keep].abs(), torch.zeros_like(ours[~keep]))
    torch.testing.assert_close(gw, gw_v)
    if not compiled:  # (compiled: the out-of-place backward reads only rows with a gradient anyway)
        monkeypatch.setenv("INDUCTOR_XENT_SKIP_IGNORED", "0")
        assert run(h, y, *ups)[3].isnan().any()


def test_eager_plans_as_compiled_does():
    """An eager call takes the strategy a compiled call of the same function takes: both plan
    without N. At N = 100, V = 500 the store chunk (100 rows of V padded to 512) is just over the
    1x budget of the real logits, so planning with the real N picked recompute eagerly while the
    compiled call (planned for strategy.DYNAMIC_ROWS) picked store: one ulp apart on the H200."""
    h = torch.randn(100, 8, requires_grad=True)
    w = torch.randn(500, 8, requires_grad=True)
    y = torch.randint(0, 500, (100,))
    eager = inductor_xent.linear_cross_entropy(h, w, y, strategy="store")
    assert "linear_ce_store" in type(eager.grad_fn).__name__, type(eager.grad_fn).__name__
    compiled = torch.compile(lambda a, b: inductor_xent.linear_cross_entropy(a, b, y, strategy="store"),
                             backend="aot_eager", fullgraph=True)(h, w)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    for a, b in zip(torch.autograd.grad(compiled, (h, w)), torch.autograd.grad(eager, (h, w))):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _api_calls(t, ids, ht, wt):
    """Each functional API over (hidden, weight, a float) -> a scalar."""
    return {
        "cross_entropy": lambda h, w, x: inductor_xent.linear_cross_entropy(h, w, t, label_smoothing=x / 10,
                                                                            logit_scale=x, softcap=20 * x),
        "cross_entropy_defaults": lambda h, w, x: inductor_xent.linear_cross_entropy(h, w, t) * x,
        "log_probs": lambda h, w, x: inductor_xent.linear_log_probs(h, w, t, temperature=x, entropy=True
                                                                    ).log_probs.sum(),
        "gather": lambda h, w, x: inductor_xent.linear_gather(h, w, ids, log_probs=True, temperature=x).sum(),
        "topk": lambda h, w, x: inductor_xent.linear_topk(h, w, 3, log_probs=True, temperature=x).values.sum(),
        "distillation": lambda h, w, x: inductor_xent.linear_distillation_loss(
            h, w, ht, wt, t, kind="jsd", temperature=x, hard_weight=0.5, student_softcap=20 * x),
    }


@pytest.mark.parametrize("name", ["cross_entropy", "cross_entropy_defaults", "log_probs", "gather", "topk",
                                  "distillation"])
def test_apis_compile_fullgraph_dynamic(name):
    """torch.compile(fullgraph=True, dynamic=True) around each functional API, with the weight an
    nn.Parameter (static sizes, as Dynamo keeps a parameter's) and a float argument: under dynamic=True
    Dynamo makes such floats (and the float defaults of the functions it inlines) symbolic, and the
    APIs' checks called math.isfinite on them ("torch.* op returned non-Tensor"), then handed them to
    the strategy choice (assume_constant_result: "argument conversion failed"). Eager's values, two
    float values, one graph per float value at most."""
    g = torch.Generator().manual_seed(3)
    n, d, v = 12, 8, 64
    h = torch.randn(n, d, generator=g, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(v, d, generator=g))
    t = torch.randint(0, v, (n,), generator=g)
    ids = torch.randint(0, v, (n, 3), generator=g)
    ht, wt = torch.randn(n, 6, generator=g), torch.randn(v, 6, generator=g)
    fn = _api_calls(t, ids, ht, wt)[name]
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    for x in (0.7, 0.9):
        got, want = compiled(h, w, x), fn(h, w, x)
        torch.testing.assert_close(got, want)
        for a, b in zip(torch.autograd.grad(got, (h, w)), torch.autograd.grad(want, (h, w))):
            torch.testing.assert_close(a, b)
    torch._dynamo.reset()
