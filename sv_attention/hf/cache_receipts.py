"""Receipts of the certified KV cache: what an eviction or a deletion did, and what it guarantees.

Plain frozen dataclasses (DESIGN §4: solver results are objects): inspect, log and assert on them;
``as_dict()`` gives a JSON-ready form and ``summary()`` a few readable lines.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SCOPE_STATEMENT = (
    "Scope: the deleted tokens' keys and values are gone from this cache and from every gate "
    "(long-range tokens by the exact fixed-C decrement, current-chunk tokens by masking). A token's "
    "influence on other tokens' hidden states computed while it was present is NOT removed unless "
    "reencode=True, which recomputes the suffix's keys and values without it."
)
SCOPE_STATEMENT_REENCODED = (
    "Scope: the deleted tokens' keys and values are gone, and the suffix after the first deleted "
    "position was re-encoded without them (reencode=True): the cache equals a cache that never saw them."
)
PATH_EXACT = "exact decrement"
PATH_LOCAL = "uncertified (local path)"
PATH_REENCODED = "re-encoded"


def _as_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _as_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _as_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_as_dict(v) for v in obj]
    return obj


@dataclass(frozen=True)
class LayerEviction:
    """What certified eviction did in one layer.

    Attributes
    ----------
    layer : int
    certified : bool
        True when the certified policy ran on a layer whose solvers all held a certificate (out of warm-up,
        KKT residuals within tolerance): every dropped token had alpha exactly 0. False when the layer was
        skipped, or when a heuristic policy chose the tokens (``reason`` says which).
    reason : str
    n_slots_before, n_slots_after : int
        Key/value slots the layer held (its tensors' sequence dimension).
    n_admitted : int
        Long-range tokens admitted to the solvers (positions before the current chunk, minus forgotten).
    n_local : int
        Current-chunk tokens (never evicted: they are read densely).
    reserve_fraction : list[list[float]] ``[batch][kv_head]``
        Fraction of the admitted tokens in each solver's reserve set (alpha exactly 0).
    evicted_positions : tuple[int, ...]
        Positions physically removed from the layer (reserve in every (batch, kv-head) solver).
    realised_fraction : float
        ``len(evicted_positions) / n_admitted`` (0 when nothing is admitted).
    kkt_max : float
        Largest KKT residual over the layer's solvers after the eviction (evicted keys re-checked).
    max_evicted_alpha : float
        Largest gate weight, over every (batch row, kv-head) of the layer where the token is a real token,
        that the physically evicted tokens held just before the eviction (alpha in gated rows, 1 in rows in
        warm-up; measured: 0.0 is what makes the eviction exact).
    policy : str
        The eviction policy's name (``"certified"``, ``"h2o"``, ``"recency"``, ``"random"``).
    """

    layer: int
    certified: bool
    reason: str
    n_slots_before: int
    n_slots_after: int
    n_admitted: int
    n_local: int
    reserve_fraction: list
    evicted_positions: tuple[int, ...]
    realised_fraction: float
    kkt_max: float
    max_evicted_alpha: float = 0.0
    policy: str = "certified"


@dataclass(frozen=True)
class EvictionReceipt:
    """Receipt of :meth:`CertifiedCache.evict`.

    With the certified policy, only tokens with alpha exactly 0 in every (batch, kv-head) solver of a layer
    leave that layer (:attr:`max_evicted_alpha` measures it), so every later readout is unchanged; a later
    admission that revives an evicted token restores it from the offload tier (see
    :attr:`CertifiedCache.restore_events`). With a heuristic policy :attr:`certified` is False and
    :attr:`max_evicted_alpha` says how much gate weight the dropped tokens carried.
    """

    layers: tuple[LayerEviction, ...]
    budget: int | None
    budget_met: bool
    memory_bytes_before: int
    memory_bytes_after: int
    offload_bytes: int
    elapsed_s: float

    @property
    def max_evicted_alpha(self) -> float:
        """Largest alpha any physically evicted token held in any solver when it was evicted (0.0 = exact)."""
        return max((le.max_evicted_alpha for le in self.layers), default=0.0)

    @property
    def certified(self) -> bool:
        return all(le.certified for le in self.layers) and bool(self.layers)

    @property
    def n_evicted(self) -> int:
        return sum(len(le.evicted_positions) for le in self.layers)

    @property
    def realised_fraction(self) -> float:
        adm = sum(le.n_admitted for le in self.layers)
        return self.n_evicted / adm if adm else 0.0

    @property
    def mean_reserve_fraction(self) -> float:
        vals = [f for le in self.layers for row in le.reserve_fraction for f in row]
        return float(sum(vals) / len(vals)) if vals else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = _as_dict(self)
        d.update(certified=self.certified, n_evicted=self.n_evicted, realised_fraction=self.realised_fraction,
                 mean_reserve_fraction=self.mean_reserve_fraction, max_evicted_alpha=self.max_evicted_alpha)
        return d

    def summary(self) -> str:
        lines = [f"EvictionReceipt: evicted {self.n_evicted} slots (realised {self.realised_fraction:.1%} of admitted; "
                 f"mean per-head reserve {self.mean_reserve_fraction:.1%}); memory {self.memory_bytes_before} -> "
                 f"{self.memory_bytes_after} bytes; budget {self.budget} met={self.budget_met}; "
                 f"max alpha of an evicted token {self.max_evicted_alpha:.1e}"]
        for le in self.layers:
            lines.append(f"  layer {le.layer} ({le.policy}): {len(le.evicted_positions)} evicted, certified={le.certified} "
                         f"({le.reason}), kkt_max={le.kkt_max:.2e}")
        return "\n".join(lines)


@dataclass(frozen=True)
class SolverDeletion:
    """One (layer, batch row, kv-head) solver's part of a deletion.

    Attributes
    ----------
    layer, batch, head : int
    kkt : dict
        KKT residuals after the decrement (``sum, margin, error, reserve, box, evicted, max``).
    elapsed_s : float
        Wall time of the solver's decrement.
    refit_deviation : float or None
        ``max |f_decrement - f_refit|`` over probes (the retained and the deleted keys), where
        ``f_refit`` is a from-scratch solve of the retained history with the same C and sigma
        (computed when ``verify=True``).
    readmitted : tuple[int, ...]
        Evicted positions the decrement turned back into support vectors (restored from offload).
    in_warmup : bool
    """

    layer: int
    batch: int
    head: int
    kkt: dict
    elapsed_s: float
    refit_deviation: float | None
    readmitted: tuple[int, ...]
    in_warmup: bool


@dataclass(frozen=True)
class DeletionReceipt:
    """Receipt of :meth:`CertifiedCache.forget`.

    Attributes
    ----------
    positions : tuple[int, ...]
        The forgotten positions (in the cache's position numbering before the call).
    paths : dict[int, str]
        Per position: ``"exact decrement"`` (admitted long-range token: fixed-C decrement in every
        solver), ``"uncertified (local path)"`` (current-chunk token: masked, weights renormalised, no SV
        certificate), or ``"re-encoded"``.
    solvers : tuple[SolverDeletion, ...]
    verified : bool
        True when refit deviations were computed (``verify=True``).
    reencoded : bool
    position_map : dict[int, int] or None
        With ``reencode=True`` positions shift: old position -> new position for every kept position at
        or after the first deleted one.
    warmup_fallback_layers : tuple[int, ...]
        Layers whose gate fell back to warm-up (ungated) because the deletion left fewer than
        ``ceil(1/C) + 2`` admitted keys.
    restored : tuple[tuple[int, int], ...]
        ``(layer, position)`` evicted tokens restored from the offload tier because the deletion revived them.
    exactness_lost : tuple[tuple[int, int], ...]
        ``(layer, position)`` revived tokens that could not be restored (no offload tier).
    elapsed_s, solver_elapsed_s : float
        Whole call; sum of the solvers' decrements.
    memory_bytes_before, memory_bytes_after : int
    scope : str
        The plain statement of what the deletion does and does not remove.
    """

    positions: tuple[int, ...]
    paths: dict
    solvers: tuple[SolverDeletion, ...]
    verified: bool
    reencoded: bool
    position_map: dict | None
    warmup_fallback_layers: tuple[int, ...]
    restored: tuple
    exactness_lost: tuple
    elapsed_s: float
    solver_elapsed_s: float
    memory_bytes_before: int
    memory_bytes_after: int
    scope: str = field(default=SCOPE_STATEMENT)

    @property
    def max_kkt_residual(self) -> float:
        return max((s.kkt.get("max", 0.0) for s in self.solvers), default=0.0)

    @property
    def max_refit_deviation(self) -> float | None:
        devs = [s.refit_deviation for s in self.solvers if s.refit_deviation is not None]
        return max(devs) if devs else None

    def as_dict(self) -> dict[str, Any]:
        d = _as_dict(self)
        d.update(max_kkt_residual=self.max_kkt_residual, max_refit_deviation=self.max_refit_deviation)
        return d

    def summary(self) -> str:
        dev = self.max_refit_deviation
        return "\n".join([
            f"DeletionReceipt: forgot {list(self.positions)} via {sorted(set(self.paths.values()))}; "
            f"{len(self.solvers)} solver decrements, max KKT residual {self.max_kkt_residual:.2e}"
            + (f", max refit deviation {dev:.2e}" if dev is not None else "")
            + f"; {self.elapsed_s * 1e3:.2f} ms",
            self.scope,
        ])


@dataclass(frozen=True)
class RestoreEvent:
    """An evicted token that a later admission or deletion revived (it failed the reserve re-check).

    ``restored`` is True when its key/value came back from the offload tier (exactness kept); False
    when no offload tier held it (exactness lost: the gate gives it weight but the slot is gone).
    """

    layer: int
    position: int
    restored: bool
    trigger: str
