"""Our pass as Inductor custom graph passes, and the cache guard.

* ``XentPass``: the rewrite with its options (``install()`` / ``uninstall()``, for users who keep
  ``backend="inductor"``), also usable as a ``CustomGraphPass`` for
  ``torch._inductor.config.pre_grad_custom_pass``.
* ``InstalledCompileFx``: what ``install()`` puts in place of ``torch._inductor.compile_fx.compile_fx``
  (which ``torch.compile(backend="inductor")`` looks up at each compile): our pass on the Dynamo
  graph, then Inductor's own ``compile_fx``, its result through ``escape.wrap``. A pre-grad pass
  could do the rewrite but not the wrapping that lets a whole-model ``torch.compile(model)`` (its
  logits returned) fuse; and on torch 2.13+ Inductor runs pre-grad passes after its AOTAutograd
  cache lookup, so a warm cache loaded a fused graph without running the pass (counters and logs
  said 0 fused sites). Running before ``compile_fx`` the pass sees every compile.
* ``CacheSalt``: a no-op ``CustomGraphPass`` the backend puts in ``joint_custom_pre_pass``. Its
  ``uuid()`` is a hash of every source file of this package, and Inductor puts custom-pass uuids
  into both the FX-graph and the AOTAutograd cache keys: editing our backward (which is not in the
  Dynamo graph, so no other key sees it) or our kernels can never replay stale compiled code; nor can
  a change of the settings that our ops read while they are traced (``config.traced``).
* ``DonatedScale``: a ``post_grad_custom_post_pass`` (backend and ``install()``) that lets a
  compiled backward of the store strategy scale its donated saved gradients in place, and the
  log-prob store's write its dz over its donated exp-logits.

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

from . import compat, config

log = logging.getLogger(__name__)
_PACKAGE = pathlib.Path(__file__).resolve().parent


@functools.cache
def source_hash() -> bytes:
    """Hash of every Python file of the package (kernels, op, backward, pass)."""
    files = tuple(sorted(str(p) for p in _PACKAGE.rglob("*.py")))
    return compat.hash_files(files)


class CacheSalt(CustomGraphPass):
    """Does nothing to the graph; its uuid keys Inductor's caches on our sources and on the settings
    our ops read while they are traced (``config.traced``: a backward traced under
    ``INDUCTOR_XENT_IMPL=chunked`` reads its stored rows in row order, one traced for the Triton kernels
    in the order they were compacted to; the same graph otherwise)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        return None

    def uuid(self) -> Optional[Any]:
        return ("inductor_xent.CacheSalt", config.traced(), source_hash())


class XentPass(CustomGraphPass):
    """The rewrite, run by Inductor on the Dynamo graph before AOTAutograd."""

    def __init__(self, allow_escaping_logits: bool = False, strategy: Optional[str] = None, store_budget=None):
        self.allow_escaping_logits = allow_escaping_logits
        self.strategy = strategy
        self.store_budget = store_budget

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.run(graph.owning_module, can_return=False)  # a pre-grad pass cannot wrap the compiled result

    def run(self, gm: torch.fx.GraphModule, can_return: bool) -> list:
        from . import patterns

        return patterns.run(gm, allow_escaping_logits=self.allow_escaping_logits, strategy=self.strategy,
                            store_budget=self.store_budget, can_return=can_return)

    def uuid(self) -> Optional[Any]:
        # the strategy knobs change the rewrite: they are part of the cache key (env defaults included)
        knobs = (self.strategy or config.strategy(), str(self.store_budget or config.store_budget()))
        return ("inductor_xent.XentPass", self.allow_escaping_logits, knobs, source_hash())


