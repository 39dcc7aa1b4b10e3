"""The backend: entry point, options, the real Inductor CPU path, the cache guard, install()."""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor import compile_fx as cfx
from torch._inductor import config as ic
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import fresh_cache

import inductor_xent
from inductor_xent import backend, compat, config, dynamo_tuning, escape, ops
from inductor_xent import inductor_pass as install

from .helpers import SPELLINGS, Recorder, V, assert_parity, counting, fused_ops, leaves, make_inputs

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_entry_point_registers_backend():
    """After pip install the name resolves with no import of ours (the entry point); from a source
    tree (PYTHONPATH, no install) importing the package registers it."""
    from importlib.metadata import entry_points

    from torch._dynamo.backends.registry import lookup_backend

    assert "inductor_xent" in torch._dynamo.list_backends(exclude_tags=())
    if any(ep.name == "inductor_xent" for ep in entry_points(group="torch_dynamo_backends")):
        assert lookup_backend("inductor_xent") is backend.inductor_xent
    else:
        assert lookup_backend("inductor_xent").__name__ == "_backend"


def test_options_split_and_validate():
    ours, theirs = backend.split_options({"xent.inner": "aot_eager", "max_autotune": True})
    assert ours == {"allow_escaping_logits": False, "inner": "aot_eager", "enable": True, "strategy": None,
                    "store_budget": None}
    assert theirs == {"max_autotune": True}
    ours, _ = backend.split_options({"xent.strategy": "store", "xent.store_budget": "2GiB"})
    assert ours["strategy"] == "store" and ours["store_budget"] == "2GiB"
    with pytest.raises(ValueError, match="strategy must be one of 'auto', 'recompute', 'store', got 'fastest'"):
        backend.split_options({"xent.strategy": "fastest"})
    with pytest.raises(ValueError, match="store budget -5 must be a finite number >= 0"):
        backend.split_options({"xent.store_budget": -5})
    with pytest.raises(ValueError, match="unknown inductor_xent option 'xent.nope'"):
        backend.split_options({"xent.nope": 1})
    with pytest.raises(TypeError, match="'xent.allow_escaping_logits' must be bool"):
        backend.split_options({"xent.allow_escaping_logits": "yes"})
    with pytest.raises(ValueError, match="'xent.inner' must be one of"):
        backend.split_options({"xent.inner": "eager"})


def test_mode_and_inductor_options_become_patches():
    patches = backend.config_patches("max-autotune-no-cudagraphs", {"epilogue-fusion": False})
    assert patches["max_autotune"] is True and patches["coordinate_descent_tuning"] is True
    assert patches["epilogue_fusion"] is False
    assert install.CACHE_SALT in compat.custom_passes(patches["joint_custom_pre_pass"])
    assert install.DONATED_SCALE in compat.custom_passes(patches["post_grad_custom_post_pass"])
    with pytest.raises(RuntimeError, match="not an Inductor config key"):
        backend.config_patches(None, {"no_such_knob": 1})


class _UserPass(CustomGraphPass):
    def __init__(self):
        self.calls = 0

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return "user-pass"


def test_cache_salt_keeps_user_joint_pass():
    user = _UserPass()
    with ic.patch(joint_custom_pre_pass=user):
        passes = compat.custom_passes(backend.config_patches(None, {})["joint_custom_pre_pass"])
    assert passes == [user, install.CACHE_SALT]


@pytest.mark.slow(s=75)
def test_inductor_cpu_end_to_end_and_cache_guard(monkeypatch):
    """Real Inductor: exact loss and grads, our fwd/bwd ops in the compiled code, the AOTAutograd
    cache hits on a recompile, and misses once a setting our ops read while traced or our sources' hash
    changes."""
    fn, _ = SPELLINGS["hf_causal_lm"]
    with fresh_cache():
        assert_parity(fn, make_inputs(), "inductor_xent", what="inductor")
        assert counters["inductor_xent"]["sites_fused"] == 1
        assert counters["inductor"]["fxgraph_cache_bypass"] == 0
        assert counters["aot_autograd"]["autograd_cache_miss"] == 1

        torch._dynamo.reset()
        counters.clear()
        torch.compile(fn, backend="inductor_xent")(**leaves(make_inputs()))
        assert counters["aot_autograd"]["autograd_cache_hit"] == 1

        # a setting our ops read while traced (the store backward's compacted rows depend on the
        # implementation) leaves the Dynamo graph as it was: the key must change with it
        torch._dynamo.reset()
        counters.clear()
        monkeypatch.setenv("INDUCTOR_XENT_IMPL", "chunked")
        torch.compile(fn, backend="inductor_xent")(**leaves(make_inputs()))
        assert counters["aot_autograd"]["autograd_cache_hit"] == 0
        assert counters["aot_autograd"]["autograd_cache_miss"] == 1

        torch._dynamo.reset()
        counters.clear()
        monkeypatch.setattr(install, "source_hash", lambda: b"edited backward kernel")
        torch.compile(fn, backend="inductor_xent")(**leaves(make_inputs()))
        assert counters["aot_autograd"]["autograd_cache_hit"] == 0
        assert counters["aot_autograd"]["autograd_cache_miss"] == 1


