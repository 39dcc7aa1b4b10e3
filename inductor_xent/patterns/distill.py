"""Knowledge distillation between two lm_heads: the divergence of one head's distribution from
another's, as users write it, becomes one ``inductor_xent::linear_distill_fwd`` call (distill.py) and
neither ``[N, V]`` logits tensor is computed.

Spellings (``q`` the log-probs of the head whose distribution is fitted, the student's; ``p`` of the
one it is fitted to, the teacher's; each ``log_softmax(z / T, -1)`` or a softmax of it):

* ``F.kl_div(F.log_softmax(s / T, -1), F.softmax(t / T, -1), reduction=...)`` (Hinton KD, TRL, Liger's
  tests; ``log_target=True`` with ``F.log_softmax(t / T, -1)``), ``reduction`` ``batchmean`` (sum over
  ``input.size(0)``), ``sum``, ``mean`` (over every element), or ``none`` followed by ``.sum(-1)`` (per
  row, the user's masking and reduction kept);
* ``(p * (log_p - log_q)).sum(-1)`` with ``p`` the softmax (or ``exp``) of ``log_p``: KL(p ‖ q) per
  row, the reverse KL of TRL's and verl's RL code when the student is ``p``;
* either per-row form times a boolean row mask (cast or not): the mask's False rows become the op's
  ignored ones, so it need not compute them; summed whole, ``(rows * mask).sum()`` (the numerator
  of a masked mean, as GKD masks the prompt), one site with reduction ``sum`` (``_masked_sum``);
* ``F.kl_div(..., reduction="none", log_target=...)`` summed whole (``.sum()``: TRL's
  ``generalized_jsd_loss`` at β = 0 or 1, then divided by the rows) or averaged (``.mean()``: kl_div's
  "mean"), or its rows under a boolean mask summed whole, ``x[mask].sum()`` (TRL 1.16 masks so; in the
  graph under ``capture_dynamic_output_shape_ops``, which our compiled calls set unless
  ``INDUCTOR_XENT_CAPTURE_DYNAMIC_OUTPUT_SHAPES=0``): the masked sum above (``_bool_indexed``);
  ``x[mask].mean()`` (TRL's ``reduction="mean"``) that sum over the kept rows' elements
  (``masked_mean``);
* TRL's generalised JSD through the mixture (``generalized_jsd_loss``, 0 < β < 1)::

      m = torch.logsumexp(torch.stack([lq + torch.log(1 - beta), lp + torch.log(beta)]), dim=0)
      jsd = beta * F.kl_div(m, lp, reduction="none", log_target=True) \
          + (1 - beta) * F.kl_div(m, lq, reduction="none", log_target=True)

  summed whole or per row (``.sum(-1)``), ``beta`` a Python number or ``torch.tensor(number)``:
  ``jsd`` with that β (``distill.py``), each head's weight in the mixture equal to its KL's
  coefficient (else no site).

The student's hard-label cross-entropy added to the divergence (``α * F.cross_entropy(s.view(-1, V),
y.view(-1)) + (1 - α) * kd * T**2``, either order, each side scaled by Python numbers; the
cross-entropy over the student's raw logits, softcapped as the divergence's are, the mean over the
labelled rows, both terms with gradients or neither) joins the same op call
(``hard_weight``): one pass over the student's logits computes both; a masked divergence only where
the mask is the cross-entropy's own ``labels != ignore_index`` (the op masks the divergence by them).

Whichever head is the student, the op computes ``KL(p ‖ q)`` of the two heads' logits with each
head's temperature folded into its scale (``LogitsChain.logit_scale``) and its softcap (Gemma 2's
``final_logit_softcapping``, the model's logits over ``T``) into the op's ``softcap_s`` /
``softcap_t`` (on the raw logits, ``_cap``; a cross-entropy mixed in must read the student's logits
capped the same); a head computed without gradient (``torch.no_grad()``, ``.detach()``: the teacher)
gets its inputs detached, a head with gradient gets them. A number added after the cap (modded-nanogpt's
``a * sigmoid(z / s)``) changes no softmax and is dropped. Other heads of the pass over the student's
logits that the op does not mix in (a summed or smoothed cross-entropy, torchtune's chunked recipe, a
top-k) are ops of their own beside it (``_heads_beside``). Declines: a per-row or per-vocabulary tensor
scale, a number added inside the cap, heads over two vocabularies, logits with other users (than such
heads), a write between the heads and the loss to what the op reads.
"""

from __future__ import annotations

import math
import operator
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from .. import config, distill, dynamo_tuning, ops
from . import _logits, _mutation, _report, _steps, lm_head_cross_entropy
from ._fx import Emitter, arg, hint, is_call, norm_dim, numel_hint, same, size_checks, tval
from ._plan import SitePlan
from ._site import Decline, Head, log_probs_of, probs_of

PATTERN = "distillation"
KL_DIV = (F.kl_div,)
SUM = (torch.sum, "sum")
MEAN = (torch.mean, "mean")
SUB = (operator.sub, torch.sub, "sub")
MUL = (operator.mul, torch.mul, "mul")
DIV = (operator.truediv, torch.div, "div")
ADD = (operator.add, torch.add, "add")
LOG = (torch.log, "log")
LOG1P = (torch.log1p, "log1p")
NEG = (operator.neg, torch.neg, "neg")
NE = (operator.ne, torch.ne, "ne")
STACK = (torch.stack,)
LOGSUMEXP = (torch.logsumexp, "logsumexp")
MASKED_FILL = (torch.masked_fill, "masked_fill")
ISINF = (torch.isinf, "isinf")


