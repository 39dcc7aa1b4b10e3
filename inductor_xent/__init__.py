"""inductor_xent: fused linear + cross-entropy for torch.compile, with no change to model code.

Public surface: ``linear_cross_entropy`` (the functional API); ``torch.compile(fn,
backend="inductor_xent")`` (the backend, registered through an entry point).
"""

from .api import linear_cross_entropy
from .explain import explain
from .inductor_pass import install, uninstall

__all__ = ["linear_cross_entropy", "explain", "install", "uninstall"]
__version__ = "0.1.0"
