"""Weight-gradient error of store's two bf16 paths, simulated on CPU against float64.

    python3 benchmarks/store_fold_precision.py      # ~20 s on 2 cores

The same numbers a GPU run of the kernels gives up to the GEMMs' summation order: each path's
roundings are applied with torch in fp32 (an fp32-accumulating GEMM, then one rounding to bf16).

- torch.compile: bf16 logits, softmax in fp32, dz rounded to bf16, dW = dzᵀ·h
- dz path: fp32 logits, dz rounded to bf16 once, dW = dzᵀ·h
- folded path: E = exp(z − ref) rounded to bf16 (the target column holding dz_t/scale), dW = Eᵀ·(scale·h)
  with scale·h rounded to bf16: two roundings per product

and over two row chunks, the first chunk's dW rounded to bf16 before the second is added (addmm).
The folded path is taken only where it stays under torch.compile's error (templates/launch.py, folds).
"""

import math

import torch

N, D, V = 2048, 512, 16384
BF = torch.bfloat16


def data(kind):
    """benchmarks/shapes.py's gauss and zipf data at a CPU-sized shape."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(N, D, generator=g)
    w = torch.randn(V, D, generator=g) * (3.0 / math.sqrt(D))
    if kind == "gauss":
        t = torch.randint(0, V, (N,), generator=g)
    else:
        h[:, 0] = 4.0
        w[:, 0] = -1.1 * torch.log1p(torch.arange(V, dtype=torch.float32)) / 4.0
        p = torch.softmax(h.to(BF).float() @ w.to(BF).float().t(), -1)
        t = torch.multinomial(p, 1, generator=g).squeeze(1)
    t[::17] = -100
    return h.to(BF), w.to(BF), t


def rel(x, r):
    return ((x.double() - r).norm() / r.norm()).item()


def two_chunks(a, b):
    """aᵀ·b over two row chunks, accumulated in bf16 as addmm does (one rounding per chunk)."""
    first = (a[: N // 2].float().t() @ b[: N // 2].float()).to(BF)
    return (first.float() + a[N // 2:].float().t() @ b[N // 2:].float()).to(BF)


def main():
    for kind in ("gauss", "zipf"):
        h, w, t = data(kind)
        valid = t != -100
        g = torch.where(valid, 1.0 / valid.sum(), 0.0)
        idx = torch.where(valid, t, 0)
        rows = torch.arange(N)
        onehot = torch.zeros(N, V)
        onehot[rows, idx] = 1
        hd = h.double()
        ref = (g.double()[:, None] * (torch.softmax(hd @ w.double().t(), -1) - onehot.double())).t() @ hd

        z_bf = (h.float() @ w.float().t()).to(BF).float()
        dz_compile = (g[:, None] * (torch.softmax(z_bf, -1) - onehot)).to(BF)
        z = h.float() @ w.float().t()
        dz = (g[:, None] * (torch.softmax(z, -1) - onehot)).to(BF)
        zt = z.gather(1, idx[:, None])[:, 0]
        lse = torch.logsumexp(z, -1)
        base = zt.to(BF).float()  # the reference: a 16-bit target logit
        e = torch.exp(z - base[:, None])
        e[rows, idx] = (torch.exp(zt - lse) - 1) * torch.exp(lse - base)
        e = e.to(BF)
        hs = (h.float() * (g * torch.exp(base - lse))[:, None]).to(BF)

        one = {name: rel((a.float().t() @ b.float()).to(BF), ref)
               for name, (a, b) in {"compile": (dz_compile, h), "dz": (dz, h), "folded": (e, hs)}.items()}
        two = {name: rel(two_chunks(a, b), ref) for name, (a, b) in {"dz": (dz, h), "folded": (e, hs)}.items()}
        print(f"{kind}: dW error, one chunk: " + ", ".join(f"{k} {v:.2e}" for k, v in one.items())
              + "; two chunks: " + ", ".join(f"{k} {v:.2e}" for k, v in two.items()))


if __name__ == "__main__":
    main()
