"""The jobs' optimizer (worker/trainer/optimizer.py): AdamW as the spec says, its foreach kernels on every device,
and the same numbers as the per-tensor loop bit for bit (so the change of kernel changes no job's weights)."""

import torch

from service.job_spec.objective import OptimizerSpec
from worker.trainer.optimizer import adamw

SHAPES = [(16, 64), (64, 16), (16, 128), (128, 16), (7,)]


def _train(make, steps=6):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    optimizer = make(params)
    grads = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=grads)
        optimizer.step()
    return params, optimizer


def test_adamw_follows_the_spec_and_runs_foreach():
    spec = OptimizerSpec(lr=3e-4, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.1)
    _, optimizer = _train(lambda ps: adamw(ps, spec), steps=1)
    group = optimizer.param_groups[0]
    assert isinstance(optimizer, torch.optim.AdamW)
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (3e-4, (0.8, 0.9), 1e-8, 0.1)
    assert group["foreach"] is True  # on a CPU torch would otherwise loop over the tensors one by one


def test_foreach_gives_the_per_tensor_loops_numbers_bit_for_bit():
    spec = OptimizerSpec(lr=1e-3, weight_decay=0.01)
    ours, opt_ours = _train(lambda ps: adamw(ps, spec))
    loop, opt_loop = _train(lambda ps: torch.optim.AdamW(ps, lr=spec.lr, betas=spec.betas, eps=spec.eps,
                                                         weight_decay=spec.weight_decay, foreach=False))
    for a, b in zip(ours, loop):
        assert torch.equal(a, b)
    for a, b in zip(ours, loop):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt_ours.state[a][key], opt_loop.state[b][key])
