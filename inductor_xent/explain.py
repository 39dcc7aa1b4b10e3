"""``inductor_xent.explain(fn, *args, **kwargs)``: which lm_head -> cross-entropy sites (and
log-probs, entropy, argmax heads) the backend would fuse in ``fn``, which it declines and why; each
site's ``head`` names what it computes (``cross_entropy``, ``log_probs``, ``entropy``, ``argmax``,
or several joined by ``+`` when they share one op call).

It compiles ``fn`` with a recording backend (Dynamo's graphs go through our pass, then run eagerly),
calls it once with the given arguments and returns a ``Report``. Like ``torch._dynamo.explain`` it
resets Dynamo before and after, so ``fn`` is traced from scratch; like the backend it applies the
Dynamo tuning (``dynamo_tuning.tune_dynamo``) and traces inside ``dynamo_tuning.DynamoScope``, so
that it traces as ``backend="inductor_xent"`` would.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from . import dynamo_tuning, escape, patterns
from .patterns import ESCAPE_HINT, SiteReport

# what to change, for the graph breaks that keep an lm_head and its loss apart (seen in the zoo sweep,
# benchmarks/zoo.py: 7 transformers architectures break on the loss_type warning, which the default
# Dynamo tuning skips; 9 elsewhere in forward, which the nested graph breaks of dynamo_tuning.DynamoScope fix)
LOSS_TYPE_HINT = (
    "transformers logs a warning_once about loss_type=None inside forward (models whose class name gives "
    "no loss type, e.g. GPT2LMHeadModel) and Dynamo graph-breaks on a logging.Logger call; inductor_xent's "
    "Dynamo tuning, which skips that call, was switched off (INDUCTOR_XENT_DYNAMO_TUNING=0): unset it, or "
    "set model.loss_type = 'ForCausalLM' once before compiling"
)
CAPTURE_HINT = (
    "Dynamo broke the graph at an operator whose output shape depends on the data (a boolean-mask index, "
    "as TRL's GKD loss masks its jsd): a divergence or logits before it leave the graph whole; "
)
CAPTURE_OFF = (
    "INDUCTOR_XENT_CAPTURE_DYNAMIC_OUTPUT_SHAPES=0 is set: unset it to keep such an index in the graph, where "
    "the pass reads x[mask].sum() as a masked sum"
)
CAPTURE_RETRIED = (
    "the frame was traced again without keeping it in the graph: Dynamo could not trace it so, as where code "
    "branches on the truth of such a size (if z.shape[0]: after z = x[mask]; compare the size instead, if "
    "z.shape[0] > 0:), or its graph failed to compile so (TORCH_LOGS=inductor_xent names the error)"
)
CAPTURE_DROPPED = (
    " (seen with Dynamo's capture_dynamic_output_shape_ops, which keeps a boolean index in the graph; as no "
    "site used it, the frame was traced again without it)"
)
NESTED_HINT = (
    "Dynamo graph-breaks inside the model's forward ({}), so the forward's last graph ends at its return "
    "and hands the whole output, logits included, to the caller: remove that break{}"
)
NESTED_OFF = (
    ", or set INDUCTOR_XENT_NESTED_GRAPH_BREAKS=1 (the default on torch 2.13+; off on 2.11 and 2.12, whose "
    "Dynamo may resume a nested frame with its caller's globals) so that the backend traces with "
    "torch._dynamo.config.nested_graph_breaks = True; Dynamo then keeps tracing the caller, and a function "
    "that returns only the loss fuses"
)
NESTED_ON = (
    " (Dynamo traced with nested_graph_breaks = True and still ended the caller's graph there: a break "
    "it cannot continue across)"
)


@dataclass
class Report:
    sites: list[SiteReport] = field(default_factory=list)
    graph_count: int = 0
    graph_break_count: int = 0
    graph_break_reasons: list[str] = field(default_factory=list)  # the first line of each distinct one
    capture_retried: bool = False  # a frame was traced again without capture_dynamic_output_shape_ops

    @property
    def fused_count(self) -> int:
        return sum(s.fused for s in self.sites)

    @property
    def declined_count(self) -> int:
        return sum(not s.fused for s in self.sites)

    @property
    def logits_escape(self) -> bool:
        """True when some site's logits are an output of the compiled region."""
        return any(s.logits_escape for s in self.sites)

    @property
    def bytes_avoided(self) -> int:
        return sum(s.bytes_avoided for s in self.sites)

    def __str__(self) -> str:
        head = (f"inductor_xent.explain: {len(self.sites)} site(s), {self.fused_count} fused, "
                f"{self.declined_count} declined; {self.graph_count} graph(s), "
                f"{self.graph_break_count} graph break(s)")
        lines = [head]
        if self.sites:
            cols = ("pattern", "fused", "head", "rows x vocab x dim", "dtype", "logits MiB", "avoided MiB",
                    "strategy", "reason")
            rows = [cols]
            for s in self.sites:
                rows.append((
                    s.pattern, "yes" if s.fused else "no", s.head, f"{s.rows} x {s.vocab} x {s.hidden_dim}",
                    s.dtype or "?", _mib(s.logits_bytes), _mib(s.bytes_avoided), _strategy_word(s), s.reason,
                ))
            widths = [max(len(r[i]) for r in rows) for i in range(len(cols) - 1)]
            for r in rows:
                lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
        else:
            lines.append("  no lm_head matmul -> cross-entropy site found")
        if self.graph_break_count and not self.sites and any(
                "Dynamic shape operator" in r for r in self.graph_break_reasons):
            from . import config

            if self.capture_retried or not config.capture_dynamic_output_shapes():
                lines.append("note: " + CAPTURE_HINT + (CAPTURE_RETRIED if self.capture_retried else CAPTURE_OFF) + ".")
        if self.logits_escape:
            lines.append("note: " + ESCAPE_HINT + ".")
        return "\n".join(lines)


