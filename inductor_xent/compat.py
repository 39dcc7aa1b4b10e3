"""Every difference between the torch releases we support (2.11 on the GPU box, 2.13+ in CI) lives here.

Only the seams: what the package changes in Dynamo's behaviour, and why, is dynamo_tuning.py.

* Custom graph passes: 2.11 takes one callable per hook; 2.13+ also takes a list or tuple
  (``torch._inductor.custom_graph_pass.get_custom_graph_passes``). ``add_pass`` / ``remove_pass``
  compose ours with whatever the user already set, in either form.
* ``compile_fx`` grew ``compile_region_name`` in 2.13; we never pass it.
* ``aot_eager_decomp_partition`` (the fast CPU test path: AOTAutograd + Inductor's decompositions and
  partitioner, no code generation) exists in both.
* DTensor methods in Dynamo graphs: 2.13+ records ``dt.redistribute(...)`` / ``dt.to_local(...)`` as
  ``call_method`` nodes; 2.11 as a ``call_function`` of a closure named ``prim_redistribute`` /
  ``prim_to_local`` that holds the arguments (``dtensor_method`` reads both).
* Dynamo's ``ignore_logging_functions`` (a set; ``LoggingLoggerVariable.call_method`` drops a
  ``logging.Logger`` method call whose bound method or ``__func__`` is in it) and
  ``nested_graph_breaks`` (a bool, off by default) exist in both (dynamo_tuning.py sets them);
  2.11's compilation-metrics log cannot write a function in the first (``loggable_function``).
* TF32 for fp32 CUDA matmuls: 2.9+ has ``fp32_precision`` ("tf32" / "ieee" / "none": the legacy
  flag decides) beside the legacy ``allow_tf32``, and reading ``allow_tf32`` raises once the new API
  set "tf32" (HF's ``TrainingArguments`` sets ``torch.backends.fp32_precision`` on torch >= 2.9):
  ``tf32_matmuls`` reads whichever decides; ``ieee_fp32_matmuls`` turns TF32 off for a block.
* Nested graph breaks: 2.11's Dynamo resumes a nested frame after a graph break with its caller's
  globals (MusicGen's training forward under transformers 5.25, behind a decorator from another module:
  ``NameError: name 'random' is not defined``); 2.13 resumes it with its own. The backend turns them on
  by default only where they are sound (``nested_graph_breaks_sound``); 2.12 was not checked.
* Python operators in Dynamo graphs: 2.11 records some as the tensor's dunder method
  (``argmax.__eq__(y)``), 2.13 as ``operator.eq``: ``patterns._fx.is_call`` reads both.
* ``graph_retained``: whether the running backward keeps its graph (``retain_graph`` /
  ``create_graph``), from ``torch._C._autograd._get_current_graph_task_keep_graph`` (private, in
  both); where it is missing the answer is True, the safe one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

try:  # 2.13+
    from torch._inductor.custom_graph_pass import get_custom_graph_passes as _get_custom_graph_passes

    PASS_LISTS = True
except ImportError:  # 2.11: one callable per hook
    _get_custom_graph_passes = None
    PASS_LISTS = False


def custom_passes(value: Any) -> list:
    """The passes held by one custom-pass config value, as a list (``None`` -> ``[]``)."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, ComposedPass):
        return list(value.passes)
    return [value]


class ComposedPass(CustomGraphPass):
    """Several passes behind one callable, for torch 2.11 whose hooks hold a single callable.

    Its uuid combines the members' uuids; a member without one (a plain function) makes it None,
    which tells Inductor not to cache: the same rule Inductor applies to that member alone.
    """

    def __init__(self, passes):
        self.passes = tuple(passes)

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> Optional[Any]:
        ids = []
        for p in self.passes:
            uid = p.uuid() if hasattr(p, "uuid") else None
            if uid is None:
                return None
            ids.append(uid)
        return tuple(ids)