@pytest.mark.slow(s=109)
def test_inductor_generated_code_calls_our_ops():
    from torch._inductor.utils import run_fw_bw_and_get_code

    fn, _ = SPELLINGS["softcap"]
    ins = make_inputs()
    ins["x"].requires_grad_(True)
    ins["W"].requires_grad_(True)
    compiled = torch.compile(fn, backend="inductor_xent")
    _, code = run_fw_bw_and_get_code(lambda: compiled(**ins))
    text = "\n".join(code)
    assert str(ops.FORWARD) in text and str(ops.BACKWARD) in text


def _store_case():
    torch.manual_seed(0)
    h = torch.randn(64, 32, requires_grad=True)
    W = torch.randn(100, 32, requires_grad=True)
    return h, W, torch.randint(0, 100, (64,))


def _mean_ce(h, W, y):
    return F.cross_entropy(h @ W.t(), y)


@pytest.mark.parametrize("retain", [False, True])
def test_compiled_store_backward_scales_donated_gradients_in_place(retain):
    """Inductor's backward for the store strategy scales the saved gradients in place (store_scale_,
    no new buffer) when autograd donates them; a retained graph keeps them (store_scale, out of
    place) so that a second backward through it sees them unscaled. Gradients equal eager's."""
    from torch._inductor.utils import run_and_get_code

    h, W, y = _store_case()
    compiled = torch.compile(_mean_ce, backend="inductor_xent",
                             options={"xent.strategy": "store", "xent.store_budget": "8x"})

    def step(fn):
        loss = fn(h, W, y)
        (loss * 0.5).backward(retain_graph=retain)
        if retain:
            (loss * 0.25).backward()
        return h.grad, W.grad

    with fresh_cache():
        (gh, gw), code = run_and_get_code(step, compiled)
    text = "\n".join(code)
    assert str(ops.STORE) in text
    assert (str(ops.STORE_SCALE_) in text) is not retain
    assert (str(ops.STORE_SCALE) in text) is retain
    h.grad = W.grad = None
    rh, rw = step(_mean_ce)
    torch.testing.assert_close(gh, rh)
    torch.testing.assert_close(gw, rw)


