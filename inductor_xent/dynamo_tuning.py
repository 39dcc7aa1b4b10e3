"""Dynamo tuning: the Dynamo settings inductor_xent changes so that a real model's lm_head and its loss
land in one graph, each with the switch that turns it off.

Dynamo traces before any backend runs, so where it breaks a graph is decided by its own options, not
by the backend; with three of its defaults the lm_head and the loss of real models end up in different
graphs (benchmarks/zoo.py: 7 + 9 of 189 transformers causal LMs, below). This module changes these
things, and nothing else:

* ``tune_dynamo()`` (process-wide): adds transformers' ``logger.warning_once``, when transformers is
  already imported, to ``torch._dynamo.config.ignore_logging_functions``, so Dynamo drops that call
  instead of graph-breaking on it (transformers logs a ``loss_type=None`` warning inside ``forward``
  of 7 of the zoo's causal LMs). Compiled code then does not print that warning; eager code still
  does; no other logging call is affected. Called when backend.py is imported (the entry point's
  lookup), at each call of the backend, by ``explain`` and by the source-tree registration in
  ``__init__.py``. Off: ``INDUCTOR_XENT_DYNAMO_TUNING=0`` (``config.dynamo_tuning()``).
* ``DynamoScope`` (scoped): the backend's ``backend_ctx_ctor``, entered around every call of a
  function compiled with ``backend="inductor_xent"`` (and around ``explain``'s trace); sets
  ``torch._dynamo.config.nested_graph_breaks = True`` for that call and restores it after (9 of the
  zoo's causal LMs fuse only so). Off: ``INDUCTOR_XENT_NESTED_GRAPH_BREAKS=0``
  (``config.nested_graph_breaks()``). Also ``capture_dynamic_output_shape_ops = True`` (off:
  ``INDUCTOR_XENT_CAPTURE_DYNAMIC_OUTPUT_SHAPES=0``, ``config.capture_dynamic_output_shapes()``): a
  boolean-mask indexing (TRL's GKD loss, ``jsd[labels != -100]`` before ``jsd.sum()``; an accuracy's
  ``logits[mask].argmax(-1)``) stays in the graph, where the pass reads it (a masked sum; the mask
  moved after the head), instead of breaking the graph and returning the ``[N, V]`` tensor.
* ``retry_without_capture()``: wraps Dynamo's frame conversion once (when a scope first turns the
  capture on) so that a frame traced under it is traced again without it, as ``backend="inductor"``
  traces it (the index breaks the graph): where Dynamo fails on code that branches on the truth of
  such a size (``if z.shape[0]:``), where compiling the graph fails (AOTAutograd and Inductor have
  bugs with such sizes), and where no fused site used the capture (``captured_pass``: the backend
  raises ``CaptureUnused``), so the capture changes only the graphs that fuse thanks to it. Counted in
  ``counters["inductor_xent"]["frames_traced_without_capture"]`` (a failure) and
  ``["frames_traced_without_unused_capture"]``. A compile that runs CUDA graphs (``mode="reduce-overhead"``,
  ``triton.cudagraphs``, read at each call) traces without the capture.
* ``honour_backend_ctx()``: wraps ``torch._dynamo.eval_frame.get_compiler_fn`` once (when backend.py
  is imported) so that ``torch.compile(..., backend=<ours>)`` enters our ``backend_ctx_ctor`` (the
  ``DynamoScope``) as ``torch._dynamo.optimize(<ours>)`` does; torch.compile's backend wrapper hides
  the attribute, in 2.11 and 2.13+ alike (tests/test_backend.py checks both ways). Every other
  backend gets what it got. No switch of its own: with ``INDUCTOR_XENT_NESTED_GRAPH_BREAKS=0`` the
  scope it enters changes nothing.

Nothing here runs at import: backend.py, explain.py and ``__init__.py`` call it. Torch 2.11's
compilation-metrics log cannot write a function in ``ignore_logging_functions``; that release
difference is ``compat.loggable_function``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any, Optional

from . import compat, config

log = logging.getLogger(__name__)


def transformers_warning_once() -> Optional[Callable]:
    """transformers' ``warning_once`` (a ``functools.lru_cache`` object that transformers sets as
    ``logging.Logger.warning_once``), or None when transformers is not imported; never imports it."""
    hf_logging = sys.modules.get("transformers.utils.logging")
    fn = getattr(hf_logging, "warning_once", None)
    return fn if fn is not None and getattr(logging.Logger, "warning_once", None) is fn else None


def tune_dynamo() -> dict:
    """Set the Dynamo options that let real models fuse; idempotent; returns what it changed.

    Dynamo graph-breaks on every ``logging.Logger`` call it traces. transformers logs a
    ``warning_once`` about ``loss_type=None`` inside ``forward`` of the models whose class name gives
    no loss type (GPT-2, BERT, CTRL, ... 7 of the 189 causal LMs of the zoo sweep), and that break
    falls between the lm_head and the loss. So by default (``INDUCTOR_XENT_DYNAMO_TUNING``, config.py)
    transformers' ``warning_once``, when transformers is already imported, joins
    ``torch._dynamo.config.ignore_logging_functions``: no graph break on it, and compiled code does not
    print such a warning (eager code still does). No other logging call is affected.

    The backend calls this when it is looked up and at each call; the option is process-wide (it
    must hold when Dynamo traces, which is before any backend runs), and a frame Dynamo traced before
    it was set keeps its graph breaks until it is traced again. ``nested_graph_breaks`` is scoped
    instead: ``DynamoScope``.
    """
    from torch._dynamo import config as dynamo_config

    changed: dict[str, Any] = {}
    warning_once = transformers_warning_once() if config.dynamo_tuning() else None
    if warning_once is not None and warning_once not in dynamo_config.ignore_logging_functions:
        # a new set: torch._dynamo.config.patch (tests, users) restores the old one on exit
        dynamo_config.ignore_logging_functions = {*dynamo_config.ignore_logging_functions,
                                                  compat.loggable_function(dynamo_config, warning_once)}
        changed["ignore_logging_functions"] = warning_once
        log.info("inductor_xent: added transformers' logger.warning_once to "
                 "torch._dynamo.config.ignore_logging_functions (no graph break on it; compiled code does not "
                 "print it); INDUCTOR_XENT_DYNAMO_TUNING=0 leaves Dynamo's configuration alone")
    config.nested_graph_breaks()  # a bad value is an error here too, before anything is traced
    config.capture_dynamic_output_shapes()
    return changed


class DynamoScope:
    """The backend's ``backend_ctx_ctor``: Dynamo entered around every call of a function compiled
    with ``backend="inductor_xent"`` (and around ``explain``'s trace), with ``nested_graph_breaks =
    True`` unless ``INDUCTOR_XENT_NESTED_GRAPH_BREAKS=0`` and ``capture_dynamic_output_shape_ops =
    True`` unless ``INDUCTOR_XENT_CAPTURE_DYNAMIC_OUTPUT_SHAPES=0`` or the compile (``mode``, ``options``:
    torch.compile's) runs CUDA graphs (a graph holding a boolean index's ``nonzero`` runs without
    them, so there the index breaks the graph as torch ships it, an outer scope's capture turned off
    too); the options are restored when the call returns. A
    graph break inside a model's ``forward`` (an ``.item()`` in a router, a call Dynamo skips) then no
    longer ends the graph at forward's return, which would hand the logits to the caller: the
    caller's loss-only graph keeps tracing (9 of the zoo's 189 causal LMs fuse only so).
    Scoped because it changes how Dynamo handles every graph break and PyTorch still ships it off:
    other compiled functions in the process trace as before."""

    def __init__(self, mode: Optional[str] = None, options: Optional[dict] = None):
        self._compile_kwargs = (mode, options or {})  # torch.compile's, read at each call (_cudagraphs)
        self._patch = None
        self._captured = None  # _SCOPE.captured before this scope changed it

    def __enter__(self):
        from torch._dynamo import config as dynamo_config

        changes = {}
        if config.nested_graph_breaks() and not dynamo_config.nested_graph_breaks:
            changes["nested_graph_breaks"] = True
        outer = getattr(_SCOPE, "captured", False)
        if config.capture_dynamic_output_shapes() and not _cudagraphs(*self._compile_kwargs):
            if not dynamo_config.capture_dynamic_output_shape_ops:
                changes["capture_dynamic_output_shape_ops"] = True
        elif outer and dynamo_config.capture_dynamic_output_shape_ops:
            changes["capture_dynamic_output_shape_ops"] = False  # an outer scope's, not for CUDA graphs
        if changes:
            self._patch = dynamo_config.patch(**changes)
            self._patch.__enter__()
        if "capture_dynamic_output_shape_ops" in changes:
            retry_without_capture()
            self._captured, _SCOPE.captured = outer, changes["capture_dynamic_output_shape_ops"]
        return self

    def __exit__(self, *exc) -> bool:
        patch, self._patch = self._patch, None
        if self._captured is not None:
            _SCOPE.captured, self._captured = self._captured, None
        if patch is not None:
            patch.__exit__(*exc)
        return False


RETRIED = "frames_traced_without_capture"  # counters["inductor_xent"]: retried on a data-dependent guard
UNUSED = "frames_traced_without_unused_capture"  # retried because no site used the capture
USED = "inductor_xent_capture_used"  # gm.meta key: the pass fused a site that the capture kept in the graph
_SCOPE = threading.local()  # .captured: a DynamoScope of this thread turned the capture on


class CaptureUnused(RuntimeError):
    """Raised by the backend (``require_capture_used``) for a graph that holds sizes known only at run
    time, kept in by our scope's capture, where no site used them: the frame is traced again without
    the capture (``retry_without_capture``), as torch ships Dynamo."""


def _caused_by(error: BaseException, kinds: tuple) -> Optional[BaseException]:
    """The first of ``error`` and its causes that is one of ``kinds``, or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kinds):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