def run(gm: GraphModule, log, strategy: Optional[str] = None, store_budget=None) -> list:
    """Rewrite every distillation site of ``gm``; one ``SiteReport`` per site found. Analysis is
    pure: a bug there declines the site (logged); a rewrite is not guarded. ``strategy`` /
    ``store_budget``: the pass's (``recompute``, like a budget of 0, takes the recompute op, which
    keeps per-row statistics only: distill.recomputes; otherwise the budget bounds the kept gradient
    logits: distill.keeps_dz)."""
    which = strategy or config.strategy()
    budget = "0" if which == "recompute" else ("" if store_budget is None else str(store_budget))
    reports = []
    for node in [*gm.graph.find_nodes(op="call_function", target=F.kl_div),
                 *gm.graph.find_nodes(op="call_method", target="sum"),
                 *gm.graph.find_nodes(op="call_function", target=torch.sum),
                 *gm.graph.find_nodes(op="call_method", target="mean"),
                 *gm.graph.find_nodes(op="call_function", target=torch.mean)]:
        if node.graph is not gm.graph or not node.users:
            continue
        try:
            found = _match(node)
            reason = None if found is None or isinstance(found, Decline) else _check(found)
        except Exception as e:  # noqa: BLE001
            log.warning("inductor_xent: internal error analysing %s; site left alone", node.name, exc_info=True)
            found, reason = Decline(PATTERN, node, f"internal error in the pass (please report): {e!r}"), None
        if found is None:
            continue
        if isinstance(found, Decline) or reason:
            why = found if isinstance(found, Decline) else Decline(PATTERN, node, reason)
            chain = None if isinstance(found, Decline) or isinstance(found["q"], Decline) else found["q"]
            reports.append(_report.declined(PATTERN, node.name, ("distillation",), chain, why))
            continue
        reports.append(_rewrite(gm, node, found, budget))
    return reports


def _head(lp: Optional[object]) -> Optional[Union[_logits.LogitsChain, Decline]]:
    if lp is None or lp.dim != tval(lp.logits).dim() - 1 or lp.lse:
        return None
    return _logits.trace(lp.logits)


def _match(node: Node) -> Union[dict, Decline, None]:
    """{"q": chain, "p": chain, "rows": per row, "reduce": how, "nodes": the expression's nodes, "out":
    the node replaced} for a distillation spelling at ``node``, a Decline, or None."""
    if is_call(node, KL_DIV):
        inp, target = arg(node, 0, "input"), arg(node, 1, "target")
        log_target = arg(node, 4, "log_target", False)
        reduction = arg(node, 3, "reduction", "mean")
        if arg(node, 2, "size_average") is not None or node.kwargs.get("reduce") is not None:
            return None
        lq = log_probs_of(inp)
        lp = log_probs_of(target) if log_target else probs_of(target)
        q, p = _head(lq), _head(lp)
        if q is None or p is None:
            return None
        if reduction == "none":
            return None  # elementwise: only the per-row sum below (node.sum(-1)) is a site
        if reduction not in ("batchmean", "sum", "mean"):
            return Decline(PATTERN, node, f"kl_div reduction {reduction!r}")
        return dict(q=q, p=p, reduce=reduction, out=node, inp=inp, nodes=(node, *lq.nodes, *lp.nodes))
    # per row: kl_div(..., reduction="none").sum(-1), or (P * (log_p - log_q)).sum(-1)
    src = arg(node, 0, "input")
    dim = arg(node, 1, "dim")
    if dim is None and len(node.args) <= 1 and not node.kwargs and isinstance(src, Node):  # a whole sum (mean)
        elements, mask, indexing = _bool_indexed(src)
        if is_call(elements, KL_DIV) and arg(elements, 3, "reduction", "mean") == "none":
            found = _match_kl_none(elements)
        else:
            found = _match_mixture_jsd(elements)
        if found is None:
            return None
        # a mean over the elements: of every one (kl_div's "mean"), or of the mask's rows' (TRL's "mean")
        reduce = "sum" if is_call(node, SUM) else "mean" if mask is None else "masked_mean"
        return dict(found, reduce=reduce, out=node, inp=src, nodes=(node, *indexing, *found["nodes"]),
                    **({} if mask is None else {"mask": mask, "indexed": True}))
    if is_call(node, MEAN):
        return None
    if not isinstance(src, Node) or tval(src) is None or norm_dim(dim, tval(src).dim()) != tval(src).dim() - 1 \
            or arg(node, 2, "keepdim", False) or node.kwargs.get("dtype") is not None:
        return None
    if is_call(src, KL_DIV) and arg(src, 3, "reduction", "mean") == "none":
        inner = _match_kl_none(src)
        return None if inner is None else _masked_sum(dict(inner, reduce="none", out=node,
                                                           nodes=(node, *inner["nodes"])))
    if is_call(src, ADD):
        jsd = _match_mixture_jsd(src)
        return None if jsd is None else _masked_sum(dict(jsd, reduce="none", out=node, nodes=(node, *jsd["nodes"])))
    soft = _match_soft_ce(src)
    if soft is not None:
        return Decline(PATTERN, node, soft) if isinstance(soft, str) else _masked_sum(
            dict(soft, reduce="none", out=node, nodes=(node, *soft["nodes"])))
    if is_call(src, MUL) and len(src.args) == 2 and not src.kwargs:
        for prob, diff in (src.args, reversed(src.args)):
            if not (is_call(diff, SUB) and len(diff.args) == 2 and not diff.kwargs):
                continue
            lp, lq = log_probs_of(diff.args[0]), log_probs_of(diff.args[1])
            pr = probs_of(prob)
            if lp is None or lq is None or pr is None or pr.logits is not lp.logits:
                continue
            q, p = _head(lq), _head(lp)
            if q is None or p is None:
                return None
            return _masked_sum(dict(q=q, p=p, reduce="none", out=node,
                                    nodes=(node, src, diff, *lq.nodes, *lp.nodes, *pr.nodes)))
    return None