def hash_files(paths: tuple[str, ...]) -> bytes:
    """Inductor's ``get_hash_for_files`` (what its docs recommend for ``uuid()``), or the same idea
    with hashlib where a release lacks it."""
    try:
        from torch._inductor.custom_graph_pass import get_hash_for_files
    except ImportError:
        import hashlib

        h = hashlib.sha256()
        for path in paths:
            h.update(path.encode())
            with open(path, "rb") as f:
                h.update(f.read())
        return h.digest()
    return get_hash_for_files(paths)


def _pack(passes: list) -> Any:
    if not passes:
        return None
    if len(passes) == 1:
        return passes[0]
    return list(passes) if PASS_LISTS else ComposedPass(passes)


def add_pass(value: Any, ours: Callable) -> Any:
    """The config value ``value`` with ``ours`` appended (after the user's own passes); idempotent."""
    passes = custom_passes(value)
    if any(p is ours for p in passes):
        return value
    if isinstance(value, tuple) and PASS_LISTS:
        return (*value, ours)
    return _pack([*passes, ours])


def remove_pass(value: Any, ours: Callable) -> Any:
    """The config value ``value`` without ``ours``; the user's passes stay, in their order."""
    passes = custom_passes(value)
    if not any(p is ours for p in passes):
        return value
    rest = [p for p in passes if p is not ours]
    if isinstance(value, tuple) and PASS_LISTS and len(rest) != 1:
        return tuple(rest) or None
    return _pack(rest)


def list_mode_options(mode: Optional[str], dynamic: Optional[bool] = None) -> dict:
    """Inductor's config patches for ``torch.compile(mode=...)`` (same function in 2.11 and 2.13+)."""
    if mode is None or mode == "default":
        return {}
    from torch._inductor import list_mode_options as _list_mode_options

    return dict(_list_mode_options(mode, dynamic))


def compile_fx(gm: torch.fx.GraphModule, example_inputs, config_patches: dict):
    from torch._inductor.compile_fx import compile_fx as _compile_fx

    return _compile_fx(gm, example_inputs, config_patches=config_patches or None)


def aot_eager(gm: torch.fx.GraphModule, example_inputs):
    """AOTAutograd with Inductor's decompositions and partitioner, run eagerly: fast CPU tests."""
    from torch._dynamo.backends.debugging import aot_eager_decomp_partition

    return aot_eager_decomp_partition(gm, example_inputs)


def tf32_matmuls() -> bool:
    """Whether torch runs fp32 CUDA matmuls in TF32 now, whichever API set it, never reading the
    legacy flag where the new API decides (reading it then raises). "none" inherits from the level
    above: 2.13 reports the inherited value at the matmul level, 2.11 its own "none" (a global
    "tf32" set by HF's TrainingArguments failed this test on the GPU box until the levels above were
    read); with every level "none" the legacy flag decides."""
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        return bool(matmul.allow_tf32)
    for level in (matmul, torch.backends.cuda, torch.backends):
        precision = getattr(level, "fp32_precision", "none")
        if precision in ("tf32", "ieee"):
            return precision == "tf32"
    try:
        return bool(matmul.allow_tf32)
    except RuntimeError:  # a mix this function does not know: torch's float32 matmul precision
        return torch.get_float32_matmul_precision() != "highest"


@contextlib.contextmanager
def ieee_fp32_matmuls() -> Iterator[None]:
    """fp32 CUDA matmuls in IEEE inside the block (a reference's, a test's), restored after, through
    the API that reads back without raising."""
    matmul = torch.backends.cuda.matmul
    field = "fp32_precision" if hasattr(matmul, "fp32_precision") else "allow_tf32"
    old = getattr(matmul, field)
    setattr(matmul, field, "ieee" if field == "fp32_precision" else False)
    try:
        yield
    finally:
        setattr(matmul, field, old)


def nested_graph_breaks_sound() -> bool:
    """Whether Dynamo resumes a nested frame with its own globals (torch 2.13+): the default of
    ``INDUCTOR_XENT_NESTED_GRAPH_BREAKS``."""
    return torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)


