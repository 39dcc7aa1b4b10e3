"""The Triton kernels, forward, backward and store, against the oracle.

One file for both kinds of machine: on a CUDA machine the kernels run on the GPU; on a CPU machine
they run under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py before any kernel
is defined). The interpreter is never switched on in a process that has a GPU, so it cannot leak into
the CUDA tests that share the session (``python3 -m pytest`` runs everything in one process).

Shapes are tiny and odd (N=37 rows: 3 row blocks of the interpreter's 16, the last partial; D=24:
not a multiple of the 16-wide D step; V=131: prime, 5 tiles of 32 with a ragged last one) because
the interpreter runs every program in Python. Tolerances are relative to PyTorch's own error: for
each case we compute torch's same-dtype result (``F.linear`` in the input dtype, then ``.float()``,
the way models write it) and ours, both against a float64 oracle, and require
``err(ours) <= K * err(torch) + EPS``.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import inductor_xent
from inductor_xent import compat, reference, strategy
from inductor_xent.options import LossOptions, fold_temperature
from inductor_xent.templates import configs, launch, rows
from inductor_xent.templates import forward as _forward

from .helpers import assert_within_torch_error, rel_err
from .rl import check_grpo, eager_log_probs, grpo_batch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
assert CUDA or type(_forward.lce_fwd_kernel).__name__ == "InterpretedFunction", \
    "without a GPU the kernels must be defined under TRITON_INTERPRET=1 (tests/conftest.py sets it)"

# the interpreter's numpy emulation: its deprecations, and overflow in lanes that are masked off
pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning:triton.*", "ignore::RuntimeWarning:triton.*"
)

K = 1.5  # issue 3: gradient error at most 1.5x torch's own
EPS = {torch.float32: 1e-6, torch.bfloat16: 1e-5}


@pytest.fixture(autouse=True)
def _ieee_fp32():
    """fp32 matmuls in IEEE on both sides (ours follows torch's TF32 setting: compat.tf32_matmuls),
    set through the API that reads back: once a test in the same process used the new one (HF's
    TrainingArguments sets torch.backends.fp32_precision), the legacy allow_tf32 raises when read."""
    if not CUDA:
        yield
        return
    with compat.ieee_fp32_matmuls():
        yield


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def make_inputs(n=37, d=24, v=131, dtype=torch.float32, bias=False, scale=1.0, seed=0,
                ignore_index=-100, transposed_weight=False, strided_hidden=False):
    """Fresh random inputs; rows 0..15 (the whole first row block) and every 7th row ignored."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g)
    w = torch.randn(v, d, generator=g) * (scale / d**0.5)
    b = torch.randn(v, generator=g) if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[:16] = ignore_index
    t[16::7] = ignore_index
    if strided_hidden:  # a column slice of a wider tensor: row stride 2*d
        h = torch.cat([h, torch.randn(n, d, generator=g)], dim=1)[:, :d]
    h = h.to(dtype)
    w = w.to(dtype)
    if transposed_weight:  # the model stores W as [D, V] and passes W_dv.t()
        w = w.t().contiguous().t()
    b = None if b is None else b.to(dtype)
    return tuple(None if x is None else x.to(DEVICE) for x in (h, w, b, t))


def rows_and_lse(h, w, b, t, o, *, torch_way):
    """(loss rows, lse). torch_way: logits from F.linear in the input dtype, then .float(), as a
    model computes them; else the oracle (float64 inputs give the float64 reference)."""
    if not torch_way:
        return reference.loss_rows(h, w, b, t, o)
    z = F.linear(h, w, b).float() * o.logit_scale
    if o.softcap is not None:
        z = o.softcap * torch.tanh(z / o.softcap)
    lse = torch.logsumexp(z, dim=-1)
    valid = t != o.ignore_index
    zt = z.gather(1, torch.where(valid, t, 0)[:, None])[:, 0]
    eps = o.label_smoothing
    loss = (1 - eps) * (lse - zt) + eps * (lse - z.mean(-1)) + o.z_loss * lse**2
    return torch.where(valid, loss, 0.0), lse


def grads_of(h, w, b, t, o, gl, gs, *, torch_way):
    """Loss rows, lse and the gradients of sum(gl*loss + gs*lse) w.r.t. (hidden, weight, bias)."""
    leaves = [x.detach().clone().requires_grad_() for x in (h, w) + ((b,) if b is not None else ())]
    loss, lse = rows_and_lse(leaves[0], leaves[1], leaves[2] if b is not None else None, t, o,
                             torch_way=torch_way)
    (gl.to(loss.dtype) * loss + gs.to(lse.dtype) * lse).sum().backward()
    return loss.detach(), lse.detach(), [x.grad for x in leaves]


def _upstream(n, seed, grad_lse=True):
    g = torch.Generator().manual_seed(seed)
    gl = torch.rand(n, generator=g) + 0.5  # non-uniform, as reduction="none" gives
    gs = torch.randn(n, generator=g) * 0.3 if grad_lse else torch.zeros(n)
    return gl.to(DEVICE), gs.to(DEVICE)


def check_case(h, w, b, t, o, *, grad_lse=True, seed=1, eps=None):
    """Forward and backward through the launchers against the float64 oracle, relative to torch."""
    gl, gs = _upstream(h.shape[0], seed, grad_lse)
    up = [None if x is None else x.double() for x in (h, w, b)]
    ref_loss, ref_lse, ref_grads = grads_of(*up, t, o, gl.double(), gs.double(), torch_way=False)
    pt_loss, pt_lse, pt_grads = grads_of(h, w, b, t, o, gl, gs, torch_way=True)

    loss, lse, lse_lo = launch.forward(h, w, b, t, o)
    assert loss.dtype == lse.dtype == lse_lo.dtype == torch.float32
    assert torch.isfinite(lse).all() and torch.isfinite(loss).all()
    eps = EPS[h.dtype] if eps is None else eps
    for name, ours, pt, ref in (("loss", loss, pt_loss, ref_loss), ("lse", lse, pt_lse, ref_lse)):
        assert_within_torch_error(ours, pt, ref, k=K, floor=eps, what=name)
    assert torch.all(loss[t == o.ignore_index] == 0)

    needs = (True, True, b is not None)
    ours = launch.backward(gl, gs, h, w, b, t, lse, lse_lo, o, needs)
    for name, x, pt, ref, src in zip(("hidden", "weight", "bias"), ours, pt_grads, ref_grads, (h, w, b)):
        assert x.dtype == src.dtype and x.shape == src.shape, name
        assert_within_torch_error(x, pt, ref, k=K, floor=eps, what=name)
    return ours


def reduced_and_grads(h, w, b, t, o, reduction, *, torch_way):
    """The mean/sum loss and its gradients w.r.t. (hidden, weight, bias)."""
    leaves = [x.detach().clone().requires_grad_() for x in (h, w) + ((b,) if b is not None else ())]
    rows, _ = rows_and_lse(leaves[0], leaves[1], leaves[2] if b is not None else None, t, o, torch_way=torch_way)
    loss = rows.sum() / (t != o.ignore_index).sum() if reduction == "mean" else rows.sum()
    return [loss.detach()] + list(torch.autograd.grad(loss, leaves))


def op_fp32_accumulate(h, w, chunk_rows, needs):
    """What the store op passes the launcher: strategy's precision rule for these row chunks."""
    return strategy.fp32_accumulate(h.shape[0], chunk_rows, w.element_size(), needs[1])


def check_store(h, w, b, t, o, *, reduction="mean", chunk_rows=0, needs=None, eps=None):
    """The store strategy (loss and gradients in one pass over row chunks) against the oracle."""
    needs = needs or (True, True, b is not None)
    ref = reduced_and_grads(*[None if x is None else x.double() for x in (h, w, b)], t, o, reduction,
                            torch_way=False)
    pt = reduced_and_grads(h, w, b, t, o, reduction, torch_way=True)
    loss, *grads = launch.store(h, w, b, t, o, reduction, chunk_rows, needs,
                                fp32_accumulate=op_fp32_accumulate(h, w, chunk_rows, needs))
    assert loss.dtype == torch.float32 and loss.dim() == 0
    eps = EPS[h.dtype] if eps is None else eps
    assert_within_torch_error(loss, pt[0], ref[0], k=K, floor=eps, what="loss")
    for name, need, x, p, r, src in zip(("hidden", "weight", "bias"), needs, grads, pt[1:], ref[1:], (h, w, b)):
        if not need:
            assert x.shape == (0,), name
            continue
        assert x.dtype == src.dtype and x.shape == src.shape, name
        assert_within_torch_error(x, p, r, k=K, floor=eps, what=name)
    return loss, grads


# ---------------------------------------------------------------------------------------------
# forward + backward, one option at a time, then all together
# ---------------------------------------------------------------------------------------------
CASES = {
    # plain cross-entropy; the all-ignored first row block must give loss 0 and still an lse
    "plain": (dict(), LossOptions()),
    # bias add in the epilogue, and its column-sum gradient
    "bias": (dict(bias=True), LossOptions()),
    # label smoothing: the sum of logits and the eps/V term of dz
    "smoothing": (dict(), LossOptions(label_smoothing=0.1)),
    # logit_scale and a softcap that bites (logits std ~6 against a cap of 3): tanh, sech²
    "scale_softcap": (dict(scale=6.0), LossOptions(logit_scale=0.7, softcap=3.0)),
    # z-loss: the 2*z_loss*lse*p term; grad_lse is nonzero in every case
    "z_loss": (dict(), LossOptions(z_loss=1e-2)),
    # an ignore_index that is also a valid class id
    "ignore_valid_id": (dict(ignore_index=5), LossOptions(ignore_index=5)),
    # every option at once, with a [D, V] weight passed transposed and a strided hidden
    "everything_strided": (
        dict(bias=True, scale=4.0, transposed_weight=True, strided_hidden=True),
        LossOptions(label_smoothing=0.2, logit_scale=1.3, softcap=5.0, z_loss=1e-3),
    ),
}
# store cannot take a softcap with label smoothing (strategy.py): the same case without smoothing
STORE_CASES = {**CASES, "everything_strided": (
    CASES["everything_strided"][0], CASES["everything_strided"][1]._replace(label_smoothing=0.0))}


@pytest.mark.parametrize("name", list(CASES))
def test_fwd_bwd_fp32(name):
    kwargs, o = CASES[name]
    check_case(*make_inputs(**{**kwargs, "ignore_index": o.ignore_index}), o)


@pytest.mark.parametrize("name", ["plain", "everything_strided"])
def test_fwd_bwd_bf16(name):
    kwargs, o = CASES[name]
    check_case(*make_inputs(dtype=torch.bfloat16, seed=3, **kwargs), o)


def test_vocab_smaller_than_block():
    """V=20 < the 32-column tile, D=24 (masked D tail), N=5 < one row block."""
    o = LossOptions(label_smoothing=0.1, z_loss=1e-3)
    h, w, b, t = make_inputs(n=5, d=24, v=20, bias=True)
    t[:] = torch.tensor([3, -100, 19, 0, 7])
    check_case(h, w, b, t, o)


def test_many_splits_and_chunks(monkeypatch):
    """Force the forward to split the vocabulary over programs (partials combined) and the
    backward to walk it in chunks of one column tile (several chunks, the last ragged)."""
    monkeypatch.setattr(launch, "_num_sms", lambda device: 64)
    monkeypatch.setattr(configs, "BWD_EXTRA_BYTES", 0)
    monkeypatch.setattr(configs, "BWD_MIN_CHUNK_BYTES", 1)
    h, w, b, t = make_inputs(bias=True, seed=5, v=131 if not CUDA else 701)
    splits, _ = configs.vocab_split(3, 5, 64)
    assert splits == 5 and configs.dlogits_chunk(37, 24, 131, 4, True, 32) == 32
    o = LossOptions(label_smoothing=0.1, softcap=4.0, z_loss=1e-3)
    check_case(h, w, b, t, o)
    check_case(*make_inputs(dtype=torch.bfloat16, bias=True, seed=6, v=131 if not CUDA else 701), o)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_z_loss_gradient_where_softmax_is_onehot(smoothing):
    """V=1, so p == onehot: the CE part of dz is 0 and the z-loss term is the whole gradient. It
    must not be rounded away against g, as the folded g·(1 + 2·z_loss·lse) did (2.3e-5 relative
    error, against 6e-8 now), nor left over from p − 0.9 − 0.1 with smoothing (the target's
    coefficient (1 − ε) + ε/V is one constant, 1 here). The torch side here is F.cross_entropy plus
    a separate z-loss, whose backward has no such cancellation."""
    h, w, _, _ = make_inputs(n=9, d=8, v=1, seed=11)
    t = torch.zeros(9, dtype=torch.long, device=DEVICE)  # the only class; no row ignored
    o = LossOptions(z_loss=1e-3, label_smoothing=smoothing)
    gl = (torch.rand(9, generator=torch.Generator().manual_seed(12)) + 0.5).to(DEVICE)

    def grads(h, w, fn):
        h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        (gl.to(h.dtype) * fn(h, w)).sum().backward()
        return h.grad, w.grad

    exact = grads(h.double(), w.double(), lambda h, w: reference.loss_rows(h, w, None, t, o)[0])
    same = grads(h, w, lambda h, w: F.cross_entropy(F.linear(h, w), t, reduction="none", label_smoothing=smoothing)
                 + 1e-3 * torch.logsumexp(F.linear(h, w), -1) ** 2)
    _, lse, lse_lo = launch.forward(h, w, None, t, o)
    ours = launch.backward(gl, torch.zeros_like(gl), h, w, None, t, lse, lse_lo, o, (True, True, False))
    for name, x, s, e in zip(("hidden", "weight"), ours, same, exact):
        assert_within_torch_error(x, s, e, k=K, floor=1e-7, what=name)
    # store computes the same gradient in its forward (sum: upstream 1 per row)
    loss, gh, gw, _ = launch.store(h, w, None, t, o, "sum", 0, (True, True, False), fp32_accumulate=False)
    exact = grads(h.double(), w.double(), lambda h, w: reference.loss_rows(h, w, None, t, o)[0] / gl.double())
    for name, x, e in zip(("hidden", "weight"), (gh, gw), exact):
        assert rel_err(x, e) <= 1e-6, (name, rel_err(x, e))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tma_descriptors(monkeypatch, dtype):
    """The TMA path (operands as tensor descriptors; out-of-bounds rows, columns and the D tail
    read as zeros instead of being clamped and masked), forward and backward, with splits and
    chunks, and the store forward's flattened persistent loop (4 programs over 3 row blocks x 5
    tiles: each walks several tiles, the grouped order across row blocks). D=32: descriptor rows
    must be 16-byte aligned."""
    if CUDA and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA descriptors need Hopper or later")
    monkeypatch.setattr(configs, "BWD_EXTRA_BYTES", 0)
    monkeypatch.setattr(configs, "BWD_MIN_CHUNK_BYTES", 1)
    tma = configs.CONFIGS["interpret"]._replace(tma=True)
    monkeypatch.setattr(configs, "dlogits_config", lambda dtype: tma)
    monkeypatch.setattr(configs, "forward_config", lambda dtype: tma)
    monkeypatch.setattr(configs, "store_config", lambda dtype: tma._replace(split_tiles=1))
    h, w, b, t = make_inputs(d=32, dtype=dtype, bias=True, seed=13)
    assert launch._tma_ok(tma, h, w) and not launch._tma_ok(tma, h, w.t().contiguous().t())
    check_case(h, w, b, t, LossOptions(label_smoothing=0.1, softcap=4.0, z_loss=1e-3))
    check_store(h, w, b, t, LossOptions(softcap=4.0, z_loss=1e-3), chunk_rows=16)
    check_store(h, w, b, t, LossOptions(label_smoothing=0.1), chunk_rows=0)


@pytest.mark.parametrize("needs", [(True, False, False), (False, True, False), (False, False, True)])
def test_backward_needs_subset(needs):
    """A gradient not asked for is an empty (0,) tensor; the others equal the full backward's."""
    h, w, b, t = make_inputs(bias=True, seed=7)
    o = LossOptions(label_smoothing=0.1)
    _, lse, lse_lo = launch.forward(h, w, b, t, o)
    gl, gs = _upstream(37, 8)
    full = launch.backward(gl, gs, h, w, b, t, lse, lse_lo, o, (True, True, True))
    part = launch.backward(gl, gs, h, w, b, t, lse, lse_lo, o, needs)
    for need, x, ref in zip(needs, part, full):
        if need:
            torch.testing.assert_close(x, ref, rtol=0, atol=0)
        else:
            assert x.shape == (0,)
    store_full = launch.store(h, w, b, t, o, "mean", 16, (True, True, True),
                              fp32_accumulate=op_fp32_accumulate(h, w, 16, (True, True, True)))
    store_part = launch.store(h, w, b, t, o, "mean", 16, needs, fp32_accumulate=op_fp32_accumulate(h, w, 16, needs))
    for need, x, ref in zip(needs, store_part[1:], store_full[1:]):
        if need:
            torch.testing.assert_close(x, ref, rtol=0, atol=0)
        else:
            assert x.shape == (0,)


def test_deterministic():
    h, w, b, t = make_inputs(dtype=torch.bfloat16, bias=True, seed=8)
    o = LossOptions(label_smoothing=0.1, z_loss=1e-3)
    runs = []
    for _ in range(2):
        loss, lse, lse_lo = launch.forward(h, w, b, t, o)
        ones, zeros = torch.ones(37, device=DEVICE), torch.zeros(37, device=DEVICE)
        runs.append((loss, lse, lse_lo) + launch.backward(ones, zeros, h, w, b, t, lse, lse_lo, o, (True, True, True))
                    + launch.store(h, w, b, t, o, "mean", 16, (True, True, True),
                                   fp32_accumulate=op_fp32_accumulate(h, w, 16, (True, True, True))))
    for x, y in zip(*runs):
        assert torch.equal(x, y)


def test_empty_rows():
    h, w, b, t = make_inputs(n=0, bias=True)
    loss, lse, lse_lo = launch.forward(h, w, b, t, LossOptions())
    assert loss.shape == lse.shape == lse_lo.shape == (0,)
    gh, gw, gb = launch.backward(loss, lse, h, w, b, t, lse, lse_lo, LossOptions(), (True, True, True))
    assert gh.shape == (0, 24) and torch.equal(gw, torch.zeros_like(w)) and torch.equal(gb, torch.zeros_like(b))
    total, gh, gw, gb = launch.store(h, w, b, t, LossOptions(), "sum", 0, (True, True, True), fp32_accumulate=False)
    assert total.item() == 0 and gh.shape == (0, 24) and torch.equal(gw, torch.zeros_like(w))
    assert torch.equal(gb, torch.zeros_like(b))


def test_unsupported_reason():
    if CUDA:
        assert launch.unsupported_reason(torch.zeros(2, 2, device="cuda")) is None
    else:
        assert launch.unsupported_reason(torch.zeros(2, 2)) is None  # CPU under the interpreter
    assert "float64" in launch.unsupported_reason(torch.zeros(2, 2, dtype=torch.float64, device=DEVICE))


def test_vocab_split_covers_every_tile():
    for num_m, tiles, slots in [(1, 1, 132), (64, 502, 132), (3, 5, 4), (128, 197, 264), (2, 1000, 132)]:
        splits, per = configs.vocab_split(num_m, tiles, slots)
        assert splits * per >= tiles > (splits - 1) * per


# ---------------------------------------------------------------------------------------------
# precision where fp32 rounding bites (issue 9)
# ---------------------------------------------------------------------------------------------
def test_a_large_common_logit_keeps_the_loss():
    """Every logit 2^24: lse = 2^24 + log 8 rounds to 2^24 + 2 in fp32, so lse − z_t gives 2.0
    instead of log 8 = 2.0794; the loss is taken relative to the row max, and the backward's
    softmax from (z − lse) − lse_lo, so loss and gradients stay exact. (PyTorch's own test of the
    same name, tolerance 1e-2.)"""
    h = torch.ones(3, 1, device=DEVICE)
    w = torch.full((8, 1), 2.0**24, device=DEVICE)
    t = torch.tensor([0, 3, 7], device=DEVICE)
    o = LossOptions()
    loss, lse, lse_lo = launch.forward(h, w, None, t, o)
    torch.testing.assert_close(loss, torch.full_like(loss, math.log(8)), rtol=1e-6, atol=0)
    gl = torch.ones(3, device=DEVICE)
    gh, gw, _ = launch.backward(gl, torch.zeros_like(gl), h, w, None, t, lse, lse_lo, o, (True, True, False))
    # d/dz = 1/8 − onehot for every row; d/dW[v] = Σ_rows (1/8 − onehot) · 1
    want_gw = torch.full((8, 1), 3 / 8, device=DEVICE)
    want_gw[[0, 3, 7]] -= 1
    torch.testing.assert_close(gw, want_gw, rtol=1e-6, atol=0)
    torch.testing.assert_close(gh, torch.zeros_like(gh), rtol=0, atol=1e-6 * 2**24)
    total, _, gw_store, _ = launch.store(h, w, None, t, o, "sum", 0, (True, True, False), fp32_accumulate=False)
    torch.testing.assert_close(total, torch.tensor(3 * math.log(8), device=DEVICE), rtol=1e-6, atol=0)
    torch.testing.assert_close(gw_store, want_gw, rtol=1e-6, atol=0)


@pytest.mark.parametrize("softcap, scale", [(30.0, 1.0), (30.0, 3.0), (4.0, 40.0)])  # Gemma's cap; saturated
def test_softcap_fp32_as_accurate_as_eager(softcap, scale):
    """fp32 with a softcap as accurate as eager fp32 (torch.tanh): tanh of small arguments
    (1 − 2/(e^{2x}+1) cancels there: with a cap of 30 the loss came out 4-6x less accurate than
    eager's, grad_weight 2x) and sech² where tanh saturates (1 − tanh² cancels). The error floor is
    1e-8 here, not 1e-6: these errors are ~1e-7 and the floor would hide them. On the GPU the
    kernels' exp2/log are the hardware's approximations (~2 ulp), which alone cost ~1e-7 of the
    loss: the floor there is 2e-7 (the old tanh still fails it at a cap of 30)."""
    h, w, b, t = make_inputs(n=37, d=24, v=131, scale=scale, seed=21)
    o = LossOptions(softcap=softcap)
    eps = 2e-7 if CUDA else 1e-8
    check_case(h, w, b, t, o, eps=eps)
    check_store(h, w, b, t, o, chunk_rows=16, eps=eps)


# ---------------------------------------------------------------------------------------------
# store: loss and gradients in the forward
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(STORE_CASES))
def test_store_fp32(name):
    kwargs, o = STORE_CASES[name]
    check_store(*make_inputs(**{**kwargs, "ignore_index": o.ignore_index}), o, chunk_rows=16)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_rows", [0, 16])  # one chunk (one rounding of dW), three (fp32 accumulator)
