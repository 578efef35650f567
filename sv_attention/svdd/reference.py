"""From-scratch reference solve of the SVDD dual (the "retrain without" baseline).

    min_alpha  alpha^T K alpha - diag(K)^T alpha   s.t.  sum(alpha) = 1,  0 <= alpha <= C

Algorithm (independent of the incremental Cauwenberghs–Poggio walk in :mod:`.exact`): sequential
minimal optimisation with second-order working-set selection (as in LIBSVM) from the uniform feasible
point ``alpha = 1/n`` down to a maximal KKT violation of ``1e-13``, then an exact *polish*: the
bordered KKT system of the identified partition is solved directly, and kept when it satisfies every
KKT condition (it then is the optimum to rounding). Degenerate problems (duplicate keys) are handled
by SMO itself; the polish uses a least-squares solve.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from sv_attention.errors import InfeasibleBoxError, InvalidHyperparameterError, InvalidInputError
from sv_attention.svdd.blas import one_blas_thread
from sv_attention.svdd.readapi import ReadAPI, as_float64_matrix, sq_dists
from sv_attention.svdd.receipts import ERROR, MARGIN, RESERVE, KKTResiduals, Partition, kkt_residuals

BOUND_TOL = 1e-12


def check_hyper(C: float, sigma: float) -> tuple[float, float]:
    """Validate ``C > 0`` and ``sigma > 0`` (finite); return them as floats."""
    try:
        C, sigma = float(C), float(sigma)
    except (TypeError, ValueError) as exc:
        raise InvalidHyperparameterError(f"C and sigma must be numbers, got C={C!r}, sigma={sigma!r}") from exc
    if not (np.isfinite(C) and C > 0):
        raise InvalidHyperparameterError(f"C must be finite and > 0, got {C}; e.g. C = 1/(nu*n0) with nu in (0, 1]")
    if not (np.isfinite(sigma) and sigma > 0):
        raise InvalidHyperparameterError(f"sigma must be finite and > 0, got {sigma}; pass a positive bandwidth")
    return C, sigma


def feasible(n: int, C: float) -> bool:
    """``n * C >= 1`` (with a relative tolerance of 1e-12)."""
    return n * C >= 1.0 - 1e-12


def rbf_gram_np(X: np.ndarray, sigma: float) -> np.ndarray:
    """RBF Gram ``exp(-||x_i - x_j||^2 / sigma^2)`` by differences, float64 ``[n, n]``, diagonal exactly 1."""
    K = np.exp(-sq_dists(X, X) / (sigma * sigma))
    np.fill_diagonal(K, 1.0)
    return K


def rho_interval(alpha: np.ndarray, h: np.ndarray, C: float) -> tuple[float, float]:
    """The offsets rho that satisfy the KKT conditions with ``g = rho + h`` (``h = 2 K alpha - diag K``).

    ``g_i >= 0`` where ``alpha_i < C`` and ``g_i <= 0`` where ``alpha_i > 0`` give ``[lo, hi]``. At an
    optimum with a key strictly inside the box the interval is a point; otherwise rho is not unique.
    The interval is the same for every optimal alpha (the dual optimal set), so its midpoint is a
    canonical rho shared by the maintained solver and the reference.
    """
    below = alpha < C * (1.0 - BOUND_TOL)
    above = alpha > C * BOUND_TOL
    lo = float((-h[below]).max()) if below.any() else -np.inf
    hi = float((-h[above]).min()) if above.any() else np.inf
    return lo, hi


def canonical_rho(alpha: np.ndarray, h: np.ndarray, C: float) -> float:
    """Midpoint of :func:`rho_interval` (its finite end when the other is infinite)."""
    lo, hi = rho_interval(alpha, h, C)
    if not np.isfinite(lo):
        return hi if np.isfinite(hi) else 0.0
    if not np.isfinite(hi):
        return lo
    return 0.5 * (lo + hi)


DEGENERATE_GAP = 1e-10  # rho interval wider than this: no key strictly inside the box, rho not unique


def polish(K: np.ndarray, C: float, status: np.ndarray) -> tuple[np.ndarray, float]:
    """Solve the bordered KKT system of a fixed partition.

    Returns ``alpha [n]`` and ``rho`` (least squares when the margin block is singular).
    """
    n = K.shape[0]
    s = np.flatnonzero(status == MARGIN)
    e = np.flatnonzero(status == ERROR)
    alpha = np.zeros(n)
    alpha[e] = C
    diag = np.diag(K)
    if s.size == 0:
        h = 2.0 * K @ alpha - diag
        return alpha, canonical_rho(alpha, h, C)
    M = np.zeros((s.size + 1, s.size + 1))
    M[0, 1:] = 1.0
    M[1:, 0] = 1.0
    M[1:, 1:] = 2.0 * K[np.ix_(s, s)]
    c = np.empty(s.size + 1)
    c[0] = 1.0 - e.size * C
    c[1:] = diag[s] - 2.0 * C * K[np.ix_(s, e)].sum(axis=1)
    x = np.linalg.lstsq(M, c, rcond=1e-14)[0]
    alpha[s] = x[1:]
    return alpha, float(x[0])


def smo(K: np.ndarray, C: float, tol: float = 1e-13, max_iter: int | None = None) -> tuple[np.ndarray, int]:
    """SMO with second-order working-set selection; returns ``alpha [n]`` and the iteration count."""
    n = K.shape[0]
    diag = np.diag(K).copy()
    alpha = np.full(n, 1.0 / n)
    grad = 2.0 * K @ alpha - diag  # d objective / d alpha
    max_iter = max_iter if max_iter is not None else 200 * n + 1000
    it = 0
    for it in range(1, max_iter + 1):  # noqa: B007 - the count is returned
        up = alpha < C - BOUND_TOL * C
        down = alpha > BOUND_TOL * C
        if not up.any() or not down.any():
            break
        gu = np.where(up, grad, np.inf)
        i = int(np.argmin(gu))
        gi = gu[i]
        gd = np.where(down, grad, -np.inf)
        if gd.max() - gi <= tol:
            # refresh the (incrementally updated) gradient before declaring convergence
            grad = 2.0 * K @ alpha - diag
            gu = np.where(up, grad, np.inf)
            i = int(np.argmin(gu))
            gi = gu[i]
            gd = np.where(down, grad, -np.inf)
            if gd.max() - gi <= tol:
                break
        eta = np.maximum(2.0 * (diag[i] + diag - 2.0 * K[i]), 1e-15)
        viol = gd - gi
        score = np.where(viol > 0, viol * viol / eta, -np.inf)
        j = int(np.argmax(score))
        if not np.isfinite(score[j]):
            break
        # move delta from j to i
        delta = (grad[j] - grad[i]) / eta[j]
        delta = min(delta, C - alpha[i], alpha[j])
        if delta <= 0:
            break
        alpha[i] += delta
        alpha[j] -= delta
        grad += 2.0 * delta * (K[:, i] - K[:, j])
        if it % 200 == 0:
            grad = 2.0 * K @ alpha - diag
    # snap to exact bounds
    alpha[alpha <= BOUND_TOL * C] = 0.0
    alpha[alpha >= C - BOUND_TOL * C] = C
    alpha /= alpha.sum() if abs(alpha.sum() - 1.0) > 1e-15 else 1.0
    return alpha, it


def classify(alpha: np.ndarray, C: float) -> np.ndarray:
    """Status codes from coefficient values (exact bounds -> E / R, interior -> S)."""
    st = np.full(alpha.shape, MARGIN, dtype=np.int8)
    st[alpha <= 0.0] = RESERVE
    st[alpha >= C] = ERROR
    return st


def solve_dual(K: np.ndarray, C: float) -> tuple[np.ndarray, float, np.ndarray, int]:
    """From-scratch solve on a Gram matrix.

    Parameters
    ----------
    K : float64 ``[n, n]`` Gram (symmetric PSD)
    C : box, with ``n * C >= 1``

    Returns
    -------
    alpha ``[n]``, rho, status ``[n]`` (RESERVE / MARGIN / ERROR codes), SMO iterations.
    """
    n = K.shape[0]
    if not feasible(n, C):
        raise InfeasibleBoxError(f"{n} keys with C={C} give n*C={n * C:.6g} < 1: infeasible; "
                                 f"add keys or use a larger C (need n >= {int(np.ceil(1.0 / C - 1e-9))})")
    alpha, iters = smo(K, C)
    status = classify(alpha, C)
    diag = np.diag(K)
    # rho from the SMO solution: average over margin points
    a_p, rho_p = polish(K, C, status)
    g_p = rho_p - diag + 2.0 * K @ a_p
    res = kkt_residuals(a_p, g_p, status, C)
    s = status == MARGIN
    in_box = (not s.any()) or (a_p[s].min() >= -1e-12 and a_p[s].max() <= C * (1 + 1e-12))
    if in_box and res.max <= 1e-9:
        alpha, rho = a_p, rho_p
    else:
        # polish failed (degenerate margin block): keep the SMO point and its averaged rho
        h = 2.0 * K @ alpha - diag
        rho = float(-h[s].mean()) if s.any() else canonical_rho(alpha, h, C)
    # rho is not unique when no key is strictly inside the box: use the canonical midpoint
    h = 2.0 * K @ alpha - diag
    lo, hi = rho_interval(alpha, h, C)
    if hi - lo > DEGENERATE_GAP:
        rho = canonical_rho(alpha, h, C)
        m = status == MARGIN
        alpha[m & (alpha >= 0.5 * C)] = C
        alpha[m & (alpha < 0.5 * C)] = 0.0
        status = classify(alpha, C)
    return alpha, rho, status, iters


@dataclass(frozen=True)
class _Sol:
    ids: np.ndarray
    keys: np.ndarray
    alpha: np.ndarray
    rho: float
    status: np.ndarray


class SVDDSolution(ReadAPI):
    """A from-scratch SVDD solution with the same read API as the maintained solver.

    Attributes
    ----------
    ids : int64 ``[n]``; keys : float64 ``[n, d]``; alpha : float64 ``[n]`` aligned with ids
    rho : float; C, sigma : floats; partition : :class:`Partition`; kkt : :class:`KKTResiduals`
    iterations : SMO iterations; elapsed_s : wall time of the solve (Gram build included)
    """

    def __init__(self, ids: np.ndarray, keys: np.ndarray, alpha: np.ndarray, rho: float, status: np.ndarray,
                 C: float, sigma: float, kkt: KKTResiduals, iterations: int, elapsed_s: float) -> None:
        self.ids, self.keys, self.alpha, self.rho = ids, keys, alpha, float(rho)
        self.status, self.C, self.sigma = status, C, sigma
        self.kkt, self.iterations, self.elapsed_s = kkt, iterations, elapsed_s

    @property
    def partition(self) -> Partition:
        def pick(code: int) -> tuple[int, ...]:
            return tuple(int(i) for i in np.sort(self.ids[self.status == code]))

        return Partition(margin=pick(MARGIN), error=pick(ERROR), reserve=pick(RESERVE))

    def alpha_of(self, ids: Any) -> np.ndarray:
        """Coefficients of the given ids (0 for none of them is impossible: every id must be present)."""
        pos = {int(i): k for k, i in enumerate(self.ids)}
        return np.array([self.alpha[pos[int(i)]] for i in np.atleast_1d(ids)])

    def __repr__(self) -> str:
        return (f"SVDDSolution(n={len(self.ids)}, C={self.C:.6g}, sigma={self.sigma:.6g}, "
                f"partition={self.partition.sizes}, kkt_max={self.kkt.max:.2e})")


@one_blas_thread
def refit(keys: Any, C: float, sigma: float, ids: Any | None = None) -> SVDDSolution:
    """Solve the SVDD dual for ``keys`` from scratch (the "retrain without" reference).

    Parameters
    ----------
    keys : float64 ``[n, d]`` (numpy or torch), with ``n * C >= 1``
    C, sigma : box and RBF bandwidth (``k = exp(-||a-b||^2 / sigma^2)``)
    ids : optional int ``[n]`` ids to label the keys (default ``0..n-1``)

    Returns
    -------
    SVDDSolution with ``ids, alpha, rho, partition, decision_function, readout, kkt``.
    """
    t0 = time.perf_counter()
    C, sigma = check_hyper(C, sigma)
    X = as_float64_matrix(keys, "keys")
    n = X.shape[0]
    if ids is None:
        id_arr = np.arange(n, dtype=np.int64)
    else:
        id_arr = np.asarray(ids).reshape(-1)
        if id_arr.shape[0] != n or not np.issubdtype(id_arr.dtype, np.integer):
            raise InvalidInputError(f"ids must be {n} integers, got {id_arr.dtype} of shape {id_arr.shape}")
        if np.unique(id_arr).size != n:
            raise InvalidInputError("ids contain repeats; pass unique ids")
        id_arr = id_arr.astype(np.int64)
    K = rbf_gram_np(X, sigma)
    alpha, rho, status, iters = solve_dual(K, C)
    g = rho - 1.0 + 2.0 * K @ alpha
    kkt = kkt_residuals(alpha, g, status, C)
    return SVDDSolution(id_arr, X, alpha, rho, status, C, sigma, kkt, iters, time.perf_counter() - t0)
