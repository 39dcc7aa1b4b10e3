"""Knobs of inductor_xent, and the only place environment variables are read.

Every value is read when it is used (not at import), so tests and users can change the environment
or the attributes below at run time.
"""

from __future__ import annotations

import math
import os

IMPLS = ("auto", "triton", "chunked")
_IMPL_ALIASES = {"reference": "chunked"}  # the old name, kept with a deprecation warning

# The chunked CPU path holds at most this many bytes of logits per row chunk (plus a few buffers of
# the same size: softmax/gradient, tanh). Measured at N=4096, D=64, V=32768 fp32 (512 MiB of
# logits, 2 cores): 16 MiB -> peak RSS growth 111 MiB, 8 MiB -> 55 MiB, 4 MiB -> 23 MiB, at the
# same speed (0.6x eager's time); 8 MiB keeps each chunk's matmul large (64 rows x V here).
fallback_chunk_bytes: int = 8 * 2**20

# Defaults of the strategy knobs (inductor_xent/strategy.py); the environment overrides them.
STRATEGIES = ("auto", "recompute", "store")
STRATEGY_DEFAULT = "auto"
# auto takes ``store`` when its extra memory is at most this: here the size of the [N, V] logits
# in the input dtype, i.e. what torch.compile holds for the same loss. Store then never holds
# more than the plain compiled loss would, and is 6·N·D·V FLOPs instead of recompute's 8·N·D·V.
STORE_BUDGET_DEFAULT = "1x"


def impl() -> str:
    """``INDUCTOR_XENT_IMPL``: which implementation runs behind the op.

    ``auto`` (default): Triton kernels for CUDA tensors of bf16/fp16/fp32, the chunked PyTorch path
    otherwise. ``triton``: the Triton kernels for every bf16/fp16/fp32 input; on CPU tensors they
    run under ``TRITON_INTERPRET=1`` (slow; for tests); float64 inputs still take the chunked
    path. ``chunked``: the chunked PyTorch path (``fallback.py``) always. ``reference`` is the old
    name of ``chunked`` (deprecated: it never meant the test oracle ``reference.py``).
    """
    value = os.environ.get("INDUCTOR_XENT_IMPL", "auto").strip().lower() or "auto"
    if value in _IMPL_ALIASES:
        import warnings

        new = _IMPL_ALIASES[value]
        warnings.warn(f"INDUCTOR_XENT_IMPL={value} is deprecated; use INDUCTOR_XENT_IMPL={new} (the same chunked "
                      "PyTorch path)", DeprecationWarning, stacklevel=2)
        value = new
    if value not in IMPLS:
        raise ValueError(f"INDUCTOR_XENT_IMPL={value!r}; expected one of {', '.join(IMPLS)}")
    return value


def strategy() -> str:
    """``INDUCTOR_XENT_STRATEGY``: ``auto`` (default) | ``recompute`` | ``store`` (strategy.py)."""
    value = os.environ.get("INDUCTOR_XENT_STRATEGY", STRATEGY_DEFAULT).strip().lower() or STRATEGY_DEFAULT
    return check_strategy(value)


def store_budget() -> str:
    """``INDUCTOR_XENT_STORE_BUDGET``: how much extra memory ``auto`` lets ``store`` hold: bytes
    (``2GiB``, ``512MiB``, ``1073741824``) or a fraction of the logits (``0.5x``); default ``1x``."""
    value = os.environ.get("INDUCTOR_XENT_STORE_BUDGET", STORE_BUDGET_DEFAULT).strip() or STORE_BUDGET_DEFAULT
    parse_budget(value)  # a clear error for a malformed value, where it is read
    return value


def check_strategy(strategy: str) -> str:
    """``strategy`` if it is one of STRATEGIES, else ``ValueError`` (the environment, ``xent.strategy``,
    ``install(strategy=...)`` and the functional API's argument all go through here)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(map(repr, STRATEGIES))}, got {strategy!r}")
    return strategy


def parse_budget(value: str | int | float) -> tuple[str, float]:
    """A store budget as ("bytes", n) or ("logits", fraction): ``"2GiB"``, ``"512MiB"``, ``123456``, or
    ``"0.5x"`` (that fraction of the [N, V] logits in the input dtype, which torch.compile holds)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        amount, kind = float(value), "bytes"
    else:
        text = str(value).strip().replace(" ", "")
        kind, amount = "bytes", None
        units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 1e3, "mb": 1e6, "gb": 1e9, "b": 1}
        try:
            if text.lower().endswith("x"):
                kind, amount = "logits", float(text[:-1])
            else:
                for unit, mult in units.items():
                    if text.lower().endswith(unit):
                        amount = float(text[: -len(unit)]) * mult
                        break
                else:
                    amount = float(text)
        except ValueError:
            amount = None
        if amount is None:
            raise ValueError(f"store budget {value!r}: expected bytes (e.g. 2147483648, '2GiB', '512MiB') or a "
                             "fraction of the logits (e.g. '0.5x')")
    if not math.isfinite(amount) or amount < 0:
        raise ValueError(f"store budget {value!r} must be a finite number >= 0")
    return kind, amount


