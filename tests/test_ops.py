"""The torch.library ops: schemas, fake impls, autograd registration, compile, retain_graph."""

import pytest
import torch

import inductor_xent
from inductor_xent import reference
from inductor_xent.ops import BACKWARD as BWD
from inductor_xent.ops import FORWARD as FWD
from inductor_xent.ops import LOGPROB_BACKWARD as LP_BWD
from inductor_xent.ops import LOGPROB_FORWARD as LP_FWD
from inductor_xent.ops import LOGPROB_STORE as LP_STORE
from inductor_xent.ops import LOGPROB_STORE_BACKWARD as LP_STORE_BWD
from inductor_xent.ops import LOGPROB_STORE_BACKWARD_ as LP_STORE_BWD_
from inductor_xent.ops import STORE

from .helpers import assert_all_smaller


def _args(n=13, d=7, v=23, dtype=torch.float32, bias=True, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).to(device, dtype).requires_grad_()
    w = torch.randn(v, d, generator=g).to(device, dtype).requires_grad_()
    b = torch.randn(v, generator=g).to(device, dtype).requires_grad_() if bias else None
    y = torch.randint(0, v, (n,), generator=g).to(device)
    y[::4] = -100
    return h, w, b, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_opcheck_forward(dtype, bias, softcap):
    h, w, b, y = _args(dtype=dtype, bias=bias)
    torch.library.opcheck(FWD, (h, w, b, y, -100, 0.1, 0.9, softcap, 1e-3))