def _strategy_word(site) -> str:
    """'store ~N MiB' / 'recompute' in the table; the reason column has the whole description."""
    if not site.fused:
        return "-"
    if site.strategy == "store":  # (a size where the site knows it: not a distillation's chunks)
        return "store" if site.extra_bytes is None else f"store ~{_mib(site.extra_bytes)} MiB"
    return "recompute"


def _mib(n) -> str:
    return "?" if n is None else f"{n / 2**20:.2f}"


def explain(fn, *args, **kwargs) -> Report:
    """Trace ``fn(*args, **kwargs)`` with Dynamo, run our pass on every graph, report every site."""
    import torch

    fn = getattr(fn, "_orig_mod", fn)  # a torch.compile'd module: explain the module itself
    fn = getattr(fn, "_torchdynamo_orig_callable", fn)  # a torch.compile'd function
    report = Report()
    uncaptured: list = []  # declined sites of graphs traced again without the capture

    def recording_backend(gm, example_inputs):
        sites = []
        try:
            with dynamo_tuning.captured_pass(gm):  # as the backend: a graph the capture did not help is traced again
                sites = patterns.run(gm, can_return=True)
        except dynamo_tuning.CaptureUnused:
            # a site the capture let the pass see declined (a masked sum it cannot fuse): say why, once
            uncaptured.extend(dataclasses.replace(s, reason=s.reason + CAPTURE_DROPPED) for s in sites if not s.fused)
            raise
        report.graph_count += 1
        report.sites.extend(sites)
        return escape.wrap(gm, gm.forward)

    from torch._dynamo.utils import counters

    dynamo_tuning.tune_dynamo()
    torch._dynamo.reset()
    before = dict(counters["graph_break"])
    retried = counters["inductor_xent"][dynamo_tuning.RETRIED]
    try:
        with torch._dynamo.config.patch(suppress_errors=False), dynamo_tuning.DynamoScope():  # as the backend traces
            torch.compile(fn, backend=recording_backend)(*args, **kwargs)
        new = {k: v - before.get(k, 0) for k, v in counters["graph_break"].items() if v > before.get(k, 0)}
        report.graph_break_count = sum(new.values())
        report.graph_break_reasons = [_first_line(k) for k in new]
        report.capture_retried = counters["inductor_xent"][dynamo_tuning.RETRIED] > retried
        report.sites = [dataclasses.replace(s, reason=_with_break_hint(s, report, new)) for s in report.sites]
        seen = {(s.pattern, s.head, s.reason) for s in report.sites}
        report.sites += [s for s in uncaptured if (s.pattern, s.head, s.reason[:-len(CAPTURE_DROPPED)]) not in seen]
    finally:
        torch._dynamo.reset()
    return report


def _first_line(text: str) -> str:
    return str(text).strip().splitlines()[0] if str(text).strip() else str(text)


def _with_break_hint(site: SiteReport, report: Report, breaks: dict) -> str:
    """A declined site's reason, plus what to change when a graph break is the cause."""
    if site.fused or not breaks:
        return site.reason
    if site.logits_input:
        if any("loss_type=" in str(k) for k in breaks):
            return f"{site.reason}; {LOSS_TYPE_HINT}"
        return f"{site.reason}; Dynamo broke the graph at: {'; '.join(report.graph_break_reasons)}"
    if site.logits_escape:
        from . import config

        return f"{site.reason}; if the compiled function returns only the loss: " + NESTED_HINT.format(
            "; ".join(report.graph_break_reasons), NESTED_ON if config.nested_graph_breaks() else NESTED_OFF)
    return site.reason
