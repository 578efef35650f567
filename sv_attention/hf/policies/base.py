"""The eviction-policy interface: a context in, a keep mask out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from sv_attention.errors import InvalidInputError


@dataclass
class PolicyContext:
    """What a policy may look at when choosing which tokens to keep.

    Attributes
    ----------
    positions : int array ``[n]``
        Stream position of each candidate token (larger = more recent).
    keys : float array ``[n, d]`` or None
        The candidate keys.
    attention_mass : float array ``[n]`` or None
        Accumulated attention mass each token has received (heavy-hitter policies).
    support : bool array ``[n]`` or None
        True where an exact SVDD solver gives the token alpha > 0 (margin or error set); False for the
        reserve set (alpha exactly 0). Certified policies need it.
    rng : numpy Generator or None
        Randomness for stochastic policies.
    """

    positions: np.ndarray
    keys: np.ndarray | None = None
    attention_mass: np.ndarray | None = None
    support: np.ndarray | None = None
    rng: np.random.Generator | None = None

    def __post_init__(self) -> None:
        self.positions = np.asarray(self.positions)
        if self.positions.ndim != 1:
            raise InvalidInputError(f"positions must be 1-D [n], got shape {self.positions.shape}")
        n = self.positions.shape[0]
        for name in ("attention_mass", "support"):
            val = getattr(self, name)
            if val is not None and np.asarray(val).shape != (n,):
                raise InvalidInputError(f"{name} must have shape [{n}] like positions, got {np.asarray(val).shape}")
        if self.keys is not None and np.asarray(self.keys).shape[0] != n:
            raise InvalidInputError(f"keys must have {n} rows like positions, got {np.asarray(self.keys).shape}")

    @property
    def n(self) -> int:
        return int(self.positions.shape[0])


@dataclass
class PolicyDecision:
    """The outcome of a policy.

    Attributes
    ----------
    keep : bool array ``[n]``
        True for the tokens to keep.
    certified : bool
        True when every dropped token is provably inert (alpha exactly 0).
    budget : int
        The budget asked for.
    budget_met : bool
        ``keep.sum() <= budget``. A certified policy never drops a support vector to meet a budget.
    notes : dict
        Policy-specific details.
    """

    keep: np.ndarray
    certified: bool
    budget: int
    budget_met: bool
    notes: dict = field(default_factory=dict)

    @property
    def n_kept(self) -> int:
        return int(self.keep.sum())

    @property
    def evicted_index(self) -> np.ndarray:
        """Indices (into the context arrays) of the dropped tokens."""
        return np.flatnonzero(~self.keep)


class EvictionPolicy(ABC):
    """Choose which tokens to keep under a budget."""

    name: ClassVar[str] = "base"
    certified: ClassVar[bool] = False
    needs: ClassVar[tuple[str, ...]] = ()
    """Context fields the policy requires (checked before :meth:`_keep` runs)."""

    def select(self, ctx: PolicyContext, budget: int) -> PolicyDecision:
        """Decide which of the ``ctx.n`` tokens to keep, at most ``budget`` where the policy allows.

        Raises
        ------
        InvalidInputError
            ``budget`` negative or not an integer, or a field the policy needs is missing.
        """
        if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 0:
            raise InvalidInputError(f"budget must be a non-negative integer, got {budget!r}")
        for f in self.needs:
            if getattr(ctx, f) is None:
                raise InvalidInputError(f"policy {self.name!r} needs PolicyContext.{f}; pass it")
        keep, notes = self._keep(ctx, int(budget))
        keep = np.asarray(keep, dtype=bool)
        return PolicyDecision(keep=keep, certified=self.certified, budget=int(budget),
                              budget_met=bool(keep.sum() <= budget), notes=notes)

    @abstractmethod
    def _keep(self, ctx: PolicyContext, budget: int) -> tuple[np.ndarray, dict]:
        """Return the keep mask ``[n]`` and a notes dict."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def top_k_mask(score: np.ndarray, k: int, tiebreak: np.ndarray) -> np.ndarray:
    """Keep the ``k`` largest scores; ties broken by the larger ``tiebreak`` (e.g. the more recent)."""
    n = score.shape[0]
    keep = np.zeros(n, dtype=bool)
    if k <= 0:
        return keep
    order = np.lexsort((-np.asarray(tiebreak), -np.asarray(score)))  # primary: score desc
    keep[order[: min(k, n)]] = True
    return keep
