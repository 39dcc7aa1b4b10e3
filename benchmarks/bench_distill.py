"""Distillation head benchmark: Hinton KD between a student and a teacher lm_head (issue 25).

    python benchmarks/bench_distill.py [--shape 8192x4096x8192x128256] [--methods ...] [--out DIR]
        [--quick] [--rounds N] [--device cuda|cpu] [--prompt FRACTION]

The spelling timed (the teacher under ``torch.no_grad()``, T = 2, forward + backward w.r.t. the
student's hidden states and weight)::

    s = F.linear(hs, ws)
    with torch.no_grad():
        t = F.linear(ht, wt)
    loss = F.kl_div(F.log_softmax(s / T, -1), F.softmax(t / T, -1), reduction="batchmean") * T**2

Methods: ``cublas`` the four GEMMs alone (student and teacher logits, dH, dW: the floor);
``compile`` the spelling under torch.compile (Inductor); ``ours`` ``inductor_xent.linear_distillation_loss``
(on CUDA it keeps the student's gradient logits, ``distill.keeps_dz``); ``ours_acc`` the same with a store
budget of 1 byte (row chunks adding into an fp32 weight-gradient accumulator); ``ours_recompute`` with a
store budget of 0 (per-row statistics kept, the backward recomputes both heads over vocabulary chunks);
``ours_compiled`` the spelling under ``torch.compile(backend="inductor_xent")`` (the pass fuses it);
``liger`` Liger-Kernel's ``LigerFusedLinearJSDLoss`` with ``jsd_beta=0`` (its forward-KL limit;
teacher logits computed by Liger in chunks too), when installed.

Accounting: median of ``triton.testing.do_bench`` (bench_kernels.bench_ms); extra MiB: the peak
allocation during one call minus the allocation before it, minus the two gradient buffers. Errors:
‖x − ref‖/‖ref‖ of the loss and gradients against the spelling in fp32 (TF32 off) on the same
bf16 inputs, at 1024 rows. Target (issue 25): fwd+bwd ≤ 1.00× torch.compile with ≤ 10 % of its
extra memory. ``--rounds N``: then the methods' fwd+bwd interleaved over N rounds (the order rotated
each round), the median of the per-round ratios to torch.compile.

``--prompt F`` (GKD-style on-policy distillation): each sequence of 1024 rows starts with a prompt of
F·1024 rows whose divergence does not count (target ``-100``, ``shapes.ignore_rows``), the loss the mean
over the other rows; ours gets the target (``reduction="mean"``) and computes the labelled rows only
(``distill.skips_rows``); ``ours_dense`` is ours with ``INDUCTOR_XENT_SKIP_IGNORED=0``. The spelling::

    rows = F.kl_div(F.log_softmax(s / T, -1), F.log_softmax(t / T, -1), log_target=True,
                    reduction="none").sum(-1)
    loss = (rows * mask).sum() / mask.sum() * T**2

``--softcap C`` (Gemma 2's students and teachers): both heads' logits capped, ``torch.tanh(z / C) * C``
as Gemma 2's model spells it, before the temperature; ours gets ``student_softcap=C, teacher_softcap=C``;
Liger's ops take no softcap (their rows are skipped).

``--device cpu`` is a dry run on tiny shapes (it checks the harness, not the speed).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk  # noqa: E402

import inductor_xent  # noqa: E402
from inductor_xent import compat  # noqa: E402

TEMP = 2.0
METHODS = ("cublas", "compile", "ours", "ours_acc", "ours_recompute", "ours_compiled", "liger", "liger_chunked",
           "ours_dense")
TARGET = []  # with --prompt: the [N] target whose -100 rows are the prompts' (a method on n rows reads [:n])
CAP = []  # with --softcap: both heads' softcap


def capped(z):
    return torch.tanh(z / CAP[0]) * CAP[0] if CAP else z


def spelling(hs, ws, ht, wt):
    s = capped(F.linear(hs, ws))
    with torch.no_grad():
        t = capped(F.linear(ht, wt))
    if TARGET:
        rows = F.kl_div(F.log_softmax(s.float() / TEMP, -1), F.log_softmax(t.float() / TEMP, -1), log_target=True,
                        reduction="none").sum(-1)
        mask = (TARGET[0][:hs.shape[0]] != -100).float()
        return (rows * mask).sum() / mask.sum() * TEMP**2
    return F.kl_div(F.log_softmax(s / TEMP, -1), F.softmax(t / TEMP, -1), reduction="batchmean") * TEMP**2


def ours(hs, ws, ht, wt):
    caps = dict(student_softcap=CAP[0], teacher_softcap=CAP[0]) if CAP else {}
    if TARGET:
        return inductor_xent.linear_distillation_loss(hs, ws, ht.detach(), wt.detach(), TARGET[0][:hs.shape[0]],
                                                      temperature=TEMP, reduction="mean", **caps) * TEMP**2
    return inductor_xent.linear_distillation_loss(hs, ws, ht.detach(), wt.detach(), temperature=TEMP,
                                                  reduction="batchmean", **caps) * TEMP**2


def ours_dense(hs, ws, ht, wt):
    """ours computing every row (INDUCTOR_XENT_SKIP_IGNORED=0 around the call; the kept path forms the
    gradients in the forward): the A/B of --prompt."""
    os.environ["INDUCTOR_XENT_SKIP_IGNORED"] = "0"
    try:
        return ours(hs, ws, ht, wt)
    finally:
        del os.environ["INDUCTOR_XENT_SKIP_IGNORED"]


@contextlib.contextmanager
def chunk_knob(knob, nbytes):
    """The sweep's methods: ``distill.<knob>`` at ``nbytes`` around one fwd+bwd (the recompute
    backward reads its chunk size in the backward)."""
    from inductor_xent import distill
    old = getattr(distill, knob)
    setattr(distill, knob, nbytes)
    try:
        yield
    finally:
        setattr(distill, knob, old)


def with_budget(budget, hs, ws, ht, wt):
    """``ours`` under ``INDUCTOR_XENT_STORE_BUDGET=budget`` for this call only."""
    old = os.environ.get("INDUCTOR_XENT_STORE_BUDGET")
    os.environ["INDUCTOR_XENT_STORE_BUDGET"] = budget
    try:
        return ours(hs, ws, ht, wt)
    finally:
        if old is None:
            del os.environ["INDUCTOR_XENT_STORE_BUDGET"]
        else:
            os.environ["INDUCTOR_XENT_STORE_BUDGET"] = old


# a store budget of 1 byte: no gradient logits kept, the chunks add into an fp32 weight-gradient accumulator
ours_acc = functools.partial(with_budget, "1")
# a store budget of 0: recompute (per-row statistics kept, the backward over vocabulary chunks)
ours_recompute = functools.partial(with_budget, "0")


def liger_fn(name):
    """Liger-Kernel's explicit distillation ops at their forward-KL limit (beta = 0): ``liger`` its Triton
    ``LigerFusedLinearJSD``, ``liger_chunked`` its torch.compile'd ``chunked_loss.LigerFusedLinearJSDLoss``
    (soft loss only). Their normalisation differs from the spelling's (no T**2): no error column."""
    try:
        if name == "liger":
            from liger_kernel.transformers.fused_linear_jsd import LigerFusedLinearJSD
            loss = LigerFusedLinearJSD(jsd_beta=0.0, temperature=TEMP)
            return (lambda hs, ws, ht, wt: loss(hs, ws, ht.detach(), wt.detach(), None)), None
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss
        loss = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=0.0, temperature=TEMP)
        labels = {}

        def run(hs, ws, ht, wt):
            y = labels.setdefault(hs.shape[0], torch.zeros(hs.shape[0], dtype=torch.long, device=hs.device))
            return loss(hs, ws, ht.detach(), wt.detach(), y)
        return run, None
    except Exception as e:  # noqa: BLE001
        return None, f"{name} not importable: {e!r}"


