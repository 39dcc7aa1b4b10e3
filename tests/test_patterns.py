"""The pass on Dynamo graphs: which spellings it fuses (graph before/after, exact site counts, eager
parity of the loss and every gradient) and which it must leave alone.

Sizes: V = 37 (prime, unaligned), D = 16, batch 2 x 7 tokens; targets mix ignore_index (-100) rows
into every batch, including one all-ignored sequence for the masked spellings.
"""

from __future__ import annotations

import operator

import expecttest
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import normalize_gm
from torch._dynamo.utils import counters

import inductor_xent
from inductor_xent import patterns
from inductor_xent.backend import inductor_xent as xent_backend

from .tolerance import assert_within_torch_error

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

V, D, B, T = 37, 16, 2, 7
OP = torch.ops.inductor_xent.linear_ce_fwd.default
STORE = torch.ops.inductor_xent.linear_ce_store.default  # mean/sum sites may take the store strategy (auto)


def fused_ops(targets) -> int:
    """How many fused ops (either strategy's) a recorded graph holds."""
    return sum(t is OP or t is STORE for t in targets)
SOURCE_TARGETS = {F.cross_entropy, F.nll_loss, torch._C._nn.linear, operator.matmul, torch.matmul, torch.mm,
                  torch.logsumexp, F.log_softmax}
SOURCE_METHODS = {"log_softmax", "gather", "logsumexp"}


def make_inputs(dtype=torch.float32, seed=0, batch=B):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, T, D, generator=g, dtype=dtype)
    W = (torch.randn(V, D, generator=g) * 0.5).to(dtype)
    Wdv = (torch.randn(D, V, generator=g) * 0.5).to(dtype)
    b = torch.randn(V, generator=g).to(dtype)
    yv = torch.randint(0, V, (batch, T), generator=g)
    y = yv.clone()
    y[0, ::3] = -100  # ignored rows mixed in
    y[-1, :] = -100 if batch > 2 else y[-1, :]
    return dict(x=x, W=W, Wdv=Wdv, b=b, y=y, yv=yv, n=(y != -100).sum())


def leaves(inputs, requires_grad=True):
    out = {}
    for k, v in inputs.items():
        v = v.detach().clone()
        if v.is_floating_point() and requires_grad:
            v.requires_grad_(True)
        out[k] = v
    return out


# ---------------------------------------------------------------------------------------------
# spellings that must fuse: name -> (fn(x, W, Wdv, b, y, yv, n), pattern)
# ---------------------------------------------------------------------------------------------
def _hf_loss(logits, labels, n):
    """transformers' ForCausalLMLoss with num_items_in_batch: pad-shifted labels, sum / n."""
    logits = logits.float()
    labels = F.pad(labels, (0, 1), value=-100)
    shift = labels[..., 1:].contiguous()
    loss = F.cross_entropy(logits.view(-1, V), shift.view(-1).to(logits.device), ignore_index=-100,
                           reduction="sum")
    return loss / n


