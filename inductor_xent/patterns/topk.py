"""``torch.topk(z, k)`` / ``z.topk(k)`` of the logits, of their ``log_softmax`` or of their
``softmax`` over the vocabulary (the largest ``k``): the student's top-k in top-k distillation, a
teacher's top-k export, top-k accuracy (issue 25, item 2).

A ``topk`` head: ``topk.linear_topk``'s op (``inductor_xent::linear_topk``: row chunks, each chunk's
logits and ``torch.topk`` over them, never the ``[N, V]`` logits) gives the values and indices; a
softmax's values are the exponentials of the log-probs'. Its users must read the result's two items
(``values, indices = torch.topk(...)``, ``.values``, ``[0]``); ``sorted=False`` is served sorted
(any order is allowed). Declined, with the reason: the smallest k (``largest=False``), a k that is not
a Python int when compiling, the result read whole. A top-k over fewer than ``MIN_VOCAB`` columns (a
mixture-of-experts router's) is no candidate.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

from ._fx import arg, hint, is_call, norm_dim, tval
from ._logits import is_matmul
from ._site import Decline, Head, log_probs_of, probs_of
from ._steps import MATCHERS

PATTERN = "topk"
TARGETS = (torch.topk, "topk")
# fewer columns than this are no vocabulary: a mixture-of-experts router's top-k over its experts
# (Mixtral's 8, DeepSeek-V3's 256, Qwen3-Next's 512: softmax(gate(h)).topk(k)) or a classifier's,
# left alone (not a candidate: nothing to report)
MIN_VOCAB = 1024


def match(node: Node):
    src, k, dim = arg(node, 0, "input"), arg(node, 1, "k"), arg(node, 2, "dim", -1)
    largest, t = arg(node, 3, "largest", True), tval(src)
    if t is None or t.dim() < 2 or not isinstance(dim, int) or norm_dim(dim, t.dim()) != t.dim() - 1:
        return None  # over another dimension: no per-row top-k of the vocabulary
    if (hint(t.shape[-1]) or 0) < MIN_VOCAB:
        return None  # a router's experts, not a vocabulary
    of, logits, consumed, lse = "logits", src, (), ()
    lp, p = log_probs_of(src), probs_of(src)
    if lp is not None and lp.dim == t.dim() - 1:
        of, logits, consumed, lse = "log_probs", lp.logits, lp.nodes, lp.lse
    elif p is not None and p.dim == t.dim() - 1:
        of, logits, consumed, lse = "probs", p.logits, p.nodes, p.lse
    elif not (is_matmul(src) or is_call(src, tuple(MATCHERS))):
        return None  # of something computed from the logits (per-token values): not the vocabulary's top-k
    if largest is not True:
        return Decline(PATTERN, node, "torch.topk(..., largest=False) (the smallest k) is not fused", logits=logits,
                       kind="topk")
    if isinstance(k, bool) or not isinstance(k, int):
        return Decline(PATTERN, node, "a top-k whose k is not a Python int when compiling", logits=logits,
                       kind="topk")
    items = list(node.users)
    if not all(is_call(u, (operator.getitem,)) and arg(u, 1, "index") in (0, 1) for u in items):
        return Decline(PATTERN, node, "the top-k result is read whole (read its values and indices)", logits=logits,
                       kind="topk")
    return Head(PATTERN, node, logits, None, consumed, aux=tuple(items), kind="topk", needs_lse_of=lse, k=k,
                normalised=of)