@pytest.mark.parametrize("needs", [(True, True, True), (True, False, False), (False, True, True)])
def test_opcheck_backward(needs):
    h, w, b, y = _args()
    with torch.no_grad():
        _, lse, lse_lo, _ = FWD(h, w, b, y, -100, 0.0, 1.0, None, 0.0)
    g, gl = torch.randn(13), torch.randn(13)
    args = (g, gl, h.detach(), w.detach(), b.detach(), y, lse, lse_lo, -100, 0.0, 1.0, None, 0.0, *needs)
    torch.library.opcheck(BWD, args)
    gh, gw, gb = BWD(*args)
    assert gh.shape == ((13, 7) if needs[0] else (0,))
    assert gw.shape == ((23, 7) if needs[1] else (0,))
    assert gb.shape == ((23,) if needs[2] else (0,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("needs", [(True, True, True), (True, False, False), (False, True, True)])
def test_opcheck_store(dtype, reduction, needs):
    h, w, b, y = _args(dtype=dtype)
    h.requires_grad_(needs[0])
    w.requires_grad_(needs[1])
    b.requires_grad_(needs[2])
    torch.library.opcheck(STORE, (h, w, b, y, -100, 0.1, 0.9, None, 1e-3, reduction, 8, "1x", *needs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("need_entropy, need_argmax", [(False, False), (True, True), (True, False)])
def test_opcheck_log_probs_forward(dtype, bias, softcap, need_entropy, need_argmax):
    h, w, b, y = _args(dtype=dtype, bias=bias)
    torch.library.opcheck(LP_FWD, (h, w, b, y, -100, 1.4, softcap, need_entropy, need_argmax))
    _, ent, arg, _, _ = LP_FWD(h, w, b, y, -100, 1.4, softcap, need_entropy, need_argmax)
    assert ent.shape == ((13,) if need_entropy else (0,)) and arg.shape == ((13,) if need_argmax else (0,))
    assert arg.dtype == torch.long


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("needs", [(True, True, True), (True, False, False), (False, True, True)])
def test_opcheck_log_probs_backward(with_entropy, needs):
    h, w, b, y = _args()
    with torch.no_grad():
        _, ent, _, lse, lse_lo = LP_FWD(h, w, b, y, -100, 0.7, 3.0, True, False)
    g = torch.Generator().manual_seed(1)
    g_lp, g_ent, g_lse = (torch.randn(13, generator=g) for _ in range(3))
    args = (g_lp, g_ent if with_entropy else None, g_lse, h.detach(), w.detach(), b.detach(), y, lse, lse_lo,
            ent if with_entropy else None, -100, 0.7, 3.0, *needs)
    torch.library.opcheck(LP_BWD, args)
    gh, gw, gb = LP_BWD(*args)
    assert gh.shape == ((13, 7) if needs[0] else (0,))
    assert gw.shape == ((23, 7) if needs[1] else (0,))
    assert gb.shape == ((23,) if needs[2] else (0,))


# (implementation, stored rows): the chunked path keeps nothing; the Triton kernels (on the GPU, or
# interpreted on CPU) keep every row's exp-logits, or the first 5 of 13 and recompute the rest
LP_STORE_CASES = [("chunked", 0), ("triton", 13), ("triton", 5)]
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where INDUCTOR_XENT_IMPL=triton runs


@pytest.mark.parametrize("impl, rows", LP_STORE_CASES)
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("need_entropy, need_argmax", [(True, True), (False, False)])
def test_opcheck_log_probs_store(impl, rows, softcap, need_entropy, need_argmax, monkeypatch):
    """The store op's schema, fake shapes (e, m, st sized from store_rows, or empty on the chunked
    path) and autograd; its outputs equal the recompute op's and its e keeps the asked rows."""
    monkeypatch.setenv("INDUCTOR_XENT_IMPL", impl)
    h, w, b, y = _args(device=TRITON_DEVICE if impl == "triton" else "cpu")
    args = (h, w, b, y, -100, 1.4, softcap, need_entropy, need_argmax, rows, "1x")
    torch.library.opcheck(LP_STORE, args)
    out, ref = LP_STORE(*args), LP_FWD(*args[:9])
    for a, r in zip(out[:5], ref):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)
    e, m, st = out[5:]
    assert e.shape[0] == m.shape[1] == rows and st.shape == ((rows,) if softcap and rows else (0,))


@pytest.mark.parametrize("impl, rows", LP_STORE_CASES)
def test_opcheck_log_probs_store_skipping_ignored_rows(impl, rows, monkeypatch):
    """The store op with ``skip_ignored`` on 16-bit inputs (the Triton kernels then keep the valid rows
    first): schema, fakes and autograd; its outputs are the recompute op's with skipping (0 on the
    ignored rows), and its gradients, through the compacted backward, the recompute op's."""
    monkeypatch.setenv("INDUCTOR_XENT_IMPL", impl)
    h, w, _, y = _args(dtype=torch.bfloat16, bias=False, device=TRITON_DEVICE if impl == "triton" else "cpu")
    args = (h, w, None, y, -100, 1.4, None, True, False, rows, "1x", True)
    torch.library.opcheck(LP_STORE, args)
    out, ref = LP_STORE(*args), LP_FWD(*args[:9], True)
    for a, r in zip(out[:5], ref):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[0][y == -100], torch.zeros_like(out[0][y == -100]))
    g = torch.Generator().manual_seed(2)
    ups = [torch.randn(13, generator=g).to(h.device) for _ in range(2)]
    got = torch.autograd.grad((out[0] * ups[0] + out[1] * ups[1]).sum(), (h, w))
    want = torch.autograd.grad((ref[0] * ups[0] + ref[1] * ups[1]).sum(), (h, w))
    for a, r in zip(got, want):
        torch.testing.assert_close(a.float(), r.float(), rtol=1e-2, atol=1e-2 * r.float().abs().max().item())


@pytest.mark.parametrize("impl, rows", LP_STORE_CASES)
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("needs", [(True, True, True), (False, True, False)])
def test_opcheck_log_probs_store_backward(impl, rows, with_entropy, needs, monkeypatch):
    """The store backward op against the recompute backward op: the same gradients (to rounding)."""
    monkeypatch.setenv("INDUCTOR_XENT_IMPL", impl)
    h, w, b, y = _args(device=TRITON_DEVICE if impl == "triton" else "cpu")
    with torch.no_grad():
        _, ent, _, lse, lse_lo, e, m, st = LP_STORE(h, w, b, y, -100, 0.7, 3.0, True, False, rows, "1x")
    g = torch.Generator().manual_seed(1)
    g_lp, g_ent, g_lse = (torch.randn(13, generator=g).to(h.device) for _ in range(3))
    head = (g_lp, g_ent if with_entropy else None, g_lse, h.detach(), w.detach(), b.detach(), y, lse, lse_lo,
            ent if with_entropy else None)
    tail = (-100, 0.7, 3.0, *needs)
    torch.library.opcheck(LP_STORE_BWD, (*head, e, m, st, *tail))
    ref = LP_BWD(*head, *tail)
    for a, r in zip(LP_STORE_BWD(*head, e, m, st, *tail), ref):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)
    # the in-place form (dz over e): its schema says it mutates e, which it does where rows are kept
    torch.library.opcheck(LP_STORE_BWD_, (*head, e.clone(), m, st, *tail))
    kept = e.clone()
    for a, r in zip(LP_STORE_BWD_(*head, kept, m, st, *tail), ref):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)
    assert torch.equal(kept, e) is (rows == 0)


@pytest.mark.parametrize("strategy", ["recompute", "store"])
def test_frozen_weight_strategies(strategy):
    """A frozen weight gets no gradient work and no gradient, in both strategies."""
    h, w, b, y = _args()
    w.requires_grad_(False)
    inductor_xent.linear_cross_entropy(h, w, y, bias=b, strategy=strategy).backward()
    assert w.grad is None and h.grad is not None and b.grad is not None
    want = torch.autograd.grad(reference.linear_cross_entropy(h, w, y, bias=b), (h, b))
    for p, g in zip((h, b), want):
        torch.testing.assert_close(p.grad, g)


def test_store_with_a_gradient_the_forward_did_not_compute_is_an_error():
    h, w, b, y = _args()
    loss, *_ = STORE(h, w, b, y, -100, 0.0, 1.0, None, 0.0, "mean", 0, "1GiB", True, False, True)
    with pytest.raises(RuntimeError, match="computed no gradient for weight"):
        loss.backward()