def _match_soft_ce(src: Node) -> Union[dict, str, None]:
    """torchtune's ``ForwardKLLoss`` per row, ``(softmax(t) * log_softmax(s)).sum(-1)``, the student's
    log-probabilities weighted by the teacher's probabilities (the negated soft cross-entropy: kind
    ``soft_ce``, ``negate``), maybe through torchtune's ``masked_fill(·, isinf(s), 0)``: the product is
    0 where the student's logit is infinite. A biasless matmul's logits are infinite only where its
    inputs are (or overflow), and then eager's row is not finite either; a bias may hold ``-inf`` (a
    masked vocabulary), so with one the spelling declines. Else None."""
    nodes: tuple = ()
    if is_call(src, MASKED_FILL) and len(src.args) == 3 and not src.kwargs and src.args[2] == 0 \
            and is_call(src.args[1], ISINF) and len(src.args[1].args) == 1:
        nodes, inf_of, src = (src, src.args[1]), src.args[1].args[0], src.args[0]
    else:
        inf_of = None
    if not (is_call(src, MUL) and len(src.args) == 2 and not src.kwargs):
        return None
    for prob, logp in (src.args, reversed(src.args)):
        pr, lq = probs_of(prob), log_probs_of(logp)
        if pr is None or lq is None or pr.logits is lq.logits or (inf_of is not None and inf_of is not lq.logits):
            continue
        q, p = _head(lq), _head(pr)
        if q is None or p is None:
            return None
        if inf_of is not None and not isinstance(q, Decline) and q.bias is not None:
            return "an isinf mask over a biased head's logits (a bias may hold -inf)"
        return dict(q=q, p=p, kind="soft_ce", negate=True, nodes=(*nodes, src, *lq.nodes, *pr.nodes))
    return None


# a boolean tensor as a 0/1 number: x.float(), x.to(dtype), x.type_as(y), ...
CASTS = ("float", "half", "bfloat16", "double", "to", "type_as", "type", "int", "long")


def _bool_source(node) -> Optional[Node]:
    """The boolean tensor that ``node`` is, or casts to a number, maybe reshaped (before or after the
    cast: ``mask.int().view(-1)``), else None; its values in ``node``'s row-major order."""
    while isinstance(node, Node) and tval(node) is not None and (tval(node).dtype != torch.bool
                                                                 or is_call(node, _steps.VIEWS)):
        if not node.args or not (is_call(node, _steps.VIEWS) or node.op == "call_method" and node.target in CASTS):
            return None
        node = node.args[0]
    return node if isinstance(node, Node) and tval(node) is not None else None


def _bool_indexed(src: Node) -> tuple[Node, Optional[Node], tuple]:
    """``(x, mask, nodes)`` for ``src = x[mask]`` with ``mask`` a boolean tensor of ``x``'s row shape (TRL's
    ``jsd = jsd[labels != -100]`` before ``jsd.sum()``; Dynamo keeps it in the graph under
    ``capture_dynamic_output_shape_ops``, an ``[u0, V]`` tensor of unbacked size): summed whole, the
    mask's rows' sum. ``nodes`` the indexing and Dynamo's checks of ``u0`` (its ``sym_size``, the
    comparisons and ``_assert_scalar`` of its range), which go with it. Else ``(src, None, ())``."""
    if not (is_call(src, (operator.getitem,)) and len(src.args) == 2 and isinstance(src.args[1], Node)):
        return src, None, ()
    x, mask = src.args
    tx, tm = tval(x), tval(mask)
    if not isinstance(x, Node) or tx is None or tm is None or tm.dtype != torch.bool or tm.dim() != tx.dim() - 1 \
            or tuple(tm.shape) != tuple(tx.shape[:-1]):
        return src, None, ()
    nodes = [src]
    for user in src.users:
        checks = size_checks(user, tm.numel())
        if checks is not None:
            nodes += checks
        elif not (is_call(user, SUM) or is_call(user, MEAN)):
            return src, None, ()  # another reader (the count read elsewhere: not the whole sum alone)
    return x, mask, tuple(nodes)


def _masked_sum(f: dict) -> dict:
    """A per-row site whose rows are only used under a row mask, ``rows * mask`` (``mask`` boolean or
    cast from one; the rows and the mask maybe each reshaped first, torchtune's ``x.view(-1) *
    mask.view(-1)``, as long as the product does not broadcast: reshapes keep the row-major order, so
    the flattened mask pairs with the flattened rows): ``mask`` the rows that count, so the op can skip
    the others (its rows there are 0, as the product's). Summed whole, ``(rows * mask).sum()`` (the
    GKD spelling's numerator; also ``sum(dim=0)`` of a 1-D product), the site becomes that sum
    (reduction ``sum``: the gradients formed in the forward); otherwise (verl's ``masked_mean`` over a
    dim) the per-row site with the mask. Else ``f``."""
    viewed, views = f["out"], []
    while len(viewed.users) == 1 and is_call(next(iter(viewed.users)), _steps.VIEWS):
        viewed = next(iter(viewed.users))
        views.append(viewed)
    mul = next(iter(viewed.users)) if len(viewed.users) == 1 else None
    if mul is None or not is_call(mul, MUL) or len(mul.args) != 2 or mul.kwargs:
        return f
    other = mul.args[1] if mul.args[0] is viewed else mul.args[0]
    mask = _bool_source(other)
    if mask is None or tval(other).shape != tval(viewed).shape:
        return f
    chain = [other]  # the mask as the product reads it, back to the boolean the op reads (its casts, views)
    while chain[-1] is not mask:
        chain.append(chain[-1].args[0])
    total = next(iter(mul.users)) if len(mul.users) == 1 else None
    if total is None or not _whole_sum(total):  # the op goes where the mask exists: before the product
        return dict(f, mask=mask, mask_chain=tuple(chain), anchor=mul)
    return dict(f, reduce="sum", out=total, inp=mul, mask=mask, mask_chain=tuple(chain),
                nodes=(total, mul, *views, *f["nodes"]))