def _lp_entropy(h, W, y):
    logp = F.log_softmax(h @ W.t() / 0.7, -1)
    return logp.gather(-1, y[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("retain", [False, True])
def test_compiled_log_prob_store_writes_dz_over_donated_exp_logits(monkeypatch, retain):
    """The log-prob store's compiled backward writes its dz over the stored exp-logits
    (linear_logprob_store_bwd_) when autograd donates them, and leaves them (the out-of-place op)
    under retain_graph, where a second backward reads them again: both backward results as eager's
    (Triton kernels, interpreted on CPU tensors)."""
    from torch._inductor.utils import run_and_get_code

    if not torch.cuda.is_available():
        monkeypatch.setenv("INDUCTOR_XENT_IMPL", "triton")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(1)
    h = torch.randn(48, 32, device=dev, requires_grad=True)
    W = torch.randn(80, 32, device=dev, requires_grad=True)
    y = torch.randint(0, 80, (48,), device=dev)
    up = torch.randn(2, 48, device=dev)
    compiled = torch.compile(_lp_entropy, backend="inductor_xent",
                             options={"xent.strategy": "store", "xent.store_budget": "1GiB"})

    def step(fn):
        lp, ent = fn(h, W, y)
        out = (lp * up[0] + ent * up[1]).sum()
        first = torch.autograd.grad(out, (h, W), retain_graph=retain)
        return (*first, *(torch.autograd.grad(out * 0.5, (h, W)) if retain else ()))

    torch._dynamo.reset()
    with fresh_cache():
        got, code = run_and_get_code(step, compiled)
    text = "\n".join(code)
    assert str(ops.LOGPROB_STORE) in text
    assert (str(ops.LOGPROB_STORE_BACKWARD_) in text) is not retain
    for a, b in zip(got, step(_lp_entropy)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _scale_graph(two_users=False, tangent_name="tangents_1"):
    g = torch.fx.Graph()
    saved, s = g.placeholder("getitem_1"), g.placeholder(tangent_name)
    out = g.call_function(ops.STORE_SCALE, (saved, s))
    g.output((out, g.call_function(torch.ops.aten.neg.default, (saved,))) if two_users else (out,))
    return g


@pytest.mark.parametrize("case", ["donated", "not_donated", "read_elsewhere", "no_tangents", "cudagraphs"])
def test_donated_scale_pass_rewrites_only_a_donated_sole_use(monkeypatch, case):
    monkeypatch.setattr(compat, "donated_backward_inputs", lambda: frozenset() if case == "not_donated" else {0})
    g = _scale_graph(two_users=case == "read_elsewhere", tangent_name="arg1_1" if case == "no_tangents" else "tangents_1")
    with ic.patch({"triton.cudagraphs": case == "cudagraphs"}):
        install.DONATED_SCALE(g)
    targets = [n.target for n in g.nodes if n.op == "call_function"]
    assert (ops.STORE_SCALE_ in targets) is (case == "donated")
    assert (ops.STORE_SCALE in targets) is (case != "donated")
    if case == "donated":  # the output is the (scaled) saved tensor itself
        assert g.output_node().args[0][0].name == "getitem_1"


# ---------------------------------------------------------------------------------------------
# install() / uninstall() for backend="inductor" users
# ---------------------------------------------------------------------------------------------
def test_install_fires_and_user_pass_still_runs():
    fn, _ = SPELLINGS["linear_view_mean"]
    user = _UserPass()
    with ic.patch(pre_grad_custom_pass=user, joint_custom_pre_pass=None, post_grad_custom_post_pass=None), \
            fresh_cache():
        original = cfx.compile_fx
        inductor_xent.install()
        assert isinstance(cfx.compile_fx, install.InstalledCompileFx) and cfx.compile_fx.original is original
        assert ic.pre_grad_custom_pass is user
        ins = make_inputs()
        torch.testing.assert_close(torch.compile(fn, backend="inductor")(**ins), fn(**ins))
        assert user.calls == 1
        assert counters["inductor_xent"]["sites_fused"] == 1
        inductor_xent.uninstall()
        assert cfx.compile_fx is original and ic.pre_grad_custom_pass is user
        assert ic.joint_custom_pre_pass is None and ic.post_grad_custom_post_pass is None


def test_install_counts_fused_sites_on_a_warm_cache():
    """The pass runs in front of compile_fx, before Inductor's caches: a second process-like compile
    that loads the graph from the warm FX-graph and AOTAutograd caches still runs it, and the
    counters report the fused site (a pre-grad pass, run after the AOTAutograd cache lookup on torch
    2.13+, reported 0)."""
    fn, _ = SPELLINGS["linear_view_mean"]
    ins = make_inputs()
    with fresh_cache(), ic.patch(fx_graph_cache=True, fx_graph_remote_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=True):
        inductor_xent.install()
        for _ in range(2):
            torch._dynamo.reset()
            counters.clear()
            torch.testing.assert_close(torch.compile(fn, backend="inductor")(**ins), fn(**ins))
            assert counters["inductor_xent"]["sites_fused"] == 1
        assert counters["aot_autograd"]["autograd_cache_hit"] == 1, dict(counters["aot_autograd"])


def test_compose_forms():
    """None, one pass, lists and tuples (2.13+); the 2.11 single-callable form via ComposedPass."""
    ours, a, b = install.XentPass(), _UserPass(), _UserPass()
    assert compat.add_pass(None, ours) is ours
    assert compat.remove_pass(ours, ours) is None
    with pytest.MonkeyPatch.context() as mp:  # torch 2.13+: lists and tuples
        mp.setattr(compat, "PASS_LISTS", True)
        _lists_and_tuples(ours, a, b)
    with pytest.MonkeyPatch.context() as mp:  # torch 2.11: one callable per hook
        mp.setattr(compat, "PASS_LISTS", False)
        composed = compat.add_pass(a, ours)
        assert isinstance(composed, compat.ComposedPass) and composed.passes == (a, ours)
        assert composed.uuid() == ("user-pass", ours.uuid())
        assert compat.ComposedPass([lambda g: None, ours]).uuid() is None  # a plain function: no caching
        assert compat.remove_pass(composed, ours) is a


def _lists_and_tuples(ours, a, b):
    assert compat.add_pass([a], ours) == [a, ours]
    assert compat.add_pass((a, b), ours) == (a, b, ours)
    assert compat.remove_pass((a, b, ours), ours) == (a, b)
    assert compat.add_pass(compat.add_pass(a, ours), ours) == [a, ours]  # idempotent
    assert compat.remove_pass([a, ours], ours) is a


def test_backend_options_fuse_escaping_logits():
    def fn(x, W, y, **_):
        logits = F.linear(x, W)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1)), logits

    rec = Recorder(**{"xent.allow_escaping_logits": True})
    torch.compile(fn, backend=rec)(**make_inputs())
    assert fused_ops(rec.after[0]) == 1


def test_string_backend_with_mode_and_options():
    """torch.compile passes mode= or options= (not both: torch refuses) through to the entry point."""
    fn, _ = SPELLINGS["matmul_T_scale"]
    ins = make_inputs()
    compiled = torch.compile(fn, backend="inductor_xent",
                             options={"xent.inner": "aot_eager", "xent.allow_escaping_logits": False})
    torch.testing.assert_close(compiled(**ins), fn(**ins))
    assert counters["inductor_xent"]["sites_fused"] == 1
    torch._dynamo.reset()
    counters.clear()
    disabled = torch.compile(fn, backend="inductor_xent", options={"xent.inner": "aot_eager", "xent.enable": False})
    torch.testing.assert_close(disabled(**ins), fn(**ins))
    assert counters["inductor_xent"]["sites_fused"] == 0


@pytest.mark.slow(s=106)
@pytest.mark.parametrize("name", ["z_loss", "lse_keepdim", "weight_dv", "one_hot"])
def test_inductor_cpu_spellings(name):
    """Real Inductor on the spellings whose rewrite is least like HF's: the op's lse output feeding
    a z-loss (its gradient flows through our backward), keepdim/cast lse, a [D, V] weight view."""
    fn, _ = SPELLINGS[name]
    assert_parity(fn, make_inputs(), "inductor_xent", what=f"inductor {name}")
    assert counters["inductor_xent"]["sites_fused"] == 1


def test_torch_compile_drops_backend_ctx_ctor():
    """Why the Dynamo tuning (``dynamo_tuning.tune_dynamo``: ignore_logging_functions, nested_graph_breaks) is
    process-wide, not scoped to our own frames: the only per-backend hook, a ``backend_ctx_ctor``
    attribute entered around the compiled frames, is honoured by ``torch._dynamo.optimize`` but not by
    ``torch.compile``, which wraps every backend (string or callable, with or without options) in
    ``_TorchCompileWrapper`` without it (torch 2.11 and 2.13). And the backend itself runs only after
    Dynamo has traced. If this fails, torch has started honouring the hook, and
    ``dynamo_tuning.honour_backend_ctx`` (which hands ours on) can go."""
    entered = []

    class Recording:
        def __enter__(self):
            entered.append(1)

        def __exit__(self, *exc):
            return False

    def recording_backend(gm, example_inputs, **kwargs):
        return gm.forward

    recording_backend.backend_ctx_ctor = Recording

    def f(x):
        return x.sin() + 1

    x = torch.randn(3)
    torch.compile(f, backend=recording_backend)(x)
    torch.compile(f, backend=recording_backend, options={"any": 1})(x)
    assert entered == []
    torch._dynamo.reset()
    torch._dynamo.optimize(recording_backend)(f)(x)
    assert entered


# ---------------------------------------------------------------------------------------------
# the Dynamo tuning (dynamo_tuning.tune_dynamo): applied at lookup and at each backend call
# ---------------------------------------------------------------------------------------------
def _logs_then_adds(logger, method="warning_once"):
    def f(x):
        y = x.sin()
        getattr(logger, method)(f"a {method} inside a compiled function")
        return y + 1

    return f


def test_dynamo_tuning_ignores_transformers_warning_once_only(untuned_dynamo):
    """By default, with transformers imported, exactly transformers' ``warning_once`` joins
    ``ignore_logging_functions`` (what ``logging.Logger.warning_once`` resolves to, whose bound
    method's ``__func__`` Dynamo looks up), no other Dynamo option changes, a second call changes
    nothing; and Dynamo then traces through ``warning_once`` but still breaks on ``warning``."""
    hf_logging = pytest.importorskip("transformers.utils.logging")
    cfg = untuned_dynamo
    before = cfg.get_config_copy()
    assert dynamo_tuning.tune_dynamo() == {"ignore_logging_functions": hf_logging.warning_once}
    after = cfg.get_config_copy()
    assert after.pop("ignore_logging_functions") == before.pop("ignore_logging_functions") | {hf_logging.warning_once}
    assert after == before
    assert logging.Logger.warning_once is hf_logging.warning_once
    assert dynamo_tuning.tune_dynamo() == {}

    logger = logging.getLogger("inductor_xent.tests")
    frames = []
    for f in (_logs_then_adds(logger), _logs_then_adds(logger, "warning")):
        torch._dynamo.reset()
        counter = torch._dynamo.testing.CompileCounter()
        x = torch.randn(3)
        torch.testing.assert_close(torch.compile(f, backend=counter)(x), f(x))
        frames.append(counter.frame_count)
    assert frames == [1, 2]


def test_dynamo_tuning_keeps_dynamo_compilation_metrics_loggable(untuned_dynamo):
    """torch 2.11 json-dumps Dynamo's configuration after every compilation, without leaving
    ``ignore_logging_functions`` out: a function there made each compilation log "Unexpected
    exception logging compilation metrics" (seen on the H200 box); the set then holds a stand-in."""
    hf_logging = pytest.importorskip("transformers.utils.logging")
    probe = getattr(torch._dynamo.utils, "_get_dynamo_config_for_logging", None)
    dynamo_tuning.tune_dynamo()
    assert hf_logging.warning_once in untuned_dynamo.ignore_logging_functions
    if probe is not None:
        json.loads(probe())
    assert pickle.loads(pickle.dumps(untuned_dynamo.ignore_logging_functions)) == untuned_dynamo.ignore_logging_functions


def test_dynamo_tuning_applied_at_backend_call(untuned_dynamo):
    """A transformers imported after ``torch.compile`` looked the backend up: the backend's call
    applies the tuning, for the frames Dynamo traces next."""
    hf_logging = pytest.importorskip("transformers.utils.logging")
    torch.compile(lambda x: x.cos(), backend="inductor_xent", options={"xent.inner": "aot_eager"})(torch.randn(3))
    assert hf_logging.warning_once in untuned_dynamo.ignore_logging_functions
    assert untuned_dynamo.nested_graph_breaks is False


def test_dynamo_tuning_off_or_no_transformers_changes_nothing(untuned_dynamo, monkeypatch):
    """``INDUCTOR_XENT_DYNAMO_TUNING=0``, or transformers not imported (never imported by us): the
    Dynamo configuration stays as it is, and the warning_once call breaks the graph as before."""
    pytest.importorskip("transformers.utils.logging")
    cfg = untuned_dynamo
    before = cfg.get_config_copy()
    monkeypatch.setenv("INDUCTOR_XENT_DYNAMO_TUNING", "0")
    assert dynamo_tuning.tune_dynamo() == {} and cfg.get_config_copy() == before
    counter = counting(backend.inductor_xent, **{"xent.inner": "aot_eager"})
    torch.compile(_logs_then_adds(logging.getLogger("inductor_xent.tests")), backend=counter)(torch.randn(3))
    assert counter.frame_count == 2 and cfg.get_config_copy() == before
    monkeypatch.delenv("INDUCTOR_XENT_DYNAMO_TUNING")
    for name in [m for m in sys.modules if m == "transformers" or m.startswith("transformers.")]:
        monkeypatch.delitem(sys.modules, name)
    assert dynamo_tuning.tune_dynamo() == {} and cfg.get_config_copy() == before
    assert "transformers.utils.logging" not in sys.modules


def test_nested_graph_breaks_default_follows_the_torch_release(untuned_dynamo, monkeypatch):
    """On by default where Dynamo resumes a nested frame with its own globals (torch 2.13+), off on 2.11
    and 2.12 (a resumed MusicGen forward raised NameError there, transformers 5.25);
    INDUCTOR_XENT_NESTED_GRAPH_BREAKS=1 turns them on there too: a forward that breaks before its
    lm_head fuses without handing its logits to the caller."""
    sound = torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)
    assert compat.nested_graph_breaks_sound() is sound and config.nested_graph_breaks() is sound
    ins = {k: make_inputs()[k] for k in ("x", "W", "y")}

    def loss_only(x, W, y):
        return _forward_with_item(x, W, y)["loss"]

    monkeypatch.setenv("INDUCTOR_XENT_NESTED_GRAPH_BREAKS", "1")
    report = inductor_xent.explain(loss_only, *leaves(ins).values())
    assert report.fused_count == 1 and not report.logits_escape, report
    assert untuned_dynamo.nested_graph_breaks is False


