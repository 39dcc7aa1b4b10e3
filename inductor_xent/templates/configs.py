"""Named tuning configs of the Triton kernels, and the tables that pick them.

Policy: no ``@triton.autotune`` in the op. Every launch takes a named config from a
table keyed on the dtype class and a bucket of D, so a shape compiles once and the choice is
reproducible; ``benchmarks/bench_kernels.py --sweep`` times the candidates below on the GPU and the
measurement that justified each default is written next to it (and in ``benchmarks/NOTES.md``).
Under ``TRITON_INTERPRET=1`` one tiny config serves every launch (the interpreter is ~10^5x slower).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import config as _config


class KernelConfig(NamedTuple):
    """Tile shape and launch parameters of one matmul-with-epilogue kernel."""

    block_m: int  # rows of hidden per program
    block_n: int  # vocabulary columns per tile
    block_k: int  # reduction (D) step
    group_m: int  # row blocks per L2 group (grouped ordering: the W tiles of a group stay in L2)
    num_warps: int
    num_stages: int  # software-pipelining depth of the D loop
    ctas_per_sm: int = 1  # expected residency, used only to size the vocabulary split
    split_tiles: int = 0  # forward: vocabulary tiles per program; 0 = vocab_split's model
    tma: bool = False  # operands through TMA descriptors where the layout allows (launch._tma_ok)


# ---------------------------------------------------------------------------------------------
# candidates (names are used by the benchmark's --sweep and in NOTES.md)
# ---------------------------------------------------------------------------------------------
CONFIGS: dict[str, KernelConfig] = {
    # the usual best Triton bf16 GEMM tile on Hopper: 128x256 fp32 accumulator over 2 warpgroups,
    # 48 KiB of shared memory per stage
    "m128n256k64w8s3": KernelConfig(128, 256, 64, 8, 8, 3),
    "m128n256k64w8s4": KernelConfig(128, 256, 64, 8, 8, 4),
    # one vocabulary tile per program (a plain GEMM schedule; partials N x V/256 x 12 bytes) or a few
    "m128n256k64w8s3t1": KernelConfig(128, 256, 64, 8, 8, 3, split_tiles=1),
    "m128n256k64w8s3t4": KernelConfig(128, 256, 64, 8, 8, 3, split_tiles=4),
    "m256n128k64w8s3t1": KernelConfig(256, 128, 64, 8, 8, 3, split_tiles=1),
    # the same tiles with TMA (bulk tensor copies) instead of per-thread cp.async pointer loads
    "m128n256k64w8s3tma": KernelConfig(128, 256, 64, 8, 8, 3, tma=True),
    "m128n256k64w8s4tma": KernelConfig(128, 256, 64, 8, 8, 4, tma=True),
    "m256n128k64w8s3tma": KernelConfig(256, 128, 64, 8, 8, 3, tma=True),
    # store forward (an epilogue that writes the tile): smaller tiles (bench --store-sweep, --store-forward)
    "m128n128k64w8s4tma": KernelConfig(128, 128, 64, 8, 8, 4, tma=True),
    "m128n128k64w4s4tma": KernelConfig(128, 128, 64, 8, 4, 4, tma=True),
    "m128n128k64w8s3tma": KernelConfig(128, 128, 64, 8, 8, 3, tma=True),
    "m256n128k64w8s4tma": KernelConfig(256, 128, 64, 8, 8, 4, tma=True),
    # smaller accumulator: no spills (ptxas: 186 registers, 0 stack, offline sm_90 compile), but
    # 186 x 256 threads still allows only one CTA per SM
    "m128n128k64w8s3": KernelConfig(128, 128, 64, 8, 8, 3),
    "m128n128k64w4s4": KernelConfig(128, 128, 64, 8, 4, 4),
    "m256n128k64w8s3": KernelConfig(256, 128, 64, 8, 8, 3),
    # fp32 operands: 4-byte elements halve the tile per stage
    "m128n128k32w8s3": KernelConfig(128, 128, 32, 8, 8, 3),
    "m64n128k32w4s3": KernelConfig(64, 128, 32, 8, 4, 3, ctas_per_sm=2),
    # the interpreter: tl.dot needs every dimension >= 16
    "interpret": KernelConfig(16, 32, 16, 2, 4, 1),
}

# (kernel, operand bytes) -> config name. D is not bucketed: in the H200 sweep (bf16, 2026-12-02,
# benchmarks/NOTES.md) 128x256 was the fastest forward tile or within 3% at D = 4096, 2304 and 768
# (llama3-8b 14.5 ms; 256x128 15.5, 128x128 18.8, tl.range(flatten=True) 27.5, since deleted); the
# dlogits kernel's tile moved the backward by less than the run-to-run spread (40.4-43.5 ms).
# TMA operands (H200 sweep, 2026-12-03, llama3-8b, bf16, fwd / bwd ms, bitwise the same results):
# pointers s3 14.25 / 44.06; TMA s3 13.09 / 40.02, TMA s4 12.99 / 39.82, TMA 256x128 13.15 / 41.62.
# Triton 3.6's warp specialisation (tl.range(warp_specialize=True)) of the D loop gave 13.09 / 40.23
# with TMA and 14.24 / 41.89 without, of the forward's vocabulary loop 12.89 / 39.72: within a run's
# spread of TMA s4, so that code path was deleted. Operands TMA cannot take (odd D, a W_dv.t()
# weight, pre-Hopper GPUs) run the same tile with pointers (launch._tma_ok).
FORWARD_TABLE: dict[int, str] = {2: "m128n256k64w8s4tma", 4: "m128n128k32w8s3"}
DLOGITS_TABLE: dict[int, str] = {2: "m128n256k64w8s4tma", 4: "m128n128k32w8s3"}
# the fp32 accumulate-GEMM used for grad_hidden where cuBLAS cannot write fp32 from bf16 inputs
ACC_MM_TABLE: dict[int, str] = {2: "m128n128k64w8s3", 4: "m64n128k32w4s3"}

# The forward's vocabulary split (vocab_split): at most this many waves of programs, and at most
# FORWARD_PARTIAL_BYTES of (row, split) partials. On the H200 (bf16, llama3-8b shape, one run each)
# 4 tiles per program took 14.07 ms, 1 tile 14.23 ms, and 251 tiles (2 splits, one wave of 128
# programs on 132 SMs) 14.53 ms: the per-program ramp is small against the wave quantisation.
# config.batch_invariant(): the forward's vocabulary split is this many tiles whatever N and the SM
# count, so that a row's partials and their combine order never depend on the batch. 4 tiles per
# program was within 1 % of the model's split at the llama3-8b shape (14.07 ms against 14.23 for one
# tile, above); its cost at other shapes is not measured.
BATCH_INVARIANT_TILES = 4
FORWARD_MAX_WAVES = 64
FORWARD_PARTIAL_BYTES = 64 * 2**20
FORWARD_RAMP_TILES = 0.1  # pipeline fill + partial write of one program, in units of one tile

# Extra memory the backward may hold at once: the fp32 grad_hidden accumulator (N*D*4 bytes) plus
# one chunk of dlogits (N*Vc in the input dtype). 192 MiB keeps the llama3-8b shape (N=8192,
# D=4096: 128 MiB accumulator, Vc=4096) under the 200 MiB; a chunk never gets less than
# BWD_MIN_CHUNK_BYTES, so very large N*D still makes progress with GEMMs of useful size.
BWD_EXTRA_BYTES = 192 * 2**20
BWD_MIN_CHUNK_BYTES = 32 * 2**20


def _pick(table: dict[int, str], dtype: torch.dtype) -> KernelConfig:
    if _config.triton_interpret():
        return CONFIGS["interpret"]
    return CONFIGS[table[torch.finfo(dtype).bits // 8]]


def forward_config(dtype: torch.dtype) -> KernelConfig:
    return _pick(FORWARD_TABLE, dtype)


def dlogits_config(dtype: torch.dtype) -> KernelConfig:
    return _pick(DLOGITS_TABLE, dtype)


# The store strategy's forward (store.lce_store_fwd_kernel: persistent, one split per vocabulary
# tile, the exp-logit tile normalised by that tile's own max). H200 (bf16, 2026-12-03, the forward
# alone on a 4096-row chunk, medians of 5 interleaved rounds, bench --store-forward), llama3-8b /
# gemma2-2b ms: persistent 128x256 s3 TMA 6.76 / 8.19, s4 6.79 / 8.38; persistent 256x128 s3 7.09 /
# 8.65, s4 7.14 / 8.83; one program per tile (the kernel before): 256x128 s3 7.24 / 8.76 (the
# default then), 128x256 s3 7.03 / 8.70. Persistent without flattening the loops (256x128): 40.87
# against 40.38 ms flattened for the whole store op at llama3-8b.
STORE_TABLE: dict[int, str] = {2: "m128n256k64w8s3tma", 4: "m128n128k32w8s3"}


def store_config(dtype: torch.dtype) -> KernelConfig:
    """The store strategy's forward (STORE_TABLE): one vocabulary tile per program."""
    return _pick(STORE_TABLE, dtype)._replace(split_tiles=1)


