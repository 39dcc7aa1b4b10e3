"""RL head benchmark: per-token log-probabilities and entropy of an lm_head at a sampling temperature.

    python -m inductor_xent bench rl [--shapes qwen2.5-7b] [--data gauss] [--methods ours,compile,...]
        [--temperature 0.7] [--prompt 0.5] [--out DIR] [--quick] [--device cuda|cpu]

The spelling timed is what verl / TRL / OpenRLHF compute from a model's logits::

    logp = F.log_softmax(F.linear(h, w).float() / T, -1)
    log_probs = torch.gather(logp, -1, ids[:, None])[:, 0]
    entropy = -(logp.exp() * logp).sum(-1)

Methods: ``cublas`` the GEMMs alone (one for the forward: the floor; three for forward+backward:
what keeping the logits costs); ``eager`` the spelling; ``compile`` it under torch.compile
(Inductor); ``ours`` ``inductor_xent.linear_log_probs(..., temperature=T, entropy=...)`` (strategy
auto: store, keeping the exp-logits, from D = 2048 up; issue 24), ``ours_recompute`` the same with
``strategy="recompute"``; ``ours_dense`` ``ours`` with ``INDUCTOR_XENT_SKIP_IGNORED=0`` around the
forward call (with ``--prompt``: the forward computes the prompt rows; the A/B of issue 24's skipping);
``ours_compiled`` the spelling under ``torch.compile(backend="inductor_xent")``, timed only where
the pass fused it (``inductor_xent.explain`` before, the pass counters on the compiling call);
``ours_masked`` the spelling with its outputs multiplied by the rows' mask (``log_probs * keep``,
``entropy * keep``: a loss's masking, with ``--prompt`` the prompt rows 0) under
``torch.compile(backend="inductor_xent")``: the pass finds that every use passes the mask and skips
the masked rows (patterns/_masked.py), with no ignore_index anywhere (issue 24's RL pass sites);
``cce`` cut-cross-entropy's ``linear_cross_entropy(h / T, w, ids, reduction="none")`` negated (no
temperature argument: the hidden states are divided by T in bf16, one more rounding; no entropy);
``liger`` Liger-Kernel's ``_ChunkedSelectiveLogProbFunction`` (the log-prob head inside its
GRPO/PPO losses; private; plain PyTorch over 2048-row × 4096-column chunks; no entropy anywhere in
Liger 0.8.5's Triton path); ``liger_cute`` Liger-Kernel's CuTe-DSL SM90 fused scaled cross-entropy
(``LigerFusedScaledCrossEntropySM90Function``: per-token NLL at a temperature, optionally the
entropy; no logits kept, the backward recomputes them; Hopper and bf16 only, its wheels as
gpu_run.sh brings them).

Variants: ``fwd lp`` / ``fwd lp+ent``: the forward under ``torch.no_grad()`` (old- and
reference-policy log-probs in an RL step), log-probs alone or with the entropy; ``fwd+bwd lp`` /
``fwd+bwd lp+ent``: the forward and ``torch.autograd.grad`` w.r.t. hidden and weight with random
N(0, 1) upstream gradients on log_probs (and entropy).

Accounting: time is the median of ``triton.testing.do_bench`` after warm-up (bench_kernels.bench_ms;
L2 flushed; the inputs are far larger than L2). Extra MiB: the peak allocation during one call
minus the allocation before it, minus the two gradient buffers. Errors: ‖x − ref‖/‖ref‖ against the
same spelling in fp32 (fp32 matmul, TF32 off) on the same bf16 inputs, computed ``--ref-rows``
rows at a time (the gradients are linear in the upstream gradients, so one pass gives the
references of both the lp and the lp+ent backward). Targets: log-probs forward ≤ 1.10× the
cuBLAS logits GEMM (issue 10); log-probs+entropy forward+backward ≤ 1.0× torch.compile's time of
the same spelling with ≤ 25 % of its extra memory where the store strategy runs (``ours``,
``ours_compiled``: issue 24), ≤ 5 % for ``ours_recompute`` (issue 10). All ids are real tokens (the RL spelling has no
ignore_index: masks apply downstream), so make_data's ignored rows get a neighbour's id.

``--prompt F``: the first F of each 1024-row sequence is a prompt (shapes.ignore_rows), as in an RL
or GKD batch whose loss masks the prompt: every method gets a zero upstream gradient there, and the
functional API methods (``ours``, ``ours_recompute``, ``ours_dense``) get those rows' ids as
``ignore_index`` (-100), so that they need not compute them (log-probs and entropy 0 there); the
others compute every row, as the spelling does. The log-prob and entropy errors are over the other
rows.

``--device cpu`` is a dry run of the same code paths on tiny shapes (``--shapes 96x64x1031``):
perf_counter medians, no memory figures; it checks the harness, not the speed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk  # noqa: E402
from shapes import DATA, IGNORE_INDEX, ignore_rows, make_data, shape_of  # noqa: E402

# in the order they run: a step cut short by its timeout still has the main rows
METHODS = ("cublas", "ours", "compile", "ours_recompute", "eager", "ours_compiled", "cce", "liger", "liger_cute",
           "ours_dense", "ours_masked")
COMPILED_OURS = ("ours_compiled", "ours_masked")  # timed only where the pass fused (fused_call)
API_METHODS = ("ours", "ours_recompute", "ours_dense")  # given ignore_index on the prompt rows (--prompt)
VARIANTS = ("fwd_lp", "fwd_lpe", "fwdbwd_lp", "fwdbwd_lpe")
LABELS = {"fwd_lp": "fwd lp", "fwd_lpe": "fwd lp+ent", "fwdbwd_lp": "fwd+bwd lp", "fwdbwd_lpe": "fwd+bwd lp+ent"}
NO_ENTROPY = {"cce": "cut-cross-entropy has no entropy", "liger": "Liger-Kernel 0.8.5's Triton path has no entropy"}
FWD_VS_CUBLAS = 1.10  # targets: log-probs forward / cuBLAS logits GEMM
BWD_VS_COMPILE = 1.0  # lp+ent fwd+bwd / torch.compile's time
# extra memory / torch.compile's: issue 10's 5 % for the recompute strategy; issue 24's 25 % where the
# log-prob op's store keeps the exp-logits (ours and ours_compiled: auto takes store from D = 2048 up)
MEM_VS_COMPILE = {"ours": 0.25, "ours_compiled": 0.25, "ours_masked": 0.25, "ours_recompute": 0.05}
T = 0.7  # the sampling temperature of the spelling; --temperature sets it before anything is compiled
MiB = bk.MiB


# ---------------------------------------------------------------------------------------------
# the spelling, and each method's (log-probs fn, log-probs+entropy fn): fn(h, w, ids)
# ---------------------------------------------------------------------------------------------
def log_probs(h, w, ids):
    logp = F.log_softmax(F.linear(h, w).float() / T, -1)
    return torch.gather(logp, -1, ids[:, None])[:, 0]


def log_probs_entropy(h, w, ids):
    logp = F.log_softmax(F.linear(h, w).float() / T, -1)
    return torch.gather(logp, -1, ids[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


# one code object per compiled method: Dynamo caches graphs per code object
def _lp_inductor(h, w, ids):
    return log_probs(h, w, ids)


def _lpe_inductor(h, w, ids):
    return log_probs_entropy(h, w, ids)


def _lp_xent(h, w, ids):
    return log_probs(h, w, ids)


def _lpe_xent(h, w, ids):
    return log_probs_entropy(h, w, ids)


def _lp_masked(h, w, ids, keep):
    return log_probs(h, w, ids) * keep


def _lpe_masked(h, w, ids, keep):
    lp, ent = log_probs_entropy(h, w, ids)
    return lp * keep, ent * keep


def build(name, keep=None):
    """(log-probs fn, log-probs+entropy fn or None) of a method; compiled ones with dynamic=False
    (one graph per shape and grad mode, as an RL step reuses them). ``keep``: the rows' mask
    (``ours_masked``)."""
    if name == "ours_masked":
        import inductor_xent  # noqa: F401  (registers the backend from a source tree)

        lp, lpe = (torch.compile(f, backend="inductor_xent", dynamic=False) for f in (_lp_masked, _lpe_masked))
        return lambda h, w, ids: lp(h, w, ids, keep), lambda h, w, ids: lpe(h, w, ids, keep)
    if name == "eager":
        return log_probs, log_probs_entropy
    if name == "compile":
        return torch.compile(_lp_inductor, dynamic=False), torch.compile(_lpe_inductor, dynamic=False)
    if name == "ours_compiled":
        import inductor_xent  # noqa: F401  (registers the backend from a source tree)

        return (torch.compile(_lp_xent, backend="inductor_xent", dynamic=False),
                torch.compile(_lpe_xent, backend="inductor_xent", dynamic=False))
    if name in API_METHODS:
        from inductor_xent import linear_log_probs

        strategy = "recompute" if name == "ours_recompute" else None  # ours: auto (store from D = 2048)

        def call(h, w, ids, entropy):
            if name != "ours_dense":
                return linear_log_probs(h, w, ids, temperature=T, entropy=entropy, strategy=strategy)
            os.environ["INDUCTOR_XENT_SKIP_IGNORED"] = "0"  # read at call time (config.skip_ignored_rows)
            try:
                return linear_log_probs(h, w, ids, temperature=T, entropy=entropy, strategy=strategy)
            finally:
                del os.environ["INDUCTOR_XENT_SKIP_IGNORED"]

        def lpe(h, w, ids):
            out = call(h, w, ids, True)
            return out.log_probs, out.entropy

        return lambda h, w, ids: call(h, w, ids, False).log_probs, lpe
    if name == "cce":
        from cut_cross_entropy import linear_cross_entropy

        return lambda h, w, ids: -linear_cross_entropy(h / T, w, ids, reduction="none"), None
    if name == "liger":
        from liger_kernel.chunked_loss.fused_linear_ppo import (
            _SELECTIVE_LOGPROB_VOCAB_CHUNK_SIZE,
            _ChunkedSelectiveLogProbFunction,
        )

        return (lambda h, w, ids: _ChunkedSelectiveLogProbFunction.apply(
            h, w, ids, None, T, _SELECTIVE_LOGPROB_VOCAB_CHUNK_SIZE), None)
    if name == "liger_cute":
        from liger_kernel.ops.cutedsl.ops.fused_scaled_cross_entropy_sm90 import (
            LigerFusedScaledCrossEntropySM90Function as scaled_ce,
        )

        def lpe(h, w, ids):
            nll, ent = scaled_ce.apply(h, w, ids, T, IGNORE_INDEX, 1, True)
            return -nll, ent

        return lambda h, w, ids: -scaled_ce.apply(h, w, ids, T, IGNORE_INDEX), lpe
    raise ValueError(f"unknown method {name!r}; choose from {METHODS}")


def rl_data(shape, data, device):
    """make_data's inputs with every id a real token (its ignored rows take the previous row's id)."""
    h, w, ids = make_data(shape, data, device=device)
    return h, w, torch.where(ids == IGNORE_INDEX, ids.roll(1), ids)


def upstream(n, device, seed=1):
    """Random N(0, 1) incoming gradients of (log_probs, entropy), fp32."""
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(n, device=device, generator=g), torch.randn(n, device=device, generator=g)


def reference(h, w, ids, up, rows):
    """The spelling in fp32 (TF32 off) on the bf16 inputs, ``rows`` rows at a time: log_probs,
    entropy, and grad_hidden / grad_weight for the lp backward (upstream ``up[0]`` on log_probs)
    and the lp+ent backward (``up`` on both), as {"lp", "ent", "dh_lp", "dw_lp", "dh_lpe", "dw_lpe"}."""
    from inductor_xent import compat

    with compat.ieee_fp32_matmuls():  # TF32 off, by the API that reads back
        w32 = w.float().requires_grad_()
        ref = {"lp": [], "ent": [], "dh_lp": [], "dh_ent": []}
        dw_lp, dw_ent = torch.zeros_like(w32), torch.zeros_like(w32)
        for start in range(0, h.shape[0], rows):
            sl = slice(start, start + rows)
            hc = h[sl].float().requires_grad_()
            lp, ent = log_probs_entropy(hc, w32, ids[sl])
            gh, gw = torch.autograd.grad(lp, (hc, w32), up[0][sl], retain_graph=True)
            ref["dh_lp"].append(gh)
            dw_lp += gw
            gh, gw = torch.autograd.grad(ent, (hc, w32), up[1][sl])
            ref["dh_ent"].append(gh)
            dw_ent += gw
            ref["lp"].append(lp.detach())
            ref["ent"].append(ent.detach())
            del lp, ent, gh, gw
        ref = {k: torch.cat(v) for k, v in ref.items()}
        ref["dw_lp"], ref["dw_lpe"] = dw_lp, dw_lp + dw_ent
        ref["dh_lpe"] = ref["dh_lp"] + ref.pop("dh_ent")
        return ref


# ---------------------------------------------------------------------------------------------
# measuring
# ---------------------------------------------------------------------------------------------
class Rig:
    """Timing and memory on the device: bench_kernels' helpers on CUDA; on the CPU (dry runs) a
    perf_counter median and no memory figure."""

    def __init__(self, device, quick):
        self.device, self.quick = device, quick

    def ms(self, fn, long=False):
        if self.device == "cuda":
            return bk.bench_ms(fn, self.quick, long)
        fn()
        times = []
        for _ in range(2 if self.quick else 5):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    def peak(self, fn):
        """(fn's result, extra peak MiB or None)."""
        return bk.extra_peak_mib(fn) if self.device == "cuda" else (fn(), None)

    def free(self):
        if self.device == "cuda":
            torch.cuda.empty_cache()


def runner(fns, variant, h, w, ids, up):
    """A function running ``variant`` once: (log_probs, entropy or None, grad_hidden or None,
    grad_weight or None); None when the method lacks the spelling (no entropy)."""
    entropy, grad = variant.endswith("lpe"), variant.startswith("fwdbwd")
    fn = fns[entropy]
    if fn is None:
        return None
    if not grad:
        def run():
            with torch.no_grad():
                out = fn(h, w, ids)
            return (*out, None, None) if entropy else (out, None, None, None)
        return run
    hr, wr = h.detach().requires_grad_(), w.detach().requires_grad_()

    def run():
        out = fn(hr, wr, ids)
        outs, grads = (out, up) if entropy else ((out,), up[:1])
        gh, gw = torch.autograd.grad(outs, (hr, wr), grads)
        return outs[0].detach(), outs[1].detach() if entropy else None, gh, gw
    return run


def errors(res, ref, variant, keep):
    """Relative errors against the fp32 reference; log-probs and entropy over the ``keep`` rows (the
    API methods' prompt rows are 0)."""
    lp, ent, gh, gw = res
    which = "lpe" if variant.endswith("lpe") else "lp"
    err = {"err_lp": bk.rel_err(lp[keep], ref["lp"][keep])}
    if ent is not None:
        err["err_ent"] = bk.rel_err(ent[keep], ref["ent"][keep])
    if gh is not None:
        err["err_dh"] = bk.rel_err(gh, ref[f"dh_{which}"])
        err["err_dw"] = bk.rel_err(gw, ref[f"dw_{which}"])
    return err


def fused_call(run):
    """``run()`` for ``ours_compiled``: (its result, None when the pass fused a site in the graph the
    call compiled, else why not). explain_spellings reset Dynamo, so each variant's first call
    compiles its graph (grad mode is part of the guard)."""
    from torch._dynamo.utils import counters

    fused, graphs = counters["inductor_xent"]["sites_fused"], counters["stats"]["unique_graphs"]
    res = run()
    if counters["stats"]["unique_graphs"] == graphs:
        return res, "not checked: the call compiled no graph"
    if counters["inductor_xent"]["sites_fused"] == fused:
        return res, "not fused: the compiled graph kept the logits (pass counters)"
    return res, None


def explain_spellings(h, w, ids):
    """{entropy: None when the pass fuses the spelling (or explain failed: the pass counters then
    decide), else why not}, from inductor_xent.explain on the real inputs under no_grad (it runs the
    spelling once eagerly and resets Dynamo). Saves compiling graphs that would not be timed."""
    import inductor_xent

    verdict = {}
    for entropy, fn in ((False, log_probs), (True, log_probs_entropy)):
        try:
            with torch.no_grad():
                report = inductor_xent.explain(fn, h, w, ids)
        except Exception:  # e.g. out of memory running the spelling eagerly
            traceback.print_exc(limit=2)
            verdict[entropy] = None
            continue
        if report.fused_count:
            verdict[entropy] = None
        else:
            reasons = "; ".join(s.reason for s in report.sites) or "no lm_head -> log_softmax site found"
            verdict[entropy] = f"not fused: {reasons}"
    return verdict


def measure(name, fns, h, w, ids, up, ref, rig, keep):
    """{variant: {ms, mib, err_*} or {status}} for one method."""
    declined = explain_spellings(h, w, ids) if name == "ours_compiled" else {}
    out = {}
    for variant in VARIANTS:
        run = runner(fns, variant, h, w, ids, up)
        if run is None:
            out[variant] = {"status": "no entropy"}
            continue
        entropy = variant.endswith("lpe")
        if declined.get(entropy):
            out[variant] = {"status": declined[entropy]}
            continue
        grad = variant.startswith("fwdbwd")
        try:
            if name in COMPILED_OURS:
                res, why = fused_call(run)
                if why:
                    out[variant] = {"status": why}
                    continue
            else:
                res = run()  # compiles, if it does
            row = errors(res, ref, variant, keep)
            del res
            res, mib = rig.peak(run)
            if mib is not None and grad:
                mib -= (res[2].nbytes + res[3].nbytes) / MiB
            row["mib"] = mib
            del res
            row["ms"] = rig.ms(run, long=grad)
            out[variant] = row
        except Exception as exc:  # a failing method must not stop the others
            if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
                out[variant] = {"status": "OOM"}  # also when a compiler wrapped it in its own error
            else:
                out[variant] = {"status": f"error: {type(exc).__name__}: {exc}".replace("\n", " ")[:300]}
                traceback.print_exc(limit=3)
        rig.free()
    return out


def measure_cublas(h, w, rig):
    """The GEMMs alone, in the variants' places: one GEMM for the forwards, three for fwd+bwd."""
    fwd = rig.ms(lambda: h @ w.t())
    bwd = rig.ms(lambda: bk.gemms_fwd_bwd(h, w), long=True)
    return {v: {"ms": bwd if v.startswith("fwdbwd") else fwd} for v in VARIANTS}


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def _cell(v, key, spec):
    if "status" in v:
        return "OOM" if v["status"] == "OOM" else v["status"].split(":")[0]
    return bk.fmt(v.get(key), spec)


def main_variant(row):
    """The variant whose errors the table shows: lp+ent fwd+bwd, or lp fwd+bwd for the peers."""
    return "fwdbwd_lpe" if "ms" in row["variants"].get("fwdbwd_lpe", {}) else "fwdbwd_lp"


def markdown(rows, info):
    lines = [
        f"{info['gpu']}, torch {info['torch']}, triton {info['triton']}, liger-kernel {info['liger_kernel']}, "
        f"cut-cross-entropy {info['cut_cross_entropy']}, {info['date']}; bf16, T = {info['temperature']}; "
        + (f"prompt {info['prompt']:.0%} of each sequence (no upstream gradient; ignore_index for the API "
           "methods); " if info.get("prompt") else "") +
        "median ms; extra MiB beyond the inputs and the gradients; errors vs the spelling in fp32 (TF32 off) "
        "of the lp+ent fwd+bwd (peers: lp fwd+bwd).",
        "",
        "| shape | data | method | " + " | ".join(f"{LABELS[v]} ms" for v in VARIANTS)
        + " | fwd lp+ent MiB | fwd+bwd lp MiB | fwd+bwd lp+ent MiB | err lp | err ent | err dH | err dW | note |",
        "|---" * 15 + "|",
    ]
    for r in rows:
        vs = r["variants"]
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['data']} | {r['method']} | failed: {r['error'][:100]} |" + " |" * 11)
            continue
        main = vs[main_variant(r)]
        notes = sorted({v["status"] for v in vs.values() if "status" in v and len(v["status"]) > 12})
        if r["method"] in NO_ENTROPY:
            notes.insert(0, NO_ENTROPY[r["method"]])
        if r["method"] == "cublas":
            notes.insert(0, "GEMMs alone: 1 (fwd), 3 (fwd+bwd)")
        lines.append(
            f"| {r['shape']} | {r['data']} | {r['method']} | "
            + " | ".join(_cell(vs[v], "ms", ".2f") for v in VARIANTS) + " | "
            + " | ".join(_cell(vs[v], "mib", ".0f") for v in ("fwd_lpe", "fwdbwd_lp", "fwdbwd_lpe")) + " | "
            + " | ".join(bk.fmt(main.get(k), ".1e") for k in ("err_lp", "err_ent", "err_dh", "err_dw"))
            + f" | {'; '.join(notes)} |")
    return "\n".join(lines)