class DonatedScale(CustomGraphPass):
    """Post-grad, backward graphs: store's ``store_scale(g, s)`` becomes ``store_scale_(g, s)`` (in
    place; on the GPU nothing moves for ``s`` = 1) where ``g`` is a saved gradient that autograd
    donates to this backward and nothing else in the graph reads it. Without it, Inductor writes
    ``g * s`` to a new buffer: a read and a write of the weight gradient (1 GiB at llama3-8b) per
    step. Likewise ``linear_logprob_store_bwd`` becomes ``linear_logprob_store_bwd_`` (dz written over
    the stored exp-logits, two whole-vocabulary GEMMs) where its ``e`` is donated and read by it
    alone. Left alone under CUDA graphs (a mutated input would keep the backward out of them)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        from torch._inductor import config as ic

        from . import ops

        nodes = [*graph.find_nodes(op="call_function", target=ops.STORE_SCALE),
                 *graph.find_nodes(op="call_function", target=ops.LOGPROB_STORE_BACKWARD)]
        if not nodes or ic.triton.cudagraphs:
            return
        donated = compat.donated_backward_inputs()
        placeholders = graph.find_nodes(op="placeholder")
        # AOTAutograd's backward graphs take the tangents as ``tangents_<i>``; a forward, inference or
        # compiled-autograd graph has none (and its donated indices, if any, are another graph's)
        if not donated or not any(p.name.startswith("tangents") for p in placeholders):
            return
        position = {p: i for i, p in enumerate(placeholders)}
        for node in nodes:
            if node.target is ops.STORE_SCALE:
                g, s = node.args
                if position.get(g) not in donated or len(g.users) != 1:
                    continue
                with graph.inserting_before(node):
                    graph.call_function(ops.STORE_SCALE_, (g, s))
                node.replace_all_uses_with(g)
                graph.erase_node(node)
                log.debug("inductor_xent: %s scaled in place (donated)", g.name)
                continue
            e = node.args[10] if len(node.args) > 10 else node.kwargs["e"]  # the stored exp-logits
            if position.get(e) not in donated or len(e.users) != 1:
                continue
            node.target = ops.LOGPROB_STORE_BACKWARD_
            log.debug("inductor_xent: the log-prob store's dz written over %s (donated)", e.name)

    def uuid(self) -> Optional[Any]:
        # what it does depends on the donation, which Inductor's graph cache key does not hold
        donated = compat.donated_backward_inputs()
        return ("inductor_xent.DonatedScale", None if donated is None else tuple(sorted(donated)), source_hash())


class InstalledCompileFx:
    """``torch._inductor.compile_fx.compile_fx`` while ``install()``ed (see the module docstring)."""

    def __init__(self, original: Any, ours: XentPass):
        self.original, self.ours = original, ours
        self.__wrapped__ = original

    def __call__(self, model_, example_inputs_, *args, **kwargs):
        from . import escape, patterns

        # compile_fx calls itself (with config patches); the backend ran the pass already
        if not isinstance(model_, torch.fx.GraphModule) or model_.meta.get(patterns.DONE):
            return self.original(model_, example_inputs_, *args, **kwargs)
        self.ours.run(model_, can_return=True)
        return escape.wrap(model_, self.original(model_, example_inputs_, *args, **kwargs))


CACHE_SALT = CacheSalt()
DONATED_SCALE = DonatedScale()
_installed: list = []  # [InstalledCompileFx] while installed


def install(*, allow_escaping_logits: bool = False, strategy: Optional[str] = None, store_budget=None) -> None:
    """Run our pass for every ``torch.compile(..., backend="inductor")`` from now on
    (``strategy`` / ``store_budget``: as the backend's ``xent.*`` options), whole-model compiles
    that return the logits included (escape.py), e.g. HF ``Trainer(torch_compile=True)``.

    Puts ``InstalledCompileFx`` in place of ``torch._inductor.compile_fx.compile_fx`` (our pass runs
    on the Dynamo graph before Inductor's own passes, the user's pre-grad passes included, which
    keep running), adds the cache salt to ``joint_custom_pre_pass`` and the in-place scaling of
    store's donated gradients to ``post_grad_custom_post_pass``. Idempotent; undo with
    ``uninstall()``. Already compiled functions are not recompiled.
    """
    from torch._inductor import compile_fx as cfx
    from torch._inductor import config as ic

    if strategy is not None:
        config.check_strategy(strategy)
    if store_budget is not None:
        config.parse_budget(store_budget)
    uninstall()
    wrapper = InstalledCompileFx(cfx.compile_fx, XentPass(allow_escaping_logits, strategy, store_budget))
    cfx.compile_fx = wrapper
    ic.joint_custom_pre_pass = compat.add_pass(ic.joint_custom_pre_pass, CACHE_SALT)
    ic.post_grad_custom_post_pass = compat.add_pass(ic.post_grad_custom_post_pass, DONATED_SCALE)
    _installed.append(wrapper)
    log.info("inductor_xent: installed in front of Inductor's compile_fx")


def uninstall() -> None:
    """Remove what ``install()`` added; the user's own passes stay as they were."""
    from torch._inductor import compile_fx as cfx
    from torch._inductor import config as ic

    while _installed:
        wrapper = _installed.pop()
        if cfx.compile_fx is wrapper:
            cfx.compile_fx = wrapper.original
        ic.joint_custom_pre_pass = compat.remove_pass(ic.joint_custom_pre_pass, CACHE_SALT)
        ic.post_grad_custom_post_pass = compat.remove_pass(ic.post_grad_custom_post_pass, DONATED_SCALE)