def _whole_sum(node: Node) -> bool:
    """``x.sum()``, or a sum over every dim of ``x`` without keepdim or dtype (``torch.sum(x, dim=0)``
    of a 1-D ``x``)."""
    if not (is_call(node, ("sum",)) or is_call(node, (torch.sum,))) or not node.args:
        return False
    if len(node.args) == 1 and not node.kwargs:
        return True
    x, dim = node.args[0], arg(node, 1, "dim")
    if set(node.kwargs) - {"dim"} or len(node.args) > 2 or tval(x) is None:
        return False
    dims = dim if isinstance(dim, (list, tuple)) else (dim,)
    ndim = tval(x).dim()
    return sorted(norm_dim(d, ndim) for d in dims if norm_dim(d, ndim) is not None) == list(range(ndim)) \
        and len(dims) == ndim
def _match_kl_none(kl: Node) -> Optional[dict]:
    inp, target = arg(kl, 0, "input"), arg(kl, 1, "target")
    lq = log_probs_of(inp)
    lp = log_probs_of(target) if arg(kl, 4, "log_target", False) else probs_of(target)
    q, p = _head(lq), _head(lp)
    if q is None or p is None:
        return None
    return dict(q=q, p=p, nodes=(kl, *lq.nodes, *lp.nodes))


def _number(x) -> Optional[tuple[float, tuple]]:
    """(value, the nodes computing it) of a scalar constant: a Python number, ``torch.tensor(number)``,
    and ``1 - x``, ``x * y``, ``-x``, ``torch.log(x)``, ``torch.log1p(x)`` of such (TRL's ``beta``,
    ``1 - beta``, ``log(beta)``, ``log1p(-beta)``)."""
    if isinstance(x, bool) or not isinstance(x, (int, float, Node)):
        return None
    if not isinstance(x, Node):
        return float(x), ()
    if is_call(x, (torch.tensor,)) and len(x.args) == 1 and set(x.kwargs) <= {"dtype", "device"}:
        v = x.args[0]
        return (float(v), (x,)) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
    if (is_call(x, SUB) or is_call(x, MUL)) and len(x.args) == 2 and not x.kwargs:
        a, b = _number(x.args[0]), _number(x.args[1])
        if a is None or b is None:
            return None
        return (a[0] - b[0] if is_call(x, SUB) else a[0] * b[0]), (x, *a[1], *b[1])
    if is_call(x, LOG) and len(x.args) == 1 and not x.kwargs:
        a = _number(x.args[0])
        return None if a is None or a[0] <= 0 else (math.log(a[0]), (x, *a[1]))
    if is_call(x, LOG1P) and len(x.args) == 1 and not x.kwargs:  # TRL 1.16: torch.log1p(-beta)
        a = _number(x.args[0])
        return None if a is None or a[0] <= -1 else (math.log1p(a[0]), (x, *a[1]))
    if is_call(x, NEG) and len(x.args) == 1 and not x.kwargs:
        a = _number(x.args[0])
        return None if a is None else (-a[0], (x, *a[1]))
    return None


def _match_mixture_jsd(jsd: Node) -> Optional[dict]:
    """TRL's generalised JSD written through the mixture (module docstring): {"q", "p", "kind": "jsd",
    "beta", "nodes"} with ``beta`` the weight of the ``p`` head in the mixture and on its KL (``p`` the
    frozen head where one is: the teacher, as the op names it; else the stack's second item), or None."""
    if not is_call(jsd, ADD) or len(jsd.args) != 2 or jsd.kwargs:
        return None
    coef, kls, nodes = {}, {}, [jsd]
    for term in jsd.args:  # beta * kl_div(m, lp_h, none, log_target=True), either order
        if not (is_call(term, MUL) and len(term.args) == 2 and not term.kwargs):
            return None
        kl = next((a for a in term.args if is_call(a, KL_DIV)), None)
        c = _number(term.args[0] if term.args[1] is kl else term.args[1]) if kl is not None else None
        if c is None or arg(kl, 3, "reduction", "mean") != "none" or not arg(kl, 4, "log_target", False) \
                or arg(kl, 2, "size_average") is not None or kl.kwargs.get("reduce") is not None:
            return None
        target = arg(kl, 1, "target")
        coef[target], kls[target] = c[0], kl
        nodes += [term, kl, *c[1]]
    mixes = {arg(kl, 0, "input") for kl in kls.values()}
    m = next(iter(mixes))
    if len(kls) != 2 or len(mixes) != 1 or not is_call(m, LOGSUMEXP) or arg(m, 1, "dim") not in (0, [0], (0,)) \
            or arg(m, 2, "keepdim", False):
        return None
    stack = arg(m, 0, "input")
    if not is_call(stack, STACK) or arg(stack, 1, "dim", 0) != 0 or len(arg(stack, 0, "tensors")) != 2:
        return None
    heads, weights = [], []
    nodes += [m, stack]
    for item in arg(stack, 0, "tensors"):  # log p_h + log(w_h), either order
        if not (is_call(item, ADD) and len(item.args) == 2 and not item.kwargs):
            return None
        lp = next((a for a in item.args if a in kls), None)
        c = _number(item.args[0] if item.args[1] is lp else item.args[1]) if lp is not None else None
        if c is None:
            return None
        heads.append(lp)
        weights.append(math.exp(c[0]))
        nodes += [item, *c[1]]
    if heads[0] is heads[1] or not all(math.isclose(w, coef[h], rel_tol=1e-6) for h, w in zip(heads, weights)) \
            or not math.isclose(sum(weights), 1.0, rel_tol=1e-6) or not 0.0 < weights[1] < 1.0:
        return None
    lq, lp = (log_probs_of(h) for h in heads)
    q, p = _head(lq), _head(lp)
    if q is None or p is None:
        return None
    beta = weights[1]
    if _frozen(q) > _frozen(p):  # the teacher's role to the frozen head, β its weight
        q, p, lq, lp, beta = p, q, lp, lq, weights[0]
    return dict(q=q, p=p, kind="jsd", beta=beta, nodes=(*nodes, *lq.nodes, *lp.nodes))


