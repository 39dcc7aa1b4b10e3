"""``inductor_xent.explain(fn, *args, **kwargs)``: which lm_head -> cross-entropy sites the backend
would fuse in ``fn``, which it declines and why.

It compiles ``fn`` with a recording backend (Dynamo's graphs go through our pass, then run eagerly),
calls it once with the given arguments and returns a ``Report``. Like ``torch._dynamo.explain`` it
resets Dynamo before and after, so ``fn`` is traced from scratch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import patterns
from .patterns import ESCAPE_HINT, Site


@dataclass
class Report:
    sites: list[Site] = field(default_factory=list)
    graph_count: int = 0
    graph_break_count: int = 0

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
            cols = ("pattern", "fused", "rows x vocab x dim", "dtype", "logits MiB", "avoided MiB", "strategy",
                    "reason")
            rows = [cols]
            for s in self.sites:
                rows.append((
                    s.pattern, "yes" if s.fused else "no", f"{s.rows} x {s.vocab} x {s.hidden_dim}",
                    s.dtype or "?", _mib(s.logits_bytes), _mib(s.bytes_avoided), _strategy_word(s), s.reason,
                ))
            widths = [max(len(r[i]) for r in rows) for i in range(len(cols) - 1)]
            for r in rows:
                lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
        else:
            lines.append("  no lm_head matmul -> cross-entropy site found")
        if self.logits_escape:
            lines.append("note: " + ESCAPE_HINT + ".")
        return "\n".join(lines)


def _strategy_word(site) -> str:
    """'store ~N MiB' / 'recompute' in the table; the reason column has the whole description."""
    if not site.fused:
        return "-"
    if site.strategy.startswith("store"):
        return f"store ~{_mib(site.extra_bytes)} MiB"
    return "recompute"


def _mib(n) -> str:
    return "?" if n is None else f"{n / 2**20:.2f}"


def explain(fn, *args, **kwargs) -> Report:
    """Trace ``fn(*args, **kwargs)`` with Dynamo, run our pass on every graph, report every site."""
    import torch

    fn = getattr(fn, "_orig_mod", fn)  # a torch.compile'd module: explain the module itself
    fn = getattr(fn, "_torchdynamo_orig_callable", fn)  # a torch.compile'd function
    report = Report()

    def recording_backend(gm, example_inputs):
        report.graph_count += 1
        report.sites.extend(patterns.run(gm))
        return gm.forward

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    breaks = sum(counters["graph_break"].values())
    try:
        with torch._dynamo.config.patch(suppress_errors=False):
            torch.compile(fn, backend=recording_backend)(*args, **kwargs)
        report.graph_break_count = sum(counters["graph_break"].values()) - breaks
    finally:
        torch._dynamo.reset()
    return report
