"""Benchmark shapes and data sets (``make_data``: gauss and zipf)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

IGNORE_INDEX = -100


class Shape(NamedTuple):
    n: int  # tokens (rows of hidden)
    d: int  # hidden size
    v: int  # vocabulary


SHAPES: dict[str, Shape] = {
    "llama3-8b": Shape(8192, 4096, 128256),
    "gemma2-2b": Shape(8192, 2304, 256000),
    "gpt2": Shape(16384, 768, 50257),  # unaligned V: cuBLAS is slow there, masked tiles are not
    # an RL head (bench_rl.py): Qwen2.5-7B's hidden size and padded vocabulary, 16384 rollout tokens
    # (its fp32 logits are 9.3 GiB)
    "qwen2.5-7b": Shape(16384, 3584, 152064),
    # smaller shapes for --quick and the GPU tests
    "small": Shape(2048, 1024, 32000),
}

DATA = ("gauss", "zipf")


def shape_of(name: str) -> Shape:
    """A shape of ``SHAPES`` by name, or an ad-hoc one spelled ``NxDxV`` (e.g. ``96x64x1031``)."""
    if name in SHAPES:
        return SHAPES[name]
    parts = name.split("x")
    if len(parts) == 3 and all(p.isdigit() and int(p) > 0 for p in parts):
        return Shape(*map(int, parts))
    raise ValueError(f"unknown shape {name!r}; choose from {', '.join(SHAPES)} or spell one NxDxV")


def make_data(shape: Shape, data: str, dtype=torch.bfloat16, device="cuda", seed=0):
    """(hidden (N, D), weight (V, D), target (N,)) of the ``gauss`` or ``zipf`` data set.

    gauss: hidden ~ N(0, 1), weight ~ N(0, (3/sqrt(D))^2) (logits have std ~3), uniform targets.
    zipf:  as gauss, plus one constant hidden feature 4.0 whose weight column is
           -1.1*log(1 + token_id)/4 (a Zipf prior); targets sampled from the resulting softmax.
    In both, every 17th target is ignore_index."""
    n, d, v = shape
    g = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(n, d, device=device, generator=g)
    w = torch.randn(v, d, device=device, generator=g) * (3.0 / math.sqrt(d))
    if data == "gauss":
        t = torch.randint(0, v, (n,), device=device, generator=g)
    elif data == "zipf":
        h[:, 0] = 4.0
        w[:, 0] = -1.1 * torch.log1p(torch.arange(v, device=device, dtype=torch.float32)) / 4.0
        t = torch.empty(n, dtype=torch.long, device=device)
        hq, wq = h.to(dtype).float(), w.to(dtype).float()
        for start in range(0, n, 1024):  # sample from softmax(z) a chunk of rows at a time
            p = torch.softmax(hq[start:start + 1024] @ wq.t(), dim=-1)
            t[start:start + 1024] = torch.multinomial(p, 1, generator=g).squeeze(1)
    else:
        raise ValueError(f"unknown data {data!r}; choose from {DATA}")
    t[::17] = IGNORE_INDEX
    return h.to(dtype), w.to(dtype), t


# ignored-row layouts of ``ignore_rows`` (bench kernels --ignored): SFT prompts, or padding
IGNORED_LAYOUTS = ("prompt", "padding")
PROMPT_SEQ = 1024  # rows per sequence of the prompt layout


def ignore_rows(t: torch.Tensor, fraction: float, layout: str = "prompt", seed: int = 1) -> torch.Tensor:
    """``t`` with exactly round(fraction·N) rows set to ignore_index and every other row valid
    (replacing make_data's every-17th). ``prompt``: each sequence of PROMPT_SEQ rows starts with its
    prompt, a contiguous span of fraction·PROMPT_SEQ rows (SFT); ``padding``: rows scattered at random."""
    n = t.shape[0]
    t = t.clone()
    t[t == IGNORE_INDEX] = 0
    if layout == "prompt":
        pos = torch.arange(n, device=t.device) % PROMPT_SEQ
        seq_len = torch.full((n,), PROMPT_SEQ, device=t.device)
        last = n - n % PROMPT_SEQ
        seq_len[last:] = max(n - last, 1)  # a ragged last sequence
        t[pos < torch.round(fraction * seq_len)] = IGNORE_INDEX
    elif layout == "padding":
        g = torch.Generator(device=t.device).manual_seed(seed)
        t[torch.randperm(n, device=t.device, generator=g)[:round(fraction * n)]] = IGNORE_INDEX
    else:
        raise ValueError(f"unknown layout {layout!r}; choose from {IGNORED_LAYOUTS}")
    return t
