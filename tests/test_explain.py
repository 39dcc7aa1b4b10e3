"""inductor_xent.explain: sites found, fused and declined with reasons, sizes, a readable table."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import inductor_xent
from inductor_xent import ops

from .helpers import DECLINES, SPELLINGS, V, make_inputs

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_fused_site_fields():
    fn, pattern = SPELLINGS["linear_bias_float_sum"]
    ins = make_inputs()
    report = inductor_xent.explain(fn, **ins)
    assert report.fused_count == 1 and report.declined_count == 0 and report.graph_count == 1
    (site,) = report.sites
    assert site.pattern == pattern and site.fused
    assert site.reason.startswith("fused: reduction=sum") and "bias" in site.reason
    n = ins["x"].shape[0] * ins["x"].shape[1]
    assert (site.rows, site.vocab, site.hidden_dim, site.dtype) == (str(n), V, ins["x"].shape[-1], "float32")
    assert site.logits_bytes == n * V * 4
    # the fp32 matmul output and its (no-op) .float() are gone: at least one [N, V] fp32 buffer
    assert site.bytes_avoided >= n * V * 4
    assert report.bytes_avoided == site.bytes_avoided


def _ce_plain(h, w, y):
    return F.cross_entropy((h @ w.t()).float(), y)


def _ce_z_loss(h, w, y):
    z = (h @ w.t()).float()
    return F.cross_entropy(z, y) + 1e-4 * (torch.logsumexp(z, -1) ** 2).mean()


def _ce_returned(h, w, y):
    z = (h @ w.t()).float()
    return F.cross_entropy(z, y), z


def _ce_no_ignore(h, w, y):
    return F.cross_entropy((h @ w.t()).float(), y, ignore_index=-1)


@pytest.mark.parametrize("fn, says", [
    (_ce_plain, "ignored rows skipped in forward and backward"),
    (_ce_z_loss, "ignored rows computed in the forward (a logsumexp of the graph reads theirs)"),
    (_ce_returned, "ignored rows computed in the forward (the returned logits need them)"),
    (_ce_no_ignore, "ignored rows skipped in forward and backward"),  # ignore_index=-1 is still one
])
def test_explain_says_what_happens_to_the_ignored_rows(fn, says):
    """(issue 24) A fused cross-entropy's reason says whether its ignore_index rows' logits are
    computed: skipped in both passes, or computed in the forward because a logsumexp of the graph or
    the returned logits read them (the op's skip_ignored, _rewrite.rewrite)."""
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(24, 8, generator=g), torch.randn(37, 8, generator=g).requires_grad_()
    y = torch.randint(0, 37, (24,), generator=g)
    y[:5] = -100 if fn is not _ce_no_ignore else -1
    (site,) = inductor_xent.explain(fn, h, w, y).sites
    assert site.fused and says in site.reason, site.reason
    assert site.reason.count("ignored rows") == 1


def test_explain_unwraps_a_compiled_module():
    """explain(torch.compile(model)) explains the model itself, with our pass."""
    ins = make_inputs()

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(ins["x"].shape[-1], V, bias=False)

        def forward(self, x, y):
            return F.cross_entropy(self.lm_head(x).float().view(-1, V), y.view(-1))

    compiled = torch.compile(Head(), backend="eager")
    report = inductor_xent.explain(compiled, ins["x"], ins["y"])
    assert report.fused_count == 1 and report.sites[0].pattern == "lm_head_cross_entropy"
    fn, _ = SPELLINGS["softcap"]
    report = inductor_xent.explain(torch.compile(fn, backend="eager"), **ins)
    assert report.fused_count == 1 and "softcap=2" in report.sites[0].reason


def test_declined_site_reason_in_table():
    fn, words = DECLINES["class_weights"]
    report = inductor_xent.explain(fn, **make_inputs())
    assert report.fused_count == 0 and report.declined_count == 1
    text = str(report)
    assert "lm_head_cross_entropy" in text and "no" in text and "class weights" in text


def test_table_layout():
    def fn(x, W, y, **_):
        a = F.cross_entropy(F.linear(x, W).view(-1, V), y.view(-1))
        c = F.cross_entropy(F.linear(x, W).view(-1, V), y.view(-1), weight=torch.ones(V))
        return a + c
    report = inductor_xent.explain(fn, **make_inputs())
    lines = str(report).splitlines()
    assert lines[0].startswith("inductor_xent.explain: 2 site(s), 1 fused, 1 declined; 1 graph(s), 0 graph break(s)")
    assert lines[1].split()[:4] == ["pattern", "fused", "head", "rows"]
    assert [line.split()[1:3] for line in lines[2:4]] == [["yes", "cross_entropy"], ["no", "cross_entropy"]]


def test_no_site():
    report = inductor_xent.explain(lambda x: (x * 2).sum(), torch.randn(3))
    assert report.sites == [] and "no lm_head matmul -> cross-entropy site found" in str(report)


def test_escaping_logits_hint():
    """Returned logits that the op cannot write (the loss reads a slice of their rows): declined,
    saying why and what to compile instead. (Returned logits it can write fuse: test_escape.py.)"""
    def fn(x, W, y, **_):
        logits = F.linear(x, W)
        return {"loss": F.cross_entropy(logits[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1)), "logits": logits}
    report = inductor_xent.explain(fn, **make_inputs())
    assert report.logits_escape and report.fused_count == 0
    assert "slice or permutation" in report.sites[0].reason
    assert "compile a function that returns only the loss" in str(report)


def test_dump_graphs_logs_before_and_after(monkeypatch, caplog):
    monkeypatch.setenv("INDUCTOR_XENT_DUMP_GRAPHS", "1")
    fn, _ = SPELLINGS["linear_view_mean"]
    with caplog.at_level(logging.INFO, logger="inductor_xent.patterns"):
        inductor_xent.explain(fn, **make_inputs())
    text = caplog.text
    assert "graph before the pass" in text and "graph after the pass" in text
    assert text.index("torch.nn.functional.cross_entropy") < text.index("graph after the pass")
    assert f"torch.ops.{ops.FORWARD}" in text.split("graph after the pass")[1]


class _BreakingModel(torch.nn.Module):
    """A forward that graph-breaks before its lm_head (an ``.item()``, as in some MoE routers) and
    returns the logits with the loss, like a transformers ``CausalLMOutput``; the loss of the
    shifted logits (``logits[:, :-1]``, older transformers), so that a graph returning the logits
    cannot have the op write them (escape.py) and declines."""

    def __init__(self, d):
        super().__init__()
        self.body = torch.nn.Linear(d, d)
        self.lm_head = torch.nn.Linear(d, V, bias=False)

    def forward(self, x, y):
        h = self.body(x)
        if h.detach().abs().max().item() >= 0:  # graph break
            h = torch.relu(h)
        logits = self.lm_head(h)
        return {"loss": F.cross_entropy(logits[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1)), "logits": logits}


def test_break_inside_forward_escape_names_nested_graph_breaks(untuned_dynamo, monkeypatch):
    """A loss-only function around a forward that graph-breaks fuses, as under the backend (explain
    traces inside dynamo_tuning.DynamoScope: nested graph breaks, restored afterwards). With
    INDUCTOR_XENT_NESTED_GRAPH_BREAKS=0 Dynamo returns the logits from the forward's last graph, and
    explain says which setting keeps them out of it; setting Dynamo's option directly fuses too."""
    ins = make_inputs()
    model = _BreakingModel(ins["x"].shape[-1])

    def loss_only(x, y):
        return model(x, y)["loss"]

    monkeypatch.setenv("INDUCTOR_XENT_NESTED_GRAPH_BREAKS", "1")  # the default on torch 2.13+
    assert inductor_xent.explain(loss_only, ins["x"], ins["y"]).fused_count == 1
    assert untuned_dynamo.nested_graph_breaks is False
    monkeypatch.setenv("INDUCTOR_XENT_NESTED_GRAPH_BREAKS", "0")
    report = inductor_xent.explain(loss_only, ins["x"], ins["y"])
    assert report.fused_count == 0 and report.logits_escape and report.graph_break_count >= 1
    reason = report.sites[0].reason
    assert "nested_graph_breaks = True" in reason and "Tensor.item()" in reason, reason
    assert "set INDUCTOR_XENT_NESTED_GRAPH_BREAKS=1" in reason, reason
    with torch._dynamo.config.patch(nested_graph_breaks=True):
        assert inductor_xent.explain(loss_only, ins["x"], ins["y"]).fused_count == 1
