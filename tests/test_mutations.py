"""Writes between the lm_head matmul and the loss (issue 9).

The rewrite reads the hidden states, weight, bias and targets where the loss is; eager read them at
the matmul. ``torch.mul(h, 3, out=h)`` in between was fused (eager 8.665, compiled 24.242) because
the in-place check went by op names. Every way Python code writes a tensor, or an alias of it, in
that window must decline with a reason naming the op, or (where Dynamo breaks the graph there) leave
nothing fused; writes before the matmul, after the loss, or of unrelated tensors must still fuse.
Each case checks the compiled loss, gradients and inputs (which the writes may change) against eager.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import inductor_xent

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

B, T, D, V = 2, 5, 8, 11  # V prime; B*T = 10 rows


def _model(mutate, where="between", hidden="fresh"):
    """``F.cross_entropy(F.linear(h, W).float().view(-1, V), y.view(-1))`` with ``mutate(h, W, y, u)``
    placed ``before`` the matmul, ``between`` it and the loss, or ``after`` the loss. ``h`` is
    ``x * 1`` (a fresh tensor autograd lets us write) or ``x`` itself (``hidden="input"``)."""

    def fn(x, W, y, u):
        h = x * 1 if hidden == "fresh" else x
        if where == "before":
            mutate(h, W, y, u)
        z = F.linear(h, W)
        if where == "between":
            mutate(h, W, y, u)
        loss = F.cross_entropy(z.float().view(-1, V), y.view(-1))
        if where == "after":
            mutate(h, W, y, u)
        return loss

    return fn


def _matmul_model(mutate):
    """The same with ``h @ W.t()`` (the matmul's weight operand is a view node of W)."""

    def fn(x, W, y, u):
        h = x * 1
        z = h @ W.t()
        mutate(h, W, y, u)
        return F.cross_entropy(z.view(-1, V), y.view(-1))

    return fn


def _module_model(mutate):
    """The same with an ``nn.Linear`` lm_head passed as ``W``: its weight is an ``nn.Parameter``."""

    def fn(x, head, y, u):
        h = x * 1
        z = head(h)
        mutate(h, head.weight, y, u)
        return F.cross_entropy(z.view(-1, V), y.view(-1))

    return fn


def _z_loss_model(mutate):
    """PaLM-style z-loss: the logsumexp comes first, so the fused op sits there (before the write)
    while eager's cross_entropy reads the targets after it."""

    def fn(x, W, y, u):
        z = F.linear(x * 1, W).view(-1, V)
        lse = torch.logsumexp(z, -1)
        mutate(None, W, y, u)
        return F.cross_entropy(z, y.view(-1)) + 1e-2 * lse.pow(2).mean()

    return fn


def _z_loss_late_targets(x, W, y, u):
    """The targets are computed after the logsumexp, so the rewrite hoists them above it; a write
    into them (``out=``) in between would be skipped by the hoisted read."""
    z = F.linear(x * 1, W).view(-1, V)
    lse = torch.logsumexp(z, -1)
    t = torch.empty_like(y)
    torch.add(y, 1, out=t)
    return F.cross_entropy(z, t.view(-1)) + 1e-2 * lse.pow(2).mean()


def _one_hot_model(x, W, y, u):
    """Hand-written cross-entropy: eager reads the targets at one_hot, before the matmul."""
    oh = F.one_hot(y, V)
    z = F.linear(x * 1, W)
    y.add_(1)
    return -(oh * F.log_softmax(z.float(), -1)).sum(-1).mean()


def _view_setitem(h, W, y, u):
    h.view(-1)[0] = 5.0


def _setitem(h, W, y, u):
    h[:, 0] = 0.0


def _iadd(h, W, y, u):
    h += 1


def _data_assign(h, W, y, u):
    h.data = u


def _weight_data_assign(h, W, y, u):
    W.data = W.data * 2


def _no_grad_update(h, W, y, u):
    with torch.no_grad():  # as an optimizer does: allowed on a parameter that requires grad
        W.mul_(2)


def _targets_setitem(h, W, y, u):
    y[0] = -100


def _logits_inplace(x, W, y, u):
    z = F.linear(x * 1, W)
    z.mul_(2)
    return F.cross_entropy(z.view(-1, V), y.view(-1))


_ROWS = (torch.tensor([0, 3]),)  # index_put_ indices: rows 0 and 3 of h.view(-1, D)


def case(fn, grad, expect, words="", inner="aot_eager", ignore=True, alias=False, module=False):
    """One row of ``CASES``.

    grad: the leaf that requires grad ("x": the hidden states' source, "W": the weight) or None
        (the spelling refuses autograd, e.g. ``out=``, or eager's backward would find a saved
        tensor modified): then everything runs under no_grad.
    expect: "declined" (a site, not fused, its reason contains ``words``), "fused", or "break"
        (Dynamo breaks the graph at the write: the loss's graph gets the logits as an input).
    inner: what compiles the graph after the pass (``xent.inner``).
    ignore: whether some targets are ignore_index (-100); off where the write or one_hot needs
        class ids.
    alias: pass ``x.view(-1)`` as ``u`` (an alias of the hidden states as another argument).
    module: pass an ``nn.Linear`` holding the weight as ``W``.
    """
    return dict(fn=fn, grad=grad, expect=expect, words=words, inner=inner, ignore=ignore, alias=alias,
                module=module)


CASES = {
    # the case: a pure-looking name whose out= writes the hidden states
    "mul_out": case(_model(lambda h, W, y, u: torch.mul(h, 3, out=h)), None, "declined",
                "torch.mul(..., out=) writes the hidden states"),
    # out= into a view of the hidden states (an alias, not the node itself)
    "add_out_view": case(_model(lambda h, W, y, u: torch.add(u[0, 0], 1, out=h.view(-1, D)[0])), None, "declined",
                     "torch.add(..., out=) writes the hidden states"),
    # out= of an op with a different name (matmul)
    "matmul_out": case(_model(lambda h, W, y, u: torch.matmul(u, torch.eye(D), out=h)), None, "declined",
                   "torch.matmul(..., out=) writes the hidden states"),
    # Tensor method with a trailing underscore
    "method_inplace": case(_model(lambda h, W, y, u: h.mul_(3)), "x", "declined", "Tensor.mul_ writes the hidden states"),
    # torch function with a trailing underscore (aten schema relu_(Tensor(a!) self))
    "function_inplace": case(_model(lambda h, W, y, u: torch.relu_(h)), "x", "declined",
                         "torch.relu_ writes the hidden states"),
    # F.relu(inplace=True): a Python function whose flag, not its name, says it writes
    "functional_inplace_flag": case(_model(lambda h, W, y, u: F.relu(h, inplace=True)), "x", "declined",
                                "relu(..., inplace=True) writes the hidden states"),
    # the flag given by position: F.dropout(h, p, training, inplace)
    "functional_inplace_positional": case(_model(lambda h, W, y, u: F.dropout(h, 0.5, True, True)), "x", "declined",
                                      "dropout(..., inplace=True) writes the hidden states"),
    # h += 1: operator.iadd
    "iadd": case(_model(_iadd), "x", "declined", "operator.iadd writes the hidden states"),
    # h[:, 0] = 0: operator.setitem
    "setitem": case(_model(_setitem), "x", "declined", "operator.setitem writes the hidden states"),
    # h.view(-1)[0] = 5 after h @ W.t(): setitem on a view node
    "view_setitem": case(_matmul_model(_view_setitem), "x", "declined", "operator.setitem writes the hidden states"),
    # Tensor.index_put_ (indices as a tuple of tensors)
    "index_put_method": case(_model(lambda h, W, y, u: h.view(-1, D).index_put_(_ROWS, torch.tensor(5.0))), "x",
                         "declined", "Tensor.index_put_ writes the hidden states"),
    # torch.index_put_, the function spelling
    "index_put_function": case(_model(lambda h, W, y, u: torch.index_put_(h, (torch.tensor([1]),), torch.tensor(5.0))),
                           "x", "declined", "torch.index_put_ writes the hidden states"),
    # copy_ from another tensor (broadcast)
    "copy_": case(_model(lambda h, W, y, u: h.copy_(u)), "x", "declined", "Tensor.copy_ writes the hidden states"),
    # set_: h now points at another tensor's storage
    "set_": case(_model(lambda h, W, y, u: h.set_(u)), None, "declined", "Tensor.set_ writes the hidden states"),
    # resize_: Dynamo does not trace it (graph break)
    "resize_": case(_model(lambda h, W, y, u: h.resize_(B * T * D)), None, "break", ""),
    # h.data = u: Dynamo breaks the graph for a tensor created inside the region, and the graph
    # after the break has a set_ on an input, which aot_eager_decomp_partition cannot compile
    # (torch's limitation, with or without the pass): compiled with Inductor
    "data_assign": case(_model(_data_assign), None, "break", inner="inductor"),
    # h.data.mul_(3): _get_data_attr (an alias) written in place
    "data_inplace": case(_model(lambda h, W, y, u: h.data.mul_(3)), "x", "declined",
                     "Tensor.mul_ writes the hidden states"),
    # h.detach().mul_(3): another alias
    "detach_inplace": case(_model(lambda h, W, y, u: h.detach().mul_(3)), "x", "declined",
                       "Tensor.mul_ writes the hidden states"),
    # a list argument: aten::_foreach_mul_(Tensor(a!)[] self, ...)
    "foreach": case(_model(lambda h, W, y, u: torch._foreach_mul_([u, h], 3)), None, "declined",
                "torch._foreach_mul_ writes the hidden states"),
    # an OpOverload: decided from its _schema
    "aten_overload": case(_model(lambda h, W, y, u: torch.ops.aten.mul_.Tensor(h, torch.tensor(3.0))), "x", "declined",
                      "aten.mul_.Tensor writes the hidden states"),
    # a metadata-only write: the shape the op reads changes
    "unsqueeze_": case(_model(lambda h, W, y, u: h.unsqueeze_(0)), None, "declined",
                   "Tensor.unsqueeze_ writes the hidden states"),
    # an alias of the hidden states passed as another argument (u is x.view(-1)); Dynamo's fake
    # inputs share storage as the real ones do
    "alias_argument": case(_model(lambda h, W, y, u: u.mul_(3), hidden="input"), None, "declined",
                           "Tensor.mul_ writes the hidden states", alias=True),
    # the weight parameter written in place (eager autograd refuses a leaf that requires grad)
    "weight_inplace": case(_model(lambda h, W, y, u: W.mul_(2)), None, "declined", "Tensor.mul_ writes the weight"),
    # an optimizer-like foreach update of the weight
    "weight_foreach": case(_model(lambda h, W, y, u: torch._foreach_add_([W], [W])), None, "declined",
                       "torch._foreach_add_ writes the weight"),
    # an nn.Linear's weight parameter updated under no_grad between (the write comes first, so
    # the reason names it rather than the grad-mode change)
    "parameter_no_grad_update": case(_module_model(_no_grad_update), "W", "declined",
                                     "Tensor.mul_ writes the weight", module=True),
    # W.data.mul_(2): allowed on a parameter that requires grad
    "weight_data_inplace": case(_model(lambda h, W, y, u: W.data.mul_(2)), "W", "declined",
                            "Tensor.mul_ writes the weight"),
    # W.data = ...: Dynamo traces it as Tensor.set_ on the parameter (Inductor: as data_assign)
    "weight_data_assign": case(_model(_weight_data_assign), None, "declined", "Tensor.set_ writes the weight",
                               inner="inductor"),
    # the targets written between the matmul and the loss: eager's loss reads them after the write, and
    # so does the op (placed at the loss): fused (ProphetNet builds its targets this way)
    "targets_inplace": case(_model(lambda h, W, y, u: y.add_(1)), "x", "fused", ignore=False),
    # y[0] = -100
    "targets_setitem": case(_model(_targets_setitem), "x", "fused"),
    # the targets written between the z-loss logsumexp (where the op goes) and the loss
    "targets_after_lse": case(_z_loss_model(lambda h, W, y, u: y.add_(1)), None, "declined",
                              "Tensor.add_ writes the targets", ignore=False),
    # targets computed after the logsumexp and filled through out=: the hoisted read would miss it
    "targets_out_after_lse": case(_z_loss_late_targets, None, "declined", "torch.add(..., out=) writes the targets",
                                  ignore=False),
    # one_hot(y) read before the matmul, y written after it (no grad: aot_eager_decomp_partition's
    # partitioner recomputes one_hot(y) in backward after the write, with or without the pass)
    "targets_one_hot": case(_one_hot_model, None, "declined", "Tensor.add_ writes the targets", ignore=False),
    # the logits themselves written (a logits user, but the reason names the write)
    "logits_inplace": case(_logits_inplace, "x", "declined", "Tensor.mul_ writes the logits"),
    # negative controls: the same writes where they change nothing the rewrite moves.
    # the hidden states written before the matmul reads them
    "before_matmul_inplace": case(_model(lambda h, W, y, u: h.mul_(3), where="before"), "x", "fused"),
    # the out= write, before the matmul
    "before_matmul_out": case(_model(lambda h, W, y, u: torch.mul(h, 3, out=h), where="before"), None, "fused"),
    # the weight written before the matmul
    "before_matmul_weight": case(_model(lambda h, W, y, u: W.mul_(2), where="before"), None, "fused"),
    # the hidden states written after the loss (no grad: nothing is saved for a backward)
    "after_loss_inplace": case(_model(lambda h, W, y, u: h.mul_(3), where="after"), None, "fused"),
    # the weight written after the loss (an optimizer-like update)
    "after_loss_weight": case(_model(lambda h, W, y, u: W.mul_(2), where="after"), None, "fused"),
    # the targets written after the loss
    "after_loss_targets": case(_model(lambda h, W, y, u: y.add_(1), where="after"), None, "fused", ignore=False),
    # ... but in grad mode the fused op saves the hidden states for the weight's gradient, which
    # eager's linear does not when the weight needs none: declined, or backward would fail
    "after_loss_saved": case(_model(lambda h, W, y, u: h.mul_(3), where="after"), "x", "declined",
                             "Tensor.mul_ writes the hidden states after the loss"),
    # an unrelated tensor written in place in between
    "unrelated_inplace": case(_model(lambda h, W, y, u: u.mul_(3)), "x", "fused"),
    # out= into an unrelated tensor, reading the hidden states (a read is not a write)
    "unrelated_out_reads_hidden": case(_model(lambda h, W, y, u: torch.mul(h, 3, out=u)), None, "fused"),
    # pure ops on the hidden states in between (mul, view, float; used, so Dynamo keeps them)
    "pure_between": case(_model(lambda h, W, y, u: u.add_(torch.mul(h, 3).view(B, T, D).float())), "x", "fused"),
}


def _inputs(row):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, D, generator=g)
    W = torch.randn(V, D, generator=g) * 0.5
    y = torch.randint(0, V - 1, (B, T), generator=g)  # y + 1 is still a class id
    if row["ignore"]:
        y[1, ::2] = -100
    u = torch.randn(B, T, D, generator=g)
    if row["alias"]:
        u = x.view(-1)
    if row["module"]:
        head = torch.nn.Linear(D, V, bias=False)
        head.weight.data.copy_(W)
        W = head
    return x, W, y, u


