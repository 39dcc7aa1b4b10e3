"""Micro-benchmark of templates/rows.py's count-bounded GEMMs against cuBLAS (the store backward's
two products at the llama3-8b head): ``python -m benchmarks.bench_rows_mm [--out file.json]``."""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from inductor_xent.templates import rows
from inductor_xent.templates.configs import KernelConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    r, v, d = args.rows, args.vocab, args.dim
    dev, dt = "cuda", torch.bfloat16
    dz = torch.randn(r, v, device=dev, dtype=dt) * 1e-3
    w = torch.randn(v, d, device=dev, dtype=dt)
    h = torch.randn(r, d, device=dev, dtype=dt)
    gh = torch.empty(r, d, device=dev, dtype=dt)
    gw = torch.zeros(v, d, device=dev, dtype=dt)
    res = {}

    def t(name, fn):
        ms = do_bench(fn, warmup=5, rep=40)
        res[name] = ms
        print(f"{name:48s} {ms:8.3f} ms", flush=True)

    t("cublas dH = dz @ W", lambda: torch.mm(dz, w, out=gh))
    t("cublas dW = dz.T @ h", lambda: torch.mm(dz.t(), h, out=gw))
    t("cublas dW += dz.T @ h", lambda: gw.addmm_(dz.t(), h))
    ref_h = torch.mm(dz, w)
    ref_w = torch.mm(dz.t(), h)
    cfgs = {
        "m128n256k64w8s3": KernelConfig(128, 256, 64, 8, 8, 3, tma=True),
        "m128n256k64w8s4": KernelConfig(128, 256, 64, 8, 8, 4, tma=True),
        "m128n128k64w8s4": KernelConfig(128, 128, 64, 8, 8, 4, tma=True),
        "m256n128k64w8s3": KernelConfig(256, 128, 64, 8, 8, 3, tma=True),
    }
    for frac in (1.0, 0.5, 0.3):
        c = torch.tensor([int(r * frac)], device=dev, dtype=torch.int32)
        for name, cfg in cfgs.items():
            for flat in (True, False):
                tag = f"{name} flat={int(flat)} count={frac}"
                try:
                    t(f"ours dH {tag}", lambda c=c, cfg=cfg, flat=flat: rows.rows_mm(
                        gh, dz, w, c, bound="m", cfg=cfg, flatten=flat))
                    if frac == 1.0:
                        res[f"err dH {tag}"] = (gh.float() - ref_h.float()).abs().max().item()
                    t(f"ours dW {tag}", lambda c=c, cfg=cfg, flat=flat: rows.rows_mm(
                        gw, dz, h, c, bound="k", trans_a=True, cfg=cfg, flatten=flat))
                    if frac == 1.0:
                        res[f"err dW {tag}"] = (gw.float() - ref_w.float()).abs().max().item()
                    t(f"ours dW+= {tag}", lambda c=c, cfg=cfg, flat=flat: rows.rows_mm(
                        gw, dz, h, c, bound="k", trans_a=True, accumulate=True, cfg=cfg, flatten=flat))
                except Exception as e:  # a config that does not compile: say so and go on
                    print(tag, "failed:", repr(e)[:300], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
