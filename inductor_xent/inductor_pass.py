"""Our pass as Inductor custom graph passes, and the cache guard.

* ``XentPass``: the rewrite as a ``CustomGraphPass`` for ``torch._inductor.config.pre_grad_custom_pass``
  (``install()`` / ``uninstall()``, for users who keep ``backend="inductor"``).
* ``CacheSalt``: a no-op ``CustomGraphPass`` the backend puts in ``joint_custom_pre_pass``. Its
  ``uuid()`` is a hash of every source file of this package, and Inductor puts custom-pass uuids
  into both the FX-graph and the AOTAutograd cache keys: editing our backward (which is not in the
  Dynamo graph, so no other key sees it) or our kernels can never replay stale compiled code.

Both compose with the user's own passes through ``compat.add_pass`` (one callable on torch 2.11,
lists on 2.13+).
"""

from __future__ import annotations

import functools
import logging
import pathlib
from typing import Any, Optional

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import compat

log = logging.getLogger(__name__)
_PACKAGE = pathlib.Path(__file__).resolve().parent


@functools.cache
def source_hash() -> bytes:
    """Hash of every Python file of the package (kernels, op, backward, pass)."""
    files = tuple(sorted(str(p) for p in _PACKAGE.rglob("*.py")))
    return compat.hash_files(files)


class CacheSalt(CustomGraphPass):
    """Does nothing to the graph; its uuid keys Inductor's caches on our sources."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        return None

    def uuid(self) -> Optional[Any]:
        return ("inductor_xent.CacheSalt", source_hash())


class XentPass(CustomGraphPass):
    """The rewrite, run by Inductor on the Dynamo graph before AOTAutograd."""

    def __init__(self, allow_escaping_logits: bool = False, strategy: Optional[str] = None, store_budget=None):
        self.allow_escaping_logits = allow_escaping_logits
        self.strategy = strategy
        self.store_budget = store_budget

    def __call__(self, graph: torch.fx.Graph) -> None:
        from . import patterns

        patterns.run(graph.owning_module, allow_escaping_logits=self.allow_escaping_logits, strategy=self.strategy,
                     store_budget=self.store_budget)

    def uuid(self) -> Optional[Any]:
        from . import config

        # the strategy knobs change the rewrite: they are part of the cache key (env defaults included)
        knobs = (self.strategy or config.strategy(), str(self.store_budget or config.store_budget()))
        return ("inductor_xent.XentPass", self.allow_escaping_logits, knobs, source_hash())


CACHE_SALT = CacheSalt()
_installed: list = []  # [(XentPass, CacheSalt)] while installed


def install(*, allow_escaping_logits: bool = False, strategy: Optional[str] = None, store_budget=None) -> None:
    """Run our pass for every ``torch.compile(..., backend="inductor")`` from now on
    (``strategy`` / ``store_budget``: as the backend's ``xent.*`` options).

    Appends it to ``torch._inductor.config.pre_grad_custom_pass`` (after any pass of the user's,
    which keeps running) and adds the cache salt to ``joint_custom_pre_pass``. Idempotent; undo with
    ``uninstall()``. Already compiled functions are not recompiled.
    """
    from torch._inductor import config as ic

    from . import strategy as _strategy

    if strategy is not None:
        _strategy.check_strategy(strategy)
    if store_budget is not None:
        _strategy.parse_budget(store_budget)
    uninstall()
    ours = XentPass(allow_escaping_logits, strategy, store_budget)
    ic.pre_grad_custom_pass = compat.add_pass(ic.pre_grad_custom_pass, ours)
    ic.joint_custom_pre_pass = compat.add_pass(ic.joint_custom_pre_pass, CACHE_SALT)
    _installed.append(ours)
    log.info("inductor_xent: installed as Inductor's pre-grad custom pass")


def uninstall() -> None:
    """Remove what ``install()`` added; the user's own passes stay as they were."""
    from torch._inductor import config as ic

    while _installed:
        ours = _installed.pop()
        ic.pre_grad_custom_pass = compat.remove_pass(ic.pre_grad_custom_pass, ours)
        ic.joint_custom_pre_pass = compat.remove_pass(ic.joint_custom_pre_pass, CACHE_SALT)