def graph_retained() -> bool:
    """Whether the backward pass now running keeps its graph (saved tensors live on after it):
    True where torch cannot say."""
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep is None else bool(keep())  # outside a backward pass torch says True


def donated_backward_inputs() -> Optional[frozenset]:
    """Placeholder positions of the backward graph Inductor is compiling now whose tensors autograd
    donates to it (saved tensors it frees after this backward and that alias no input or output:
    AOTAutograd's ``bw_donated_idxs``, what Inductor's own ``DonatedBuffer`` reads); None where
    this torch does not say. Empty when the backward keeps its graph (``retain_graph``): AOTAutograd
    then compiles it without donation, and refuses a later ``retain_graph`` backward of one that
    had donated buffers."""
    try:
        from torch._inductor.utils import get_donated_idxs
    except ImportError:
        return None
    idxs = get_donated_idxs()
    return None if idxs is None else frozenset(idxs)


def inductor_config_keys() -> set:
    from torch._inductor import config

    return set(config.get_config_copy())


def dtensor_method(node: torch.fx.Node) -> Optional[tuple[str, tuple, dict]]:
    """(method name, arguments after the tensor, keyword arguments) of a tensor method call in a
    Dynamo graph, including 2.11's ``prim_<method>`` closures for DTensor methods; None otherwise."""
    if node.op == "call_method":
        return node.target, tuple(node.args[1:]), dict(node.kwargs)
    fn = node.target if node.op == "call_function" else None
    name = getattr(fn, "__name__", "")
    if not name.startswith("prim_") or getattr(fn, "__closure__", None) is None or len(node.args) != 1:
        return None
    cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))
    if "args_as_value" not in cells or "kwargs_as_value" not in cells:
        return None
    return name[len("prim_"):], tuple(cells["args_as_value"]), dict(cells["kwargs_as_value"])


def dynamo_frame(gm: Any) -> Optional[str]:
    """The name of the Python function Dynamo traced into ``gm`` (``torch_dynamo_resume_in_<fn>_at_<line>``
    for the code after a graph break), from the reason Dynamo records on the graph; None when unknown."""
    stack = getattr(getattr(gm, "compile_subgraph_reason", None), "user_stack", None)
    return getattr(stack[-1], "name", None) if stack else None


class _LoggableFunction(str):
    """A function as a member of a Dynamo option set that Dynamo's compilation-metrics log can write.

    torch 2.11 writes its whole Dynamo configuration with ``json.dumps`` at the end of every
    compilation and leaves ``ignore_logging_functions`` off its blocklist (2.13 has it on), so a
    function in that set makes every compilation log "Unexpected exception logging compilation
    metrics ... _lru_cache_wrapper is not JSON serializable". This stand-in is written as the
    function's name and is equal to the function (same hash), which is all Dynamo's membership test
    (``method in ignore_set or function in ignore_set``) asks of it."""

    def __new__(cls, fn: Callable):
        self = super().__new__(cls, f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}")
        self.fn = fn
        return self

    def __hash__(self) -> int:
        return hash(self.fn)

    def __eq__(self, other) -> bool:
        return other is self.fn or (isinstance(other, _LoggableFunction) and other.fn is self.fn)

    def __ne__(self, other) -> bool:
        return not self.__eq__(other)

    def __reduce__(self):
        return (_LoggableFunction, (self.fn,))


def loggable_function(dynamo_config, fn: Callable) -> Callable:
    """``fn`` as a member of a Dynamo option set (``ignore_logging_functions``): ``fn`` itself, or its
    stand-in where this torch's compilation-metrics log cannot write it (``_LoggableFunction``)."""
    from torch._dynamo import utils as dynamo_utils

    probe = getattr(dynamo_utils, "_get_dynamo_config_for_logging", None)
    if probe is None:
        return fn
    with dynamo_config.patch(ignore_logging_functions={*dynamo_config.ignore_logging_functions, fn}):
        try:
            probe()
        except TypeError:
            return _LoggableFunction(fn)
    return fn
