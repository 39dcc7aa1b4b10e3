"""What the tests share, so that no test module imports another: the tolerance rule, the inputs,
spellings and declines of the pass, a recording backend and compile counter, graph printouts.

Sizes: V = 37 (prime, unaligned), D = 16, batch 2 x 7 tokens; targets mix ignore_index (-100) rows
into every batch, including one all-ignored sequence for the masked spellings.
"""

from __future__ import annotations

import contextlib
import functools
import operator

import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend, normalize_gm
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.accuracy import rel_err  # the zoo sweep's measure too
from inductor_xent import config, dynamo_tuning, ops
from inductor_xent.backend import inductor_xent as xent_backend
from inductor_xent.options import LossOptions, compute_dtype

V, D, B, T = 37, 16, 2, 7
# the ops of an unfused site (F.one_hot is torch._C._nn.one_hot)
SOURCE_TARGETS = {F.cross_entropy, F.nll_loss, torch._C._nn.linear, operator.matmul, torch.matmul, torch.mm,
                  torch.einsum, torch.logsumexp, F.log_softmax, F.one_hot, F.softmax, torch.gather, torch.argmax}
SOURCE_METHODS = {"log_softmax", "gather", "logsumexp", "softmax", "argmax"}


# ---------------------------------------------------------------------------------------------
# the tolerance rule: errors relative to PyTorch's own error against float64
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def fallback_chunks(nbytes: int):
    """``config.fallback_chunk_bytes`` for a forward *and* its backward: the chunked CPU path
    recomputes the logits in the backward, and a different chunking there may round them
    differently from the forward (a gemv against a gemm): an error of ~1e-6 in fp32 gradients that
    is the test's doing (each pass reads the setting when it runs; H200 box, a hypothesis case with
    64-byte forward chunks and an 8 MiB backward: 1.2e-6 against 1.1e-7 with one setting)."""
    old = config.fallback_chunk_bytes
    config.fallback_chunk_bytes = nbytes
    try:
        yield
    finally:
        config.fallback_chunk_bytes = old


def assert_within_torch_error(ours, torch_same_dtype, exact, *, k: float = 4.0, floor: float = 1e-6, what=""):
    """err(ours, exact) <= k * err(torch_same_dtype, exact) + floor.

    ``exact`` is computed in float64; ``torch_same_dtype`` is what plain PyTorch gets in the input
    dtype, so the bound says "no worse than PyTorch itself" (k leaves room for a different but
    equally good rounding order)."""
    e_ours, e_torch = rel_err(ours, exact), rel_err(torch_same_dtype, exact)
    assert e_ours <= k * e_torch + floor, f"{what}: err(ours)={e_ours:.3g} > {k}*err(torch)={e_torch:.3g} + {floor:g}"


def assert_gradient_within_torch_error(ours, torch_same_dtype, exact, hidden, weight, *, floor: float, what=""):
    """``assert_within_torch_error`` for a gradient, except where the exact gradient is 0 (a
    vocabulary of one: p = 1 exactly): eager's formula gives exact zeros there, a path that
    recomputes the logits p = exp(δz) with δz the logits' rounding, so the bound is the logits'
    scale, ‖hidden‖·‖weight‖ times a few ulps of the compute dtype (seen: 1.6e-6 on an H100, 1.07e-6
    in the chunked CPU path, fp32)."""
    if exact.numel() and not exact.any().item() and not torch_same_dtype.any().item():
        eps = torch.finfo(ours.dtype if ours.is_floating_point() else torch.float32).eps
        bound = 64 * eps * (hidden.detach().double().norm() * weight.detach().double().norm()).item()
        assert ours.double().norm().item() <= bound + floor, f"{what}: ‖ours‖={ours.double().norm():.3g} > {bound:.3g}"
        return
    assert_within_torch_error(ours, torch_same_dtype, exact, floor=floor, what=what)