def _frozen(c) -> int:
    """How surely a head is the frozen teacher: 2 detached (``.detach()``, ``torch.no_grad()``), 1
    without gradient (its inputs need none), 0 trained."""
    if not isinstance(c, _logits.LogitsChain):
        return 0
    return 2 if c.detached else 0 if tval(c.matmul).requires_grad else 1


def _by_number(node: Node) -> Optional[tuple[Node, float]]:
    """(the tensor, its factor) for ``x * c``, ``c * x`` or ``x / c`` with ``c`` a Python number."""
    if not (is_call(node, MUL) or is_call(node, DIV)) or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    if is_call(node, DIV):
        return (a, 1.0 / b) if isinstance(b, (int, float)) and not isinstance(b, bool) and b != 0 else None
    for x, c in ((a, b), (b, a)):
        if isinstance(x, Node) and isinstance(c, (int, float)) and not isinstance(c, bool):
            return x, float(c)
    return None


def _hard_label_mix(f: dict) -> Union[dict, str, None]:
    """The student's hard-label cross-entropy added to the divergence, ``a · F.cross_entropy(s, y) +
    b · kd`` (either order, each side scaled by Python numbers, ``kd`` the site's reduced value, e.g.
    times ``T**2``), ``s`` the student's raw logits (softcapped as the divergence's are, if they are):
    {"add", "target", "ignore_index", "soft", "hard", "nodes"} for one op computing both, a reason it
    cannot, or None (no such sum)."""
    q, node, nodes, factor = f["q"], f["out"], [], 1.0
    while len(node.users) == 1 and _by_number(next(iter(node.users))) is not None:
        node = next(iter(node.users))
        factor *= _by_number(node)[1]
        nodes.append(node)
    add = next(iter(node.users)) if len(node.users) == 1 else None
    if add is None or not is_call(add, ADD) or len(add.args) != 2 or add.kwargs:
        return None
    other, hard = add.args[1] if add.args[0] is node else add.args[0], 1.0
    while isinstance(other, Node) and len(other.users) == 1 and _by_number(other) is not None:
        nodes.append(other)
        other, c = _by_number(other)
        hard *= c
    if not is_call(other, lm_head_cross_entropy.TARGETS) or len(other.users) != 1:
        return None
    head = lm_head_cross_entropy.match(other)
    c = _logits.trace(head.logits) if isinstance(head, Head) else None
    if not isinstance(c, _logits.LogitsChain) or c.matmul is not q.matmul:
        return None
    if head.reduction != "mean" or head.label_smoothing:
        return ("a hard-label cross-entropy with another reduction than the mean, or label smoothing, added to the "
                "divergence")
    if f["reduce"] == "none":
        return "a hard-label cross-entropy added to a per-row divergence"
    # (a cap c folds to the scale (1/c)·c: 1.0 to rounding only)
    # (a number added after the cap, LogitsChain.shift, changes no softmax: neither term reads it)
    if not math.isclose(c.logit_scale, 1.0, rel_tol=1e-9) or not _same_cap(c.softcap, _cap(q)) or c.bias_shift \
            or c.weight_scale is not None or c.row_scaled or c.bias is not q.bias:
        return ("the hard-label cross-entropy reads other logits than the student's raw (or softcapped) ones: "
                "scaled, capped otherwise, biased")
    # one op gives both terms the student's gradients: not where one of them reads detached logits or runs
    # under no_grad
    if _trains(c, other) != _trains(q, f["out"]):
        return ("the hard-label cross-entropy and the divergence differ in gradient (one reads the student's "
                "logits detached or under torch.no_grad())")
    reorders = any(isinstance(op, (_steps.Slice, _steps.Permute)) for ch in (q, c) for _, op in ch.shape_ops)
    if reorders or not same(tval(c.nodes[-1]).numel(), tval(q.nodes[-1]).numel()):
        return "the hard-label cross-entropy reads other rows of the student's logits than the divergence"
    # a masked divergence (``(rows * mask).sum()``): the op masks it by the cross-entropy's labels, so the
    # mask must be those labels' own (``y != ignore_index``)
    mask = f.get("mask")
    if mask is not None and not _labels_mask(mask, head.target, int(head.ignore_index)):
        return ("a hard-label cross-entropy added to a divergence masked otherwise than by its labels "
                "(the mask is not `labels != ignore_index`)")
    if mask is not None:  # the op masks by the labels as the CE reads them: no write since the mask was taken
        written = _mutation.first_write((mask,), add)
        if written is not None:
            return (f"{_mutation.spelling(written)} writes a tensor between the labels mask and the hard-label "
                    "cross-entropy")
    if f["reduce"] == "masked_mean":
        return "a hard-label cross-entropy added to the mean of a divergence's masked elements"
    inp = tval(f["inp"])
    divisor = {"batchmean": inp.shape[0], "mean": inp.numel(), "sum": 1}[f["reduce"]]
    if not isinstance(divisor, int):
        return "a divergence mixed with a cross-entropy under dynamic shapes (the batchmean divisor is symbolic)"
    return dict(add=add, target=head.target, ignore_index=int(head.ignore_index), soft=factor / divisor, hard=hard,
                masked=mask is not None, nodes=(add, *nodes, other, *head.consumed, *head.aux, *c.nodes))