def _get(rows, shape, data, method, variant, key):
    r = next((r for r in rows if (r["shape"], r["data"], r["method"]) == (shape, data, method)), None)
    return None if r is None else r.get("variants", {}).get(variant, {}).get(key)


def targets(rows):
    """The issues' two targets per shape and data set, for ``ours``, ``ours_recompute``, ``ours_compiled`` and
    ``ours_masked``:
    [{"shape", "data", "method", "target", "verdict": met | missed | n/a, "detail"}]."""
    out = []
    for shape, data in dict.fromkeys((r["shape"], r["data"]) for r in rows):
        floor = _get(rows, shape, data, "cublas", "fwd_lp", "ms")
        c_ms, c_mib = (_get(rows, shape, data, "compile", "fwdbwd_lpe", k) for k in ("ms", "mib"))
        for method in MEM_VS_COMPILE:
            if not any(r["method"] == method and (r["shape"], r["data"]) == (shape, data) for r in rows):
                continue
            ms = _get(rows, shape, data, method, "fwd_lp", "ms")
            goal = f"log-probs forward <= {FWD_VS_CUBLAS:.2f}x cuBLAS logits GEMM"
            if ms is None or floor is None:
                why = _get(rows, shape, data, method, "fwd_lp", "status") or "cublas not measured"
                out.append(dict(shape=shape, data=data, method=method, target=goal, verdict="n/a", detail=why))
            else:
                out.append(dict(shape=shape, data=data, method=method, target=goal,
                                verdict="met" if ms <= FWD_VS_CUBLAS * floor else "missed",
                                detail=f"{ms:.2f} ms / {floor:.2f} ms = {ms / floor:.3f}x"))
            ms, mib = (_get(rows, shape, data, method, "fwdbwd_lpe", k) for k in ("ms", "mib"))
            goal = (f"log-probs+entropy fwd+bwd <= {BWD_VS_COMPILE:.1f}x torch.compile, "
                    f"extra memory <= {MEM_VS_COMPILE[method]:.0%} of its")
            if ms is None or c_ms is None:
                why = (_get(rows, shape, data, method, "fwdbwd_lpe", "status")
                       or f"compile: {_get(rows, shape, data, 'compile', 'fwdbwd_lpe', 'status') or 'not measured'}")
                out.append(dict(shape=shape, data=data, method=method, target=goal, verdict="n/a", detail=why))
                continue
            time_ok = ms <= BWD_VS_COMPILE * c_ms
            detail = f"{ms:.2f} ms / {c_ms:.2f} ms = {ms / c_ms:.3f}x"
            if mib is None or c_mib is None:
                verdict, detail = ("missed" if not time_ok else "n/a"), detail + "; memory not measured"
            else:
                mem_ok = mib <= MEM_VS_COMPILE[method] * max(c_mib, 0.0)
                verdict = "met" if time_ok and mem_ok else "missed"
                detail += f"; {mib:.0f} MiB / {c_mib:.0f} MiB = {mib / max(c_mib, 1e-9):.1%}"
            out.append(dict(shape=shape, data=data, method=method, target=goal, verdict=verdict, detail=detail))
    return out


