"""Certified eviction: drop only reserve tokens (alpha exactly 0 in an exact SVDD fit)."""

from __future__ import annotations

import numpy as np

from sv_attention.hf.policies.base import EvictionPolicy, PolicyContext


class CertifiedPolicy(EvictionPolicy):
    """Keep every support vector (margin and error sets); fill any spare budget with the most recent
    reserve tokens.

    Dropping a reserve token leaves the gate's output unchanged (its alpha is exactly 0), so the decision
    is ``certified``. A support vector is never dropped: when ``budget < |S ∪ E|`` the decision keeps the
    whole support and reports ``budget_met = False``.
    """

    name = "certified"
    certified = True
    needs = ("support",)

    def _keep(self, ctx: PolicyContext, budget: int) -> tuple[np.ndarray, dict]:
        support = np.asarray(ctx.support, dtype=bool)
        keep = support.copy()
        spare = budget - int(support.sum())
        if spare > 0:
            reserve = np.flatnonzero(~support)
            recent = reserve[np.argsort(-ctx.positions[reserve], kind="stable")][:spare]
            keep[recent] = True
        return keep, {"support": int(support.sum()), "reserve": int((~support).sum())}
