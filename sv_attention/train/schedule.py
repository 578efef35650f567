"""Learning-rate schedule (linear warm-up, cosine decay) and AdamW parameter groups."""

from __future__ import annotations

import math

import torch


def lr_factor(step: int, steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak learning rate for optimiser step ``step`` (0-based).

    Linear warm-up ``(step + 1) / warmup_steps`` for ``step < warmup_steps``, then a cosine from 1 down to
    ``min_lr_ratio`` reached at ``step = steps - 1``.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(steps - 1 - warmup_steps, 1)
    progress = min(max((step - warmup_steps) / span, 0.0), 1.0)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(optimizer: torch.optim.Optimizer, steps: int, warmup_steps: int,
                   min_lr_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` applying :func:`lr_factor` (stepped once per optimiser step, on every process)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, steps, warmup_steps, min_lr_ratio))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on parameters with >= 2 dimensions (matrices, embeddings), none on
    biases, norms and scalars. Tied parameters appear once."""
    decay, no_decay = [], []
    seen: set[int] = set()
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