def torch_same_dtype_loss(hidden, weight, target, bias=None, **kw):
    """The eager PyTorch spelling users write: the linear in the input dtype, then .float()."""
    opts = LossOptions(kw.get("ignore_index", -100), kw.get("label_smoothing", 0.0),
                       kw.get("logit_scale", 1.0), kw.get("softcap"), kw.get("z_loss", 0.0))
    z = F.linear(hidden, weight, bias)
    z = z.to(compute_dtype(hidden.dtype)) * opts.logit_scale
    if opts.softcap is not None:
        z = opts.softcap * torch.tanh(z / opts.softcap)
    v = weight.shape[0]
    zf, t = z.reshape(-1, v), target.reshape(-1)
    red = kw.get("reduction", "mean")
    loss = F.cross_entropy(zf, t, ignore_index=opts.ignore_index, reduction="none",
                           label_smoothing=opts.label_smoothing)
    valid = t != opts.ignore_index
    loss = loss + torch.where(valid, opts.z_loss * torch.logsumexp(zf, -1) ** 2, 0.0)
    if red == "none":
        return loss.reshape(target.shape)
    if red == "sum":
        return loss.sum()
    return loss.sum() / valid.sum()


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------
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


def case_inputs(c: dict):
    """(hidden, weight, bias or None, target) of a hypothesis case (``cases()`` of test_fallback.py
    and test_log_probs.py: sizes, dtype, bias, ignored rows, strides, 3-D), floats requiring grad."""
    g = torch.Generator().manual_seed(c["seed"])
    n, d, v, dt = c["n"], c["d"], c["v"], c["dtype"]
    h = torch.randn(n, d, generator=g)
    w = torch.randn(v, d, generator=g) * (3 / d**0.5)  # logits with std ~ 3
    b = torch.randn(v, generator=g) if c["bias"] else None
    y = torch.randint(0, v, (n,), generator=g)
    if c["ignore"] == "some":
        y[::3] = c["ignore_index"]
    elif c["ignore"] == "all":
        y[:] = c["ignore_index"]
    elif c["ignore"] == "block":
        y[: n // 2] = c["ignore_index"]
    if c["non_contiguous"]:  # every other row of a wider buffer, weight as a transposed [D, V] buffer
        h = torch.randn(n, 2, d, generator=g)[:, 0, :].copy_(h)
        w = w.t().contiguous().t()
    if c["three_d"]:
        h, y = h.reshape(2, n // 2, d), y.reshape(2, n // 2)
    h, w = h.to(dt).requires_grad_(), w.to(dt).requires_grad_()
    b = None if b is None else b.to(dt).requires_grad_()
    return h, w, b, y


def leaves(inputs, requires_grad=True):
    out = {}
    for k, v in inputs.items():
        v = v.detach().clone()
        if v.is_floating_point() and requires_grad:
            v.requires_grad_(True)
        out[k] = v
    return out


# ---------------------------------------------------------------------------------------------
# spellings that must fuse: name -> (fn, pattern). Every fn is called with all of make_inputs() as
# keywords and names only the inputs it reads (the graph's inputs); the others go to ``**_``.
# ---------------------------------------------------------------------------------------------
def _hf_loss(logits, labels, n):
    """transformers' ForCausalLMLoss with num_items_in_batch: pad-shifted labels, sum / n."""
    logits = logits.float()
    labels = F.pad(labels, (0, 1), value=-100)
    shift = labels[..., 1:].contiguous()
    loss = F.cross_entropy(logits.view(-1, V), shift.view(-1).to(logits.device), ignore_index=-100,
                           reduction="sum")
    return loss / n


def _linear_view_mean(x, W, y, **_):
    """F.linear without bias, view to rows: nanoGPT / HF."""
    return F.cross_entropy(F.linear(x, W).view(-1, V), y.view(-1))


def _nanogpt_ignore_minus_one(x, W, y, **_):
    """nanoGPT: logits.view(-1, logits.size(-1)), ignore_index=-1."""
    return _nanogpt(x, W, torch.where(y < 0, -1, y))


def _linear_bias_float_sum(x, W, b, y, **_):
    """F.linear with bias, upcast, reduction sum."""
    return F.cross_entropy(F.linear(x, W, b).float().view(-1, V), y.view(-1), reduction="sum")


def _matmul_T_scale(x, W, y, **_):
    """@ with .T and a constant scale (muP-style output multiplier), reshape."""
    return F.cross_entropy(((x @ W.T) * 0.5).reshape(-1, V), y.reshape(-1))


def _mm_t_div_to(x, W, y, **_):
    """torch.mm of flattened hidden with .t(), division by a constant, .to(dtype)."""
    return F.cross_entropy((torch.mm(x.view(-1, D), W.t()) / 3.0).to(torch.float32), y.flatten())


def _weight_dv(x, Wdv, y, **_):
    """Weight stored [D, V]: torch.matmul(x, Wdv)."""
    return F.cross_entropy(torch.matmul(x, Wdv).flatten(0, 1), y.flatten())


def _einsum(x, W, y, **_):
    """einsum, weight [V, D]."""
    return F.cross_entropy(torch.einsum("btd,vd->btv", x, W).view(-1, V), y.view(-1))


def _softcap(x, W, y, **_):
    """Gemma 2 final_logit_softcapping: div -> tanh -> mul, then .float()."""
    return F.cross_entropy((torch.tanh(F.linear(x, W) / 2.0) * 2.0).float().view(-1, V), y.view(-1))


def _bias_add(x, W, b, y, **_):
    """A separate bias add after the matmul."""
    return F.cross_entropy((x @ W.t() + b).view(-1, V), y.view(-1))


def _slice_seq(x, W, y, **_):
    """Slicing the logits along the sequence (pushed onto the hidden states)."""
    return F.cross_entropy(F.linear(x, W)[:, :-1, :].contiguous().view(-1, V), y[:, 1:].reshape(-1))


def _transpose(x, W, b, y, **_):
    """Class dim moved to 1."""
    return F.cross_entropy(F.linear(x, W, b).transpose(1, 2), y)


def _none_masked(x, W, y, **_):
    """reduction="none", then the user's own masking and mean."""
    return (F.cross_entropy(F.linear(x, W).view(-1, V), y.view(-1), reduction="none")
            * (y.view(-1) != -100)).sum() / (y != -100).sum()


def _ignore_smoothing(x, W, y, **_):
    """ignore_index and label smoothing."""
    return F.cross_entropy(F.linear(x, W).view(-1, V), torch.where(y < 0, -1, y).view(-1), ignore_index=-1,
                           label_smoothing=0.2)


def _hf_causal_lm(x, W, y, n, **_):
    """transformers ForCausalLMLoss with num_items_in_batch."""
    return _hf_loss(F.linear(x, W), y, n)


def _nll_log_softmax(x, W, y, **_):
    """nll_loss of log_softmax."""
    return F.nll_loss(F.log_softmax(F.linear(x, W).float(), dim=-1).view(-1, V), y.view(-1))


def _nll_transposed(x, W, y, **_):
    """nll_loss with the class dim at 1."""
    return F.nll_loss(torch.log_softmax(F.linear(x, W), -1).transpose(1, 2), y, reduction="sum")


def _logprob_gather(x, W, yv, **_):
    """-log p(target) through gather."""
    return -(F.linear(x, W).log_softmax(-1).gather(-1, yv.unsqueeze(-1)).squeeze(-1)).mean()


def _one_hot(x, W, yv, **_):
    """-(one_hot * log_softmax).sum(-1)."""
    return -(F.one_hot(yv, V).float() * F.log_softmax(x @ W.t(), dim=-1)).sum(-1).mean()


SPELLINGS = {
    "linear_view_mean": (_linear_view_mean, "lm_head_cross_entropy"),
    "nanogpt": (_nanogpt_ignore_minus_one, "lm_head_cross_entropy"),
    "linear_bias_float_sum": (_linear_bias_float_sum, "lm_head_cross_entropy"),
    "matmul_T_scale": (_matmul_T_scale, "lm_head_cross_entropy"),
    "mm_t_div_to": (_mm_t_div_to, "lm_head_cross_entropy"),
    "weight_dv": (_weight_dv, "lm_head_cross_entropy"),
    "einsum": (_einsum, "lm_head_cross_entropy"),
    "softcap": (_softcap, "lm_head_cross_entropy"),
    "bias_add": (_bias_add, "lm_head_cross_entropy"),
    "slice_seq": (_slice_seq, "lm_head_cross_entropy"),
    "transpose": (_transpose, "lm_head_cross_entropy"),
    "none_masked": (_none_masked, "lm_head_cross_entropy"),
    "ignore_smoothing": (_ignore_smoothing, "lm_head_cross_entropy"),
    "hf_causal_lm": (_hf_causal_lm, "lm_head_cross_entropy"),
    "nll_log_softmax": (_nll_log_softmax, "log_softmax_nll"),
    "nll_transposed": (_nll_transposed, "log_softmax_nll"),
    "logprob_gather": (_logprob_gather, "log_softmax_nll"),
    "one_hot": (_one_hot, "one_hot"),
}


def _z_loss(x, W, y, **_):
    """cross-entropy plus a PaLM-style z-loss on a separately computed logsumexp."""
    logits = F.linear(x, W).float()
    ce = F.cross_entropy(logits.view(-1, V), y.view(-1))
    return ce + 1e-2 * torch.logsumexp(logits, dim=-1).pow(2).mean()


def _nanogpt(x, W, targets):
    logits = F.linear(x, W)
    B, T, C = logits.shape
    return F.cross_entropy(logits.view(B * T, logits.size(-1)), targets.view(-1), ignore_index=-1)


def _lse_minus_gather(x, W, yv, **_):
    """logsumexp - gather, torch.gather and [..., 0] spelling, in the matmul dtype."""
    z = x @ W.t()
    return (torch.logsumexp(z, dim=-1) - torch.gather(z, -1, yv[..., None])[..., 0]).mean()


def _lse_gather_shared(x, W, yv, **_):
    """logsumexp and gather of the same logits node, the lse reused for a z-loss."""
    z = F.linear(x, W).float()
    lse = torch.logsumexp(z, -1)
    return (lse - z.gather(-1, yv[..., None]).squeeze(-1)).mean() + 1e-2 * (lse**2).mean()


def _lse_keepdim(x, W, b, yv, **_):
    """keepdim=True logsumexp minus the unsqueezed gather, squeezed at the end; z-loss on the
    matmul-dtype logits before an upcast."""
    z = F.linear(x, W, b)
    lse = torch.logsumexp(z, -1, keepdim=True)
    rows = (lse.float() - z.float().gather(-1, yv.unsqueeze(-1))).squeeze(-1)
    return rows.sum() + 1e-2 * lse.square().sum()


def _tied(x, W, y, yv, **_):
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


def _prophetnet(x, W, y, **_):
    """ProphetNet: the streams' logits [B, ngram, T, V] moved to [ngram, B, T, V] before the loss
    (here B and T play ngram and B); log_softmax with dtype=float32 then nll_loss."""
    z = F.linear(x, W).transpose(0, 1).contiguous()
    lp = F.log_softmax(z.view(-1, z.size(-1)), dim=-1, dtype=torch.float32)
    return F.nll_loss(lp, y.transpose(0, 1).reshape(-1))


def _softcap_functional_tanh(x, W, y, **_):
    """RecurrentGemma: F.tanh (its own callable in the graph, not torch.tanh), cap on the right."""
    return F.cross_entropy((F.tanh(F.linear(x, W) / 2.0) * 2.0).view(-1, V), y.view(-1))


def _softcap_cap_first(x, W, y, **_):
    """The cap first, the division written as a multiplication, the method spelling of tanh."""
    return F.cross_entropy((2.0 * (F.linear(x, W) * 0.5).tanh()).view(-1, V), y.view(-1))


def _vocab_scale(x, W, b, y, **_):
    """Dory: a learned scale per vocabulary entry after the upcast (b stands for it; its gradient is
    checked)."""
    return F.cross_entropy((F.linear(x, W).float() * b).view(-1, V), y.view(-1))


def _scalar_tensor_scale(x, Wdv, b, y, **_):
    """A 0-dim tensor factor on the left, on a [D, V] weight, before a softcap."""
    return F.cross_entropy((torch.tanh((b[0] * (x @ Wdv)) / 3.0) * 3.0).view(-1, V), y.view(-1))


def _permute_leading(x, W, y, **_):
    """A permutation of the leading dims, then the [B, T]-shaped targets permuted alike."""
    return F.cross_entropy(F.linear(x, W).permute(1, 0, 2).reshape(-1, V), y.t().reshape(-1))


def _no_grad_head(x, W, y, **_):
    """The lm_head runs under no_grad, the loss after it: the op runs where the loss is, with gradient
    enabled, so its loss is detached (eager's carries no gradient: the weight gets none)."""
    with torch.no_grad():
        logits = F.linear(x, W)
    return F.cross_entropy(logits.view(-1, V), y.view(-1)) + x.sum() * 0


SPELLINGS.update({
    "softcap_functional_tanh": (_softcap_functional_tanh, "lm_head_cross_entropy"),
    "softcap_cap_first": (_softcap_cap_first, "lm_head_cross_entropy"),
    "vocab_scale": (_vocab_scale, "lm_head_cross_entropy"),
    "scalar_tensor_scale": (_scalar_tensor_scale, "lm_head_cross_entropy"),
    "prophetnet_transpose": (_prophetnet, "log_softmax_nll"),
    "permute_leading": (_permute_leading, "lm_head_cross_entropy"),
    "no_grad_lm_head": (_no_grad_head, "lm_head_cross_entropy"),
})


def _torch_linear_cross_entropy(x, W, b, y, **_):
    """torch 2.13's F.linear_cross_entropy: its reference path inlines to linear + CE."""
    return F.linear_cross_entropy(x.view(-1, D), W, y.view(-1), linear_bias=b, ignore_index=-100)


if hasattr(F, "linear_cross_entropy"):  # torch 2.13+
    SPELLINGS["torch_linear_cross_entropy"] = (_torch_linear_cross_entropy, "lm_head_cross_entropy")


# ---------------------------------------------------------------------------------------------
# declines: name -> (fn, words its reason contains); called as the spellings are
# ---------------------------------------------------------------------------------------------
def _class_weights(x, W, y, **_):
    return F.cross_entropy(F.linear(x, W).view(-1, V), y.view(-1), weight=torch.linspace(0.5, 1.5, V))


def _probability_targets(x, W, Wdv, **_):
    return F.cross_entropy(F.linear(x, W).view(-1, V), F.softmax(F.linear(x, Wdv.t()), -1).detach().view(-1, V))


def _float64_upcast(x, W, y, **_):
    return F.cross_entropy(F.linear(x, W).double().view(-1, V), y.view(-1))


def _unsupported_op_between(x, W, y, **_):
    return F.cross_entropy(torch.relu(F.linear(x, W)).view(-1, V), y.view(-1))


def _mixed_dtype_bias(x, W, b, y, **_):
    return F.cross_entropy((x.bfloat16() @ W.bfloat16().t() + b).view(-1, V), y.view(-1))


def _nll_class_weights(x, W, y, **_):
    return F.nll_loss(F.log_softmax(F.linear(x, W), -1).view(-1, V), y.view(-1), weight=torch.linspace(0.5, 1.5, V))


def _one_hot_keepdim(x, W, yv, **_):
    return -(F.one_hot(yv, V) * F.log_softmax(F.linear(x, W), -1)).sum(-1, keepdim=True).mean()


def _legacy_reduce(x, W, y, **_):
    return F.cross_entropy(F.linear(x, W).view(-1, V), y.view(-1), size_average=True)


def _row_mask_multiply(x, W, y, **_):
    """A factor per row (here a padding mask) is not a per-vocabulary scale: it cannot go into the weight."""
    return F.cross_entropy((F.linear(x, W) * (y != -100).unsqueeze(-1)).view(-1, V), y.view(-1))


def _tensor_scale_after_tanh(x, W, b, y, **_):
    """After the softcap only a Python number can be folded (into the cap)."""
    return F.cross_entropy((torch.tanh(F.linear(x, W) / 2.0) * b).view(-1, V), y.view(-1))


def _one_hot_broadcast(x, W, yv, **_):
    """one_hot(y[T]) * lp[B, T, V] broadcasts every batch row against the same targets."""
    return -(F.one_hot(yv[0], V) * F.log_softmax(F.linear(x, W), -1)).sum(-1).mean()


def _lse_before_permute(x, W, y, **_):
    """A z-loss logsumexp of the logits before a permutation of their rows: the op's lse rows are in
    the permuted order, so the logsumexp keeps the logits (row 0 of it: the order matters)."""
    z = F.linear(x, W)
    ce = F.cross_entropy(z.permute(1, 0, 2).reshape(-1, V), y.t().reshape(-1))
    return ce + 1e-2 * (torch.logsumexp(z, -1)[0] * torch.arange(T)).sum()


def _scale_from_logits(x, W, y, **_):
    """A per-vocabulary factor computed from the logits themselves."""
    z = F.linear(x, W)
    return F.cross_entropy((z * z.detach().mean((0, 1))).view(-1, V), y.view(-1))


def _other_user(x, W, y, **_):
    logits = F.linear(x, W)
    return F.cross_entropy(logits.view(-1, V), y.view(-1)) + 1e-3 * logits.pow(2).mean()


DECLINES = {
    "class_weights": (_class_weights, "class weights"),
    "probability_targets": (_probability_targets, "probability targets"),
    "logits_other_user": (_other_user, "other users"),
    "float64_upcast": (_float64_upcast, "float64 loss"),
    "unsupported_op_between": (_unsupported_op_between, "unsupported op"),
    "mixed_dtype_bias": (_mixed_dtype_bias, "mixed dtypes"),
    "nll_class_weights": (_nll_class_weights, "class weights"),
    "one_hot_keepdim": (_one_hot_keepdim, "without keepdim"),
    "legacy_reduce": (_legacy_reduce, "legacy"),
    "row_mask_multiply": (_row_mask_multiply, "unsupported op"),
    "scale_from_logits": (_scale_from_logits, "computed from the logits"),
    "tensor_scale_after_tanh": (_tensor_scale_after_tanh, "after the softcap"),
    "one_hot_broadcast": (_one_hot_broadcast, "broadcast"),
    "lse_before_permute": (_lse_before_permute, "other users"),
}


# ---------------------------------------------------------------------------------------------
# the recording backend, printouts, parity
# ---------------------------------------------------------------------------------------------
class Recorder:
    """A backend: records each Dynamo graph before and after our pass (its call targets, and its
    printout), then compiles it with the backend (``xent.inner`` aot_eager unless given). Dynamo
    traces for it as for the backend itself (its ``DynamoScope``)."""

    backend_ctx_ctor = dynamo_tuning.DynamoScope  # what the real backend carries (inductor_xent/backend.py)
    _inductor_xent_backend = True

    def __init__(self, **options):
        self.options = {"xent.inner": "aot_eager", **options}
        self.before, self.after, self.graphs = [], [], []  # call targets; the graphs (rewritten in place)
        self.code_before, self.code_after = [], []  # printouts

    def __call__(self, gm, example_inputs):
        self.before.append(targets(gm))
        self.code_before.append(printout(gm))
        self.graphs.append(gm)
        out = xent_backend(gm, example_inputs, options=self.options)
        self.after.append(targets(gm))
        self.code_after.append(printout(gm))
        return out


def counting(backend, **options):
    """``backend`` (with ``options``) behind Dynamo's compile counter: ``.frame_count`` graphs compiled."""
    return CompileCounterWithBackend(functools.partial(backend, options=options) if options else backend)


def targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


def printout(gm) -> str:
    """The graph as code with shapes (torch's ``normalize_gm`` of ``print_readable``, blank lines
    dropped): the same text on torch 2.11 and 2.13."""
    text = normalize_gm(gm.print_readable(print_output=False))
    return "".join(line.rstrip() + "\n" for line in text.splitlines() if line.strip())


def before_after(fn, inputs=None, **options) -> str:
    """The printouts of ``fn``'s one Dynamo graph before and after the pass (``options`` are the
    backend's), called with ``inputs`` (make_inputs() unless given) as keywords: the text the
    ``TestPrintouts`` classes pin with ``assertExpectedInline``."""
    rec = Recorder(**options)
    torch.compile(fn, backend=rec)(**(inputs or make_inputs()))
    assert len(rec.graphs) == 1
    return rec.code_before[0] + "# --- after the pass ---\n" + rec.code_after[0]


def fused_ops(graph_targets) -> int:
    """How many fused ops (either strategy's, or the log-probs op) a recorded graph holds."""
    return sum(t in (ops.FORWARD, ops.STORE, ops.LOGPROB_FORWARD, ops.LOGPROB_STORE) for t in graph_targets)


def sources(graph_targets) -> list:
    """The ops of an unfused lm_head -> cross-entropy among a graph's call targets."""
    return [t for t in graph_targets if t in SOURCE_TARGETS or (isinstance(t, str) and t in SOURCE_METHODS)]


def logits_sized(graphs, rows: int = B * (T - 1)) -> list[str]:
    """The nodes of ``graphs`` (Dynamo's or AOTAutograd's) that hold an [N, V] tensor: one with a
    vocabulary dim and at least ``rows`` rows of it (the fewest any spelling has), other than a
    [V, D] weight or its gradient."""
    found = []
    for g in graphs:
        for node in g.graph.nodes:
            v = node.meta.get("val", node.meta.get("example_value"))
            for t in v if isinstance(v, (list, tuple)) else [v]:
                if isinstance(t, torch.Tensor) and V in t.shape and t.numel() >= rows * V \
                        and sorted(t.shape) != sorted((V, D)):
                    found.append(node.format_node())
    return found


def recorded_pass(fn):
    """``fn`` compiled with our pass then ``aot_eager``, recording AOTAutograd's graphs: (the compiled
    function, the recorder, the list the pass's site reports are appended to)."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    from inductor_xent import patterns

    aot, sites = AotEagerAndRecordGraphs(), []

    def backend(gm, example_inputs):
        sites.extend(patterns.run(gm))
        return aot(gm, example_inputs)

    torch._dynamo.reset()
    return torch.compile(fn, backend=backend), aot, sites


def assert_all_smaller(graphs, numel: int):
    """Every tensor of ``graphs`` (AOTAutograd's, ``meta["val"]``) has fewer than ``numel`` elements:
    with ``numel`` = N·V, no logits are computed or saved there."""
    for graph in graphs:
        for node in graph.graph.nodes:
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                assert val.numel() < numel, f"{node.format_node()} has {tuple(val.shape)}"


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces (eager code: the chunked paths' bound on memory)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


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
# autocast: references and runs (test_autocast.py, test_spellings.py)
# ---------------------------------------------------------------------------------------------
# what autocast rounds before the matmul (a linear's bias too; those spellings pass ``b`` to F.linear)
MATMUL_OPERANDS = ("x", "W", "Wdv")


def autocast_exact(fn, inputs: dict, rounded_to=None, names=MATMUL_OPERANDS):
    """float64 eager without autocast: the loss and its gradients w.r.t. the float inputs. With
    ``rounded_to``, the inputs in ``names`` are first rounded to that dtype (straight through: the
    gradient is the identity), so the reference computes from exactly what autocast hands the matmul."""
    leaf = {k: v.detach().double().requires_grad_() for k, v in inputs.items() if v.is_floating_point()}
    ins = dict(inputs, **leaf)
    if rounded_to is not None:
        ins.update({k: leaf[k] + (inputs[k].to(rounded_to).double() - leaf[k]).detach() for k in names})
    loss = fn(**ins)
    grads = torch.autograd.grad(loss, list(leaf.values()), allow_unused=True)
    return loss.detach(), {k: g for k, g in zip(leaf, grads) if g is not None}


def autocast_representable(inputs: dict, dtype: torch.dtype) -> dict:
    """``inputs`` with every float tensor rounded to ``dtype`` and back to its own dtype: whatever
    autocast casts, it casts without rounding."""
    return {k: v.to(dtype).to(v.dtype) if v.is_floating_point() else v for k, v in inputs.items()}


def autocast_loss_and_grads(fn, ins: dict, *, autocast=None, backend=None):
    """fn's loss and its gradients w.r.t. the float leaves of ``ins`` (the forward under
    ``torch.autocast(<their device>, autocast)`` when given, the backward outside it, as training
    loops run)."""
    leaf = {k: v for k, v in ins.items() if v.is_floating_point() and v.requires_grad}
    f = torch.compile(fn, backend=backend) if backend else fn
    device = next(iter(leaf.values())).device.type
    with torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        loss = f(**ins)
    grads = torch.autograd.grad(loss, list(leaf.values()), allow_unused=True)
    return loss.detach(), {k: g for k, g in zip(leaf, grads) if g is not None}
