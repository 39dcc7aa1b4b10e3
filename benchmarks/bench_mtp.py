"""Multi-token prediction through one lm_head (issue 25, item 4): several hidden states, one weight.

    python benchmarks/bench_mtp.py [--shape 8192x4096x128256] [--depths 1] [--rounds 3] [--quick]
        [--out DIR] [--device cuda|cpu]

The loss is DeepSeek-V3's: the next token from ``h0`` and, for each MTP depth k, token k + 2 from
``h_k``, every depth through the same lm_head, ``CE_0 + 0.3 · mean_k CE_k`` (bf16; each hidden state a
leaf, so only the head is timed). Per depth N rows of the ``NxDxV`` shape. Methods:

* ``compile``: the loss under ``torch.compile`` (Inductor);
* ``ours_shared``: the loss under ``torch.compile(backend="inductor_xent")``: the pass makes the sites one
  log-probs op over all the rows (``patterns/_shared.py``);
* ``ours_apart``: one fused op per site, ``inductor_xent.linear_cross_entropy`` per depth (the default
  strategy: store on CUDA), what the pass did before;
* ``cublas``: the depths' logits GEMMs alone (a floor for the forward).

Forward + backward (gradients of every hidden state and of the weight), interleaved rounds, the median
of each method's per-round times and its ratio to compile's in the same round; extra peak MiB.
``--device cpu`` is a dry run on tiny shapes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk  # noqa: E402

import inductor_xent  # noqa: E402

LAMBDA = 0.3


def mtp_loss(hs, w, ys):
    loss = F.cross_entropy(F.linear(hs[0], w).float(), ys[0])
    depths = [F.cross_entropy(F.linear(h, w).float(), y) for h, y in zip(hs[1:], ys[1:])]
    return loss + LAMBDA * sum(depths) / len(depths)


def apart(hs, w, ys):
    depths = [inductor_xent.linear_cross_entropy(h, w, y) for h, y in zip(hs[1:], ys[1:])]
    return inductor_xent.linear_cross_entropy(hs[0], w, ys[0]) + LAMBDA * sum(depths) / len(depths)


def methods() -> dict:
    return {
        "compile": torch.compile(mtp_loss, dynamic=False),
        "ours_shared": torch.compile(mtp_loss, backend="inductor_xent", dynamic=False),
        "ours_apart": apart,
        "cublas": lambda hs, w, ys: [F.linear(h, w) for h in hs],
    }


def ms_of(device, quick):
    def ms(fn):
        if device == "cuda":
            return bk.bench_ms(fn, quick, False)
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return ms


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bk.head_args(ap)
    ap.add_argument("--depths", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    n, d, v = bk.head_shape(args)
    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    hs = [(torch.randn(n, d, generator=g) / d**0.25).to(args.device, dtype) for _ in range(args.depths + 1)]
    w = (torch.randn(v, d, generator=g) / d**0.25).to(args.device, dtype)
    ys = [torch.randint(0, v, (n,), generator=g).to(args.device) for _ in hs]
    fns = methods()
    chosen = args.methods.split(",") if args.methods else list(fns)
    ms = ms_of(args.device, args.quick)
    leaves = [h.detach().requires_grad_() for h in hs], w.detach().requires_grad_()

    def run(m):
        if m == "cublas":  # the logits GEMMs, forward only
            with torch.no_grad():
                return fns[m](hs, w, ys)
        return torch.autograd.grad(fns[m](leaves[0], leaves[1], ys), [*leaves[0], leaves[1]])

    times: dict = {m: [] for m in chosen}
    mib: dict = {}
    losses = {}
    for _ in range(args.rounds):
        for m in chosen:
            times[m].append(ms(lambda m=m: run(m)))
    for m in chosen:
        if args.device == "cuda":
            mib[m] = bk.extra_peak_mib(lambda m=m: run(m))[1]
            torch.cuda.empty_cache()
        if m != "cublas":
            with torch.no_grad():
                losses[m] = float(fns[m](hs, w, ys))
    rows = []
    for m in chosen:
        ratios = ([a / b for a, b in zip(times[m], times["compile"])] if "compile" in times and m != "cublas"
                  else [])
        rows.append({"method": m, "ms": statistics.median(times[m]), "rounds_ms": times[m],
                     "vs_compile": statistics.median(ratios) if ratios else None, "extra_mib": mib.get(m),
                     "loss": losses.get(m)})
        print(json.dumps(rows[-1]), flush=True)
    print(f"mtp: {args.depths + 1} sites of {n}x{d}x{v} ({dtype}), fwd+bwd (cublas: the forward GEMMs), "
          f"{args.rounds} interleaved rounds")
    print("| method | ms | vs compile | extra MiB | loss |")
    print("|---|---|---|---|---|")
    for r in rows:
        cells = [r["ms"], r["vs_compile"], r["extra_mib"], r["loss"]]
        print(f"| {r['method']} | " + " | ".join("—" if c is None else f"{c:.4g}" for c in cells) + " |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        info = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                "date": time.strftime("%Y-%m-%d"), "shape": [n, d, v], "depths": args.depths, "rounds": args.rounds}
        (Path(args.out) / "bench_mtp.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
