"""bf16 ring attention's gradients against an fp64 reference: one long doc over a ring of W gloo ranks.

    python tools/ring_precision.py --world-size 4 --tokens 2048      # dq, dk, dv max relative error

Every rank holds its zigzag share of one doc in bf16 and runs the ring's forward and backward through the
tiled kernels (the kernel both the fp32-accumulating ring and an older checkout run: ``PYTHONPATH=<checkout>``
compares them); rank 0 gathers the gradients and compares them with the fp64 formula. Prints JSON.
"""

from __future__ import annotations

import argparse
import json

import torch


def _rank(rank: int, world: int, tokens: int) -> list[float] | None:
    import torch.distributed as dist

    from balanced_loader.materialize import cp_positions, padded_length
    from parallel_runtime.engines import ring
    from parallel_runtime.engines.context import RingAttention

    ring.FUSED_MIN_ROWS = 10**9  # the tiled blocks
    h, hkv, d = 4, 2, 32
    g = torch.Generator().manual_seed(0)
    q, k, v, go = (torch.randn(tokens, n, d, generator=g, dtype=torch.float64) for n in (h, hkv, hkv, h))
    rows = cp_positions(padded_length(tokens, world), world, 1)[rank]
    real = torch.from_numpy(rows[rows < tokens])  # this lane's real rows (padding sits at the end)

    def lane(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out = torch.zeros(len(rows), x.shape[1], d, dtype=dtype)
        out[:len(real)] = x[real].to(dtype)
        return out

    ql, kl, vl = (lane(x, torch.bfloat16).requires_grad_() for x in (q, k, v))
    o = RingAttention(dist.group.WORLD, list(range(world)), rank).bind([tokens])(ql, kl, vl)
    (o.float() * lane(go, torch.float32)).sum().backward()
    full = [torch.zeros(tokens, n, d, dtype=torch.float64) for n in (h, hkv, hkv)]
    for f, t in zip(full, (ql, kl, vl)):
        f[real] = t.grad[:len(real)].double()
        dist.all_reduce(f)
    if rank:
        return None
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    rep = h // hkv
    s = torch.einsum("qhd,khd->hqk", qq, kk.repeat_interleave(rep, 1)) / d**0.5
    s = s.masked_fill(torch.ones(tokens, tokens, dtype=torch.bool).triu(1), float("-inf"))
    (torch.einsum("hqk,khd->qhd", s.softmax(-1), vv.repeat_interleave(rep, 1)) * go).sum().backward()
    return [float((a - b.grad).abs().max() / b.grad.abs().max()) for a, b in zip(full, (qq, kk, vv))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args()
    from parallel_runtime.launch import spawn_world

    err = spawn_world(_rank, args.world_size, args.tokens, timeout_s=1200)[0]
    print(json.dumps({"world_size": args.world_size, "tokens": args.tokens, "dq_dk_dv_rel_error": err}))


if __name__ == "__main__":
    main()