def _unviewed(node):
    while is_call(node, _steps.VIEWS) and node.args:
        node = node.args[0]
    return node


def _labels_mask(mask: Node, target: Node, ignore_index: int) -> bool:
    """Whether ``mask`` is ``target != ignore_index`` (either tensor reshaped), the rows a cross-entropy
    over ``target`` counts."""
    if not (is_call(mask, NE) and len(mask.args) == 2 and not mask.kwargs):
        return False
    labels, value = mask.args
    if isinstance(labels, (int, float)) and isinstance(value, Node):
        labels, value = value, labels
    return isinstance(value, int) and not isinstance(value, bool) and value == ignore_index \
        and _unviewed(labels) is _unviewed(target)


def _trains(c: _logits.LogitsChain, value: Node) -> bool:
    """Whether a loss term computed as ``value`` from the chain's logits gives them a gradient."""
    return not c.detached and bool(tval(value).requires_grad)


def _cap(c: _logits.LogitsChain) -> Optional[float]:
    """A head's softcap on its raw logits, before its temperature: the chain's logits are
    ``softcap·tanh(z·scale/softcap)`` (``options.fold_temperature``), ``scale·cap·tanh(z/cap)`` with
    ``cap = softcap/scale``."""
    return None if c.softcap is None else c.softcap / c.logit_scale


def _same_cap(a: Optional[float], b: Optional[float]) -> bool:
    return (a is None) == (b is None) and (a is None or math.isclose(a, b, rel_tol=1e-9))


def _check(f: dict) -> Optional[str]:
    """Why the two heads cannot become the op, or None (``f["mix"]`` set where a hard-label
    cross-entropy of the student joins it)."""
    for role, c in (("fitted", f["q"]), ("target", f["p"])):
        if isinstance(c, Decline):
            return c.reason
        if c.bias_shift:  # (a number added after the cap, ``shift``, changes no softmax: the op ignores it)
            return f"the {role} head's logits are shifted by a number inside the cap (not supported in distillation)"
        if c.weight_scale is not None or c.row_scaled:
            return f"the {role} head's logits are scaled by a tensor (not supported in distillation)"
        if c.logit_scale <= 0:
            return f"the {role} head's temperature is not positive"
    q, p = f["q"], f["p"]
    if not same(q.vd[0], p.vd[0]):
        return f"the two heads have different vocabularies ({q.vd[0]} and {p.vd[0]})"
    tq, tp = tval(q.nodes[-1]), tval(p.nodes[-1])
    if tq.shape != tp.shape:
        return f"the two heads' logits have different shapes ({tuple(tq.shape)} and {tuple(tp.shape)})"
    if q.matmul is p.matmul:
        return "both distributions come from one lm_head"
    devices = {tval(n).device for n in (q.hidden, q.weight, p.hidden, p.weight)}
    if len(devices) != 1 or next(iter(devices)).type not in ("cpu", "cuda"):
        return f"unsupported device(s) {sorted(map(str, devices))}"
    mine = set(f["nodes"]) | set(q.nodes) | set(p.nodes)
    others = {u for n in mine if n is not f["out"] for u in n.users if u not in mine}
    last, mix = f.get("anchor", f["out"]), None
    if others:  # the student's hard-label cross-entropy added to the divergence: one op for both
        mix = _hard_label_mix(f)
        if mix is not None and not isinstance(mix, str):
            last = mix["add"]
            mine |= set(mix["nodes"])
            others = {u for n in mine if n is not last for u in n.users if u not in mine}
    if others and not isinstance(mix, dict):  # the student's logits read by heads the pass fuses apart
        beside = _heads_beside(q, mine, others)
        if beside:
            f["beside"], others, mix = beside, set(), None
    others = sorted(u.name for u in others)
    # the op reads both heads' inputs (and the row mask or labels) at the loss: no write between the
    # first matmul and the loss to those, to the logits or to what the divergence derives from them
    # (a running sum of other terms, torchtune's ``total += ...``, may be written)
    reads = {n: "the logits or what the divergence derives from them" for n in mine}
    for c in (q, p):
        reads.update({n: "a head's hidden states, weight or bias" for n in (c.hidden, c.weight, c.bias)
                      if n is not None})
    for n in (f.get("mask"), mix.get("target") if isinstance(mix, dict) else None):
        if isinstance(n, Node):
            reads[n] = "the row mask or the labels"
    written = _mutation.first_write_to((q.matmul, p.matmul), last, reads)
    if written is not None:
        return (f"{_mutation.spelling(written[0])} writes a tensor between the lm_head matmuls and the loss "
                f"({written[1]})")
    # the op reads the boolean where eager read its cast (``mask.float()``, maybe reshaped): no write to
    # the boolean or to a cast of it from the first cast on (one side would see it, the other not)
    chain = f.get("mask_chain", ())
    written = _mutation.first_write_to((chain[-2],), last, dict.fromkeys(chain, "the row mask")) \
        if len(chain) > 1 else None
    if written is not None:
        return (f"{_mutation.spelling(written[0])} writes {written[1]} or its cast after the cast (the op reads "
                "the boolean)")
    # the op saves the heads' inputs for its backward, where eager's no-grad or frozen linear may not
    output = next(iter(last.graph.find_nodes(op="output")), None)
    saved = {n: "a head's hidden states, weight or bias" for c in (q, p) for n in (c.hidden, c.weight, c.bias)
             if n is not None}
    trains = any(bool(tval(n).requires_grad) for n in saved if tval(n) is not None)
    written = _mutation.first_write_to((last,), output, saved) if trains and output is not None else None
    if written is not None:
        return (f"{_mutation.spelling(written[0])} writes {written[1]} after the loss, and the fused op's "
                "backward reads it (eager's may not)")
    if isinstance(mix, str):
        return mix
    if others:
        return f"the logits have other users ({', '.join(others)})"
    if mix is not None and f.get("negate"):
        return "a hard-label cross-entropy added to the negated soft cross-entropy (not supported yet)"
    if mix is not None:
        f["mix"] = mix
    return None


