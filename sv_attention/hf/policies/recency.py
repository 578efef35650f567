"""Recency: keep the most recent tokens (a sliding window)."""

from __future__ import annotations

import numpy as np

from sv_attention.hf.policies.base import EvictionPolicy, PolicyContext


class RecencyPolicy(EvictionPolicy):
    """Keep the ``budget`` tokens with the largest positions."""

    name = "recency"

    def _keep(self, ctx: PolicyContext, budget: int) -> tuple[np.ndarray, dict]:
        keep = np.zeros(ctx.n, dtype=bool)
        keep[np.argsort(-ctx.positions, kind="stable")[:budget]] = True
        return keep, {}
