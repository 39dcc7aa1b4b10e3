"""Compile kernels for sm_90 on this (CPU) machine and check their shared memory against the H100/H200.

    python3 benchmarks/sm90_check.py

A Triton kernel whose pipelined stages and epilogue ask more shared memory than the GPU has compiles
fine and fails only at its first launch (``OutOfResources``): the third session's rows_mm with an fp32
output asked 278552 bytes against 232448 and 43 GPU tests failed a session later. ``triton.compile``
with a ``GPUTarget`` runs here (the triton wheel ships ptxas), so each launch specialisation that
``templates/`` uses can be checked without a device: this script compiles the ones whose tiles come from
a table (rows_mm's configs for every output dtype, the store forward with every head flag, the log-prob
store's dz kernel) and prints the shared memory each asks, failing (exit 1) on any above the limit.
TMA operands are passed as ``tensordesc<...>`` types; strides of 1 as constexprs (as a launch
specialises them). About a minute on 2 cores. Run it without TRITON_INTERPRET (the tables' GPU configs).
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from inductor_xent.templates import configs, rows  # noqa: E402
from inductor_xent.templates.store import lce_logprob_dz_kernel, lce_store_fwd_kernel  # noqa: E402

SHARED_LIMIT = 232448  # bytes per block on sm_90 (H100, H200): what the launch checks against
TARGET = GPUTarget("cuda", 90, 32)


def shared_bytes(fn, types: dict, const: dict, num_warps: int, num_stages: int) -> int:
    """Shared memory the sm_90 build of ``fn`` asks, with ``types`` for its runtime arguments (int32
    where not given) and ``const`` its constexprs."""
    sig = {name: "constexpr" if name in const else types.get(name, "i32")
           for name in inspect.signature(fn.fn).parameters}
    kernel = triton.compile(ASTSource(fn, sig, const), target=TARGET,
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    return kernel.metadata.shared


def rows_mm_cases():
    for name, cfg, out in (("16-bit -> 16-bit", rows.ROWS_MM_CONFIG[2], "bf16"),
                           ("16-bit -> fp32 (accumulator)", rows.ROWS_MM_FP32_OUT, "fp32")):
        for trans_a in (False, True):
            a_block = [cfg.block_k, cfg.block_m] if trans_a else [cfg.block_m, cfg.block_k]
            types = {"out_ptr": f"*{out}", "a_ptr": f"tensordesc<bf16{a_block}>".replace(" ", ""),
                     "b_ptr": f"tensordesc<bf16[{cfg.block_k},{cfg.block_n}]>", "count_ptr": "*i32",
                     "out_rows_ptr": "*i64"}
            const = dict(stride_o_n=1, stride_a_1=1, stride_b_n=1, BOUND_M=not trans_a, TRANS_A=trans_a,
                         ACCUMULATE=True, HAS_OUT_ROWS=not trans_a, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                         BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, INPUT_PRECISION="tf32",
                         NUM_STAGES=cfg.num_stages, DOT_UPCAST=False, USE_TMA=True, NUM_PROGRAMS=132, FLATTEN=True)
            yield (f"rows_mm {name}, {'dzᵀ·h' if trans_a else 'dz·W'}", rows.rows_mm_kernel, types, const,
                   cfg.num_warps, cfg.num_stages)


def store_forward_cases():
    cfg = configs.store_config(torch.bfloat16)
    types = {"hidden_ptr": f"tensordesc<bf16[{cfg.block_m},{cfg.block_k}]>",
             "weight_ptr": f"tensordesc<bf16[{cfg.block_n},{cfg.block_k}]>", "bias_ptr": "*bf16",
             "target_ptr": "*i64", "part_ptr": "*fp32", "arg_ptr": "*i32", "e_ptr": "*fp16", "logits_ptr": "*bf16",
             "count_ptr": "*i32", "logit_scale": "fp32", "softcap": "fp32"}
    for label, heads in (("loss", dict(NEED_ENTROPY=False, NEED_ARGMAX=False, E_SECH2=True, HAS_SOFTCAP=False)),
                         ("log-probs, entropy, argmax, softcap",
                          dict(NEED_ENTROPY=True, NEED_ARGMAX=True, E_SECH2=False, HAS_SOFTCAP=True))):
        const = dict(stride_h_d=1, stride_w_d=1, HAS_BIAS=True, NEED_SUM_Z=False, BLOCK_M=cfg.block_m,
                     BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, EVEN_K=True,
                     INPUT_PRECISION="tf32", NUM_STAGES=cfg.num_stages, DOT_UPCAST=False, USE_TMA=True,
                     NUM_PROGRAMS=132, FLATTEN=True, HAS_SCALE=True, EVEN_M=False, EVEN_V=False,
                     WRITE_LOGITS=False, HAS_COUNT=True, **heads)
        yield f"store forward ({label})", lce_store_fwd_kernel, types, const, cfg.num_warps, cfg.num_stages


def logprob_dz_cases():
    cfg = configs.store_dz_config(configs.store_config(torch.bfloat16))
    types = {name: "*fp32" for name in ("m_ptr", "st_ptr", "lse_ptr", "lse_lo_ptr", "grad_loss_ptr", "grad_lse_ptr",
                                        "grad_ent_ptr", "ent_ptr", "dbias_ptr")}
    types.update(e_ptr="*fp16", order_ptr="*i64", target_ptr="*i64", dz_ptr="*bf16", count_ptr="*i32",
                 logit_scale="fp32", softcap="fp32")
    const = dict(HAS_SOFTCAP=True, HAS_ENTROPY=True, HAS_ORDER=True, NEED_DBIAS=True, HAS_COUNT=True,
                 COUNT_ALIGN=rows.ROWS_MM_CONFIG[2].block_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                 GROUP_M=cfg.group_m)
    yield "log-prob store dz", lce_logprob_dz_kernel, types, const, cfg.num_warps, 1


def main() -> int:
    over = 0
    for label, fn, types, const, warps, stages in (*rows_mm_cases(), *store_forward_cases(), *logprob_dz_cases()):
        used = shared_bytes(fn, types, const, warps, stages)
        ok = used <= SHARED_LIMIT
        over += not ok
        print(f"{'ok  ' if ok else 'OVER'} {used:>7} / {SHARED_LIMIT} bytes  {label}", flush=True)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