@pytest.mark.parametrize("name", ["INDUCTOR_XENT_DYNAMO_TUNING", "INDUCTOR_XENT_NESTED_GRAPH_BREAKS",
                                  "INDUCTOR_XENT_CAPTURE_DYNAMIC_OUTPUT_SHAPES"])
def test_dynamo_tuning_bad_value_names_accepted_values(untuned_dynamo, monkeypatch, name):
    monkeypatch.setenv(name, "maybe")
    message = f"{name}='maybe'; expected one of 1, true, on, yes, 0, false, off, no"
    with pytest.raises(ValueError, match=message):
        dynamo_tuning.tune_dynamo()
    with pytest.raises(Exception, match=message):  # through torch.compile: Dynamo wraps the backend's error
        torch.compile(lambda x: x.cos(), backend="inductor_xent")(torch.randn(3))


def _forward_with_item(x, W, y):
    """A model's forward that graph-breaks before its lm_head (an ``.item()``, as in some MoE routers)
    and returns the logits beside the loss, like a transformers ``CausalLMOutput``."""
    if x.detach().abs().max().item() >= 0:
        x = torch.relu(x)
    logits = F.linear(x, W)
    return {"loss": F.cross_entropy(logits.view(-1, V), y.view(-1)), "logits": logits}


def test_nested_graph_breaks_scoped_to_our_compiled_calls(untuned_dynamo, monkeypatch):
    """With ``INDUCTOR_XENT_NESTED_GRAPH_BREAKS=1`` (the default on torch 2.13+) a function compiled with
    backend="inductor_xent" is traced with
    ``nested_graph_breaks`` (dynamo_tuning.DynamoScope, entered around each call): a loss-only function around
    a forward that breaks before its lm_head fuses in a graph that returns only the loss, loss and
    gradients within torch's error (string or callable backend, with options). The option is back to
    False after each call; another backend in the same process traces without it, and
    ``INDUCTOR_XENT_NESTED_GRAPH_BREAKS=0`` leaves it off for ours too: Dynamo then ends the forward's
    last graph at its return, which hands the logits to the caller (the site still fuses, the op
    writing the returned logits: escape.py)."""
    monkeypatch.setenv("INDUCTOR_XENT_NESTED_GRAPH_BREAKS", "1")
    ins = {k: make_inputs()[k] for k in ("x", "W", "y")}
    returned = []  # per graph with a site: whether it returns the logits

    def loss_only(x, W, y):
        return _forward_with_item(x, W, y)["loss"]

    def recording(gm, example_inputs, **kwargs):
        compiled = backend.inductor_xent(gm, example_inputs, options={"xent.inner": "aot_eager"})
        if any(n.target in (ops.FORWARD, ops.STORE) for n in gm.graph.nodes):
            returned.append(bool(gm.meta.get(escape.META_KEY, (None, []))[1]))
        return compiled

    recording.backend_ctx_ctor = dynamo_tuning.DynamoScope  # what the real backend carries
    recording._inductor_xent_backend = True
    for how in ("inductor_xent", recording):
        torch._dynamo.reset()
        counters.clear()
        returned.clear()
        opts = {"options": {"xent.inner": "aot_eager"}} if how == "inductor_xent" else {}
        torch.compile(loss_only, backend=how, **opts)(**leaves(ins)).backward()
        assert counters["inductor_xent"]["sites_fused"] == 1, how
        assert counters["inductor_xent"]["sites_declined"] == 0, how
        assert returned in ([], [False]), how
        assert untuned_dynamo.nested_graph_breaks is False
    torch._dynamo.reset()
    counters.clear()
    assert_parity(loss_only, ins, "inductor_xent", what="nested graph breaks, scoped")
    assert counters["inductor_xent"]["sites_fused"] >= 1

    torch._dynamo.reset()
    returned.clear()  # another backend (ours behind Dynamo's compile counter): no scope, the logits returned
    assert_parity(loss_only, ins, counting(recording), what="other")
    assert returned and all(returned)

    monkeypatch.setenv("INDUCTOR_XENT_NESTED_GRAPH_BREAKS", "0")
    torch._dynamo.reset()
    returned.clear()
    assert_parity(loss_only, ins, recording, what="nested off")
    assert returned and all(returned)
    assert untuned_dynamo.nested_graph_breaks is False