def _leaves(x, W):
    return {"x": x, "W": W.weight if isinstance(W, torch.nn.Module) else W}


def _call(row, compiled):
    x, W, y, u = _inputs(row)
    grad = row["grad"]
    for k, t in _leaves(x, W).items():
        t.requires_grad_(k == grad)
    fn = row["fn"]
    if compiled:
        fn = torch.compile(fn, backend="inductor_xent", options={"xent.inner": row["inner"]})
    with torch.set_grad_enabled(grad is not None):
        loss = fn(x, W, y, u)
    grads = {}
    if grad is not None:
        (grads[grad],) = torch.autograd.grad(loss, _leaves(x, W)[grad])
    return loss.detach(), grads, [t.detach() for t in (x, _leaves(x, W)["W"], y, u)]


@pytest.mark.slow(s=82)
@pytest.mark.parametrize("name", list(CASES))
def test_write_declines_or_fuses_exactly(name):
    row = CASES[name]
    want = _call(row, compiled=False)
    got = _call(row, compiled=True)
    torch.testing.assert_close(got[0], want[0], msg=f"{name}: loss")
    assert got[1].keys() == want[1].keys()
    for k in want[1]:
        torch.testing.assert_close(got[1][k], want[1][k], msg=f"{name}: grad {k}")
    for i, (a, b) in enumerate(zip(got[2], want[2])):  # writes to the inputs happened as in eager
        torch.testing.assert_close(a, b, msg=f"{name}: input {'xWyu'[i]} after the call")
    assert counters["inductor_xent"]["sites_fused"] == (row["expect"] == "fused")

    x, W, y, u = _inputs(row)
    for k, t in _leaves(x, W).items():
        t.requires_grad_(k == row["grad"])
    with torch.set_grad_enabled(row["grad"] is not None):
        report = inductor_xent.explain(row["fn"], x, W, y, u)
    if row["expect"] == "fused":
        assert [s.fused for s in report.sites] == [True], str(report)
    elif row["expect"] == "declined":
        assert [s.fused for s in report.sites] == [False], str(report)
        assert row["words"] in report.sites[0].reason, str(report)
    else:  # the graph breaks at the write: the loss's graph gets the logits as an input
        assert report.graph_break_count >= 1 and report.fused_count == 0, str(report)
        assert all("graph break" in s.reason for s in report.sites), str(report)


