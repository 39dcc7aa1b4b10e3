"""Knobs of inductor_xent, and the only place environment variables are read.

Every value is read when it is used (not at import), so tests and users can change the environment
or the attributes below at run time.
"""

from __future__ import annotations

import os

IMPLS = ("auto", "triton", "reference")

# The chunked CPU path holds at most this many bytes of logits per row chunk (plus a few buffers of
# the same size: softmax/gradient, tanh). Measured at N=4096, D=64, V=32768 fp32 (512 MiB of
# logits, 2 cores): 16 MiB -> peak RSS growth 111 MiB, 8 MiB -> 55 MiB, 4 MiB -> 23 MiB, at the
# same speed (0.6x eager's time); 8 MiB keeps each chunk's matmul large (64 rows x V here).
fallback_chunk_bytes: int = 8 * 2**20


def impl() -> str:
    """``INDUCTOR_XENT_IMPL``: which implementation runs behind the op.

    ``auto`` (default): Triton kernels for CUDA tensors of bf16/fp16/fp32, the chunked PyTorch path
    otherwise. ``triton``: the Triton kernels for every bf16/fp16/fp32 input; on CPU tensors they
    run under ``TRITON_INTERPRET=1`` (slow; for tests); float64 inputs still take the chunked
    path. ``reference``: the chunked PyTorch path (``fallback.py``) always; the materialising
    oracle ``reference.py`` is for tests only and is never selected here.
    """
    value = os.environ.get("INDUCTOR_XENT_IMPL", "auto").strip().lower() or "auto"
    if value not in IMPLS:
        raise ValueError(f"INDUCTOR_XENT_IMPL={value!r}; expected one of {', '.join(IMPLS)}")
    return value


def triton_interpret() -> bool:
    """True when Triton kernels run in the interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dump_graphs() -> bool:
    """``INDUCTOR_XENT_DUMP_GRAPHS=1`` logs every graph before and after the pass (logger
    ``inductor_xent.patterns``, level INFO)."""
    return os.environ.get("INDUCTOR_XENT_DUMP_GRAPHS", "0") not in ("", "0")
