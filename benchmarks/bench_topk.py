"""Per-row top-k head benchmark (issue 25, items 2 and 3).

    python benchmarks/bench_topk.py [--shape 8192x4096x128256] [--k 64] [--quick] [--out DIR]
        [--device cuda|cpu]

What is timed, at the llama3-8b head by default (bf16):

* ``cublas``: the logits GEMM alone, ``F.linear(h, w)`` (the floor of any top-k);
* ``eager`` / ``compile``: ``torch.topk(F.log_softmax(F.linear(h, w).float() / T, -1), k)`` eagerly
  and under torch.compile (Inductor);
* ``ours``: ``inductor_xent.linear_topk(h, w, k, log_probs=True, temperature=T)``;
* ``ours_compiled``: the spelling under ``torch.compile(backend="inductor_xent")`` (the pass fuses it);
* ``kept_ours`` / ``kept_eager``: the kept-set log-probs of sampled ids over each row's top-k,
  ``linear_log_probs(..., top_k=k)`` against eager's ``masked_fill`` spelling;
* ``nucleus_ours`` / ``nucleus_eager`` / ``nucleus_compile``: the kept-set log-probs over each row's
  top-p set (p = 0.9, HF's ``TopPLogitsWarper`` rule), ``linear_log_probs(..., top_p=0.9)`` against
  the warper written out over the logits, eagerly and under torch.compile; ``nucleus_bisect`` /
  ``nucleus_sort``: ours with the rows past the candidates bisected (CUDA's default) / sorted, on any
  device (``topk.BISECT_DEVICES``). Only when named in
  ``--methods`` (not in the default list): the sort over the vocabulary is slow to compile and time.
  ``--logit-std`` sets the logits' spread: at the default 1 (gauss data) a kept set holds most of the
  vocabulary; at 4 tens of columns, as an LLM's (the median and largest kept-set sizes are printed).
* ``gather_eager`` / ``gather_compile`` / ``gather_ours`` / ``gather_ours_compiled`` (opt-in): the
  student's side of top-k distillation from a teacher's stored top-k, the log-probs at T of k fixed
  random ids per row (``F.log_softmax(F.linear(h, w).float() / T, -1).gather(-1, ids)``) eagerly,
  under torch.compile, ``inductor_xent.linear_gather`` (``auto``: on CUDA the logits kept for the backward;
  ``gather_ours_recompute``: recomputed there) and the spelling under the backend;
  ``gather_logits_*`` the same for the logits at those ids (``F.linear(h, w).gather(-1, ids)``, the
  student renormalised over the k), whose fused forward is k dot products per row.

Forward alone and forward + backward (the values' gradient a random [N, k] tensor; the kept-set
rows' a random [N]) with the extra peak memory of each. The kept-set methods also get errors on the
first ERR_ROWS rows against their spelling in fp32 (fp32 inputs and matmuls, TF32 off): the log-probs'
where finite, the hidden and weight gradients, and the rows whose target is kept in one and not the
other (``kept_differ``); the eager and compiled spellings' errors are torch's own. Accounting: median of
``triton.testing.do_bench`` (bench_kernels.bench_ms); extra MiB: peak minus what was allocated
before the call. Target (issue 25): top-k (k = 64) forward ≤ 1.15× the cuBLAS logits GEMM.
``--device cpu`` is a dry run on tiny shapes.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk  # noqa: E402

import inductor_xent  # noqa: E402

T = 0.7
TOP_P = 0.9
TARGET_FWD_VS_CUBLAS = 1.15
# timed only when named in --methods
OPT_IN = ("nucleus_ours", "nucleus_eager", "nucleus_compile", "nucleus_bisect", "nucleus_sort", "gather_eager",
          "gather_compile", "gather_ours", "gather_ours_recompute", "gather_ours_compiled", "gather_logits_eager",
          "gather_logits_compile", "gather_logits_ours", "gather_logits_ours_compiled")
ERR_ROWS = 512


def spelling(h, w, k):
    return torch.topk(F.log_softmax(F.linear(h, w).float() / T, -1), k)


def gathered(h, w, ids):
    return F.log_softmax(F.linear(h, w).float() / T, -1).gather(-1, ids)


def gathered_logits(h, w, ids):
    return F.linear(h, w).gather(-1, ids).float()


@functools.cache
def teacher_ids(n: int, v: int, k: int, device: str) -> torch.Tensor:
    """k distinct random ids per row (a teacher's stored top-k), the same for every method."""
    g = torch.Generator().manual_seed(2)
    return torch.rand(n, v, generator=g).topk(k, -1).indices.to(device) if n * v <= 2**31 else \
        torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n)]).to(device)