@contextlib.contextmanager
def captured_pass(gm):
    """Around our pass on ``gm``: afterwards ``require_capture_used(gm)``; where that raises, the
    pass's counts (``counters["inductor_xent"]``) are undone first, since the frame is traced again."""
    from torch._dynamo.utils import counters

    before = Counter(counters["inductor_xent"])
    yield
    try:
        require_capture_used(gm)
    except CaptureUnused:
        mine = counters["inductor_xent"]
        mine.clear()
        mine.update(before)
        raise


def require_capture_used(gm) -> None:
    """Raise ``CaptureUnused`` when our scope's capture is on, ``gm`` (a Dynamo graph after the pass)
    holds a value of a size known only at run time (a boolean index's rows, ``nonzero``) and no site
    the pass fused needed it (``gm.meta[USED]``, set where the pass read a boolean index: a masked sum,
    a head over masked logits). Elsewhere the index then breaks the graph as torch ships Dynamo, so
    the capture changes nothing but the graphs that fuse thanks to it."""
    from torch._dynamo import config as dynamo_config
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    if not getattr(_SCOPE, "captured", False) or not dynamo_config.capture_dynamic_output_shape_ops \
            or gm.meta.get(USED):
        return
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        if value is not None and free_unbacked_symbols(value):
            raise CaptureUnused(f"{node.name} has a size known only at run time and no fused site needs it")