def test_only_requested_gradients():
    """A frozen weight gets no gradient work and no gradient."""
    h, w, b, y = _args()
    w.requires_grad_(False)
    inductor_xent.linear_cross_entropy(h, w, y, bias=b).backward()
    assert w.grad is None and h.grad is not None and b.grad is not None


@pytest.mark.parametrize("strategy", ["recompute", "store"])
def test_retain_graph_and_second_backward(strategy):
    h, w, b, y = _args()
    loss = inductor_xent.linear_cross_entropy(h, w, y, bias=b, strategy=strategy)
    g1 = torch.autograd.grad(loss, (h, w, b), retain_graph=True)
    g2 = torch.autograd.grad(loss * 3, (h, w, b))
    for a, c in zip(g1, g2):
        torch.testing.assert_close(3 * a, c)
    want = torch.autograd.grad(reference.linear_cross_entropy(h, w, y, bias=b), (h, w, b))
    for a, c in zip(g1, want):
        torch.testing.assert_close(a, c)


@pytest.mark.parametrize("strategy", ["recompute", "store"])
def test_compile_fullgraph_two_batch_sizes_no_recompile(strategy):
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(
        lambda h, w, y: inductor_xent.linear_cross_entropy(h, w, y, label_smoothing=0.1, z_loss=1e-4,
                                                           strategy=strategy),
        backend=counter, fullgraph=True, dynamic=None,
    )
    for n in (16, 24, 40):  # the second size triggers automatic dynamic; the third must reuse it
        h, w, _, y = _args(n=n, seed=n)
        got = fn(h, w, y)
        got.backward()
        want = reference.linear_cross_entropy(h, w, y, label_smoothing=0.1, z_loss=1e-4)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(h.grad, torch.autograd.grad(want, h)[0])
    assert counter.frame_count == 2, counter.frame_count  # static, then one dynamic graph
    torch._dynamo.reset()


@pytest.mark.slow(s=81)
@pytest.mark.parametrize("strategy", ["recompute", "store"])
def test_compile_inductor_cpu_matches_eager(strategy):
    torch._dynamo.reset()
    fn = torch.compile(lambda h, w, b, y: inductor_xent.linear_cross_entropy(h, w, y, bias=b, softcap=3.0,
                                                                             strategy=strategy),
                       backend="inductor", fullgraph=True)
    h, w, b, y = _args(n=19)
    got = fn(h, w, b, y)
    got.backward()
    want = reference.linear_cross_entropy(h, w, y, bias=b, softcap=3.0)
    torch.testing.assert_close(got, want)
    for p, g in zip((h, w, b), torch.autograd.grad(want, (h, w, b))):
        torch.testing.assert_close(p.grad, g)
    torch._dynamo.reset()


@pytest.mark.parametrize("strategy", ["recompute", "store"])
def test_backward_graph_saves_no_logits(strategy):
    """Under AOTAutograd the forward saves inputs and the (N,) lse (recompute) or the gradients
    (store): no [N, V] tensor crosses, and the backward is our op (recompute) or a scaling (store)."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    torch._dynamo.reset()
    rec = AotEagerAndRecordGraphs()
    n, d, v = 32, 8, 1009
    h, w, b, y = _args(n=n, d=d, v=v)
    torch.compile(lambda h, w, y: inductor_xent.linear_cross_entropy(h, w, y, strategy=strategy), backend=rec,
                  fullgraph=True)(h, w, y).backward()
    (fw,), (bw,) = rec.fw_graphs, rec.bw_graphs
    assert_all_smaller((fw, bw), n * v)
    targets = {node.target for node in bw.graph.nodes}
    assert (BWD in targets) == (strategy == "recompute")
    assert STORE in {node.target for node in fw.graph.nodes} or strategy == "recompute"
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", ["forward", "store"])
def test_write_logits(op, dtype, monkeypatch):
    """write_logits: the last output is hidden @ W.T + b in the inputs' dtype (an empty (0,) without
    it), not differentiable, and the other outputs are the same bits either way (returned logits
    need every row: store skips no ignored row then, so the comparison is with skipping off)."""
    monkeypatch.setenv("INDUCTOR_XENT_SKIP_IGNORED", "0")
    h, w, b, y = _args(dtype=dtype)
    if op == "forward":
        args = (h, w, b, y, -100, 0.1, 0.9, 2.0, 1e-3)
        torch.library.opcheck(FWD, (*args, True))
        with_logits, without = FWD(*args, True), FWD(*args)
    else:
        args = (h, w, b, y, -100, 0.1, 0.9, None, 1e-3, "mean", 8, "1x", True, True, True)
        torch.library.opcheck(STORE, (*args, True))
        with_logits, without = STORE(*args, True), STORE(*args)
    assert without[-1].shape == (0,)
    for a, c in zip(with_logits[:-1], without[:-1]):
        assert torch.equal(a, c)
    logits = with_logits[-1]
    assert logits.dtype == dtype and not logits.requires_grad
    expected = torch.nn.functional.linear(h.float(), w.float(), b.float()).to(dtype)  # fp32 sum, rounded once
    assert torch.equal(logits, expected.detach())