def store_dz_config(fwd: KernelConfig) -> KernelConfig:
    """The store strategy's pointwise dz kernel: the forward's tile width (its partials are per
    tile), fewer rows per program (a [32, 128] tile for 16-bit inputs: 16 values per thread at 8
    warps; H200 --store-kernels: ~3.4 TB/s, no other launch was faster by more than 4%)."""
    if _config.triton_interpret():
        return fwd
    return KernelConfig(32, fwd.block_n, 0, 8, 8, 1)


def acc_mm_config(dtype: torch.dtype) -> KernelConfig:
    return _pick(ACC_MM_TABLE, dtype)


def vocab_split(num_row_blocks: int, num_tiles: int, num_slots: int, num_rows: int = 0) -> tuple[int, int]:
    """(splits, tiles per split) for the forward grid ``num_row_blocks x splits``.

    Every program does ``tiles per split`` tiles (the last split fewer), so the time is about
    ``ceil(programs / slots) * (tiles_per_split + FORWARD_RAMP_TILES)``; pick the split with the least
    modelled time among those within FORWARD_MAX_WAVES waves and FORWARD_PARTIAL_BYTES of partials
    (16 bytes per row and split)."""
    max_splits = min(num_tiles, (FORWARD_MAX_WAVES * num_slots) // max(1, num_row_blocks))
    if num_rows:
        max_splits = min(max_splits, FORWARD_PARTIAL_BYTES // (16 * num_rows))
    best = None
    for splits in range(1, max(1, max_splits) + 1):
        per_split = -(-num_tiles // splits)
        real = -(-num_tiles // per_split)
        waves = -(-(num_row_blocks * real) // num_slots)
        cost = waves * (per_split + FORWARD_RAMP_TILES)
        if best is None or cost < best[0] - 1e-9:
            best = (cost, real, per_split)
    return best[1], best[2]


def dlogits_chunk(n: int, d: int, v: int, itemsize: int, needs_hidden_acc: bool, block_n: int) -> int:
    """Vocabulary columns per backward chunk: the dlogits chunk and the accumulator fit in
    BWD_EXTRA_BYTES; a multiple of the kernel's block_n; never more than V needs."""
    acc = n * d * 4 if needs_hidden_acc else 0
    return _chunk_columns(max(BWD_MIN_CHUNK_BYTES, BWD_EXTRA_BYTES - acc), n, v, itemsize, block_n)


def _chunk_columns(chunk_bytes: int, n: int, v: int, itemsize: int, block_n: int) -> int:
    """The columns of an [n, cols] chunk of ``itemsize``-byte elements within ``chunk_bytes``: a
    multiple of block_n, at least one block, never more than V needs."""
    cols = chunk_bytes // max(1, n * itemsize)
    cols = max(block_n, cols // block_n * block_n)
    return min(cols, -(-v // block_n) * block_n)


# The log-prob op's stored backward (launch.backward with ``stored``) reads dz's softmax from memory:
# no GEMM in its dz pass, so its vocabulary chunk is sized for the two GEMMs alone. Each chunk's
# grad_hidden GEMM reads and writes the fp32 [N, D] accumulator: at N = 16384, D = 3584 (Qwen2.5-7B)
# 470 MB per chunk (~0.12 ms at 4 TB/s) against ~0.17 ms of MMA for a 1024-column chunk, the size
# BWD_EXTRA_BYTES gives there. 256 MiB of dz (8192 columns at that N) cuts that traffic 8x for
# 5 % of the 4.6 GiB the stored exp-logits take anyway (a model, not a measurement).
STORED_BWD_CHUNK_BYTES = 256 * 2**20


def stored_chunk(n: int, v: int, itemsize: int, block_n: int) -> int:
    """Vocabulary columns per chunk of the stored log-prob backward: STORED_BWD_CHUNK_BYTES of dz, a
    multiple of ``block_n`` (the store forward's tile), never more than V needs."""
    return _chunk_columns(STORED_BWD_CHUNK_BYTES, n, v, itemsize, block_n)