SPELLINGS = {
    # F.linear without bias, view to rows: nanoGPT / HF
    "linear_view_mean": (lambda x, W, Wdv, b, y, yv, n: F.cross_entropy(F.linear(x, W).view(-1, V), y.view(-1)),
                         "lm_head_cross_entropy"),
    # nanoGPT: logits.view(-1, logits.size(-1)), ignore_index=-1
    "nanogpt": (lambda x, W, Wdv, b, y, yv, n: _nanogpt(x, W, torch.where(y < 0, -1, y)), "lm_head_cross_entropy"),
    # F.linear with bias, upcast, reduction sum
    "linear_bias_float_sum": (lambda x, W, Wdv, b, y, yv, n: F.cross_entropy(
        F.linear(x, W, b).float().view(-1, V), y.view(-1), reduction="sum"), "lm_head_cross_entropy"),
    # @ with .T and a constant scale (muP-style output multiplier), reshape
    "matmul_T_scale": (lambda x, W, Wdv, b, y, yv, n: F.cross_entropy(
        ((x @ W.T) * 0.5).reshape(-1, V), y.reshape(-1)), "lm_head_cross_entropy"),
    # torch.mm of flattened hidden with .t(), division by a constant, .to(dtype)
    "mm_t_div_to": (lambda x, W, Wdv, b, y, yv, n: F.cross_entropy(
        (torch.mm(x.view(-1, D), W.t()) / 3.0).to(torch.float32), y.flatten()), "lm_head_cross_entropy"),
    # weight stored [D, V]: torch.matmul(x, Wdv)
    "weight_dv": (lambda x, W, Wdv, b, y, yv, n: F.cross_entropy(
        torch.matmul(x, Wdv).flatten(0, 1), y.flatten()), "lm_head_cross_entropy"),
    # einsum, weight [V, D]
    "einsum": (lambda x, W, Wdv, b, y, yv, n: F.cross_entropy(
        torch.einsum("btd,vd->btv", x, W).view(-1, V), y.view(-1)), "lm_head_cross_entropy"),
    # Gemma 2 final_logit_softcapping: div -> tanh -> mul, then .float()
    "softcap": (lambda x, W, Wdv, b, y, yv, n: F.cross_entropy(
        (torch.tanh(F.linear(x, W) / 2.0) * 2.0).float().view(-1, V), y.view(-1)), "lm_head_cross_entropy"),
    # a separate bias add after the matmul
    "bias_add": (lambda x, W, Wdv, b, y, yv, n: F.cross_entropy(
        (x @ W.t() + b).view(-1, V), y.view(-1)), "lm_head_cross_entropy"),
    # slicing the logits along the sequence (pushed onto the hidden states)
    "slice_seq": (lambda x, W, Wdv, b, y, yv, n: F.cross_entropy(
        F.linear(x, W)[:, :-1, :].contiguous().view(-1, V), y[:, 1:].reshape(-1)), "lm_head_cross_entropy"),
    # class dim moved to 1
    "transpose": (lambda x, W, Wdv, b, y, yv, n: F.cross_entropy(F.linear(x, W, b).transpose(1, 2), y),
                  "lm_head_cross_entropy"),
    # reduction="none", then the user's own masking and mean
    "none_masked": (lambda x, W, Wdv, b, y, yv, n: (
        F.cross_entropy(F.linear(x, W).view(-1, V), y.view(-1), reduction="none")
        * (y.view(-1) != -100)).sum() / (y != -100).sum(), "lm_head_cross_entropy"),
    # ignore_index and label smoothing
    "ignore_smoothing": (lambda x, W, Wdv, b, y, yv, n: F.cross_entropy(
        F.linear(x, W).view(-1, V), torch.where(y < 0, -1, y).view(-1), ignore_index=-1, label_smoothing=0.2),
        "lm_head_cross_entropy"),
    # transformers ForCausalLMLoss with num_items_in_batch
    "hf_causal_lm": (lambda x, W, Wdv, b, y, yv, n: _hf_loss(F.linear(x, W), y, n), "lm_head_cross_entropy"),
    # nll_loss of log_softmax
    "nll_log_softmax": (lambda x, W, Wdv, b, y, yv, n: F.nll_loss(
        F.log_softmax(F.linear(x, W).float(), dim=-1).view(-1, V), y.view(-1)), "log_softmax_nll"),
    # nll_loss with the class dim at 1
    "nll_transposed": (lambda x, W, Wdv, b, y, yv, n: F.nll_loss(
        torch.log_softmax(F.linear(x, W), -1).transpose(1, 2), y, reduction="sum"), "log_softmax_nll"),
    # -log p(target) through gather
    "logprob_gather": (lambda x, W, Wdv, b, y, yv, n: -(
        F.linear(x, W).log_softmax(-1).gather(-1, yv.unsqueeze(-1)).squeeze(-1)).mean(), "log_softmax_nll"),
    # -(one_hot * log_softmax).sum(-1)
    "one_hot": (lambda x, W, Wdv, b, y, yv, n: -(
        F.one_hot(yv, V).float() * F.log_softmax(x @ W.t(), dim=-1)).sum(-1).mean(), "one_hot"),
}


def _z_loss(x, W, Wdv, b, y, yv, n):
    """cross-entropy plus a PaLM-style z-loss on a separately computed logsumexp."""
    logits = F.linear(x, W).float()
    ce = F.cross_entropy(logits.view(-1, V), y.view(-1))
    return ce + 1e-2 * torch.logsumexp(logits, dim=-1).pow(2).mean()


def _nanogpt(x, W, targets):
    logits = F.linear(x, W)
    B, T, C = logits.shape
    return F.cross_entropy(logits.view(B * T, logits.size(-1)), targets.view(-1), ignore_index=-1)


def _lse_minus_gather(x, W, Wdv, b, y, yv, n):
    """logsumexp - gather, torch.gather and [..., 0] spelling, in the matmul dtype."""
    z = x @ W.t()
    return (torch.logsumexp(z, dim=-1) - torch.gather(z, -1, yv[..., None])[..., 0]).mean()


def _lse_gather_shared(x, W, Wdv, b, y, yv, n):
    """logsumexp and gather of the same logits node, the lse reused for a z-loss."""
    z = F.linear(x, W).float()
    lse = torch.logsumexp(z, -1)
    return (lse - z.gather(-1, yv[..., None]).squeeze(-1)).mean() + 1e-2 * (lse**2).mean()


def _lse_keepdim(x, W, Wdv, b, y, yv, n):
    """keepdim=True logsumexp minus the unsqueezed gather, squeezed at the end; z-loss on the
    matmul-dtype logits before an upcast."""
    z = F.linear(x, W, b)
    lse = torch.logsumexp(z, -1, keepdim=True)
    rows = (lse.float() - z.float().gather(-1, yv.unsqueeze(-1))).squeeze(-1)
    return rows.sum() + 1e-2 * lse.square().sum()


def _tied(x, W, Wdv, b, y, yv, n):
    """GPT-2 / nanoGPT tied embeddings: the lm_head weight is the token embedding."""
    h = F.embedding(yv, W) + x
    return F.cross_entropy(F.linear(h, W).view(-1, V), y.view(-1))


