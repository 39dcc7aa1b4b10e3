"""CPU benchmark of the chunked fallback against eager ``F.cross_entropy(F.linear(...))``.

Accounting: wall-clock median of ``--repeat`` forward+backward runs after one warm-up; peak memory
growth = the process's peak resident set (VmHWM, reset through /proc/self/clear_refs before each
run) minus the resident set before it, so it counts every byte the run touched, allocator slack
included. Gradient buffers (hidden and weight) are preallocated by a warm-up and excluded.

    python3 benchmarks/cpu_fallback.py            # N=4096, D=64, V=32768, float32 (issue 2's shape)
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import time

import torch
import torch.nn.functional as F

import inductor_xent


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) * 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def eager(h, w, y):
    return F.cross_entropy(F.linear(h, w).float(), y)


def ours(h, w, y):
    return inductor_xent.linear_cross_entropy(h, w, y)


def measure(fn, h, w, y, repeat: int) -> dict:
    def step():
        h.grad = w.grad = None
        fn(h, w, y).backward()

    step()  # warm-up (also allocates the gradient buffers once)
    times, peaks = [], []
    for _ in range(repeat):
        h.grad = w.grad = None
        before = _status("VmRSS")
        _reset_peak()
        t0 = time.perf_counter()
        fn(h, w, y).backward()
        times.append(time.perf_counter() - t0)
        grads = h.grad.nbytes + w.grad.nbytes
        peaks.append(_status("VmHWM") - before - grads)
    return {"ms": 1e3 * statistics.median(times), "peak_growth_mib": max(peaks) / 2**20}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--v", type=int, default=32768)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    h = torch.randn(args.n, args.d, requires_grad=True)
    w = (torch.randn(args.v, args.d) * 3 / args.d**0.5).requires_grad_()
    y = torch.randint(0, args.v, (args.n,))
    y[::17] = -100
    logits_mib = args.n * args.v * 4 / 2**20
    out = {
        "shape": [args.n, args.d, args.v], "dtype": "float32", "logits_mib": logits_mib,
        "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor(),
        "date": time.strftime("%Y-%m-%d"),
    }
    for name, fn in (("eager", eager), ("inductor_xent", ours)):
        out[name] = measure(fn, h, w, y, args.repeat)
    print(f"N={args.n} D={args.d} V={args.v} fp32 (logits {logits_mib:.0f} MiB), "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| method | fwd+bwd ms | peak growth MiB | / logits |")
    print("|---|---|---|---|")
    for name in ("eager", "inductor_xent"):
        r = out[name]
        print(f"| {name} | {r['ms']:.1f} | {r['peak_growth_mib']:.0f} | {r['peak_growth_mib'] / logits_mib:.2f} |")
    print(f"time ratio ours/eager: {out['inductor_xent']['ms'] / out['eager']['ms']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
