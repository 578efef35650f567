"""Reference SVDD solutions for checking the batched path, and the key generators of its benchmark.

:func:`reference_solution` solves one problem to (near) machine precision in float64: with the
project's exact from-scratch solver (``solve_dual``, the Gram form of ``refit``) when importable, or
with the independent interior-point QP solver Clarabel, whose answer is then made exact by reading out its
partition and re-solving the bordered system of that partition with ridge 0 (checked against the KKT
conditions; the interior-point iterate is kept when the re-solve is not a KKT point).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sv_attention.errors import BackendUnavailableError


@dataclass
class ReferenceSolution:
    """One exact fp64 SVDD solution.

    Attributes
    ----------
    alpha : ndarray ``[n]`` float64
    rho : float
    partition : ndarray ``[n]`` int8  (0 = reserve, 1 = margin, 2 = error)
    kkt_residual : float  largest KKT violation of (alpha, rho)
    method : str  "refit" (exact solver) or "clarabel+resolve" / "clarabel"
    """

    alpha: np.ndarray
    rho: float
    partition: np.ndarray
    kkt_residual: float
    method: str


def _partition_from(alpha: np.ndarray, C: float, eps_rel: float = 1e-6) -> np.ndarray:
    eps = eps_rel * C
    part = np.ones(alpha.shape, dtype=np.int8)
    part[alpha <= eps] = 0
    part[alpha >= C - eps] = 2
    return part


def _kkt(K: np.ndarray, alpha: np.ndarray, rho: float, part: np.ndarray, C: float) -> float:
    g = rho - np.diag(K) + 2.0 * K @ alpha
    r = [abs(alpha.sum() - 1.0)]
    S, E, R = part == 1, part == 2, part == 0
    if S.any():
        r += [np.abs(g[S]).max(), max(0.0, (-alpha[S]).max()), max(0.0, (alpha[S] - C).max())]
    if E.any():
        r += [max(0.0, g[E].max())]
    if R.any():
        r += [max(0.0, (-g[R]).max())]
    return float(max(r))


def _clarabel(K: np.ndarray, C: float) -> ReferenceSolution:
    try:
        import clarabel
        import scipy.sparse as sp
    except ImportError as exc:  # pragma: no cover - dev dependency
        raise BackendUnavailableError("the reference needs sv_attention.svdd.exact or clarabel + scipy "
                                      "(pip install 'sv-attention[dev]')") from exc
    n = K.shape[0]
    P = sp.csc_matrix(np.triu(2.0 * K))
    q = -np.diag(K).copy()
    A = sp.vstack([sp.csc_matrix(np.ones((1, n))), -sp.identity(n), sp.identity(n)]).tocsc()
    b = np.concatenate([[1.0], np.zeros(n), np.full(n, C)])
    cones = [clarabel.ZeroConeT(1), clarabel.NonnegativeConeT(2 * n)]
    settings = clarabel.DefaultSettings()
    settings.verbose = False
    settings.tol_gap_abs = settings.tol_gap_rel = 1e-12
    settings.tol_feas = 1e-12
    sol = clarabel.DefaultSolver(P, q, A, b, cones, settings).solve()
    alpha = np.clip(np.asarray(sol.x, dtype=np.float64), 0.0, C)
    rho = float(-np.asarray(sol.z)[0])  # multiplier of sum(alpha) = 1 (sign: g = rho - K_ii + 2 K alpha)
    part = _partition_from(alpha, C)
    # Exact re-solve of the partition found.
    S, E = part == 1, part == 2
    m = int(S.sum())
    if m > 0:
        M = np.zeros((m + 1, m + 1))
        M[0, 1:] = 1.0
        M[1:, 0] = 1.0
        M[1:, 1:] = 2.0 * K[np.ix_(S, S)]
        c = np.concatenate([[1.0 - E.sum() * C], np.diag(K)[S] - 2.0 * C * K[np.ix_(S, E)].sum(1)])
        try:
            u = np.linalg.solve(M, c)
            a2 = np.zeros(n)
            a2[S] = u[1:]
            a2[E] = C
            if _kkt(K, a2, float(u[0]), part, C) <= _kkt(K, alpha, rho, part, C) + 1e-12:
                return ReferenceSolution(a2, float(u[0]), part, _kkt(K, a2, float(u[0]), part, C),
                                         "clarabel+resolve")
        except np.linalg.LinAlgError:
            pass
    g = -np.diag(K) + 2.0 * K @ alpha
    rho = float(-np.median(g[S])) if S.any() else rho
    return ReferenceSolution(alpha, rho, part, _kkt(K, alpha, rho, part, C), "clarabel")


def reference_solution(K: np.ndarray | torch.Tensor, C: float, *, use_exact: bool = True) -> ReferenceSolution:
    """Exact fp64 solution of one problem ``min a^T K a - diag(K)^T a, sum a = 1, 0 <= a <= C``.

    Parameters
    ----------
    K : array ``[n, n]`` (converted to float64), with ``n C >= 1``
    C : float
    use_exact : bool, default True
        Use the project's exact from-scratch solver (:func:`sv_attention.svdd.reference.solve_dual`,
        SMO + bordered polish, the ``refit`` of the exact solver) when importable; otherwise (or when
        False) Clarabel + exact re-solve of its partition.
    """
    K = np.asarray(K.detach().cpu().double() if isinstance(K, torch.Tensor) else K, dtype=np.float64)
    if use_exact:
        try:
            from sv_attention.svdd.receipts import ERROR, MARGIN
            from sv_attention.svdd.reference import solve_dual
        except ImportError:
            solve_dual = None
        if solve_dual is not None:
            alpha, rho, status, _ = solve_dual(K, float(C))
            part = np.zeros(alpha.shape, dtype=np.int8)
            part[status == MARGIN] = 1
            part[status == ERROR] = 2
            return ReferenceSolution(alpha, float(rho), part, _kkt(K, alpha, float(rho), part, C), "refit")
    return _clarabel(K, C)


def gaussian_keys(G: int, n: int, d: int, generator: torch.Generator) -> torch.Tensor:
    """``[G, n, d]`` standard normal keys (float64)."""
    return torch.randn(G, n, d, generator=generator, dtype=torch.float64)


def clustered_keys(G: int, n: int, d: int, generator: torch.Generator, clusters: int = 4,
                   spread: float = 0.3) -> torch.Tensor:
    """``[G, n, d]`` keys from ``clusters`` Gaussian blobs (centres N(0, I), within-blob std ``spread``)."""
    centres = torch.randn(G, clusters, d, generator=generator, dtype=torch.float64)
    which = torch.randint(0, clusters, (G, n), generator=generator)
    base = torch.gather(centres, 1, which[..., None].expand(G, n, d))
    return base + spread * torch.randn(G, n, d, generator=generator, dtype=torch.float64)