SPELLINGS.update({
    "z_loss": (_z_loss, "lm_head_cross_entropy"),
    "lse_gather_shared": (_lse_gather_shared, "logsumexp_minus_gather"),
    "lse_minus_gather": (_lse_minus_gather, "logsumexp_minus_gather"),
    "lse_keepdim": (_lse_keepdim, "logsumexp_minus_gather"),
    "tied_embedding": (_tied, "lm_head_cross_entropy"),
})


def _prophetnet(x, W, Wdv, b, y, yv, n):
    """ProphetNet: the streams' logits [B, ngram, T, V] moved to [ngram, B, T, V] before the loss
    (here B and T play ngram and B); log_softmax with dtype=float32 then nll_loss."""
    z = F.linear(x, W).transpose(0, 1).contiguous()
    lp = F.log_softmax(z.view(-1, z.size(-1)), dim=-1, dtype=torch.float32)
    return F.nll_loss(lp, y.transpose(0, 1).reshape(-1))


SPELLINGS.update({
    # RecurrentGemma: F.tanh (its own callable in the graph, not torch.tanh), cap on the right
    "softcap_functional_tanh": (lambda x, W, Wdv, b, y, yv, n: F.cross_entropy(
        (F.tanh(F.linear(x, W) / 2.0) * 2.0).view(-1, V), y.view(-1)), "lm_head_cross_entropy"),
    # the cap first, the division written as a multiplication, the method spelling of tanh
    "softcap_cap_first": (lambda x, W, Wdv, b, y, yv, n: F.cross_entropy(
        (2.0 * (F.linear(x, W) * 0.5).tanh()).view(-1, V), y.view(-1)), "lm_head_cross_entropy"),
    # Dory: a learned scale per vocabulary entry after the upcast (b stands for it; its gradient is checked)
    "vocab_scale": (lambda x, W, Wdv, b, y, yv, n: F.cross_entropy(
        (F.linear(x, W).float() * b).view(-1, V), y.view(-1)), "lm_head_cross_entropy"),
    # a 0-dim tensor factor on the left, on a [D, V] weight, before a softcap
    "scalar_tensor_scale": (lambda x, W, Wdv, b, y, yv, n: F.cross_entropy(
        (torch.tanh((b[0] * (x @ Wdv)) / 3.0) * 3.0).view(-1, V), y.view(-1)), "lm_head_cross_entropy"),
    "prophetnet_transpose": (_prophetnet, "log_softmax_nll"),
    # a permutation of the leading dims, then the [B, T]-shaped targets permuted alike
    "permute_leading": (lambda x, W, Wdv, b, y, yv, n: F.cross_entropy(
        F.linear(x, W).permute(1, 0, 2).reshape(-1, V), y.t().reshape(-1)), "lm_head_cross_entropy"),
})


if hasattr(F, "linear_cross_entropy"):  # torch 2.13+: its reference path inlines to linear + CE
    SPELLINGS["torch_linear_cross_entropy"] = (lambda x, W, Wdv, b, y, yv, n: F.linear_cross_entropy(
        x.view(-1, D), W, y.view(-1), linear_bias=b, ignore_index=-100), "lm_head_cross_entropy")


class Recorder:
    """A backend: records the Dynamo graph's targets before and after our pass, then compiles."""

    def __init__(self, **options):
        self.options = {"xent.inner": "aot_eager", **options}
        self.before, self.after, self.graphs = [], [], []

    def __call__(self, gm, example_inputs):
        self.before.append(_targets(gm))
        self.graphs.append(gm)
        out = xent_backend(gm, example_inputs, options=self.options)
        self.after.append(_targets(gm))
        return out


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


def _sources(targets) -> list:
    return [t for t in targets if t in SOURCE_TARGETS or (isinstance(t, str) and t in SOURCE_METHODS)]


def run_both(fn, inputs, backend, requires_grad=True, fp64=True):
    """(eager loss, eager grads, compiled loss, compiled grads[, fp64 loss, fp64 grads])."""
    results = []
    for mode in ("eager", "compiled", "fp64")[: 3 if fp64 else 2]:
        ins = leaves(inputs, requires_grad)
        if mode == "fp64":
            ins = {k: (v.detach().double().requires_grad_(requires_grad) if v.is_floating_point() else v)
                   for k, v in ins.items()}
        f = torch.compile(fn, backend=backend) if mode == "compiled" else fn
        loss = f(**ins)
        grads = {}
        if requires_grad:
            loss.backward()
            grads = {k: v.grad for k, v in ins.items() if v.is_floating_point() and v.grad is not None}
        results += [loss.detach(), grads]
    return results


def assert_parity(fn, inputs, backend, requires_grad=True, what=""):
    le, ge, lc, gc, l64, g64 = run_both(fn, inputs, backend, requires_grad)
    assert lc.dtype == le.dtype and lc.shape == le.shape
    assert_within_torch_error(lc, le, l64, what=f"{what} loss")
    assert set(gc) == set(ge), f"{what}: gradients of {sorted(gc)} vs eager {sorted(ge)}"
    for k in ge:
        assert_within_torch_error(gc[k], ge[k], g64[k], what=f"{what} grad {k}")


