"""What the pass says about each candidate site: the ``SiteReport`` record ``run`` returns (and
``inductor_xent.explain`` shows), its sizes, and the text of a fused site's reason."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from torch.fx import Node

from .. import strategy
from . import _dtensor, _unloop
from ._fx import hint, tval
from ._logits import LogitsChain
from ._plan import SitePlan
from ._site import NO_IGNORE, Decline, HeadKind
from ._steps import StackedSlice

ESCAPE_HINT = (
    "the logits are also a graph output (the compiled function returns them), so they must be "
    "materialised: compile a function that returns only the loss instead, e.g. "
    "torch.compile(lambda **batch: model(**batch).loss, backend='inductor_xent') or a whole training "
    "step; or pass options={'xent.allow_escaping_logits': True} to fuse the loss anyway"
)


@dataclass(frozen=True)
class SiteReport:
    """One candidate site: what ``explain`` reports and ``run`` returns (``inductor_xent.explain``'s
    ``report.sites``). Built once per site by ``declined`` or ``fused``; nothing parses its text."""

    pattern: str
    fused: bool
    reason: str
    node: str  # the loss node's name in the Dynamo graph
    heads: tuple[HeadKind, ...] = ("cross_entropy",)  # what the site computes, in HEAD_KINDS order
    rows: Optional[str] = None  # N, the number of rows (symbolic when dynamic)
    vocab: Optional[int] = None  # V
    hidden_dim: Optional[int] = None  # D
    dtype: Optional[str] = None  # dtype of the matmul (the logits as eager computes them)
    logits_bytes: Optional[int] = None  # one [N, V] logits tensor in that dtype (at the example sizes)
    bytes_avoided: int = 0  # [N, V]-sized buffers the rewritten forward no longer materialises
    logits_escape: bool = False  # the logits are a graph output
    logits_input: bool = False  # the logits are a graph input (a graph break before the loss)
    logits_returned: bool = False  # the logits are also returned: the op writes them (escape.py)
    strategy: Optional[strategy.Name] = None  # how a fused site computes its gradients
    strategy_reason: str = ""  # why (strategy.GradientPlan.describe())
    extra_bytes: Optional[int] = None  # the store strategy's estimated extra memory (at the example sizes)

    @property
    def head(self) -> str:
        """The heads joined by "+" (the table's column, the log line)."""
        return "+".join(self.heads)


def sizes(chain: Optional[LogitsChain]) -> dict:
    """The sizes a report gives of the logits ``chain`` (none when unknown)."""
    if chain is None:
        return {}
    tz = tval(chain.matmul)
    v, d = chain.vd
    vocab, rows = hint(v), math.prod(tz.shape[:-1])
    n = hint(rows)
    return dict(rows=str(rows), vocab=vocab, hidden_dim=hint(d), dtype=str(tz.dtype).replace("torch.", ""),
                logits_bytes=None if n is None or vocab is None else n * vocab * tz.element_size())


def declined(pattern: str, node: str, heads: tuple, chain: Optional[LogitsChain], why: Decline) -> SiteReport:
    """The report of a site left alone, for ``why``."""
    return SiteReport(pattern, False, why.reason, node, heads, **sizes(chain), logits_escape=why.logits_escape,
                      logits_input=why.logits_input)


def fused(pattern: str, node: str, heads: tuple, plan: SitePlan, how: strategy.GradientPlan,
          bytes_avoided: int) -> SiteReport:
    """The report of a rewritten site, saying what the op took over."""
    loss, chain = plan.first, plan.logits
    ce = next((h for h, _ in plan.heads if h.kind == "cross_entropy"), None)
    main, tops = plan.main_heads, [h for h, _ in plan.heads if h.kind == "topk"]
    parts = (
        len(main) > 1 and f"{len(main)} heads in one op call",
        *(f"top-k op (k={h.k}, of the {h.normalised.replace('_', '-')})" for h in tops),
        *(f"gather op (k={h.k}, of the {h.normalised.replace('_', '-')})" for h, _ in plan.heads
          if h.kind == "gathered"),
        *(f"top-k op (k={h.k}) for the log-probs over the kept set" for h, _ in plan.heads
          if h.kind == "kept" and not h.nucleus),
        *(f"nucleus op (top_p={'per row' if h.top_p_rows is not None else f'{h.top_p:g}'}"
          f"{f', top_k={h.k}' if h.k else ''}) for the log-probs over the kept set"
          for h, _ in plan.heads if h.nucleus),
        plan.log_probs_op and "log-probs op",
        ce is not None and f"reduction={ce.reduction}",
        plan.ignore_index != NO_IGNORE and f"ignore_index={plan.ignore_index}",
        loss.label_smoothing and f"label_smoothing={loss.label_smoothing}",
        chain.bias is not None and "bias",
        chain.logit_scale != 1.0 and f"logit_scale={chain.logit_scale:g}",
        chain.softcap is not None and f"softcap={chain.softcap:g}",
        chain.bias_shift and f"{chain.bias_shift:g} added before the softcap (a constant bias)",
        chain.shift and f"sigmoid softcap: {chain.shift:g} added after it (no softmax sees it)",
        chain.row_scaled and "per-row temperature pushed onto the hidden states",
        any(c.detached for _, c in plan.heads) and "logits.detach() heads without gradient",
        plan.no_grad and "heads inside a grad-mode switch (torch.no_grad()) without gradient",
        chain.weight_scale is not None and "tensor scale folded into the weight",
        chain.sliced and "slice pushed onto the hidden states",
        _stacked(chain) and "one of several stacked heads (torch.stack(heads)[:, k])",
        plan.siblings and "one op per row slice of the logits (the other slices are sites of their own)",
        plan.shared and f"one log-probs op for the rows of {plan.shared} sites of this lm_head weight "
                        "(the weight read once per tile)",
        plan.apart and f"its own op, not one with the other sites of this lm_head weight ({plan.apart})",
        not chain.weight_is_vd and "[D, V] weight",
        unlooped(plan) and f"a Python loop over {unlooped(plan)} folded into one op",
        plan.autocast and f"autocast: operands cast to {str(plan.dtype).replace('torch.', '')}",
        _dtensor.describe(chain),  # vocabulary parallel
        plan.lse_users and f"{len(plan.lse_users)} logsumexp mapped onto the op's lse",
        plan.escapes and "logits still materialised for their other users (allow_escaping_logits)",
        plan.returned and "the returned logits written by the op (no second GEMM; their gradient only if used)",
        _ignored_rows(plan, how),
        "strategy " + how.describe(),
    )
    return SiteReport(pattern, True, "fused: " + ", ".join(p for p in parts if p), node, heads, **sizes(chain),
                      bytes_avoided=bytes_avoided, logits_escape=plan.escapes_to_output,
                      logits_returned=bool(plan.returned), strategy=how.strategy, strategy_reason=how.describe(),
                      extra_bytes=how.extra_bytes if how.strategy == "store" else None)


def _ignored_rows(plan: SitePlan, how: strategy.GradientPlan) -> str:
    """What a cross-entropy op does with the ``ignore_index`` rows (issue 24): no logits for them in
    either pass, or why its forward computes them (the backward skips every row without a gradient).
    A log-probs site's rows that every use's row mask zeroes (_masked.py) are skipped the same way;
    where none is found, why."""
    if plan.row_mask is not None:
        return (f"masked rows skipped in forward and backward (every use of the values passes a row mask: "
                f"{plan.row_mask.describe()}; CUDA: 16-bit inputs; CPU: any dtype)")
    if plan.row_mask_why and plan.ignore_index == NO_IGNORE and any(
            h.kind in ("log_probs", "entropy") for h, _ in plan.heads):
        return f"every row computed ({plan.row_mask_why})"
    if plan.row_mask_why and plan.log_probs_op and not plan.per_row_store and plan.ignore_index != NO_IGNORE:
        return f"ignored rows computed ({plan.row_mask_why})"  # an entropy or argmax read on them
    if plan.ignore_index == NO_IGNORE or (plan.log_probs_op and not plan.per_row_store):
        return ""
    if plan.returned:
        return "ignored rows computed in the forward (the returned logits need them)"
    if (how.strategy != "store" or plan.per_row_store) and plan.lse_users:
        return "ignored rows computed in the forward (a logsumexp of the graph reads theirs)"
    return "ignored rows skipped in forward and backward (CUDA: 16-bit inputs; CPU: any dtype)"


def _stacked(chain: LogitsChain) -> bool:
    return any(isinstance(s, StackedSlice) for s in chain.steps)


def unlooped(plan: SitePlan) -> Optional[str]:
    """What ``_unloop.fold`` folded into the plan's heads (e.g. "row chunks (split) joined by
    torch.cat"), if it did."""
    nodes = [*plan.logits.nodes]
    for h, c in plan.heads:
        nodes += [h.loss, *h.consumed, *h.needs_lse_of, *c.nodes]
    return next((_unloop.describe(n) for n in nodes if isinstance(n, Node) and _unloop.describe(n)), None)