def retry_without_capture() -> bool:
    """Let a frame that the capture cannot help compile as without it. This wraps Dynamo's per-frame
    conversion (``torch._dynamo.convert_frame._compile``, private, in 2.11 and 2.13 alike) once: in a
    frame traced under our scope's capture only, on ``GuardOnDataDependentSymNode`` (code that
    branches on the truth of a boolean-indexed size, ``z = x[m]; if z.shape[0]:``, a hard error where
    Dynamo would otherwise break the graph), a failed compile of the graph (``BackendCompilerFailed``,
    ``TorchRuntimeError``: AOTAutograd rejects some in-place writes around such sizes) or
    ``CaptureUnused`` (no fused site used it), the frame is converted again with the option off; the
    frames resumed after its graph breaks are traced as usual, under the scope. If the second attempt
    fails, its error is the user's, as without the capture. Returns whether the hook is in place."""
    from torch._dynamo import config as dynamo_config
    from torch._dynamo import convert_frame
    from torch._dynamo.utils import counters

    original = getattr(convert_frame, "_compile", None)
    if original is None:
        return False
    if getattr(original, "_inductor_xent_hook", False):
        return True

    from torch._dynamo.exc import BackendCompilerFailed, TorchRuntimeError
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    @functools.wraps(original)
    def _compile(*args, **kwargs):
        if not getattr(_SCOPE, "captured", False) or not dynamo_config.capture_dynamic_output_shape_ops:
            return original(*args, **kwargs)
        try:
            return original(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 (re-raised unless the capture may be its cause)
            cause = _caused_by(error, (GuardOnDataDependentSymNode, CaptureUnused, BackendCompilerFailed,
                                       TorchRuntimeError))
            if cause is None:
                raise
            key = UNUSED if _caused_by(error, (CaptureUnused,)) else RETRIED
            code = args[0] if args else kwargs.get("code")
            counters["inductor_xent"][key] += 1
            log.info("inductor_xent: %s traced again without capture_dynamic_output_shape_ops (%s)",
                     getattr(code, "co_name", code), f"{type(cause).__name__}: {cause}"[:300])
        _SCOPE.captured = False
        try:
            with dynamo_config.patch(capture_dynamic_output_shape_ops=False):
                return original(*args, **kwargs)
        finally:
            _SCOPE.captured = True

    _compile._inductor_xent_hook = True
    convert_frame._compile = _compile
    return True


def honour_backend_ctx() -> bool:
    """Have ``torch.compile(..., backend=<ours>)`` enter our backend's ``backend_ctx_ctor`` around the
    compiled calls, as ``torch._dynamo.optimize(<ours>)`` does. ``torch.compile`` wraps every backend
    in ``torch._TorchCompileWrapper``, and Dynamo's ``get_compiler_fn`` copies the attributes of that
    wrapper (not of the backend inside it) onto what ``_optimize`` reads ``backend_ctx_ctor`` from,
    so the attribute is lost. This wraps ``torch._dynamo.eval_frame.get_compiler_fn`` (the name
    ``_optimize`` and ``optimize_assert`` call) once, to hand the attribute on when the wrapped
    backend is ours (marked ``_inductor_xent_backend``); every other backend gets what it got. It
    acts after the entry point has imported us (inside the wrapper's construction, before
    ``_optimize`` runs), so the first ``torch.compile`` of a process gets it too. Returns whether
    the hook is in place."""
    from torch._dynamo import eval_frame

    original = getattr(eval_frame, "get_compiler_fn", None)
    if original is None:
        return False
    if getattr(original, "_inductor_xent_hook", False):
        return True

    def get_compiler_fn(compiler_fn):
        result = original(compiler_fn)
        ours = getattr(compiler_fn, "compiler_fn", compiler_fn)  # torch.compile's wrapper, or the backend
        ctor = getattr(ours, "backend_ctx_ctor", None)
        if getattr(ours, "_inductor_xent_backend", False) and ctor is not None:
            kwargs = getattr(compiler_fn, "kwargs", {})
            result.backend_ctx_ctor = functools.partial(ctor, kwargs.get("mode"), kwargs.get("options"))
        return result

    get_compiler_fn.__wrapped__ = original
    get_compiler_fn.__doc__ = original.__doc__
    get_compiler_fn._inductor_xent_hook = True
    eval_frame.get_compiler_fn = get_compiler_fn
    return True


def _cudagraphs(mode, options: dict) -> bool:
    """Whether ``torch.compile(mode=mode, options=options)`` runs Inductor's graphs as CUDA graphs (with
    Inductor's configuration as it is now: each call reads it)."""
    from torch._inductor import config as inductor_config

    try:
        patches = compat.list_mode_options(mode)
    except Exception:  # noqa: BLE001 (a bad mode is torch.compile's error to raise, later)
        patches = {}
    return bool({**patches, **options}.get("triton.cudagraphs", inductor_config.triton.cudagraphs))
