"""``torch.compile(fn, backend="inductor_xent")``: rewrite the Dynamo graph, then hand it to Inductor.

The entry point (``torch_dynamo_backends`` in pyproject.toml) names ``inductor_xent`` below; this
module must not also ``register_backend`` that name (Dynamo would assert "duplicate name").

``options`` holds Inductor config keys (passed through as config patches, validated by Inductor) and
our own keys, prefixed ``xent.``:

* ``xent.allow_escaping_logits`` (bool, default False): fuse the loss even when the logits have
  other users in the graph (e.g. an auxiliary loss on them); they are then still computed for
  those users. Logits the compiled function only returns need no option: the op writes them and
  their gradient is attached outside the graph (escape.py).
* ``xent.inner`` (``"inductor"`` default | ``"aot_eager"``): what compiles the rewritten graph.
  ``aot_eager`` runs AOTAutograd with Inductor's decompositions and partitioner but no code
  generation: fast CPU tests.
* ``xent.enable`` (bool, default True): False skips the rewrite (A/B comparisons).
* ``xent.strategy`` (``"auto"`` default | ``"recompute"`` | ``"store"``) and ``xent.store_budget``
  (bytes, ``"2GiB"``, or a fraction of the logits, ``"0.5x"``): how fused sites compute their
  gradients (inductor_xent/strategy.py); default from ``INDUCTOR_XENT_STRATEGY`` /
  ``INDUCTOR_XENT_STORE_BUDGET``.

Dynamo options: Dynamo traces before any backend runs, so the options that decide where it breaks
the graph are set before it traces.

* ``dynamo_tuning.tune_dynamo`` lets Dynamo skip transformers' ``warning_once`` calls, for the whole
  process: set when this module is imported (when ``torch.compile(..., backend="inductor_xent")``
  looks the backend up through the entry point) and again at each call of the backend (idempotent),
  for a transformers imported after ``torch.compile``; ``INDUCTOR_XENT_DYNAMO_TUNING=0`` switches
  it off. The only setting the package changes for the whole process without being asked
  (``install()`` is asked).
* ``dynamo_tuning.DynamoScope``, this backend's ``backend_ctx_ctor``, sets ``nested_graph_breaks``
  (unless ``INDUCTOR_XENT_NESTED_GRAPH_BREAKS=0``) and ``capture_dynamic_output_shape_ops`` (unless
  ``INDUCTOR_XENT_CAPTURE_DYNAMIC_OUTPUT_SHAPES=0`` or the compile runs CUDA graphs; a frame it
  cannot trace so is traced again without it) only while a function compiled with this backend runs;
  ``dynamo_tuning.honour_backend_ctx`` makes ``torch.compile`` enter it, as
  ``torch._dynamo.optimize`` does (torch.compile's backend wrapper hides the attribute).
"""

from __future__ import annotations

from typing import Any, Optional

from . import compat, config, dynamo_tuning, escape, patterns
from .inductor_pass import CACHE_SALT, DONATED_SCALE

XENT_OPTIONS = {"allow_escaping_logits": bool, "inner": str, "enable": bool, "strategy": str,
                "store_budget": (str, int, float)}
INNER = ("inductor", "aot_eager")


def split_options(options: Optional[dict]) -> tuple[dict, dict]:
    """(our ``xent.*`` options without the prefix, Inductor's options), validating ours."""
    ours, theirs = {"allow_escaping_logits": False, "inner": "inductor", "enable": True, "strategy": None,
                    "store_budget": None}, {}
    for key, value in (options or {}).items():
        if not key.startswith("xent."):
            theirs[key] = value
            continue
        name = key[len("xent."):]
        if name not in XENT_OPTIONS:
            raise ValueError(f"unknown inductor_xent option {key!r}; known: "
                             + ", ".join(f"xent.{k}" for k in XENT_OPTIONS))
        kinds = XENT_OPTIONS[name] if isinstance(XENT_OPTIONS[name], tuple) else (XENT_OPTIONS[name],)
        if not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds:
            raise TypeError(f"option {key!r} must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}")
        ours[name] = value
    if ours["inner"] not in INNER:
        raise ValueError(f"option 'xent.inner' must be one of {INNER}, got {ours['inner']!r}")
    if ours["strategy"] is not None:
        config.check_strategy(ours["strategy"])
    if ours["store_budget"] is not None:
        config.parse_budget(ours["store_budget"])
    return ours, theirs


def config_patches(mode: Optional[str], inductor_options: dict) -> dict:
    """Inductor config patches for ``mode`` and ``options``, plus our cache salt."""
    from torch._inductor import config as ic

    patches: dict[str, Any] = compat.list_mode_options(mode)
    known = compat.inductor_config_keys()
    for key, value in inductor_options.items():
        name = key.replace("-", "_")
        if name not in known:
            raise RuntimeError(f"Unexpected optimization option {key} (not an Inductor config key "
                               "and not an inductor_xent 'xent.*' option)")
        patches[name] = value
    current = patches.get("joint_custom_pre_pass", ic.joint_custom_pre_pass)
    patches["joint_custom_pre_pass"] = compat.add_pass(current, CACHE_SALT)
    current = patches.get("post_grad_custom_post_pass", ic.post_grad_custom_post_pass)
    patches["post_grad_custom_post_pass"] = compat.add_pass(current, DONATED_SCALE)
    return patches


def inductor_xent(gm, example_inputs, *, mode: Optional[str] = None, options: Optional[dict] = None):
    """The backend: our rewrite on the Dynamo graph (torch IR, before autograd), then ``compile_fx``."""
    dynamo_tuning.tune_dynamo()  # for the frames Dynamo traces from now on
    ours, theirs = split_options(options)
    patches = config_patches(mode, theirs)  # validates Inductor's keys whichever inner compiler runs
    with dynamo_tuning.captured_pass(gm):  # a graph the capture did not help: traced again without it
        if ours["enable"]:
            patterns.run(gm, allow_escaping_logits=ours["allow_escaping_logits"], strategy=ours["strategy"],
                         store_budget=ours["store_budget"], can_return=True)
    if ours["inner"] == "aot_eager":
        return escape.wrap(gm, compat.aot_eager(gm, example_inputs))
    return escape.wrap(gm, compat.compile_fx(gm, example_inputs, patches))


inductor_xent.backend_ctx_ctor = dynamo_tuning.DynamoScope  # entered around every compiled call
inductor_xent._inductor_xent_backend = True
dynamo_tuning.honour_backend_ctx()
dynamo_tuning.tune_dynamo()  # at lookup: the entry point imports this module before Dynamo traces anything
