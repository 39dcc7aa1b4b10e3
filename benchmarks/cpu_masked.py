"""CPU A/B of a masked RL site under the pass (issue 24; patterns/_masked.py): TRL's GRPO loss from
the logits, the first half of each sequence masked after the head, forward + backward.

    python3 benchmarks/cpu_masked.py MODE [--shape 4x512x256x32000] [--masked 0.5]

MODE: ``inductor_xent`` (the pass skips the masked rows), ``dense`` (the same with
``INDUCTOR_XENT_SKIP_IGNORED=0``: every row computed; read at compile time), ``inductor``
(torch.compile's default backend), ``eager``. One mode per process (the switch is read when the pass
runs); the loss printed must be the same for every mode. Median of 5 steps after 2 warm-up steps,
``torch.set_num_threads`` as given. CPU timings are noisy: run the modes in alternating order.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def grpo(h, w, ids, old, adv, mask):
    z = (h @ w.t()).float() / 0.7
    lp = z.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, -1)
    ratio = torch.exp(lp - old)
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv)
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("inductor_xent", "dense", "inductor", "eager"))
    p.add_argument("--shape", default="4x512x256x32000", help="BxSxDxV")
    p.add_argument("--masked", type=float, default=0.5, help="fraction of each sequence masked (its start)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    b, s, d, v = (int(x) for x in args.shape.split("x"))
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(b, s, d, generator=g), torch.randn(v, d, generator=g) * 0.05
    ids, adv = torch.randint(0, v, (b, s), generator=g), torch.randn(b, 1, generator=g)
    old = -torch.rand(b, s, generator=g) * 3
    mask = torch.ones(b, s, dtype=torch.long)
    mask[:, : int(s * args.masked)] = 0
    if args.mode == "dense":
        os.environ["INDUCTOR_XENT_SKIP_IGNORED"] = "0"
    if args.mode == "eager":
        fn = grpo
    else:
        import inductor_xent  # noqa: F401  (registers the backend from a source tree)

        fn = torch.compile(grpo, backend="inductor" if args.mode == "inductor" else "inductor_xent")

    def step() -> float:
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fn(hh, ww, ids, old, adv, mask)
        loss.backward()
        return loss.item()

    loss = step()
    step()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    print(f"{args.mode:13s} {args.shape} masked {args.masked:.0%}: loss {loss:.6f}, median "
          f"{statistics.median(times) * 1e3:.1f} ms ({', '.join(f'{t * 1e3:.0f}' for t in times)})")


if __name__ == "__main__":
    main()