def _masked_kd(hs, ws, ht, wt, y):
    """TRL's masking: the divergence's rows under the labels mask by boolean indexing, summed."""
    kl = F.kl_div(F.log_softmax(F.linear(hs, ws), -1), F.log_softmax(F.linear(ht, wt).detach(), -1),
                  reduction="none", log_target=True)
    mask = y != -100
    return kl[mask].sum() / mask.sum()


def test_dynamic_output_shapes_captured_in_our_compiled_calls(untuned_dynamo, monkeypatch):
    """A boolean-mask indexing breaks Dynamo's graph as torch ships it (the ``[N, V]`` divergence then
    leaves the first graph: no site). Inside our compiled calls (and explain) it stays in the graph by
    default and the site fuses, with eager's loss, the option back to False after the call; with
    ``INDUCTOR_XENT_CAPTURE_DYNAMIC_OUTPUT_SHAPES=0`` the graph breaks there and explain says to unset it."""
    g = torch.Generator().manual_seed(5)
    y = torch.randint(0, 64, (2, 8), generator=g)
    y[:, :3] = -100
    ins = dict(hs=torch.randn(2, 8, 16, generator=g, requires_grad=True), ws=torch.randn(64, 16, generator=g),
               ht=torch.randn(2, 8, 16, generator=g), wt=torch.randn(64, 16, generator=g), y=y)
    report = inductor_xent.explain(_masked_kd, **ins)
    assert report.fused_count == 1 and report.graph_break_count == 0, str(report)
    out = torch.compile(_masked_kd, backend="inductor_xent", options={"xent.inner": "aot_eager"})(**ins)
    torch.testing.assert_close(out, _masked_kd(**ins))
    assert counters["inductor_xent"]["fused.distillation"] >= 1
    assert untuned_dynamo.capture_dynamic_output_shape_ops is False
    monkeypatch.setenv("INDUCTOR_XENT_CAPTURE_DYNAMIC_OUTPUT_SHAPES", "0")
    torch._dynamo.reset()
    report = inductor_xent.explain(_masked_kd, **ins)
    assert report.fused_count == 0 and report.graph_break_count == 1, str(report)
    assert "INDUCTOR_XENT_CAPTURE_DYNAMIC_OUTPUT_SHAPES=0 is set: unset it" in str(report), str(report)


