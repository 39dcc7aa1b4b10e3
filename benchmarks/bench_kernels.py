"""Kernel benchmark: fused linear + cross-entropy against cuBLAS, eager, torch.compile and peers.

    python -m inductor_xent bench kernels [--shapes llama3-8b,gpt2] [--data gauss,zipf]
        [--methods ours,compile,...] [--out DIR] [--quick] [--sweep]

Accounting (printed with the table):
- time: ``triton.testing.do_bench(..., return_mode="median")`` after warm-up (L2 flushed before
  each run by do_bench; the inputs are GBs, larger than the 60 MB L2, so no rotation is needed).
  "fwd" is the loss with inputs that require grad (training mode: whatever the method saves for
  backward is paid here); "inf fwd" is under ``torch.no_grad()``; "fwd+bwd" computes the loss and
  ``torch.autograd.grad`` w.r.t. hidden and weight.
- TFLOP/s: 2·N·D·V / fwd time and 8·N·D·V / fwd+bwd time for every method (the recompute
  accounting: methods that store the logits do 6·N·D·V, so their true rate is 3/4 of the figure).
- extra MiB: peak allocation during fwd+bwd minus the allocation before it and minus the two
  gradient buffers (N·D + V·D elements in the input dtype).
- errors: ‖x − ref‖/‖ref‖ against an fp32 reference (fp32 matmul, TF32 off) on the same inputs:
  the mean loss, grad_hidden, grad_weight.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import DATA, IGNORE_INDEX, IGNORED_LAYOUTS, SHAPES, ignore_rows, make_data, shape_of  # noqa: E402

# ours: the functional API with strategy auto; ours_recompute / ours_store: each strategy forced;
# ours_compiled: the product path, torch.compile(..., backend="inductor_xent") of the eager spelling
METHODS = ("cublas", "eager", "compile", "compile_chunker", "liger", "liger_cute", "liger_cute_scaled", "quack", "cce",
           "ours", "ours_recompute", "ours_store", "ours_compiled", "ours_dense")
# peers that need the CuTe DSL (nvidia-cutlass-dsl 4.8.1, Hopper only; benchmarks/gpu_run.sh says how its wheels
# reach the GPU box): Liger-Kernel's SM90 kernels (liger_cute: the gradients in the forward, 6·N·D·V, keeps a
# chunk of logits; liger_cute_scaled: no logits, the backward recomputes them, 8·N·D·V) and QuACK's chunked
# linear cross-entropy (its scaled-exp pipeline where eligible: SM90, bf16, V % 128 == 0)
CUTE_PEERS = ("liger_cute", "liger_cute_scaled", "quack")
# ours_dense: ours with INDUCTOR_XENT_SKIP_IGNORED=0 (every row computed: the A/B of --ignored)
OURS = ("ours", "ours_recompute", "ours_store", "ours_compiled", "ours_dense")
MiB = 2**20
# --scan: time and memory against V (N, D fixed at llama3-8b's) and against N (D, V fixed); gauss data
SCAN_V = (32000, 50257, 128256, 256000)
SCAN_N = (2048, 4096, 8192, 16384)
SCAN_METHODS = "cublas,eager,ours"  # compiled methods would recompile at every point


# ---------------------------------------------------------------------------------------------
# the methods: each returns fn(hidden, weight, target) -> mean loss
# ---------------------------------------------------------------------------------------------
def _eager(h, w, t):
    return F.cross_entropy(F.linear(h, w).float(), t, ignore_index=IGNORE_INDEX)


def _eager_chunker(h, w, t):  # its own code object: its compiled graphs don't mix with "compile"'s
    return _eager(h, w, t)


def _eager_ours(h, w, t):  # likewise, for backend="inductor_xent"
    return _eager(h, w, t)


def strategy_of(name, h, w):
    """The strategy ``auto`` takes for these inputs (what "ours" and "ours_compiled" run)."""
    from inductor_xent import strategy

    if name in ("ours_recompute", "ours_store"):
        return name[5:]
    p = strategy.choose(h.shape[0], h.shape[1], w.shape[0], h.dtype, w.dtype, reduction="mean",
                        needs=(True, True, False))
    return p.describe()


_BUILT = {}


def build(name):
    """The method's callable; compiled ones are built once (dynamic=False: one graph per shape,
    reused across data sets, as a training run would)."""
    if name not in _BUILT:
        _BUILT[name] = _build(name)
    return _BUILT[name]


def _build(name):
    if name == "eager":
        return _eager
    if name == "compile":
        return torch.compile(_eager, dynamic=False)
    if name == "compile_chunker":
        import torch._inductor.config as inductor_config

        compiled = torch.compile(_eager_chunker, dynamic=False)

        def fn(h, w, t):
            with inductor_config.patch({"auto_chunker.enable": True}):
                return compiled(h, w, t)

        return fn
    if name == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        return lambda h, w, t: liger_fused_linear_cross_entropy(h, w, t, ignore_index=IGNORE_INDEX)
    if name == "liger_cute":
        from liger_kernel.ops.cutedsl.ops.fused_linear_cross_entropy_sm90 import liger_fused_linear_cross_entropy_sm90

        return lambda h, w, t: liger_fused_linear_cross_entropy_sm90(h, w, t, IGNORE_INDEX, "mean")
    if name == "liger_cute_scaled":
        from liger_kernel.ops.cutedsl.ops.fused_scaled_cross_entropy_sm90 import (
            LigerFusedScaledCrossEntropySM90Function as scaled_ce,
        )

        def fn(h, w, t):  # per-token NLL (0 on ignored rows): the mean over the counted rows
            return scaled_ce.apply(h, w, t, 1.0, IGNORE_INDEX).sum() / (t != IGNORE_INDEX).sum()

        return fn
    if name == "quack":
        from quack.linear_cross_entropy import chunked_linear_cross_entropy

        def fn(h, w, t):  # its default chunk; QuACK 0.6.5 rejects chunk == D (m == n in its dx GEMM's epilogue)
            chunk = 4096 if h.shape[1] != 4096 else 2048
            return chunked_linear_cross_entropy(h, w, t, chunk_size=chunk, ignore_index=IGNORE_INDEX)

        return fn
    if name == "cce":
        from cut_cross_entropy import linear_cross_entropy

        return lambda h, w, t: linear_cross_entropy(h, w, t, ignore_index=IGNORE_INDEX)
    if name in OURS:
        os.environ.setdefault("INDUCTOR_XENT_IMPL", "auto")
        from inductor_xent import linear_cross_entropy

        if name == "ours_compiled":
            return torch.compile(_eager_ours, backend="inductor_xent", dynamic=False)
        if name == "ours_dense":
            def dense(h, w, t):
                os.environ["INDUCTOR_XENT_SKIP_IGNORED"] = "0"  # read at call time (config.skip_ignored_rows)
                try:
                    return linear_cross_entropy(h, w, t, ignore_index=IGNORE_INDEX)
                finally:
                    del os.environ["INDUCTOR_XENT_SKIP_IGNORED"]

            return dense
        which = {"ours": None, "ours_recompute": "recompute", "ours_store": "store"}[name]
        return lambda h, w, t: linear_cross_entropy(h, w, t, ignore_index=IGNORE_INDEX, strategy=which)
    raise ValueError(f"unknown method {name!r}; choose from {METHODS}")


def reference(h, w, t):
    """fp32 loss and grads (fp32 matmul, TF32 off) of the same bf16 inputs."""
    from inductor_xent import compat

    with compat.ieee_fp32_matmuls():  # TF32 off, by the API that reads back
        h32 = h.float().requires_grad_()
        w32 = w.float().requires_grad_()
        loss = _eager(h32, w32, t)
        gh, gw = torch.autograd.grad(loss, (h32, w32))
        return loss.detach(), gh, gw


def rel_err(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


# ---------------------------------------------------------------------------------------------
# measuring
# ---------------------------------------------------------------------------------------------
def head_args(ap: argparse.ArgumentParser, shape: str = "8192x4096x128256") -> None:
    """The options every single-head benchmark script takes (bench_topk.py, bench_mtp.py)."""
    ap.add_argument("--shape", default=shape)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--methods", default=None)
    ap.add_argument("--out", default=None)


def head_shape(args) -> tuple[int, int, int]:
    """(N, D, V) of ``--shape``; tiny on ``--device cpu`` (a dry run)."""
    n, d, v = (int(x) for x in args.shape.split("x"))
    return (min(n, 64), min(d, 32), min(v, 500)) if args.device == "cpu" else (n, d, v)


def bench_ms(fn, quick, long):
    from triton.testing import do_bench

    rep = (150 if quick else 500) * (2 if long else 1)
    return do_bench(fn, warmup=50 if quick else 100, rep=rep, return_mode="median")


def extra_peak_mib(fn):
    """Run ``fn()`` once: (its result, the peak allocation during it minus the allocation before
    it, in MiB). What the result holds is counted; callers subtract what they don't want counted."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, (torch.cuda.max_memory_allocated() - base) / MiB


