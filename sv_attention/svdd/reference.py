"""From-scratch reference solve of the SVDD dual (the "retrain without" baseline).

    min_alpha  alpha^T K alpha - diag(K)^T alpha   s.t.  sum(alpha) = 1,  0 <= alpha <= C

Algorithm (independent of the incremental Cauwenberghs–Poggio walk in :mod:`.exact`): sequential
minimal optimisation with second-order working-set selection (as in LIBSVM) from the uniform feasible
point ``alpha = 1/n`` down to a maximal KKT violation of ``1e-13``, then an exact *polish*: the
bordered KKT system of the identified partition is solved directly, and kept when it satisfies every
KKT condition (it then is the optimum to rounding). Degenerate problems (duplicate keys) are handled
by SMO itself; the polish uses a least-squares solve.

SMO converges linearly, slowly on smooth kernels (a bandwidth far above the data scale makes the Gram
numerically singular): when neither the first ``200 n + 1000`` iterations nor the polish reach the
tolerance, SMO continues from where it stopped, up to :data:`SMO_EXTRA_ROUNDS` more rounds. A solve that
still misses :data:`REFIT_TOL` says so: :attr:`SVDDSolution.converged` is False and a ``RuntimeWarning``
is issued (an oracle that did not converge must not be compared against silently).
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import numpy as np

from sv_attention.errors import (
    InfeasibleBoxError,
    InvalidHyperparameterError,
    InvalidInputError,
    UnknownIdError,
)
from sv_attention.svdd.blas import one_blas_thread
from sv_attention.svdd.box import feasible_size
from sv_attention.svdd.readapi import ReadAPI, as_float64_matrix, as_id_array, sq_dists
from sv_attention.svdd.receipts import ERROR, MARGIN, RESERVE, KKTResiduals, Partition, kkt_residuals

BOUND_TOL = 1e-12
REFIT_TOL = 1e-10
"""KKT residual a converged reference solve reaches (SMO stops at a violation of 1e-13)."""
SMO_EXTRA_ROUNDS = 10
"""Further rounds of ``200 n + 1000`` SMO iterations when the first round and the polish miss REFIT_TOL."""
MIN_C = 2.0 ** -53
"""Smallest accepted box: a smaller C needs more than 2**53 keys before ``n * C >= 1``."""


def _real(x: Any, name: str) -> float:
    """``x`` as a float when it is a real number (Python or numpy int / float, 0-d array); bools refused."""
    if isinstance(x, (bool, np.bool_)) or (isinstance(x, np.ndarray) and x.dtype == bool):
        raise InvalidHyperparameterError(f"{name} must be a real number, got the bool {x!r}")
    if isinstance(x, np.ndarray) and x.ndim == 0:
        x = x[()]
    if not isinstance(x, (int, float, np.integer, np.floating)):
        raise InvalidHyperparameterError(f"{name} must be a real number, got {type(x).__name__} {x!r}")
    return float(x)


def check_hyper(C: Any, sigma: Any) -> tuple[float, float]:
    """Validate the box ``C`` and the bandwidth ``sigma``; return them as floats.

    Raises
    ------
    InvalidHyperparameterError
        Not a real number (bools and strings included); ``C`` not finite, ``<= 0`` or below
        :data:`MIN_C` (no solver could ever hold the ``1/C`` keys feasibility needs); ``sigma`` not finite,
        ``<= 0``, or so small / large that ``sigma**2`` under- or overflows float64.
    """
    C, sigma = _real(C, "C"), _real(sigma, "sigma")
    if not (np.isfinite(C) and C > 0):
        raise InvalidHyperparameterError(f"C must be finite and > 0, got {C}; e.g. C = 1/(nu*n0) with nu in (0, 1]")
    if C < MIN_C:
        raise InvalidHyperparameterError(
            f"C = {C:.3g} is too small: feasibility (n * C >= 1) would need more than 2**53 keys; use C >= {MIN_C:.3g} "
            "(e.g. C = 1/(nu*n0) with a realistic reference size n0)")
    if not (np.isfinite(sigma) and sigma > 0):
        raise InvalidHyperparameterError(f"sigma must be finite and > 0, got {sigma}; pass a positive bandwidth")
    s2 = sigma * sigma
    if not (s2 >= np.finfo(np.float64).tiny and np.isfinite(s2) and np.isfinite(1.0 / s2)):
        raise InvalidHyperparameterError(
            f"sigma = {sigma:.3g}: sigma**2 under- or overflows float64; use a bandwidth in [1e-150, 1e150] (rescale "
            "the keys if they live at an extreme scale)")
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


def smo(K: np.ndarray, C: float, tol: float = 1e-13, max_iter: int | None = None,
        alpha0: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """SMO with second-order working-set selection; returns ``alpha [n]`` and the iteration count.

    Starts from ``alpha0`` (feasible) when given, else from the uniform point ``1/n``.
    """
    alpha, it, _ = _smo(K, C, tol, max_iter, alpha0)
    return alpha, it


def _smo(K: np.ndarray, C: float, tol: float, max_iter: int | None,
         alpha0: np.ndarray | None) -> tuple[np.ndarray, int, bool]:
    """:func:`smo`, also returning whether the maximal violation reached ``tol`` (False: the cap stopped it)."""
    n = K.shape[0]
    diag = np.diag(K).copy()
    alpha = np.full(n, 1.0 / n) if alpha0 is None else np.array(alpha0, dtype=np.float64)
    grad = 2.0 * K @ alpha - diag  # d objective / d alpha
    max_iter = max_iter if max_iter is not None else 200 * n + 1000
    it = 0
    done = False
    for it in range(1, max_iter + 1):  # noqa: B007 - the count is returned
        up = alpha < C - BOUND_TOL * C
        down = alpha > BOUND_TOL * C
        if not up.any() or not down.any():
            done = True
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
                done = True
                break
        eta = np.maximum(2.0 * (diag[i] + diag - 2.0 * K[i]), 1e-15)
        viol = gd - gi
        score = np.where(viol > 0, viol * viol / eta, -np.inf)
        j = int(np.argmax(score))
        if not np.isfinite(score[j]):
            done = True
            break
        # move delta from j to i
        delta = (grad[j] - grad[i]) / eta[j]
        delta = min(delta, C - alpha[i], alpha[j])
        if delta <= 0:
            done = True
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
    return alpha, it, done


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
                                 f"add keys or use a larger C (need n >= {feasible_size(C)})")
    cap = 200 * n + 1000
    alpha, iters, _ = _smo(K, C, 1e-13, cap, None)
    best = None
    for rnd in range(SMO_EXTRA_ROUNDS + 1):
        cand = _finish(K, C, alpha.copy())
        res = _residual(K, C, *cand)
        if best is None or res < best[0]:
            best = (res, cand)
        if res <= REFIT_TOL or rnd == SMO_EXTRA_ROUNDS:
            break
        # not there yet (slow linear convergence on a near-singular Gram): continue SMO where it stopped
        alpha, more, done = _smo(K, C, 1e-13, cap, alpha)
        iters += more
        if done and more <= 1:
            break
    a, rho, status = best[1]
    return a, rho, status, iters


def _residual(K: np.ndarray, C: float, alpha: np.ndarray, rho: float, status: np.ndarray) -> float:
    g = rho - np.diag(K) + 2.0 * K @ alpha
    r = kkt_residuals(alpha, g, status, C).max
    return r if np.isfinite(r) else np.inf


def _finish(K: np.ndarray, C: float, alpha: np.ndarray) -> tuple[np.ndarray, float, np.ndarray]:
    """Partition, polish (kept when it satisfies every KKT condition) and canonical rho of an SMO point."""
    status = classify(alpha, C)
    diag = np.diag(K)
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
    return alpha, rho, status


class SVDDSolution(ReadAPI):
    """A from-scratch SVDD solution with the same read API as the maintained solver.

    Attributes
    ----------
    ids : int64 ``[n]``; keys : float64 ``[n, d]``; alpha : float64 ``[n]`` aligned with ids
    rho : float; C, sigma : floats; partition : :class:`Partition`; kkt : :class:`KKTResiduals`
    iterations : SMO iterations; elapsed_s : wall time of the solve (Gram build included)
    converged : every KKT residual within :data:`REFIT_TOL` (check it before using the solution as an oracle)
    """

    def __init__(self, ids: np.ndarray, keys: np.ndarray, alpha: np.ndarray, rho: float, status: np.ndarray,
                 C: float, sigma: float, kkt: KKTResiduals, iterations: int, elapsed_s: float) -> None:
        self.ids, self.keys, self.alpha, self.rho = ids, keys, alpha, float(rho)
        self.status, self.C, self.sigma = status, C, sigma
        self.kkt, self.iterations, self.elapsed_s = kkt, iterations, elapsed_s
        self.converged = bool(np.isfinite(kkt.max) and kkt.max <= REFIT_TOL)
        """True when every KKT residual is within :data:`REFIT_TOL` (else a RuntimeWarning was issued)."""

    @property
    def partition(self) -> Partition:
        def pick(code: int) -> tuple[int, ...]:
            return tuple(int(i) for i in np.sort(self.ids[self.status == code]))

        return Partition(margin=pick(MARGIN), error=pick(ERROR), reserve=pick(RESERVE))

    def alpha_of(self, ids: Any) -> np.ndarray:
        """Coefficients of the given ids, float64 ``[len(ids)]``.

        Raises :class:`InvalidInputError` for non-integer ids, :class:`UnknownIdError` for an id not solved.
        """
        pos = {int(i): k for k, i in enumerate(self.ids)}
        arr = as_id_array(ids)
        missing = [int(i) for i in arr if int(i) not in pos]
        if missing:
            raise UnknownIdError(f"ids {missing[:10]} are not among this solution's ids; see .ids")
        return np.array([self.alpha[pos[int(i)]] for i in arr], dtype=np.float64)

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
    SVDDSolution with ``ids, alpha, rho, partition, decision_function, readout, kkt`` and ``converged``
    (False, with a ``RuntimeWarning``, when the KKT residual misses :data:`REFIT_TOL`).

    Raises
    ------
    InvalidHyperparameterError, InvalidInputError, InfeasibleBoxError
    """
    t0 = time.perf_counter()
    C, sigma = check_hyper(C, sigma)
    X = as_float64_matrix(keys, "keys")
    n = X.shape[0]
    if ids is None:
        id_arr = np.arange(n, dtype=np.int64)
    else:
        id_arr = as_id_array(ids)
        if id_arr.shape[0] != n:
            raise InvalidInputError(f"got {id_arr.shape[0]} ids for {n} keys; pass one id per key")
        if np.unique(id_arr).size != n:
            raise InvalidInputError("ids contain repeats; pass unique ids")
    K = rbf_gram_np(X, sigma)
    alpha, rho, status, iters = solve_dual(K, C)
    g = rho - 1.0 + 2.0 * K @ alpha
    kkt = kkt_residuals(alpha, g, status, C)
    sol = SVDDSolution(id_arr, X, alpha, rho, status, C, sigma, kkt, iters, time.perf_counter() - t0)
    if not sol.converged:
        warnings.warn(f"refit: SMO stopped after {iters} iterations with KKT residual {kkt.max:.3e} > {REFIT_TOL:g} "
                      "(a near-singular Gram: duplicate keys or a bandwidth far above the data scale); "
                      "the solution's .converged is False", RuntimeWarning, stacklevel=3)
    return sol
