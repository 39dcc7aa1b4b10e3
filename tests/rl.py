"""RL heads written in plain PyTorch, for the tests of ``linear_log_probs``.

``eager_log_probs`` is what RL code computes from a model's materialised logits (verl, TRL and
OpenRLHF spell it this way: logits in fp32, divided by the sampling temperature, log_softmax, gather
of the sampled tokens, entropy from the same distribution); ``grpo_loss`` is a GRPO/PPO clipped
surrogate over per-token log-probabilities, with a k3 KL penalty to a reference policy, an entropy
bonus and a response mask; ``check_grpo`` feeds it ``linear_log_probs``'s outputs and
``eager_log_probs``'s and compares the loss and the gradients; ``grpo_problem`` makes its inputs.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def eager_log_probs(hidden: Tensor, weight: Tensor, target: Tensor, *, bias: Optional[Tensor] = None,
                    temperature: float = 1.0, logit_scale: float = 1.0, softcap: Optional[float] = None,
                    ignore_index: int = -100) -> tuple[Tensor, Tensor, Tensor]:
    """(log_probs, entropy, argmax) from the logits ``F.linear`` gives in the input dtype, cast to
    fp32 (fp64 stays fp64) as models do; ignored rows give 0."""
    z = F.linear(hidden, weight, bias)
    z = z.to(torch.float64 if z.dtype == torch.float64 else torch.float32) * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    logp = z.log_softmax(-1)
    valid = target != ignore_index
    picked = logp.gather(-1, torch.where(valid, target, 0).unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return torch.where(valid, picked, 0.0), torch.where(valid, entropy, 0.0), z.argmax(-1)


def grpo_per_token(log_probs: Tensor, entropy: Tensor, old_log_probs: Tensor, ref_log_probs: Tensor,
                   advantages: Tensor, *, clip: float = 0.2, kl_coef: float = 0.04,
                   entropy_coef: float = 0.01) -> Tensor:
    """The clipped surrogate ``max(−A·r, −A·clip(r, 1 ± clip))`` with ``r = exp(log_probs −
    old_log_probs)``, plus ``kl_coef·(exp(d) − d − 1)``, ``d = ref − log_probs`` (the k3 estimator
    of KL(π‖π_ref)), minus ``entropy_coef·entropy``, per token. ``advantages`` broadcasts against
    the tokens (one per sequence in GRPO)."""
    ratio = torch.exp(log_probs - old_log_probs)
    surrogate = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip, 1 + clip))
    d = ref_log_probs - log_probs
    return surrogate + kl_coef * (torch.exp(d) - d - 1) - entropy_coef * entropy


def grpo_loss(log_probs: Tensor, entropy: Tensor, old_log_probs: Tensor, ref_log_probs: Tensor,
              advantages: Tensor, mask: Tensor, **coefs) -> Tensor:
    """The token-level mean of ``grpo_per_token`` over ``mask``."""
    per_token = grpo_per_token(log_probs, entropy, old_log_probs, ref_log_probs, advantages, **coefs)
    m = mask.to(per_token.dtype)
    return (per_token * m).sum() / m.sum()


def check_grpo(ours_fn, hidden: Tensor, weight: Tensor, target: Tensor, kw: dict, batch: dict, *, k: float,
               floor: float) -> None:
    """The GRPO loss and its gradients w.r.t. (hidden, weight) on ``ours_fn(h, w) -> (log_probs,
    entropy)`` against float64 eager, within ``k`` times eager's same-dtype error plus ``floor``.

    The rollout's and the reference policy's log-probs are data (the exact ones plus
    ``grpo_batch``'s offsets), not functions of the implementation. The loss is a mean of terms
    whose advantages cancel (normalised over the group), so its error is measured against the
    size of its terms (the masked mean of their magnitudes), not against its own small value."""
    with torch.no_grad():
        rollout = eager_log_probs(hidden.double(), weight.double(), target, **kw)[0]

    def run(fn, hh, ww):
        hh, ww = hh.detach().clone().requires_grad_(), ww.detach().clone().requires_grad_()
        lp, ent = fn(hh, ww)
        old, ref = ((rollout + batch[name]).to(lp.dtype) for name in ("old_offset", "ref_offset"))
        per_token = grpo_per_token(lp, ent, old, ref, batch["advantages"].to(lp.dtype))
        m = batch["mask"].to(lp.dtype)
        loss = (per_token * m).sum() / m.sum()
        scale = ((per_token.abs() * m).sum() / m.sum()).item()
        return [loss.detach(), *torch.autograd.grad(loss, (hh, ww))], scale

    ours, _ = run(ours_fn, hidden, weight)
    same, _ = run(lambda hh, ww: eager_log_probs(hh, ww, target, **kw)[:2], hidden, weight)
    exact, scale = run(lambda hh, ww: eager_log_probs(hh, ww, target, **kw)[:2], hidden.double(), weight.double())
    assert ours[0].dtype == same[0].dtype
    e_ours, e_same = (abs(x[0].item() - exact[0].item()) / scale for x in (ours, same))
    assert e_ours <= k * e_same + floor, f"loss: err(ours)={e_ours:.3g} err(torch)={e_same:.3g} (of {scale:.3g})"
    for name, x, s, e in zip(("grad_hidden", "grad_weight"), ours[1:], same[1:], exact[1:]):
        e_ours, e_same = (((y.double() - e).norm() / e.norm()).item() for y in (x, s))
        assert e_ours <= k * e_same + floor, f"{name}: err(ours)={e_ours:.3g} err(torch)={e_same:.3g}"
    ratio = torch.exp(-batch["old_offset"])[batch["mask"]]
    assert ((ratio - 1).abs() > 0.2).any() and ((ratio - 1).abs() < 0.2).any()  # the clip bites on some tokens


def grpo_batch(batch: int, seq: int, *, seed: int = 0, device="cpu") -> dict:
    """Rollout data of ``batch`` sequences of ``seq`` tokens: per-sequence advantages (normalised
    group rewards), old and reference log-probability offsets (added to the current policy's, so
    the ratios spread over e^±0.3 and the clip at 0.2 bites on some tokens), and a response mask
    (a prompt of 3 tokens masked out, padding at the end of every other sequence)."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, 1, generator=g)
    mask = torch.ones(batch, seq, dtype=torch.bool)
    mask[:, :3] = False
    mask[::2, -4:] = False
    return dict(
        advantages=((rewards - rewards.mean()) / (rewards.std() + 1e-6)).to(device),
        old_offset=(torch.randn(batch, seq, generator=g) * 0.3).to(device),
        ref_offset=(torch.randn(batch, seq, generator=g) * 0.2).to(device),
        mask=mask.to(device),
    )


def grpo_problem(dtype, *, bsz: int = 4, seq: int = 19, d: int = 16, v: int = 211, seed: int = 7) -> tuple:
    """(hidden, weight, target, batch) of a GRPO step on ``bsz`` sequences of ``seq`` tokens: logits
    with std ~3, ``grpo_batch``'s rollout data, targets ignored (-100) where the mask is off."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(bsz, seq, d, generator=g).to(dtype)
    w = (torch.randn(v, d, generator=g) * (3 / d**0.5)).to(dtype)
    y = torch.randint(0, v, (bsz, seq), generator=g)
    batch = grpo_batch(bsz, seq, seed=seed + 1)
    y[~batch["mask"]] = -100  # prompt and padding: no target
    return h, w, y, batch
