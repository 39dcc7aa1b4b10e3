"""``python -m inductor_xent demo``: a few training steps of a small causal LM, compiled with
``backend="inductor"`` and with ``backend="inductor_xent"``, side by side.

Shows what the pass found (the ``explain`` table and the FX graph before/after, abridged), the loss
of every step under both backends and their difference, peak memory (measured: CUDA allocator
peak on GPU, the process's peak resident set on CPU) and time. Exits 1 if the losses diverge.
"""

from __future__ import annotations

import argparse
import copy
import re
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

# CPU default: 2048 tokens x V=32000 -> 250 MiB of fp32 logits per step, small enough to finish in
# well under 2 minutes on 2 cores with both compiles.
CPU_SHAPE = dict(vocab=32000, hidden=128, layers=2, heads=4, batch=8, seq=256, dtype=torch.float32)
# GPU default: Llama-3's vocabulary; 8 x 2048 tokens -> 3.9 GiB of bf16 logits.
GPU_SHAPE = dict(vocab=128256, hidden=1024, layers=2, heads=8, batch=8, seq=2048, dtype=torch.bfloat16)
LOSS_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


# ---------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------
class TinyCausalLM(nn.Module):
    """Used when transformers is not installed: embedding, a GELU MLP block per layer, lm_head,
    and HF's loss spelling (``.float()``, pad-shifted labels, ``F.cross_entropy``)."""

    def __init__(self, vocab, hidden, layers, **_):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = x + block(x)
        logits = self.lm_head(self.norm(x)).float()
        shift = F.pad(labels, (0, 1), value=-100)[..., 1:]
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), shift.reshape(-1), ignore_index=-100)


def build_model(shape: dict, device: str, use_hf: bool):
    torch.manual_seed(0)
    if use_hf:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=4 * shape["hidden"],
            num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
            num_key_value_heads=shape["heads"], max_position_embeddings=shape["seq"],
        )
        model = LlamaForCausalLM(cfg)
        name = (f"transformers LlamaForCausalLM (vocab {shape['vocab']}, hidden {shape['hidden']}, "
                f"{shape['layers']} layers, random weights)")

        def loss_of(m, batch):
            return m(**batch).loss
    else:
        model = TinyCausalLM(**shape)
        name = f"built-in TinyCausalLM (vocab {shape['vocab']}, hidden {shape['hidden']}, {shape['layers']} layers)"

        def loss_of(m, batch):
            return m(batch["input_ids"], batch["labels"])
    return model.to(device=device, dtype=shape["dtype"]), loss_of, name


def batches(shape: dict, device: str, steps: int):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=g)
        labels = ids.clone()
        labels[:, : round(shape.get("prompt", 1 / 8) * shape["seq"])] = -100  # a prompt whose tokens carry no loss
        yield {"input_ids": ids.to(device), "labels": labels.to(device)}


# ---------------------------------------------------------------------------------------------
# measuring
# ---------------------------------------------------------------------------------------------
class PeakMemory:
    """Peak bytes above the level at entry: CUDA allocator stats, or VmHWM/VmRSS on Linux CPU."""

    def __init__(self, device: str):
        self.device = device
        self.peak = 0

    def _rss(self, field_name):
        with open("/proc/self/status") as f:
            return int(re.search(rf"{field_name}:\s+(\d+)", f.read()).group(1)) * 1024

    def __enter__(self):
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.start = self._rss("VmRSS")
        return self

    def __exit__(self, *exc):
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.start
        else:
            self.peak = self._rss("VmHWM") - self.start


@dataclass
class Run:
    backend: str
    losses: list = field(default_factory=list)
    step_s: list = field(default_factory=list)
    peak_bytes: list = field(default_factory=list)


def progress(iterable, total, desc):
    try:
        from tqdm import tqdm

        return tqdm(iterable, total=total, desc=desc, leave=False, file=sys.stderr)
    except ImportError:
        print(f"{desc} ...", file=sys.stderr)
        return iterable