def kept_eager(h, w, ids, k):
    u = F.linear(h, w).float() / T
    kth = torch.topk(u, k).values[..., -1:]
    return u.masked_fill(u < kth, float("-inf")).log_softmax(-1).gather(-1, ids[:, None])[:, 0]


def nucleus_eager(h, w, ids, top_p=TOP_P):
    """HF's TopPLogitsWarper over the logits at T, then the sampled ids' log-probs over the kept set."""
    u = F.linear(h, w).float() / T
    sorted_logits, sorted_indices = torch.sort(u, descending=False)
    remove = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
    remove[..., -1:] = 0
    u = u.masked_fill(remove.scatter(-1, sorted_indices, remove), float("-inf"))
    return u.log_softmax(-1).gather(-1, ids[:, None])[:, 0]


def methods(k):
    compiled = torch.compile(spelling, dynamic=False)
    nucleus_compiled = torch.compile(nucleus_eager, dynamic=False)
    fused = torch.compile(spelling, backend="inductor_xent", dynamic=False)
    gather_compiled = torch.compile(gathered, dynamic=False)
    gather_fused = torch.compile(gathered, backend="inductor_xent", dynamic=False)
    logits_compiled = torch.compile(gathered_logits, dynamic=False)
    logits_fused = torch.compile(gathered_logits, backend="inductor_xent", dynamic=False)

    def at(fn):  # the method over the teacher's ids of these shapes
        return lambda h, w, ids: fn(h, w, teacher_ids(h.shape[0], w.shape[0], k, str(h.device)))
    return {
        "cublas": lambda h, w, ids: F.linear(h, w),
        "eager": lambda h, w, ids: spelling(h, w, k).values,
        "compile": lambda h, w, ids: compiled(h, w, k).values,
        "ours": lambda h, w, ids: inductor_xent.linear_topk(h, w, k, log_probs=True, temperature=T).values,
        "ours_compiled": lambda h, w, ids: fused(h, w, k).values,
        "kept_eager": lambda h, w, ids: kept_eager(h, w, ids, k),
        "kept_ours": lambda h, w, ids: inductor_xent.linear_log_probs(h, w, ids, temperature=T, top_k=k).log_probs,
        "nucleus_eager": nucleus_eager,
        "nucleus_compile": lambda h, w, ids: nucleus_compiled(h, w, ids),
        "nucleus_ours": lambda h, w, ids: inductor_xent.linear_log_probs(h, w, ids, temperature=T,
                                                                       top_p=TOP_P).log_probs,
        "nucleus_bisect": nucleus_with(("cuda", "cpu")),
        "nucleus_sort": nucleus_with(()),
        "gather_eager": at(gathered),
        "gather_compile": at(gather_compiled),
        "gather_ours": at(lambda h, w, i: inductor_xent.linear_gather(h, w, i, log_probs=True, temperature=T)),
        "gather_ours_recompute": at(lambda h, w, i: inductor_xent.linear_gather(h, w, i, log_probs=True, temperature=T,
                                                                                strategy="recompute")),
        "gather_ours_compiled": at(gather_fused),
        "gather_logits_eager": at(gathered_logits),
        "gather_logits_compile": at(logits_compiled),
        "gather_logits_ours": at(lambda h, w, i: inductor_xent.linear_gather(h, w, i)),
        "gather_logits_ours_compiled": at(logits_fused),
    }


def nucleus_with(devices: tuple):
    """``nucleus_ours`` with ``topk.BISECT_DEVICES`` set to ``devices`` for its forward: the rows past the
    candidates bisected where the tensors' device is among them, else sorted (the A/B of the two)."""
    from inductor_xent import topk

    def run(h, w, ids):
        saved, topk.BISECT_DEVICES = topk.BISECT_DEVICES, devices
        try:
            return inductor_xent.linear_log_probs(h, w, ids, temperature=T, top_p=TOP_P).log_probs
        finally:
            topk.BISECT_DEVICES = saved
    return run