def cublas(hs, ws, ht, wt):
    s = hs @ ws.t()
    with torch.no_grad():
        t = ht @ wt.t()
    return s @ ws, s.t() @ hs, t


def measure(name, fn, hs, ws, ht, wt, device, quick, knobs=None):
    """(ms, extra MiB, outputs) of one method's fwd+bwd; ``knobs``: (name, bytes) for ``chunk_knob``."""
    if name == "cublas":
        def run():
            return cublas(hs, ws, ht, wt)
    else:
        hr, wr = hs.detach().requires_grad_(), ws.detach().requires_grad_()

        def run():
            with chunk_knob(*knobs) if knobs else contextlib.nullcontext():
                loss = fn(hr, wr, ht, wt)
                return loss, *torch.autograd.grad(loss, (hr, wr))
    run()  # warm-up (compiles)
    if device == "cuda":
        ms = bk.bench_ms(run, quick, True)
        out, peak = bk.extra_peak_mib(run)
        grads = (hs.numel() + ws.numel()) * hs.element_size() / 2**20
        RUNS[name] = run
        return ms, peak - grads, out
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, None, out


RUNS = {}  # method -> its fwd+bwd closure (for --rounds)


def interleaved(names, rounds, quick):
    """Each method's fwd+bwd ms over ``rounds`` rounds, the order rotated each round, and the
    per-round ratios of each to torch.compile."""
    ms = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            ms[name].append(bk.bench_ms(RUNS[name], quick, True))
    ratios = {name: [a / b for a, b in zip(ms[name], ms["compile"])] for name in names} if "compile" in ms else {}
    return dict(ms=ms, ratios=ratios)