def gemms_fwd_bwd(h, w):
    """The three GEMMs of a forward+backward that keeps the logits: logits, dH, dW."""
    z = h @ w.t()
    return z @ w, z.t() @ h


def measure_cublas(h, w, t, quick):
    """The GEMMs alone: one for the forward, three (logits, dH, dW) for forward+backward."""
    fwd = bench_ms(lambda: h @ w.t(), quick, False)
    return {"fwd_ms": fwd, "inf_fwd_ms": fwd, "fwdbwd_ms": bench_ms(lambda: gemms_fwd_bwd(h, w), quick, True)}


def measure(name, fn, h, w, t, ref, quick):
    hr, wr = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    # correctness (and compilation) first
    loss = fn(hr, wr, t)
    gh, gw = torch.autograd.grad(loss, (hr, wr))
    row = {
        "err_loss": abs(loss.item() - ref[0].item()) / abs(ref[0].item()),
        "err_grad_hidden": rel_err(gh, ref[1]),
        "err_grad_weight": rel_err(gw, ref[2]),
    }
    del loss, gh, gw
    # memory: peak during one fwd+bwd, minus what existed before and the two gradients
    (gh, gw), peak = extra_peak_mib(lambda: torch.autograd.grad(fn(hr, wr, t), (hr, wr)))
    row["extra_mib"] = peak - (gh.nbytes + gw.nbytes) / MiB
    del gh, gw
    # time
    row["fwd_ms"] = bench_ms(lambda: fn(hr, wr, t), quick, False)
    row["fwdbwd_ms"] = bench_ms(lambda: torch.autograd.grad(fn(hr, wr, t), (hr, wr)), quick, True)
    if name in OURS:
        row["strategy"] = strategy_of(name, h, w)
        with torch.no_grad():
            row["inf_fwd_ms"] = bench_ms(lambda: fn(h, w, t), quick, False)
    return row