def test_store_bf16(reduction, chunk_rows):
    kwargs, o = STORE_CASES["everything_strided"]
    check_store(*make_inputs(dtype=torch.bfloat16, seed=4, **kwargs), o, reduction=reduction, chunk_rows=chunk_rows)


def test_store_two_chunks_bf16_accumulates_in_the_weight_dtype():
    """Two row chunks of a bf16 weight: the weight gradient is rounded twice (strategy.py's
    LOWP_ACCUMULATE_CHUNKS) and must still be within the tolerance."""
    from inductor_xent.strategy import LOWP_ACCUMULATE_CHUNKS

    assert LOWP_ACCUMULATE_CHUNKS >= 2
    check_store(*make_inputs(n=32, dtype=torch.bfloat16, bias=True, seed=9), LossOptions(z_loss=1e-3),
                chunk_rows=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scaled_gives_the_bits_of_torchs_product(dtype):
    """store's backward scales its saved gradients by the incoming scalar with a blocked kernel:
    the fp32 product rounded once (what Inductor's generated product gives; torch's eager CUDA
    product first rounds a 0-dim fp32 CUDA tensor to the 16-bit dtype), in a row-major or a
    transposed ([D, V] weight) layout; ``g * s`` itself for a layout with gaps."""
    gen = torch.Generator().manual_seed(3)
    g = (torch.randn(300, 70, generator=gen) * 5).to(dtype).to(DEVICE)
    s = torch.tensor(0.7123, device=DEVICE)
    for x in (g, g.t().contiguous().t()):
        got = launch.scaled(x, s)
        assert torch.equal(got, (x.float() * s).to(dtype)) and got.stride() == x.stride()
    gaps = g[:, :50]
    assert torch.equal(launch.scaled(gaps, s), gaps * s)


def test_store_memory_estimate_uses_the_store_tile():
    """strategy's extra-memory estimate (12 bytes of partials per row and STORE_TILE columns) uses
    the vocabulary tile of the store forward's GPU configs (configs.STORE_TABLE), 16-bit and fp32."""
    from inductor_xent import strategy

    assert set(configs.STORE_TABLE) == set(strategy.STORE_TILE)
    for itemsize, name in configs.STORE_TABLE.items():
        assert configs.CONFIGS[name].block_n == strategy.STORE_TILE[itemsize], name


@pytest.mark.parametrize("block, group", [(launch.COMBINE_BLOCK, launch.COMBINE_GROUP), (32, 32)])
def test_combine_reduces_many_splits_in_groups(block, group):
    """The split combine over more splits than one step takes (2·group + 6 splits: two full groups
    and a ragged one; 45 rows: a partial row block), against float64: lse, loss with smoothing and
    z-loss, the target's sech² sum, entropy, and the argmax of the first split at the row max when a
    later split ties it, in another group or in the same one. The default launch and 32 x 32."""
    gen = torch.Generator().manual_seed(21)
    n, splits, v = 45, 2 * group + 6, 9000
    m = torch.randn(splits, n, generator=gen, dtype=torch.float64) * 3
    s = torch.rand(splits, n, generator=gen, dtype=torch.float64) * 30 + 1
    zt = torch.zeros(splits, n, dtype=torch.float64)
    hit = torch.randint(0, splits, (n,), generator=gen)
    zt[hit, torch.arange(n)] = torch.randn(n, generator=gen, dtype=torch.float64)
    sz = torch.randn(splits, n, generator=gen, dtype=torch.float64) * 50
    a = -torch.rand(splits, n, generator=gen, dtype=torch.float64) * 20
    arg = torch.randint(0, v, (splits, n), generator=gen, dtype=torch.int32)
    m[5, :10] = m[group + 3, :10] = m[:, :10].max(0).values + 1  # a tie across groups: split 5 wins
    m[9, 10:20] = m[2, 10:20] = m[:, 10:20].max(0).values + 1  # a tie within a group: split 2 wins
    st = torch.rand(splits, n, generator=gen, dtype=torch.float64)
    target = torch.randint(0, v, (n,), generator=gen)
    target[3] = -100
    part = torch.stack([m, s, zt, sz, st, a]).float()
    m, s, zt, sz, st, a = part.double().unbind(0)  # what the kernel reads
    outs = [torch.empty(n, dtype=torch.float32, device=DEVICE) for _ in range(5)]
    argmax = torch.empty(n, dtype=torch.int64, device=DEVICE)
    eps, zl = 0.1, 1e-3
    _forward.lce_combine_kernel[(-(-n // block),)](
        part.to(DEVICE), arg.to(DEVICE), target.to(DEVICE), *outs[:3], outs[4], outs[3], argmax,
        n, v, splits, -100, eps, zl,
        NEED_SUM_Z=True, NEED_ST=True, NEED_ENTROPY=True, NEED_ARGMAX=True,
        BLOCK=block, GROUP=group)
    big = m.max(0).values
    total = (s * (m - big).exp()).sum(0)
    lse = big + total.log()
    loss = total.log() + (1 - eps) * (big - zt.sum(0)) + zl * lse**2 + eps * (big - sz.sum(0) / v)
    loss[3] = 0.0
    ent = total.log() - ((m - big).exp() * (a + (m - big) * s)).sum(0) / total
    ent[3] = 0.0
    first = torch.where(m == big, torch.arange(splits)[:, None], splits).min(0).values
    loss_k, lse_k, lo_k, ent_k, st_k = (x.cpu().double() for x in outs)
    torch.testing.assert_close(lse_k, lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(st_k, st.sum(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_k, loss, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ent_k, ent, rtol=1e-5, atol=1e-5)
    assert torch.equal(argmax.cpu(), arg[first, torch.arange(n)].long())
    assert (first[:10] == 5).all() and (first[10:20] == 2).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_in_place_writes_the_same_bits_into_g(dtype):
    """In place: the same bits as the out-of-place product, in ``g`` itself; an upstream 1 leaves
    ``g`` as it was (on the GPU the kernel then reads and writes nothing)."""
    gen = torch.Generator().manual_seed(4)
    g = (torch.randn(300, 70, generator=gen) * 5).to(dtype).to(DEVICE)
    for x in (g.clone(), g.t().contiguous().t()):
        want = (x.float() * 0.7123).to(dtype)
        got = launch.scaled(x, torch.tensor(0.7123, device=DEVICE), in_place=True)
        assert got is x and torch.equal(x, want) and x.stride() == got.stride()
        before = x.clone()
        assert launch.scaled(x, torch.tensor(1.0, device=DEVICE), in_place=True) is x
        assert torch.equal(x, before)
    gaps = g.clone()[:, :50]
    want = gaps * 3.0
    assert launch.scaled(gaps, torch.tensor(3.0, device=DEVICE), in_place=True) is gaps
    assert torch.equal(gaps, want)


def test_store_backward_scales_in_place_only_when_the_graph_is_freed(monkeypatch):
    """store's backward scales its saved gradients in place when autograd frees the graph after it,
    and out of place under retain_graph: a second backward through the same graph, with another
    upstream gradient, gets its own gradients, and the first call's results are not changed."""
    monkeypatch.setenv("INDUCTOR_XENT_IMPL", "triton")
    seen = []
    real = launch.scaled

    def spy(g, s, in_place=False):
        seen.append(in_place)
        return real(g, s, in_place=in_place)

    monkeypatch.setattr(launch, "scaled", spy)
    h, w, _, t = make_inputs(dtype=torch.bfloat16, seed=16)
    hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = inductor_xent.linear_cross_entropy(hh, ww, t, strategy="store")
    first = torch.autograd.grad(loss, (hh, ww), retain_graph=True)
    kept = [x.clone() for x in first]
    second = torch.autograd.grad(loss, (hh, ww), torch.tensor(0.25, device=DEVICE), retain_graph=True)
    third = torch.autograd.grad(loss, (hh, ww), torch.tensor(0.5, device=DEVICE))  # frees the graph
    assert seen == [False, False, False, False, True, True]
    for a, k, b, c in zip(first, kept, second, third):
        assert torch.equal(a, k)  # untouched by the later calls
        assert torch.equal(b, (a.float() * 0.25).to(a.dtype)) and torch.equal(c, (a.float() * 0.5).to(a.dtype))
    # and the plain training call: loss.backward() into .grad, the result of a retained call's bits
    loss = inductor_xent.linear_cross_entropy(hh, ww, t, strategy="store")
    loss.backward()
    assert torch.equal(hh.grad, first[0]) and torch.equal(ww.grad, first[1])


def test_log_prob_store_writes_dz_over_e_only_when_the_graph_is_freed(monkeypatch):
    """The functional API's log-prob store (which drops e) writes its dz over e in an eager backward
    that frees the graph, and leaves e under retain_graph: a second backward through the same graph
    then gets the first one's gradients scaled, and the last (freeing) call too."""
    monkeypatch.setenv("INDUCTOR_XENT_IMPL", "triton")
    seen = []
    real = launch.log_probs_store_backward

    def spy(*args, in_place=False, **kw):
        seen.append(in_place)
        return real(*args, in_place=in_place, **kw)

    monkeypatch.setattr(launch, "log_probs_store_backward", spy)
    h, w, _, t = make_inputs(dtype=torch.bfloat16, seed=18)
    hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    up = torch.randn(2, h.shape[0], generator=torch.Generator().manual_seed(19)).to(DEVICE)
    out = inductor_xent.linear_log_probs(hh, ww, t, temperature=0.7, entropy=True, strategy="store")
    total = (out.log_probs * up[0] + out.entropy * up[1]).sum()
    first = [x.clone() for x in torch.autograd.grad(total, (hh, ww), retain_graph=True)]
    second = torch.autograd.grad(total * 0.5, (hh, ww), retain_graph=True)
    third = torch.autograd.grad(total * 0.25, (hh, ww))  # frees the graph: in place
    assert seen == [False, False, True]
    for a, b, c in zip(first, second, third):  # the chunked and the in-place sums: each rounded once
        tol = dict(rtol=1e-2, atol=1e-2 * a.float().abs().max().item())
        torch.testing.assert_close(b.float(), a.float() * 0.5, **tol)
        torch.testing.assert_close(c.float(), a.float() * 0.25, **tol)


def test_store_op_called_directly_keeps_the_gradients_it_returned(monkeypatch):
    """The op's gradient outputs are its caller's when it calls the op itself: the backward then
    scales out of place, and what the caller holds does not change."""
    from inductor_xent import ops

    monkeypatch.setenv("INDUCTOR_XENT_IMPL", "triton")
    h, w, _, t = make_inputs(dtype=torch.bfloat16, seed=17)
    hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss, gh, gw, _, _ = ops.STORE(hh, ww, None, t, -100, 0.0, 1.0, None, 0.0, "mean", 0, "1x", True, True,
                                    False)
    held = gh.clone(), gw.clone()
    (loss * 0.5).backward()
    assert torch.equal(gh, held[0]) and torch.equal(gw, held[1])
    assert torch.equal(hh.grad, (held[0].float() * 0.5).to(gh.dtype))
    assert torch.equal(ww.grad, (held[1].float() * 0.5).to(gw.dtype))


def test_store_compiles_with_the_triton_backward(monkeypatch):
    """Through torch.compile (AOTAutograd traces store's backward with fake tensors: the scaling
    kernel must not launch there), compiled gradients equal eager ones bitwise."""
    monkeypatch.setenv("INDUCTOR_XENT_IMPL", "triton")
    h, w, _, t = make_inputs(dtype=torch.bfloat16, seed=15)

    def grads(fn):
        hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        loss = fn(hh, ww)
        return [loss.detach(), *torch.autograd.grad(loss * 0.5, (hh, ww))]  # exact in every dtype

    def fn(hh, ww):
        return inductor_xent.linear_cross_entropy(hh, ww, t, strategy="store")

    torch._dynamo.reset()
    for x, y in zip(grads(torch.compile(fn, backend="aot_eager", fullgraph=True)), grads(fn)):
        assert torch.equal(x, y)


def test_store_all_ignored_mean_is_nan_with_zero_gradients():
    h, w, b, t = make_inputs(bias=True, seed=10)
    t[:] = -100
    loss, gh, gw, gb = launch.store(h, w, b, t, LossOptions(), "mean", 16, (True, True, True),
                                    fp32_accumulate=op_fp32_accumulate(h, w, 16, (True, True, True)))
    assert torch.isnan(loss)
    assert not gh.any() and not gw.any() and not gb.any()


# ---------------------------------------------------------------------------------------------
# through the public function and the op, INDUCTOR_XENT_IMPL=triton
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["recompute", "store"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_public_function(monkeypatch, strategy, dtype, reduction):
    monkeypatch.setenv("INDUCTOR_XENT_IMPL", "triton")
    h, w, b, t = make_inputs(dtype=dtype, bias=True, scale=4.0, seed=11)
    kw = dict(bias=None, reduction=reduction, label_smoothing=0.1, softcap=6.0, z_loss=1e-3)
    if strategy == "store":
        kw["label_smoothing"] = 0.0  # not with a softcap (strategy.py)
    g = (torch.rand(37, generator=torch.Generator().manual_seed(12)) + 0.5).to(DEVICE)  # non-uniform for "none"

    def run(fn, hh, ww, bb, torch_way=False):
        leaves = [x.detach().clone().requires_grad_() for x in (hh, ww, bb)]
        if torch_way:
            z = F.linear(leaves[0], leaves[1], leaves[2]).float()
            z = kw["softcap"] * torch.tanh(z / kw["softcap"])
            out = F.cross_entropy(z, t, reduction=reduction, label_smoothing=kw["label_smoothing"])
            lse = torch.logsumexp(z, -1)
            zl = torch.where(t != -100, kw["z_loss"] * lse**2, 0.0)
            out = out + (zl if reduction == "none" else zl.sum() / ((t != -100).sum() if reduction == "mean" else 1))
        elif fn is inductor_xent.linear_cross_entropy:
            out = fn(leaves[0], leaves[1], t, strategy=strategy, **{**kw, "bias": leaves[2]})
        else:
            out = fn(leaves[0], leaves[1], t, **{**kw, "bias": leaves[2]})
        (out * g.to(out.dtype) if reduction == "none" else out).sum().backward()
        return [out.detach()] + [x.grad for x in leaves]

    ours = run(inductor_xent.linear_cross_entropy, h, w, b)
    ref = run(reference.linear_cross_entropy, h.double(), w.double(), b.double())
    pt = run(None, h, w, b, torch_way=True)
    for name, x, r, p in zip(("loss", "hidden", "weight", "bias"), ours, ref, pt):
        assert_within_torch_error(x, p, r, k=K, floor=EPS[dtype], what=name)


# ---------------------------------------------------------------------------------------------
# log-probabilities, entropy, argmax (RL and evaluation heads)
# ---------------------------------------------------------------------------------------------
def _lp_opts(temperature=1.0, logit_scale=1.0, softcap=None, ignore_index=-100):
    scale, cap = fold_temperature(logit_scale, softcap, temperature)
    return LossOptions(ignore_index, 0.0, scale, cap, 0.0)


def lp_and_grads(h, w, b, t, kw, ups, *, torch_way):
    """(log_probs, entropy, lse) and the gradients of Σ(a·log_probs + e·entropy + c·lse) w.r.t.
    (hidden, weight, bias). torch_way: logits from F.linear in the input dtype, then .float()."""
    leaves = [x.detach().clone().requires_grad_() for x in (h, w) + ((b,) if b is not None else ())]
    bias = leaves[2] if b is not None else None
    if torch_way:
        lp, ent, _ = eager_log_probs(leaves[0], leaves[1], t, bias=bias, **kw)
    else:
        lp, ent, _ = reference.linear_log_probs(leaves[0], leaves[1], t, bias=bias, **kw)
    z = F.linear(leaves[0], leaves[1], bias).to(lp.dtype) * kw.get("logit_scale", 1.0)
    if kw.get("softcap") is not None:
        z = kw["softcap"] * torch.tanh(z / kw["softcap"])
    lse = torch.logsumexp(z / kw.get("temperature", 1.0), -1)
    outs = (lp, ent, lse)
    total = sum((u.to(x.dtype) * x).sum() for u, x in zip(ups, outs))
    return [x.detach() for x in outs], list(torch.autograd.grad(total, leaves))


def check_log_probs(h, w, b, t, kw, *, seed=1, eps=None, grad_lse=True, store_rows=None, in_place=False):
    """log_probs_forward + backward (with the entropy term) through the launchers against the
    float64 oracle, relative to torch; argmax a row maximum of the float64 logits. ``store_rows``:
    log_probs_store keeping that many rows' exp-logits and log_probs_store_backward instead
    (``in_place``: its dz written over them, the stored rows' e then no longer theirs)."""
    n = h.shape[0]
    g = torch.Generator().manual_seed(seed)
    ups = [(torch.randn(n, generator=g) * s).to(DEVICE) for s in (1.0, 0.5, 0.3 if grad_lse else 0.0)]
    exact, exact_grads = lp_and_grads(*[None if x is None else x.double() for x in (h, w, b)], t, kw, ups,
                                      torch_way=False)
    same, same_grads = lp_and_grads(h, w, b, t, kw, ups, torch_way=True)
    o = _lp_opts(**kw)
    if store_rows is None:
        lp, ent, arg, lse, lse_lo = launch.log_probs_forward(h, w, b, t, o, True, True)
    else:
        lp, ent, arg, lse, lse_lo, e, m, st = launch.log_probs_store(h, w, b, t, o, True, True, store_rows)
        assert e.shape[0] == m.shape[1] == min(store_rows, n) and st.shape == ((e.shape[0],) if o.softcap else (0,))
    assert lp.dtype == ent.dtype == lse.dtype == torch.float32 and arg.dtype == torch.long
    eps = EPS[h.dtype] if eps is None else eps
    for name, ours, pt, ref in zip(("log_probs", "entropy", "lse"), (lp, ent, lse), same, exact):
        assert rel_err(ours, ref) <= K * rel_err(pt, ref) + eps, (name, rel_err(ours, ref), rel_err(pt, ref))
    ignored = t == o.ignore_index
    assert torch.all(lp[ignored] == 0) and torch.all(ent[ignored] == 0)
    z = reference.logits(h.double(), w.double(), None if b is None else b.double(), o)
    top = z.amax(-1)
    assert torch.all(z.gather(1, arg[:, None])[:, 0] >= top - 1e-5 * (1 + top.abs())), "argmax"

    args = (-ups[0], ups[2], h, w, b, t, lse, lse_lo, o, (True, True, b is not None))
    if store_rows is None:
        ours = launch.backward(*args, grad_entropy=ups[1], entropy=ent)
    else:
        ours = launch.log_probs_store_backward(*args, grad_entropy=ups[1], entropy=ent, e=e, m=m, st=st,
                                               in_place=in_place)
    for name, x, pt, ref, src in zip(("hidden", "weight", "bias"), ours, same_grads, exact_grads, (h, w, b)):
        assert x.dtype == src.dtype and x.shape == src.shape, name
        assert rel_err(x, ref) <= K * rel_err(pt, ref) + eps, (name, rel_err(x, ref), rel_err(pt, ref))
    return (lp, ent, arg, lse, lse_lo) + tuple(ours)


LP_CASES = {
    # the plain log-softmax gather at temperature 1; the all-ignored first row block gives 0
    "plain": (dict(), dict()),
    # a sampling temperature below 1 (sharper): logit_scale / T
    "temperature": (dict(), dict(temperature=0.6)),
    # bias, scale, a softcap that bites (logits std ~6 against a cap of 3), then the temperature
    "bias_scale_softcap_temperature": (dict(bias=True, scale=6.0), dict(temperature=1.4, logit_scale=0.7, softcap=3.0)),
    # an ignore_index that is also a valid class id
    "ignore_valid_id": (dict(ignore_index=5), dict(ignore_index=5)),
    # a [D, V] weight passed transposed and a strided hidden
    "everything_strided": (dict(bias=True, scale=4.0, transposed_weight=True, strided_hidden=True),
                           dict(temperature=0.8, logit_scale=1.3, softcap=5.0)),
}


@pytest.mark.parametrize("name", list(LP_CASES))
def test_log_probs_fp32(name):
    make_kw, kw = LP_CASES[name]
    check_log_probs(*make_inputs(**make_kw), kw)


@pytest.mark.parametrize("name", ["plain", "everything_strided"])
def test_log_probs_bf16(name):
    make_kw, kw = LP_CASES[name]
    check_log_probs(*make_inputs(dtype=torch.bfloat16, seed=3, **make_kw), kw)


# the log-prob op's store (launch.log_probs_store): every row's exp-logits kept (37 of 37 rows), the
# first 20 only (a stored part whose valid rows end inside a row block, the rest recomputed), none
STORE_ROWS = [37, 20, 0]


@pytest.mark.parametrize("store_rows", STORE_ROWS)
@pytest.mark.parametrize("name", list(LP_CASES))
def test_log_probs_store_fp32(name, store_rows):
    make_kw, kw = LP_CASES[name]
    check_log_probs(*make_inputs(**make_kw), kw, store_rows=store_rows)


@pytest.mark.parametrize("store_rows", STORE_ROWS[:2])
@pytest.mark.parametrize("name", ["plain", "bias_scale_softcap_temperature", "everything_strided"])
def test_log_probs_store_bf16(name, store_rows):
    """16-bit inputs: the stored rows compacted (rows.compacts), their dz read through the order."""
    make_kw, kw = LP_CASES[name]
    check_log_probs(*make_inputs(dtype=torch.bfloat16, seed=3, **make_kw), kw, store_rows=store_rows)


@pytest.mark.parametrize("store_rows", STORE_ROWS[:2])
@pytest.mark.parametrize("name, dtype", [("plain", torch.float32), ("bias_scale_softcap_temperature", torch.float32),
                                         ("everything_strided", torch.bfloat16), ("ignore_valid_id", torch.bfloat16)])
def test_log_probs_store_in_place(name, dtype, store_rows):
    """dz written over the stored exp-logits (launch._stored_in_place: the whole vocabulary at once,
    every row walked), with and without recomputed rows after them: as accurate as the chunked
    stored backward, and e really overwritten (a test that would pass with the chunked path fails
    there)."""
    make_kw, kw = LP_CASES[name]
    h, w, b, t = make_inputs(dtype=dtype, seed=5, **make_kw)
    o = _lp_opts(**kw)
    *_, e, _, _ = launch.log_probs_store(h, w, b, t, o, True, True, store_rows)
    before = e.clone()
    real = launch.log_probs_store

    def keep(*args):  # the store check_log_probs runs, with its e watched
        out = real(*args)
        watched.append(out[5])
        return out

    watched = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch, "log_probs_store", keep)
        check_log_probs(h, w, b, t, kw, store_rows=store_rows, in_place=True)
    (e,) = watched
    assert torch.equal(before, e.view(before.dtype)) is False


def test_log_probs_store_many_chunks(monkeypatch):
    """The stored backward in chunks of one store tile (its tile maxima indexed per chunk), bf16 with
    the rows compacted and without an lse gradient (the RL case: the ignored rows are not live)."""
    monkeypatch.setattr(configs, "STORED_BWD_CHUNK_BYTES", 1)
    v = 131 if not CUDA else 701
    h, w, b, t = make_inputs(n=50, v=v, dtype=torch.bfloat16, bias=True, scale=4.0, seed=31)
    check_log_probs(h, w, b, t, dict(temperature=0.7, softcap=6.0), store_rows=50, grad_lse=False)


def test_log_probs_store_never_reads_rows_without_gradient(monkeypatch):
    """The stored backward walks only the rows with an incoming gradient: NaN in the ignored rows'
    hidden states (kept in e, with a NaN lse) leaves every gradient equal to that of the valid rows
    alone; computing every row (skipping off) spreads the NaN. Fails if those rows are read."""
    block = 128 if CUDA else 16
    n = 3 * block
    h, w, b, t = make_inputs(n=n, bias=True, seed=32, dtype=torch.bfloat16)  # 16-bit: rows.compacts
    t[:] = torch.randint(0, w.shape[0], (n,), generator=torch.Generator().manual_seed(33)).to(t.device)
    t[torch.arange(n, device=t.device) % 3 == 2] = -100
    keep = t != -100
    h = h.clone()
    h[~keep] = float("nan")
    o = _lp_opts(temperature=0.8)
    g = torch.Generator().manual_seed(34)
    ups = [torch.randn(n, generator=g).to(DEVICE) for _ in range(2)]

    def grads(hh, tt, ua, ub):
        lp, ent, _, lse, lse_lo, e, m, st = launch.log_probs_store(hh, w, b, tt, o, True, False, hh.shape[0])
        return launch.log_probs_store_backward(-ua, torch.zeros_like(ua), hh, w, b, tt, lse, lse_lo, o,
                                               (True, True, True), grad_entropy=ub, entropy=ent, e=e, m=m, st=st)

    gh, gw, gb = grads(h, t, *ups)
    gh_v, gw_v, gb_v = grads(h[keep], t[keep], ups[0][keep], ups[1][keep])
    assert torch.equal(gw, gw_v) and torch.equal(gb, gb_v)
    assert torch.equal(gh[keep], gh_v) and torch.equal(gh[~keep], torch.zeros_like(gh[~keep]))
    monkeypatch.setenv("INDUCTOR_XENT_SKIP_IGNORED", "0")
    assert grads(h, t, *ups)[1].isnan().any()


@pytest.mark.parametrize("store_rows, in_place", [(10**6, False), (10**6, True), (1, False), (1, True)])
def test_log_probs_store_skips_ignored_rows(store_rows, in_place, monkeypatch):
    """log_probs_store with ``skip_ignored`` (entropy and argmax asked for): the valid rows go first,
    the first S of them keep their exp-logits and no kernel computes an ignored row (its argmax 0); the backward finds the order again
    (``compacted``). NaN in the ignored rows' hidden states leaves the outputs and gradients those of
    the valid rows alone (the same rows kept): the same bits where every row is kept, within 1e-5
    where the rows past S recompute (their vocabulary split follows their number). The ignored rows'
    outputs and hidden gradient are 0. Skipping off puts their NaN into the lse: fails if they are
    computed. e's and m's unwritten rows hold NaN: fails if the backward (the in-place one walks
    every row it is given) reads a row past the count. The valid rows fill whole row blocks in each
    part (kept, recomputed): past a count the GEMMs read rows up to the next K step, with a zero
    gradient, which NaN would spoil."""
    block = 128 if CUDA else 16  # rows_mm's and the forward's row block
    n = 3 * block
    store_rows = block if store_rows == 1 else store_rows  # one block of valid rows kept, one recomputed
    h, w, b, t = make_inputs(n=n, bias=True, seed=35, dtype=torch.bfloat16)  # 16-bit: rows.compacts
    t[:] = torch.randint(0, w.shape[0], (n,), generator=torch.Generator().manual_seed(36)).to(t.device)
    t[torch.arange(n, device=t.device) % 3 == 0] = -100  # two blocks of valid rows
    keep = t != -100
    h = h.clone()
    h[~keep] = float("nan")
    o = _lp_opts(temperature=0.8, softcap=20.0)
    g = torch.Generator().manual_seed(37)
    ua, ub = (torch.randn(n, generator=g).to(DEVICE) for _ in range(2))
    empty = launch.stored_empty  # e and m uninitialised: NaN here, so that reading an unwritten row shows
    monkeypatch.setattr(launch, "stored_empty", lambda *a: tuple(x.fill_(float("nan")) for x in empty(*a)))

    def run(hh, tt, ga, gb, skip):
        lp, ent, arg, lse, lse_lo, e, m, st = launch.log_probs_store(hh, w, b, tt, o, True, True, store_rows, skip)
        grads = launch.log_probs_store_backward(
            -ga, torch.zeros_like(ga), hh, w, b, tt, lse, lse_lo, o, (True, True, True), grad_entropy=gb, entropy=ent,
            e=e, m=m, st=st, in_place=in_place, compacted=launch.store_skips(skip, hh.dtype))
        return (lp, ent, lse, arg), grads

    (lp, ent, lse, arg), (gh, gw, gb) = run(h, t, ua, ub, True)
    (lp_v, ent_v, lse_v, arg_v), (gh_v, gw_v, gb_v) = run(h[keep], t[keep], ua[keep], ub[keep], False)
    assert torch.equal(arg[keep], arg_v) and torch.equal(arg[~keep], torch.zeros_like(arg[~keep])), "the argmax too"
    same = torch.equal if store_rows >= n else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    for ours, alone in ((lp, lp_v), (ent, ent_v), (lse, lse_v)):
        assert same(ours[keep], alone)
        assert torch.equal(ours[~keep].abs(), torch.zeros_like(ours[~keep]))
    assert torch.equal(gh[~keep], torch.zeros_like(gh[~keep]))
    # in place both runs' GEMMs are rows_mm, bounded by the count or over every row: the same tiles
    assert same(gh[keep], gh_v) and same(gw.float(), gw_v.float()) and same(gb.float(), gb_v.float())
    monkeypatch.setenv("INDUCTOR_XENT_SKIP_IGNORED", "0")
    assert run(h, t, ua, ub, True)[0][2].isnan().any()


@pytest.mark.slow(s=32)
@pytest.mark.usefixtures("row_invariant_dot")
def test_batch_invariant_forward(monkeypatch):
    """INDUCTOR_XENT_BATCH_INVARIANT=1 (issue 25): each row's log-prob, entropy, argmax and
    logsumexp are the same bits computed in a batch of 21 rows and inside batches of 64 and 100 rows
    at shuffled positions (150, 400, 600 on a GPU); without it the vocabulary split follows N (checked: the test would not
    show anything if the splits agreed anyway)."""
    monkeypatch.setattr(launch, "_num_sms", lambda device: 64)  # room for N-dependent splits
    v = 701 if not CUDA else 50257
    # rows alone, and the batches they sit in: on a GPU (128-row blocks) 21 and 100 rows are one row
    # block each and take the same split anyway (H100: (50, 4) both)
    few, sizes = (21, (64, 100)) if not CUDA else (150, (400, 600))
    h, w, b, t = make_inputs(n=sizes[-1], v=v, dtype=torch.bfloat16, bias=True, scale=3.0, seed=41)
    cfg = configs.forward_config(h.dtype)
    assert launch._splits(cfg, h[:few], v) != launch._splits(cfg, h, v)
    monkeypatch.setenv("INDUCTOR_XENT_BATCH_INVARIANT", "1")
    assert launch._splits(cfg, h[:few], v) == launch._splits(cfg, h, v)
    o = _lp_opts(temperature=0.7, softcap=5.0)
    alone = launch.log_probs_forward(h[:few], w, b, t[:few], o, True, True)
    for n, seed in zip(sizes, (42, 43)):
        g = torch.Generator().manual_seed(seed)
        others = few + torch.randperm(sizes[-1] - few, generator=g)[:n - few]
        order = torch.cat([torch.arange(few), others])[torch.randperm(n, generator=g)].to(DEVICE)
        inside = launch.log_probs_forward(h[order], w, b, t[order], o, True, True)
        where = (order[:, None] == torch.arange(few, device=DEVICE)).int().argmax(0)  # row r's position
        for a, c in zip(alone, inside):
            assert torch.equal(a, c[where]), n


def test_log_probs_many_splits_and_chunks(monkeypatch):
    """The entropy and argmax partials combined over 5 vocabulary splits, the backward in chunks
    of one tile; without an lse gradient (the usual RL case)."""
    monkeypatch.setattr(launch, "_num_sms", lambda device: 64)
    monkeypatch.setattr(configs, "BWD_EXTRA_BYTES", 0)
    monkeypatch.setattr(configs, "BWD_MIN_CHUNK_BYTES", 1)
    v = 131 if not CUDA else 701
    check_log_probs(*make_inputs(bias=True, seed=5, v=v), dict(temperature=0.7, softcap=4.0), grad_lse=False)
    check_log_probs(*make_inputs(dtype=torch.bfloat16, bias=True, seed=6, v=v), dict(temperature=1.3), grad_lse=False)


@pytest.mark.parametrize("many_splits", [False, True])
def test_argmax_ties_take_the_first_column(monkeypatch, many_splits):
    """Exact ties (equal weight rows) resolve to the smallest index as torch.argmax, within a tile
    and across tiles and splits (the interpreter's 32-column tiles: 40 and 45 in tile 1, 70 and 71
    in tile 2, 100 in tile 3, 130 in tile 4; on the GPU's 128 or 256 columns, 130 is the other tile)."""
    if many_splits:
        monkeypatch.setattr(launch, "_num_sms", lambda device: 64)
        assert configs.vocab_split(3, 5, 64)[0] == 5  # one tile per split
    d, v = 24, 131
    w = torch.randn(v, d, generator=torch.Generator().manual_seed(14)) * 0.01
    w[[130, 70, 45, 40], 0] = 5.0  # the logits of rows with hidden e0 tie at these columns
    w[[100, 71, 70], 1] = 5.0  # and of rows with hidden e1 at these
    h = torch.zeros(37, d)
    h[:20, 0] = 1.0
    h[20:, 1] = 1.0
    t = torch.randint(0, v, (37,), generator=torch.Generator().manual_seed(15))
    _, _, arg, _, _ = launch.log_probs_forward(h.to(DEVICE), w.to(DEVICE), None, t.to(DEVICE), _lp_opts(),
                                               False, True)
    assert arg.tolist() == [40] * 20 + [70] * 17
    assert arg.tolist() == F.linear(h, w).argmax(-1).tolist()


def test_log_probs_large_common_logit():
    """Every logit 2^24: log-prob −log 8 and entropy log 8 exactly (relative to the max; lse − Σp·z
    cancels to 0 or 2 in fp32), the entropy's gradient exactly 0 (p uniform: log p + H = 0)."""
    h = torch.ones(3, 1, device=DEVICE)
    w = torch.full((8, 1), 2.0**24, device=DEVICE)
    t = torch.tensor([0, 3, 7], device=DEVICE)
    o = _lp_opts()
    lp, ent, arg, lse, lse_lo = launch.log_probs_forward(h, w, None, t, o, True, True)
    torch.testing.assert_close(lp, torch.full_like(lp, -math.log(8)), rtol=1e-6, atol=0)
    torch.testing.assert_close(ent, torch.full_like(ent, math.log(8)), rtol=1e-6, atol=0)
    assert arg.tolist() == [0, 0, 0]
    ones = torch.ones(3, device=DEVICE)
    _, gw, _ = launch.backward(0 * ones, 0 * ones, h, w, None, t, lse, lse_lo, o, (False, True, False),
                               grad_entropy=ones, entropy=ent)
    torch.testing.assert_close(gw, torch.zeros_like(gw), rtol=0, atol=1e-6)


def test_log_probs_deterministic_and_flags():
    """Bitwise the same twice; entropy / argmax not asked for are (0,) and change nothing else."""
    h, w, b, t = make_inputs(dtype=torch.bfloat16, bias=True, seed=8)
    o = _lp_opts(temperature=0.9, softcap=6.0)
    up = torch.rand(37, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    runs = []
    for _ in range(2):
        lp, ent, arg, lse, lse_lo = launch.log_probs_forward(h, w, b, t, o, True, True)
        runs.append((lp, ent, arg) + launch.backward(-up, 0 * up, h, w, b, t, lse, lse_lo, o, (True, True, True),
                                                     grad_entropy=up, entropy=ent))
    for x, y in zip(*runs):
        assert torch.equal(x, y)
    lp, ent, arg, lse, _ = launch.log_probs_forward(h, w, b, t, o, False, False)
    assert ent.shape == arg.shape == (0,)
    # another specialisation of the kernel: the compiler may contract differently (FMA)
    torch.testing.assert_close(lp, runs[0][0], rtol=1e-6, atol=1e-6)
    loss, lse_ce, _ = launch.forward(h, w, b, t, o)  # log_prob = −loss of the same options, same kernel
    assert torch.equal(lp, -loss) and torch.equal(lse, lse_ce)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_probs_grpo_through_the_op(monkeypatch, dtype):
    """A GRPO loss (clipped ratio, KL penalty, entropy bonus, mask) on linear_log_probs with
    INDUCTOR_XENT_IMPL=triton: loss and gradients within a multiple of eager's error."""
    monkeypatch.setenv("INDUCTOR_XENT_IMPL", "triton")
    bsz, seq = 3, 13
    h, w, _, _ = make_inputs(n=bsz * seq, dtype=dtype, seed=16)
    h = h.view(bsz, seq, -1)
    t = torch.randint(0, w.shape[0], (bsz, seq), generator=torch.Generator().manual_seed(17)).to(DEVICE)
    batch = grpo_batch(bsz, seq, seed=18, device=DEVICE)
    t[~batch["mask"]] = -100
    kw = dict(temperature=0.7, softcap=8.0)
    check_grpo(lambda hh, ww: inductor_xent.linear_log_probs(hh, ww, t, entropy=True, **kw)[:2], h, w, t, kw, batch,
               k=K, floor=EPS[dtype])


# ---------------------------------------------------------------------------------------------
# write_logits: the raw logit tiles, for a compiled function that returns the logits too (escape.py)
# ---------------------------------------------------------------------------------------------
# (kernel, bias, dtype): each kernel in both dtypes, with and without a bias, three store chunks once
WRITE_CASES = [("forward", True, torch.float32), ("forward", False, torch.bfloat16),
               ("store_one_chunk", True, torch.bfloat16), ("store_chunks", False, torch.float32)]


@pytest.mark.parametrize("kind, bias, dtype", WRITE_CASES)
def test_write_logits_is_the_lm_head_output(kind, bias, dtype, monkeypatch):
    """Both forward kernels write hidden @ W.T + b rounded once to the input dtype, every row and
    column (unaligned V, a partial last row block, three store chunks), and compute the same loss
    as without writing (the epilogue is otherwise unchanged). Returned logits need every row, so
    store does not skip the ignored ones then: the comparison is with skipping off."""
    monkeypatch.setenv("INDUCTOR_XENT_SKIP_IGNORED", "0")
    h, w, b, t = make_inputs(n=37, d=16, v=67, dtype=dtype, bias=bias, seed=11)
    o = LossOptions(softcap=4.0, logit_scale=0.5)
    exact = F.linear(h.double(), w.double(), None if b is None else b.double())
    logits = torch.full((h.shape[0], w.shape[0]), float("nan"), dtype=dtype, device=DEVICE)
    if kind == "forward":
        with_logits = launch.forward(h, w, b, t, o, logits=logits)
        without = launch.forward(h, w, b, t, o)
    else:
        chunk = 16 if kind == "store_chunks" else 0
        args = (h, w, b, t, o, "mean", chunk, (True, True, bias))
        acc = op_fp32_accumulate(h, w, chunk, args[-1])
        with_logits = launch.store(*args, fp32_accumulate=acc, logits=logits)
        without = launch.store(*args, fp32_accumulate=acc)
    for a, c in zip(with_logits, without):
        assert torch.equal(a, c)
    # one rounding of the fp32 sum to the output dtype (the interpreter truncates: up to one ulp more)
    ulp = torch.finfo(dtype).eps * (1.0 if CUDA else 2.0)
    err = ((logits.double() - exact).abs() / exact.abs().clamp_min(1.0)).max().item()
    assert err <= ulp + (1e-6 if dtype == torch.float32 else 0.0), err


# ---------------------------------------------------------------------------------------------
# ignored rows: store moves the valid rows first and its kernels stop at their count (rows.py)
# ---------------------------------------------------------------------------------------------
# (pattern, chunk_rows): no row ignored; every row; a prompt-like prefix per "sequence" (two chunks,
# the second with fewer valid rows than a block; one chunk, whose weight gradient is one product);
# scattered padding over three chunks, one all-ignored
SKIP_CASES = [("none", 0), ("all", 16), ("prefix", 32), ("prefix", 0), ("scattered", 16)]


def _ignore(t, pattern):
    n = t.shape[0]
    if pattern == "all":
        t[:] = -100
    elif pattern == "prefix":  # two "sequences" of n/2 rows, the first 60 % of each a prompt
        for s in range(2):
            t[s * n // 2: s * n // 2 + int(0.6 * n / 2)] = -100
    elif pattern == "scattered":
        t[torch.arange(n, device=t.device) % 3 != 1] = -100
        t[16:32] = -100  # with the valid rows moved first, the last chunk holds none
    return t


@pytest.mark.parametrize("pattern, chunk", SKIP_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_skips_ignored_rows(pattern, chunk, dtype, monkeypatch):
    """The store against the oracle, with a bias and a [D, V] weight passed transposed (rows_mm's
    pointer path, a transposed grad_weight), and the ignored rows' grad_hidden exactly 0: compacted in
    bf16, dense in fp32 (rows.compacts); one chunk's two products make the gradients (rows.row_grads)."""
    calls, row_grads = [], rows.row_grads
    monkeypatch.setattr(rows, "row_grads", lambda *a, **k: calls.append(1) or row_grads(*a, **k))
    h, w, b, t = make_inputs(n=48, dtype=dtype, bias=True, seed=21, transposed_weight=pattern == "prefix")
    t = _ignore(t, pattern)
    _, (gh, gw, _) = check_store(h, w, b, t, LossOptions(z_loss=1e-3), reduction="mean", chunk_rows=chunk)
    assert torch.equal(gh[t == -100], torch.zeros_like(gh[t == -100]))
    assert gw.stride() == w.stride()  # a [D, V] weight's gradient is the .t() of a contiguous one too
    assert len(calls) == (chunk == 0 and dtype == torch.bfloat16), calls


def test_store_never_reads_ignored_rows(monkeypatch):
    """With the valid count a multiple of the row block, nothing reads an ignored row: NaN there
    leaves the loss and every gradient finite and equal to those of the valid rows alone. Computing
    every row (INDUCTOR_XENT_SKIP_IGNORED=0) spreads the NaN into grad_weight: this test fails if
    the rows are not skipped."""
    block = 128 if CUDA else 16  # rows_mm's and the store forward's row block
    n = 3 * block
    h, w, b, t = make_inputs(n=n, bias=True, seed=22, dtype=torch.bfloat16)  # 16-bit: rows.compacts
    t[:] = torch.randint(0, w.shape[0], (n,), generator=torch.Generator().manual_seed(23)).to(t.device)
    t[torch.arange(n, device=t.device) % 3 == 0] = -100  # two blocks of valid rows
    h = h.clone()
    h[t == -100] = float("nan")
    args = (w, b, t, LossOptions(), "sum", block, (True, True, True))
    loss, gh, gw, gb = launch.store(h, *args, fp32_accumulate=False)
    keep = t != -100
    loss_v, gh_v, gw_v, gb_v = launch.store(h[keep], w, b, t[keep], *args[3:], fp32_accumulate=False)
    assert torch.equal(loss, loss_v) and torch.equal(gw, gw_v) and torch.equal(gb, gb_v)
    assert torch.equal(gh[keep], gh_v) and torch.equal(gh[~keep], torch.zeros_like(gh[~keep]))
    monkeypatch.setenv("INDUCTOR_XENT_SKIP_IGNORED", "0")
    assert launch.store(h, *args, fp32_accumulate=False)[2].isnan().any()


@pytest.mark.parametrize("aligned", [True, False])
def test_rows_mm_reads_a_transposed_b_as_stored(aligned):
    """rows_mm with b = W.t() of a row-major [N, K] W (a row chunk's logits h·Wᵀ): its TMA path loads
    W's [BLOCK_N, BLOCK_K] blocks (TRANS_B), the pointer path (rows not 16-byte aligned) W.t()'s
    strides; the first count rows against torch, the others left as they were."""
    g = torch.Generator().manual_seed(41)
    k = 32 if aligned else 27
    a = torch.randn(40, k, generator=g).to(DEVICE, torch.bfloat16)
    w = torch.randn(72, k, generator=g).to(DEVICE, torch.bfloat16)
    out = torch.full((40, 72), 7.0, dtype=torch.bfloat16, device=DEVICE)
    count = torch.tensor([23], dtype=torch.int32, device=DEVICE)
    rows.rows_mm(out, a, w.t(), count, bound="m")
    exact = a[:23].double() @ w.double().t()
    assert rel_err(out[:23], exact) <= torch.finfo(torch.bfloat16).eps * 2
    assert torch.equal(out[23:], torch.full_like(out[23:], 7.0))


def test_recompute_backward_never_reads_rows_without_gradient(monkeypatch):
    """The recompute backward moves the rows with an incoming gradient first and its GEMMs stop at
    their count: NaN in the other rows' hidden states (ignored targets, no lse gradient) leaves every
    gradient finite and equal to the valid rows' alone. Fails if those rows are computed (skipping
    off spreads the NaN into grad_weight)."""
    block = 128 if CUDA else 16
    n = 3 * block
    h, w, b, t = make_inputs(n=n, bias=True, seed=24, dtype=torch.bfloat16)  # 16-bit: rows.compacts
    t[:] = torch.randint(0, w.shape[0], (n,), generator=torch.Generator().manual_seed(25)).to(t.device)
    t[torch.arange(n, device=t.device) % 3 == 1] = -100
    o = LossOptions(label_smoothing=0.1)
    _, lse, lse_lo = launch.forward(h, w, b, t, o)
    keep = t != -100
    h = h.clone()
    h[~keep] = float("nan")
    gl = torch.rand(n, generator=torch.Generator().manual_seed(26)).to(DEVICE)
    args = (w, b, t, lse, lse_lo, o, (True, True, True))
    gh, gw, gb = launch.backward(gl, torch.zeros_like(gl), h, *args)
    gh_v, gw_v, gb_v = launch.backward(gl[keep], torch.zeros_like(gl[keep]), h[keep], w, b, t[keep], lse[keep],
                                       lse_lo[keep], *args[5:])
    assert torch.equal(gw, gw_v) and torch.equal(gb, gb_v)
    assert torch.equal(gh[keep], gh_v) and torch.equal(gh[~keep], torch.zeros_like(gh[~keep]))
    monkeypatch.setenv("INDUCTOR_XENT_SKIP_IGNORED", "0")
    assert launch.backward(gl, torch.zeros_like(gl), h, *args)[1].isnan().any()


@pytest.mark.parametrize("head", ["loss", "log_probs"])
@pytest.mark.usefixtures("row_invariant_dot")
def test_recompute_forward_skips_ignored_rows(head, monkeypatch):
    """With ``skip_ignored`` the recompute forward (the loss's, and the log-prob op's with its entropy)
    moves the valid rows first and the row blocks past their count exit at once: NaN in the ignored
    rows' hidden states leaves every valid row's outputs the bits of the forward over finite inputs
    (the same tiles, the same vocabulary split), and the ignored rows' outputs 0. Fails if those rows
    are computed (skipping off puts their NaN into the lse)."""
    block = 128 if CUDA else 16  # the forward's row block
    n = 3 * block + 5
    h, w, b, t = make_inputs(n=n, bias=True, seed=27, dtype=torch.bfloat16)  # 16-bit: rows.compacts
    t[:] = torch.randint(0, w.shape[0], (n,), generator=torch.Generator().manual_seed(28)).to(t.device)
    t[torch.arange(n, device=t.device) % 4 == 1] = -100
    t[block:2 * block] = -100  # a whole row block ignored
    keep = t != -100
    if head == "loss":
        o = LossOptions(label_smoothing=0.1, z_loss=1e-3)

        def run(h, **kw):
            return launch.forward(h, w, b, t, o, **kw)
    else:
        o = LossOptions(logit_scale=1 / 0.7, softcap=20.0)

        def run(h, **kw):
            lp, ent, _, lse, lse_lo = launch.log_probs_forward(h, w, b, t, o, True, False, **kw)
            return lp, ent, lse, lse_lo

    dense = run(h)
    h = h.clone()
    h[~keep] = float("nan")
    skipped = run(h, skip_ignored=True)
    for ours, full in zip(skipped, dense):
        assert torch.equal(ours[keep], full[keep])
        assert torch.equal(ours[~keep].abs(), torch.zeros_like(ours[~keep]))  # (log-probs: −0.0)
    monkeypatch.setenv("INDUCTOR_XENT_SKIP_IGNORED", "0")
    assert run(h, skip_ignored=True)[-2].isnan().any()


def _api_precision():
    """``torch.get_float32_matmul_precision()``, or None where torch 2.11 refuses to read it: the legacy
    flag and the new API both set in this process (by an earlier test, or a library such as HF's
    TrainingArguments), which made this test fail in its setup on the GPU box."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return None


@pytest.mark.parametrize("how", ["global_tf32", "global_ieee", "matmul_tf32", "matmul_ieee", "legacy_true",
                                 "legacy_false", "overridden_tf32", "api_highest", "api_high"])
def test_fp32_dots_follow_either_tf32_api(how):
    """TF32 for fp32 inputs as torch decides it, by either API: HF's TrainingArguments sets
    ``torch.backends.fp32_precision`` (torch >= 2.9), after which reading the legacy ``allow_tf32``
    raises; the launchers' choice must not (it did: an fp32 model trained by HF's Trainer on a GPU).
    A level decides unless it is "none" (ATen's Context::float32Precision): the global one only where
    the cuda and matmul levels are "none" (``overridden``: a matmul level "ieee" under a global
    "tf32"); ``torch.set_float32_matmul_precision`` sets the matmul level (the GPU box's worker had it
    set by an earlier test when the global case first ran there)."""
    matmul, cuda = torch.backends.cuda.matmul, torch.backends.cuda
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip("this torch has only the legacy allow_tf32")
    levels = [lvl for lvl in (torch.backends, cuda, matmul) if hasattr(lvl, "fp32_precision")]
    # set_float32_matmul_precision also sets the MKLDNN matmul level: restored with the others
    mkldnn = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
    restore = levels + ([mkldnn] if hasattr(mkldnn, "fp32_precision") else [])
    old = ([lvl.fp32_precision for lvl in restore], _api_precision(), compat.tf32_matmuls())
    try:
        where, value = how.split("_")
        for lvl in levels[1:]:
            lvl.fp32_precision = "none"
        if where == "legacy":
            matmul.allow_tf32 = value == "true"
        elif where == "api":
            torch.set_float32_matmul_precision(value)
        elif where == "overridden":
            torch.backends.fp32_precision, matmul.fp32_precision = value, "ieee"
        else:
            (torch.backends if where == "global" else matmul).fp32_precision = value
        tf32 = value in ("tf32", "true", "high") and where != "overridden"
        assert compat.tf32_matmuls() is tf32
        assert launch._input_precision(torch.float32) == ("tf32" if tf32 else "ieee")
        assert launch._input_precision(torch.bfloat16) == "tf32"
        with compat.ieee_fp32_matmuls():
            assert launch._input_precision(torch.float32) == "ieee"
        assert compat.tf32_matmuls() is tf32
    finally:  # the new API's levels first, then the legacy flag only where it still differs
        if old[1] is not None:
            torch.set_float32_matmul_precision(old[1])
        for lvl, value in zip(restore, old[0]):
            lvl.fp32_precision = value
        if compat.tf32_matmuls() is not old[2]:
            matmul.allow_tf32 = old[2]


def test_tf32_read_where_the_matmul_level_reports_none(monkeypatch):
    """torch 2.11 reports the matmul level's own "none" under a global "tf32" (2.13 the inherited
    value) and raises on the legacy read: the level above decides (the GPU box failed the test above
    at global_tf32 before it was read)."""
    class Matmul:  # 2.11's view of torch.backends.cuda.matmul under HF's global setting
        fp32_precision = "none"

        @property
        def allow_tf32(self):
            raise RuntimeError("you have used mix of the legacy and new APIs to set the TF32 status")

    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip("this torch has only the legacy allow_tf32")
    old = torch.backends.fp32_precision
    monkeypatch.setattr(torch.backends.cuda, "matmul", Matmul())
    try:
        for precision, tf32 in (("tf32", True), ("ieee", False)):
            torch.backends.fp32_precision = precision
            assert compat.tf32_matmuls() is tf32
            assert launch._input_precision(torch.float32) == ("tf32" if tf32 else "ieee")
    finally:
        torch.backends.fp32_precision = old
