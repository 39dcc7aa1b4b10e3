"""Distillation between two lm_heads (inductor_xent/distill.py, patterns/distill.py): the op
against a float64 reference for every divergence and reduction, with student and teacher
gradients; the spellings the pass fuses (Hinton's kl_div, log-target kl_div, per-row KL sums) with
eager's values and gradients and no [N, V] tensor left; declines with their reasons."""

from __future__ import annotations

import functools
import math
import os

import pytest
import torch
import torch.nn.functional as F

import inductor_xent
from inductor_xent import compat, ops
from inductor_xent.distill import KINDS, REDUCTIONS, linear_distillation_loss

from .helpers import Recorder, assert_parity, assert_within_torch_error, fused_ops, logits_sized, rel_err, run_both

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

B, T, DS, DT, V = 2, 5, 8, 12, 29  # the teacher wider than the student


def _inputs(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, V, (B, T), generator=g)
    y[0, ::2] = -100
    return dict(hs=torch.randn(B, T, DS, generator=g).to(dtype), ws=(torch.randn(V, DS, generator=g) * 0.7).to(dtype),
                bs=torch.randn(V, generator=g).to(dtype), ht=torch.randn(B, T, DT, generator=g).to(dtype),
                wt=(torch.randn(V, DT, generator=g) * 0.7).to(dtype), y=y)


def _capped(z, cap):
    """Gemma 2's softcap as its model spells it (in the logits' dtype), or ``z``."""
    return z if cap is None else torch.tanh(z / cap) * cap


def _reference(hs, ws, ht, wt, y, kind, beta, temperature, reduction, bs=None, caps=(None, None)):
    """The divergence written out in PyTorch, on logits computed in the inputs' dtype (each head
    softcapped by ``caps`` before the temperature)."""
    wide = torch.float64 if hs.dtype == torch.float64 else torch.float32
    s = _capped(F.linear(hs, ws, bs), caps[0]).to(wide) / temperature
    t = _capped(F.linear(ht, wt), caps[1]).to(s.dtype) / temperature
    ls, lt = s.log_softmax(-1), t.log_softmax(-1)
    if kind == "forward_kl":
        rows = F.kl_div(ls, lt, log_target=True, reduction="none").sum(-1)
    elif kind == "reverse_kl":
        rows = F.kl_div(lt, ls, log_target=True, reduction="none").sum(-1)
    elif kind == "soft_ce":  # torchtune's ForwardKLLoss: the cross-entropy against the teacher's probabilities
        rows = -(lt.exp() * ls).sum(-1)
    else:
        lm = torch.logsumexp(torch.stack([lt + math.log(beta), ls + math.log1p(-beta)]), 0)
        rows = beta * F.kl_div(lm, lt, log_target=True, reduction="none").sum(-1) \
            + (1 - beta) * F.kl_div(lm, ls, log_target=True, reduction="none").sum(-1)
    valid = y != -100
    rows = torch.where(valid, rows, 0.0)
    return {"none": rows, "sum": rows.sum(), "mean": rows.sum() / valid.sum(),
            "batchmean": rows.sum() / rows.numel()}[reduction]


def _run(fn, ins: dict, dtype=None, teacher_grad=True):
    leaves = {k: (v.detach().to(dtype or v.dtype).requires_grad_(k in ("hs", "ws", "bs") or teacher_grad)
                  if v.is_floating_point() else v) for k, v in ins.items()}
    out = fn(**leaves)
    seed = torch.Generator().manual_seed(1)
    g = torch.randn(out.shape, generator=seed, dtype=out.dtype)
    names = [k for k, v in leaves.items() if v.is_floating_point() and v.requires_grad]
    grads = torch.autograd.grad(out, [leaves[k] for k in names], g, allow_unused=True)
    return out.detach(), {k: v for k, v in zip(names, grads) if v is not None}


def _mixed_reference(hs, ws, bs, ht, wt, y, kind, beta, temperature, reduction, soft, hard, caps=(None, None)):
    """soft · the divergence + hard · the student's hard-label cross-entropy (its raw logits, softcapped
    by ``caps[0]``; the mean over labelled rows, per row for "none"), computed apart."""
    kd = _reference(hs, ws, ht, wt, y, kind, beta, temperature, reduction, bs=bs, caps=caps)
    z = _capped(F.linear(hs, ws, bs), caps[0]).to(torch.float64 if hs.dtype == torch.float64 else torch.float32)
    ce = F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1), reduction="none" if reduction == "none" else "mean")
    return soft * kd + hard * ce.reshape(kd.shape)


def _check_student(ours, theirs, ins: dict, what: str):
    """Loss and student gradients (hs, ws, bs) of ``ours`` within torch's error of float64."""
    out, grads = _run(ours, ins, teacher_grad=False)
    same, same_g = _run(theirs, ins, teacher_grad=False)
    exact, exact_g = _run(theirs, ins, torch.float64, teacher_grad=False)
    assert_within_torch_error(out, same, exact, what=f"{what} loss")
    assert set(grads) == {"hs", "ws", "bs"}
    for k in grads:
        assert_within_torch_error(grads[k], same_g[k], exact_g[k], what=f"{what} grad {k}")


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_op_matches_float64_with_student_and_teacher_gradients(kind, reduction):
    ins = _inputs()

    def ours(hs, ws, bs, ht, wt, y):
        return linear_distillation_loss(hs, ws, ht, wt, y, student_bias=bs, kind=kind, beta=0.3, temperature=1.7,
                                        reduction=reduction)

    def theirs(hs, ws, bs, ht, wt, y):
        return _reference(hs, ws, ht, wt, y, kind, 0.3, 1.7, reduction, bs=bs)

    out, grads = _run(ours, ins)
    same, same_g = _run(theirs, ins)
    exact, exact_g = _run(theirs, ins, torch.float64)
    assert_within_torch_error(out, same, exact, what=f"{kind} {reduction} loss")
    assert set(grads) == set(same_g) == {"hs", "ws", "bs", "ht", "wt"}
    for k in grads:
        assert_within_torch_error(grads[k], same_g[k], exact_g[k], what=f"{kind} {reduction} grad {k}")


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("kind", ["forward_kl", "jsd"])
def test_op_mixes_the_hard_label_cross_entropy(kind, reduction):
    """soft_weight · divergence + hard_weight · the student's cross-entropy (its raw logits, the mean
    over labelled rows; per row for "none") in one pass: loss and student gradients against the two
    computed apart in float64, within torch's own error."""
    ins = _inputs(seed=3)
    temp, alpha = 2.0, 0.3

    def ours(hs, ws, bs, ht, wt, y):
        return linear_distillation_loss(hs, ws, ht, wt, y, student_bias=bs, kind=kind, beta=0.4, temperature=temp,
                                        reduction=reduction, soft_weight=(1 - alpha) * temp**2, hard_weight=alpha)

    def theirs(hs, ws, bs, ht, wt, y):
        return _mixed_reference(hs, ws, bs, ht, wt, y, kind, 0.4, temp, reduction, (1 - alpha) * temp**2, alpha)

    _check_student(ours, theirs, ins, f"{kind} {reduction} mixed")


def test_op_hard_weight_needs_the_target():
    ins = _inputs()
    with pytest.raises(ValueError, match="hard_weight needs the target"):
        linear_distillation_loss(ins["hs"], ins["ws"], ins["ht"], ins["wt"], hard_weight=0.5)
    with pytest.raises(ValueError, match="soft_weight must be a finite number"):
        linear_distillation_loss(ins["hs"], ins["ws"], ins["ht"], ins["wt"], ins["y"], soft_weight=float("nan"))


def test_op_in_bfloat16_within_torch_error():
    ins = _inputs()
    f = dict(kind="forward_kl", temperature=2.0, reduction="mean")

    def ours(hs, ws, bs, ht, wt, y):
        return linear_distillation_loss(hs, ws, ht, wt, y, student_bias=bs, **f)

    def theirs(hs, ws, bs, ht, wt, y):
        return _reference(hs, ws, ht, wt, y, f["kind"], 0.5, f["temperature"], f["reduction"], bs=bs)

    out, grads = _run(ours, ins, torch.bfloat16, teacher_grad=False)
    same, same_g = _run(theirs, ins, torch.bfloat16, teacher_grad=False)
    exact, exact_g = _run(theirs, {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in ins.items()},
                          torch.float64, teacher_grad=False)
    assert_within_torch_error(out, same, exact, what="bf16 loss")
    for k in grads:
        assert grads[k].dtype == torch.bfloat16
        assert_within_torch_error(grads[k], same_g[k], exact_g[k], what=f"bf16 grad {k}")


@pytest.mark.parametrize("path", ["accumulating", "kept", "recompute"])
@pytest.mark.parametrize("kind", KINDS)
def test_softcapped_heads_match_float64(kind, path, request):
    """Each head's softcap before the temperature (Gemma 2's), the hard-label CE over the student's
    capped logits: the loss and every gradient within torch's error of float64, on each of the three
    paths. Caps of the logits' size, so that a cap left out, or applied after the temperature, fails."""
    fixture = {"kept": "keep_dz_on_cpu", "recompute": "recompute_chunks"}.get(path)
    calls = request.getfixturevalue(fixture) if fixture else None
    ins = _inputs(seed=9)
    caps = (1.5, 2.5)
    kw = dict(kind=kind, beta=0.3, temperature=1.7, reduction="mean", soft_weight=1.3, hard_weight=0.4,
              student_softcap=caps[0], teacher_softcap=caps[1], store_budget=0 if path == "recompute" else None)

    def ours(hs, ws, bs, ht, wt, y):
        return linear_distillation_loss(hs, ws, ht, wt, y, student_bias=bs, **kw)

    def theirs(hs, ws, bs, ht, wt, y):
        return _mixed_reference(hs, ws, bs, ht, wt, y, kind, 0.3, 1.7, "mean", 1.3, 0.4, caps=caps)

    out, grads = _run(ours, ins, teacher_grad=path != "kept")  # the kept path trains the student alone
    same, same_g = _run(theirs, ins, teacher_grad=path != "kept")
    exact, exact_g = _run(theirs, ins, torch.float64, teacher_grad=path != "kept")
    assert_within_torch_error(out, same, exact, what=f"{kind} {path} loss")
    assert set(grads) == set(same_g)
    for k in grads:
        assert_within_torch_error(grads[k], same_g[k], exact_g[k], what=f"{kind} {path} grad {k}")
    if calls is not None:
        assert calls, f"the {path} path did not run"
    uncapped = linear_distillation_loss(ins["hs"], ins["ws"], ins["ht"], ins["wt"], ins["y"], student_bias=ins["bs"],
                                        **{**kw, "student_softcap": None, "teacher_softcap": None})
    assert not torch.allclose(uncapped, out, rtol=1e-3), "caps this small must change the loss"


def test_bench_distill_cpu_dry_run_with_softcaps(tmp_path):
    """bench_distill.py's dry run with both heads capped: our methods agree with the capped spelling
    (fp32 on CPU, to 1e-5), Liger's ops are skipped with a reason, the cap is in the JSON."""
    import json

    from benchmarks import bench_distill

    bench_distill.main(["--device", "cpu", "--softcap", "2.0", "--methods", "ours,ours_recompute,liger",
                        "--out", str(tmp_path)])
    out = json.loads((tmp_path / "bench_distill.json").read_text())
    assert out["meta"]["softcap"] == 2.0
    rows = {r["method"]: r for r in out["results"]}
    assert rows["liger"]["error"] == "takes no softcap"
    for name in ("ours", "ours_recompute"):
        assert max(rows[name]["errors"].values()) < 1e-5, rows[name]


def test_softcaps_are_checked():
    ins = _inputs()
    for bad in (0.0, -1.0, float("inf"), True, "30"):
        with pytest.raises(ValueError, match="student_softcap must be None or a finite number > 0"):
            linear_distillation_loss(ins["hs"], ins["ws"], ins["ht"], ins["wt"], student_softcap=bad)
    with pytest.raises(ValueError, match="teacher_softcap must be None"):
        linear_distillation_loss(ins["hs"], ins["ws"], ins["ht"], ins["wt"], teacher_softcap=float("nan"))