def timed(device, quick):
    def ms(fn):
        if device == "cuda":
            return bk.bench_ms(fn, quick, False)
        fn()
        times = []
        for _ in range(2):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3
    return ms


def errors(fn, ref_fn, h, w, ids) -> dict:
    """A kept-set method's errors against ``ref_fn`` (its spelling) in fp32 on the first ERR_ROWS rows:
    log-probs where both are finite, hidden and weight gradients for a random upstream gradient (the
    −inf rows' counted as 0, as ``measure``'s step), and how many rows' targets the two keep otherwise."""
    r = min(ERR_ROWS, h.shape[0])
    g = torch.Generator().manual_seed(1)
    up = torch.randn(r, generator=g).to(h.device)
    out = []
    for f, dtype in ((fn, h.dtype), (ref_fn, torch.float32)):
        hh = h[:r].detach().to(dtype).requires_grad_()
        ww = w.detach().to(dtype).requires_grad_()
        lp = f(hh, ww, ids[:r])
        out.append((lp.detach().float(), *torch.autograd.grad((lp.where(torch.isfinite(lp), 0.0) * up).sum(),
                                                              (hh, ww))))
        del hh, ww, lp
    (lp, dh, dw), (lp_ref, dh_ref, dw_ref) = out
    both = torch.isfinite(lp) & torch.isfinite(lp_ref)
    return {"err_lp": bk.rel_err(lp[both], lp_ref[both]), "err_dh": bk.rel_err(dh, dh_ref),
            "err_dw": bk.rel_err(dw, dw_ref), "kept_differ": int((torch.isfinite(lp) != torch.isfinite(lp_ref)).sum())}


def measure(name, fn, h, w, ids, k, ms, device) -> dict:
    """One method's row: forward (no grad) and forward + backward times and extra memory."""
    row = {"method": name, "shape": "x".join(map(str, (h.shape[0], h.shape[1], w.shape[0]))), "k": k}
    try:
        with torch.no_grad():
            row["fwd_ms"] = ms(lambda: fn(h, w, ids))
            if device == "cuda":
                row["fwd_mib"] = bk.extra_peak_mib(lambda: fn(h, w, ids))[1]
        if name == "cublas":
            return row
        hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
        out = fn(hh, ww, ids)
        up = torch.randn(out.shape, device=device, dtype=out.dtype)
        del out

        def step():
            res = fn(hh, ww, ids)
            return torch.autograd.grad((res.where(torch.isfinite(res), 0.0) * up).sum(), (hh, ww))

        row["fwd_bwd_ms"] = ms(step)
        if device == "cuda":
            row["fwd_bwd_mib"] = bk.extra_peak_mib(step)[1]
        if name.startswith(("nucleus", "kept")):
            ref = nucleus_eager if name.startswith("nucleus") else functools.partial(kept_eager, k=k)
            row.update(errors(fn, ref, h, w, ids))
    except torch.OutOfMemoryError:
        row["status"] = "OOM"
    return row


def interleaved(fns, chosen, h, w, ids, ms, count: int) -> Optional[dict]:
    """{"ms": per method, one time per round; "ratios": ours / cublas per round} of the forwards of
    cublas, ours and ours_compiled (those chosen; cublas and ours at least), the order rotated per round."""
    names = [m for m in ("cublas", "ours", "ours_compiled") if m in chosen]
    if "cublas" not in names or "ours" not in names:
        return None
    times = {m: [] for m in names}
    with torch.no_grad():
        for r in range(count):
            for m in names[r % len(names):] + names[:r % len(names)]:
                times[m].append(ms(lambda fn=fns[m]: fn(h, w, ids)))
    return {"ms": times, "ratios": [o / c for o, c in zip(times["ours"], times["cublas"])]}


