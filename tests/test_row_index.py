"""Heads over logits picked by a boolean row mask (``logits[mask]``), which Dynamo keeps in the graph
inside our compiled calls (dynamo_tuning.DynamoScope): the pass moves the mask after the head
(patterns/_row_index.py) where that is exact, and the site fuses with eager's loss and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import inductor_xent

from .helpers import Recorder, V, assert_parity, fused_ops, make_inputs, sources

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _ce(x, W, y, **_):
    """F.cross_entropy over the labelled rows only (BERT-style masked positions)."""
    m = y != -100
    z = F.linear(x, W)
    return F.cross_entropy(z[m], y[m])


def _ce_sum_smoothing(x, W, y, **_):
    m = y >= 0
    z = x @ W.t()
    return F.cross_entropy(z[m], y[m], reduction="sum", label_smoothing=0.1) / m.sum()


def _ce_none(x, W, y, **_):
    m = y != -100
    z = F.linear(x, W).float()
    return F.cross_entropy(z[m], y[m], reduction="none").pow(2).mean()


def _accuracy_beside_loss(x, W, y, **_):
    """An accuracy over the labelled rows beside the loss (the review's case: the index took the loss's
    fusion away)."""
    z = F.linear(x, W)
    m = y != -100
    accuracy = (z[m].argmax(-1) == y[m]).float().mean()
    return F.cross_entropy(z.view(-1, V), y.view(-1)) + accuracy


def _accuracy_keepdim_flat(x, W, y, **_):
    z = F.linear(x, W).view(-1, V)
    m = y.view(-1) != -100
    hits = (z[m].argmax(-1, keepdim=True).squeeze(-1) == y.view(-1)[m]).sum()
    return F.cross_entropy(z, y.view(-1)) * hits


FUSED = {"ce": _ce, "ce_sum_smoothing": _ce_sum_smoothing, "ce_none": _ce_none,
         "accuracy_beside_loss": _accuracy_beside_loss, "accuracy_keepdim_flat": _accuracy_keepdim_flat}


@pytest.mark.parametrize("name", sorted(FUSED))
def test_heads_over_masked_logits_fuse(name):
    rec = Recorder()
    assert_parity(FUSED[name], make_inputs(), rec, what=name)
    assert len(rec.before) == 1, "one graph: the index stays in it"
    assert fused_ops(rec.after[0]) == 1 and sources(rec.after[0]) == [], rec.code_after[0]
    assert counters["inductor_xent"]["sites_fused"] == 1 and counters["inductor_xent"]["sites_declined"] == 0


def _other_mask(x, W, y, **_):
    """Labels picked by another mask (as many rows, others): not a row subset of one cross-entropy."""
    m = y != -100
    return F.cross_entropy(F.linear(x, W)[m], y[m.flip(0)])


def _labels_written(x, W, y, **_):
    """The labels written after their rows were picked: where(mask, labels, ...) would read the new ones."""
    m = y != -100
    z, picked = F.linear(x, W), y[m]
    y.clamp_(max=3)
    return F.cross_entropy(z[m], picked)


def _class_weights(x, W, y, **_):
    m = y != -100
    return F.cross_entropy(F.linear(x, W)[m], y[m], weight=torch.linspace(0.5, 1.5, V))


@pytest.mark.parametrize("fn", [_other_mask, _labels_written, _class_weights], ids=lambda f: f.__name__)
def test_heads_over_masked_logits_left_alone(fn):
    """Where moving the mask would not be exact, nothing moves and the result is eager's."""
    rec = Recorder()
    ins = make_inputs()
    compiled = torch.compile(fn, backend=rec)(**{k: v.clone() for k, v in ins.items()})
    torch.testing.assert_close(compiled, fn(**{k: v.clone() for k, v in ins.items()}))
    assert fused_ops(rec.after[0]) == 0 and counters["inductor_xent"]["sites_fused"] == 0


def test_explain_reports_the_masked_heads_fused():
    ins = make_inputs()
    report = inductor_xent.explain(_accuracy_beside_loss, x=ins["x"], W=ins["W"], y=ins["y"])
    assert report.fused_count == 1 and report.graph_break_count == 0, str(report)
    assert "2 heads in one op call" in report.sites[0].reason, str(report)


def test_a_users_check_of_the_row_count_stays():
    """Only Dynamo's own range checks of the picked row count go with the index: a user's
    ``torch._check`` on it still runs (here it fails: no row is labelled)."""
    def fn(x, W, y, **_):
        m = y != -100
        zm = F.linear(x, W)[m]
        torch._check(zm.shape[0] >= 4, lambda: "too few labelled rows")
        return F.cross_entropy(zm, y[m])

    ins = make_inputs()
    ins["y"][:] = -100
    with pytest.raises(Exception, match="too few labelled rows"):
        torch.compile(fn, backend=Recorder())(**ins)

