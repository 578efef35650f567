"""Receipts, certificates and KKT residuals of the exact SVDD solver (DESIGN §2.2).

Every mutating call of :class:`~sv_attention.svdd.exact.IncrementalSVDD` returns one of the receipt
dataclasses below; :meth:`~sv_attention.svdd.exact.IncrementalSVDD.certificate` returns a
:class:`Certificate`. They are plain frozen dataclasses: inspect, log and assert on them.

KKT conditions (``g_i = rho - K_ii + 2 (K alpha)_i``):

- sum:      ``sum(alpha) = 1``
- margin:   ``g_i = 0`` on the margin set S (``0 < alpha_i < C``)
- error:    ``g_i <= 0`` on the error set E (``alpha_i = C``)
- reserve:  ``g_i >= 0`` on the reserve set R (``alpha_i = 0``), evicted reserve keys included
- box:      ``0 <= alpha_i <= C``
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Status codes of a key inside the solver.
RESERVE, MARGIN, ERROR = 0, 1, 2


@dataclass(frozen=True)
class Partition:
    """The partition of the active keys, as tuples of ids (each sorted ascending)."""

    margin: tuple[int, ...]
    error: tuple[int, ...]
    reserve: tuple[int, ...]

    @property
    def sizes(self) -> dict[str, int]:
        """``{"margin": |S|, "error": |E|, "reserve": |R|}``."""
        return {"margin": len(self.margin), "error": len(self.error), "reserve": len(self.reserve)}

    def label_of(self, ident: int) -> str:
        """``"margin"``, ``"error"`` or ``"reserve"`` for an active id (KeyError otherwise)."""
        for name in ("margin", "error", "reserve"):
            if ident in getattr(self, name):
                return name
        raise KeyError(ident)


@dataclass(frozen=True)
class KKTResiduals:
    """Worst violation of each KKT condition (all >= 0; 0 means exactly satisfied).

    ``evicted`` is the reserve condition ``g >= 0`` evaluated on the evicted (stored) reserve keys.
    """

    sum: float = 0.0
    margin: float = 0.0
    error: float = 0.0
    reserve: float = 0.0
    box: float = 0.0
    evicted: float = 0.0

    @property
    def max(self) -> float:
        """The largest residual."""
        return max(self.sum, self.margin, self.error, self.reserve, self.box, self.evicted)

    def as_dict(self) -> dict[str, float]:
        return {"sum": self.sum, "margin": self.margin, "error": self.error, "reserve": self.reserve,
                "box": self.box, "evicted": self.evicted, "max": self.max}


def kkt_residuals(alpha: np.ndarray, g: np.ndarray, status: np.ndarray, C: float,
                  g_evicted: np.ndarray | None = None) -> KKTResiduals:
    """KKT residuals of a solution.

    Parameters
    ----------
    alpha, g : float64 ``[n]`` coefficients and KKT gradients ``g_i = rho - K_ii + 2 (K alpha)_i``
    status : int ``[n]`` with :data:`RESERVE`, :data:`MARGIN`, :data:`ERROR`
    C : the box
    g_evicted : float64 ``[m]`` gradients of evicted reserve keys, or None

    Returns
    -------
    KKTResiduals (a residual touched by a NaN is ``inf``, so a NaN can never pass as a KKT point)
    """
    if alpha.size == 0:
        return KKTResiduals()
    s, e, r = status == MARGIN, status == ERROR, status == RESERVE
    margin = _worst(np.abs(g[s]))
    error = _worst(g[e])
    reserve = _worst(-g[r])
    lo, hi = float(alpha.min()), float(alpha.max())
    box = float("inf") if lo != lo or hi != hi else max(0.0, -lo, hi - C)  # NaN != NaN
    # alpha must also sit exactly on its bound for E / R
    box = max(box, _worst(np.abs(alpha[e] - C)), _worst(np.abs(alpha[r])))
    ev = _worst(-g_evicted) if g_evicted is not None else 0.0
    total = abs(float(alpha.sum()) - 1.0)
    return KKTResiduals(sum=total if total == total else float("inf"), margin=margin, error=error,
                        reserve=reserve, box=box, evicted=ev)


def _worst(v: np.ndarray) -> float:
    """``max(0, max(v))``, with ``inf`` when ``v`` holds a NaN (never read as 0: ``max(0, nan)`` is 0)."""
    if v.size == 0:
        return 0.0
    m = float(v.max())
    if m != m:  # NaN
        return float("inf")
    return m if m > 0.0 else 0.0


@dataclass(frozen=True)
class _Receipt:
    ids: tuple[int, ...]
    """The ids this call acted on, in order."""
    n: int
    """Active keys after the call."""
    partition_sizes: dict[str, int]
    kkt: KKTResiduals
    guard_events: int
    """Guard events (refactors, refused degenerate pivots, anti-cycling skips) during this call."""
    guard_detail: dict[str, int]
    elapsed_s: float
    in_warmup: bool
    fallback: bool = False
    """True when the active-set walk did not converge and a from-scratch solve replaced it (also warned)."""
    events: int = 0
    """Active-set events (set migrations and rho sweeps) walked during this call."""


@dataclass(frozen=True)
class AdmissionReceipt(_Receipt):
    """Receipt of :meth:`IncrementalSVDD.add`. ``ids`` are the new ids, in order.

    ``readmitted`` lists previously evicted reserve keys whose re-check ``g >= 0`` failed after this
    admission and that were therefore re-admitted to the active set (restore their values!).
    """

    readmitted: tuple[int, ...] = field(default=())


@dataclass(frozen=True)
class DeletionReceipt(_Receipt):
    """Receipt of :meth:`IncrementalSVDD.remove`. ``ids`` / ``deleted`` are the deleted ids.

    ``readmitted`` lists evicted reserve keys that the deletion turned into support vectors again
    (the solution stays the refit-without of the full history).
    """

    readmitted: tuple[int, ...] = field(default=())

    @property
    def deleted(self) -> tuple[int, ...]:
        return self.ids


@dataclass(frozen=True)
class EvictionReceipt(_Receipt):
    """Receipt of :meth:`IncrementalSVDD.evict_reserve`. ``ids`` are the evicted reserve ids.

    ``max_abs_output_change`` is 0.0 by construction (alpha of every evicted key is exactly 0); it is
    recorded so that logs carry the certified claim.
    """

    max_abs_output_change: float = 0.0


@dataclass(frozen=True)
class Certificate:
    """State of the solver's guarantees.

    ``certified`` is True when the solver is out of warm-up and every KKT residual (evicted keys
    included) is at most ``tolerance``: then every reserve / evicted key has alpha exactly 0 at an
    optimum of the full history, so dropping it leaves every readout unchanged.
    """

    certified: bool
    in_warmup: bool
    n: int
    n_evicted: int
    C: float
    sigma: float
    partition_sizes: dict[str, int]
    kkt: KKTResiduals
    tolerance: float
    guard_events: int
    guard_detail: dict[str, int]
    fallbacks: int
    reason: str
    """Why the certificate is (not) issued, in words."""