@pytest.fixture
def keep_dz_on_cpu(monkeypatch):
    """The kept-dz chunks (distill.keeps_dz, CUDA's default) on CPU, 3 rows a chunk; counts their calls."""
    from inductor_xent import distill

    monkeypatch.setattr(distill, "KEEP_DZ_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(distill, "TEACHER_CHUNK_BYTES", 3 * V * 4)
    calls = []
    real = distill._kept_dz_chunks
    monkeypatch.setattr(distill, "_kept_dz_chunks", lambda *a, **k: calls.append("op") or real(*a, **k))
    math = distill._chunk_math_into
    monkeypatch.setattr(distill, "_chunk_math_into", lambda *a, **k: calls.append("chunk") or math(*a, **k))
    return calls


@pytest.mark.parametrize("hard", [0.0, 0.3])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_kept_dz_matches_float64(kind, reduction, hard, keep_dz_on_cpu):
    """The student's gradient logits of every row kept, the weight gradient one GEMM at the end:
    values and student gradients (bias included, with and without the hard-label CE; a per-row loss
    keeps dz in its backward) against float64 within torch's error, over chunks of 3 rows (the last
    one short)."""
    ins = _inputs(seed=5)
    kw = dict(kind=kind, beta=0.3, temperature=1.7, reduction=reduction, soft_weight=1.3, hard_weight=hard)

    def ours(hs, ws, bs, ht, wt, y):
        return linear_distillation_loss(hs, ws, ht, wt, y, student_bias=bs, **kw)

    def theirs(hs, ws, bs, ht, wt, y):
        return _mixed_reference(hs, ws, bs, ht, wt, y, kind, 0.3, 1.7, reduction, 1.3, hard)

    _check_student(ours, theirs, ins, f"{kind} {reduction}")
    assert keep_dz_on_cpu, "the kept-dz path did not run"
    ops, chunks = keep_dz_on_cpu.count("op"), keep_dz_on_cpu.count("chunk")
    rows = int((ins["y"] != -100).sum())  # on CPU the chunks run on the labelled rows alone
    assert chunks == ops * -(-rows // 3), "not the 3-row chunks (chunk_rows's teacher item size and bytes)"


def test_kept_dz_only_where_it_applies(keep_dz_on_cpu, monkeypatch):
    """A per-row loss keeps dz in its backward only (the forward forms no gradient); a trained
    teacher, a frozen student head, and a store budget smaller than the [N, V] gradient logits take
    the accumulating chunks."""
    ins = _inputs()
    leaves = {k: v.requires_grad_(k in ("hs", "ws")) if v.is_floating_point() else v for k, v in ins.items()}
    args = (leaves["hs"], leaves["ws"], leaves["ht"], leaves["wt"], leaves["y"])
    rows = linear_distillation_loss(*args, reduction="none")
    assert not keep_dz_on_cpu
    rows.sum().backward()
    assert keep_dz_on_cpu
    keep_dz_on_cpu.clear()
    linear_distillation_loss(*args[:2], args[2].requires_grad_(), *args[3:]).backward()
    assert not keep_dz_on_cpu
    args[2].requires_grad_(False)
    args[1].requires_grad_(False)  # a frozen head (LoRA): each chunk's hidden-state gradient is whole
    linear_distillation_loss(*args).backward()
    assert not keep_dz_on_cpu
    args[1].requires_grad_()
    rows = int((leaves["y"] != -100).sum())  # on CPU the chunks run on the labelled rows alone
    monkeypatch.setenv("INDUCTOR_XENT_STORE_BUDGET", f"{rows * V * 4 - 1}")
    linear_distillation_loss(*args).backward()
    assert not keep_dz_on_cpu
    monkeypatch.setenv("INDUCTOR_XENT_STORE_BUDGET", f"{rows * V * 4}")
    linear_distillation_loss(*args).backward()
    assert keep_dz_on_cpu


def test_kept_dz_follows_the_budget_and_the_strategy(keep_dz_on_cpu, monkeypatch):
    """store_budget=0 and INDUCTOR_XENT_STRATEGY=recompute (the functional API), xent.strategy=
    "recompute" and a too small xent.store_budget (the backend) keep no gradient logits; the
    defaults do."""
    ins = {k: v.requires_grad_(k in ("hs", "ws")) if v.is_floating_point() else v for k, v in _inputs().items()}
    args = (ins["hs"], ins["ws"], ins["ht"], ins["wt"], ins["y"])
    linear_distillation_loss(*args, store_budget=0).backward()
    assert not keep_dz_on_cpu
    monkeypatch.setenv("INDUCTOR_XENT_STRATEGY", "recompute")
    linear_distillation_loss(*args).backward()
    assert not keep_dz_on_cpu
    monkeypatch.delenv("INDUCTOR_XENT_STRATEGY")
    linear_distillation_loss(*args, store_budget="1x").backward()
    assert keep_dz_on_cpu
    with pytest.raises(ValueError, match="store budget"):
        linear_distillation_loss(*args, store_budget="lots")
    for opts, kept in (({"xent.strategy": "recompute"}, False), ({"xent.store_budget": B * T * V * 4 - 1}, False),
                       ({}, True)):
        keep_dz_on_cpu.clear()
        torch._dynamo.reset()
        compiled = torch.compile(_hinton, backend="inductor_xent", options={"xent.inner": "aot_eager", **opts})
        compiled(**{k: ins[k] for k in ("hs", "ws", "ht", "wt")}).backward()
        assert bool(keep_dz_on_cpu) == kept, opts


def test_kept_dz_under_autocast_within_eager_error(keep_dz_on_cpu):
    """Under autocast with fp32 master weights and bias (bf16 hidden states, the teacher's too) each
    head's operands are cast as F.linear's are, so the kept path runs: the loss and the student's
    gradients (the fp32 leaves' in fp32 through the casts, as autograd gives every leaf) within eager
    autocast's error against float64 of the bf16-rounded operands."""
    ins = _inputs(seed=9)
    leaves = (ins["hs"].bfloat16().requires_grad_(), ins["ws"].clone().requires_grad_(),
              ins["bs"].clone().requires_grad_())
    ht = ins["ht"].bfloat16()  # the teacher's hidden states from its bf16 autocast forward, its weight fp32
    kw = dict(kind="forward_kl", beta=0.5, temperature=2.0, reduction="mean")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = linear_distillation_loss(*leaves[:2], ht, ins["wt"], ins["y"], student_bias=leaves[2], **kw)
        eager = _reference(*leaves[:2], ht, ins["wt"], ins["y"], bs=leaves[2], **kw)
    assert keep_dz_on_cpu, "the kept-dz path did not run"
    g_ours, g_eager = torch.autograd.grad(ours, leaves), torch.autograd.grad(eager, leaves)
    rounded = [t.detach().bfloat16().double().requires_grad_() for t in leaves]
    exact = _reference(*rounded[:2], ins["ht"].bfloat16().double(), ins["wt"].bfloat16().double(), ins["y"],
                       bs=rounded[2], **kw)
    g_exact = torch.autograd.grad(exact, rounded)
    assert_within_torch_error(ours, eager.float(), exact, what="autocast loss")
    for name, a, e, x in zip(("hs", "ws", "bs"), g_ours, g_eager, g_exact):
        assert_within_torch_error(a, e, x, what=f"autocast grad {name}")


def test_mixed_dtypes_outside_autocast_are_refused():
    """A head's operands in different dtypes without autocast are a TypeError naming them (as
    linear_cross_entropy's and linear_topk's), not a GEMM's error from inside the op."""
    ins = _inputs()
    with pytest.raises(TypeError, match=r"the student's weight.dtype \(torch.float32\) must equal its hidden.dtype "
                                        r"\(torch.bfloat16\); inside torch.autocast"):
        linear_distillation_loss(ins["hs"].bfloat16(), ins["ws"], ins["ht"], ins["wt"])
    with pytest.raises(TypeError, match=r"the teacher's bias.dtype \(torch.float16\) must equal its hidden.dtype"):
        linear_distillation_loss(ins["hs"], ins["ws"], ins["ht"], ins["wt"], teacher_bias=ins["bs"].half())


def test_op_runs_with_autocast_off(small_chunks):
    """Inside torch.autocast the op's implementation runs with autocast off (Inductor calls it with the
    caller's autocast still on): bf16 operands give the same bits inside and outside, one-row chunks
    whose weight gradients add up in fp32 (an autocast GEMM would round each chunk's to bf16)."""
    ins = _inputs(seed=2, dtype=torch.bfloat16)

    def loss(hs, ws, bs, ht, wt, y):
        return linear_distillation_loss(hs, ws, ht, wt, y, student_bias=bs, kind="jsd", beta=0.3, reduction="sum",
                                        hard_weight=0.5)

    def autocast(fn):
        def run(**kw):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(**kw)
        return run

    out, grads = _run(loss, ins)
    out_ac, grads_ac = _run(autocast(loss), ins)
    assert torch.equal(out, out_ac)
    assert set(grads) == set(grads_ac) == {"hs", "ws", "bs", "ht", "wt"}
    for k in grads:
        assert torch.equal(grads[k], grads_ac[k]), k


def test_compiled_kept_dz_under_autocast_within_eager_error(keep_dz_on_cpu, monkeypatch):
    """Hinton KD compiled by the backend under autocast with fp32 parameters: the pass casts both heads'
    operands to bf16 as autocast does (the op's chunks see bf16 only: without the casts it computes in
    fp32, as close to float64 as eager, which the error bound alone would not notice), the op keeps the
    student's gradient logits, and the loss and the fp32 gradients are within eager autocast's error
    against float64 of the bf16-rounded operands."""
    from torch._dynamo.utils import counters

    from inductor_xent import distill

    dtypes = []
    chunks = distill._chunks
    monkeypatch.setattr(distill, "_chunks", lambda hs, ws, bs, ht, wt, *a, **k: dtypes.append(
        {hs.dtype, ws.dtype, ht.dtype, wt.dtype}) or chunks(hs, ws, bs, ht, wt, *a, **k))

    ins = _inputs(seed=4)
    compiled = torch.compile(_hinton, backend="inductor_xent", options={"xent.inner": "aot_eager"})

    def run(fn, exact=False):
        xs = {k: ins[k].bfloat16().double() if exact else ins[k].clone() for k in ("hs", "ws", "ht", "wt")}
        leaves = [xs[k].requires_grad_() for k in ("hs", "ws")]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not exact):
            out = fn(**xs)
        return out, torch.autograd.grad(out, leaves)

    ours, g_ours = run(compiled)
    assert counters["inductor_xent"]["fused.distillation"] == 1 and keep_dz_on_cpu
    assert dtypes and all(d == {torch.bfloat16} for d in dtypes), dtypes
    eager, g_eager = run(_hinton)
    exact, g_exact = run(_hinton, exact=True)
    assert_within_torch_error(ours, eager, exact, what="compiled autocast loss")
    for name, a, e, x in zip(("hs", "ws"), g_ours, g_eager, g_exact):
        assert_within_torch_error(a, e, x, what=f"compiled autocast grad {name}")


@pytest.mark.parametrize("caps", [(None, None), (2.0, 3.0)])
def test_compiled_chunk_math_has_one_graph_for_every_chunk_size(caps):
    """options.compiled_per_row marks the rows dynamic: chunks of 5, 6 and 7 rows (a batch's last chunk
    follows N) reuse one graph, where static shapes compile one each and fail at Dynamo's limit under
    fullgraph; the values are eager's (softcapped heads too)."""
    from torch._dynamo.utils import counters

    from inductor_xent import distill, options

    torch._dynamo.reset()
    counters.clear()
    fn = options.compiled_per_row(distill._chunk_math_into)
    g = torch.Generator().manual_seed(4)
    for rows in (5, 6, 7):
        zs, zt = torch.randn(rows, V, generator=g), torch.randn(rows, V, generator=g)
        w, valid = torch.rand(rows, generator=g), torch.rand(rows, generator=g) > 0.3
        dz = zs.clone()
        args = ("jsd", 0.3, 0.5, 0.5, None, None, None, False, caps)  # positional, as the chunks call it
        out = fn(dz, zt, w, valid, *args)
        ref_dz = zs.clone()
        ref = distill._chunk_math_into(ref_dz, zt, w, valid, *args)
        torch.testing.assert_close(out[0], ref[0])
        torch.testing.assert_close(dz, ref_dz)
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_kept_dz_teacher_chunk_follows_the_weight_gradient():
    """The teacher chunk is as large as the student's weight gradient (no higher peak than the end's),
    within 128 and 512 MiB, whole 128-row tiles."""
    from inductor_xent.distill import chunk_rows

    cuda, v = torch.device("cuda"), 128256
    assert chunk_rows(8192, v, cuda, 2, v * 4096 * 2) == 2048  # 512 MiB of bf16 rows: 2093, tiles of 128
    assert chunk_rows(8192, v, cuda, 2, v * 1024 * 2) == 1024  # a 250 MiB weight gradient
    assert chunk_rows(8192, v, cuda, 2, 1000) == 512  # at least 128 MiB
    assert chunk_rows(300, v, cuda, 2, v * 4096 * 2) == 300


@pytest.mark.parametrize("keep", [False, True])
def test_explain_says_when_dz_is_kept(keep, keep_dz_on_cpu, monkeypatch):
    """explain names the kept gradient logits and their size; the avoided bytes are both heads'
    logits (the rewritten graph holds neither: the batchmean divisor is a number, not a size read from
    the student's log-probs), less the kept ones."""
    from inductor_xent import distill

    if not keep:
        monkeypatch.setattr(distill, "KEEP_DZ_DEVICES", ("cuda",))
    ins = {k: v.requires_grad_(k == "ws") if v.is_floating_point() else v for k, v in _inputs().items()}
    site = inductor_xent.explain(_hinton, **ins).sites[0]
    assert site.fused and site.strategy == "store"
    kept = B * T * V * 4
    assert ("gradient logits of every row kept (~1 KiB)" in site.strategy_reason) == keep
    assert site.extra_bytes == (kept if keep else None)
    assert site.bytes_avoided == (kept if keep else 2 * kept)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("budget", ["1x", "1", "0"])
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_bf16_within_torch_error(kind, budget, monkeypatch):
    """On the GPU in bf16 (the chunk math compiled by Inductor; budget 1x keeps dz, 1 byte accumulates
    in fp32, 0 recomputes over vocabulary chunks): Hinton KD mixed with the hard-label CE, student
    gradients, several chunks; jsd with both heads softcapped (the compiled math's caps)."""
    from inductor_xent import distill

    monkeypatch.setenv("INDUCTOR_XENT_STORE_BUDGET", budget)
    monkeypatch.setattr(distill, "TEACHER_CHUNK_BYTES", 256 * 4096 * 2)  # chunks of 256 rows: 4, the last short
    kept, recomputed = [], []
    real = distill._kept_dz_chunks
    monkeypatch.setattr(distill, "_kept_dz_chunks", lambda *a, **k: kept.append(1) or real(*a, **k))
    grads_real = distill._recompute_grads
    monkeypatch.setattr(distill, "_recompute_grads", lambda *a, **k: recomputed.append(1) or grads_real(*a, **k))
    monkeypatch.setattr(distill, "CUDA_CHUNK_BYTES", 200 * 4096 * 4 * distill.CHUNK_TENSORS)
    # recompute: row chunks of 256 in the forward (two bf16 [rows, V]: four, the last short), column
    # chunks of 896 in the backward (three bf16 [N, columns]: five, the last short)
    monkeypatch.setattr(distill, "RECOMPUTE_CHUNK_BYTES", 256 * 4096 * 2 * 2)
    assert distill.recompute_slice(777, 4096, torch.device("cuda"), 2, 2) == 256
    assert distill.recompute_slice(4096, 777, torch.device("cuda"), 2, 3) == 896
    n, ds, dt, v = 777, 256, 384, 4096
    g = torch.Generator().manual_seed(11)
    y = torch.randint(0, v, (n,), generator=g)
    y[::3] = -100
    ins = dict(hs=torch.randn(n, ds, generator=g), ws=torch.randn(v, ds, generator=g) * 0.2,
               bs=torch.randn(v, generator=g), ht=torch.randn(n, dt, generator=g),
               wt=torch.randn(v, dt, generator=g) * 0.2, y=y)
    cuda = {k: x.cuda() for k, x in ins.items()}
    caps = (5.0, 8.0) if kind == "jsd" else (None, None)
    kw = dict(kind=kind, beta=0.3, temperature=2.0, soft_weight=0.7 * 4, hard_weight=0.3, student_softcap=caps[0],
              teacher_softcap=caps[1])

    def ours(hs, ws, bs, ht, wt, y):
        return linear_distillation_loss(hs, ws, ht, wt, y, student_bias=bs, reduction="batchmean", **kw)

    def theirs(hs, ws, bs, ht, wt, y):
        kd = _reference(hs, ws, ht, wt, y, kind, 0.3, 2.0, "batchmean", bs=bs, caps=caps)
        z = _capped(F.linear(hs, ws, bs), caps[0]).to(torch.float64 if hs.dtype == torch.float64 else torch.float32)
        return kw["soft_weight"] * kd + 0.3 * F.cross_entropy(z, y)

    bf16 = {k: x.bfloat16() if x.is_floating_point() else x for k, x in cuda.items()}
    with compat.ieee_fp32_matmuls():
        out, grads = _run(ours, bf16, teacher_grad=False)
        same, same_g = _run(theirs, bf16, teacher_grad=False)
        exact, exact_g = _run(theirs, bf16, torch.float64, teacher_grad=False)
    assert_within_torch_error(out, same, exact, what=f"{kind} loss")
    assert bool(kept) == (budget == "1x"), "the kept-dz path runs on CUDA within the budget only"
    assert bool(recomputed) == (budget == "0"), "recompute runs at a budget of 0 only"
    for k in grads:
        assert grads[k].dtype == torch.bfloat16
        assert_within_torch_error(grads[k], same_g[k], exact_g[k], what=f"{kind} grad {k}")


def test_op_refuses_bad_arguments():
    ins = _inputs()
    with pytest.raises(ValueError, match="kind must be one of"):
        linear_distillation_loss(ins["hs"], ins["ws"], ins["ht"], ins["wt"], kind="kl")
    with pytest.raises(ValueError, match="0 < beta < 1"):
        linear_distillation_loss(ins["hs"], ins["ws"], ins["ht"], ins["wt"], kind="jsd", beta=1.0)
    with pytest.raises(ValueError, match="one vocabulary"):
        linear_distillation_loss(ins["hs"], ins["ws"], ins["ht"], ins["wt"][:-1])
    with pytest.raises(ValueError, match="temperature must be a finite number > 0, got 0.0"):
        linear_distillation_loss(ins["hs"], ins["ws"], ins["ht"], ins["wt"], temperature=0.0)
    with pytest.raises(TypeError, match="temperature must be a number, got Tensor"):  # as every API says it
        linear_distillation_loss(ins["hs"], ins["ws"], ins["ht"], ins["wt"], temperature=torch.tensor(2.0))


# ---------------------------------------------------------------------------------------------
# the pass
# ---------------------------------------------------------------------------------------------
def _hinton(hs, ws, ht, wt, **_):
    """Hinton KD as TRL's / Liger's tests write it: the teacher under no_grad, batchmean, T**2."""
    s = F.linear(hs, ws)
    with torch.no_grad():
        t = F.linear(ht, wt)
    temp = 2.0
    return F.kl_div(F.log_softmax(s / temp, dim=-1), F.softmax(t / temp, dim=-1), reduction="batchmean") * temp**2


def _log_target_masked(hs, ws, bs, ht, wt, y, **_):
    """Per-row forward KL with log_target, upcast logits, a masked mean over the label positions."""
    s = F.linear(hs, ws, bs).float()
    t = F.linear(ht, wt).detach().float()
    rows = F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), reduction="none", log_target=True).sum(-1)
    mask = (y != -100).float()
    return (rows * mask).sum() / mask.sum()