def test_allow_escaping_logits_does_not_fuse_a_write():
    """With ``allow_escaping_logits`` the logits may have other users; a user that writes them is
    not one of those: fusing would compute the loss of the logits before the write."""

    def fn(x, W, y):
        z = F.linear(x, W)
        z.mul_(2)
        return F.cross_entropy(z.view(-1, V), y.view(-1))

    x, W, y, _ = _inputs(CASES["mul_out"])
    want = fn(x, W, y)
    options = {"xent.inner": "aot_eager", "xent.allow_escaping_logits": True}
    got = torch.compile(fn, backend="inductor_xent", options=options)(x, W, y)
    torch.testing.assert_close(got, want)
    assert counters["inductor_xent"]["sites_fused"] == 0
    assert counters["inductor_xent"]["sites_declined"] == 1


def _graph(fn, *args):
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        torch.compile(fn, backend=record, fullgraph=True)(*args)
    return graphs[0]


def test_schema_decides_what_a_node_writes():
    """``_mutation.writes`` on a Dynamo graph: pure ops write nothing, whatever their aten overload
    set holds (``aten::sort`` has a TorchScript ``sort.Tensor(Tensor(a!)[] self)``, ``aten::mul``
    ``mul.out``); writes are found by schema, flag or operator, and name the written argument."""
    from inductor_xent.patterns import _mutation

    def fn(h, u):
        a = torch.sort(h, -1).values + torch.mul(h, 3) + F.relu(h) + F.dropout(h, 0.5, False)
        b = h.view(-1).float().sum() + torch.add(h, 1, alpha=2).max(-1).values.sum() + h.detach().sum()
        torch.mul(h, 3, out=u)  # writes u only
        u.view(-1)[0] = 1.0  # writes the view node
        F.relu(u, inplace=True)
        torch._foreach_add_([u, h], 1.0)
        return a.sum() + b

    gm = _graph(fn, torch.randn(3, 4), torch.randn(3, 4))
    found = {n.name: [w.name for w in _mutation.writes(n)] for n in gm.graph.nodes}
    written = {_mutation.spelling(n): found[n.name] for n in gm.graph.nodes if found[n.name]}
    assert written == {
        "torch.mul(..., out=)": ["l_u_"],
        "operator.setitem": ["view_1"],
        "torch.nn.functional.relu(..., inplace=True)": ["l_u_"],
        "torch._foreach_add_": ["l_u_", "l_h_"],
    }, written
