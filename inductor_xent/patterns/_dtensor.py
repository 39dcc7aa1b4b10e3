"""DTensor lm_heads (tensor parallelism): what the pass sees through, checks and puts back.

With ``ColwiseParallel`` on the lm_head (torchtitan's spelling), Dynamo's graph holds DTensors::

    x_dt = DTensor.from_local(x, mesh, (Replicate(),))          # ColwiseParallel's input hook
    z_dt = torch._C._nn.linear(x_dt, W_dt)                       # W_dt: Shard(0), z_dt: Shard(-1)
    z_dt = z_dt.redistribute(placements=(Shard(-1),))            # output hook (a no-op here), or
                                                                 # (Replicate(),) + .to_local() with
                                                                 # output_layouts=Replicate()
    loss = F.cross_entropy(z_dt.flatten(0, 1).float(), y)        # under loss_parallel(): a DTensor

``redistribute`` and ``full_tensor`` keep a DTensor's global value, and so does ``to_local`` of a
replicated one: the walk back from the loss passes them (``passes``). The site is then rewritten as
usual with DTensor hidden states and weight, and ``inductor_xent.distributed`` (imported here
on first use) gives the op its vocabulary-parallel rules. The op's outputs are replicated DTensors:
the rewrite takes their local tensors for the reduction and makes the loss a DTensor again where
the original one was (``local``, ``restore``). Layouts the rules do not run decline with their
reason (``decline_reason``).
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from torch.fx import Node

from .. import compat
from ._fx import arg, tval


def _is_dtensor(value: Any) -> bool:
    # no DTensor can exist before its module is imported: single-rank graphs never import it
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def involved(chain) -> bool:
    """True when the lm_head matmul works on DTensors."""
    return _is_dtensor(tval(chain.weight)) or _is_dtensor(tval(chain.hidden))


def passes(node: Node) -> Optional[Node]:
    """The input of ``node`` when it is a DTensor op between the matmul and the loss that keeps the
    logits' global value (a ``_steps.Noop``); None for anything else."""
    call = compat.dtensor_method(node) if node.op in ("call_method", "call_function") else None
    first = arg(node, 0, "input")
    if call is None or not isinstance(first, Node):
        return None
    name, args, kwargs = call
    src = tval(first)
    if not _is_dtensor(src) or kwargs.get("grad_placements") is not None:
        return None
    if name in ("redistribute", "full_tensor") and not (name == "full_tensor" and args):
        return first
    if name == "to_local" and not args and all(p.is_replicate() for p in src.placements):
        return first
    return None


def decline_reason(site, chain) -> Optional[str]:
    """Why a DTensor site cannot become the vocabulary-parallel op; None when it can (or when no
    DTensor is involved)."""
    if not involved(chain):
        return None
    from .. import distributed

    if not chain.weight_is_vd:
        return "vocabulary parallel: a [D, V] DTensor weight (only nn.Linear's [V, D] layout is supported)"
    bias = tval(chain.bias) if chain.bias is not None else None
    try:
        distributed.layout(tval(chain.hidden), tval(chain.weight), bias, tval(site.target), site.label_smoothing,
                           chain.softcap)
    except distributed.LayoutError as e:
        return f"vocabulary parallel: {e.reason}"
    if _is_dtensor(tval(site.target)):
        return "vocabulary parallel: DTensor targets (pass the labels as a plain tensor, as torchtitan does)"
    loss = tval(site.loss)
    if _is_dtensor(loss) and not all(p.is_replicate() for p in loss.placements):
        return f"vocabulary parallel: the loss is not replicated ({tuple(loss.placements)})"
    return None


def describe(chain) -> Optional[str]:
    """What ``explain`` says about a fused DTensor site."""
    if not involved(chain):
        return None
    w = tval(chain.weight)
    dim = next(i for i, p in enumerate(w.placements) if not p.is_replicate())
    return f"vocabulary-parallel over {w.device_mesh.size(dim)} ranks (mesh dim {dim})"


def local(e, node: Node) -> Node:
    """The op's output as this rank's plain tensor (the op returns replicated DTensors)."""
    return e.method("to_local", node) if _is_dtensor(tval(node)) else node


def restore(e, node: Node, like: Node, chain) -> Node:
    """``node`` as a replicated DTensor where the node it replaces (``like``) was a DTensor."""
    if not _is_dtensor(tval(like)) or _is_dtensor(tval(node)):
        return node
    from .. import distributed

    return e.call(distributed.replicate_like, node, chain.hidden)
