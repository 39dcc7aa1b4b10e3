"""What ``INDUCTOR_XENT_BATCH_INVARIANT=1`` costs (issue 25, item 5: the default if it costs ≤ 2 %).

    python benchmarks/bench_batch_invariant.py [--shape 16384x3584x152064] [--rounds 3]

The switch fixes the forward's vocabulary split (4 tiles a split, instead of the split the cost model
picks from N) and makes the log-prob op recompute instead of store. Timed, interleaved over rounds
(median of ``triton.testing.do_bench`` each), bf16, T = 0.7, log-probs + entropy:

* ``fwd``: the forward alone (no gradient), off and on: the fixed split's cost;
* ``fwd+bwd``: forward + backward with random per-token upstream gradients, off (auto: store from
  D = 2048) and on (recompute): what an RL step pays.

Also checks the switch's promise on the way: 300 rows alone and inside the shuffled batch give the
same bits (log-probs, entropy, argmax).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk  # noqa: E402

import inductor_xent  # noqa: E402

KEY = "INDUCTOR_XENT_BATCH_INVARIANT"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="16384x3584x152064")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    n, d, v = (int(x) for x in args.shape.split("x"))
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(n, d, generator=g) / d**0.25).to("cuda", torch.bfloat16)
    w = (torch.randn(v, d, generator=g) / d**0.25).to("cuda", torch.bfloat16)
    ids = torch.randint(0, v, (n,), generator=g).cuda()
    up = torch.randn(2, n, generator=g).cuda()
    kw = dict(temperature=0.7, entropy=True)

    def fwd():
        with torch.no_grad():
            return inductor_xent.linear_log_probs(h, w, ids, **kw)

    hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()

    def step():
        out = inductor_xent.linear_log_probs(hh, ww, ids, **kw)
        return torch.autograd.grad((out.log_probs * up[0] + out.entropy * up[1]).sum(), (hh, ww))

    times = {f"{what}_{mode}": [] for what in ("fwd", "fwd+bwd") for mode in ("off", "on")}
    for r in range(args.rounds):
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            os.environ[KEY] = "1" if mode == "on" else "0"
            times[f"fwd_{mode}"].append(bk.bench_ms(fwd, True, False))
            times[f"fwd+bwd_{mode}"].append(bk.bench_ms(step, True, False))
            torch.cuda.empty_cache()
    os.environ[KEY] = "1"
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1)).cuda()
    alone, inside = fwd_rows(h[:300], w, ids[:300], kw), fwd_rows(h[order], w, ids[order], kw)
    where = torch.argsort(order)[:300]
    same = all(torch.equal(a, b[where]) for a, b in zip(alone, inside))
    os.environ.pop(KEY)
    med = {k: statistics.median(x) for k, x in times.items()}
    row = {"shape": args.shape, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "rounds": times, "median_ms": med, "rows_alone_equal_inside": same,
           "fwd_cost": med["fwd_on"] / med["fwd_off"], "step_cost": med["fwd+bwd_on"] / med["fwd+bwd_off"]}
    print(json.dumps(row, indent=1))
    print(f"batch invariance: forward {row['fwd_cost']:.3f}x, forward+backward {row['step_cost']:.3f}x "
          f"(issue 25: the default if <= 1.02x); 300 rows alone == inside {n}: {same}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_batch_invariant.json").write_text(json.dumps(row, indent=1))
    return 0


def fwd_rows(h, w, ids, kw):
    with torch.no_grad():
        out = inductor_xent.linear_log_probs(h, w, ids, argmax=True, **kw)
    return out.log_probs, out.entropy, out.argmax


if __name__ == "__main__":
    sys.exit(main())