def _reverse_rows(hs, ws, ht, wt, **_):
    """Reverse KL per row, ``(p_s * (logp_s - logp_t)).sum(-1)`` (the student is p), at T = 0.7."""
    ls = (F.linear(hs, ws) / 0.7).log_softmax(-1)
    lt = (F.linear(ht, wt).detach() / 0.7).log_softmax(-1)
    return (ls.exp() * (ls - lt)).sum(-1).mean()


def _both_trained(hs, ws, ht, wt, **_):
    """Mutual learning: both heads get gradients (``sum``)."""
    return F.kl_div(F.log_softmax(F.linear(hs, ws), -1), F.softmax(F.linear(ht, wt), -1), reduction="sum")


def _hinton_with_labels(hs, ws, ht, wt, y, **_):
    """Hinton's α·CE + (1 − α)·T²·KD over the same student logits (the CE on its raw logits, ignored
    labels skipped; the KD over every row): one op."""
    s = F.linear(hs, ws)
    with torch.no_grad():
        t = F.linear(ht, wt)
    temp, alpha = 2.0, 0.3
    kd = F.kl_div(F.log_softmax(s / temp, dim=-1), F.softmax(t / temp, dim=-1), reduction="batchmean")
    ce = F.cross_entropy(s.view(-1, s.size(-1)), y.view(-1), ignore_index=-100)
    return alpha * ce + (1 - alpha) * kd * temp**2


def _labels_first_sum(hs, ws, bs, ht, wt, y, **_):
    """The CE first, a biased student, the KD as a sum over 2-D logits divided by the row count."""
    s = F.linear(hs, ws, bs).view(-1, V)
    t = F.linear(ht, wt).detach().view(-1, V)
    return F.cross_entropy(s, y.view(-1)) + F.kl_div(s.log_softmax(-1), t.log_softmax(-1), log_target=True,
                                                      reduction="sum") / (B * T)