def _ignored_cases(spec: str):
    """--ignored "0,0.5" and --ignored-layout "prompt,padding" as [(fraction, layout)], or [None]
    (the data set's own every-17th row)."""
    if not spec:
        return [None]
    fractions = [float(x) for x in spec.split(",")]
    return [(f, lay) for lay in _LAYOUTS for f in fractions if f > 0 or lay == _LAYOUTS[0]]


_LAYOUTS = list(IGNORED_LAYOUTS)


def interleaved(shapes, methods, rounds, quick, ignored=(None,)):
    """fwd+bwd of each method in ``rounds`` rounds, the order rotated every round, so that drift of
    the GPU's clocks over a run falls on every method alike. Per method: the median over rounds,
    and per round the ratio to the first method (its reference, normally ``compile``), whose median
    is the comparison this mode is for: two single runs of one method differ by up to ~5% here."""
    import statistics

    for shape_name, case in ((s, c) for s in shapes for c in ignored):
        times = _interleave_shape(shape_name, methods, rounds, quick, case)
        ref = methods[0]
        if case is not None:
            print(f"ignored rows: {case[0]:.0%}, layout {case[1]}")
        print(f"| {shape_name} | method | median fwd+bwd ms ({rounds} rounds) | min | max | "
              f"median of per-round ratio to {ref} |")
        print("|---|---|---|---|---|---|")
        for name in methods:
            ratios = [a / b for a, b in zip(times[name], times[ref])]
            print(f"| {shape_name} | {name} | {statistics.median(times[name]):.2f} | {min(times[name]):.2f} | "
                  f"{max(times[name]):.2f} | {statistics.median(ratios):.3f}x |", flush=True)
        torch.cuda.empty_cache()


def _interleave_shape(shape_name, methods, rounds, quick, case=None):
    h, w, t = make_data(SHAPES[shape_name], "gauss")
    if case is not None:
        t = ignore_rows(t, *case)
    hr, wr = h.requires_grad_(), w.requires_grad_()
    fns = {}
    for name in methods:
        if name == "cublas":
            fns[name] = lambda: gemms_fwd_bwd(h, w)
        else:
            fn = build(name)
            fns[name] = lambda fn=fn: torch.autograd.grad(fn(hr, wr, t), (hr, wr))
        fns[name]()  # compile / autotune outside the timing
    times = {name: [] for name in methods}
    for r in range(rounds):
        order = methods[r % len(methods):] + methods[:r % len(methods)]
        for name in order:
            times[name].append(bench_ms(fns[name], quick, True))
        print(json.dumps({"interleaved": shape_name, "ignored": case, "round": r, "order": order,
                          "ms": {k: round(v[-1], 3) for k, v in times.items()}}), flush=True)
    return times


def _adhoc(name):
    """Whether ``name`` spells a shape ``NxDxV`` (shapes.shape_of); the main run takes those too."""
    try:
        shape_of(name)
    except ValueError:
        return False
    return name not in SHAPES


def kernel_stats():
    """Registers, spills, shared memory and HGMMA count of every compiled kernel of ours."""
    from inductor_xent.templates import backward, forward

    stats = {}
    from inductor_xent.templates import store

    for kern in (forward.lce_fwd_kernel, backward.lce_dlogits_kernel, backward.lce_acc_mm_kernel,
                 store.lce_store_dz_kernel):
        for cache in getattr(kern, "device_caches", {}).values():
            for i, compiled in enumerate(cache[0].values()):
                entry = {"n_regs": compiled.n_regs, "n_spills": compiled.n_spills,
                         "shared": compiled.metadata.shared}
                try:
                    sass = compiled.asm["sass"]
                    entry["hgmma"] = sass.count("HGMMA")
                    entry["hmma"] = sass.count("HMMA")
                except Exception as exc:  # cuobjdump missing
                    entry["sass"] = repr(exc)[:80]
                stats[f"{kern.fn.__name__}#{i}"] = entry
    return stats


def time_config(cfg, h, w, t, quick):
    """Forward and backward (dH and dW) through the launchers with one kernel config."""
    from inductor_xent.options import LossOptions
    from inductor_xent.templates import launch

    o, n = LossOptions(), h.shape[0]
    gl, gs = torch.full((n,), 1.0 / n, device="cuda"), torch.zeros(n, device="cuda")
    _, lse, lo = launch.forward(h, w, None, t, o, cfg=cfg)
    # agreement with the default config (a config must compute the same function)
    _, lse0, lo0 = launch.forward(h, w, None, t, o)
    grads = launch.backward(gl, gs, h, w, None, t, lse, lo, o, (True, True, False), cfg=cfg)
    grads0 = launch.backward(gl, gs, h, w, None, t, lse0, lo0, o, (True, True, False))
    diff = {"diff_lse": rel_err(lse, lse0), "diff_dH": rel_err(grads[0], grads0[0]),
            "diff_dW": rel_err(grads[1], grads0[1])}
    del grads, grads0
    return diff | {
        "fwd_ms": bench_ms(lambda: launch.forward(h, w, None, t, o, cfg=cfg), quick, False),
        "bwd_ms": bench_ms(lambda: launch.backward(gl, gs, h, w, None, t, lse, lo, o, (True, True, False), cfg=cfg),
                           quick, True),
    }