def _heads_beside(q: _logits.LogitsChain, mine: set, others: set) -> Optional[list]:
    """The kinds of the other heads over the student's lm_head (a cross-entropy, log-probs, a top-k:
    the pass's idioms) when they account for every other user of its logits (``others``, outside the
    divergence's nodes ``mine``), else None. Then the divergence is an op of its own and each of those
    heads one later in the pass, each computing the student's logits again (one more GEMM forward and
    in the backward) where the sum of the two (``_hard_label_mix``) is not the one op's: a
    cross-entropy summed, or over other rows than the divergence's mask, or torchtune's chunks, whose
    counts are tensors. Neither head's ``[N, V]`` logits stays."""
    from . import _analyse, _candidates, _match

    graph = q.matmul.graph
    candidates = _candidates(graph)
    covered, read, kinds, sites = set(), set(), [], []
    for node, idioms in candidates.items():
        found = _match(node, idioms)
        if not isinstance(found, Head) or found.loss in mine:
            continue
        c = _logits.trace(found.logits)
        if isinstance(c, _logits.LogitsChain) and c.matmul is q.matmul:
            covered |= {*c.nodes, *found.consumed, found.loss, *found.aux}
            read |= {*c.nodes, *found.consumed}
            kinds.append(found.kind)
            sites.append((node, idioms))
    # and nothing else reads what those heads read of the logits (else they decline, and the logits stay)
    alone = all(u in covered or u in mine for n in read for u in n.users)
    if not (kinds and others <= covered and alone):
        return None
    # nor would their sites decline for another reason (read with the divergence's reads allowed, as
    # they will be gone): else the divergence's op would run beside the logits it did not remove
    for node, idioms in sites:
        found = _analyse(graph.owning_module, node, idioms, candidates, True, False)
        if found is None or not isinstance(found.outcome, SitePlan):
            return None
    return kinds


def _operands(e: Emitter, c: _logits.LogitsChain) -> tuple:
    """(hidden [N, D], weight [V, D], bias) of a head for the op, in its matmul's dtype, detached when
    the head is computed without gradient (the teacher under torch.no_grad())."""
    d = c.vd[1] if isinstance(c.vd[1], int) else e.method("size", c.weight, 1 if c.weight_is_vd else 0)
    hidden = _logits.replay(e, c.hidden, [op for _, op in c.shape_ops], d)
    hidden = e.method("reshape", hidden, (-1, d))
    weight = c.weight if c.weight_is_vd else e.method("t", c.weight)
    bias = c.bias
    dtype = tval(c.matmul).dtype
    no_grad = c.detached or not tval(c.matmul).requires_grad
    out = []
    for t in (hidden, weight, bias):
        if t is None:
            out.append(None)
            continue
        if tval(t).dtype != dtype:
            t = e.method("to", t, dtype)
        if no_grad and tval(t).requires_grad:
            t = e.method("detach", t)
        out.append(t)
    return tuple(out)


