"""The zoo: real transformers architectures, built from tiny configs with random weights (no hub
downloads), compiled as ``lambda ids, labels: model(input_ids=ids, labels=labels).loss``.

Each must give exactly one fused site, the eager loss and every parameter gradient (within
PyTorch's own error against a float64 copy of the model), and the same number of Dynamo graphs as
without our pass. Each family also runs once end to end through the real Inductor backend.

Environment (for the GPU box): ``INDUCTOR_XENT_TEST_DEVICE`` (default ``cpu``) and
``INDUCTOR_XENT_TEST_DTYPE`` (``float32`` default, or ``bfloat16``).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

transformers = pytest.importorskip("transformers")

import inductor_xent  # noqa: E402
from inductor_xent import dynamo_tuning  # noqa: E402
from inductor_xent.backend import inductor_xent as xent_backend  # noqa: E402

from .helpers import assert_within_torch_error, counting  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

DEVICE = os.environ.get("INDUCTOR_XENT_TEST_DEVICE", "cpu")
DTYPE = getattr(torch, os.environ.get("INDUCTOR_XENT_TEST_DTYPE", "float32"))
BATCH, SEQ = 2, 12
# eager-vs-compiled closeness where no float64 reference is taken: the rounding of DTYPE (our op
# keeps fp32 logits where eager rounds them to DTYPE first)
LOOSE = 1.0 if DTYPE == torch.float32 else 2e3  # bf16/fp16: ~1e-2 instead of ~1e-5

_COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1, max_position_embeddings=64)
# name -> (config factory, vocab); vocabularies are primes (unaligned) between 97 and 257
ZOO = {
    "llama": (lambda v: transformers.LlamaConfig(vocab_size=v, **_COMMON), 97),
    "mistral": (lambda v: transformers.MistralConfig(vocab_size=v, **_COMMON), 101),
    "qwen2": (lambda v: transformers.Qwen2Config(vocab_size=v, **_COMMON), 103),
    # final_logit_softcapping = 30 (div -> tanh -> mul) and tied embeddings
    "gemma2": (lambda v: transformers.Gemma2Config(vocab_size=v, head_dim=16, **_COMMON), 107),
    # tied lm_head / wte, Conv1D blocks, learned positions; no dropout (GPT-2's default is 0.1, and in
    # training mode each run would draw other masks, which would loosen the float64 comparison)
    "gpt2": (lambda v: transformers.GPT2Config(vocab_size=v, n_embd=32, n_layer=1, n_head=2, n_positions=64,
                                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), 257),
    "phi3": (lambda v: transformers.Phi3Config(vocab_size=v, pad_token_id=0, **_COMMON), 109),
    "olmo2": (lambda v: transformers.Olmo2Config(vocab_size=v, pad_token_id=0, **_COMMON), 113),
    # logits * logit_scale (a Python float), tied embeddings
    "cohere": (lambda v: transformers.CohereConfig(vocab_size=v, logit_scale=0.25, pad_token_id=0, **_COMMON), 127),
    # logits / logits_scaling
    "granite": (lambda v: transformers.GraniteConfig(vocab_size=v, logits_scaling=4.0, **_COMMON), 131),
    # Gemma 3 text: softcapping like Gemma 2
    "gemma3": (lambda v: transformers.Gemma3TextConfig(vocab_size=v, head_dim=16, final_logit_softcapping=30.0,
                                                        **_COMMON), 137),
}


def build(name: str, dtype=DTYPE, seed: int = 0, gpt2_loss_type: Optional[str] = "ForCausalLM"):
    make_config, vocab = ZOO[name]
    torch.manual_seed(seed)
    config = make_config(vocab)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).to(DEVICE, dtype)
    if name == "gpt2":
        # GPT2LMHeadModel's class name gives no known loss_type (transformers leaves None), so
        # `self.loss_function` logs a warning_once inside forward, a graph break between the lm_head
        # and the loss unless the backend's Dynamo tuning was applied before the first trace, which
        # depends on the order tests run in; test_gpt2_without_loss_type_* test None.
        model.loss_type = gpt2_loss_type
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g).to(DEVICE)
    labels = ids.clone()
    labels[0, -3:] = -100  # padding
    return model, ids, labels


def loss_fn(model):
    return lambda ids, labels: model(input_ids=ids, labels=labels).loss


def _loss_and_grads(model, fn, ids, labels):
    model.zero_grad(set_to_none=True)
    loss = fn(ids, labels)
    loss.backward()
    return loss.detach(), {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def check_model(name: str, backend, fused: int = 1, **build_kwargs):
    """``fused`` sites fused (and the rest declined), loss and every gradient within torch's error."""
    model, ids, labels = build(name, **build_kwargs)
    ref = copy.deepcopy(model).double()
    l64, g64 = _loss_and_grads(ref, loss_fn(ref), ids, labels)
    le, ge = _loss_and_grads(model, loss_fn(model), ids, labels)
    lc, gc = _loss_and_grads(model, torch.compile(loss_fn(model), backend=backend), ids, labels)
    assert counters["inductor_xent"]["sites_fused"] == fused, dict(counters["inductor_xent"])
    assert (counters["inductor_xent"]["sites_declined"] == 0) == bool(fused), dict(counters["inductor_xent"])
    assert set(gc) == set(ge)
    assert_within_torch_error(lc, le, l64, what=f"{name} loss")
    for k in ge:
        assert_within_torch_error(gc[k], ge[k], g64[k], what=f"{name} grad {k}")
    return model, ids, labels


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_fused_exact_same_graph_count(name):
    ours = counting(xent_backend, **{"xent.inner": "aot_eager"})
    check_model(name, ours)
    # the graph count without our pass (Dynamo's split does not depend on the backend)
    torch._dynamo.reset()
    plain = CompileCounter()
    model, ids, labels = build(name)
    torch.compile(loss_fn(model), backend=plain)(ids, labels)
    assert ours.frame_count == plain.frame_count


