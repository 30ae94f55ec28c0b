"""Fixed-shard optimizer on one rank: pull/push slices and AdamW equal torch's AdamW."""

from __future__ import annotations

import torch

from parallel_runtime.training.optimizer import AdamWConfig, FlatLayout, LocalParam, ParamSpec, ShardedOptimizer
from parallel_runtime.training.transport import ShardExchange


def test_single_rank_matches_torch_adamw():
    torch.manual_seed(0)
    specs = [ParamSpec(name="w", shape=(6, 4), tp_dim=0), ParamSpec(name="n", shape=(4,), decay=False)]
    init = {"w": torch.randn(6, 4), "n": torch.ones(4)}
    cfg = AdamWConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=0.0)
    opt = ShardedOptimizer(FlatLayout(specs, 1), init, cfg)
    xc = ShardExchange(opt)
    # two TP "ranks" simulated in one process: each holds half of w's rows, n replicated
    halves = [torch.nn.Parameter(torch.empty(3, 4)) for _ in range(2)]
    norms = [torch.nn.Parameter(torch.empty(4)) for _ in range(2)]
    local = [LocalParam(spec=specs[0], tensor=halves[t], tp_index=t, tp_size=2) for t in range(2)]
    local += [LocalParam(spec=specs[1], tensor=norms[t], tp_index=t, tp_size=2) for t in range(2)]
    ref_w = torch.nn.Parameter(init["w"].clone())
    ref_n = torch.nn.Parameter(init["n"].clone())
    ref = torch.optim.AdamW([{"params": [ref_w], "weight_decay": 0.1}, {"params": [ref_n], "weight_decay": 0.0}],
                            lr=1e-2, betas=cfg.betas, eps=cfg.eps)
    for _ in range(3):
        xc.pull(local)
        torch.testing.assert_close(torch.cat([h.data for h in halves]), ref_w.data, rtol=1e-6, atol=1e-7)
        x = torch.randn(5, 4)
        for t in range(2):
            (x @ halves[t].T).pow(2).sum().backward()
            (x * norms[t]).sum().backward()
        (x @ ref_w.T).pow(2).sum().backward()
        (x * ref_n).sum().backward()  # replicated: counted once (tp index 0)
        xc.push(local)
        opt.step()
        ref.step()
        ref.zero_grad()
        for p in halves + norms:
            p.grad = None
    xc.pull(local)
    torch.testing.assert_close(torch.cat([h.data for h in halves]), ref_w.data, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(norms[1].data, ref_n.data, rtol=1e-6, atol=1e-7)


def test_clipping_uses_the_global_norm():
    specs = [ParamSpec(name="a", shape=(3,))]
    opt = ShardedOptimizer(FlatLayout(specs, 1), {"a": torch.zeros(3)}, AdamWConfig(lr=1.0, max_grad_norm=1.0))
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    ShardExchange(opt).push([LocalParam(spec=specs[0], tensor=p)])
    assert abs(opt.step() - 5.0) < 1e-9
