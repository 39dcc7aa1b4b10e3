"""Python loops over the rows of the logits (patterns/_unloop.py), each copied from the project that
spells it: folded into one op, loss and every gradient within torch's error of eager; a loop over
logits that the pass then declines is left as written."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import inductor_xent

from .helpers import Recorder, V, assert_parity, fused_ops, make_inputs

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _litgpt(x, W, y, **_):
    """LitGPT utils.chunked_cross_entropy (lm_head not chunked): split rows, CE none, cat, sum / n."""
    logits, t = F.linear(x, W).reshape(-1, V), y.reshape(-1)
    losses = [F.cross_entropy(a, b, ignore_index=-100, reduction="none") for a, b in zip(logits.split(3), t.split(3))]
    n = (t != -100).sum()
    return torch.cat(losses).sum() / n.maximum(torch.ones_like(n))


def _trl_rows(x, W, yv, **_):
    """TRL 1.16 trainer/utils.selective_log_softmax, bf16 branch: zip(logits, index), stacked."""
    logits = F.linear(x, W) / 0.7
    index = yv.unsqueeze(-1)
    out = []
    for row_logits, row_labels in zip(logits, index, strict=True):
        out.append(F.log_softmax(row_logits, dim=-1).gather(dim=-1, index=row_labels))
    return torch.stack(out).squeeze(-1).sum()


def _verl_rows(x, W, yv, **_):
    """verl logprobs_from_logits_v2 (TRL <= 0.2x), bf16 branch: gather per row, then squeeze."""
    logits, out = F.linear(x, W), []
    for row_logits, row_labels in zip(logits, yv):
        row = F.log_softmax(row_logits, dim=-1)
        out.append(row.gather(dim=-1, index=row_labels.unsqueeze(-1)).squeeze(-1))
    return (torch.stack(out) * 0.5).sum()


def _trl_entropy(x, W, **_):
    """TRL trainer/utils.entropy_from_logits: entropy of row chunks of the flat logits, cat."""
    logits = F.linear(x, W)
    ents = []
    for chunk in logits.reshape(-1, V).split(4, dim=0):
        logps = F.log_softmax(chunk, dim=-1)
        ents.append(-(torch.exp(logps) * logps).sum(-1))
    return torch.cat(ents, dim=0).reshape(logits.shape[:-1]).mean()


LOOPS = {"litgpt": (_litgpt, "row chunks"), "trl_rows": (_trl_rows, "the rows of the batch"),
         "verl_rows": (_verl_rows, "the rows of the batch"), "trl_entropy": (_trl_entropy, "row chunks")}


@pytest.mark.parametrize("name", sorted(LOOPS))
def test_loop_folds_into_one_op(name):
    fn, words = LOOPS[name]
    ins = make_inputs()
    report = inductor_xent.explain(fn, **ins)
    assert report.fused_count == 1 and len(report.sites) == 1, str(report)
    assert f"a Python loop over {words}" in report.sites[0].reason, report.sites[0].reason
    rec = Recorder()
    assert_parity(fn, ins, rec, what=name)
    assert fused_ops(rec.after[0]) == 1
    assert torch.stack not in rec.after[0] and torch.cat not in rec.after[0]


def _declined_loop(x, W, y, **_):
    """Row chunks whose cross-entropy has class weights (declined): the loop stays as written."""
    logits, t = F.linear(x, W).reshape(-1, V), y.reshape(-1)
    w = torch.ones(V)
    return torch.cat([F.cross_entropy(a, b, weight=w, reduction="none") for a, b in zip(logits.split(3), t.split(3))]
                     ).sum()


def test_loop_over_declined_logits_is_left_as_written():
    ins = make_inputs()
    rec = Recorder()
    torch.compile(_declined_loop, backend=rec)(**ins)
    assert fused_ops(rec.after[0]) == 0
    assert rec.after[0] == rec.before[0], "the chunked loop keeps its bounded memory"