@pytest.mark.slow(s=83)
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_inductor_end_to_end(name):
    check_model(name, "inductor_xent")


def _kd_step(student, teacher, temperature=2.0):
    """Hinton KD between two HF models, as a distillation script writes it: both models' ``logits``
    (Gemma 2's softcapped inside the model), the teacher's under no_grad, α·CE + (1 − α)·T²·KD."""
    def step(ids, labels):
        s = student(input_ids=ids).logits
        with torch.no_grad():
            t = teacher(input_ids=ids).logits
        kd = torch.nn.functional.kl_div(torch.nn.functional.log_softmax(s / temperature, -1),
                                        torch.nn.functional.softmax(t / temperature, -1), reduction="batchmean")
        ce = torch.nn.functional.cross_entropy(s.flatten(0, 1), labels.flatten())
        return 0.4 * ce + 0.6 * kd * temperature**2
    return step


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_distillation_between_two_models_fuses(name):
    """Two models of the zoo, a student and a frozen teacher, compiled as one KD step: one fused
    distillation site (the CE mixed in), the loss and the student's gradients within torch's error
    of float64. Gemma 2's caps made small (0.25; the tiny models' logits are ~0.1) so that a cap
    dropped or misplaced would fail."""
    student, ids, labels = build(name)
    teacher = build(name, seed=3)[0].requires_grad_(False)
    if name == "gemma2":
        for m in (student, teacher):
            m.config.final_logit_softcapping = 0.25
    ref_s, ref_t = copy.deepcopy(student).double(), copy.deepcopy(teacher).double()
    l64, g64 = _loss_and_grads(ref_s, _kd_step(ref_s, ref_t), ids, labels)
    le, ge = _loss_and_grads(student, _kd_step(student, teacher), ids, labels)
    ours = counting(xent_backend, **{"xent.inner": "aot_eager"})
    lc, gc = _loss_and_grads(student, torch.compile(_kd_step(student, teacher), backend=ours), ids, labels)
    assert counters["inductor_xent"]["sites_fused"] == 1, dict(counters["inductor_xent"])
    assert counters["inductor_xent"]["sites_declined"] == 0, dict(counters["inductor_xent"])
    assert set(gc) == set(ge)
    assert_within_torch_error(lc, le, l64, what=f"{name} KD loss")
    for k in ge:
        assert_within_torch_error(gc[k], ge[k], g64[k], what=f"{name} KD grad {k}")


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_zoo_inference(name):
    model, ids, labels = build(name)
    with torch.no_grad():
        eager = loss_fn(model)(ids, labels)
        compiled = torch.compile(loss_fn(model), backend=xent_backend, options={"xent.inner": "aot_eager"})(
            ids, labels)
    torch.testing.assert_close(compiled, eager, rtol=1e-5 * LOOSE, atol=1e-5 * LOOSE)
    assert counters["inductor_xent"]["sites_fused"] == 1


