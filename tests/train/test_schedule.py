import math

import pytest
import torch

from sv_attention.train.schedule import lr_factor, make_scheduler, param_groups


def test_warmup_then_cosine_to_min():
    steps, warm, lo = 20, 4, 0.1
    f = [lr_factor(s, steps, warm, lo) for s in range(steps)]
    assert f[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert f[4] == pytest.approx(1.0) and f[-1] == pytest.approx(lo)
    assert all(a >= b for a, b in zip(f[4:], f[5:]))  # monotone decay after warm-up
    mid = warm + (steps - 1 - warm) / 2
    assert lr_factor(int(mid), steps, warm, lo) == pytest.approx(
        lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * (int(mid) - warm) / (steps - 1 - warm))))


def test_scheduler_applies_factor_per_step():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=0.01)
    sched = make_scheduler(opt, 10, 2, 0.0)
    seen = []
    for _ in range(10):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.01 * lr_factor(s, 10, 2, 0.0) for s in range(10)])


def test_decay_only_on_matrices_and_tied_counted_once():
    m = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 5))
    m[2].weight = m[0].weight  # tie
    decay, no_decay = param_groups(m, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert len(decay["params"]) == 1  # the tied matrix once
    assert {p.ndim for p in no_decay["params"]} == {1} and len(no_decay["params"]) == 3