def profile_kernels(h, w, t):
    """GPU time per kernel of one forward and one backward (default configs), from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    from inductor_xent import strategy
    from inductor_xent.options import LossOptions
    from inductor_xent.templates import launch

    o, n = LossOptions(), h.shape[0]
    gl, gs = torch.full((n,), 1.0 / n, device="cuda"), torch.zeros(n, device="cuda")
    _, lse, lo = launch.forward(h, w, None, t, o)
    launch.backward(gl, gs, h, w, None, t, lse, lo, o, (True, True, False))
    acc = strategy.fp32_accumulate(n, n // 2, w.element_size(), True)  # as the op decides
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        launch.forward(h, w, None, t, o)
        launch.backward(gl, gs, h, w, None, t, lse, lo, o, (True, True, False))
        launch.store(h, w, None, t, o, "mean", n // 2, (True, True, False), fp32_accumulate=acc)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))


def profile_op(shapes, methods=("ours",)):
    """Each method's fwd+bwd: event-timed wall per iteration against the sum of the kernels' GPU
    time (a gap means the GPU waited on the host), and the kernels that take it."""
    from torch.profiler import ProfilerActivity, profile

    for shape_name, name in ((s, m) for s in shapes for m in methods):
        fn = build(name)
        h, w, t = make_data(SHAPES[shape_name], "gauss")
        hr, wr = h.requires_grad_(), w.requires_grad_()
        for _ in range(3):
            torch.autograd.grad(fn(hr, wr, t), (hr, wr))
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            start.record()
            for _ in range(3):
                torch.autograd.grad(fn(hr, wr, t), (hr, wr))
            end.record()
            torch.cuda.synchronize()
        busy, gaps = device_timeline(prof)
        print(json.dumps({"profile": shape_name, "method": name, "wall_ms_per_iter": start.elapsed_time(end) / 3,
                          "kernel_ms_per_iter": busy / 3}), flush=True)
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=24, max_name_column_width=60))
        print("largest idle gaps on the GPU (ms, the kernels on either side):")
        for gap, before, after in gaps[:8]:
            print(f"  {gap:7.3f}  {before[:50]} -> {after[:50]}")


def device_timeline(prof):
    """(ms the GPU was busy, idle gaps between its activities sorted longest first) from a profile:
    kernels, copies and fills only (the CPU ops' device totals would count each kernel twice)."""
    from torch.autograd import DeviceType

    acts = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    busy, gaps, end, last = 0.0, [], None, ""
    for e in acts:
        s, f = e.time_range.start, e.time_range.end  # microseconds
        if end is not None and s > end:
            gaps.append(((s - end) / 1e3, last, e.name))
        if end is None or f > end:
            busy += (f - max(s, end if end is not None else s)) / 1e3
            end, last = f, e.name
    return busy, sorted(gaps, reverse=True)


def store_kernels(shapes):
    """The store strategy's two memory-bound kernels on one chunk of 4096 rows, alone: the dz pass
    (E in fp16 read, dz in bf16 written over it) per (BLOCK_M, num_warps), and the split combine
    (one split per 256-column tile) per rows per program. ms and the bytes they move per second."""
    for shape_name in shapes:
        _store_kernels_at(SHAPES[shape_name].v, shape_name)


def _store_kernels_at(v, shape_name, m=4096):
    import triton
    from triton.testing import do_bench

    from inductor_xent.options import LossOptions
    from inductor_xent.templates import configs, launch
    from inductor_xent.templates.forward import lce_combine_kernel
    from inductor_xent.templates.store import lce_store_dz_kernel

    bn = configs.store_config(torch.bfloat16).block_n
    tiles = -(-v // bn)
    gen = torch.Generator(device="cuda").manual_seed(0)
    e = torch.rand((m, v), device="cuda", generator=gen).to(torch.float16)
    dz = e.view(torch.bfloat16)
    part = torch.rand((3, tiles, m), device="cuda", generator=gen) + 0.5
    t = torch.randint(0, v, (m,), device="cuda", generator=gen)
    lse, lo, loss = (torch.rand(m, device="cuda", generator=gen) + 3 for _ in range(3))
    g = torch.full((m,), 1.0 / m, device="cuda")
    no_arg = torch.empty(0, dtype=torch.int32, device="cuda")
    hit, rest = launch._smoothing_coefs(LossOptions(), v)

    def dz_pass(bm, warps):
        lce_store_dz_kernel[(triton.cdiv(m, bm) * tiles,)](
            e, dz, part, t, lse, lo, None, g, None, m, v, e.stride(0), dz.stride(0), 0,
            -100, hit, rest, 0.0, 1.0, 0.0, HAS_SOFTCAP=False, NEED_DBIAS=False,
            BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8, num_warps=warps)

    def combine(block, group):
        lce_combine_kernel[(triton.cdiv(m, block),)](
            part, no_arg, t, loss, lse, lo, None, None, None, m, v, tiles, -100, 0.0, 0.0,
            NEED_SUM_Z=False, NEED_ST=False, NEED_ENTROPY=False, NEED_ARGMAX=False, BLOCK=block, GROUP=group)

    for bm, warps in ((32, 8), (16, 4), (64, 8), (64, 16), (128, 16)):
        ms = do_bench(lambda bm=bm, warps=warps: dz_pass(bm, warps), warmup=20, rep=100, return_mode="median")
        print(json.dumps({"store_kernel": "dz", "shape": shape_name, "block_m": bm, "num_warps": warps,
                          "ms": ms, "TB/s": 4 * m * v / ms / 1e9}), flush=True)
    for block, group in ((128, 1), (32, 32), (64, 16), (16, 64), (32, 16)):
        ms = do_bench(lambda block=block, group=group: combine(block, group), warmup=20, rep=100,
                      return_mode="median")
        print(json.dumps({"store_kernel": "combine", "shape": shape_name, "block": block, "group": group,
                          "splits": tiles, "ms": ms}), flush=True)


def store_sweep(shapes, quick, names):
    """The store strategy's forward tile (one vocabulary tile per program; the dz pass follows its
    width): each config's whole store op (2 chunks, loss and both gradients) against the default's
    results and time. A smaller tile can fit two programs per SM, so that one's epilogue (exp, the
    E store) overlaps the other's matmul."""
    from inductor_xent import strategy
    from inductor_xent.options import LossOptions
    from inductor_xent.templates import configs, launch

    o = LossOptions()
    for shape_name in shapes:
        shape = SHAPES[shape_name]
        h, w, t = make_data(shape, "gauss")
        rows = shape.n // 2
        acc = strategy.fp32_accumulate(shape.n, rows, w.element_size(), True)  # as the op decides

        def run(cfg=None, h=h, w=w, t=t, rows=rows, acc=acc):
            return launch.store(h, w, None, t, o, "mean", rows, (True, True, False), fp32_accumulate=acc, cfg=cfg)

        base = run()
        for name in names:
            cfg = configs.CONFIGS[name]._replace(split_tiles=1)
            row = {"store_sweep": shape_name, "config": name}
            try:
                got = run(cfg)
                row |= {"diff_loss": rel_err(got[0], base[0]), "diff_dH": rel_err(got[1], base[1]),
                        "diff_dW": rel_err(got[2], base[2])}
                del got
                row["ms"] = bench_ms(lambda cfg=cfg: run(cfg), quick, True)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            print(json.dumps(row), flush=True)
        del base, h, w, t
        torch.cuda.empty_cache()


def forward_rounds(shapes, names, rounds, store):
    """A forward alone per config (--configs), the configs interleaved over ``rounds`` rounds in
    rotated order, with cuBLAS's logits GEMM of the same rows as the first entry: the median ms of
    each and its ratio to cuBLAS. ``store``: the store strategy's forward (the logits kernel with
    the E store, and the split combine) on one chunk of half the shape's rows; else the recompute
    forward (launch.forward) on all rows."""
    import statistics

    from triton.testing import do_bench

    from inductor_xent.options import LossOptions
    from inductor_xent.templates import configs, launch

    o = LossOptions()
    for shape_name in shapes:
        shape = SHAPES[shape_name]
        h, w, t = make_data(shape, "gauss")
        m = shape.n // 2 if store else shape.n
        h_c, t_c = h[:m], t[:m]
        outs = tuple(torch.empty(m, device="cuda") for _ in range(3))
        e = torch.empty((m, shape.v), dtype=torch.float16, device="cuda") if store else None

        def run(name, h_c=h_c, w=w, t_c=t_c, outs=outs, e=e):
            if name == "cublas":
                return h_c @ w.t()
            cfg = configs.CONFIGS[name]
            if e is None:
                return launch.forward(h_c, w, None, t_c, o, cfg=cfg)
            cfg = cfg._replace(split_tiles=1)
            return launch._forward_pass(h_c, w, None, t_c, o, cfg, -(-w.shape[0] // cfg.block_n), 1, outs, e=e)

        entries = ["cublas", *names]
        times = {name: [] for name in entries}
        for r in range(rounds):
            for name in entries[r % len(entries):] + entries[: r % len(entries)]:
                times[name].append(do_bench(lambda name=name, run=run: run(name), warmup=10, rep=60,
                                            return_mode="median"))
        first = statistics.median(times["cublas"])
        for name in entries:
            med = statistics.median(times[name])
            print(json.dumps({"forward": "store" if store else "recompute", "shape": shape_name, "rows": m,
                              "config": name, "ms": med, "ratio_to_cublas": med / first,
                              "tflops": 2 * m * shape.d * shape.v / med / 1e9, "rounds": times[name]}), flush=True)
        del h, w, t, e, h_c, t_c
        torch.cuda.empty_cache()


def backward_rounds(shapes, rounds):
    """The recompute backward (launch.backward: dlogits kernel and cuBLAS GEMMs per vocabulary
    chunk) with the dlogits kernel persistent (one program per SM) and with one program per tile,
    interleaved over ``rounds`` rounds: the median ms of each."""
    import statistics

    from triton.testing import do_bench

    from inductor_xent.options import LossOptions
    from inductor_xent.templates import launch

    o = LossOptions()
    for shape_name in shapes:
        shape = SHAPES[shape_name]
        h, w, t = make_data(shape, "gauss")
        n = shape.n
        gl, gs = torch.full((n,), 1.0 / n, device="cuda"), torch.zeros(n, device="cuda")
        _, lse, lo = launch.forward(h, w, None, t, o)

        def run(persistent, h=h, w=w, t=t, gl=gl, gs=gs, lse=lse, lo=lo):
            launch.DLOGITS_PERSISTENT = persistent
            try:
                return launch.backward(gl, gs, h, w, None, t, lse, lo, o, (True, True, False))
            finally:
                launch.DLOGITS_PERSISTENT = True

        same = all(torch.equal(a, b) for a, b in zip(run(True), run(False)))
        times = {True: [], False: []}
        for r in range(rounds):
            for persistent in ((True, False) if r % 2 == 0 else (False, True)):
                times[persistent].append(do_bench(lambda p=persistent, run=run: run(p), warmup=3, rep=30,
                                                  return_mode="median"))
        for persistent in (False, True):
            print(json.dumps({"backward": shape_name, "persistent": persistent, "bitwise_same": same,
                              "ms": statistics.median(times[persistent]), "rounds": times[persistent]}), flush=True)
        del h, w, t, lse, lo, run
        torch.cuda.empty_cache()


def sweep(shapes, quick, out, names=None):
    """Time each candidate config of the forward and of the backward (launch.* with cfg=)."""
    from inductor_xent.templates import configs

    names = names or ["m128n256k64w8s3", "m128n256k64w8s3t1", "m128n256k64w8s3t4", "m256n128k64w8s3",
                      "m256n128k64w8s3t1", "m128n128k64w8s3"]
    rows = []
    for shape_name in shapes:
        shape = SHAPES[shape_name]
        h, w, t = make_data(shape, "gauss")
        flops = 2 * shape.n * shape.d * shape.v
        for name in names:
            row = {"shape": shape_name, "config": name}
            try:
                row.update(time_config(configs.CONFIGS[name], h, w, t, quick))
                row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            print(json.dumps(row), flush=True)
            rows.append(row)
        profile_kernels(h, w, t)
    stats = kernel_stats()
    for k, v in stats.items():
        print(k, v)
    (out / "sweep.json").write_text(json.dumps({"rows": rows, "kernels": stats}, indent=1))
    return rows


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def env_info(device="cuda"):
    """GPU, versions, date and command line (``device="cpu"``: the CPU, for dry runs)."""
    import platform

    import triton

    info = {
        "gpu": torch.cuda.get_device_name() if device == "cuda" else f"CPU {platform.machine()} (dry run)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    if device == "cuda":
        from inductor_xent.templates.backward import _cublas_fp32_out

        info["cublas_addmm_fp32_out_bf16"] = _cublas_fp32_out(torch.device("cuda", torch.cuda.current_device()),
                                                              torch.bfloat16)
    return info | {"command": " ".join(sys.argv)}


def fmt(x, spec):
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown(rows, info):
    lines = [
        f"GPU {info['gpu']}, torch {info['torch']}, triton {info['triton']}, {info['date']}; bf16; "
        "median ms (do_bench); TFLOP/s = 2NDV/fwd and 8NDV/fwd+bwd for every method; errors vs fp32 "
        "reference (TF32 off).",
        "",
        "| shape | data | method | fwd ms | inf fwd ms | fwd+bwd ms | extra MiB | err loss | err dH | err dW "
        "| fwd TFLOP/s | fwd+bwd TFLOP/s | strategy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['data']} | {r['method']} | failed: {r['error'][:80]} "
                         "| | | | | | | | | |")
            continue
        lines.append(
            f"| {r['shape']} | {r['data']} | {r['method']} | {fmt(r.get('fwd_ms'), '.2f')} "
            f"| {fmt(r.get('inf_fwd_ms'), '.2f')} | {fmt(r.get('fwdbwd_ms'), '.2f')} "
            f"| {fmt(r.get('extra_mib'), '.0f')} | {fmt(r.get('err_loss'), '.1e')} "
            f"| {fmt(r.get('err_grad_hidden'), '.1e')} | {fmt(r.get('err_grad_weight'), '.1e')} "
            f"| {fmt(r.get('fwd_tflops'), '.0f')} | {fmt(r.get('fwdbwd_tflops'), '.0f')} | {r.get('strategy', '')} |"
        )
    return "\n".join(lines)


def plot(rows, info, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    groups = sorted({(r["shape"], r["data"]) for r in rows})
    methods = [m for m in METHODS if any(r["method"] == m and "fwdbwd_ms" in r for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    width = 0.8 / max(1, len(methods))
    for ax, key, label in ((axes[0], "fwd_ms", "forward ms"), (axes[1], "fwdbwd_ms", "forward+backward ms")):
        for i, m in enumerate(methods):
            vals = [next((r.get(key, 0) for r in rows if (r["shape"], r["data"]) == g and r["method"] == m), 0)
                    for g in groups]
            ax.bar([j + i * width for j in range(len(groups))], vals, width, label=m)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))])
        ax.set_xticklabels([f"{s}\n{d}" for s, d in groups])
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{info['gpu']} · torch {info['torch']} · triton {info['triton']} · {info['date']} · bf16")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_pareto(rows, info, path):
    """Time against extra memory, one point per method (strategies included), one panel per shape
    and data set; the Pareto front (no other point both faster and leaner) joined by a line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    groups = sorted({(r["shape"], r["data"]) for r in rows if r.get("extra_mib") is not None})
    if not groups:
        return
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.8), squeeze=False)
    for ax, g in zip(axes[0], groups):
        pts = [(max(r["extra_mib"], 1.0), r["fwdbwd_ms"], r["method"]) for r in rows
               if (r["shape"], r["data"]) == g and r.get("extra_mib") is not None and r.get("fwdbwd_ms")]
        for x, y, m in pts:
            ax.scatter([x], [y], color=plt.cm.tab20(METHODS.index(m) % 20), label=m, zorder=3)
            ax.annotate(m, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        front, best = [], float("inf")
        for x, y, _ in sorted(pts):
            if y < best:
                front.append((x, y))
                best = y
        ax.plot([x for x, _ in front], [y for _, y in front], color="gray", ls="--", lw=1, zorder=2)
        ax.set_xscale("log")
        ax.set_xlabel("extra peak MiB (log)")
        ax.set_ylabel("forward+backward ms")
        ax.set_title(f"{g[0]} · {g[1]}")
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"time vs memory · {info['gpu']} · torch {info['torch']} · triton {info['triton']} · "
                 f"{info['date']} · bf16 (dashed: Pareto front)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def store_options(shapes, quick, out):
    """The store strategy's weight-gradient accumulation for a bf16 weight, measured: chunks of N,
    N/2, N/4, N/8 rows, each with the accumulation in bf16 (one rounding per chunk) and in an fp32
    accumulator; time, extra memory and gradient errors on gauss and zipf."""
    from inductor_xent.options import LossOptions
    from inductor_xent.templates import launch

    rows = []
    for shape_name in shapes:
        shape = SHAPES[shape_name]
        for data in DATA:
            h, w, t = make_data(shape, data)
            ref = reference(h, w, t)
            for div in (1, 2, 4, 8):
                for acc in (False, True):
                    row = {"shape": shape_name, "data": data, "chunk_rows": shape.n // div, "fp32_acc": acc}

                    def run(h=h, w=w, t=t, rows=shape.n // div, acc=acc):
                        return launch.store(h, w, None, t, LossOptions(), "mean", rows, (True, True, False),
                                            fp32_accumulate=acc)

                    try:
                        loss, gh, gw, _ = run()
                        row["err_grad_hidden"], row["err_grad_weight"] = rel_err(gh, ref[1]), rel_err(gw, ref[2])
                        del loss, gh, gw
                        res, peak = extra_peak_mib(run)
                        row["extra_mib"] = peak - (res[1].nbytes + res[2].nbytes) / MiB
                        del res
                        row["ms"] = bench_ms(run, quick, False)
                    except Exception as exc:
                        row["error"] = f"{type(exc).__name__}: {exc}"[:200]
                    print(json.dumps(row), flush=True)
                    rows.append(row)
            del h, w, t, ref, run
            torch.cuda.empty_cache()
    (out / "store_options.json").write_text(json.dumps(rows, indent=1))
    return rows


def scan_shapes() -> dict:
    """{name: Shape} of the --scan points: V varies at N=8192, D=4096; N varies at D=4096, V=128256."""
    from shapes import Shape

    base = SHAPES["llama3-8b"]
    points = {f"V={v}": Shape(base.n, base.d, v) for v in SCAN_V}
    points.update({f"N={n}": Shape(n, base.d, base.v) for n in SCAN_N if n != base.n})
    return points


def plot_scan(rows, info, path):
    """Lines of fwd+bwd ms and extra MiB against V and against N, one line per method."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    base = SHAPES["llama3-8b"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for col, (axis, fixed) in enumerate((("v", ("n", base.n)), ("n", ("v", base.v)))):
        for row_i, (key, label) in enumerate((("fwdbwd_ms", "forward+backward ms"), ("extra_mib", "extra peak MiB"))):
            ax = axes[row_i][col]
            for m in METHODS:
                pts = sorted((r[axis], r[key]) for r in rows
                             if r["method"] == m and r.get(key) is not None and r[fixed[0]] == fixed[1])
                if pts:  # one color per method in every panel
                    ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=m,
                            color=plt.cm.tab20(METHODS.index(m) % 20))
            ax.set_xscale("log", base=2)
            ax.set_xlabel(f"{axis.upper()} ({fixed[0].upper()}={fixed[1]}, D={base.d})")
            ax.set_ylabel(label)
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{info['gpu']} · torch {info['torch']} · triton {info['triton']} · {info['date']} · bf16, gauss")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def progress(items, desc):
    try:
        from tqdm import tqdm

        return tqdm(items, desc=desc, file=sys.stderr)
    except ImportError:
        return items


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="llama3-8b,gemma2-2b,gpt2",
                   help=f"from {', '.join(SHAPES)}, or NxDxV (the main run)")
    p.add_argument("--data", default=",".join(DATA))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--out", default="out")
    p.add_argument("--quick", action="store_true", help="fewer timed runs")
    p.add_argument("--sweep", action="store_true", help="time the kernel configs instead")
    p.add_argument("--configs", default="", help="--sweep, --store-sweep: config names from templates/configs.py")
    p.add_argument("--profile", action="store_true", help="profile our fwd+bwd through the op instead")
    p.add_argument("--store-kernels", action="store_true",
                   help="time the store strategy's dz pass and split combine alone, per launch parameters")
    p.add_argument("--store-sweep", action="store_true",
                   help="time the store op per forward tile config (--configs) instead")
    p.add_argument("--store-forward", action="store_true",
                   help="time the store forward alone per config (--configs), interleaved over --rounds (default 5)")
    p.add_argument("--forward", action="store_true",
                   help="time the recompute forward alone per config (--configs) and cuBLAS's GEMM, interleaved "
                        "over --rounds (default 5)")
    p.add_argument("--backward", action="store_true",
                   help="time the recompute backward with the persistent and the one-program-per-tile dlogits "
                        "kernel, interleaved over --rounds (default 5)")
    p.add_argument("--store-options", action="store_true",
                   help="measure the store strategy's weight-gradient accumulation options instead")
    p.add_argument("--rounds", type=int, default=0,
                   help="time fwd+bwd only, the methods interleaved over this many rounds (the first method "
                        "is the reference of the ratios)")
    p.add_argument("--scan", action="store_true",
                   help=f"time and memory against V and N (methods default {SCAN_METHODS}); plots bench_scan.png")
    p.add_argument("--ignored", default="",
                   help="ignored-row fractions, e.g. 0,0.3,0.5,0.7 (replacing the data's every 17th row)")
    p.add_argument("--ignored-layout", default=",".join(IGNORED_LAYOUTS),
                   help=f"with --ignored: {' and/or '.join(IGNORED_LAYOUTS)} (SFT prompt spans per sequence, "
                        "scattered padding)")
    args = p.parse_args(argv)
    _LAYOUTS[:] = args.ignored_layout.split(",")
    if args.scan and args.methods == p.get_default("methods"):
        args.methods = SCAN_METHODS
    unknown = [m for m in args.methods.split(",") if m not in METHODS]
    if unknown:
        p.error(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    if not torch.cuda.is_available():
        print("bench kernels times GPU kernels (cuBLAS, Triton, the peers) and torch sees no CUDA device. "
              "On a CPU, `python3 benchmarks/cpu_fallback.py` measures the chunked PyTorch path against eager, "
              "and `python -m inductor_xent demo` trains a small model with both backends.", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = args.shapes.split(",")
    if args.sweep:
        sweep(shapes, args.quick, out, [c for c in args.configs.split(",") if c])
        return 0
    if args.profile:
        profile_op(shapes, args.methods.split(",") if args.methods != ",".join(METHODS) else ("ours",))
        return 0
    if args.store_options:
        store_options(shapes, args.quick, out)
        return 0
    if args.store_sweep:
        store_sweep(shapes, args.quick, [c for c in args.configs.split(",") if c])
        return 0
    if args.store_kernels:
        store_kernels(shapes)
        return 0
    if args.backward:
        backward_rounds(shapes, args.rounds or 5)
        return 0
    if args.store_forward or args.forward:
        from inductor_xent.templates import configs

        table = configs.STORE_TABLE if args.store_forward else configs.FORWARD_TABLE
        names = [c for c in args.configs.split(",") if c] or [table[2]]
        forward_rounds(shapes, names, args.rounds or 5, args.store_forward)
        return 0
    if args.rounds:
        interleaved(shapes, args.methods.split(","), args.rounds, args.quick, _ignored_cases(args.ignored))
        return 0
    info = env_info()
    print(json.dumps(info), flush=True)
    rows = []
    shape_table = scan_shapes() if args.scan else {**SHAPES, **{s: shape_of(s) for s in shapes if _adhoc(s)}}
    if args.scan:
        shapes, args.data = list(shape_table), "gauss"
    unknown = [s for s in shapes if s not in shape_table]
    if unknown:
        p.error(f"unknown shape(s) {', '.join(unknown)}; choose from {', '.join(shape_table)}")
    bar = progress([(s, d, c) for s in shapes for d in args.data.split(",") for c in _ignored_cases(args.ignored)],
                   "bench kernels")
    for shape_name, data, case in bar:
        shape = shape_table[shape_name]
        h, w, t = make_data(shape, data)
        if case is not None:
            t = ignore_rows(t, *case)
        ref = reference(h, w, t)
        for method in args.methods.split(","):
            row = {"shape": shape_name, "data": data, "method": method,
                   "n": shape.n, "d": shape.d, "v": shape.v}
            if case is not None:  # the data label carries the case, for the table and the plots
                row["ignored"], row["layout"] = case
                row["data"] = f"{data}-ign{round(100 * case[0])}-{case[1]}"
            try:
                if method == "cublas":
                    row.update(measure_cublas(h, w, t, args.quick))
                else:
                    row.update(measure(method, build(method), h, w, t, ref, args.quick))
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]
                traceback.print_exc(limit=2)
            flops = shape.n * shape.d * shape.v
            if "fwd_ms" in row:
                row["fwd_tflops"] = 2 * flops / row["fwd_ms"] / 1e9
            if "fwdbwd_ms" in row:
                row["fwdbwd_tflops"] = 8 * flops / row["fwdbwd_ms"] / 1e9
            print(json.dumps(row), flush=True)
            rows.append(row)
            torch.cuda.empty_cache()
        del h, w, t, ref
        torch.cuda.empty_cache()
    info["kernels"] = kernel_stats()
    stem = "bench_scan" if args.scan else "bench_kernels"
    (out / f"{stem}.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    (plot_scan if args.scan else plot)(rows, info, out / f"{stem}.png")
    if not args.scan:
        plot_pareto(rows, info, out / "bench_pareto.png")
    print(json.dumps(info["kernels"]))
    print(markdown(rows, info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
