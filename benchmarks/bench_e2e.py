"""End-to-end benchmark: one HF Llama training step compiled with backend="inductor" and with
backend="inductor_xent" (issue 4's realistic check).

Modes (``--modes``, comma-separated), each inductor against inductor_xent:

* ``loss``: the compiled region is ``lambda batch: model(**batch).loss`` (returns only the loss, so
  the logits need not exist), parameters in bf16; ours with each strategy too;
* ``autocast``: the same region under ``torch.autocast(bf16)`` with fp32 parameters (HF
  ``Trainer(bf16=True)``, accelerate, Lightning ``bf16-mixed``);
* ``whole``: ``torch.compile(model)``, the whole model (its logits returned), the caller taking
  ``.loss``, parameters in bf16;
* ``whole_autocast``: the whole model under autocast with fp32 parameters (``Trainer(torch_compile=True,
  bf16=True)``).

A step = compiled forward + backward + SGD update. Step time: median
over ``--steps`` steps after ``--warmup`` steps (the first compiles). Peak memory: CUDA allocator
peak during a step minus the memory allocated before it (weights, gradients, optimizer state and
the batch are excluded since they exist before the step starts).

    python -m inductor_xent bench e2e --out out/        # GPU: hidden 2048, V=128256, 8 x 2048 tokens
    python -m inductor_xent bench e2e --modes autocast,whole,whole_autocast
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time

import torch

from inductor_xent import demo

SHAPE = dict(vocab=128256, hidden=2048, layers=2, heads=16, batch=8, seq=2048, dtype=torch.bfloat16)


# (label, backend, options): the default backend, ours with its default strategy (auto), and ours
# with each strategy forced, so that the time/memory trade-off of the strategies shows end to end
VARIANTS = (
    ("inductor", "inductor", None),
    ("inductor_xent", "inductor_xent", None),
    ("inductor_xent:recompute", "inductor_xent", {"xent.strategy": "recompute"}),
    ("inductor_xent:store", "inductor_xent", {"xent.strategy": "store"}),
)
# mode: (parameters' dtype, autocast, compile the whole model)
MODES = {
    "loss": (torch.bfloat16, False, False),
    "autocast": (torch.float32, True, False),
    "whole": (torch.bfloat16, False, True),
    "whole_autocast": (torch.float32, True, True),
}


def run_backend(variant, base_model, loss_of, shape, device, warmup, steps, mode="loss") -> dict:
    label, backend, options = variant
    dtype, autocast, whole = MODES[mode]
    model = copy.deepcopy(base_model).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    torch._dynamo.reset()
    if whole:  # the caller takes .loss and drops the returned logits
        compiled_model = torch.compile(model, backend=backend, options=options)
        region = lambda batch: compiled_model(**batch).loss  # noqa: E731
    else:
        region = torch.compile(lambda batch: loss_of(model, batch), backend=backend, options=options)

    def step(batch):
        ctx = torch.autocast(device, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with ctx:
            return region(batch)

    from torch._dynamo.utils import counters

    counters["inductor_xent"].clear()
    times, peaks, losses = [], [], []
    batch_list = list(demo.batches(shape, device, 2))
    for i in demo.progress(range(warmup + steps), warmup + steps, f"{mode}: {label:>23}"):
        loss, seconds, peak = demo.timed_step(step, batch_list[i % 2], opt, device)
        losses.append(loss)
        if i >= warmup:
            times.append(seconds)
            peaks.append(peak)
    return {"backend": label, "mode": mode, "step_ms": 1e3 * statistics.median(times),
            "peak_mib": max(peaks) / 2**20, "losses": losses,
            "sites_fused": counters["inductor_xent"]["sites_fused"] if backend == "inductor_xent" else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=SHAPE["layers"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default=None, help="directory for bench_e2e.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--modes", default="loss", help=f"comma-separated, of {', '.join(MODES)} (see above)")
    p.add_argument("--prompt", type=float, default=1 / 8,
                   help="fraction of each sequence that is prompt (labels -100); 0.5: an SFT batch, half ignored")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        print(f"unknown mode {unknown[0]!r}; choose from {', '.join(MODES)}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench e2e needs a CUDA GPU (torch sees none); use --device cpu for a small smoke run",
              file=sys.stderr)
        return 2
    shape = dict(demo.CPU_SHAPE if args.device == "cpu" else SHAPE, layers=args.layers, prompt=args.prompt)
    base_model, loss_of, name = demo.build_model(shape, args.device, use_hf=True)
    results = [run_backend(v, base_model, loss_of, shape, args.device, args.warmup, args.steps, mode)
               for mode in modes for v in (VARIANTS if mode == "loss" else VARIANTS[:2])]
    tokens = shape["batch"] * shape["seq"]
    meta = {
        "model": name, "tokens": tokens, "dtype": str(shape["dtype"]), "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d"), "prompt_fraction": args.prompt,
        "logits_mib": tokens * shape["vocab"] * shape["dtype"].itemsize / 2**20,
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    print(f"\n{name}, {tokens} tokens ({args.prompt:.0%} of each sequence ignored), {meta['gpu']}, "
          f"torch {meta['torch']}, {meta['date']}")
    print("| mode | backend | sites fused | step ms (median) | peak MiB during step | step / inductor | MiB saved |")
    print("|---|---|---|---|---|---|---|")
    for mode in modes:
        ref = next(r for r in results if r["mode"] == mode and r["backend"] == "inductor")
        for r in (r for r in results if r["mode"] == mode):
            fused = "" if r["sites_fused"] is None else r["sites_fused"]
            print(f"| {mode} | {r['backend']} | {fused} | {r['step_ms']:.1f} | {r['peak_mib']:.0f} "
                  f"| {r['step_ms'] / ref['step_ms']:.3f}x | {ref['peak_mib'] - r['peak_mib']:.0f} |")
        ours = next(r for r in results if r["mode"] == mode and r["backend"] == "inductor_xent")
        print(f"{mode}: step time ratio {ours['step_ms'] / ref['step_ms']:.3f}; "
              f"peak saved {ref['peak_mib'] - ours['peak_mib']:.0f} MiB "
              f"(logits in {shape['dtype']}: {meta['logits_mib']:.0f} MiB); "
              f"losses step 0: {ref['losses'][0]:.5f} vs {ours['losses'][0]:.5f}")
    if args.out:
        import os

        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_e2e.json"), "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
