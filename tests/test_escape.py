"""Compiled functions that return the logits as well as the loss (``torch.compile(model)`` of an HF
model, nanoGPT's ``logits, loss = model(X, Y)``): the op writes the returned logits from its own
tiles (no second GEMM), they leave AOTAutograd's graph without a gradient (no [N, V] zero tangent
in the compiled backward), and escape.EscapedLogits gives them an exact one when the caller uses
them. Checked through the backend, ``install()`` and ``explain``: the graph, the returned values,
the loss and every gradient against eager, whether or not the caller's loss reads the logits.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import AotEagerAndRecordGraphs
from torch._dynamo.utils import counters

import inductor_xent
from inductor_xent import escape, ops, patterns

from .helpers import (
    B,
    Recorder,
    T,
    V,
    assert_within_torch_error,
    fused_ops,
    leaves,
    logits_sized,
    make_inputs,
    targets,
)
from .helpers import _hf_loss as hf_loss

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


# ---------------------------------------------------------------------------------------------
# spellings: fn(x, W, b, y, n) -> (loss, returned logits)
# ---------------------------------------------------------------------------------------------
def _nanogpt(x, W, y, **_):
    """nanoGPT's GPT.forward: ``logits = self.lm_head(x)``, the loss of ``logits.view(-1, C)``."""
    logits = F.linear(x, W)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)), logits


def _hf(x, W, y, n, **_):
    """HF LlamaForCausalLM: the logits in the model's dtype returned, the loss (ForCausalLMLoss) of
    ``logits.float()`` with pad-shifted labels and num_items_in_batch."""
    logits = F.linear(x, W)
    return hf_loss(logits, y, n), logits


def _gemma(x, W, y, **_):
    """Gemma 2: final_logit_softcapping on the returned logits, the loss of their fp32 copy."""
    logits = torch.tanh(F.linear(x, W) / 2.0) * 2.0
    return F.cross_entropy(logits.float().view(-1, V), y.view(-1)), logits


def _upcast_returned(x, W, b, y, **_):
    """The fp32 upcast (of a linear with a bias) returned, as some models return their logits."""
    logits = F.linear(x, W, b).float()
    return F.cross_entropy(logits.view(-1, V), y.view(-1), reduction="sum"), logits


def _bias_added(x, W, b, y, **_):
    """A bias added after the matmul: the returned tensor is the add."""
    logits = x @ W.t() + b
    return F.cross_entropy(logits.view(-1, V), y.view(-1)), logits


def _z_loss(x, W, y, **_):
    """A z-loss on the logsumexp (mapped onto the op's lse) next to the returned logits."""
    logits = F.linear(x, W)
    z = logits.float()
    loss = F.cross_entropy(z.view(-1, V), y.view(-1)) + 1e-2 * torch.logsumexp(z, -1).pow(2).mean()
    return loss, logits


RETURNING = {"nanogpt": _nanogpt, "hf": _hf, "gemma_softcap": _gemma, "upcast_returned": _upcast_returned,
             "bias_added": _bias_added, "z_loss": _z_loss}


def _run(fn, ins, backend=None, uses_logits=False, autocast=None):
    """(loss, returned logits, gradients of x, W, b) of ``loss`` (plus 0.1·mean(logits²) when the
    caller uses the logits), the forward under CPU autocast when given."""
    leaf = leaves({k: ins[k] for k in ("x", "W", "b")})
    f = torch.compile(fn, backend=backend) if backend else fn
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        loss, logits = f(**leaf, y=ins["y"], n=ins["n"])
    total = loss + 0.1 * logits.float().square().mean() if uses_logits else loss
    grads = torch.autograd.grad(total, list(leaf.values()), allow_unused=True)
    return [loss.detach(), logits.detach(),
            *(torch.zeros_like(p) if g is None else g for p, g in zip(leaf.values(), grads))]


def _check(fn, ins, backend, uses_logits, autocast=None, what=""):
    ours = _run(fn, ins, backend, uses_logits, autocast)
    same = _run(fn, ins, None, uses_logits, autocast)
    exact = _run(fn, {k: v.double() if v.is_floating_point() else v for k, v in ins.items()}, None, uses_logits)
    assert ours[1].dtype == same[1].dtype and ours[1].shape == same[1].shape
    for name, a, s, e in zip(("loss", "logits", "grad x", "grad W", "grad b"), ours, same, exact):
        assert_within_torch_error(a, s, e, what=f"{what} {name}")