def test_zoo_dynamic_sequence_no_extra_recompiles():
    """Sequence lengths 12, 10, 8: as many compiled frames as with no pass (automatic dynamic)."""
    model, _, _ = build("llama")
    frames = []
    for enable in (True, False):
        torch._dynamo.reset()
        backend = counting(xent_backend, **{"xent.inner": "aot_eager", "xent.enable": enable})
        compiled = torch.compile(loss_fn(model), backend=backend)
        for seq in (12, 10, 8):
            ids = torch.randint(0, ZOO["llama"][1], (BATCH, seq), device=DEVICE)
            torch.testing.assert_close(compiled(ids, ids), loss_fn(model)(ids, ids), rtol=1e-5 * LOOSE,
                                       atol=1e-5 * LOOSE)
        frames.append(backend.frame_count)
    assert frames[0] == frames[1]


def test_whole_model_compile_writes_the_returned_logits():
    """torch.compile(model) returns the logits: the site fuses and the op writes them; a loss-only
    region fuses without returning any."""
    model, ids, labels = build("llama")
    report = inductor_xent.explain(model, input_ids=ids, labels=labels)
    assert report.fused_count == 1 and report.sites[0].logits_returned, str(report)
    assert "returned logits written by the op" in str(report)
    good = inductor_xent.explain(loss_fn(model), ids, labels)
    assert good.fused_count == 1 and not good.logits_escape and not good.sites[0].logits_returned


def test_zoo_num_items_in_batch():
    """Gradient accumulation as the HF Trainer does it: reduction="sum" then / num_items_in_batch."""
    model, ids, labels = build("llama")
    n = (labels[..., 1:] != -100).sum() + 5  # the count over all micro-batches

    def fn(ids, labels):
        return model(input_ids=ids, labels=labels, num_items_in_batch=n).loss

    le, ge = _loss_and_grads(model, fn, ids, labels)
    backend = counting(xent_backend, **{"xent.inner": "aot_eager"})
    lc, gc = _loss_and_grads(model, torch.compile(fn, backend=backend), ids, labels)
    torch.testing.assert_close(lc, le, rtol=1e-5 * LOOSE, atol=1e-6 * LOOSE)
    for k in ge:
        torch.testing.assert_close(gc[k], ge[k], rtol=1e-4 * LOOSE, atol=1e-6 * LOOSE)
    assert counters["inductor_xent"]["sites_fused"] == 1 and backend.frame_count == 1


def test_whole_model_allow_escaping_logits():
    """torch.compile(model, options={"xent.allow_escaping_logits": True}): the loss is fused, the
    returned logits still computed; loss, logits and gradients equal eager's."""
    model, ids, labels = build("qwen2")
    out = []
    for f in (model, torch.compile(model, backend=xent_backend,
                                   options={"xent.inner": "aot_eager", "xent.allow_escaping_logits": True})):
        model.zero_grad(set_to_none=True)
        o = f(input_ids=ids, labels=labels)
        (o.loss + 1e-3 * o.logits.float().square().mean()).backward()
        out.append([o.loss.detach(), o.logits.detach(), *(p.grad for p in model.parameters())])
    for e, c in zip(*out):
        torch.testing.assert_close(c, e, rtol=1e-4 * LOOSE, atol=1e-5 * LOOSE)
    assert counters["inductor_xent"]["sites_fused"] == 1


def test_gpt2_without_loss_type_fuses(untuned_dynamo):
    """GPT2LMHeadModel as transformers builds it (loss_type None): the Dynamo tuning that looking
    the backend up applies lets Dynamo skip transformers' loss_type warning_once, so the site fuses,
    loss and gradients within torch's error, with no change to the model or the call."""
    dynamo_tuning.tune_dynamo()  # what the lookup does in a fresh process (test_gpt2_..._fresh_process checks that)
    check_model("gpt2", "inductor_xent", gpt2_loss_type=None)


