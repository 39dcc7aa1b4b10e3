"""inductor_xent: fused linear + cross-entropy for torch.compile, with no change to model code.

Public surface: ``linear_cross_entropy``, ``linear_log_probs`` (``top_k=``: the kept-set
log-probs), ``linear_distillation_loss``, ``linear_topk`` and ``linear_gather`` (the functional API);
``torch.compile(fn, backend="inductor_xent")`` (the backend, registered through an entry point).
"""

from . import logs as _logs
from .api import LogProbs, linear_cross_entropy, linear_log_probs
from .distill import linear_distillation_loss
from .explain import explain
from .gathered import linear_gather
from .inductor_pass import install, uninstall
from .topk import TopK, linear_topk

__all__ = ["linear_cross_entropy", "linear_log_probs", "linear_distillation_loss", "linear_topk", "linear_gather",
           "LogProbs", "TopK", "explain", "install", "uninstall"]


def _backend(gm, example_inputs, **kwargs):
    from .backend import inductor_xent

    return inductor_xent(gm, example_inputs, **kwargs)


def _register_without_entry_point() -> None:
    """Make ``backend="inductor_xent"`` work when the package runs from a source tree (PYTHONPATH,
    no ``pip install``), where its ``torch_dynamo_backends`` entry point does not exist. When the
    entry point exists Dynamo registers the backend itself, and registering it here as well would
    trip Dynamo's duplicate-name assertion. Registering stands in for the entry point's import of
    ``backend.py``, so it also applies the Dynamo tuning that import applies (``dynamo_tuning.tune_dynamo``)."""
    from importlib.metadata import entry_points

    if any(ep.name == "inductor_xent" for ep in entry_points(group="torch_dynamo_backends")):
        return
    import torch._dynamo

    if "inductor_xent" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(compiler_fn=_backend, name="inductor_xent")
        from . import dynamo_tuning

        dynamo_tuning.tune_dynamo()


_register_without_entry_point()
_logs.register()
__version__ = "0.1.0"