# ---------------------------------------------------------------------------------------------
# fused spellings: graph and numbers
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_spelling_fuses_and_matches_eager(name):
    fn, pattern = SPELLINGS[name]
    rec = Recorder()
    assert_parity(fn, make_inputs(), rec, what=name)
    assert len(rec.before) == 1, "one graph, no graph break"
    assert _sources(rec.before[0]), "the source ops are in the graph before the pass"
    assert fused_ops(rec.after[0]) == 1
    assert _sources(rec.after[0]) == [], f"source ops left after the pass: {_sources(rec.after[0])}"
    assert counters["inductor_xent"]["sites_fused"] == 1
    assert counters["inductor_xent"][f"fused.{pattern}"] == 1
    assert counters["inductor_xent"]["sites_declined"] == 0


@pytest.mark.parametrize("name", ["linear_bias_float_sum", "softcap", "transpose", "z_loss"])
def test_inference_no_grad(name):
    fn, _ = SPELLINGS[name]
    rec = Recorder()
    with torch.no_grad():
        assert_parity(fn, make_inputs(), rec, requires_grad=False, what=name)
    assert fused_ops(rec.after[0]) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_other_dtypes(dtype):
    """bf16 (the op keeps fp32 logits: at least as accurate as eager) and float64."""
    fn, _ = SPELLINGS["linear_bias_float_sum" if dtype == torch.bfloat16 else "bias_add"]
    rec = Recorder()
    le, ge, lc, gc, l64, g64 = run_both(fn, make_inputs(dtype), rec)
    assert fused_ops(rec.after[0]) == 1
    assert lc.dtype == le.dtype
    assert_within_torch_error(lc, le, l64, floor=1e-10 if dtype == torch.float64 else 1e-6, what="loss")
    for k in ge:
        assert gc[k].dtype == ge[k].dtype
        assert_within_torch_error(gc[k], ge[k], g64[k], floor=1e-10 if dtype == torch.float64 else 1e-6,
                                  what=f"grad {k}")


def test_vocab_scale_bf16_within_torch_error():
    """The per-vocabulary scale goes into the weight in bf16 (one rounding per weight entry where eager
    rounds each logit once): loss and every gradient, the scale's included, within torch's own error."""
    fn, _ = SPELLINGS["vocab_scale"]
    rec = Recorder()
    le, ge, lc, gc, l64, g64 = run_both(fn, make_inputs(torch.bfloat16), rec)
    assert rec.after[0].count(OP) == 1
    assert_within_torch_error(lc, le, l64, what="loss")
    for k in ge:
        assert gc[k].dtype == ge[k].dtype
        assert_within_torch_error(gc[k], ge[k], g64[k], what=f"grad {k}")


def test_partial_requires_grad():
    """Only the weight trains (frozen hidden states): no grad for x, weight grad exact."""
    fn, _ = SPELLINGS["linear_view_mean"]
    ins = make_inputs()
    rec = Recorder()
    results = []
    for f in (fn, torch.compile(fn, backend=rec)):
        W = ins["W"].clone().requires_grad_(True)
        loss = f(ins["x"], W, ins["Wdv"], ins["b"], ins["y"], ins["yv"], ins["n"])
        loss.backward()
        results.append((loss.detach(), W.grad))
    torch.testing.assert_close(results[1][0], results[0][0])
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-6)
    assert fused_ops(rec.after[0]) == 1


def test_all_ignored_mean_is_nan_like_eager():
    fn, _ = SPELLINGS["linear_view_mean"]
    ins = make_inputs()
    ins["y"] = torch.full_like(ins["y"], -100)
    eager = fn(**ins)
    compiled = torch.compile(fn, backend=Recorder())(**ins)
    assert torch.isnan(eager) and torch.isnan(compiled)
    assert counters["inductor_xent"]["sites_fused"] == 1


class _Head(torch.nn.Module):
    """nn.Linear + nn.CrossEntropyLoss modules, as a model would hold them."""

    def __init__(self):
        super().__init__()
        self.lm_head = torch.nn.Linear(D, V, bias=True)
        self.loss = torch.nn.CrossEntropyLoss(ignore_index=-100, label_smoothing=0.1)

    def forward(self, x, y):
        return self.loss(self.lm_head(x).view(-1, V), y.view(-1))


def test_modules_linear_and_cross_entropy_loss():
    """nn.Linear (bias) + nn.CrossEntropyLoss(label_smoothing): parameters are graph inputs."""
    torch.manual_seed(0)
    head, ins = _Head(), make_inputs()
    rec = Recorder()
    results = []
    for f in (head, torch.compile(head, backend=rec)):
        head.zero_grad(set_to_none=True)
        x = ins["x"].clone().requires_grad_(True)
        loss = f(x, ins["y"])
        loss.backward()
        results.append([loss.detach(), x.grad, head.lm_head.weight.grad, head.lm_head.bias.grad])
    for c, e in zip(results[1], results[0]):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)
    assert fused_ops(rec.after[0]) == 1 and torch.nn.functional.cross_entropy not in rec.after[0]
    assert counters["inductor_xent"]["fused.lm_head_cross_entropy"] == 1


def test_two_sites_in_one_graph():
    """Two heads (e.g. a multi-token-prediction model): each fused, exact count 2."""
    def fn(x, W, Wdv, b, y, yv, n):
        a = F.cross_entropy(F.linear(x, W).view(-1, V), y.view(-1))
        c = F.cross_entropy((x @ Wdv).view(-1, V), yv.view(-1))
        return a + c
    rec = Recorder()
    assert_parity(fn, make_inputs(), rec, what="two sites")
    assert fused_ops(rec.after[0]) == 2
    assert counters["inductor_xent"]["sites_fused"] == 2