def _branches_on_size(x, y):
    z = x[y > 0]
    return z.sum() if z.shape[0] else x.sum()


def test_data_dependent_branches_compile_by_default(untuned_dynamo):
    """Code that branches on the truth of a boolean-indexed size, which Dynamo cannot trace with the
    index in the graph (``GuardOnDataDependentSymNode`` under capture_dynamic_output_shape_ops, a hard
    error), compiles as with backend="inductor": the frame is traced again without the capture (a
    graph break at the index), counted; other frames keep it. An empty mask takes the other branch."""
    compiled = torch.compile(_branches_on_size, backend="inductor_xent", options={"xent.inner": "aot_eager"})
    x, y = torch.randn(8, 4), torch.randn(8)
    torch.testing.assert_close(compiled(x, y), _branches_on_size(x, y))
    assert counters["inductor_xent"]["frames_traced_without_capture"] == 1
    torch.testing.assert_close(compiled(x, -y.abs() - 1), x.sum())
    assert untuned_dynamo.capture_dynamic_output_shape_ops is False
    with pytest.raises(Exception, match="data-dependent"):  # the error the retry answers, as torch ships it
        with untuned_dynamo.patch(capture_dynamic_output_shape_ops=True):
            torch.compile(_branches_on_size, backend="aot_eager")(x, y)


