"""What the pass says, through torch's own logging: ``TORCH_LOGS`` and tlparse.

* ``TORCH_LOGS=inductor_xent`` logs every site fused or declined, with its reason (INFO, loggers
  under ``inductor_xent``); ``TORCH_LOGS=+inductor_xent`` adds each graph before and after the pass
  (DEBUG). From Python: ``torch._logging.set_logs(modules={"inductor_xent": logging.DEBUG})``. The
  package registers ``inductor_xent`` in torch's log registry when it is imported (``TORCH_LOGS=help``
  lists it).
* ``TORCH_TRACE=<dir>`` (then ``tlparse``): the before/after graphs are structured-trace artifacts
  named ``inductor_xent_graph_before`` / ``inductor_xent_graph_after``, next to Dynamo's and
  Inductor's graphs of the same compile id.
* The pass runs under torch's ``GraphTransformObserver`` as ``inductor_xent``: with Inductor's
  ``trace.log_url_for_graph_xform`` set it draws the graph before and after (pydot), and
  ``torch._inductor.config.disabled_passes = "inductor_xent"`` switches the pass off.

``INDUCTOR_XENT_DUMP_GRAPHS=1``, the old switch, still logs the graphs at INFO, with a deprecation
warning naming ``TORCH_LOGS=+inductor_xent``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Optional, TypeVar

import torch

from . import config

T = TypeVar("T")
LOG = "inductor_xent"
ARTIFACTS = {"before": "inductor_xent_graph_before", "after": "inductor_xent_graph_after"}
DEPRECATED = ("INDUCTOR_XENT_DUMP_GRAPHS is deprecated: TORCH_LOGS=+inductor_xent logs the graphs before and after "
              "the pass (and TORCH_TRACE records them for tlparse)")


def register() -> None:
    """Make ``inductor_xent`` a log of torch's registry (``TORCH_LOGS=help`` lists it)."""
    from torch._logging import _internal

    if not _internal.log_registry.is_log(LOG):
        _internal.register_log(LOG, LOG)


def graph(log: logging.Logger, gm: torch.fx.GraphModule, when: str) -> None:
    """Show ``gm`` ``when`` ("before" or "after") the pass: a tlparse artifact, a DEBUG record (an INFO
    one under the deprecated ``INDUCTOR_XENT_DUMP_GRAPHS``)."""
    legacy = config.dump_graphs()
    if legacy and when == "before":
        warnings.warn(DEPRECATED, DeprecationWarning, stacklevel=3)
    level = logging.INFO if legacy else logging.DEBUG
    text = None
    if log.isEnabledFor(level):
        text = gm.print_readable(print_output=False)
        log.log(level, "inductor_xent: graph %s the pass:\n%s", when, text)
    torch._logging.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": ARTIFACTS[when], "encoding": "string"},
        payload_fn=lambda: text if text is not None else gm.print_readable(print_output=False),
    )


def apply(gm: torch.fx.GraphModule, pass_fn: Callable[[torch.fx.GraphModule], T]) -> Optional[T]:
    """``pass_fn(gm)`` under torch's ``GraphTransformObserver`` (pass name ``inductor_xent``): it
    records the graph before and after when Inductor's ``trace.log_url_for_graph_xform`` is set, and
    skips the pass (None) when ``torch._inductor.config.disabled_passes`` names it."""
    try:
        from torch.fx.passes.graph_transform_observer import GraphTransformObserver
    except ImportError:  # pragma: no cover - every supported torch has it
        return pass_fn(gm)
    return GraphTransformObserver(gm, LOG).apply_gm_pass(pass_fn)