# ---------------------------------------------------------------------------------------------
# declines: no rewrite, identical results, a reason
# ---------------------------------------------------------------------------------------------
DECLINES = {
    "class_weights": (lambda x, W, Wdv, b, y, yv, n: F.cross_entropy(
        F.linear(x, W).view(-1, V), y.view(-1), weight=torch.linspace(0.5, 1.5, V)), "class weights"),
    "probability_targets": (lambda x, W, Wdv, b, y, yv, n: F.cross_entropy(
        F.linear(x, W).view(-1, V), F.softmax(F.linear(x, Wdv.t()), -1).detach().view(-1, V)),
        "probability targets"),
    "logits_other_user": (lambda x, W, Wdv, b, y, yv, n: _other_user(x, W, y), "other users"),
    "float64_upcast": (lambda x, W, Wdv, b, y, yv, n: F.cross_entropy(
        F.linear(x, W).double().view(-1, V), y.view(-1)), "float64 loss"),
    "unsupported_op_between": (lambda x, W, Wdv, b, y, yv, n: F.cross_entropy(
        torch.relu(F.linear(x, W)).view(-1, V), y.view(-1)), "unsupported op"),
    "no_grad_lm_head": (lambda x, W, Wdv, b, y, yv, n: _no_grad_head(x, W, y), "grad mode changes"),
    "mixed_dtype_bias": (lambda x, W, Wdv, b, y, yv, n: F.cross_entropy(
        (x.bfloat16() @ W.bfloat16().t() + b).view(-1, V), y.view(-1)), "mixed dtypes"),
    "nll_class_weights": (lambda x, W, Wdv, b, y, yv, n: F.nll_loss(
        F.log_softmax(F.linear(x, W), -1).view(-1, V), y.view(-1), weight=torch.linspace(0.5, 1.5, V)),
        "class weights"),
    "one_hot_keepdim": (lambda x, W, Wdv, b, y, yv, n: -(
        F.one_hot(yv, V) * F.log_softmax(F.linear(x, W), -1)).sum(-1, keepdim=True).mean(), "without keepdim"),
    "legacy_reduce": (lambda x, W, Wdv, b, y, yv, n: F.cross_entropy(
        F.linear(x, W).view(-1, V), y.view(-1), size_average=True), "legacy"),
    # a factor per row (here a padding mask) is not a per-vocabulary scale: it cannot go into the weight
    "row_mask_multiply": (lambda x, W, Wdv, b, y, yv, n: F.cross_entropy(
        (F.linear(x, W) * (y != -100).unsqueeze(-1)).view(-1, V), y.view(-1)), "unsupported op"),
    # a per-vocabulary factor computed from the logits themselves
    "scale_from_logits": (lambda x, W, Wdv, b, y, yv, n: _scale_from_logits(x, W, y), "computed from the logits"),
    # after the softcap only a Python number can be folded (into the cap)
    "tensor_scale_after_tanh": (lambda x, W, Wdv, b, y, yv, n: F.cross_entropy(
        (torch.tanh(F.linear(x, W) / 2.0) * b).view(-1, V), y.view(-1)), "after the softcap"),
    # one_hot(y[T]) * lp[B, T, V] broadcasts every batch row against the same targets
    "one_hot_broadcast": (lambda x, W, Wdv, b, y, yv, n: -(
        F.one_hot(yv[0], V) * F.log_softmax(F.linear(x, W), -1)).sum(-1).mean(), "broadcast"),
}


def _scale_from_logits(x, W, y):
    z = F.linear(x, W)
    return F.cross_entropy((z * z.detach().mean((0, 1))).view(-1, V), y.view(-1))


def _no_grad_head(x, W, y):
    """The head runs under no_grad: moving its
    work into the loss's grad-enabled region would add gradients eager never computes."""
    with torch.no_grad():
        logits = F.linear(x, W)
    return F.cross_entropy(logits.view(-1, V), y.view(-1)) + x.sum() * 0


def _other_user(x, W, y):
    logits = F.linear(x, W)
    return F.cross_entropy(logits.view(-1, V), y.view(-1)) + 1e-3 * logits.pow(2).mean()


@pytest.mark.parametrize("name", sorted(DECLINES))
def test_declines_with_reason(name):
    fn, words = DECLINES[name]
    rec = Recorder()
    le, ge, lc, gc = run_both(fn, make_inputs(), rec, fp64=False)
    assert fused_ops(rec.after[0]) == 0
    assert rec.after[0] == rec.before[0], "a declined site leaves the graph untouched"
    torch.testing.assert_close(lc, le)
    for k in ge:
        torch.testing.assert_close(gc[k], ge[k])
    assert counters["inductor_xent"]["sites_declined"] == 1
    assert counters["inductor_xent"]["sites_fused"] == 0
    report = inductor_xent.explain(fn, **make_inputs())
    assert [s.fused for s in report.sites] == [False]
    assert words in report.sites[0].reason, report.sites[0].reason