def triton_interpret() -> bool:
    """True when Triton kernels run in the interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dump_graphs() -> bool:
    """``INDUCTOR_XENT_DUMP_GRAPHS=1`` logs every graph before and after the pass (logger
    ``inductor_xent.patterns``, level INFO)."""
    return os.environ.get("INDUCTOR_XENT_DUMP_GRAPHS", "0") not in ("", "0")


# the spellings of a yes/no environment variable (lower case), and what they mean
_SWITCH = {"1": True, "true": True, "on": True, "yes": True, "0": False, "false": False, "off": False, "no": False}


def _switch(name: str, default: bool) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value not in _SWITCH:
        raise ValueError(f"{name}={value!r}; expected one of {', '.join(_SWITCH)}")
    return _SWITCH[value]


def dynamo_tuning() -> bool:
    """``INDUCTOR_XENT_DYNAMO_TUNING``: ``1`` (default) lets Dynamo skip transformers' once-per-process
    warnings (``logger.warning_once``) instead of graph-breaking on them; ``0`` leaves Dynamo's
    configuration alone (``dynamo_tuning.tune_dynamo``)."""
    return _switch("INDUCTOR_XENT_DYNAMO_TUNING", True)


def nested_graph_breaks() -> bool:
    """``INDUCTOR_XENT_NESTED_GRAPH_BREAKS``: ``1`` (default on torch 2.13+) traces what runs inside a
    function compiled with ``backend="inductor_xent"`` (and ``explain``) with
    ``torch._dynamo.config.nested_graph_breaks = True``, restored when the call returns
    (``dynamo_tuning.DynamoScope``); ``0`` (default on 2.11 and 2.12, whose Dynamo may resume a nested
    frame with its caller's globals: ``compat.nested_graph_breaks_sound``) leaves Dynamo's option as it is."""
    from . import compat

    return _switch("INDUCTOR_XENT_NESTED_GRAPH_BREAKS", compat.nested_graph_breaks_sound())


def capture_dynamic_output_shapes() -> bool:
    """``INDUCTOR_XENT_CAPTURE_DYNAMIC_OUTPUT_SHAPES``: ``1`` (default) traces what runs inside a function
    compiled with ``backend="inductor_xent"`` (and ``explain``) with
    ``torch._dynamo.config.capture_dynamic_output_shape_ops = True``, restored when the call returns
    (``dynamo_tuning.DynamoScope``): a boolean-mask indexing (TRL's ``jsd[labels != -100]`` before the
    sum, ``logits[mask].argmax(-1)`` for an accuracy) stays in the graph instead of breaking it between
    the heads and the loss. A frame where no fused site reads such an index, or that Dynamo cannot
    trace or compile so (``if z.shape[0]:`` after ``z = x[mask]``), is traced again without it
    (``dynamo_tuning.retry_without_capture``), as is a compile that runs CUDA graphs. ``0`` leaves
    Dynamo's option as it is (off unless set)."""
    return _switch("INDUCTOR_XENT_CAPTURE_DYNAMIC_OUTPUT_SHAPES", True)


def batch_invariant() -> bool:
    """``INDUCTOR_XENT_BATCH_INVARIANT``: ``1`` makes every row's forward values (loss, log-probs,
    entropy, argmax, logsumexp) on the Triton path the same bits whatever the batch around it: the
    forward walks the vocabulary in splits of a fixed size (``configs.BATCH_INVARIANT_TILES`` tiles),
    not in a split chosen from N and the GPU's SM count, and the log-prob op recomputes (its store
    keeps a number of rows that depends on N). For an RL trainer and a rollout engine that must agree
    bit for bit. ``0`` (default): the split that the cost model picks."""
    return _switch("INDUCTOR_XENT_BATCH_INVARIANT", False)


def skip_ignored_rows() -> bool:
    """``INDUCTOR_XENT_SKIP_IGNORED``: ``1`` (default) lets the kernels skip the rows whose outputs
    are known to be zero (a cross-entropy's ``ignore_index`` rows): the valid rows are moved first on
    the device and every GEMM stops at their count (templates/rows.py); ``0`` computes every row
    (the A/B switch of ``bench kernels --ignored``)."""
    return _switch("INDUCTOR_XENT_SKIP_IGNORED", True)


def traced() -> tuple:
    """The settings that change what the ops' autograd and the pass trace into a graph that the graph's
    own nodes do not show (the implementation decides whether a store op's backward reads compacted
    rows; the strategy, budget, row skipping and batch invariance change the rewrite): part of the
    Inductor cache keys (``inductor_pass.CacheSalt``), so that a compiled graph is never replayed
    under other settings."""
    return (impl(), strategy(), store_budget(), skip_ignored_rows(), batch_invariant(), triton_interpret())