@pytest.mark.parametrize("uses_logits", [False, True])
@pytest.mark.parametrize("strategy", ["recompute", "store"])
@pytest.mark.parametrize("name", sorted(RETURNING))
def test_returned_logits_fuse_and_match_eager(name, strategy, uses_logits):
    fn = RETURNING[name]
    rec = Recorder(**{"xent.strategy": strategy, "xent.store_budget": "1GiB"})
    _check(fn, make_inputs(), rec, uses_logits, what=name)
    assert fused_ops(rec.after[0]) == 1 and counters["inductor_xent"]["sites_declined"] == 0
    lse_used = name == "z_loss"  # store cannot map a logsumexp: recompute
    op = ops.STORE if strategy == "store" and not lse_used else ops.FORWARD
    (call,) = [n for n in rec.graphs[0].graph.nodes if n.target is op]
    assert call.args[-1] is True, "the op writes the logits"
    assert [t for t in rec.after[0] if t in (torch._C._nn.linear, torch.matmul, "matmul")] == [], "no second GEMM"


@pytest.mark.parametrize("name", ["hf", "gemma_softcap"])
def test_returned_logits_under_autocast(name):
    """bf16 autocast with fp32 parameters: the returned logits are bf16 as eager autocast's."""
    ins = {k: v.bfloat16().float() if v.is_floating_point() else v for k, v in make_inputs().items()}
    for uses_logits in (False, True):
        torch._dynamo.reset()
        rec = Recorder()
        _check(RETURNING[name], ins, rec, uses_logits, autocast=torch.bfloat16, what=name)
        assert fused_ops(rec.after[0]) == 1


@pytest.mark.parametrize("strategy", ["recompute", "store"])
def test_no_logits_gradient_in_the_compiled_backward(strategy):
    """AOTAutograd's graphs: the forward computes no [N, V] GEMM of its own (the op writes the logits),
    and the backward holds no [N, V] tensor at all: no zero tangent for the unused logits, no
    gradient of them (their only [N, V] work is outside, in EscapedLogits, when used)."""
    aot = AotEagerAndRecordGraphs()

    def backend(gm, example_inputs):
        patterns.run(gm, strategy=strategy, store_budget="1GiB", can_return=True)
        return escape.wrap(gm, aot(gm, example_inputs))

    ins = make_inputs()
    leaf = leaves({k: ins[k] for k in ("x", "W")})
    loss, logits = torch.compile(_nanogpt, backend=backend)(**leaf, y=ins["y"])
    loss.backward()
    assert logits.grad_fn is not None and type(logits.grad_fn).__name__.startswith("EscapedLogits")
    assert len(aot.fw_graphs) == len(aot.bw_graphs) == 1
    assert logits_sized(aot.bw_graphs) == []
    gemms = [n for n in aot.fw_graphs[0].graph.nodes if n.target in (torch.ops.aten.mm.default,
                                                                     torch.ops.aten.addmm.default)]
    assert [n for n in gemms if n.meta["val"].shape[-1] == V] == [], "no [N, V] GEMM of the graph's own"
    op = ops.STORE if strategy == "store" else ops.FORWARD
    assert op in targets(aot.fw_graphs[0])
    assert logits_sized(aot.fw_graphs, rows=B * T), "the forward does hold the returned logits"


def test_explain_and_counters_of_a_whole_model():
    """A module whose forward returns (logits, loss), compiled whole: explain says fused, that the
    logits are returned (no escape note), and the backend's counters agree."""
    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(V, 16)
            self.lm_head = torch.nn.Linear(16, V, bias=False)

        def forward(self, ids, targets):
            logits = self.lm_head(torch.tanh(self.emb(ids)))
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
            return logits, loss

    model, ins = GPT(), make_inputs()
    ids = ins["yv"]
    report = inductor_xent.explain(model, ids, ids)
    assert report.fused_count == 1 and not report.logits_escape, str(report)
    assert report.sites[0].logits_returned and "returned logits written by the op" in report.sites[0].reason
    counters.clear()
    logits, loss = torch.compile(model, backend="inductor_xent", options={"xent.inner": "aot_eager"})(ids, ids)
    eager_logits, eager_loss = model(ids, ids)
    torch.testing.assert_close(logits, eager_logits)
    torch.testing.assert_close(loss, eager_loss)
    assert counters["inductor_xent"]["sites_fused"] == 1