def _graphs(fn, *args, **compile_kwargs) -> int:
    """How many graphs Dynamo compiles for one call of ``fn`` compiled with our backend."""
    torch._dynamo.reset()
    counters.clear()
    if "mode" not in compile_kwargs:  # (torch.compile takes a mode or options)
        compile_kwargs["options"] = {"xent.inner": "aot_eager", **compile_kwargs.get("options", {})}
    torch.testing.assert_close(torch.compile(fn, backend="inductor_xent", **compile_kwargs)(*args), fn(*args))
    return counters["stats"]["unique_graphs"]


def _kd_inputs(seed=5):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 64, (2, 8), generator=g)
    y[:, :3] = -100
    return (torch.randn(2, 8, 16, generator=g, requires_grad=True), torch.randn(64, 16, generator=g),
            torch.randn(2, 8, 16, generator=g), torch.randn(64, 16, generator=g), y)


@pytest.mark.parametrize("compile_kwargs", [{"mode": "reduce-overhead"}, {"options": {"triton.cudagraphs": True}}],
                         ids=["reduce_overhead", "cudagraphs_option"])
def test_no_capture_where_cuda_graphs_run(untuned_dynamo, compile_kwargs):
    """A graph holding a boolean index's nonzero runs without CUDA graphs: where the compile asks for
    them, the index breaks the graph as torch ships it (two graphs), elsewhere it stays in (one, the
    masked divergence fused)."""
    assert _graphs(_masked_kd, *_kd_inputs(), **compile_kwargs) == 2
    assert _graphs(_masked_kd, *_kd_inputs()) == 1