def test_inplace_update_through_a_view_declines():
    """The op reads the hidden states where the loss is: an in-place update of a view of them in
    between (here of the buffer behind ``h.view``) must keep the site unfused. Forward only: eager
    autograd refuses the mutation of a saved tensor anyway."""

    def fn(x, W, y):
        h = x.detach().clone()
        logits = F.linear(h.view(-1, D), W)
        h.mul_(3)
        return F.cross_entropy(logits, y.view(-1))

    inputs = make_inputs()
    args = (inputs["x"], inputs["W"], inputs["y"])
    with torch.no_grad():
        want = fn(*args)
        got = torch.compile(fn, backend=xent_backend, options={"xent.inner": "aot_eager"})(*args)
    torch.testing.assert_close(got, want)
    assert counters["inductor_xent"]["sites_fused"] == 0
    assert counters["inductor_xent"]["sites_declined"] == 1
    report = inductor_xent.explain(fn, *args)
    assert "Tensor.mul_ writes the hidden states" in report.sites[0].reason, report.sites[0].reason


def test_returned_logits_decline_then_fuse_when_allowed():
    def fn(x, W, Wdv, b, y, yv, n):
        logits = F.linear(x, W)
        return F.cross_entropy(logits.float().view(-1, V), y.view(-1)), logits
    ins = make_inputs()
    rec = Recorder()
    torch.compile(fn, backend=rec)(**ins)
    assert fused_ops(rec.after[0]) == 0
    site = inductor_xent.explain(fn, **ins).sites[0]
    assert site.logits_escape and "graph output" in site.reason

    torch._dynamo.reset()
    counters.clear()
    rec = Recorder(**{"xent.allow_escaping_logits": True})
    eager, compiled = [], []
    for f, out in ((fn, eager), (torch.compile(fn, backend=rec), compiled)):
        L = leaves(ins)
        loss, logits = f(**L)
        (loss + logits.sum() * 1e-3).backward()
        out += [loss.detach(), logits.detach(), L["x"].grad, L["W"].grad]
    for a, c in zip(eager, compiled):
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-5)
    assert fused_ops(rec.after[0]) == 1
    assert torch._C._nn.linear in rec.after[0], "the logits are still computed for the caller"
    assert counters["inductor_xent"]["sites_fused"] == 1


def test_not_a_site():
    """Cross-entropy of something that is not a matmul output: no site, nothing reported."""
    def fn(z, y):
        return F.cross_entropy(z.view(-1, V) * 2.0, y.view(-1))
    ins = make_inputs()
    rec = Recorder()
    torch.compile(fn, backend=rec)(torch.randn(B, T, V), ins["y"])
    assert rec.after[0] == rec.before[0]
    assert counters["inductor_xent"]["sites_fused"] == counters["inductor_xent"]["sites_declined"] == 0


def test_autocast_declines():
    fn, _ = SPELLINGS["linear_view_mean"]
    rec = Recorder()
    ins = make_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = fn(**ins)
        compiled = torch.compile(fn, backend=rec)(**ins)
    torch.testing.assert_close(compiled, eager)
    assert fused_ops(rec.after[0]) == 0 and counters["inductor_xent"]["sites_declined"] == 1


# ---------------------------------------------------------------------------------------------
# dynamic shapes: no guard, recompile or graph break of our own
# ---------------------------------------------------------------------------------------------
class Counting:
    def __init__(self, backend):
        self.backend, self.frames = backend, 0

    def __call__(self, gm, example_inputs):
        self.frames += 1
        return self.backend(gm, example_inputs)


@pytest.mark.parametrize("name", ["hf_causal_lm", "slice_seq", "z_loss", "transpose"])
def test_dynamic_batch_no_extra_recompiles(name):
    """Automatic dynamic: batch 2, 3, 4. Frames compiled must equal what plain AOT compilation
    (no pass) needs, and the numbers stay exact on each size."""
    fn, _ = SPELLINGS[name]
    counts = []
    for backend in (Counting(Recorder()), Counting(Recorder(**{"xent.enable": False}))):
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(fn, backend=backend)
        for batch in (2, 3, 4):
            ins = make_inputs(batch=batch, seed=batch)
            torch.testing.assert_close(compiled(**ins), fn(**ins), rtol=1e-5, atol=1e-6)
        counts.append((backend.frames, sum(counters["graph_break"].values())))
    assert counts[0] == counts[1]
    assert counts[0][0] == 2, "static first, then one dynamic recompile"


def test_mark_dynamic_one_compile():
    fn, _ = SPELLINGS["linear_bias_float_sum"]
    backend = Counting(Recorder())
    compiled = torch.compile(fn, backend=backend)
    for batch in (2, 5):
        ins = make_inputs(batch=batch, seed=batch)
        torch._dynamo.mark_dynamic(ins["x"], 0)
        torch._dynamo.mark_dynamic(ins["y"], 0)
        torch._dynamo.mark_dynamic(ins["yv"], 0)
        torch.testing.assert_close(compiled(**ins), fn(**ins), rtol=1e-5, atol=1e-5)
    assert backend.frames == 1
    assert fused_ops(backend.backend.after[0]) == 1


