"""Random: keep a uniformly random subset of the budget's size."""

from __future__ import annotations

import numpy as np

from sv_attention.hf.policies.base import EvictionPolicy, PolicyContext


class RandomPolicy(EvictionPolicy):
    """Keep ``budget`` tokens chosen uniformly at random (``ctx.rng``, or ``seed`` when it is None)."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def _keep(self, ctx: PolicyContext, budget: int) -> tuple[np.ndarray, dict]:
        rng = ctx.rng if ctx.rng is not None else np.random.default_rng(self.seed)
        keep = np.zeros(ctx.n, dtype=bool)
        keep[rng.permutation(ctx.n)[:budget]] = True
        return keep, {}

    def __repr__(self) -> str:
        return f"RandomPolicy(seed={self.seed})"