def kept_sizes(h, w) -> tuple[int, int]:
    """The median and largest top-p kept-set size over the rows (a few row blocks at a time)."""
    sizes = []
    with torch.no_grad():
        for start in range(0, h.shape[0], 1024):
            u = F.linear(h[start:start + 1024], w).float() / T
            p = torch.sort(torch.softmax(u, -1), -1, descending=True).values
            sizes.append(((p.cumsum(-1) - p) < TOP_P).sum(-1))
    sizes = torch.cat(sizes)
    return int(sizes.median()), int(sizes.max())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bk.head_args(ap)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--logit-std", type=float, default=1.0,
                    help="the logits' standard deviation (hidden states scaled): 1 flat rows, 4 an LLM's peaked ones")
    ap.add_argument("--rounds", type=int, default=0,
                    help="then the forwards of cublas, ours and ours_compiled (those chosen) interleaved over "
                         "this many rounds, the order rotated: the target's ratio is the median of the per-round "
                         "ratios (the GPU's clock moves a single run's GEMM by up to 10 %%)")
    args = ap.parse_args(argv)
    n, d, v = bk.head_shape(args)
    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    h = (torch.randn(n, d, generator=g) * (args.logit_std / d**0.25)).to(args.device, dtype)
    w = (torch.randn(v, d, generator=g) / d**0.25).to(args.device, dtype)
    k = min(args.k, v)
    fns = methods(k)
    chosen = args.methods.split(",") if args.methods else [m for m in fns if m not in OPT_IN]
    unknown = [m for m in chosen if m not in fns]
    if unknown:
        ap.error(f"unknown methods {unknown}; known: {', '.join(fns)}")
    ms = timed(args.device, args.quick)
    with torch.no_grad():  # the kept-set rows' ids: sampled from each row's top-k (the rollout's)
        top = torch.topk(F.linear(h, w).float() / T, k)
        pick = torch.multinomial(torch.softmax(top.values, -1), 1, generator=None)[:, 0]
        ids = top.indices.gather(1, pick[:, None])[:, 0]
        del top
    sizes = kept_sizes(h, w) if any(m.startswith("nucleus") for m in chosen) else None
    if sizes:
        print(f"kept sets at top_p={TOP_P}, T={T}, logit std {args.logit_std}: median {sizes[0]} columns, "
              f"largest {sizes[1]}", flush=True)
    rows = []
    for name in chosen:
        rows.append(measure(name, fns[name], h, w, ids, k, ms, args.device))
        if args.device == "cuda":
            torch.cuda.empty_cache()
        print(json.dumps(rows[-1]), flush=True)
    base = next((r.get("fwd_ms") for r in rows if r["method"] == "cublas"), None)
    ours = next((r.get("fwd_ms") for r in rows if r["method"] == "ours"), None)
    print("| method | fwd ms | fwd MiB | fwd+bwd ms | fwd+bwd MiB | err lp | err dH | err dW | kept differ |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [r.get(key) for key in ("fwd_ms", "fwd_mib", "fwd_bwd_ms", "fwd_bwd_mib")]
        errs = [r.get(key) for key in ("err_lp", "err_dh", "err_dw")]
        print(f"| {r['method']} | " + " | ".join("—" if c is None else f"{c:.2f}" for c in cells) + " | "
              + " | ".join("—" if e is None else f"{e:.1e}" for e in errs) + f" | {r.get('kept_differ', '—')} |")
    if base and ours:
        verdict = "MET" if ours / base <= TARGET_FWD_VS_CUBLAS else "MISSED"
        print(f"target top-k (k={k}) forward <= {TARGET_FWD_VS_CUBLAS}x cuBLAS logits GEMM: {verdict} "
              f"({ours:.2f} ms / {base:.2f} ms = {ours / base:.3f}x)")
    rounds = interleaved(fns, chosen, h, w, ids, ms, args.rounds) if args.rounds else None
    if rounds:
        ratio = statistics.median(rounds["ratios"])
        print(f"| method | median fwd ms ({args.rounds} rounds) | rounds |")
        print("|---|---|---|")
        for name, times in rounds["ms"].items():
            print(f"| {name} | {statistics.median(times):.2f} | " + ", ".join(f"{t:.2f}" for t in times) + " |")
        verdict = "MET" if ratio <= TARGET_FWD_VS_CUBLAS else "MISSED"
        print(f"target top-k (k={k}) forward <= {TARGET_FWD_VS_CUBLAS}x cuBLAS logits GEMM, interleaved: {verdict} "
              f"(median of per-round ratios {ratio:.3f}x: " + ", ".join(f"{r:.3f}" for r in rounds["ratios"]) + ")")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        info = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                "date": time.strftime("%Y-%m-%d"), "logit_std": args.logit_std, "kept_sizes": sizes}
        (Path(args.out) / "bench_topk.json").write_text(json.dumps({"info": info, "rows": rows, "rounds": rounds},
                                                                   indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
