"""The causal hybrid SV-Attention layer (DESIGN §2.5): chunk-frozen SVDD gate + dense local window.

Chunk-frozen rule (chunk ``c``, default 64): a query at absolute position ``t`` lies in chunk
``[s, s + c)`` with ``s = c * floor(t / c)``. It reads

* the long-range **prefix** ``[0, s)`` weighted by ``alpha^{(s)}_j``, the SVDD coefficients of the gate
  fitted on the keys ``[0, s)`` of its (batch, kv-head) — so the gate depends **only** on keys before
  the chunk, and prefill and token-by-token decoding give the same output;
* the **local window** ``[s, t]`` with weight 1;

with one softmax over ``[0, t]`` (softmax weights times the gate, renormalised;
:mod:`sv_attention.ops.readouts`). Chunk 0 and **warm-up** (fewer than ``ceil(1/C) + 2`` valid prefix
keys) are plain causal softmax. GQA: the SVDD problem is per (batch, kv-head); query heads of one group
share their kv-head's gate.

Solvers: ``"batched"`` fits every needed boundary of every (batch, kv-head) with
:func:`sv_attention.svdd.batched.solve_batched` (one call per boundary, all (batch, kv-head) problems of
that boundary together: identical shapes in prefill and decode, so both compute the same gate); every
boundary after the first starts warm (:data:`WARM_START`): its partition is found by active-set steps
from the previous boundary's (:mod:`sv_attention.svdd.warm_fit`, no FISTA finder), then the same ridged
differentiable solve as the cold path gives the gate, so gate and gradients equal the cold path's to
solver tolerance; problems that do not settle fall back to ``solve_batched`` (counted in
:attr:`BoundaryGates.fit_counts`);
``"exact"`` streams the keys of each (batch, kv-head) into an fp64
:class:`sv_attention.svdd.IncrementalSVDD` across chunk boundaries (no gradient).

Bandwidth: ``sigma`` a float, or None for the median pairwise distance of the (valid) keys of the first
chunk ``[0, c)`` of each (batch, kv-head), frozen for all later boundaries (causal; the same in both
solvers).

Non-causal use (``causal=False``, encoders): one gate is fitted on all valid keys and every query reads
every visible key weighted by its alpha (no local window); fewer valid keys than the warm-up size gives
plain softmax.

Deletions (DESIGN §2.5) are the certified cache's business: deleting a long-range token uses the exact
decrement of the ``"exact"`` solver; deleting a current-chunk token only masks its slot (no SV
certificate).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sv_attention.errors import (
    InfeasibleBoxError,
    InvalidHyperparameterError,
    InvalidInputError,
)
from sv_attention.kernels import median_bandwidth, rbf_gram
from sv_attention.ops.masking import causal_mask, to_bool_mask
from sv_attention.ops.readouts import rbf_readout, softmax_hybrid_readout

SOLVERS = ("batched", "exact")
#: solve_batched settings of the layer (overridable through ``solve_kwargs``): 40 FISTA iterations
#: instead of the stand-alone default 80. The polish makes the partition a KKT point either way; in a
#: training step the finder is the largest part of the gate's time (``sv-attention bench step``).
LAYER_SOLVE_DEFAULTS: dict[str, Any] = {"fista_iters": 40}
READOUTS = ("softmax", "rbf")


def warmup_size(C: float) -> int:
    """Smallest number of keys out of warm-up: ``ceil(1/C) + 2`` (DESIGN §2.1)."""
    return int(math.ceil(1.0 / C - 1e-9)) + 2


def c_from_nu(nu: float, n0: int) -> float:
    """Calibrate the box once: ``C = 1 / (nu * n0)`` (DESIGN §2.1)."""
    if not (0 < nu <= 1):
        raise InvalidHyperparameterError(f"nu must be in (0, 1], got {nu}")
    if int(n0) != n0 or n0 < 1:
        raise InvalidHyperparameterError(f"n0 must be a positive integer, got {n0}")
    return 1.0 / (nu * n0)


# ----------------------------------------------------------------------------- gate cache
@dataclass
class GateCache:
    """Memo of per-boundary gates for one layer, so decoding does not refit at every step.

    Holds, per chunk boundary ``s``, the coefficients ``alpha [b, h_kv, s]`` and the ``active`` flags
    ``[b, h_kv]`` (False = warm-up: plain softmax), the frozen bandwidth ``sigma [b, h_kv]``, a
    fingerprint of the prefix keys (a cached boundary is recomputed, and counted in ``invalidations``,
    when the keys it was fitted on changed, e.g. a new sequence), and for ``solver="exact"`` the
    maintained solvers per (batch, kv-head). Use one cache per layer and per generation;
    :meth:`reset` between sequences.

    Attributes
    ----------
    alpha : dict[int, Tensor ``[b, h_kv, s]``]
    active : dict[int, bool Tensor ``[b, h_kv]``]
    sigma : Tensor ``[b, h_kv]`` or None
    hits, misses, invalidations : int
    status_counts : dict[str, int]  accumulated :attr:`BatchedSolution.counts` of every fit
    exact_solvers : list or None  ``IncrementalSVDD`` per (batch, kv-head), row-major
    exact_ingested : int  number of keys streamed into the exact solvers
    partition : dict[int, tuple]  ``(margin, error, status, alpha)`` per fitted boundary (``[b * h_kv, s]``,
        detached): warm start of later boundaries (batched solver)
    fit_counts : dict[str, int]  accumulated :attr:`BoundaryGates.fit_counts`
    """

    alpha: dict[int, torch.Tensor] = field(default_factory=dict)
    active: dict[int, torch.Tensor] = field(default_factory=dict)
    fingerprint: dict[int, tuple[float, float]] = field(default_factory=dict)
    sigma: torch.Tensor | None = None
    hits: int = 0
    misses: int = 0
    invalidations: int = 0
    status_counts: dict[str, int] = field(default_factory=dict)
    exact_solvers: list[Any] | None = None
    exact_ingested: int = 0
    partition: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    fit_counts: dict[str, int] = field(default_factory=dict)

    def reset(self) -> None:
        """Forget every boundary, the bandwidth and the exact solvers (start of a new sequence)."""
        self.alpha.clear()
        self.active.clear()
        self.fingerprint.clear()
        self.sigma = None
        self.exact_solvers = None
        self.exact_ingested = 0
        self.partition.clear()

    def boundaries(self) -> list[int]:
        """Cached boundaries, ascending."""
        return sorted(self.alpha)


def _fingerprint(k_prefix: torch.Tensor) -> tuple[float, float]:
    kd = k_prefix.detach().double()
    return float(kd.sum()), float(kd.abs().sum())


def _fingerprint_matches(a: tuple[float, float], b: tuple[float, float]) -> bool:
    tol = 1e-4 * max(a[1], b[1], 1e-30)
    return abs(a[0] - b[0]) <= tol and abs(a[1] - b[1]) <= tol


def _accumulate(counts: dict[str, int], new: dict[str, int]) -> None:
    for key, val in new.items():
        counts[key] = counts.get(key, 0) + int(val)


# ----------------------------------------------------------------------------- boundary gates
@dataclass
class BoundaryGates:
    """Gates of the requested boundaries.

    Attributes
    ----------
    alpha : dict[int, Tensor ``[b, h_kv, s]``]  coefficients over the prefix ``[0, s)``
        (0 on padded keys; differentiable w.r.t. the keys when fitted with ``detach=False``)
    active : dict[int, bool Tensor ``[b, h_kv]``]  False = warm-up (the prefix is read ungated)
    sigma : Tensor ``[b, h_kv]``  bandwidth used
    status_counts : dict[str, int]  problems per solve status, summed over the fits done in this call
    fit_counts : dict[str, int]  problems of the batched fits of this call by how they were fitted:
        ``cold`` (:func:`solve_batched`), ``warm`` (partition from the previous boundary's),
        ``warm_fallback`` (the warm start did not settle: :func:`solve_batched` from the previous gate),
        ``warm_fallback_cold`` (of those, the ones that then needed the cold solve)
    """

    alpha: dict[int, torch.Tensor]
    active: dict[int, torch.Tensor]
    sigma: torch.Tensor
    status_counts: dict[str, int]
    fit_counts: dict[str, int] = field(default_factory=dict)


def _frozen_sigma(k: torch.Tensor, key_valid: torch.Tensor, chunk: int) -> torch.Tensor:
    """Median bandwidth of the valid keys of the first chunk, ``[b, h_kv]`` (detached)."""
    c = min(chunk, k.shape[2])
    return median_bandwidth(k[:, :, :c].detach(), key_valid[:, :, :c])


def _sigma_tensor(sigma: float | torch.Tensor | None, k: torch.Tensor, key_valid: torch.Tensor, chunk: int,
                  cache: GateCache | None) -> torch.Tensor:
    b, hk = k.shape[:2]
    if sigma is None:
        if cache is not None and cache.sigma is not None and cache.sigma.shape == (b, hk):
            return cache.sigma
        sig = _frozen_sigma(k, key_valid, chunk).to(k.dtype)
        if cache is not None and k.shape[2] >= chunk:
            cache.sigma = sig
        return sig
    if isinstance(sigma, torch.Tensor):
        return sigma.to(k.dtype).expand(b, hk) if sigma.dim() == 0 else sigma.to(k.dtype)
    return torch.full((b, hk), float(sigma), dtype=k.dtype, device=k.device)


def _gram(k: torch.Tensor, s: int, sigma: torch.Tensor, detach: bool) -> torch.Tensor:
    """RBF Gram ``[b * h_kv, s, s]`` of the keys ``[0, s)``."""
    b, hk = k.shape[:2]
    keys = k[:, :, :s]
    keys = keys.detach() if detach else keys
    sig = sigma.detach() if detach else sigma
    with torch.profiler.record_function("sv.gram"):
        return rbf_gram(keys.reshape(b * hk, s, -1), sigma=sig.reshape(b * hk, 1, 1))


#: Warm start of the training path: boundaries after the first find their partition by active-set steps
#: from the previous boundary's partition (:func:`sv_attention.svdd.warm_fit.warm_partition`) instead of
#: the cold FISTA finder; the final differentiable solve is the cold path's. False: every boundary cold.
WARM_START = True
#: Process-wide counters of the batched fits (see :func:`fit_stats`): ``warm`` / ``cold`` problems,
#: ``warm_fallback`` / ``warm_fallback_cold`` (see :attr:`BoundaryGates.fit_counts`).
FIT_STATS: dict[str, int] = {}


def fit_stats() -> dict[str, int]:
    """A copy of :data:`FIT_STATS` (problems fitted ``warm`` / ``cold``, ``warm_fallback``, ...)."""
    return dict(FIT_STATS)


#: ``(margin [G, s], error [G, s], status [G], alpha [G, s])`` of a boundary's fit (detached): the warm
#: start of later boundaries.
Partition = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
#: FISTA / power iterations of the fallback of unsettled warm problems: ``solve_batched`` started from the
#: previous boundary's gate (padded with zeros) instead of from scratch; its polish makes the partition a
#: KKT point as in the cold path (problems it leaves unconverged are solved cold).
WARM_FALLBACK_FISTA_ITERS = 10
WARM_FALLBACK_POWER_ITERS = 5


@dataclass
class _BatchedFit:
    """One boundary's batched fit: the gate and, detached, the partition and statuses it ends with
    (``[G, s]`` / ``[G]``, ``G = b * h_kv``), from which the next boundary starts warm."""

    alpha: torch.Tensor
    active: torch.Tensor
    counts: dict[str, int]
    margin: torch.Tensor
    error: torch.Tensor
    status: torch.Tensor
    fit_counts: dict[str, int]

    @property
    def partition(self) -> Partition:
        return self.margin, self.error, self.status, self.alpha.detach().reshape(self.margin.shape)


def _cached_partition(cache: GateCache | None, s: int, G: int) -> Partition | None:
    """The partition of the largest boundary ``< s`` held by ``cache`` for ``G`` problems (a warm start
    only: a stale one costs active-set steps, never accuracy, as the result is checked), or None."""
    if cache is None:
        return None
    olds = [t for t, part in cache.partition.items() if t < s and part[0].shape[0] == G]
    return cache.partition[max(olds)] if olds else None


def _solve_defaults(solve_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of the layer's :func:`solve_batched` calls (the cold path)."""
    return {**LAYER_SOLVE_DEFAULTS, "check_inputs": False, **solve_kwargs}


def _fit_cold(gram: torch.Tensor, mask: torch.Tensor, C: float, kwargs: dict[str, Any]) -> Any:
    from sv_attention.svdd.batched import solve_batched

    return solve_batched(gram, mask, C, **kwargs)


def _final_ridge(kwargs: dict[str, Any]) -> float:
    """Ridge of the cold path's differentiable solve (``solve_kwargs["ridge"]`` or solve_batched's default)."""
    import inspect

    from sv_attention.svdd.batched import solve_batched

    return float(kwargs.get("ridge", inspect.signature(solve_batched).parameters["ridge"].default))


def _fit_warm_rows(gram: torch.Tensor, mask: torch.Tensor, margin0: torch.Tensor, error0: torch.Tensor, C: float,
                   kwargs: dict[str, Any]) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Warm fit of problems ``gram [G, n, n]`` from a starting partition (the previous boundary's, padded).

    The partition comes from :func:`~sv_attention.svdd.warm_fit.warm_partition` (no grad); the gate is
    then the cold path's final solve on it: the bordered system of the gram with masked entries zeroed,
    ridge ``kwargs["ridge"]`` (differentiable). Returns ``(solve, margin, error, settled [G])``; only the
    settled problems are usable.
    """
    from sv_attention.svdd.polish import fixed_partition_solve
    from sv_attention.svdd.warm_fit import warm_partition

    G = gram.shape[0]
    Ct = torch.full((G,), float(C), dtype=gram.dtype, device=gram.device)
    with torch.profiler.record_function("sv.polish"):
        wp = warm_partition(gram, mask, margin0, error0, Ct, tol=kwargs.get("tol"))
    if not bool(mask.all()):
        gram = torch.where(mask[:, :, None] & mask[:, None, :], gram, torch.zeros((), dtype=gram.dtype,
                                                                                     device=gram.device))
    with torch.profiler.record_function("sv.solve"):
        sol = fixed_partition_solve(gram, mask, wp.margin, wp.error, Ct, _final_ridge(kwargs))
    return sol, wp.margin, wp.error, wp.settled


def _fit_batched(gram: torch.Tensor, key_valid: torch.Tensor, s: int, C: float, solve_kwargs: dict[str, Any],
                 prev: Partition | None = None) -> _BatchedFit:
    """Solve the boundary-``s`` problems of every (batch, kv-head), given the Gram of a prefix ``>= s`` (its
    leading ``s x s`` block is the Gram of the keys ``[0, s)``).

    Cold (``prev`` None, or problems whose previous fit was not ``"ok"``): one :func:`solve_batched` call
    for the boundary (counted as ``cold``). Warm (:data:`WARM_START`, ``prev`` the :data:`Partition` of an
    earlier boundary ``s' < s``): the partition is found by active-set steps from ``prev``'s with the new
    keys in reserve (:func:`_fit_warm_rows`), then the same ridged differentiable solve as the cold path,
    so the gate (and its gradient) equals the cold one to solver tolerance (counted as ``warm``). Problems
    whose partition does not settle go to :func:`solve_batched` started from the previous gate
    (:data:`WARM_FALLBACK_FISTA_ITERS`; counted as ``warm_fallback``), and those it leaves unconverged
    to the cold call (``warm_fallback_cold``): no gate comes from an unconverged warm iterate.

    One call per boundary rather than all boundaries packed into one: packing pads every problem to the
    largest prefix, and measured here (``sv-attention bench step``) the padded solve was 3-10x slower
    than the separate ones, because its element-wise operations cross torch's parallel grain size and
    pay for thread synchronisation on a shared CPU.
    """
    from sv_attention.svdd.batched import (
        STATUS_EMPTY_MARGIN,
        STATUS_NAMES,
        STATUS_OK,
        STATUS_SOLVE_FALLBACK,
        STATUS_WARMUP,
    )
    from sv_attention.svdd.warm_fit import extend_partition

    b, hk = key_valid.shape[:2]
    G = b * hk
    mask = key_valid[:, :, :s].reshape(G, s)
    block = gram[:, :s, :s]
    kwargs = _solve_defaults(solve_kwargs)
    dev = gram.device
    warm_rows = torch.zeros(G, dtype=torch.bool, device=dev)
    if WARM_START and prev is not None and "init_alpha" not in kwargs:
        # out of warm-up (hence feasible) now: a cached partition may come from another sequence
        warm_rows = (prev[2] == STATUS_OK) & (mask.sum(-1) >= warmup_size(C))
    fit_counts: dict[str, int] = {}
    if not bool(warm_rows.any()):
        sol = _fit_cold(block, mask, C, kwargs)
        fit_counts["cold"] = G
        alpha, status, margin, error, counts = sol.alpha, sol.status, sol.margin, sol.error, dict(sol.counts)
    else:
        iw = warm_rows.nonzero().flatten()
        every = len(iw) == G
        m0, e0 = extend_partition(prev[0], prev[1], s)

        def rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
            return t if len(idx) == G else t[idx]

        wsol, wm, we, settled = _fit_warm_rows(rows(block, iw), rows(mask, iw), rows(m0, iw), rows(e0, iw), C,
                                               kwargs)
        wstatus = torch.full((len(iw),), STATUS_OK, dtype=torch.int8, device=dev)
        wstatus = torch.where(~wsol.ok, torch.full_like(wstatus, STATUS_SOLVE_FALLBACK), wstatus)
        wstatus = torch.where(wsol.empty, torch.full_like(wstatus, STATUS_EMPTY_MARGIN), wstatus)
        fit_counts["warm"] = int(settled.sum())
        if every and bool(settled.all()):
            alpha, status, margin, error = wsol.alpha, wstatus, wm, we
        else:
            # (rows, alpha, status, margin, error) of each group of problems
            parts = [(iw[settled], wsol.alpha[settled], wstatus[settled], wm[settled], we[settled])]
            cold_rows = ~warm_rows
            fb = iw[~settled]
            if len(fb):
                a0 = F.pad(prev[3][fb], (0, s - prev[3].shape[-1]))
                fsol = _fit_cold(block[fb], mask[fb], C, {**kwargs, "init_alpha": a0,
                                                           "fista_iters": WARM_FALLBACK_FISTA_ITERS,
                                                           "power_iters": WARM_FALLBACK_POWER_ITERS})
                good = fsol.status == STATUS_OK
                parts.append((fb[good], fsol.alpha[good], fsol.status[good], fsol.margin[good], fsol.error[good]))
                cold_rows[fb[~good]] = True
                fit_counts["warm_fallback"] = len(fb)
                fit_counts["warm_fallback_cold"] = int((~good).sum())
            ic = cold_rows.nonzero().flatten()
            if len(ic):
                csol = _fit_cold(block[ic], mask[ic], C, kwargs)
                parts.append((ic, csol.alpha, csol.status, csol.margin, csol.error))
            fit_counts["cold"] = int((~warm_rows).sum())
            alpha = torch.zeros(G, s, dtype=gram.dtype, device=dev)
            status = torch.empty(G, dtype=torch.int8, device=dev)
            margin = torch.zeros(G, s, dtype=torch.bool, device=dev)
            error = torch.zeros(G, s, dtype=torch.bool, device=dev)
            for idx, pa, ps, pm, pe in parts:
                alpha = alpha.index_copy(0, idx, pa)
                status, margin, error = status.index_copy(0, idx, ps), margin.index_copy(0, idx, pm), \
                    error.index_copy(0, idx, pe)
        counts = {name: int((status == code).sum()) for code, name in STATUS_NAMES.items()}
    fit_counts = {key: val for key, val in fit_counts.items() if val}
    _accumulate(FIT_STATS, fit_counts)
    active = (status == STATUS_OK) | (status > STATUS_WARMUP + 1)  # ok, or solved with a caveat
    return _BatchedFit(alpha=alpha.reshape(b, hk, s), active=active.reshape(b, hk), counts=counts,
                       margin=margin.detach(), error=error.detach(), status=status, fit_counts=fit_counts)


def _fit_exact(k: torch.Tensor, key_valid: torch.Tensor, s: int, C: float, sigma: torch.Tensor,
               cache: GateCache) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
    """Stream keys ``[ingested, s)`` into the fp64 maintained solvers; read alpha over ``[0, s)``."""
    from sv_attention.svdd import IncrementalSVDD

    b, hk = k.shape[:2]
    if cache.exact_solvers is None:
        cache.exact_solvers = [IncrementalSVDD(C, float(sigma[i // hk, i % hk])) for i in range(b * hk)]
        cache.exact_ingested = 0
    lo = cache.exact_ingested
    if s < lo:
        raise InvalidInputError(f"exact gate asked for boundary {s} after {lo} keys were streamed; "
                                "reset the GateCache for a new sequence")
    kd = k.detach().to(torch.float64).cpu()
    valid = key_valid.cpu()
    alpha = torch.zeros(b, hk, s, dtype=k.dtype, device=k.device)
    active = torch.zeros(b, hk, dtype=torch.bool, device=k.device)
    counts = {"ok": 0, "warm-up": 0}
    ws = warmup_size(C)
    for i, solver in enumerate(cache.exact_solvers):
        bi, hi = divmod(i, hk)
        pos = [p for p in range(lo, s) if bool(valid[bi, hi, p])]
        if pos:
            solver.add(kd[bi, hi, pos].numpy(), ids=pos)
        if solver.n >= ws and solver.has_solution:
            ids = torch.as_tensor(solver.ids, dtype=torch.long)
            alpha[bi, hi, ids] = torch.as_tensor(solver.alpha, dtype=k.dtype, device=k.device)
            active[bi, hi] = True
            counts["ok"] += 1
        else:
            counts["warm-up"] += 1
    cache.exact_ingested = s
    return alpha, active, counts


def compute_boundary_gates(k: torch.Tensor, boundaries: list[int], *, C: float,
                           sigma: float | torch.Tensor | None = None, chunk: int = 64,
                           key_valid: torch.Tensor | None = None, solver: str = "batched", detach: bool = True,
                           cache: GateCache | None = None, solve_kwargs: dict[str, Any] | None = None,
                           ) -> BoundaryGates:
    """Fit (or fetch from ``cache``) the SVDD gate of every boundary ``s`` on the keys ``[0, s)``.

    Parameters
    ----------
    k : Tensor ``[b, h_kv, kv_len, d]``  keys (finite)
    boundaries : list of int  chunk boundaries ``0 < s <= kv_len``
    C : float  box (fixed)
    sigma : float, 0-d / ``[b, h_kv]`` Tensor or None (default None: frozen median of the first chunk)
    chunk : int, default 64  (only used for the frozen bandwidth)
    key_valid : bool Tensor ``[b, h_kv, kv_len]`` or None (all valid)
    solver : {"batched", "exact"}, default "batched"
    detach : bool, default True  fit on detached keys (no gradient through the solver)
    cache : GateCache or None  memo of fitted boundaries (required for ``solver="exact"`` streaming;
        a private one is used when None)
    solve_kwargs : dict or None  extra keyword arguments of :func:`solve_batched` (e.g. ``backend``)

    Returns
    -------
    BoundaryGates
    """
    if solver not in SOLVERS:
        raise InvalidHyperparameterError(f"solver must be one of {SOLVERS}, got {solver!r}")
    b, hk, kv_len, _ = k.shape
    if key_valid is None:
        key_valid = torch.ones(b, hk, kv_len, dtype=torch.bool, device=k.device)
    if solver == "exact" and cache is None:
        cache = GateCache()
    sig = _sigma_tensor(sigma, k, key_valid, chunk, cache)
    solve_kwargs = dict(solve_kwargs or {})
    ws = warmup_size(C)
    alpha: dict[int, torch.Tensor] = {}
    active: dict[int, torch.Tensor] = {}
    counts: dict[str, int] = {}
    fit_counts: dict[str, int] = {}
    todo = sorted(set(int(x) for x in boundaries))
    fits: list[tuple[int, Any]] = []  # (s, fingerprint) of the boundaries that need fitting
    for s in todo:
        if not 0 < s <= kv_len:
            raise InvalidInputError(f"boundary {s} outside (0, kv_len={kv_len}]")
        fp = _fingerprint(k[:, :, :s]) if cache is not None else None
        if cache is not None and s in cache.alpha and cache.alpha[s].shape[:2] == (b, hk):
            if _fingerprint_matches(cache.fingerprint[s], fp) and (detach or solver == "exact"):
                alpha[s], active[s] = cache.alpha[s], cache.active[s]
                cache.hits += 1
                continue
            cache.invalidations += 1
        fits.append((s, fp))
    results: dict[int, tuple[torch.Tensor, torch.Tensor, dict[str, int]]] = {}
    if solver == "exact":
        for s, _ in fits:
            results[s] = _fit_exact(k, key_valid, s, C, sig, cache)
    else:
        live = [s for s, _ in fits if bool((key_valid[:, :, :s].sum(-1) >= ws).any())]
        for s, _ in fits:
            if s not in live:  # every problem of this boundary is in warm-up: nothing to solve
                results[s] = (torch.zeros(b, hk, s, dtype=k.dtype, device=k.device),
                              torch.zeros(b, hk, dtype=torch.bool, device=k.device), {"warm-up": b * hk})
        if live:
            gram = _gram(k, live[-1], sig, detach)  # one Gram; each boundary uses its leading block
            prev = _cached_partition(cache, live[0], b * hk)  # warm start of the first (decoding)
            for s in live:
                fit = _fit_batched(gram, key_valid, s, C, solve_kwargs, prev)
                results[s] = (fit.alpha, fit.active, fit.counts)
                _accumulate(fit_counts, fit.fit_counts)
                if cache is not None:
                    cache.partition[s] = fit.partition
                    _accumulate(cache.fit_counts, fit.fit_counts)
                prev = fit.partition
    for s, fp in fits:
        a, act, new_counts = results[s]
        act = act & (key_valid[:, :, :s].sum(-1) >= ws)
        alpha[s], active[s] = a, act
        _accumulate(counts, new_counts)
        if cache is not None:
            cache.misses += 1
            cache.alpha[s] = a.detach() if detach else a
            cache.active[s] = act
            cache.fingerprint[s] = fp
            _accumulate(cache.status_counts, new_counts)
    # "empty margin" (every support key at the bound C, rho from its KKT interval) is an exact optimum, counted
    # in status_counts but not warned about; a solve fallback or a non-converged polish is
    bad = {key: v for key, v in counts.items() if key in ("solve fallback", "not converged") and v}
    if bad:
        warnings.warn(f"SV gate: some batched solves carry a caveat {bad}; their best partition is used",
                      RuntimeWarning, stacklevel=2)
    return BoundaryGates(alpha=alpha, active=active, sigma=sig, status_counts=counts, fit_counts=fit_counts)


# ----------------------------------------------------------------------------- the functional layer
def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, C: float, chunk: int,
                  gate_floor: float, readout: str, solver: str) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise InvalidInputError(f"q, k, v must be 4-D [b, heads, seq, d]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                                f"{tuple(v.shape)}")
    b, h, q_len, d = q.shape
    if k.shape[0] != b or v.shape[0] != b or k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2] \
            or k.shape[3] != d:
        raise InvalidInputError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if h % k.shape[1] != 0:
        raise InvalidInputError(f"query heads ({h}) must be a multiple of kv heads ({k.shape[1]})")
    if q_len > k.shape[2]:
        raise InvalidInputError(f"q_len={q_len} exceeds kv_len={k.shape[2]}: queries must be the last positions")
    if not bool(torch.isfinite(k).all()) or not bool(torch.isfinite(q).all()):
        raise InvalidInputError("non-finite queries or keys; check the projections / inputs")
    if isinstance(chunk, bool) or int(chunk) != chunk or chunk <= 0:
        raise InvalidHyperparameterError(f"chunk must be a positive integer, got {chunk!r}")
    if not (isinstance(C, (int, float)) and math.isfinite(C) and C > 0):
        raise InvalidHyperparameterError(f"C must be a finite float > 0, got {C!r}")
    if not 0.0 <= gate_floor <= 1.0:
        raise InvalidHyperparameterError(f"gate_floor must be in [0, 1], got {gate_floor}")
    if readout not in READOUTS:
        raise InvalidHyperparameterError(f"readout must be one of {READOUTS}, got {readout!r}")
    if solver not in SOLVERS:
        raise InvalidHyperparameterError(f"solver must be one of {SOLVERS}, got {solver!r}")


def gate_matrix(gates: BoundaryGates, q_pos: torch.Tensor, kv_len: int, chunk: int, causal: bool,
                gate_floor: float) -> torch.Tensor:
    """Multiplicative gate ``W [b, h_kv, q_len, kv_len]``: ``max(alpha^{(s)}_j, gate_floor)`` on the
    prefix ``j < s`` of an active boundary ``s``, 1 elsewhere (local window, chunk 0, warm-up)."""
    any_alpha = next(iter(gates.alpha.values()), None)
    b, hk = gates.sigma.shape
    dt = any_alpha.dtype if any_alpha is not None else gates.sigma.dtype
    dev = gates.sigma.device
    rows = []
    starts = (q_pos // chunk) * chunk if causal else torch.full_like(q_pos, kv_len)
    r0 = 0
    n = q_pos.shape[0]
    while r0 < n:
        s = int(starts[r0])
        r1 = r0 + 1
        while r1 < n and int(starts[r1]) == s:
            r1 += 1
        if s == 0 or s not in gates.alpha:
            rows.append(torch.ones(b, hk, r1 - r0, kv_len, dtype=dt, device=dev))
        else:
            a = gates.alpha[s]
            if gate_floor > 0:
                a = a.clamp_min(gate_floor)
            act = gates.active[s][:, :, None]
            pre = torch.where(act, a, torch.ones_like(a))
            block = torch.cat([pre, torch.ones(b, hk, kv_len - s, dtype=dt, device=dev)], dim=-1)
            rows.append(block[:, :, None, :].expand(b, hk, r1 - r0, kv_len))
        r0 = r1
    return torch.cat(rows, dim=2)


def sv_hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, C: float,
                        sigma: float | torch.Tensor | None = None, chunk: int = 64,
                        mask: torch.Tensor | None = None, scaling: float | None = None, causal: bool = True,
                        solver: str = "batched", readout: str = "softmax", gate_floor: float = 0.0,
                        detach_gate: bool = True, gate_cache: GateCache | None = None,
                        return_weights: bool = False, solve_kwargs: dict[str, Any] | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunk-frozen hybrid SV attention core on projected ``q, k, v`` (queries = last positions).

    Parameters
    ----------
    q : Tensor ``[b, h, q_len, d]``  queries at absolute positions ``kv_len - q_len .. kv_len - 1``
    k, v : Tensor ``[b, h_kv, kv_len, d]``  (``h % h_kv == 0``; one gate per kv-head)
    C : float  box of the SVDD gate (fixed; ``C = 1/(nu n0)`` via :func:`c_from_nu`)
    sigma : float, Tensor or None, default None  RBF bandwidth (None: frozen median of the first chunk)
    chunk : int, default 64  chunk length of the chunk-frozen gate
    mask : Tensor or None, default None  bool (True = attend) broadcastable to ``[b, 1|h, q_len, kv_len]``
        (or anything :func:`sv_attention.ops.masking.to_bool_mask` accepts); None = causal only. With
        ``causal=True`` it is AND-ed with the causal mask. Keys no query attends are left out of the
        SVDD problems (padding).
    scaling : float or None, default None (``1/sqrt(d)``)  softmax logit scale
    causal : bool, default True  False: one gate on all keys, no local window (see module docstring)
    solver : {"batched", "exact"}, default "batched"
    readout : {"softmax", "rbf"}, default "softmax"  (rbf uses the gate's bandwidth per kv-head)
    gate_floor : float, default 0.0  the prefix weight is ``max(alpha_j, gate_floor)``
    detach_gate : bool, default True  no gradient through the gate (as published); False
        differentiates through the ridged bordered solve (batched solver only)
    gate_cache : GateCache or None  memoises per-boundary gates across calls (decoding)
    return_weights : bool, default False  also return the attention weights ``[b, h, q_len, kv_len]``
    solve_kwargs : dict or None  forwarded to :func:`sv_attention.svdd.batched.solve_batched` (on top of
        :data:`LAYER_SOLVE_DEFAULTS`)

    Returns
    -------
    (out ``[b, h, q_len, d_v]``, weights or None)

    Raises
    ------
    InvalidInputError  wrong shapes, non-finite q / k, q_len > kv_len
    InvalidHyperparameterError  chunk <= 0, C <= 0, gate_floor outside [0, 1], unknown solver / readout
    """
    _check_inputs(q, k, v, C, chunk, gate_floor, readout, solver)
    if solver == "exact" and not detach_gate:
        raise InvalidHyperparameterError("the exact solver is not differentiable: use detach_gate=True or "
                                         "solver='batched'")
    b, h, q_len, _ = q.shape
    hk, kv_len = k.shape[1], k.shape[2]
    group = h // hk
    bmask = to_bool_mask(mask, q_len, kv_len) if mask is not None else None
    if bmask is not None:
        bmask = bmask.to(q.device)
    if causal:
        cm = causal_mask(q_len, kv_len, q.device)[None, None]
        vis = cm if bmask is None else (bmask & cm)
    else:
        vis = bmask
    # Key validity per (batch, kv-head): attended by some query of some head of the group.
    if bmask is None:
        key_valid = torch.ones(b, hk, kv_len, dtype=torch.bool, device=q.device)
    else:
        kvm = bmask.expand(b, bmask.shape[1], q_len, kv_len).any(-2)  # [b, 1|h, kv]
        if kvm.shape[1] == 1:
            key_valid = kvm.expand(b, hk, kv_len)
        else:
            key_valid = kvm.reshape(b, hk, group, kv_len).any(2)
    q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
    if causal:
        boundaries = sorted({int(s) for s in ((q_pos // chunk) * chunk).tolist() if s > 0})
    else:
        boundaries = [kv_len]
    with torch.profiler.record_function("sv.gate"):
        gates = compute_boundary_gates(k, boundaries, C=C, sigma=sigma, chunk=chunk, key_valid=key_valid,
                                       solver=solver, detach=detach_gate, cache=gate_cache,
                                       solve_kwargs=solve_kwargs)
        W = gate_matrix(gates, q_pos, kv_len, chunk, causal, gate_floor).to(q.dtype)
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        W = W.repeat_interleave(group, dim=1)
    with torch.profiler.record_function("sv.readout"):
        if readout == "softmax":
            return softmax_hybrid_readout(q, k, v, W, vis, scaling, return_weights)
        sig = gates.sigma.to(q.dtype)
        if group > 1:
            sig = sig.repeat_interleave(group, dim=1)
        return rbf_readout(q, k, v, W, sig, vis, return_weights)


def sv_hybrid_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alpha_of: dict[int, torch.Tensor],
                        active_of: dict[int, torch.Tensor], *, chunk: int, scaling: float | None = None,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-loop reference of the chunk-frozen softmax-hybrid formula given the boundary gates.

    For every (batch, head, query position t): s = chunk * (t // chunk); weights over j <= t (and the
    mask) are ``exp(scale q.k_j)`` times ``alpha^{(s)}_j`` for ``j < s`` when that boundary is active,
    1 otherwise; normalised; values summed. ``[b, h, q_len, d_v]``.
    """
    b, h, q_len, d = q.shape
    hk, kv_len = k.shape[1], k.shape[2]
    group = h // hk
    sc = d ** -0.5 if scaling is None else scaling
    out = torch.zeros(b, h, q_len, v.shape[-1], dtype=v.dtype)
    for bi in range(b):
        for hi in range(h):
            g = hi // group
            for i in range(q_len):
                t = kv_len - q_len + i
                s = chunk * (t // chunk)
                ws, vs = [], []
                for j in range(t + 1):
                    if mask is not None and not bool(mask.expand(b, h, q_len, kv_len)[bi, hi, i, j]):
                        continue
                    gate = 1.0
                    if s > 0 and j < s and s in alpha_of and bool(active_of[s][bi, g]):
                        gate = float(alpha_of[s][bi, g, j])
                    if gate <= 0:
                        continue
                    ws.append(math.exp(float((q[bi, hi, i] * k[bi, g, j]).sum()) * sc) * gate)
                    vs.append(v[bi, g, j])
                if ws:
                    tot = sum(ws)
                    out[bi, hi, i] = sum(w / tot * vv for w, vv in zip(ws, vs))
    return out


# ----------------------------------------------------------------------------- the module
class CausalSVAttention(nn.Module):
    """Multi-head causal hybrid SV-Attention (q/k/v/o projections + :func:`sv_hybrid_attention`).

    Parameters
    ----------
    d_model : int
    n_heads : int  (``d_model % n_heads == 0``)
    C : float or None, default None  box of the gate; if None, ``C = 1/(nu * n0)``
    nu : float or None, default None  (None: 0.5 when C is None)
    n0 : int or None, default None  reference size of the nu calibration (None: ``chunk``)
    sigma : float or None, default None  RBF bandwidth (None: frozen median of the first chunk)
    chunk : int, default 64
    solver : {"batched", "exact"}, default "batched"  (exact: fp64 maintained solvers, no gradient)
    readout : {"softmax", "rbf"}, default "softmax"
    gate_floor : float, default 0.0
    detach_gate : bool, default True  no gradient through the gate's solver (as published); the keys
        still get gradient through the readout. False differentiates through the ridged solve.
    bias : bool, default False  biases of the projections
    solve_kwargs : dict or None  forwarded to :func:`solve_batched` (e.g. ``{"backend": "torch"}``)

    Raises
    ------
    InvalidHyperparameterError  bad sizes or ranges
    InfeasibleBoxError  ``chunk * C < 1``: the first chunk boundary could never hold a feasible gate
    """

    def __init__(self, d_model: int, n_heads: int, *, C: float | None = None, nu: float | None = None,
                 n0: int | None = None, sigma: float | None = None, chunk: int = 64, solver: str = "batched",
                 readout: str = "softmax", gate_floor: float = 0.0, detach_gate: bool = True, bias: bool = False,
                 solve_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__()
        if d_model <= 0 or n_heads <= 0 or d_model % n_heads != 0:
            raise InvalidHyperparameterError(f"d_model ({d_model}) must be a positive multiple of n_heads ({n_heads})")
        if isinstance(chunk, bool) or int(chunk) != chunk or chunk <= 0:
            raise InvalidHyperparameterError(f"chunk must be a positive integer, got {chunk!r}")
        if C is not None and nu is not None:
            raise InvalidHyperparameterError("give C or nu, not both (C is the primitive; nu calibrates it once)")
        if C is None:
            nu = 0.5 if nu is None else nu
            n0 = chunk if n0 is None else n0
            C = c_from_nu(nu, n0)
        if not (math.isfinite(C) and C > 0):
            raise InvalidHyperparameterError(f"C must be finite and > 0, got {C}")
        if chunk * C < 1:
            raise InfeasibleBoxError(f"chunk={chunk} keys with C={C:.4g} give chunk*C={chunk * C:.4g} < 1: the gate "
                                     "at the first boundary is infeasible; raise C, or use a longer chunk, or "
                                     "calibrate with nu and n0 <= chunk")
        if sigma is not None and not (math.isfinite(sigma) and sigma > 0):
            raise InvalidHyperparameterError(f"sigma must be finite and > 0, got {sigma}")
        if solver not in SOLVERS or readout not in READOUTS:
            raise InvalidHyperparameterError(f"solver in {SOLVERS}, readout in {READOUTS}; got {solver!r}, {readout!r}")
        if not 0.0 <= gate_floor <= 1.0:
            raise InvalidHyperparameterError(f"gate_floor must be in [0, 1], got {gate_floor}")
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, d_model // n_heads
        self.C, self.nu, self.n0, self.sigma, self.chunk = float(C), nu, n0, sigma, int(chunk)
        self.solver, self.readout, self.gate_floor, self.detach_gate = solver, readout, gate_floor, detach_gate
        self.solve_kwargs = dict(solve_kwargs or {})
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, d_model, bias=bias)
        self.v_proj = nn.Linear(d_model, d_model, bias=bias)
        self.o_proj = nn.Linear(d_model, d_model, bias=bias)
        self.last_status_counts: dict[str, int] = {}
        #: :attr:`GateCache.fit_counts` of the last forward (problems fitted cold / warm / warm_fallback)
        self.last_fit_counts: dict[str, int] = {}

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, C={self.C:.4g}, chunk={self.chunk}, "
                f"solver={self.solver!r}, readout={self.readout!r}, gate_floor={self.gate_floor}, "
                f"detach_gate={self.detach_gate}")

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                gate_cache: GateCache | None = None) -> torch.Tensor:
        """``x [b, s, d_model]`` -> ``[b, s, d_model]``.

        ``attention_mask``: None (causal), a 2-D ``[b, s]`` padding mask (True / 1 = real token) or a
        4-D mask accepted by :func:`to_bool_mask`. ``gate_cache``: optional memo (see :class:`GateCache`).
        """
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise InvalidInputError(f"x must be [batch, seq, d_model={self.d_model}], got {tuple(x.shape)}")
        if not bool(torch.isfinite(x).all()):
            raise InvalidInputError("x has non-finite entries")
        b, s, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        mask = to_bool_mask(attention_mask, s, s) if attention_mask is not None else None
        # A fresh per-call cache when none is given: it records the solve status counts of this call.
        cache = gate_cache if gate_cache is not None else GateCache()
        gates_counts: dict[str, int] = {}
        out, _ = sv_hybrid_attention(q, k, v, C=self.C, sigma=self.sigma, chunk=self.chunk, mask=mask,
                                     solver=self.solver, readout=self.readout, gate_floor=self.gate_floor,
                                     detach_gate=self.detach_gate, gate_cache=cache,
                                     solve_kwargs=self.solve_kwargs)
        gates_counts = dict(cache.status_counts)
        self.last_status_counts = gates_counts
        self.last_fit_counts = dict(cache.fit_counts)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.d_model))