def test_cuda_graphs_read_at_each_call(untuned_dynamo):
    """Inductor's cudagraphs option set around the call (not at torch.compile) is honoured, and a
    function compiled for CUDA graphs traces without the capture even inside another compiled call."""
    with ic.patch({"triton.cudagraphs": True}):
        assert _graphs(_masked_kd, *_kd_inputs()) == 2
    inner = torch.compile(_masked_kd, backend="inductor_xent", options={"xent.inner": "aot_eager",
                                                                         "triton.cudagraphs": True})

    @torch.compiler.disable
    def call_inner(*args):
        return inner(*args)

    def outer(*args):
        return call_inner(*args) * 2

    assert _graphs(outer, *_kd_inputs()) == 3  # outer's after the disabled call; inner's two, broken at the index


def test_capture_kept_only_where_a_site_uses_it(untuned_dynamo):
    """A graph whose boolean index no fused site reads is traced again without the capture (as torch
    ships Dynamo: a graph break), counted, the pass's counts of the dropped attempt undone."""
    def f(h, w, y, x, m):
        return F.cross_entropy(h @ w.t(), y) + x[m].sum()

    g = torch.Generator().manual_seed(2)
    args = (torch.randn(8, 4, generator=g), torch.randn(10, 4, generator=g), torch.randint(0, 10, (8,), generator=g),
            torch.randn(8, 3, generator=g), torch.rand(8, generator=g) > 0.5)
    assert _graphs(f, *args) == 2
    assert counters["inductor_xent"]["frames_traced_without_unused_capture"] == 1
    assert counters["inductor_xent"]["sites_fused"] == 1, dict(counters["inductor_xent"])


def test_in_place_mask_after_its_index_compiles(untuned_dynamo):
    """AOTAutograd fails on a mask written in place after it indexed a tensor that needs grad when the
    index is in the graph; no site reads it, so the frame compiles as without the capture."""
    def f(x, m):
        kept = x[m]
        m &= x.detach()[:, 1] > 0
        return kept.sum() + x[m].sum()

    x = torch.randn(16, 3, requires_grad=True)
    m = torch.rand(16, generator=torch.Generator().manual_seed(0)) > 0.3
    out = torch.compile(f, backend="inductor_xent", options={"xent.inner": "aot_eager"})(x, m.clone())
    torch.testing.assert_close(out, f(x, m.clone()))


def test_explain_names_the_branch_that_kept_the_index_out(untuned_dynamo):
    """The retried frame's graph break is explained by the branch, not by the setting."""
    def loss(hs, ws, ht, wt, y):
        kl = F.kl_div(F.log_softmax(F.linear(hs, ws), -1), F.log_softmax(F.linear(ht, wt), -1),
                      reduction="none", log_target=True)
        kept = kl[y != -100]
        return kept.sum() / kept.shape[0] if kept.shape[0] else kl.sum() * 0

    g = torch.Generator().manual_seed(6)
    y = torch.randint(0, 64, (2, 8), generator=g)
    report = inductor_xent.explain(loss, torch.randn(2, 8, 16, generator=g), torch.randn(64, 16, generator=g),
                                   torch.randn(2, 8, 16, generator=g), torch.randn(64, 16, generator=g), y)
    assert report.capture_retried and report.fused_count == 0, str(report)
    assert "branches on the truth of such a size" in str(report), str(report)
    assert "is set: unset it" not in str(report), str(report)


_FIRST_COMPILE = """
import sys

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters


def forward(x, W, y):  # breaks before its lm_head and returns the logits beside the loss
    if x.detach().abs().max().item() >= 0:
        x = torch.relu(x)
    logits = F.linear(x, W)
    return {"loss": F.cross_entropy(logits, y), "logits": logits}


x, W = torch.randn(8, 16, requires_grad=True), torch.randn(50, 16, requires_grad=True)
y = torch.randint(0, 50, (8,))
assert "inductor_xent" not in sys.modules
loss = torch.compile(lambda x, W, y: forward(x, W, y)["loss"], backend="inductor_xent",
                     options={"xent.inner": "aot_eager"})(x, W, y)
loss.backward()
print(counters["inductor_xent"]["sites_fused"], counters["inductor_xent"]["sites_declined"],
      torch._dynamo.config.nested_graph_breaks)
"""


def test_first_torch_compile_of_a_process_gets_the_scope(tmp_path):
    """The entry point imports the backend inside torch.compile's backend wrapper, before Dynamo reads
    the wrapper's attributes: the very first compile of a process already runs in DynamoScope (its
    forward's .item() break does not keep the site from fusing), and leaves the option as it was."""
    script = tmp_path / "first.py"
    script.write_text(_FIRST_COMPILE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("INDUCTOR_XENT_")}
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["1", "0", "False"], done.stdout