def _gjsd(student_logits, teacher_logits, beta, temperature, per_row=False):
    """TRL's ``generalized_jsd_loss`` as its GKD trainer spells it (beta a 0-dim tensor; the mixture
    through logsumexp of a stack; β = 0 / 1 plain KLs), without its labels mask (``jsd[mask]``
    graph-breaks Dynamo), summed whole (or per row with ``per_row``)."""
    ls = F.log_softmax(student_logits / temperature, dim=-1)
    lt = F.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:
        jsd = F.kl_div(ls, lt, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(lt, ls, reduction="none", log_target=True)
    else:
        beta = torch.tensor(beta, dtype=ls.dtype)
        mixture = torch.logsumexp(torch.stack([ls + torch.log(1 - beta), lt + torch.log(beta)]), dim=0)
        jsd = beta * F.kl_div(mixture, lt, reduction="none", log_target=True) \
            + (1 - beta) * F.kl_div(mixture, ls, reduction="none", log_target=True)
    return jsd.sum(-1) if per_row else jsd.sum() / (jsd.size(0) * jsd.size(1))


def _trl_gjsd(hs, ws, ht, wt, beta=0.3, **_):
    s = F.linear(hs, ws)
    with torch.no_grad():
        t = F.linear(ht, wt)
    return _gjsd(s, t, beta, 2.0)


def _trl_gjsd_masked_rows(hs, ws, ht, wt, y, **_):
    """The mixture JSD per row (β as a Python number, the student's weight as a log of a number),
    masked to the label positions by the user."""
    ls = F.log_softmax(F.linear(hs, ws), -1)
    lt = F.log_softmax(F.linear(ht, wt).detach(), -1)
    mixture = torch.logsumexp(torch.stack([lt + math.log(0.6), ls + math.log(0.4)]), dim=0)
    rows = (F.kl_div(mixture, ls, reduction="none", log_target=True) * 0.4
            + 0.6 * F.kl_div(mixture, lt, reduction="none", log_target=True)).sum(-1)
    mask = (y != -100).float()
    return (rows * mask).sum() / mask.sum()


def _verl_masked_mean(hs, ws, ht, wt, y, **_):
    """verl's ``masked_mean`` of a per-row KL over each sequence, then over the batch (the mask a cast
    boolean)."""
    rows = F.kl_div(F.log_softmax(F.linear(hs, ws), -1), F.log_softmax(F.linear(ht, wt).detach(), -1),
                    log_target=True, reduction="none").sum(-1)
    mask = (y != -100).to(rows.dtype)
    return ((rows * mask).sum(-1) / mask.sum(-1)).mean()


def _gemma2_hinton_with_labels(hs, ws, ht, wt, y, **_):
    """Gemma 2 students and teachers: each model's ``final_logit_softcapping`` (div, tanh, mul, as HF's
    Gemma2ForCausalLM spells it; small caps so that they matter here), then Hinton's α·CE + T²·KD over
    the capped logits."""
    s = torch.tanh(F.linear(hs, ws) / 1.5) * 1.5
    with torch.no_grad():
        t = F.linear(ht, wt)
        t = t / 2.5
        t = torch.tanh(t)
        t = t * 2.5
    kd = F.kl_div(F.log_softmax(s / 2.0, dim=-1), F.softmax(t / 2.0, dim=-1), reduction="batchmean")
    return 0.3 * F.cross_entropy(s.view(-1, V), y.view(-1)) + 0.7 * kd * 4.0


def _recurrentgemma_reverse_rows(hs, ws, ht, wt, **_):
    """RecurrentGemma's ``F.tanh(logits / cap) * cap`` on the student only, reverse KL per row at T = 0.7."""
    ls = (F.tanh(F.linear(hs, ws) / 2.0) * 2.0 / 0.7).log_softmax(-1)
    lt = (F.linear(ht, wt).detach() / 0.7).log_softmax(-1)
    return (ls.exp() * (ls - lt)).sum(-1).mean()


def _sigmoid_capped_with_labels(hs, ws, ht, wt, y, **_):
    """modded-nanogpt's ``a * sigmoid(z / s)`` heads (a cap and a number added after it, which no
    softmax reads), Hinton's KD with the CE over the same capped student logits."""
    s = 3 * torch.sigmoid(F.linear(hs, ws) / 0.75)
    with torch.no_grad():
        t = 3 * torch.sigmoid(F.linear(ht, wt) / 0.75)
    kd = F.kl_div(F.log_softmax(s / 2.0, -1), F.softmax(t / 2.0, -1), reduction="batchmean") * 4.0
    return kd + 0.3 * F.cross_entropy(s.view(-1, V), y.view(-1))


def _trl116_gjsd(hs, ws, ht, wt, y, beta=0.4, sum_only=False, mean=False, **_):
    """TRL 1.16's GKD loss as ``GKDTrainer.compute_loss`` calls it: logits shifted by one position,
    the mixture weights ``log1p(-beta)`` and ``log(beta)`` of a tensor ``beta`` (plain KLs at 0 and
    1), the label mask applied by boolean indexing ``jsd[labels != -100]`` (in the graph under the
    backend's ``capture_dynamic_output_shape_ops``), ``jsd.sum() / mask.sum().clamp_min(1)``."""
    s = F.linear(hs, ws)[:, :-1, :] / 2.0
    with torch.no_grad():
        t = F.linear(ht, wt)[:, :-1, :] / 2.0
    labels = y[:, 1:]
    ls, lt = F.log_softmax(s, dim=-1), F.log_softmax(t, dim=-1)
    if beta == 0:
        jsd = F.kl_div(ls, lt, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(lt, ls, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=ls.dtype, device=ls.device)
        mixture = torch.logsumexp(torch.stack([ls + torch.log1p(-b), lt + torch.log(b)]), dim=0)
        jsd = b * F.kl_div(mixture, lt, reduction="none", log_target=True) \
            + (1 - b) * F.kl_div(mixture, ls, reduction="none", log_target=True)
    mask = labels != -100
    jsd = jsd[mask]
    if mean:  # TRL's reduction="mean": over the kept rows' elements
        return jsd.mean()
    return jsd.sum() if sum_only else jsd.sum() / mask.sum().clamp_min(1)


def _kl_none_mean(hs, ws, ht, wt, **_):
    """``kl_div(..., reduction="none").mean()``: kl_div's own "mean", over every element."""
    return F.kl_div(F.log_softmax(F.linear(hs, ws), -1), F.log_softmax(F.linear(ht, wt).detach(), -1),
                    reduction="none", log_target=True).mean()


def _masked_kd_with_labels(hs, ws, ht, wt, y, **_):
    """A masked per-row KD sum (the prompt masked by the labels) plus the hard-label CE of the same
    labels: one op, its divergence masked by the CE's own labels."""
    s = F.linear(hs, ws)
    rows = F.kl_div(F.log_softmax(s, -1), F.log_softmax(F.linear(ht, wt).detach(), -1), log_target=True,
                    reduction="none").sum(-1)
    return 0.5 * (rows * (y != -100).float()).sum() + 0.7 * F.cross_entropy(s.view(-1, s.size(-1)), y.view(-1))


def _torchtune_fkl(student_logits, teacher_logits, labels, ignore_index=-100, normalize=True):
    """torchtune's ``ForwardKLLoss.forward`` (torchtune/modules/loss/kd_losses.py), as it spells it."""
    teacher_prob = F.softmax(teacher_logits, dim=-1, dtype=torch.float32)
    inf_mask = torch.isinf(student_logits)
    student_logprob = F.log_softmax(student_logits, dim=-1, dtype=torch.float32)
    prod_probs = torch.masked_fill(teacher_prob * student_logprob, inf_mask, 0)
    x = torch.sum(prod_probs, dim=-1).view(-1)
    mask = (labels != ignore_index).int()
    if not normalize:
        return -torch.sum(x * mask.view(-1), dim=0)
    if torch.sum(mask.view(-1), dim=0) == 0:
        return torch.tensor(0.0, device=x.device)
    return -torch.sum(x * mask.view(-1), dim=0) / torch.sum(mask.view(-1), dim=0)


def _torchtune_kd(hs, ws, ht, wt, y, normalize=True, **_):
    """torchtune's KD recipe: the teacher's forward under no_grad, ``ForwardKLLoss`` of both heads'
    logits (the soft cross-entropy; normalized: a data-dependent branch, so a graph break before the
    masked sum)."""
    with torch.no_grad():
        teacher_logits = F.linear(ht, wt)
    return _torchtune_fkl(F.linear(hs, ws), teacher_logits, y, normalize=normalize)


FUSED = {"hinton": _hinton, "log_target_masked": _log_target_masked, "reverse_rows": _reverse_rows,
         "both_trained": _both_trained, "hinton_with_labels": _hinton_with_labels,
         "labels_first_sum": _labels_first_sum, "trl_gjsd": _trl_gjsd,
         "trl_gjsd_beta0": functools.partial(_trl_gjsd, beta=0.0), "trl_gjsd_beta1": functools.partial(_trl_gjsd, beta=1.0),
         "trl_gjsd_masked_rows": _trl_gjsd_masked_rows, "verl_masked_mean": _verl_masked_mean,
         "gemma2_hinton_with_labels": _gemma2_hinton_with_labels,
         "recurrentgemma_reverse_rows": _recurrentgemma_reverse_rows,
         "sigmoid_capped_with_labels": _sigmoid_capped_with_labels,
         "trl116_gjsd": _trl116_gjsd, "trl116_gjsd_beta0": functools.partial(_trl116_gjsd, beta=0.0),
         "trl116_gjsd_beta1_sum": functools.partial(_trl116_gjsd, beta=1.0, sum_only=True),
         "masked_kd_with_labels": _masked_kd_with_labels, "trl116_gjsd_mean": functools.partial(_trl116_gjsd, mean=True),
         "kl_none_mean": _kl_none_mean, "torchtune_fkl": _torchtune_kd,
         "torchtune_fkl_sum": functools.partial(_torchtune_kd, normalize=False)}
# a graph break inside a called loss function (torchtune's data-dependent branch): the caller's graph
# keeps the heads with the loss only under nested graph breaks (torch 2.13+'s default here)
NESTED_BREAK = {"torchtune_fkl"}




@pytest.mark.parametrize("name", sorted(FUSED))
def test_spelling_fuses_with_eager_values_and_gradients(name, monkeypatch):
    if name in NESTED_BREAK:  # torch 2.11 and 2.12 trace without nested graph breaks unless asked
        monkeypatch.setenv("INDUCTOR_XENT_NESTED_GRAPH_BREAKS", "1")
    fn = FUSED[name]
    ins = _inputs()
    report = inductor_xent.explain(fn, **ins)
    assert report.fused_count == len(report.sites) == 1, str(report)
    assert report.sites[0].pattern == "distillation" and "two lm_heads" in report.sites[0].reason
    rec = Recorder()
    assert_parity(fn, ins, rec, what=name)
    assert fused_ops(rec.after[0]) == 0  # the distillation op, not the cross-entropy ones
    assert ops.DISTILL_FORWARD in rec.after[0]
    assert not logits_sized(rec.graphs, rows=B * T), "no [N, V] tensor is left in the graph"


def _torchtune_chunked_kd(hs, ws, ht, wt, y, chunks=2, **_):
    """torchtune's ``ForwardKLWithChunkedOutputLoss`` over its models' chunked output (``[output(c) for c
    in h.chunk(n, dim=1)]``): one ``ForwardKLLoss(normalize=False)`` per chunk, summed, over the labelled
    count."""
    student = [F.linear(c, ws) for c in hs.chunk(chunks, dim=1)]
    with torch.no_grad():
        teacher = [F.linear(c, wt) for c in ht.chunk(chunks, dim=1)]
    mask = (y != -100).int()
    labels = [c.reshape(-1) for c in y.chunk(chunks, dim=1)]
    student = [c.reshape(-1, c.size(-1)) for c in student]
    teacher = [c.reshape(-1, c.size(-1)) for c in teacher]
    total = 0.0
    for s_chunk, t_chunk, l_chunk in zip(student, teacher, labels):
        total += _torchtune_fkl(s_chunk, t_chunk, l_chunk, normalize=False)
    return total / torch.sum(mask.view(-1), dim=0)


def test_torchtune_chunked_output_kd_fuses_each_chunk():
    """torchtune's chunked KD loss: each chunk's soft cross-entropy one op (its masked sum), eager's
    values and gradients, no [N, V] tensor left."""
    ins = _inputs()
    report = inductor_xent.explain(_torchtune_chunked_kd, **ins)
    assert report.fused_count == len(report.sites) == 2, str(report)
    assert all("soft cross-entropy" in s.reason and "reduction=sum" in s.reason for s in report.sites), str(report)
    rec = Recorder()
    assert_parity(_torchtune_chunked_kd, ins, rec, what="torchtune chunked")
    assert not logits_sized(rec.graphs, rows=B * T // 2), "no [N, V] tensor is left in the graph"


def test_isinf_mask_over_a_biased_student_declines():
    """torchtune's ``masked_fill(·, isinf(student_logits), 0)`` reads as nothing only for a biasless
    head (a bias may hold -inf, a masked vocabulary, whose columns eager's mask drops)."""
    def fn(hs, ws, bs, ht, wt, y, **_):
        return _torchtune_fkl(F.linear(hs, ws, bs), F.linear(ht, wt).detach(), y, normalize=False)

    bias = torch.zeros(V)
    bias[::5] = -math.inf
    ins = dict(_inputs(), bs=bias)
    report = inductor_xent.explain(fn, **ins)
    assert report.fused_count == 0 and "a bias may hold -inf" in str(report), str(report)
    out = torch.compile(fn, backend="inductor_xent", options={"xent.inner": "aot_eager"})(**ins)
    torch.testing.assert_close(out, fn(**ins))
    assert torch.isfinite(out)


@pytest.mark.parametrize("cap", [1.5, 49.0])
def test_softcapped_cross_entropy_mix_fuses_at_any_cap(cap):
    """Hinton's α·CE + T²·KD over Gemma-style capped student logits: one op with eager's values and
    gradients, also at caps whose folded scale (1/cap)·cap is not exactly 1.0 in floating point (49)."""
    def fn(hs, ws, ht, wt, y, **_):
        s = torch.tanh(F.linear(hs, ws) / cap) * cap
        kd = F.kl_div(F.log_softmax(s / 2.0, -1), F.softmax(F.linear(ht, wt).detach() / 2.0, -1),
                      reduction="batchmean")
        return 0.3 * F.cross_entropy(s.view(-1, V), y.view(-1)) + kd * 4.0

    ins = _inputs()
    report = inductor_xent.explain(fn, **ins)
    assert report.fused_count == 1 and "mixed in" in report.sites[0].reason, str(report)
    assert_parity(fn, ins, Recorder(), what=f"cap {cap}")


def test_softcaps_fold_onto_the_raw_logits():
    """The chain's softcap after the temperature (``softcap·tanh(z·scale/softcap)``) becomes the op's
    cap before it (``scale·cap·tanh(z/cap)``): Gemma 2's 1.5 and 2.5, named by explain; one
    cross-entropy joins the op."""
    report = inductor_xent.explain(_gemma2_hinton_with_labels, **_inputs())
    assert report.fused_count == 1, str(report)
    reason = report.sites[0].reason
    assert "softcaps 1.5 and 2.5 before them" in reason and "hard-label cross-entropy mixed in" in reason, reason
    # KL(student ‖ teacher): the op's fitted head q is the teacher's, uncapped
    assert "softcaps none and 2 before" in inductor_xent.explain(_recurrentgemma_reverse_rows, **_inputs()).sites[0].reason


def test_mixture_jsd_names_its_beta_and_needs_matching_weights():
    """The mixture JSD fuses as the op's jsd with the teacher's weight as β; a mixture whose weights
    are not the KLs' coefficients is another loss, and no site."""
    ins = _inputs()
    assert "generalised JSD (beta=0.3)" in inductor_xent.explain(_trl_gjsd, **ins).sites[0].reason
    assert "generalised JSD (beta=0.6)" in inductor_xent.explain(_trl_gjsd_masked_rows, **ins).sites[0].reason

    def mismatched(hs, ws, ht, wt, **_):
        ls, lt = F.log_softmax(F.linear(hs, ws), -1), F.log_softmax(F.linear(ht, wt).detach(), -1)
        mixture = torch.logsumexp(torch.stack([ls + math.log(0.7), lt + math.log(0.3)]), dim=0)
        return (0.5 * F.kl_div(mixture, lt, reduction="none", log_target=True)
                + 0.5 * F.kl_div(mixture, ls, reduction="none", log_target=True)).sum()

    assert not any(s.pattern == "distillation" for s in inductor_xent.explain(mismatched, **ins).sites)


@pytest.mark.usefixtures("fresh_dynamo")
def test_mixture_jsd_under_autocast_within_eager_autocast_error():
    """TRL's GKD loss as HF Trainer's bf16 runs it (CPU autocast): fused, the loss and the student's
    gradients within eager autocast's error against float64 of the bf16-rounded operands."""
    ins = _inputs()
    leaves = ("hs", "ws")

    def run(fn, dtype=None):
        xs = {k: (v.detach().to(torch.bfloat16).to(dtype) if dtype and v.is_floating_point() else v.detach())
              for k, v in ins.items()}
        for k in leaves:
            xs[k].requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is None):
            out = fn(**xs)
        return (out.float() if dtype is None else out), torch.autograd.grad(out, [xs[k] for k in leaves])

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert inductor_xent.explain(_trl_gjsd, **ins).fused_count == 1
    exact, g_exact = run(_trl_gjsd, torch.float64)
    eager, g_eager = run(_trl_gjsd)
    ours, g_ours = run(torch.compile(_trl_gjsd, backend="inductor_xent"))
    assert_within_torch_error(ours, eager, exact, what="loss")
    for name, a, e, x in zip(leaves, g_ours, g_eager, g_exact):
        assert_within_torch_error(a, e, x, what=f"grad {name}")


def test_teacher_under_no_grad_gets_no_gradient():
    ins = {k: v.requires_grad_(v.is_floating_point()) for k, v in _inputs().items()}
    torch.compile(_hinton, backend="inductor_xent", options={"xent.inner": "aot_eager"})(**ins).backward()
    assert ins["ws"].grad is not None and ins["wt"].grad is None and ins["ht"].grad is None


@pytest.mark.slow(s=82)
def test_compiles_through_inductor():
    ins = _inputs()
    le, ge = _run(_hinton, ins, teacher_grad=False)
    lc, gc = _run(torch.compile(_hinton, backend="inductor_xent"), ins, teacher_grad=False)
    torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-6)
    for k in ge:
        torch.testing.assert_close(gc[k], ge[k], rtol=1e-4, atol=1e-6)


def test_declines_say_why():
    # the student's tensors train (a cross-entropy without gradient declines only where the divergence has one)
    ins = {k: v.requires_grad_(k in ("hs", "ws")) if v.is_floating_point() else v for k, v in _inputs().items()}

    def shifted(hs, ws, ht, wt, **_):
        s = 30.0 * torch.tanh((F.linear(hs, ws) + 1.0) / 30.0)
        return F.kl_div(F.log_softmax(s, -1), F.softmax(F.linear(ht, wt).detach(), -1), reduction="batchmean")

    def detached_labels(hs, ws, ht, wt, y, **_):  # the CE trains nothing: one op would train the student by it
        s = F.linear(hs, ws)
        kd = F.kl_div(F.log_softmax(s, -1), F.softmax(F.linear(ht, wt).detach(), -1), reduction="batchmean")
        return kd + 0.5 * F.cross_entropy(s.detach().view(-1, V), y.view(-1))

    def logged_labels(hs, ws, ht, wt, y, **_):  # the CE under no_grad (a logged metric) added to the loss
        s = F.linear(hs, ws)
        kd = F.kl_div(F.log_softmax(s, -1), F.softmax(F.linear(ht, wt).detach(), -1), reduction="batchmean")
        with torch.no_grad():
            ce = F.cross_entropy(s.view(-1, V), y.view(-1))
        return kd + 0.5 * ce

    def uncapped_labels(hs, ws, ht, wt, y, **_):  # the CE over the raw logits, the KD over capped ones
        z = F.linear(hs, ws)
        kd = F.kl_div(F.log_softmax(torch.tanh(z / 2.0) * 2.0, -1), F.softmax(F.linear(ht, wt).detach(), -1),
                      reduction="batchmean")
        return kd + F.cross_entropy(z.view(-1, V), y.view(-1))

    def other_user(hs, ws, ht, wt, **_):
        s = F.linear(hs, ws)
        kd = F.kl_div(F.log_softmax(s, -1), F.softmax(F.linear(ht, wt).detach(), -1), reduction="batchmean")
        return kd + 1e-3 * s.pow(2).mean()

    def smoothed_labels(hs, ws, ht, wt, y, **_):
        s = F.linear(hs, ws)
        kd = F.kl_div(F.log_softmax(s, -1), F.softmax(F.linear(ht, wt).detach(), -1), reduction="batchmean")
        return kd + F.cross_entropy(s.view(-1, V), y.view(-1), label_smoothing=0.1)

    def scaled_labels(hs, ws, ht, wt, y, **_):
        s = F.linear(hs, ws)
        kd = F.kl_div(F.log_softmax(s, -1), F.softmax(F.linear(ht, wt).detach(), -1), reduction="batchmean")
        return kd + F.cross_entropy((s / 2.0).view(-1, V), y.view(-1))

    def other_mask_with_labels(hs, ws, ht, wt, y, **_):  # one op masks the divergence by the CE's labels only
        s = F.linear(hs, ws)
        rows = F.kl_div(F.log_softmax(s, -1), F.log_softmax(F.linear(ht, wt).detach(), -1), log_target=True,
                        reduction="none").sum(-1)
        return (rows * (y > 3)).sum() * 0.5 + 0.5 * F.cross_entropy(s.view(-1, V), y.view(-1))

    def masked_mean_with_labels(hs, ws, ht, wt, y, **_):  # the op's CE mix has no mean over masked elements
        s = F.linear(hs, ws)
        kl = F.kl_div(F.log_softmax(s, -1), F.log_softmax(F.linear(ht, wt).detach(), -1), log_target=True,
                      reduction="none")
        return kl[y != -100].mean() + 0.5 * F.cross_entropy(s.view(-1, V), y.view(-1))

    def hidden_written(hs, ws, ht, wt, **_):  # the op reads the hidden states at the loss: after the write
        h = hs * 1.0
        s = F.linear(h, ws)
        h.mul_(2.0)
        return F.kl_div(F.log_softmax(s, -1), F.softmax(F.linear(ht, wt).detach(), -1), reduction="batchmean")

    def running_sum(hs, ws, ht, wt, **_):  # a write to a running sum of other terms changes nothing it reads
        total = (hs * 0).sum()
        s = F.linear(hs, ws)
        total += 1.0
        return total + F.kl_div(F.log_softmax(s, -1), F.softmax(F.linear(ht, wt).detach(), -1), reduction="batchmean")

    assert inductor_xent.explain(running_sum, **ins).fused_count == 1
    for fn, words in ((shifted, "shifted by a number inside the cap"), (other_user, "other users"),
                      (hidden_written, "Tensor.mul_ writes a tensor between the lm_head matmuls and the loss (a "
                                       "head's hidden states")):
        report = inductor_xent.explain(fn, **ins)
        assert any(s.pattern == "distillation" and not s.fused and words in s.reason for s in report.sites), str(report)
    # a cross-entropy the divergence's op cannot mix in is a head of its own beside it (test_heads_beside_...)
    for fn in (masked_mean_with_labels, smoothed_labels, scaled_labels, uncapped_labels, detached_labels,
               logged_labels, other_mask_with_labels):
        report = inductor_xent.explain(fn, **ins)
        assert report.fused_count == len(report.sites) == 2, str(report)
        assert "heads, each an op of its own" in next(s.reason for s in report.sites if s.pattern == "distillation")


def _sum_ce_and_kd(hs, ws, ht, wt, y, **_):
    """HF's loss with ``num_items_in_batch`` (the cross-entropy summed, over a count) beside Hinton's KD:
    the op's mix takes a mean cross-entropy only, so the two are ops of their own."""
    s = F.linear(hs, ws)
    with torch.no_grad():
        t = F.linear(ht, wt)
    ce = F.cross_entropy(s.float().view(-1, V), y.view(-1), reduction="sum") / (y != -100).sum()
    kd = F.kl_div(F.log_softmax(s / 2.0, -1), F.softmax(t / 2.0, -1), reduction="batchmean") * 4.0
    return 0.5 * ce + 0.5 * kd


def _torchtune_kd_recipe(hs, ws, ht, wt, y, chunks=2, ratio=0.5, **_):
    """torchtune's knowledge_distillation recipe over its chunked output: ``CEWithChunkedOutputLoss``
    and ``ForwardKLWithChunkedOutputLoss`` of the same student chunks, each summed over the chunks and
    divided by its own count, mixed ``(1 − r)·CE + r·KD``."""
    student = [F.linear(c, ws) for c in hs.chunk(chunks, dim=1)]
    with torch.no_grad():
        teacher = [F.linear(c, wt) for c in ht.chunk(chunks, dim=1)]
    labels = [c.reshape(-1) for c in y.chunk(chunks, dim=1)]
    ce = 0.0
    for s_chunk, l_chunk in zip(student, labels):
        ce += F.cross_entropy(s_chunk.reshape(-1, s_chunk.size(-1)).float(), l_chunk, ignore_index=-100,
                              reduction="sum")
    ce = ce / (y != -100).sum()
    kd = 0.0
    for s_chunk, t_chunk, l_chunk in zip(student, teacher, labels):
        kd += _torchtune_fkl(s_chunk.reshape(-1, s_chunk.size(-1)), t_chunk.reshape(-1, t_chunk.size(-1)), l_chunk,
                             normalize=False)
    kd = kd / torch.sum((y != -100).int().view(-1), dim=0)
    return (1 - ratio) * ce + ratio * kd


@pytest.mark.parametrize("fn, sites", [(_sum_ce_and_kd, 2), (_torchtune_kd_recipe, 4)])
def test_heads_beside_the_divergence_fuse_as_ops_of_their_own(fn, sites):
    """A cross-entropy of the student's logits that the divergence's op cannot mix in (summed over a
    count, torchtune's chunks): the divergence one op, the cross-entropy another, each computing the
    student's logits; eager's values and gradients, no [N, V] tensor left."""
    ins = _inputs()
    report = inductor_xent.explain(fn, **ins)
    assert report.fused_count == len(report.sites) == sites, str(report)
    assert all("heads, each an op of its own" in s.reason for s in report.sites if s.pattern == "distillation")
    rec = Recorder()
    assert_parity(fn, ins, rec, what=fn.__name__)
    assert ops.DISTILL_FORWARD in rec.after[0] and fused_ops(rec.after[0]) == sites // 2
    assert not logits_sized(rec.graphs, rows=B * T // (sites // 2)), "no [N, V] tensor is left in the graph"


def _masked_rows(hs, ws, ht, wt, mf):
    s = F.linear(hs, ws)
    with torch.no_grad():
        t = F.linear(ht, wt)
    rows = F.kl_div(F.log_softmax(s, -1), F.softmax(t, -1), reduction="none").sum(-1)
    return (rows * mf).sum() / mf.sum()


def _float_mask_written(hs, ws, ht, wt, y, **_):  # eager reads the written float mask, the op its boolean
    mf = (y != -100).float()
    mf[:, 1] = 0.0
    return _masked_rows(hs, ws, ht, wt, mf)


def _bool_written_after_cast(hs, ws, ht, wt, y, **_):  # eager reads the cast taken before the write
    m = y != -100
    mf = m.float()
    m[:, 1] = False
    return _masked_rows(hs, ws, ht, wt, mf)


def _bool_written_before_cast(hs, ws, ht, wt, y, **_):  # both read the written mask: fuses
    m = y != -100
    m[:, 1] = False
    return _masked_rows(hs, ws, ht, wt, m.float())


def _teacher_written_after_the_loss(hs, ws, ht, wt, y, **_):  # eager's no-grad teacher linear saved nothing
    with torch.no_grad():
        h2 = ht * 1.0
        t = F.linear(h2, wt)
    loss = F.kl_div(F.log_softmax(F.linear(hs, ws), -1), F.softmax(t, -1), reduction="none").sum(-1).mean()
    with torch.no_grad():
        h2.zero_()
    return loss


def _ce_logits_read_elsewhere(hs, ws, ht, wt, y, **_):  # the CE beside the KD would decline: both stay
    s = F.linear(hs, ws)
    with torch.no_grad():
        t = F.linear(ht, wt)
    sf = s.float()
    ce = F.cross_entropy(sf.view(-1, V), y.view(-1), reduction="sum") / (y != -100).sum()
    kd = F.kl_div(F.log_softmax(s / 2, -1), F.softmax(t / 2, -1), reduction="batchmean")
    return ce + kd + 1e-4 * sf.pow(2).mean()


def _beside_head_declining_elsewhere(hs, ws, ht, wt, y, **_):  # its ids after a logsumexp: that site declines
    s = F.linear(hs, ws)
    with torch.no_grad():
        t = F.linear(ht, wt)
    loss = F.kl_div(F.log_softmax(s, -1), F.softmax(t, -1), reduction="batchmean")
    return loss - F.log_softmax(s, -1).gather(-1, s.detach().topk(4, -1).indices).mean()


@pytest.mark.parametrize("fn, fused, words", [
    (_beside_head_declining_elsewhere, 0, "other users"),
    (_float_mask_written, 0, "writes the row mask or its cast after the cast"),
    (_bool_written_after_cast, 0, "writes the row mask or its cast after the cast"),
    (_bool_written_before_cast, 1, ""),
    (_teacher_written_after_the_loss, 0, "after the loss, and the fused op's backward reads it"),
    (_ce_logits_read_elsewhere, 0, "other users"),
])
def test_writes_and_readers_the_divergence_must_see(fn, fused, words):
    """The review of 6055f45: a row mask written between its cast and the loss (the op reads the
    boolean, eager its cast); a head's input written after the loss (the op saves it, eager's no-grad
    linear did not: its backward failed); a cross-entropy beside the divergence whose logits have
    another reader (it declines: the divergence alone would leave the logits and add an op). Each
    declines with the reason, or fuses where both read the same, with eager's values."""
    ins = _inputs()  # (the student's tensors train, as in the compiled run)
    report = inductor_xent.explain(fn, **{k: v.clone().requires_grad_(k in ("hs", "ws")) if v.is_floating_point()
                                          else v.clone() for k, v in ins.items()})
    assert report.fused_count == fused, str(report)
    assert all(words in site.reason for site in report.sites if not site.fused), str(report)
    assert_parity(fn, {k: v.clone() for k, v in ins.items()}, Recorder(), what=fn.__name__)


def test_labels_written_after_their_mask_decline_the_mix():
    """The CE mix masks the divergence by the CE's labels: a write to them after the mask was taken
    (before the heads) would mask other rows than the user's, so the mix declines; the divergence (its
    mask as taken) and the cross-entropy (the labels as written) are then ops of their own, as eager."""

    def fn(hs, ws, ht, wt, y, **_):
        m = y != -100
        y[:, 3] = -100
        s = F.linear(hs, ws)
        kl = F.kl_div(F.log_softmax(s, -1), F.log_softmax(F.linear(ht, wt).detach(), -1), reduction="none",
                      log_target=True)
        return 0.5 * kl[m].sum() + 0.7 * F.cross_entropy(s.view(-1, V), y.view(-1))

    ins = _inputs()
    report = inductor_xent.explain(fn, **{k: v.clone() for k, v in ins.items()})
    assert report.fused_count == 2 and "heads, each an op of its own" in report.sites[0].reason, str(report)
    assert_parity(fn, ins, Recorder(), what="labels written")


def test_masked_mean_of_no_rows_is_nan_with_zero_gradients():
    """``jsd[mask].mean()`` with every label ignored: eager's NaN loss and zero gradients (nothing was
    indexed), not NaN gradients from 0 / 0."""
    ins = {k: v.requires_grad_(k in ("hs", "ws")) for k, v in _inputs().items()}
    ins["y"][:] = -100
    from torch._dynamo.utils import counters

    counters.clear()
    fn = functools.partial(_trl116_gjsd, mean=True)
    loss = torch.compile(fn, backend=Recorder())(**ins)
    loss.backward()
    assert loss.isnan() and ins["hs"].grad.eq(0).all() and ins["ws"].grad.eq(0).all()
    assert counters["inductor_xent"]["fused.distillation"] == 1


@pytest.mark.parametrize("reduction", ["batchmean", "rows", "mix"])
@pytest.mark.parametrize("strategy", ["", "recompute"])
def test_heads_over_boolean_masked_rows(reduction, strategy, monkeypatch):
    """Both heads over ``hidden[mask]`` (a row count known only at run time, under the capture): the op's
    backward must not branch on it (it raised GuardOnDataDependentSymNode); eager's values and grads."""
    monkeypatch.setenv("INDUCTOR_XENT_STRATEGY", strategy)

    def fn(hs, ws, ht, wt, y, **_):
        m = y != -100
        s, t = F.linear(hs[m], ws), F.linear(ht[m], wt).detach()
        if reduction == "rows":
            return F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), reduction="none",
                            log_target=True).sum(-1).mean()
        if reduction == "mix":  # (a batchmean's divisor is the unbacked count here: that mix declines)
            kd = F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), reduction="sum", log_target=True)
            return 0.1 * kd + 0.5 * F.cross_entropy(s, y[m])
        return F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), reduction="batchmean", log_target=True)

    ins = _inputs()
    rec = Recorder()
    assert_parity(fn, ins, rec, what=f"masked rows {reduction}")
    assert any(ops.DISTILL_FORWARD in a or ops.DISTILL_RECOMPUTE in a for a in rec.after)