def test_gpt2_without_loss_type_tuning_off(untuned_dynamo, monkeypatch):
    """``INDUCTOR_XENT_DYNAMO_TUNING=0``: the warning breaks the graph between lm_head and loss, the
    site declines (the result is still eager's), and explain names both ways out. (Nested graph breaks
    on, the default on torch 2.13+: without them Dynamo ends the forward's graph at that break and
    explain says the loss's frame receives the logits.)"""
    monkeypatch.setenv("INDUCTOR_XENT_DYNAMO_TUNING", "0")
    monkeypatch.setenv("INDUCTOR_XENT_NESTED_GRAPH_BREAKS", "1")
    dynamo_tuning.tune_dynamo()
    model, ids, labels = check_model("gpt2", "inductor_xent", fused=0, gpt2_loss_type=None)
    report = inductor_xent.explain(loss_fn(model), ids, labels)
    assert report.graph_break_count >= 1 and report.fused_count == 0
    assert [s.fused for s in report.sites] == [False]
    reason = report.sites[0].reason
    assert "graph break separates the lm_head matmul from the loss" in reason
    assert "INDUCTOR_XENT_DYNAMO_TUNING=0" in reason and "set model.loss_type = 'ForCausalLM'" in reason


# the user's program in a process of its own: transformers imported, then torch.compile; nothing else
_FRESH_PROCESS = """
import sys
from importlib.metadata import entry_points

import torch
import transformers
from torch._dynamo.utils import counters

if not any(ep.name == "inductor_xent" for ep in entry_points(group="torch_dynamo_backends")):
    import inductor_xent  # a source tree (no pip install): importing the package registers the backend

torch.manual_seed(0)
config = transformers.GPT2Config(vocab_size=257, n_embd=32, n_layer=1, n_head=2, n_positions=64, resid_pdrop=0.0,
                                 embd_pdrop=0.0, attn_pdrop=0.0)
model = transformers.GPT2LMHeadModel(config)
ids = torch.randint(0, 257, (2, 12))
compiled = torch.compile(lambda ids, labels: model(input_ids=ids, labels=labels).loss, backend="inductor_xent",
                         options={"xent.inner": "aot_eager"})
loss = compiled(ids, ids)
loss.backward()
torch.save({"state": model.state_dict(), "ids": ids, "loss": loss.detach(),
            "grads": {k: p.grad for k, p in model.named_parameters()}, "counters": dict(counters["inductor_xent"]),
            "breaks": sum(counters["graph_break"].values())}, sys.argv[1])
"""


@pytest.mark.slow
def test_gpt2_without_loss_type_fuses_in_a_fresh_process(tmp_path):
    """The user's path itself: a process that imports transformers and compiles GPT-2's loss with
    backend="inductor_xent" (the lookup imports backend.py, which applies the tuning before Dynamo
    traces) fuses the site with no graph break; loss and gradients within torch's error."""
    script, out = tmp_path / "user.py", tmp_path / "out.pt"
    script.write_text(_FRESH_PROCESS)
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    for name in ("INDUCTOR_XENT_DYNAMO_TUNING", "INDUCTOR_XENT_NESTED_GRAPH_BREAKS", "INDUCTOR_XENT_TEST_DEVICE"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, str(script), str(out)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = torch.load(out)
    assert got["counters"].get("sites_fused") == 1 and not got["counters"].get("sites_declined"), got["counters"]
    assert got["breaks"] == 0
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=257, n_embd=32, n_layer=1, n_head=2, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))
    model.load_state_dict(got["state"])
    model.loss_type = "ForCausalLM"  # eager: the same loss, without the warning
    ids = got["ids"]
    ref = copy.deepcopy(model).double()
    l64, g64 = _loss_and_grads(ref, loss_fn(ref), ids, ids)
    le, ge = _loss_and_grads(model, loss_fn(model), ids, ids)
    assert_within_torch_error(got["loss"], le, l64, what="gpt2 loss")
    assert set(got["grads"]) == set(ge)
    for k in ge:
        assert_within_torch_error(got["grads"][k], ge[k], g64[k], what=f"gpt2 grad {k}")