def _musicgen(x, W, Wdv, y, yv, weighted=False):
    """transformers' MusicgenForCausalLM compiled whole: codebook heads stacked on dim 1 (here two, the
    second a [D, V] weight used as ``x @ Wdv``), a loss per codebook of ``logits[:, :, -T:][:, k]``, and the
    stack returned reshaped to ``[B * codebooks, T, V]``. ``weighted``: the second codebook's loss has class
    weights (it declines: the graph computes that head's logits itself)."""
    logits = torch.stack([F.linear(x, W), x @ Wdv], dim=1)
    labels = torch.stack([y, yv], dim=-1)
    loss = torch.zeros([], dtype=x.dtype)
    for k in range(2):
        codebook = logits[:, :, -labels.shape[1]:][:, k].contiguous().view(-1, V)
        loss += F.cross_entropy(codebook, labels[..., k].contiguous().view(-1),
                                weight=torch.linspace(0.5, 1.5, V, dtype=x.dtype) if weighted and k else None)
    return loss / 2, logits.reshape(-1, *logits.shape[2:])


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("uses_logits", [False, True])
def test_returned_stacked_heads_fuse_and_match_eager(uses_logits, weighted):
    """MusicGen as ``torch.compile(model)`` sees it (its forward returns the stacked logits): each
    codebook's head fuses, its op writing its part of the returned stack; the returned values, the loss
    and every gradient as eager's, whether or not the caller uses the logits. With one head declining
    (class weights), the graph's own logits of that head sit in the stack beside the op's."""
    ins = make_inputs()
    leaf = leaves({k: ins[k] for k in ("x", "W", "Wdv")})

    def run(backend=None, dtype=torch.float32):
        args = {k: v.detach().to(dtype).requires_grad_() for k, v in leaf.items()}
        f = torch.compile(_musicgen, backend=backend) if backend else _musicgen
        loss, logits = f(**args, y=ins["y"], yv=ins["yv"], weighted=weighted)
        total = loss + 0.1 * logits.float().square().mean() if uses_logits else loss
        grads = torch.autograd.grad(total, list(args.values()))
        return [loss.detach(), logits.detach(), *grads]

    rec = Recorder()
    ours, same, exact = run(rec), run(), run(dtype=torch.float64)
    for name, a, s, e in zip(("loss", "logits", "grad x", "grad W", "grad Wdv"), ours, same, exact):
        assert a.shape == s.shape
        assert_within_torch_error(a, s, e, what=f"musicgen {name}")
    assert fused_ops(rec.after[0]) == (1 if weighted else 2)
    assert counters["inductor_xent"]["sites_declined"] == (1 if weighted else 0)
    matmuls = [t for t in rec.after[0] if t in (torch._C._nn.linear, torch.matmul, "matmul", operator.matmul)]
    assert len(matmuls) == (1 if weighted else 0), "the declined head's GEMM only"
    records = rec.graphs[0].meta[escape.META_KEY][1]
    assert sorted(r.stack[1] for r in records) == ([0] if weighted else [0, 1])


def test_returned_stack_with_sliced_rows_declines():
    """A loss over fewer rows than the stack returns (``logits[:, :, 1:]``): the op's logits would not
    cover the returned ones; the decline says so."""
    def fn(x, W, Wdv, y):
        logits = torch.stack([F.linear(x, W), x @ Wdv], dim=1)
        loss = sum(F.cross_entropy(logits[:, :, 1:][:, k].reshape(-1, V), y[:, 1:].reshape(-1)) for k in range(2))
        return loss, logits.reshape(-1, *logits.shape[2:])

    ins = make_inputs()
    report = inductor_xent.explain(fn, **leaves({k: ins[k] for k in ("x", "W", "Wdv")}), y=ins["y"])
    assert [s.fused for s in report.sites] == [False, False], str(report)
    assert all("slice or permutation" in s.reason for s in report.sites), str(report)


# ---------------------------------------------------------------------------------------------
# what still declines, and says why
# ---------------------------------------------------------------------------------------------
def _sliced(x, W, y, **_):
    logits = F.linear(x, W)
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1)), logits


def _aux_in_graph(x, W, y, **_):
    logits = F.linear(x, W)
    return F.cross_entropy(logits.view(-1, V), y.view(-1)) + 1e-3 * logits.pow(2).mean(), logits


def _log_softmax_returned(x, W, y, **_):
    logp = F.log_softmax(F.linear(x, W).float(), -1)
    return F.nll_loss(logp.view(-1, V), y.view(-1)), logp


def _entropy_and_logits(x, W, y, **_):
    logits = F.linear(x, W)
    logp = logits.float().log_softmax(-1)
    return -(logp.exp() * logp).sum(-1).mean(), logits