# ---------------------------------------------------------------------------------------------
# canonical printouts, pinned for the CI torch version
# ---------------------------------------------------------------------------------------------
pinned = pytest.mark.skipif(not torch.__version__.startswith("2.13"), reason="printouts pinned for torch 2.13")


def _printout(fn, inputs):
    rec = Recorder()
    torch.compile(fn, backend=rec)(**inputs)
    return normalize_gm(rec.graphs[0].print_readable(print_output=False))


@pinned
class TestPrintouts(expecttest.TestCase):
    def test_hf_causal_lm(self):
        fn, _ = SPELLINGS["hf_causal_lm"]
        self.assertExpectedInline(_printout(fn, make_inputs()), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 7, 16]", L_W_: "f32[37, 16]", L_y_: "i64[2, 7]", L_n_: "i64[]"):
        l_x_ = L_x_
        l_w_ = L_W_
        l_y_ = L_y_
        l_n_ = L_n_

        labels: "i64[2, 8]" = torch._C._nn.pad(l_y_, (0, 1), 'constant', -100);  l_y_ = None

        getitem: "i64[2, 7]" = labels[(Ellipsis, slice(1, None, None))];  labels = None
        shift: "i64[2, 7]" = getitem.contiguous();  getitem = None

        view_1: "i64[14]" = shift.view(-1);  shift = None
        to: "i64[14]" = view_1.to(device(type='cpu'));  view_1 = None
        reshape: "f32[14, 16]" = l_x_.reshape([-1, 16]);  l_x_ = None
        linear_ce_fwd_default = torch.ops.inductor_xent.linear_ce_fwd.default(reshape, l_w_, None, to, -100, 0.0, 1.0, None, 0.0);  reshape = l_w_ = to = None
        getitem_1: "f32[14]" = linear_ce_fwd_default[0]
        getitem_2: "f32[14]" = linear_ce_fwd_default[1];  linear_ce_fwd_default = getitem_2 = None
        sum_1: "f32[]" = getitem_1.sum();  getitem_1 = None

        truediv: "f32[]" = sum_1 / l_n_;  sum_1 = l_n_ = None
        return (truediv,)
""")

    def test_softcap_slice_none(self):
        def fn(x, W, Wdv, b, y, yv, n):
            z = torch.tanh(F.linear(x, W)[:, :-1] / 2.0) * 2.0
            return F.cross_entropy(z.float().reshape(-1, V), y[:, 1:].reshape(-1), reduction="none")
        self.assertExpectedInline(_printout(fn, make_inputs()), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 7, 16]", L_W_: "f32[37, 16]", L_y_: "i64[2, 7]"):
        l_x_ = L_x_
        l_w_ = L_W_
        l_y_ = L_y_

        getitem_1: "i64[2, 6]" = l_y_[(slice(None, None, None), slice(1, None, None))];  l_y_ = None
        reshape_1: "i64[12]" = getitem_1.reshape(-1);  getitem_1 = None
        getitem_2: "f32[2, 6, 16]" = l_x_[(slice(None, None, None), slice(None, -1, None))];  l_x_ = None
        reshape_2: "f32[12, 16]" = getitem_2.reshape([-1, 16]);  getitem_2 = None
        linear_ce_fwd_default = torch.ops.inductor_xent.linear_ce_fwd.default(reshape_2, l_w_, None, reshape_1, -100, 0.0, 1.0, 2.0, 0.0);  reshape_2 = l_w_ = None
        getitem_3: "f32[12]" = linear_ce_fwd_default[0]
        getitem_4: "f32[12]" = linear_ce_fwd_default[1];  linear_ce_fwd_default = getitem_4 = None
        view_as: "f32[12]" = getitem_3.view_as(reshape_1);  getitem_3 = reshape_1 = None
        return (view_as,)
""")


def test_pass_is_idempotent_and_lints():
    """Running the pass again on a rewritten graph finds nothing more."""
    fn, _ = SPELLINGS["hf_causal_lm"]
    rec = Recorder()
    torch.compile(fn, backend=rec)(**make_inputs())
    gm = rec.graphs[0]
    assert patterns.run(gm) == []
    gm.graph.lint()


def test_internal_error_declines_instead_of_failing(monkeypatch):
    """A bug in an idiom's analysis must not break the user's compile: the site is left alone."""
    from inductor_xent.patterns import lm_head_cross_entropy

    def broken(node):
        if node.target is F.cross_entropy:
            raise RuntimeError("boom")
        return None

    monkeypatch.setattr(lm_head_cross_entropy, "match", broken)
    fn, _ = SPELLINGS["linear_view_mean"]
    rec = Recorder()
    ins = make_inputs()
    torch.testing.assert_close(torch.compile(fn, backend=rec)(**ins), fn(**ins))
    assert rec.after[0] == rec.before[0]
    assert counters["inductor_xent"]["sites_declined"] == 1