def test_write_between_the_heads_and_the_loss_declines():
    """``s.div_(T)`` after the lm_head: the op would read the heads' inputs at the loss, past the write."""
    def fn(hs, ws, ht, wt, **_):
        s = F.linear(hs, ws)
        s.div_(2.0)
        return F.kl_div(F.log_softmax(s, -1), F.softmax(F.linear(ht, wt).detach(), -1), reduction="batchmean")

    ins = _inputs()
    report = inductor_xent.explain(fn, **ins)
    assert report.fused_count == 0, str(report)
    assert any("writes" in s.reason for s in report.sites if s.pattern == "distillation"), str(report)


def _op_inputs(seed: int, trained_teacher: bool):
    """The ops' operands as the functional API passes them (2-D hidden states, 1-D targets), the
    student's (and a trained teacher's) requiring gradients, and the ``needs`` that says so."""
    ins = _inputs(seed=seed)
    hs, ws, bs = ins["hs"].reshape(-1, DS), ins["ws"], ins["bs"]
    ht, wt = ins["ht"].reshape(-1, DT), ins["wt"]
    for t in (hs, ws, bs) + ((ht, wt) if trained_teacher else ()):
        t.requires_grad_()
    return hs, ws, bs, ht, wt, ins["y"].reshape(-1), [True, True, True, trained_teacher, trained_teacher, False]