def reference(hs, ws, ht, wt, rows):
    """The spelling in fp32 (TF32 off) on the first ``rows`` rows, as bf16 inputs are."""
    with compat.ieee_fp32_matmuls():  # TF32 off, by the API that reads back
        h, w = hs[:rows].float().requires_grad_(), ws.float().requires_grad_()
        loss = spelling(h, w, ht[:rows].float(), wt.float())
        return loss.detach(), *torch.autograd.grad(loss, (h, w))


def rel(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8192x4096x8192x128256", help="N x D_student x D_teacher x V")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help="also ours@<MiB>: ours_acc with that chunk working set; ours_kept@<MiB>: ours with its "
                         "teacher chunk at that size; ours_recompute@<MiB>: ours_recompute with that working set")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=0, help="then interleave the methods' fwd+bwd over N rounds")
    ap.add_argument("--out", default=None)
    ap.add_argument("--prompt", type=float, default=None, help="this fraction of each 1024-row sequence ignored")
    ap.add_argument("--softcap", type=float, default=None, help="both heads' logits capped (Gemma 2's: 30)")
    args = ap.parse_args(argv)
    CAP.clear()
    if args.softcap is not None:
        CAP.append(args.softcap)
    device = args.device
    n, ds, dt, v = map(int, (args.shape if device == "cuda" else "96x32x48x1031").split("x"))
    g = torch.Generator(device).manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hs = torch.randn(n, ds, generator=g, device=device).to(dtype)
    ws = (torch.randn(v, ds, generator=g, device=device) / ds**0.5).to(dtype)
    ht = torch.randn(n, dt, generator=g, device=device).to(dtype)
    wt = (torch.randn(v, dt, generator=g, device=device) / dt**0.5).to(dtype)
    rows = min(n, 1024)
    TARGET.clear()
    if args.prompt is not None:
        from shapes import ignore_rows

        TARGET.append(ignore_rows(torch.randint(0, v, (n,), generator=g, device=device), args.prompt))
    ref = reference(hs, ws, ht, wt, rows)
    fns = {"compile": torch.compile(spelling), "ours": ours, "ours_acc": ours_acc, "ours_recompute": ours_recompute,
           "ours_compiled": torch.compile(spelling, backend="inductor_xent"), "ours_dense": ours_dense}
    results = []
    for name in args.methods.split(","):
        fn = fns.get(name)
        note, knobs = None, None
        if name.startswith(("ours@", "ours_kept@", "ours_recompute@")):  # another chunk size (MiB): the sweep
            mib = int(name.split("@")[1]) * 2**20
            # bound per method (--rounds interleaves them): the accumulating chunks' working set, the
            # kept-dz chunks' teacher logits, or the recompute chunks' working set
            base, knob = {"ours": (ours_acc, "CUDA_CHUNK_BYTES"), "ours_kept": (ours, "TEACHER_CHUNK_BYTES"),
                          "ours_recompute": (ours_recompute, "RECOMPUTE_CHUNK_BYTES")}[name.split("@")[0]]
            fn = base
            knobs = (knob, mib)
        if name.startswith("liger"):
            fn, note = liger_fn(name) if not CAP else (None, "takes no softcap")
            if fn is None:
                results.append(dict(method=name, error=note))
                print(f"| {name} | - | - | {note} |")
                continue
        try:
            ms, mib, out = measure(name, fn, hs, ws, ht, wt, device, args.quick, knobs)
        except Exception as e:  # noqa: BLE001
            results.append(dict(method=name, error=repr(e)[:300]))
            print(f"| {name} | error | {e!r} |"[:300])
            continue
        errs = {}
        if name != "cublas" and not name.startswith("liger"):
            with chunk_knob(*knobs) if knobs else contextlib.nullcontext():
                sub = reference_like(fn, hs, ws, ht, wt, rows)
            errs = dict(loss=rel(sub[0], ref[0]), grad_hidden=rel(sub[1], ref[1]), grad_weight=rel(sub[2], ref[2]))
        results.append(dict(method=name, ms=ms, extra_mib=mib, errors=errs))
        if device == "cuda":
            torch.cuda.empty_cache()
    base = next((r for r in results if r["method"] == "compile" and "ms" in r), None)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    prompt = "" if args.prompt is None else f", {args.prompt:.0%} of each sequence a prompt (ignored)"
    prompt += "" if args.softcap is None else f", both heads softcapped at {args.softcap:g}"
    print(f"distill fwd+bwd {n}x{ds} (teacher {dt}) x {v}, {dtype}, T={TEMP}, {gpu}{prompt}")
    print("| method | ms | / compile | extra MiB | loss err | dH err | dW err |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if "ms" not in r:
            print(f"| {r['method']} | - | - | - | {r['error'][:80]} | | |")
            continue
        ratio = f"{r['ms'] / base['ms']:.3f}" if base else "-"
        e = r["errors"]
        mib = "-" if r["extra_mib"] is None else f"{r['extra_mib']:.0f}"
        cells = " | ".join("n/a" if k not in e else f"{e[k]:.2e}" for k in ("loss", "grad_hidden", "grad_weight"))
        print(f"| {r['method']} | {r['ms']:.2f} | {ratio} | {mib} | {cells} |")  # n/a: not comparable (Liger's)
    rounds = None
    if args.rounds and RUNS:
        rounds = interleaved([r["method"] for r in results if r["method"] in RUNS], args.rounds, args.quick)
        print(f"| method | median fwd+bwd ms ({args.rounds} rounds) | rounds | median ratio to compile (per round) |")
        print("|---|---|---|---|")
        for name, times in rounds["ms"].items():
            rs = rounds["ratios"].get(name)
            ratio = "-" if not rs else f"{statistics.median(rs):.3f} (" + ", ".join(f"{x:.3f}" for x in rs) + ")"
            print(f"| {name} | {statistics.median(times):.2f} | " + ", ".join(f"{t:.2f}" for t in times)
                  + f" | {ratio} |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        meta = dict(shape=[n, ds, dt, v], dtype=str(dtype), temperature=TEMP, torch=torch.__version__,
                    prompt=args.prompt, softcap=args.softcap,
                    device=torch.cuda.get_device_name() if device == "cuda" else "cpu", date=time.strftime("%F"))
        Path(args.out, "bench_distill.json").write_text(json.dumps(dict(meta=meta, results=results, rounds=rounds),
                                                                   indent=1))


def reference_like(fn, hs, ws, ht, wt, rows):
    """The method on the first ``rows`` rows (the errors' sample)."""
    h, w = hs[:rows].detach().requires_grad_(), ws.detach().requires_grad_()
    loss = fn(h, w, ht[:rows], wt)
    return loss.detach().float(), *(x.float() for x in torch.autograd.grad(loss, (h, w)))


if __name__ == "__main__":
    main()