# ---------------------------------------------------------------------------------------------
# "in any combination": a fixed random sample of (matmul, logits transform, cast, slice, loss,
# z-loss) combinations, each fused exactly once and exact
# ---------------------------------------------------------------------------------------------
def _matmul(kind, x, W, Wdv, b):
    if kind == "linear":
        return F.linear(x, W)
    if kind == "linear_bias":
        return F.linear(x, W, b)
    if kind == "matmul_T_bias_add":
        return x @ W.T + b
    if kind == "mm_view":
        return torch.mm(x.reshape(-1, D), W.t()).view(x.shape[0], x.shape[1], V)
    if kind == "einsum":
        return torch.einsum("btd,vd->btv", x, W)
    return torch.matmul(x, Wdv)  # [D, V] weight


def _transform(kind, z):
    if kind == "scale":
        return z * 0.7
    if kind == "softcap":
        return torch.tanh(z / 5.0) * 5.0
    if kind == "scale_softcap":
        return torch.tanh((z / 2.0) / 5.0) * 5.0
    return z


def _loss(kind, z, t, tv):
    if kind == "ce_mean":
        return F.cross_entropy(z.reshape(-1, V), t.reshape(-1))
    if kind == "ce_sum_smoothing":
        return F.cross_entropy(z.reshape(-1, V), t.reshape(-1), reduction="sum", label_smoothing=0.1)
    if kind == "ce_none_masked":
        mask = (t != -100).reshape(-1)
        return (F.cross_entropy(z.reshape(-1, V), t.reshape(-1), reduction="none") * mask).sum() / mask.sum()
    if kind == "ce_transposed":
        return F.cross_entropy(z.transpose(1, 2), t)
    if kind == "nll":
        return F.nll_loss(F.log_softmax(z, -1).reshape(-1, V), t.reshape(-1))
    if kind == "lse_gather":
        return (torch.logsumexp(z, -1) - z.gather(-1, tv[..., None]).squeeze(-1)).mean()
    if kind == "one_hot":
        return -(F.one_hot(tv, V) * F.log_softmax(z, -1)).sum(-1).mean()
    return -(z.log_softmax(-1).gather(-1, tv[..., None])).mean()  # logprob_gather


_AXES = dict(
    matmul=["linear", "linear_bias", "matmul_T_bias_add", "mm_view", "einsum", "weight_dv"],
    transform=["none", "scale", "softcap", "scale_softcap"],
    cast=[False, True],
    slice_seq=[False, True],
    loss=["ce_mean", "ce_sum_smoothing", "ce_none_masked", "ce_transposed", "nll", "lse_gather", "one_hot",
          "logprob_gather"],
    z_loss=[False, True],
)
_ALL = [dict(zip(_AXES, values)) for values in __import__("itertools").product(*_AXES.values())]
COMBOS = __import__("random").Random(0).sample(_ALL, 24)


def _combination(combo):
    def fn(x, W, Wdv, b, y, yv, n):
        z = _transform(combo["transform"], _matmul(combo["matmul"], x, W, Wdv, b))
        t, tv = y, yv
        if combo["slice_seq"]:
            z, t, tv = z[:, :-1], y[:, 1:], yv[:, 1:]
        if combo["cast"]:
            z = z.float()
        loss = _loss(combo["loss"], z, t, tv)
        if combo["z_loss"]:
            loss = loss + 1e-2 * torch.logsumexp(z, -1).pow(2).mean()
        return loss
    return fn


@pytest.mark.parametrize("combo", COMBOS[:6], ids=lambda c: "-".join(str(v) for v in c.values()))
def test_combinations_dynamic_true(combo):
    """dynamic=True: every size symbolic, the weight's D and V included; two batch sizes."""
    fn = _combination(combo)
    frames = []
    for enable in (True, False):
        torch._dynamo.reset()
        counters.clear()
        backend = Counting(Recorder(**{"xent.enable": enable}))
        compiled = torch.compile(fn, backend=backend, dynamic=True)
        for batch in (2, 3):
            ins = make_inputs(batch=batch, seed=batch)
            torch.testing.assert_close(compiled(**ins), fn(**ins), rtol=1e-5, atol=1e-5)
        frames.append(backend.frames)
        if enable:
            assert counters["inductor_xent"]["sites_fused"] == frames[0] and fused_ops(backend.backend.after[0]) == 1
    assert frames[0] == frames[1]


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_combinations(combo):
    fn = _combination(combo)
    rec = Recorder()
    assert_parity(fn, make_inputs(), rec, what=str(combo))
    assert fused_ops(rec.after[0]) == 1
    assert _sources(rec.after[0]) == []
    assert counters["inductor_xent"]["sites_fused"] == 1 and counters["inductor_xent"]["sites_declined"] == 0


def test_call_module_linear_declines_with_reason():
    """torch 2.11 with inline_inbuilt_nn_modules=False shows nn.Linear as call_module: declined
    with what to change (simulated with symbolic_trace plus fake example values)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(D, V)

        def forward(self, x, y):
            return F.cross_entropy(self.lm_head(x).float().view(-1, V), y.view(-1))

    gm = torch.fx.symbolic_trace(M())
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    ins = make_inputs()
    FakeTensorProp(gm, mode).propagate(mode.from_tensor(ins["x"]), mode.from_tensor(ins["y"]))
    for node in gm.graph.nodes:
        node.meta["example_value"] = node.meta.get("val")
    before = _targets(gm)
    (site,) = patterns.run(gm)
    assert not site.fused and "inline_inbuilt_nn_modules" in site.reason
    assert _targets(gm) == before
