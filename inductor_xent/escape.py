"""Returned logits at no cost: a compiled function that returns the logits as well as the loss
(``torch.compile(model)`` of an HF model, nanoGPT's ``logits, loss = model(X, Y)``, HF
``Trainer(torch_compile=True)``).

The caller almost always drops the logits, but when it uses them (an auxiliary loss, distillation)
their gradient must be exact. AOTAutograd gives every differentiable output of a compiled graph a
tangent, and for an output nobody used it materialises an all-zero one: a [N, V] buffer written
with zeros and read by the compiled backward, whose graph adds it to the loss's gradient before
both [N, V] GEMMs (``shared/notes/torch-compile-internals.md``). So the returned logits leave
AOTAutograd's graph without a gradient, and get one outside it:

* the fused op writes the raw logits (``hidden @ W.T + b`` in the matmul's dtype) from the tiles
  its forward computes anyway (``write_logits``): no second GEMM, no fp32 copy. The op marks them
  non-differentiable; the graph returns its replay of the user's own ops between the matmul and
  the returned tensor (casts, views, a scale, a softcap) on them;
* the graph also returns the lm_head's operands (hidden states, weight, bias; an operand that is
  a graph input is taken from the call's arguments instead), and ``wrap`` hands each returned
  logits tensor to ``EscapedLogits``, an autograd node outside the compiled graph. Its backward
  runs only when the caller's loss depends on the logits; it then recomputes them from the operands
  (one GEMM) and backpropagates exactly through the same steps. When nobody uses the logits it never
  runs: the compiled backward sees a zero tangent for the hidden states ([N, D], not [N, V]) and
  none for the weight.

``Escape`` is what the pass records per returned tensor (``patterns._rewrite``); ``wrap`` is applied
by whoever compiles the rewritten graph (the backend, ``install()``'s wrapper of ``compile_fx``,
``explain``), which is why the pass only does this when its caller says it will wrap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

META_KEY = "inductor_xent_escapes"  # gm.meta[META_KEY] = (number of the graph's own outputs, [Escape])


@dataclass(frozen=True)
class Escape:
    """One returned logits tensor: where it is among the graph's outputs, where its lm_head's
    operands are (``("arg", i)``: the call's i-th argument; ``("out", j)``: the graph's j-th output,
    past its own), and how the returned tensor follows from the raw logits."""

    output: int
    hidden: tuple[str, int]
    weight: tuple[str, int]
    bias: Optional[tuple[str, int]]
    dtype: torch.dtype  # the matmul's (autocast's) dtype: the operands are cast to it
    weight_is_vd: bool  # the weight is stored [V, D] (else [D, V])
    steps: tuple  # ("cast", dtype) | ("scale", k) | ("tanh", None), from the raw logits on
    # one of several heads stacked (MusicGen's ``torch.stack(heads, 1)``, returned whole): (the stack's
    # dimension, this head's place, the number of heads); each head's tensor gets its own EscapedLogits
    stack: Optional[tuple[int, int, int]] = None


def recompute(spec: Escape, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], shape) -> Tensor:
    """The returned tensor as the model computes it from the operands, shaped ``shape``."""
    w = weight if spec.weight_is_vd else weight.t()
    z = F.linear(hidden.to(spec.dtype), w.to(spec.dtype), None if bias is None else bias.to(spec.dtype))
    for kind, payload in spec.steps:
        if kind == "cast":
            z = z.to(payload)
        elif kind == "scale":
            z = z * payload
        else:
            z = torch.tanh(z)
    return z.reshape(shape)


class EscapedLogits(torch.autograd.Function):
    """Identity on the returned logits' values; its backward is theirs w.r.t. the operands."""

    @staticmethod
    def forward(ctx, values: Tensor, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], spec: Escape):
        ctx.set_materialize_grads(False)  # an unused output: no backward at all
        ctx.save_for_backward(hidden, weight, bias)
        ctx.spec = spec
        return values.view_as(values)

    @staticmethod
    def backward(ctx, grad: Optional[Tensor]):
        if grad is None:
            return None, None, None, None, None
        hidden, weight, bias = ctx.saved_tensors
        spec, needs = ctx.spec, ctx.needs_input_grad[1:4]
        # stacked heads: the other heads' parts of the gradient go on (to their own EscapedLogits, or into
        # the compiled graph for a head it computes)
        passed = grad if ctx.needs_input_grad[0] else None
        if spec.stack is not None:
            dim, k, count = spec.stack
            full = [*hidden.shape[:-1], weight.shape[0] if spec.weight_is_vd else weight.shape[1]]
            full.insert(dim, count)
            grad = grad.reshape(full).select(dim, k)
        leaves = [None if t is None else t.detach().requires_grad_(need) for t, need in zip((hidden, weight, bias),
                                                                                            needs)]
        with torch.enable_grad():
            z = recompute(spec, *leaves, grad.shape)
            wanted = [t for t, need in zip(leaves, needs) if need]
            got = iter(torch.autograd.grad(z, wanted, grad) if wanted else ())
        return (passed, *(next(got) if need else None for need in needs), None)


def wrap(gm: torch.fx.GraphModule, compiled: Any) -> Any:
    """``compiled`` (the callable compiled from ``gm``) returning the graph's own outputs, with each
    returned logits tensor handed to ``EscapedLogits``; ``compiled`` itself when the pass returned no
    logits. Dynamo calls a backend's result with the graph's arguments; a caller that uses the boxed
    convention (one list of arguments, which the callee may clear) is served too, as ``compiled``
    would be (``_boxed_call`` is kept)."""
    own, escapes = gm.meta.get(META_KEY, (None, []))
    if not escapes:
        return compiled
    from_args = sorted({ref[1] for e in escapes for ref in (e.hidden, e.weight, e.bias) if ref and ref[0] == "arg"})

    def run(*args):
        boxed = len(args) == 1 and type(args[0]) is list  # graph arguments are tensors and ints, never lists
        given = args[0] if boxed else args
        kept = {i: given[i] for i in from_args}  # before the call: a boxed callee may clear its arguments
        outs = list(compiled(*args))
        for e in escapes:
            def get(ref):
                return None if ref is None else (kept[ref[1]] if ref[0] == "arg" else outs[ref[1]])

            outs[e.output] = EscapedLogits.apply(outs[e.output], get(e.hidden), get(e.weight), get(e.bias), e)
        return outs[:own]

    if getattr(compiled, "_boxed_call", False):
        run._boxed_call = True
    return run


__all__ = ["Escape", "EscapedLogits", "META_KEY", "recompute", "wrap"]