@pytest.mark.parametrize("reduction, hard, trained_teacher, caps", [
    ("sum", 0.0, False, ()), ("mean", 0.3, True, (1.5, None)), ("none", 0.0, False, ()), ("none", 0.3, True, (None, 2.5))])
def test_opcheck_distill_ops(reduction, hard, trained_teacher, caps):
    """The two ops' schemas, fake shapes, autograd registration and aliasing (STYLE rule 5): the
    forward for a reduced loss (its gradients in the forward) and per row (the backward op's case),
    the hard-label CE mixed in or not, a student bias, the teacher trained or not, softcaps or not."""
    from inductor_xent import distill

    hs, ws, bs, ht, wt, y, needs = _op_inputs(11, trained_teacher)
    common = (y, -100, "jsd", 0.4, 1 / 1.5, 1 / 2.0)
    weights = (1.0 - hard, hard, True, "", *caps)
    torch.library.opcheck(distill.linear_distill_fwd, (hs, ws, bs, ht, wt, None, *common, reduction, needs, *weights))
    if reduction == "none":
        grad_rows = torch.randn(hs.shape[0])
        plain = [t.detach() for t in (hs, ws, bs, ht, wt)]
        torch.library.opcheck(distill.linear_distill_bwd, (grad_rows, *plain[:3], *plain[3:], None, *common, needs,
                                                           *weights))


# ---------------------------------------------------------------------------------------------
# recompute (a store budget of 0): per-row statistics kept, the backward over vocabulary chunks
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def recompute_chunks(monkeypatch):
    """Small recompute chunks on CPU (rows of 3 in the forward, columns of 8 in the backward: V = 29
    in four, the last short); counts each chunk's math, forward ("stats") and backward ("cols")."""
    from inductor_xent import config, distill

    monkeypatch.setattr(config, "fallback_chunk_bytes", 3 * V * 4 * distill.CHUNK_TENSORS)
    assert distill.recompute_slice(B * T, V, torch.device("cpu")) == 3
    assert distill.recompute_slice(V, B * T, torch.device("cpu")) == 8
    calls = []
    for name, tag in (("_stats_math", "stats"), ("_recompute_math", "cols")):
        real = getattr(distill, name)
        monkeypatch.setattr(distill, name, lambda *a, _r=real, _t=tag, **k: calls.append(_t) or _r(*a, **k))
    return calls


def _labelled_chunks(y) -> tuple[int, int]:
    """The recompute's row chunks and column chunks on CPU, which runs on the labelled rows alone."""
    from inductor_xent import distill

    rows, cpu = int((y != -100).sum()), torch.device("cpu")
    return -(-rows // distill.recompute_slice(rows, V, cpu)), -(-V // distill.recompute_slice(V, rows, cpu))


@pytest.mark.parametrize("hard", [0.0, 0.3])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_recompute_matches_float64(kind, reduction, hard, recompute_chunks):
    """store_budget=0: the loss and every gradient (student and teacher, the student's bias) within
    torch's error of float64, the hard-label CE mixed in or not, over several row and column chunks."""
    ins = _inputs(seed=5)
    kw = dict(kind=kind, beta=0.3, temperature=1.7, reduction=reduction)

    def ours(hs, ws, bs, ht, wt, y):
        return linear_distillation_loss(hs, ws, ht, wt, y, student_bias=bs, soft_weight=1.3, hard_weight=hard,
                                        store_budget=0, **kw)

    def theirs(hs, ws, bs, ht, wt, y):
        return _mixed_reference(hs, ws, bs, ht, wt, y, kind, 0.3, 1.7, reduction, 1.3, hard)

    out, grads = _run(ours, ins)
    same, same_g = _run(theirs, ins)
    exact, exact_g = _run(theirs, ins, torch.float64)
    what = f"{kind} {reduction} hard={hard}"
    assert_within_torch_error(out, same, exact, what=f"{what} loss")
    assert set(grads) == set(same_g) == {"hs", "ws", "bs", "ht", "wt"}
    for k in grads:
        assert_within_torch_error(grads[k], same_g[k], exact_g[k], what=f"{what} grad {k}")
    row_chunks, col_chunks = _labelled_chunks(ins["y"])  # several of each (3 and 3)
    assert min(row_chunks, col_chunks) > 1
    assert recompute_chunks.count("stats") == row_chunks and recompute_chunks.count("cols") == col_chunks, \
        recompute_chunks


def test_recompute_in_bfloat16_within_torch_error(recompute_chunks):
    """bf16 operands: the hidden states' gradients summed over the column chunks in fp32 and rounded
    once, each weight-gradient chunk one GEMM: within torch's error of float64."""
    ins = _inputs(seed=6)
    kw = dict(kind="jsd", beta=0.4, temperature=2.0, reduction="batchmean")

    def ours(hs, ws, bs, ht, wt, y):
        return linear_distillation_loss(hs, ws, ht, wt, y, student_bias=bs, hard_weight=0.5, store_budget="0x",
                                        **kw)

    def theirs(hs, ws, bs, ht, wt, y):
        return _mixed_reference(hs, ws, bs, ht, wt, y, kw["kind"], 0.4, 2.0, kw["reduction"], 1.0, 0.5)

    bf16 = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in ins.items()}
    out, grads = _run(ours, bf16, teacher_grad=False)
    same, same_g = _run(theirs, bf16, teacher_grad=False)
    exact, exact_g = _run(theirs, bf16, torch.float64, teacher_grad=False)
    assert_within_torch_error(out, same, exact, what="bf16 loss")
    assert recompute_chunks.count("cols") == _labelled_chunks(ins["y"])[1] > 1
    for k in grads:
        assert grads[k].dtype == torch.bfloat16
        assert_within_torch_error(grads[k], same_g[k], exact_g[k], what=f"bf16 grad {k}")


def test_recompute_keeps_no_logits_sized_tensor(recompute_chunks):
    """What autograd saves for the backward: the inputs and [N, STATS] statistics, no [N, V] tensor
    (the default op saves its gradients, the student's weight gradient among them)."""
    from inductor_xent import distill

    ins = {k: v.reshape(-1, v.shape[-1]) if v.dim() == 3 else v for k, v in _inputs().items()}
    hs, ws = ins["hs"].requires_grad_(), ins["ws"].requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        loss = linear_distillation_loss(hs, ws, ins["ht"], ins["wt"], ins["y"].reshape(-1), store_budget=0)
    loss.backward()
    assert (B * T, distill.STATS) in saved and (B * T, V) not in saved, saved
    assert recompute_chunks.count("cols") == _labelled_chunks(ins["y"])[1] > 1


def test_recompute_follows_the_budget_and_the_strategy(recompute_chunks, monkeypatch):
    """store_budget 0 / "0x", INDUCTOR_XENT_STORE_BUDGET=0 and INDUCTOR_XENT_STRATEGY=recompute take
    the recompute op; the default budget and a loss without gradients do not; through the backend
    xent.strategy="recompute" puts it in the graph, and explain says so."""
    ins = {k: v.requires_grad_(k in ("hs", "ws")) if v.is_floating_point() else v for k, v in _inputs().items()}
    args = (ins["hs"], ins["ws"], ins["ht"], ins["wt"], ins["y"])

    def ran(**kw):
        recompute_chunks.clear()
        linear_distillation_loss(*args, **kw).backward()
        return "cols" in recompute_chunks

    assert ran(store_budget=0) and ran(store_budget="0x") and not ran() and not ran(store_budget="1")
    for env, value in (("INDUCTOR_XENT_STORE_BUDGET", "0"), ("INDUCTOR_XENT_STRATEGY", "recompute")):
        monkeypatch.setenv(env, value)
        assert ran()
        monkeypatch.delenv(env)
    recompute_chunks.clear()
    with torch.no_grad():
        linear_distillation_loss(*args, store_budget=0)
    assert not recompute_chunks
    monkeypatch.setenv("INDUCTOR_XENT_STRATEGY", "recompute")
    site = inductor_xent.explain(_hinton, **{k: ins[k] for k in ("hs", "ws", "ht", "wt")}).sites[0]
    monkeypatch.delenv("INDUCTOR_XENT_STRATEGY")
    assert site.fused and site.strategy == "recompute" and "vocabulary chunks" in site.strategy_reason, site
    rec = Recorder(**{"xent.strategy": "recompute"})
    compiled = torch.compile(_hinton, backend=rec)
    recompute_chunks.clear()
    compiled(**{k: ins[k] for k in ("hs", "ws", "ht", "wt")}).backward()
    assert ops.DISTILL_RECOMPUTE in rec.after[0] and ops.DISTILL_FORWARD not in rec.after[0]
    assert "cols" in recompute_chunks