def plot(rows, info, path):
    """Time against extra memory per method: forward (no_grad) and forward+backward panels for each
    shape and data set; filled markers lp+ent, hollow lp only; cuBLAS's time as a dashed line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    groups = list(dict.fromkeys((r["shape"], r["data"]) for r in rows))
    if not groups:
        return False
    mib_measured = any(v.get("mib") is not None for r in rows for v in r.get("variants", {}).values())
    fig, axes = plt.subplots(len(groups), 2, figsize=(12, 4.8 * len(groups)), squeeze=False)
    for (shape, data), pair in zip(groups, axes):
        for ax, kind, title in zip(pair, ("fwd", "fwdbwd"), ("forward (no_grad)", "forward + backward")):
            floor = _get(rows, shape, data, "cublas", f"{kind}_lp", "ms")
            if floor is not None:
                ax.axhline(floor, color="gray", ls="--", lw=1,
                           label="cuBLAS " + ("logits GEMM" if kind == "fwd" else "3 GEMMs"))
            for i, method in enumerate(METHODS[1:]):
                color = plt.cm.tab10(i)
                for variant, filled in ((f"{kind}_lpe", True), (f"{kind}_lp", False)):
                    ms = _get(rows, shape, data, method, variant, "ms")
                    if ms is None:
                        continue
                    mib = _get(rows, shape, data, method, variant, "mib")
                    x = max(mib if mib is not None else 1.0, 1.0)
                    ax.scatter([x], [ms], s=50, color=color if filled else "none", edgecolors=color, zorder=3,
                               label=f"{method} {'lp+ent' if filled else 'lp'}")
                    ax.annotate(method, (x, ms), fontsize=7, xytext=(4, 3), textcoords="offset points")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("extra peak MiB (log)" if mib_measured else "extra peak MiB: not measured (CPU)")
            ax.set_ylabel("ms (median, log)")
            ax.set_title(f"{shape} · {data} · {title}", fontsize=10)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"RL head (log-probs, entropy; T = {info['temperature']}) · {info['gpu']} · torch {info['torch']}"
                 f" · triton {info['triton']} · liger {info['liger_kernel']} · cce {info['cut_cross_entropy']}"
                 f" · {info['date']} · bf16", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def version(dist):
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def report(rows, info, out):
    """Write the JSON (rows and the targets); after every row, so a step cut short keeps what it measured."""
    info = info | {"targets": targets(rows)}
    (out / "bench_rl.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    return info


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def main(argv=None):
    global T
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen2.5-7b", help="names from benchmarks/shapes.py, or NxDxV")
    p.add_argument("--data", default="gauss", help=f"from {', '.join(DATA)}")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--temperature", type=float, default=T)
    p.add_argument("--ref-rows", type=int, default=1024, help="rows per chunk of the fp32 reference")
    p.add_argument("--prompt", type=float, default=0.0,
                   help="fraction of each 1024-row sequence that is a prompt (no gradient; ignore_index for ours)")
    p.add_argument("--out", default="out")
    p.add_argument("--quick", action="store_true", help="fewer timed runs")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: a dry run of the code paths on tiny shapes (no memory figures)")
    args = p.parse_args(argv)
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        p.error(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    try:
        shapes = {name: shape_of(name) for name in args.shapes.split(",")}
    except ValueError as exc:
        p.error(str(exc))
    if not 0.0 <= args.prompt < 1.0:
        p.error(f"--prompt must be in [0, 1), got {args.prompt}")
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        p.error(f"--temperature must be a finite number > 0, got {args.temperature}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench rl times GPU kernels (cuBLAS, Triton, torch.compile, the peers) and torch sees no CUDA "
              "device. `--device cpu --shapes 96x64x1031` dry-runs the same code paths on a tiny shape (CPU "
              "times, no memory figures).", file=sys.stderr)
        return 2
    T = args.temperature
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = bk.env_info(args.device) | {"temperature": T, "liger_kernel": version("liger_kernel"),
                                       "cut_cross_entropy": version("cut_cross_entropy"), "quick": args.quick,
                                       "prompt": args.prompt}
    print(json.dumps(info), flush=True)
    rig, rows = Rig(args.device, args.quick), []
    # `timeout` ends a step with SIGTERM: leave through `finally`, which writes what was measured
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        for shape_name, shape in shapes.items():
            for data in args.data.split(","):
                h, w, ids = rl_data(shape, data, args.device)
                up = upstream(shape.n, args.device)
                keep = ignore_rows(ids, args.prompt) != IGNORE_INDEX
                up = tuple(u * keep for u in up)  # the prompt rows' loss is masked: no gradient there
                ids_api = torch.where(keep, ids, IGNORE_INDEX)  # ours: the prompt rows ignored
                ref = reference(h, w, ids, up, args.ref_rows)
                for method in methods:
                    row = {"shape": shape_name, "data": data, "method": method,
                           "n": shape.n, "d": shape.d, "v": shape.v, "variants": {}}
                    try:
                        if method == "cublas":
                            row["variants"] = measure_cublas(h, w, rig)
                        else:
                            row["variants"] = measure(method, build(method, keep), h, w,
                                                      ids_api if method in API_METHODS else ids, up, ref, rig, keep)
                    except Exception as exc:  # import or build failure: the row says so
                        row["error"] = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]
                        traceback.print_exc(limit=2)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                    report(rows, info, out)
                    rig.free()
                del h, w, ids, ids_api, up, ref
                rig.free()
    finally:
        signal.signal(signal.SIGTERM, previous)
        info = report(rows, info, out)
        plot(rows, info, out / "bench_rl.png")
        print(markdown(rows, info))
        for t in info["targets"]:
            print(f"target [{t['shape']} {t['data']} {t['method']}] {t['target']}: {t['verdict'].upper()} "
                  f"({t['detail']})" + (" -- CPU dry run, not a measurement" if args.device == "cpu" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
