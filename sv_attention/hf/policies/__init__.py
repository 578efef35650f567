"""KV eviction policies behind one interface, so experiments compare them at a matched budget.

One small class per policy (DESIGN §4):

- :class:`CertifiedPolicy` keeps the support vectors (alpha > 0) of an exact SVDD fit; it only ever drops
  reserve tokens, so dropping them provably leaves the SV gate's output unchanged.
- :class:`HeavyHitterPolicy` ("H2O") keeps the tokens with the largest accumulated attention mass.
- :class:`RecencyPolicy` keeps the most recent tokens.
- :class:`RandomPolicy` keeps a uniformly random subset.

Every policy maps a :class:`PolicyContext` and a budget to a :class:`PolicyDecision`.
"""

from __future__ import annotations

from sv_attention.hf.policies.base import EvictionPolicy, PolicyContext, PolicyDecision
from sv_attention.hf.policies.certified import CertifiedPolicy
from sv_attention.hf.policies.heavy_hitter import (
    HeavyHitterPolicy,
    rbf_attention_mass,
    softmax_attention_mass,
)
from sv_attention.hf.policies.random_subset import RandomPolicy
from sv_attention.hf.policies.recency import RecencyPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    CertifiedPolicy.name: CertifiedPolicy,
    HeavyHitterPolicy.name: HeavyHitterPolicy,
    RecencyPolicy.name: RecencyPolicy,
    RandomPolicy.name: RandomPolicy,
}


def get_policy(name: str, **kwargs) -> EvictionPolicy:
    """Build a policy by name (``"certified"``, ``"h2o"``, ``"recency"``, ``"random"``)."""
    from sv_attention.errors import ConfigError

    cls = POLICIES.get(name)
    if cls is None:
        raise ConfigError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}")
    return cls(**kwargs)


__all__ = [
    "POLICIES",
    "CertifiedPolicy",
    "EvictionPolicy",
    "HeavyHitterPolicy",
    "PolicyContext",
    "PolicyDecision",
    "RandomPolicy",
    "RecencyPolicy",
    "get_policy",
    "rbf_attention_mass",
    "softmax_attention_mass",
]
