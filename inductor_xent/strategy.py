"""Which strategy computes a site's gradients, and how much memory it may hold.

* ``recompute``: the forward keeps O(N) statistics; the backward recomputes the logits.
  8·N·D·V FLOPs, extra memory O(N·D + one chunk).
* ``store``: one pass over row chunks computes the loss and, from the same logits, the gradients
  of the reduced loss; the backward scales them by the incoming scalar. 6·N·D·V FLOPs; holds the
  gradients from forward to backward, one chunk of logits, and an fp32 weight-gradient
  accumulator where the precision rule (``fp32_accumulate``) asks for one.
* ``auto`` (default): ``store`` when the reduction allows it and its extra memory fits the budget,
  else ``recompute``.

``choose`` decides from static facts (shapes, dtypes, reduction, which gradients are needed), so
the functional API and the graph pass take the same decision, and ``explain`` can show it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch

from . import config

# A bf16/fp16 weight gradient accumulated over row chunks is rounded once per chunk. Up to this
# many chunks its error stays below torch.compile's (which rounds the logits to bf16 first);
# beyond it the accumulator is fp32 (4·V·D bytes more). Measured on the H200 (llama3-8b shape,
# bf16, grad_weight error against fp32; benchmarks/RESULTS.md, "store: weight-gradient
# accumulation"): torch.compile 2.5e-3 gauss / ~3.1e-3 zipf; 1 chunk 1.7e-3 / 2.3e-3; 2 chunks
# 2.3e-3 / 2.9e-3; 4 chunks 2.8e-3 / 3.4e-3 (above compile); 8 chunks 3.1e-3 / 4.0e-3.
LOWP_ACCUMULATE_CHUNKS = 2
CHUNK_ALIGN = 128  # rows per chunk: a multiple of 128 (the store forward's 16-bit row block is 256: an
# odd multiple leaves its last block half full, which costs time, not correctness)
# Fewer rows per chunk than this and the three GEMMs per chunk lose their speed (H200, llama3-8b
# shape: chunks of 1024 rows 44.5 ms against 42.7 for 2048); store then is not worth its memory.
MIN_CHUNK_ROWS = 1024
# the store forward's vocabulary tile per input itemsize (configs.STORE_TABLE): 12 bytes of partials per (row, tile)
STORE_TILE = {2: 256, 4: 128}
# On CUDA, ``auto`` takes store only from this hidden size up. Store saves one 2·N·D·V GEMM and pays
# passes over [N, V] tensors (E written and read, dz written and read twice) whose cost does not
# shrink with D; at small D the GEMM it saves is cheaper than those passes. Measured on the H200
# (bf16, fwd+bwd): gpt2 D = 768: store 18.3 ms against recompute 12.0; gemma2-2b D = 2304: 49.5
# against 62.6; llama3-8b D = 4096: 44.3 against 56.4 (benchmarks/RESULTS.md).
STORE_MIN_D_CUDA = 2048


# how a site computes its gradients: recompute the logits in the backward, or store them (chunked)
Name = Literal["recompute", "store"]


@dataclass(frozen=True)
class GradientPlan:
    """How one site computes its gradients (``choose``'s answer; ``explain`` shows ``describe()``)."""

    strategy: Name
    chunk_rows: int = 0  # store: rows per chunk
    fp32_accumulate: bool = False  # store: weight/bias gradients accumulate in fp32
    extra_bytes: int = 0  # estimated extra memory of the chosen strategy (at the planned N)
    reason: str = ""  # why this strategy (shown by explain)
    budget: str = ""  # store: the budget the op sizes its chunks from at run time
    planned_rows: int = 0  # the log-prob and gather ops' store: the N planned for (chunk_rows of them kept)
    kept: str = "exp-logits"  # what those rows keep (the gather op's store keeps their logits)

    def describe(self) -> str:
        if self.strategy == "recompute":
            return f"recompute ({self.reason})" if self.reason else "recompute"
        if self.planned_rows:
            why = f"; {self.reason}" if self.reason else ""
            return (f"store ({self.kept} of {self.chunk_rows} of {self.planned_rows} rows kept for the backward, "
                    f"~{_mib(self.extra_bytes)}{why})")
        acc = ", fp32 weight-gradient accumulator" if self.fp32_accumulate else ""
        return f"store (chunks of {self.chunk_rows} rows{acc}, ~{_mib(self.extra_bytes)})"


def store_unsupported(reduction: str, label_smoothing: float, softcap: Optional[float], lse_used: bool,
                      needs: tuple[bool, bool, bool]) -> Optional[str]:
    """Why ``store`` cannot run this site, or None."""
    if reduction not in ("mean", "sum"):
        return f"reduction={reduction!r}: per-row incoming gradients (store needs a scalar loss)"
    if lse_used:
        return "the logsumexp is used elsewhere (its gradient is per row)"
    if label_smoothing and softcap is not None:
        return "label smoothing with a softcap (the stored softmax cannot give every column's cap derivative)"
    if not any(needs):
        return "no gradient is needed"
    return None


def store_bytes(n: int, v: int, d: int, itemsize: int, weight_itemsize: int, chunk_rows: int,
                need_weight: bool) -> tuple[int, bool]:
    """(extra bytes, fp32 accumulator?) of ``store`` with chunks of ``chunk_rows`` rows: the chunk of
    exp-logits (fp16 for 16-bit inputs, fp32 for fp32) and its per-tile partials, plus the fp32
    weight-gradient accumulator where the precision rule asks for one. The gradients themselves are
    not counted: they are the gradients (under torch.compile the backward's scaling reuses their
    buffers, AOTAutograd's donated buffers; eagerly it scales them in place, or makes one more copy
    under retain_graph)."""
    fp32_acc = fp32_accumulate(n, chunk_rows, weight_itemsize, need_weight)
    return chunk_rows * _per_row(v, itemsize) + (v * d * 4 if fp32_acc else 0), fp32_acc


def fp32_accumulate(n: int, chunk_rows: int, weight_itemsize: int, need_weight: bool) -> bool:
    """The precision rule of ``store``, the one place it is stated: the weight gradient accumulates in
    an fp32 ``[V, D]`` buffer when the weight is 16-bit and its gradient would otherwise be rounded
    once per row chunk over more than LOWP_ACCUMULATE_CHUNKS chunks of ``chunk_rows`` rows (0: all
    ``n`` rows in one chunk). The plan's memory estimate (``store_bytes``) and the store op (which
    passes the answer to the Triton launcher) both ask it."""
    chunks = -(-n // chunk_rows) if chunk_rows > 0 else 1
    return need_weight and weight_itemsize < 4 and chunks > LOWP_ACCUMULATE_CHUNKS


def _per_row(v: int, itemsize: int) -> int:
    """Bytes per row of a chunk: the exp-logits and three fp32 partials per vocabulary tile."""
    return v * (4 if itemsize >= 4 else 2) + (-(-v // STORE_TILE[min(itemsize, 4)])) * 12


# N to plan for when the rows are a dynamic size under torch.compile (the decision must not
# depend on, or guard, a size that changes between calls); the chunks are sized at run time
DYNAMIC_ROWS = 8192


def chunk_rows(n: int, v: int, d: int, dtype: torch.dtype, weight_dtype: torch.dtype, need_weight: bool,
               budget) -> int:
    """Rows per chunk of ``store`` within ``budget`` (0 when MIN_CHUNK_ROWS do not fit): the
    fewest chunks (fewer roundings of a low-precision weight gradient, fewer passes), then chunks
    of equal size (the least memory for that count). Where ``fp32_accumulate`` asks for the fp32
    accumulator at that chunk count, it must fit too. The store op calls this at run time with the
    real N, so eager and compiled calls chunk alike, and a dynamic N is chunked for its size."""
    n = max(int(n), 1)
    kind, amount = config.parse_budget(budget)
    itemsize, w_itemsize = torch.finfo(dtype).bits // 8, torch.finfo(weight_dtype).bits // 8
    limit = amount * (n * v * itemsize if kind == "logits" else 1)
    per_row = _per_row(v, itemsize)
    for acc_bytes in (0, v * d * 4):
        rows = int((limit - acc_bytes) // per_row) if limit > acc_bytes else 0
        if rows >= n:
            return n
        rows -= rows % CHUNK_ALIGN
        if rows < min(n, MIN_CHUNK_ROWS):
            continue
        chunks = -(-n // rows)
        per_chunk = -(-n // chunks)
        balanced = -(-per_chunk // CHUNK_ALIGN) * CHUNK_ALIGN
        if store_bytes(n, v, d, itemsize, w_itemsize, balanced, need_weight)[0] <= limit:
            return balanced
    return 0


def choose(
    n: Optional[int], d: int, v: int, dtype: torch.dtype, weight_dtype: torch.dtype, *,
    reduction: str, needs: tuple[bool, bool, bool], label_smoothing: float = 0.0,
    softcap: Optional[float] = None, lse_used: bool = False,
    strategy: Optional[str] = None, budget: Optional[str | int | float] = None, device: str = "cuda",
) -> GradientPlan:
    """The strategy for one site (``strategy`` and ``budget`` default to ``config``'s); ``n`` None
    means a dynamic number of rows (planned as DYNAMIC_ROWS); ``device`` is the inputs' device type."""
    strategy = config.check_strategy(strategy if strategy is not None else config.strategy())
    budget = budget if budget is not None else config.store_budget()
    config.parse_budget(budget)
    if strategy == "recompute":
        return GradientPlan("recompute", reason="strategy='recompute'")
    why = store_unsupported(reduction, label_smoothing, softcap, lse_used, needs)
    if why:
        return GradientPlan("recompute", reason="store cannot run: " + why)
    if strategy == "auto" and device == "cuda" and d < STORE_MIN_D_CUDA:
        return GradientPlan("recompute", reason=f"D = {d} < {STORE_MIN_D_CUDA}: at small D store's passes over "
                                                "[N, V] cost more than the GEMM it saves")
    n = DYNAMIC_ROWS if n is None else max(int(n), 1)
    rows = chunk_rows(n, v, d, dtype, weight_dtype, needs[1], budget)
    itemsize, w_itemsize = torch.finfo(dtype).bits // 8, torch.finfo(weight_dtype).bits // 8
    if rows:
        extra, fp32_acc = store_bytes(n, v, d, itemsize, w_itemsize, rows, needs[1])
        return GradientPlan("store", rows, fp32_acc, extra, budget=str(budget))
    smallest = store_bytes(n, v, d, itemsize, w_itemsize, min(n, MIN_CHUNK_ROWS), needs[1])[0]
    kind, amount = config.parse_budget(budget)
    limit = amount * (n * v * itemsize if kind == "logits" else 1)
    return GradientPlan("recompute",
                        reason=f"store needs at least {_mib(smallest)}, over the budget of {_mib(limit)}")


# ---------------------------------------------------------------------------------------------
# the log-prob op (per-row incoming gradients): store keeps the exp-logits of the first S rows
# ---------------------------------------------------------------------------------------------
# The backward of a per-token head (log-probs, entropy: RL) cannot be folded into the forward as the
# loss's is: its incoming gradients are per row. Store keeps, from the forward's tiles, what dz needs
# instead of the logits themselves: E = exp(z − m_tile) (fp16: 11 bits; fp32 for fp32 inputs), each
# tile's max and the target's sech², so that the backward of those rows is two GEMMs, not three
# (6·N·D·V FLOPs in all instead of 8). The first S rows as many as fit the budget; the rest recompute.
def logprob_row_bytes(v, itemsize: int):
    """Bytes a row keeps under the log-prob op's store: its exp-logits, one fp32 maximum per store
    tile, the target's sech² (``v`` may be a SymInt: no negative floor division)."""
    tile = STORE_TILE[min(itemsize, 4)]
    return v * (4 if itemsize >= 4 else 2) + (v + tile - 1) // tile * 4 + 4


def logprob_store_rows(n, v, dtype: torch.dtype, budget, store_rows: int = 0, per_row=None):
    """S, the rows (of ``n``) whose exp-logits the log-prob op's store keeps (``per_row`` bytes each:
    ``logprob_row_bytes`` unless given): ``store_rows`` when it is positive, else as many as
    ``budget`` holds; at most ``n``. ``n`` and ``v`` may be SymInts (dynamic sizes under
    torch.compile, where the op's fake sizes its outputs with this): S is then an integer expression
    in them, with no comparison (no guard)."""
    if store_rows > 0:
        return _sym_min(n, int(store_rows))
    itemsize = torch.finfo(dtype).bits // 8
    per_row = logprob_row_bytes(v, itemsize) if per_row is None else per_row
    kind, amount = config.parse_budget(budget)
    if kind == "bytes":
        return _sym_min(n, int(amount) // per_row)
    scale = 2**20  # the fraction of the logits as an integer ratio, rounded down (never over the budget)
    return _sym_min(n, (n * v * itemsize * int(amount * scale)) // (per_row * scale))


def _sym_min(a, b):
    return torch.sym_min(a, b) if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt) else min(a, b)


def choose_log_probs(
    n: Optional[int], d: int, v: int, dtype: torch.dtype, *, needs: tuple[bool, bool, bool],
    strategy: Optional[str] = None, budget: Optional[str | int | float] = None, device: str = "cuda",
) -> GradientPlan:
    """The strategy of a log-prob op (``choose``'s for the per-token heads): ``store`` keeps the
    exp-logits of as many rows as ``budget`` holds (at least MIN_CHUNK_ROWS of them, or all) and
    their backward is two GEMMs; ``auto`` takes it on CUDA from STORE_MIN_D_CUDA up (the same passes
    over [N, V] against the same saved GEMM as the loss's store); on CPU the chunked path recomputes."""
    strategy = config.check_strategy(strategy if strategy is not None else config.strategy())
    budget = budget if budget is not None else config.store_budget()
    config.parse_budget(budget)
    if strategy == "recompute":
        return GradientPlan("recompute", reason="strategy='recompute'")
    if not any(needs):
        return GradientPlan("recompute", reason="store cannot run: no gradient is needed")
    if config.batch_invariant():  # the rows store keeps (a budget's share of N) would decide a row's bits
        return GradientPlan("recompute", reason="batch-invariant (INDUCTOR_XENT_BATCH_INVARIANT=1): store keeps "
                                                "a number of rows that depends on the batch")
    if strategy == "auto" and device != "cuda":
        return GradientPlan("recompute", reason="the log-prob op stores on CUDA only (the chunked path recomputes)")
    if strategy == "auto" and d < STORE_MIN_D_CUDA:
        return GradientPlan("recompute", reason=f"D = {d} < {STORE_MIN_D_CUDA}: at small D store's passes over "
                                                "[N, V] cost more than the GEMM it saves")
    n = DYNAMIC_ROWS if n is None else max(int(n), 1)
    rows = logprob_store_rows(n, v, dtype, budget)
    per_row = logprob_row_bytes(v, torch.finfo(dtype).bits // 8)
    return _rows_plan(n, rows, per_row, v * (torch.finfo(dtype).bits // 8), budget, "exp-logits")


def _rows_plan(n: int, rows: int, per_row: int, logits_row: int, budget, kept: str) -> GradientPlan:
    """The log-prob and gather ops' plan once S (``rows`` of ``n``, ``per_row`` bytes each) is known:
    store where S is at least MIN_CHUNK_ROWS (or all), else recompute, saying how far the budget
    (``logits_row``: a row of logits' bytes, for a fraction of the logits) falls short."""
    if rows < min(n, MIN_CHUNK_ROWS):
        kind, amount = config.parse_budget(budget)
        limit = amount * (n * logits_row if kind == "logits" else 1)
        return GradientPlan("recompute", reason=f"store needs at least {_mib(min(n, MIN_CHUNK_ROWS) * per_row)}, "
                                                f"over the budget of {_mib(limit)}")
    return GradientPlan("store", rows, extra_bytes=rows * per_row, budget=str(budget), planned_rows=n, kept=kept)


# ---------------------------------------------------------------------------------------------
# the gather op with log-probs (gathered.py): store keeps the first S rows' logits
# ---------------------------------------------------------------------------------------------
# The backward of log-probs at k ids per row needs every logit of the row (the softmax's share of
# each column). Recompute runs one more GEMM for them (four in all, against eager's three); store
# keeps the forward's logits of the first S rows in the inputs' dtype (the bits the backward would
# recompute: no extra pass over [N, V], unlike the log-prob op's store), so those rows' backward is
# two GEMMs. That holds at any D (no STORE_MIN_D_CUDA): the saved GEMM costs more than writing and
# reading the logits once.
def gather_store_rows(n, v, dtype: torch.dtype, budget, store_rows: int = 0):
    """S, the rows (of ``n``) whose logits the gather op keeps (``logprob_store_rows`` at the logits'
    bytes per row)."""
    return logprob_store_rows(n, v, dtype, budget, store_rows, per_row=v * (torch.finfo(dtype).bits // 8))


def choose_gather(
    n: Optional[int], d: int, v: int, dtype: torch.dtype, *, needs: tuple[bool, bool, bool], log_probs: bool,
    strategy: Optional[str] = None, budget: Optional[str | int | float] = None, device: str = "cuda",
) -> GradientPlan:
    """The gather op's strategy: with ``log_probs``, ``store`` keeps the logits of as many rows as
    ``budget`` holds (at least MIN_CHUNK_ROWS of them, or all), ``auto`` on CUDA only (the chunked
    path keeps its memory bounded); the logits alone need no logits in their backward."""
    strategy = config.check_strategy(strategy if strategy is not None else config.strategy())
    budget = budget if budget is not None else config.store_budget()
    config.parse_budget(budget)
    if not log_probs:
        return GradientPlan("recompute", reason="the gathered logits' backward reads no logits")
    if strategy == "recompute":
        return GradientPlan("recompute", reason="strategy='recompute'")
    if not any(needs):
        return GradientPlan("recompute", reason="store cannot run: no gradient is needed")
    if strategy == "auto" and device != "cuda":
        return GradientPlan("recompute", reason="the gather op stores on CUDA only (the chunked path recomputes)")
    n = DYNAMIC_ROWS if n is None else max(int(n), 1)
    per_row = v * (torch.finfo(dtype).bits // 8)
    return _rows_plan(n, gather_store_rows(n, v, dtype, budget), per_row, per_row, budget, "logits")


def _mib(n) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"