def train(backend: str, base_model, loss_of, shape, device, steps) -> Run:
    model = copy.deepcopy(base_model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    torch._dynamo.reset()
    compiled = torch.compile(lambda batch: loss_of(model, batch), backend=backend)
    run = Run(backend)
    for i, batch in progress(enumerate(batches(shape, device, steps)), steps, f"{backend:>13}: compile + train"):
        loss, seconds, peak = timed_step(compiled, batch, opt, device)
        run.step_s.append(seconds)
        if i > 0:  # the first step compiles and allocates the gradients: not counted
            run.peak_bytes.append(peak)
        run.losses.append(loss)
    return run


def timed_step(compiled_loss, batch, opt, device) -> tuple[float, float, int]:
    """One training step: (loss, seconds, peak bytes above the level at its start)."""
    with PeakMemory(device) as mem:
        t0 = time.perf_counter()
        loss = compiled_loss(batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    return loss.item(), seconds, mem.peak


# ---------------------------------------------------------------------------------------------
# showing
# ---------------------------------------------------------------------------------------------
def show_pass(base_model, loss_of, shape, device):
    import inductor_xent
    from inductor_xent import patterns

    batch = next(batches(shape, device, 1))
    model = copy.deepcopy(base_model)
    fn = lambda b: loss_of(model, b)  # noqa: E731
    report = inductor_xent.explain(fn, batch)
    print(report)

    graphs = {}

    def capture(gm, example_inputs):  # the Dynamo graph, before and after our pass
        if not graphs:
            graphs["before"] = gm.code
            patterns.run(gm)
            graphs["after"] = gm.code
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=capture)(batch)
    torch._dynamo.reset()
    print("\nFX graph around the site, before the pass (abridged):")
    print(_abridge(graphs["before"]))
    print("\nafter the pass:")
    print(_abridge(graphs["after"]))
    return report


def _abridge(code: str, keep: int = 12) -> str:
    """The graph's tail from the lm_head matmul (before) or our op's inputs (after) to the return,
    without FX's ``;  x = None`` bookkeeping."""
    lines = [re.sub(r";\s+\w+( = \w+)* = None$", "", ln.rstrip()) for ln in code.splitlines()]
    lines = [ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    anchors = [i for i, ln in enumerate(lines) if "torch._C._nn.linear" in ln or "inductor_xent" in ln]
    start = anchors[-1] if anchors else max(0, len(lines) - keep)
    start = max(0, min(start, len(lines) - keep))
    return "\n".join(lines[start:])


def _mib(b):
    return f"{b / 2**20:,.0f} MiB"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m inductor_xent demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--model", choices=["auto", "hf", "tiny"], default="auto",
                   help="hf: transformers' Llama from a config (random weights); tiny: built-in")
    args = p.parse_args(argv)

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but torch sees no CUDA device")
    if args.steps < 2:
        p.error("--steps must be at least 2 (the first step compiles)")
    use_hf = args.model == "hf"
    if args.model == "auto":
        try:
            import transformers  # noqa: F401

            use_hf = True
        except ImportError:
            use_hf = False
    shape = dict(GPU_SHAPE if device == "cuda" else CPU_SHAPE)
    base_model, loss_of, name = build_model(shape, device, use_hf)
    tokens = shape["batch"] * shape["seq"]
    logits_bytes = tokens * shape["vocab"] * 4
    print(f"inductor_xent demo: {name} on {device}, {shape['dtype']}; {args.steps} SGD steps of "
          f"{shape['batch']} x {shape['seq']} tokens; fp32 logits would be {_mib(logits_bytes)} a step; "
          f"torch {torch.__version__}\n")

    show_pass(base_model, loss_of, shape, device)
    runs = [train(b, base_model, loss_of, shape, device, args.steps) for b in ("inductor", "inductor_xent")]

    ref, ours = runs
    rtol = LOSS_RTOL[shape["dtype"]]
    print(f"\n\n{'step':>4} | {'loss (inductor)':>15} | {'loss (inductor_xent)':>20} | {'rel. diff':>9}")
    worst = 0.0
    for i, (a, b) in enumerate(zip(ref.losses, ours.losses)):
        diff = abs(a - b) / max(abs(a), 1e-12)
        worst = max(worst, diff)
        print(f"{i:>4} | {a:>15.6f} | {b:>20.6f} | {diff:>9.2e}")
    print(f"\n{'backend':>13} | {'peak memory / step':>18} | {'step time (median, after compile)':>33} "
          "| first step (compile)")
    for r in runs:
        print(f"{r.backend:>13} | {_mib(max(r.peak_bytes)):>18} | {statistics.median(r.step_s[1:]) * 1e3:>30.0f} ms"
              f" | {r.step_s[0]:.1f} s")
    saved = max(ref.peak_bytes) - max(ours.peak_bytes)
    what = "CUDA allocator peak" if device == "cuda" else "peak resident set growth (VmHWM)"
    print(f"\nmemory saved per step: {_mib(saved)} ({what}); losses agree to {worst:.1e} (tolerance {rtol:g})")
    if not worst <= rtol:
        print(f"FAIL: the losses diverge by {worst:.2e} > {rtol:g}", file=sys.stderr)
        return 1
    return 0