@pytest.mark.parametrize("reduction, hard, trained_teacher, caps", [("batchmean", 0.0, False, ()),
                                                                    ("none", 0.3, True, (1.5, 2.5))])
def test_opcheck_recompute_ops(reduction, hard, trained_teacher, caps):
    """The recompute ops' schemas, fakes, autograd and aliasing (STYLE rule 5)."""
    from inductor_xent import distill

    hs, ws, bs, ht, wt, y, needs = _op_inputs(12, trained_teacher)
    common = (y, -100, "forward_kl", 0.5, 1 / 1.5, 1 / 1.5)
    weights = (1.0 - hard, hard, True, *caps)
    torch.library.opcheck(distill.linear_distill_recompute_fwd,
                          (hs, ws, bs, ht, wt, None, *common, reduction, needs, *weights))
    stats = distill.linear_distill_recompute_fwd(*(t.detach() for t in (hs, ws, bs, ht, wt)), None, *common,
                                                 reduction, needs, *weights)[1]
    n = hs.shape[0]
    plain = [t.detach() for t in (hs, ws, bs, ht, wt)]
    torch.library.opcheck(distill.linear_distill_recompute_bwd,
                          (torch.randn(n), torch.randn(n) if hard else None, stats, *plain, None, y, "forward_kl",
                           0.5, 1 / 1.5, 1 / 1.5, needs, *caps))


def test_recompute_gives_the_same_bits_every_time(recompute_chunks):
    """The same inputs, the same loss and gradient bits (fixed chunks, no atomics)."""
    ins = _inputs(seed=13)

    def ours(hs, ws, bs, ht, wt, y):
        return linear_distillation_loss(hs, ws, ht, wt, y, student_bias=bs, kind="jsd", beta=0.3, hard_weight=0.2,
                                        store_budget=0)

    (a, ga), (b, gb) = _run(ours, ins), _run(ours, ins)
    assert torch.equal(a, b) and ga.keys() == gb.keys()
    assert all(torch.equal(ga[k], gb[k]) for k in ga)


def test_recompute_under_autocast_matches_the_default_path(recompute_chunks):
    """CPU bf16 autocast, bf16 hidden states with fp32 master weights and bias: the recompute op gets
    the cast operands (its ran chunks say so), the fp32 leaves get fp32 gradients through the casts,
    and the loss and gradients agree with the default path's to bf16's rounding."""
    ins = _inputs(seed=14)
    y = ins["y"]
    leaves = (ins["hs"].bfloat16().requires_grad_(), ins["ws"].clone().requires_grad_(),
              ins["bs"].clone().requires_grad_())
    out = {}
    for budget in (0, "1x"):
        recompute_chunks.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = linear_distillation_loss(*leaves[:2], ins["ht"].bfloat16(), ins["wt"], y, student_bias=leaves[2],
                                            kind="reverse_kl", temperature=2.0, hard_weight=0.3, store_budget=budget)
        out[budget] = (loss.detach(), torch.autograd.grad(loss, leaves))
        assert ("cols" in recompute_chunks) == (budget == 0)
    (l0, g0), (l1, g1) = out[0], out["1x"]
    assert [g.dtype for g in g0] == [torch.bfloat16, torch.float32, torch.float32]
    torch.testing.assert_close(l0, l1, rtol=1e-5, atol=1e-6)
    for a, b in zip(g0, g1):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 2**-8