def _rewrite(gm: GraphModule, node: Node, f: dict, budget: str):
    q, p, graph, node = f["q"], f["p"], gm.graph, f["out"]
    # at the loss (or at the sum with the cross-entropy): both heads' inputs and the targets exist there
    e = Emitter(graph, f["mix"]["add"] if "mix" in f else f.get("anchor", node), node)
    hs, ws, bs = _operands(e, q)
    ht, wt, bt = _operands(e, p)
    needs = [bool(t is not None and tval(t).requires_grad) for t in (hs, ws, bs, ht, wt, bt)]
    reduce, mix = f["reduce"], f.get("mix")
    kind, beta = f.get("kind", "forward_kl"), float(f.get("beta", 0.5))
    op_reduction = "none" if reduce == "none" else "sum"
    # recompute (a store budget of 0) keeps per-row statistics for a backward over vocabulary chunks
    op, tail = (ops.DISTILL_RECOMPUTE, ()) if distill.recomputes(needs, budget) else (ops.DISTILL_FORWARD, (budget,))
    caps = (_cap(q), _cap(p))
    capped = {} if caps == (None, None) else dict(softcap_s=caps[0], softcap_t=caps[1])
    if mix is not None:  # soft · Σ KL / divisor + hard · the mean cross-entropy, every row's KL counted
        target = mix["target"] if tval(mix["target"]).dim() == 1 else e.method("reshape", mix["target"], -1)
        out = e.call(op, hs, ws, bs, ht, wt, bt, target, mix["ignore_index"], kind, beta,
                     float(q.logit_scale), float(p.logit_scale), "sum", needs, mix["soft"], mix["hard"], mix["masked"],
                     *tail,
                     **capped)
        node = mix["add"]
    else:  # a row mask (_masked_sum) as the target: its False rows ignored, so the op can skip them
        mask = f.get("mask")
        target = None if mask is None else e.call(torch.where, e.method("reshape", mask, -1), 0, -100)
        out = e.call(op, hs, ws, bs, ht, wt, bt, target, -100,
                     kind, beta, float(q.logit_scale), float(p.logit_scale), op_reduction, needs, 1.0, 0.0, True,
                     *tail, **capped)
    value = e.getitem(out, 0)
    # the sizes as numbers where they are static: a size read from the [N, V] log-probs would keep
    # them (and the student's logits) in the graph until a later pass removes them
    lp_shape = tval(q.nodes[-1]).shape
    if mix is not None:
        pass
    elif reduce == "none":
        lead = tuple(lp_shape[:-1])
        value = e.method("view", value, lead if _static(lead) else
                         e.getitem(e.method("size", q.nodes[-1]), slice(None, -1)))
    elif reduce == "batchmean":
        rows = tval(f["inp"]).shape[0]
        value = e.call(operator.truediv, value, rows if _static((rows,)) else e.method("size", f["inp"], 0))
    elif reduce == "mean":
        count = tval(f["inp"]).numel()
        value = e.call(operator.truediv, value, count if _static((count,)) else e.method("numel", f["inp"]))
    elif reduce == "masked_mean":  # x[mask].mean(): over the mask's rows' elements
        v = lp_shape[-1] if _static((lp_shape[-1],)) else e.method("size", q.nodes[-1], -1)
        count = e.call(operator.mul, e.method("sum", f["mask"]), v)
        # an empty mask: eager's mean of nothing is NaN and its gradients 0 (nothing was indexed); a
        # plain 0 / 0 here would send NaN back through the gradients the op formed
        mean = e.call(operator.truediv, value, e.method("clamp_min", count, 1))
        value = e.call(torch.where, e.call(operator.eq, count, 0), math.nan, mean)
    if f.get("negate"):  # the spelling's value is the op's divergence negated (soft_ce: Σ p·log q)
        value = e.call(operator.neg, value)
    if tval(value).dtype != tval(node).dtype:
        value = e.method("to", value, tval(node).dtype)
    node.replace_all_uses_with(value)
    avoided, dead = 0, {*f["nodes"], *q.nodes, *p.nodes, *(mix["nodes"] if mix else ())}
    for n in reversed(list(graph.nodes)):
        if n in dead and not n.users:
            t = tval(n)
            if t is not None and n in (q.matmul, p.matmul):
                avoided += (numel_hint(t) or 0) * t.element_size()
            graph.erase_node(n)
    if f.get("indexed"):  # the boolean index Dynamo kept under our scope's capture is read here
        gm.meta[dynamo_tuning.USED] = True
    kept = _kept_dz(q, needs, budget)
    what = {"forward_kl": "KL(p || q)", "soft_ce": "-(p · log q) summed (the soft cross-entropy, negated)"}.get(
        kind, f"generalised JSD (beta={beta:g})")
    recompute = distill.recomputes(needs, budget)
    how = "gradients in the forward" if reduce != "none" else "recompute"
    if recompute:
        how = ("recompute: per-row statistics kept; the backward recomputes both heads' logits over "
               "vocabulary chunks")
    elif kept:
        avoided = max(0, avoided - kept)
        size = f"~{kept / 2**20:.0f} MiB" if kept >= 2**20 else f"~{kept / 2**10:.0f} KiB"
        how += (f"; the student's gradient logits of every row kept ({size}) for one weight-gradient "
                "GEMM")
    reduction = REDUCTION_WORDS.get(reduce, reduce)
    return _report.SiteReport(PATTERN, True, f"fused: {what} of two lm_heads in one op, reduction={reduction}, "
                              f"temperatures {1 / q.logit_scale:g} and {1 / p.logit_scale:g}"
                              + ("" if caps == (None, None) else
                                 f", softcaps {_words(caps[0])} and {_words(caps[1])} before them")
                              + (f", the student's hard-label cross-entropy mixed in ({mix['hard']:g} · CE + "
                                 f"{mix['soft']:g} · Σ KL)" if mix else "")
                              + (", the target head without gradient" if not any(needs[3:]) else "")
                              + (f", the student's logits also read by {' and '.join(dict.fromkeys(f['beside']))} "
                                 "heads, each an op of its own" if f.get("beside") else "")
                              + (MASKED if f.get("mask") is not None else ""),
                              node.name, ("distillation",), **_report.sizes(q), bytes_avoided=avoided,
                              strategy="store" if reduce != "none" and not recompute else "recompute",
                              strategy_reason=how, extra_bytes=kept or None)


REDUCTION_WORDS = {"masked_mean": "mean over the mask's rows"}
# explain's note on a _masked_sum site
MASKED = (", under a row mask (its dropped rows the op's ignored ones: not computed, on CUDA for biasless "
          "16-bit heads)")


def _words(cap: Optional[float]) -> str:
    return "none" if cap is None else f"{cap:g}"


def _static(sizes) -> bool:
    return all(isinstance(x, int) for x in sizes)


def _kept_dz(q, needs: list, budget: str) -> int:
    """The bytes of the student's gradient logits the op will keep (distill.keeps_dz) at this site's
    sizes, 0 when it will not (or the rows are not known)."""
    z = tval(q.matmul)
    n, v = hint(math.prod(z.shape[:-1])), hint(z.shape[-1])
    if n is None or v is None or not distill.keeps_dz(n, v, z.dtype, z.device, True, needs, budget):
        return 0
    return n * v * z.element_size()