RETURN_DECLINES = {
    "loss_of_a_slice": (_sliced, "slice or permutation"),
    "other_user_in_graph": (_aux_in_graph, "other users in the graph"),
    "log_softmax_returned": (_log_softmax_returned, "is not the lm_head's output"),
    "entropy_head": (_entropy_and_logits, "log-probs op"),
}


@pytest.mark.parametrize("name", sorted(RETURN_DECLINES))
def test_returned_logits_that_decline_say_why(name):
    fn, words = RETURN_DECLINES[name]
    ins = make_inputs()
    report = inductor_xent.explain(fn, **leaves({k: ins[k] for k in ("x", "W")}), y=ins["y"])
    assert [s.fused for s in report.sites] == [False], str(report)
    assert words in report.sites[0].reason and report.logits_escape, report.sites[0].reason


def test_allow_escaping_logits_still_fuses_other_users():
    """With the option, logits that other nodes of the graph read are computed for them (the old
    behaviour), the loss fused; values and gradients as eager."""
    rec = Recorder(**{"xent.allow_escaping_logits": True})
    _check(_aux_in_graph, make_inputs(), rec, uses_logits=True, what="aux")
    assert fused_ops(rec.after[0]) == 1


# ---------------------------------------------------------------------------------------------
# whole-model compile of an HF model: the backend and install()
# ---------------------------------------------------------------------------------------------
def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 256, (2, 16))
    labels = ids.clone()
    labels[:, :5] = -100  # the prompt
    return model, {"input_ids": ids, "labels": labels}


def _llama_step(model, batch, compiled, autocast):
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = compiled(**batch)
    out.loss.backward()
    return [out.loss.detach(), out.logits.detach()] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.slow(s=111)
@pytest.mark.parametrize("how", ["backend", "install"])
@pytest.mark.parametrize("autocast", [False, True])
def test_hf_llama_whole_model_compile(how, autocast):
    """``torch.compile(model)`` with the caller taking ``.loss`` (what Trainer(torch_compile=True)
    runs): one fused site, the logits returned, loss, logits and every parameter's gradient as eager
    (fp32: to rounding; bf16 autocast: within eager autocast's own error against fp32)."""
    model, batch = _llama()
    if how == "install":
        inductor_xent.install()
        compiled = torch.compile(model)
    else:
        compiled = torch.compile(model, backend="inductor_xent", options={"xent.inner": "aot_eager"})
    ours = _llama_step(model, batch, compiled, autocast)
    assert counters["inductor_xent"]["sites_fused"] == 1 and counters["inductor_xent"]["sites_declined"] == 0
    same = _llama_step(model, batch, model, autocast)
    if not autocast:
        for a, s in zip(ours, same):
            torch.testing.assert_close(a, s, rtol=1e-4, atol=1e-5)
        return
    exact = _llama_step(model, batch, model, False)
    for i, (a, s, e) in enumerate(zip(ours, same, exact)):
        assert a.dtype == s.dtype
        assert_within_torch_error(a, s, e, floor=1e-3, what=f"output {i}")


def test_returned_stacked_heads_under_autocast():
    """MusicGen trained under bf16 autocast (fp32 parameters): the returned stack is bf16 as eager
    autocast's, and the loss, the stack and every gradient (the caller's loss reading the stack too)
    within eager autocast's error of float64."""
    from .helpers import autocast_representable

    ins = autocast_representable(make_inputs(), torch.bfloat16)

    def run(backend=None, dtype=torch.float32, autocast=True):
        args = {k: ins[k].detach().to(dtype).requires_grad_() for k in ("x", "W", "Wdv")}
        f = torch.compile(_musicgen, backend=backend) if backend else _musicgen
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, logits = f(**args, y=ins["y"], yv=ins["yv"])
        total = loss + 0.1 * logits.float().square().mean()
        return [loss.detach(), logits.detach(), *torch.autograd.grad(total, list(args.values()))]

    rec = Recorder()
    ours, same, exact = run(rec), run(), run(dtype=torch.float64, autocast=False)
    assert ours[1].dtype == same[1].dtype == torch.bfloat16 and fused_ops(rec.after[0]) == 2
    for name, a, s, e in zip(("loss", "logits", "grad x", "grad W", "grad Wdv"), ours, same, exact):
        assert_within_torch_error(a, s, e, floor=torch.finfo(torch.bfloat16).eps / 8, what=f"musicgen autocast {name}")