# ---------------------------------------------------------------------------------------------
# ignored rows: the kept path computes the labelled rows only (distill.skips_rows)
# ---------------------------------------------------------------------------------------------
def _prompted(n=48, ds=16, dt=24, v=64, seed=31, device="cpu", prompt=14, pad=3):
    """bf16 heads without biases and a target whose first ``prompt`` rows of each of two sequences
    are a prompt (ignored), and the last ``pad`` rows padding; 16-byte aligned rows (the TMA path)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, v, (n,), generator=g)
    for s in range(2):
        y[s * n // 2: s * n // 2 + prompt] = -100
    y[n - pad:] = -100
    ins = dict(hs=torch.randn(n, ds, generator=g), ws=torch.randn(v, ds, generator=g) * 0.5,
               ht=torch.randn(n, dt, generator=g), wt=torch.randn(v, dt, generator=g) * 0.5)
    return {k: x.to(device, torch.bfloat16) for k, x in ins.items()}, y.to(device)


def _skip_calls(monkeypatch):
    """Counts the count-bounded GEMMs that run (templates/rows.py's, for the chunks and the gradients;
    the interpreter's rows_mm calls itself again into an fp32 copy of a 16-bit output: not counted)."""
    from inductor_xent.templates import rows

    calls, depth = [], [0]
    real = rows.rows_mm

    def counted(*a, **k):
        if not depth[0]:
            calls.append(k["bound"])
        depth[0] += 1
        try:
            return real(*a, **k)
        finally:
            depth[0] -= 1
    monkeypatch.setattr(rows, "rows_mm", counted)
    return calls


def _check_skipping(ins: dict, y, kw: dict, what: str) -> None:
    """``linear_distillation_loss(**kw)`` on ``_prompted``'s bf16 heads against the same spelling in
    bf16 and float64 (``_mixed_reference``): values and the student's gradients (for a random upstream
    gradient) within torch's error, and the ignored rows' hidden gradient exactly 0."""
    seed = torch.Generator().manual_seed(2)

    def run(dtype, fn):
        leaves = {k: x.detach().to(dtype).requires_grad_(k in ("hs", "ws")) for k, x in ins.items()}
        out = fn(leaves["hs"], leaves["ws"], leaves["ht"], leaves["wt"], y)
        gout = torch.randn(out.shape, generator=seed.manual_seed(2), dtype=torch.float64).to(out.device, out.dtype)
        return (out.detach(), *torch.autograd.grad(out, [leaves["hs"], leaves["ws"]], gout))

    def theirs(hs, ws, ht, wt, y):
        return _mixed_reference(hs, ws, None, ht, wt, y, kw["kind"], kw["beta"], kw["temperature"], kw["reduction"],
                                kw["soft_weight"], kw["hard_weight"])

    with compat.ieee_fp32_matmuls():
        ours = run(torch.bfloat16, lambda *a: linear_distillation_loss(*a, **kw))
        same, exact = run(torch.bfloat16, theirs), run(torch.float64, theirs)
    for name, a, b, c in zip(("loss", "hs", "ws"), ours, same, exact):
        assert_within_torch_error(a, b, c, what=f"{what} {name}")
    assert torch.equal(ours[1][y == -100], torch.zeros_like(ours[1][y == -100]))


# the count-bounded GEMMs run on CPU tensors only in Triton's interpreter (the CPU suite's); the GPU box
# runs test_cuda_kept_dz_skips_ignored_rows instead
interpreter_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                                      reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1")


@interpreter_only
@pytest.mark.parametrize("kind, reduction, hard", [("forward_kl", "batchmean", 0.0), ("reverse_kl", "mean", 0.4),
                                                   ("jsd", "sum", 0.0), ("forward_kl", "none", 0.4)])
def test_kept_dz_skips_ignored_rows(kind, reduction, hard, keep_dz_on_cpu, monkeypatch):
    """With a target (prompt spans and padding ignored) the kept path moves the labelled rows first
    and every GEMM stops at their count (both heads' logits per chunk, both student gradients):
    values and student gradients within torch's error of float64, the ignored rows' hidden gradient
    exactly 0, chunks of 3 rows past the count included."""
    from inductor_xent import distill

    monkeypatch.setattr(distill, "TEACHER_CHUNK_BYTES", 3 * 64 * 2)  # 3 bf16 rows of V = 64
    calls = _skip_calls(monkeypatch)
    ins, y = _prompted()
    kw = dict(kind=kind, beta=0.3, temperature=1.5, reduction=reduction, soft_weight=1.2, hard_weight=hard)
    _check_skipping(ins, y, kw, f"{kind} {reduction}")
    assert "op" in keep_dz_on_cpu, "the kept path did not run"
    # a per-row loss's forward (its rows only, one chunk of both heads' logits), then both heads' logits
    # in 16 chunks of 3 rows, then dH and dW
    assert calls == ["m", "m"] * (reduction == "none") + ["m"] * (2 * 16) + ["m", "k"], calls


@interpreter_only
def test_kept_dz_never_reads_ignored_rows(keep_dz_on_cpu, monkeypatch):
    """With the labelled rows' count a multiple of the GEMMs' K step (16 under the interpreter, 64 on
    the GPU: the weight gradient's K loop reads whole steps), NaN in the ignored rows' hidden states
    (student and teacher) leaves the loss and the student's gradients finite and equal to those of
    the labelled rows alone. Fails if those rows are computed: with INDUCTOR_XENT_SKIP_IGNORED=0 the
    NaN reaches the weight gradient."""
    ins, y = _prompted(seed=32, prompt=16, pad=0)  # 16 labelled rows
    keep = y != -100
    for k in ("hs", "ht"):
        ins[k][~keep] = float("nan")

    def run(sel):
        hs, ws = ins["hs"][sel].clone().requires_grad_(), ins["ws"].clone().requires_grad_()
        loss = linear_distillation_loss(hs, ws, ins["ht"][sel], ins["wt"], y[sel], kind="jsd", reduction="sum",
                                        hard_weight=0.5)
        loss.backward()
        return loss.detach(), hs.grad, ws.grad

    everything = torch.ones_like(keep)
    loss, gh, gw = run(everything)
    loss_v, gh_v, gw_v = run(keep)
    assert "op" in keep_dz_on_cpu, "the kept path did not run"
    assert torch.allclose(loss, loss_v, rtol=1e-6, atol=0) and torch.equal(gw, gw_v)  # the sum's order differs
    assert torch.equal(gh[keep], gh_v) and torch.equal(gh[~keep], torch.zeros_like(gh[~keep]))
    monkeypatch.setenv("INDUCTOR_XENT_SKIP_IGNORED", "0")
    assert run(everything)[2].isnan().any()


@interpreter_only
def test_kept_dz_skips_only_where_it_may(keep_dz_on_cpu, monkeypatch):
    """No target, an unmasked divergence (the pass's α·CE + β·KD), a bias, fp32 heads, or
    INDUCTOR_XENT_SKIP_IGNORED=0: every row computed, by cuBLAS-style whole GEMMs."""
    from inductor_xent import distill

    ins, y = _prompted()
    hs, ws, ht, wt = ins["hs"], ins["ws"], ins["ht"], ins["wt"]
    bias = torch.zeros(ws.shape[0], dtype=ws.dtype)
    assert distill.skips_rows(hs, ws, None, ht, wt, None, y, True)
    assert not distill.skips_rows(hs, ws, None, ht, wt, None, None, True)
    assert not distill.skips_rows(hs, ws, None, ht, wt, None, y, False)
    assert not distill.skips_rows(hs, ws, bias, ht, wt, None, y, True)
    assert not distill.skips_rows(hs.float(), ws.float(), None, ht.float(), wt.float(), None, y, True)
    monkeypatch.setenv("INDUCTOR_XENT_SKIP_IGNORED", "0")
    assert not distill.skips_rows(hs, ws, None, ht, wt, None, y, True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("budget", ["1x", "1"])
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_kept_dz_skips_ignored_rows(kind, budget, monkeypatch):
    """On the GPU in bf16 with half of each sequence a prompt and some padding: the labelled
    rows only (every GEMM count-bounded), values and student gradients within torch's error of
    float64 over several chunks, the ignored rows' hidden gradient 0; the kept gradient logits (1x)
    and the accumulating chunks (a 1-byte budget)."""
    from inductor_xent import distill

    monkeypatch.setenv("INDUCTOR_XENT_STORE_BUDGET", budget)
    monkeypatch.setattr(distill, "TEACHER_CHUNK_BYTES", 256 * 4096 * 2)  # kept: chunks of 256 rows
    monkeypatch.setattr(distill, "CUDA_CHUNK_BYTES", 256 * 4096 * 4 * distill.CHUNK_TENSORS)  # accumulating: too
    calls = _skip_calls(monkeypatch)
    ins, y = _prompted(n=1024, ds=256, dt=384, v=4096, seed=33, device="cuda", prompt=256, pad=37)
    kw = dict(kind=kind, beta=0.3, temperature=2.0, reduction="batchmean", soft_weight=2.8, hard_weight=0.3)
    _check_skipping(ins, y, kw, kind)
    # both heads' logits in each of the 4 chunks, then dH and dW (kept), or dH and dW in each chunk
    assert calls == (["m"] * 8 + ["m", "k"] if budget == "1x" else ["m", "m", "m", "k"] * 4), calls


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["trl116_gjsd", "masked_kd_with_labels"])
def test_cuda_masked_spellings_compiled(name, monkeypatch):
    """TRL 1.16's GKD loss (``jsd[mask]``) and a masked KD with the CE of the same labels, compiled
    through Inductor on the GPU in bf16: fused, the masked rows not computed (count-bounded GEMMs),
    eager's values and student gradients within torch's error of float64."""
    calls = _skip_calls(monkeypatch)
    ins, y = _prompted(n=1024, ds=256, dt=384, v=4096, seed=37, device="cuda", prompt=256, pad=37)
    args = dict(hs=ins["hs"], ws=ins["ws"], ht=ins["ht"], wt=ins["wt"], y=y)
    if name == "trl116_gjsd":
        args.update(hs=ins["hs"].view(2, 512, -1), ht=ins["ht"].view(2, 512, -1), y=y.view(2, 512))
    fn = FUSED[name]
    assert inductor_xent.explain(fn, **args).fused_count == 1
    le, ge, lc, gc, l64, g64 = run_both(fn, args, "inductor_xent")
    # the loss: a sum over ~700 rows' KLs of bf16-rounded logits, ours and eager's alike, each run one draw
    # of that rounding (on an H100 ours 1.8e-4 from float64 against eager's lucky 3.9e-5): bounded at the
    # logits' precision (a row counted wrongly is 1.4e-3), the gradients against eager's error
    bound = 5e-4 + torch.finfo(lc.dtype).eps / 2  # and the loss's own rounding (TRL's: a bf16 sum)
    assert lc.dtype == le.dtype and rel_err(lc, l64) <= bound, (rel_err(lc, l64), rel_err(le, l64))
    assert set(gc) == set(ge)
    for k in ge:
        assert_within_torch_error(gc[k], ge[k], g64[k], what=f"{name} grad {k}")
    assert "k" in calls, "the masked rows were computed"


@interpreter_only
@pytest.mark.parametrize("kind, reduction, hard", [("forward_kl", "batchmean", 0.0), ("jsd", "mean", 0.4),
                                                   ("reverse_kl", "none", 0.4)])
def test_recompute_skips_ignored_rows(kind, reduction, hard, monkeypatch):
    """A store budget of 0 with a target: the forward's row chunks and the backward's column chunks
    compute the labelled rows only (every GEMM count-bounded: both heads' logits, dH through the row
    order into its fp32 sum, dW), values and student gradients within torch's error of float64, the
    ignored rows' hidden gradient exactly 0; 10 row chunks of 5 and 11 column chunks of 6."""
    from inductor_xent import config

    monkeypatch.setattr(config, "fallback_chunk_bytes", 5 * 64 * 4 * 8)
    calls = _skip_calls(monkeypatch)
    ins, y = _prompted()
    kw = dict(kind=kind, beta=0.3, temperature=1.5, reduction=reduction, soft_weight=1.2, hard_weight=hard,
              store_budget=0)
    _check_skipping(ins, y, kw, f"{kind} {reduction}")
    # both heads' logits of 10 row chunks, then of 11 column chunks, their dH (into an fp32 sum) and dW
    assert calls.count("m") == 2 * 10 + 3 * 11 and calls.count("k") == 11, calls


@interpreter_only
def test_recompute_never_reads_ignored_rows(monkeypatch):
    """A store budget of 0, 16 labelled rows (a whole K step): NaN in the ignored rows' hidden states
    leaves the loss and the student's gradients finite and equal to the labelled rows' alone (the weight
    gradient's bits; the hidden one's fp32 sum runs over other column chunks there). With
    INDUCTOR_XENT_SKIP_IGNORED=0 the NaN reaches the weight gradient."""
    ins, y = _prompted(seed=34, prompt=16, pad=0)
    keep = y != -100
    for k in ("hs", "ht"):
        ins[k][~keep] = float("nan")

    def run(sel):
        hs, ws = ins["hs"][sel].clone().requires_grad_(), ins["ws"].clone().requires_grad_()
        loss = linear_distillation_loss(hs, ws, ins["ht"][sel], ins["wt"], y[sel], kind="forward_kl",
                                        reduction="mean", hard_weight=0.5, store_budget=0)
        loss.backward()
        return loss.detach(), hs.grad, ws.grad

    everything = torch.ones_like(keep)
    loss, gh, gw = run(everything)
    loss_v, gh_v, gw_v = run(keep)
    assert torch.allclose(loss, loss_v, rtol=1e-6, atol=0) and torch.equal(gw, gw_v)
    assert torch.allclose(gh[keep].float(), gh_v.float(), rtol=1e-2, atol=1e-6)
    assert torch.equal(gh[~keep], torch.zeros_like(gh[~keep]))
    from inductor_xent.distill import linear_distill_recompute_fwd

    _, stats = linear_distill_recompute_fwd(ins["hs"], ins["ws"], None, ins["ht"], ins["wt"], None, y, -100,
                                            "forward_kl", 0.5, 1.0, 1.0, "mean", [True, True] + [False] * 4)
    assert stats[keep].isfinite().all() and torch.equal(stats[~keep], torch.zeros_like(stats[~keep]))
    monkeypatch.setenv("INDUCTOR_XENT_SKIP_IGNORED", "0")
    assert run(everything)[2].isnan().any()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_recompute_skips_ignored_rows(kind, monkeypatch):
    """On the GPU in bf16 at a store budget of 0 with half of each sequence a prompt: the labelled
    rows only in both passes (4 row chunks forward, 7 column chunks backward), values and student
    gradients within torch's error of float64, the ignored rows' hidden gradient 0."""
    from inductor_xent import distill

    monkeypatch.setattr(distill, "RECOMPUTE_CHUNK_BYTES", 256 * 4096 * 2 * 2)
    assert distill.recompute_slice(1024, 4096, torch.device("cuda"), 2, 2) == 256
    assert distill.recompute_slice(4096, 1024, torch.device("cuda"), 2, 3) == 640
    calls = _skip_calls(monkeypatch)
    ins, y = _prompted(n=1024, ds=256, dt=384, v=4096, seed=35, device="cuda", prompt=256, pad=37)
    kw = dict(kind=kind, beta=0.3, temperature=2.0, reduction="batchmean", soft_weight=2.8, hard_weight=0.3,
              store_budget=0)
    _check_skipping(ins, y, kw, kind)
    assert calls.count("m") == 2 * 4 + 3 * 7 and calls.count("k") == 7, calls  # 4 row chunks, 7 column chunks


@interpreter_only
@pytest.mark.parametrize("name", ["log_target_masked", "trl_gjsd_masked_rows", "verl_masked_mean", "trl116_gjsd",
                                  "trl116_gjsd_mean", "masked_kd_with_labels"])
def test_masked_sum_spelling_skips_the_masked_rows(name, keep_dz_on_cpu, monkeypatch):
    """Per-row divergences times a boolean row mask (cast or not): ``(rows * mask).sum() / mask.sum()``
    becomes one site of reduction ``sum``, a masked mean over each sequence a per-row site; either way
    the mask is the op's target, so the kept path computes the masked rows only (their GEMMs
    count-bounded); eager's values and student gradients, bf16 biasless heads."""
    calls = _skip_calls(monkeypatch)
    ins, y = _prompted()
    fn = functools.partial(FUSED[name], bs=None) if name == "log_target_masked" else FUSED[name]
    args = dict(hs=ins["hs"], ws=ins["ws"], ht=ins["ht"], wt=ins["wt"], y=y)
    if name.startswith("trl116"):  # two sequences [2, n / 2, D], shifted by one position
        args.update(hs=ins["hs"].view(2, -1, ins["hs"].size(-1)), ht=ins["ht"].view(2, -1, ins["ht"].size(-1)),
                    y=y.view(2, -1))
    site = inductor_xent.explain(fn, **args).sites[0]
    assert site.fused and "row mask" in site.reason, site.reason
    rec = Recorder()
    assert_parity(fn, args, rec, what=name)
    assert ops.DISTILL_FORWARD in rec.after[0] and "op" in keep_dz_on_cpu
    assert "k" in calls, "the masked rows were computed"


@interpreter_only
@pytest.mark.parametrize("trained", ["hidden_only", "both_heads"])
def test_accumulating_chunks_skip_ignored_rows(trained, monkeypatch):
    """The accumulating chunks (a frozen student head, as LoRA trains; a trained teacher): with a target
    the labelled rows only, every GEMM count-bounded (the hidden states' gradients through the row
    order, the weights' added up over 4 chunks); values and every asked gradient within torch's error
    of float64, the ignored rows' hidden gradients exactly 0."""
    from inductor_xent import config

    monkeypatch.setattr(config, "fallback_chunk_bytes", 12 * 64 * 4 * 8)  # chunks of 12 rows
    calls = _skip_calls(monkeypatch)
    ins, y = _prompted(seed=36)
    grad_of = ("hs",) if trained == "hidden_only" else ("hs", "ws", "ht", "wt")
    kw = dict(kind="jsd", beta=0.4, temperature=1.3, reduction="mean", hard_weight=0.2)

    def run(dtype, fn):
        leaves = {k: x.detach().to(dtype).requires_grad_(k in grad_of) for k, x in ins.items()}
        out = fn(leaves["hs"], leaves["ws"], leaves["ht"], leaves["wt"], y)
        return (out.detach(), *torch.autograd.grad(out, [leaves[k] for k in grad_of]))

    def theirs(hs, ws, ht, wt, y):
        return _mixed_reference(hs, ws, None, ht, wt, y, "jsd", 0.4, 1.3, "mean", 1.0, 0.2)

    ours = run(torch.bfloat16, lambda *a: linear_distillation_loss(*a, **kw))
    heads = len(grad_of) // 2 if trained == "both_heads" else 0  # the heads whose weights train
    # per chunk of 12 rows: both heads' logits, each trained hidden state's dH and weight's dW
    assert calls == (["m", "m"] + ["m", "k"] * heads if heads else ["m"] * 3) * 4, calls
    same, exact = run(torch.bfloat16, theirs), run(torch.float64, theirs)
    for name, a, b, c in zip(("loss", *grad_of), ours, same, exact):
        assert_within_torch_error(a, b, c, what=f"{trained} {name}")
    for k, g in zip(grad_of, ours[1:]):
        if k in ("hs", "ht"):
            assert torch.equal(g[y == -100], torch.zeros_like(g[y == -100])), k


@pytest.mark.parametrize("budget", [None, 0])
def test_cpu_chunks_never_read_ignored_rows(budget, monkeypatch):
    """On CPU (fp32, biased heads: no Triton) the chunks run on the labelled rows alone: NaN in the
    ignored rows' hidden states leaves the loss and every gradient (both heads trained) finite, equal
    to those of the labelled rows alone, the ignored rows' hidden gradients 0; the default chunks and a
    store budget of 0. With INDUCTOR_XENT_SKIP_IGNORED=0 the NaN reaches the weight gradient."""
    ins = {k: v.reshape(-1, v.shape[-1]) if v.dim() == 3 else v for k, v in _inputs(seed=37).items()}
    y = ins.pop("y").reshape(-1)
    keep = y != -100
    for k in ("hs", "ht"):
        ins[k][~keep] = float("nan")

    def run(sel):
        leaves = {k: (v[sel] if k in ("hs", "ht") else v).clone().requires_grad_() for k, v in ins.items()}
        loss = linear_distillation_loss(leaves["hs"], leaves["ws"], leaves["ht"], leaves["wt"], y[sel],
                                        student_bias=leaves["bs"], kind="reverse_kl", reduction="sum",
                                        hard_weight=0.3, store_budget=budget)
        loss.backward()
        return loss.detach(), {k: v.grad for k, v in leaves.items()}

    everything = torch.ones_like(keep)
    (loss, grads), (loss_v, grads_v) = run(everything), run(keep)
    assert torch.allclose(loss, loss_v, rtol=1e-6, atol=0)
    for k in ("ws", "bs", "wt"):
        assert torch.equal(grads[k], grads_v[k]), k
    for k in ("hs", "ht"):
        assert torch.equal(grads[k][keep], grads_v[k]), k
        assert torch.equal(grads[k][~keep], torch.zeros_like(grads[k][~keep])), k
    monkeypatch.setenv("INDUCTOR_XENT_SKIP_IGNORED", "0")
    assert run(everything)[1]["ws"].isnan().any()
