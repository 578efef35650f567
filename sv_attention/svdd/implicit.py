"""Implicit backward of the exact SVDD solution (DESIGN §2.3), reusing the maintained inverse.

Within a fixed partition (margin S, error E) the solution solves the bordered system
``M(K) [rho; alpha_S] = c(K)`` with ``M = [[0, 1^T], [1, 2 K_SS]]`` and
``c = [1 - |E| C; diag(K)_S - 2 C K_SE 1]``. For cotangents ``(g_rho, g_alpha_S)``,
``w = R^T [g_rho; g_alpha_S]`` with ``R = M^{-1}`` the solver's maintained inverse, and

    dL/dK_ii += w_i          (i in S)
    dL/dK_ie += -2 C w_i     (i in S, e in E)
    dL/dK_ij += -2 w_i a_j   (i, j in S)

No second solve: the forward refines ``R c`` against ``M(K)`` (iterative refinement with the same R) and
the backward is one product with ``R^T``. Set migrations are kinks: no gradient flows through them.

Caller: the naive SV reference (:func:`sv_attention.ops.sv_gate.naive.differentiable_exact_gate`) with
``detach_gate=False`` differentiates the exact solver's coefficients through this VJP; it is the reference
the trainable batched path's gradient (the ridged bordered solve of ``ops.sv_gate.fit``) is tested against
(``tests/ops/test_causal.py``). The exact solver path itself (``SVSettings(solver="exact")``, the certified
cache) stays inference-only. Checked against :func:`svdd_alpha_rho_reference` and by fp64 ``gradcheck`` in
``tests/svdd/test_implicit.py``.

Public functions
----------------
:func:`svdd_alpha_rho` (keys -> alpha, rho through the kernel map), :func:`decision_scores`,
:func:`rbf_readout`, and the plain reference :func:`svdd_alpha_rho_reference` (autograd through
``torch.linalg.solve``) that the tests compare against.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from sv_attention.errors import InvalidInputError, WarmupError
from sv_attention.kernels import rbf_gram


class ImplicitSVDD(torch.autograd.Function):
    """``K [n, n] -> (alpha [n], rho [])`` on a fixed partition, backward via the maintained inverse.

    Forward arguments: ``K`` float64 ``[n, n]``; ``margin`` / ``error`` long ``[s]`` / ``[e]`` positions
    (margin in the row order of R); ``C`` float; ``R`` float64 ``[s+1, s+1]``, the inverse of the
    bordered matrix at the solver's Gram.
    """

    @staticmethod
    def forward(ctx: Any, K: torch.Tensor, margin: torch.Tensor, error: torch.Tensor, C: float,
                R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = K.shape[0]
        s = margin
        M = torch.zeros(s.numel() + 1, s.numel() + 1, dtype=K.dtype)
        M[0, 1:] = 1.0
        M[1:, 0] = 1.0
        M[1:, 1:] = 2.0 * K[s][:, s]
        c = torch.empty(s.numel() + 1, dtype=K.dtype)
        c[0] = 1.0 - error.numel() * C
        c[1:] = torch.diagonal(K)[s] - 2.0 * C * K[s][:, error].sum(dim=1)
        x = R @ c
        for _ in range(20):  # iterative refinement with the maintained inverse (no factorisation)
            r = c - M @ x
            x = x + R @ r
            if r.abs().max() <= 1e-15 * (1.0 + c.abs().max()):
                break
        alpha = torch.zeros(n, dtype=K.dtype)
        alpha[error] = C
        alpha[s] = x[1:]
        ctx.save_for_backward(R, alpha, margin, error)
        ctx.C = C
        ctx.n = n
        return alpha, x[0].clone()

    @staticmethod
    def backward(ctx: Any, g_alpha: torch.Tensor, g_rho: torch.Tensor) -> tuple[Any, ...]:
        R, alpha, s, e = ctx.saved_tensors
        n, C = ctx.n, ctx.C
        gx = torch.empty(s.numel() + 1, dtype=R.dtype)
        gx[0] = g_rho if g_rho is not None else 0.0
        gx[1:] = g_alpha[s] if g_alpha is not None else 0.0
        w = (R.transpose(0, 1) @ gx)[1:]
        G = torch.zeros(n, n, dtype=R.dtype)
        G[s, s] += w
        if e.numel():
            G[s.unsqueeze(1), e.unsqueeze(0)] += -2.0 * C * w.unsqueeze(1)
        G[s.unsqueeze(1), s.unsqueeze(0)] += -2.0 * w.unsqueeze(1) * alpha[s].unsqueeze(0)
        return G, None, None, None, None


def _positions(solver: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Margin positions (R order), error positions, and R, all relative to ``solver.ids``."""
    if not solver.has_solution:
        raise WarmupError("the solver has no solution yet (n*C < 1); add keys before differentiating")
    ids = solver.ids
    margin_ids, R = solver.margin_inverse
    margin = np.searchsorted(ids, margin_ids)
    error = np.searchsorted(ids, np.array(solver.partition.error, dtype=np.int64))
    Rt = torch.from_numpy(R) if R is not None else torch.zeros(1, 1, dtype=torch.float64)
    return torch.from_numpy(margin.astype(np.int64)), torch.from_numpy(error.astype(np.int64)), Rt


def _check_keys(keys: torch.Tensor, solver: Any) -> None:
    if not isinstance(keys, torch.Tensor) or keys.dtype != torch.float64:
        raise InvalidInputError("keys must be a float64 torch tensor [n, d] aligned with solver.ids")
    if keys.ndim != 2 or keys.shape[0] != solver.n:
        raise InvalidInputError(f"keys must have shape [n={solver.n}, d], aligned with solver.ids; got "
                                f"{tuple(keys.shape)}")


def svdd_alpha_rho(keys: torch.Tensor, solver: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable ``(alpha [n], rho [])`` of a solved :class:`IncrementalSVDD` w.r.t. its keys.

    Parameters
    ----------
    keys : float64 ``[n, d]`` tensor, equal to ``solver.keys`` (aligned with ``solver.ids``); may
        require grad
    solver : a solved ``IncrementalSVDD`` (its partition and maintained inverse are reused)

    Returns
    -------
    alpha ``[n]`` and rho ``[]``, differentiable through the kernel map ``K = rbf_gram(keys)``.
    """
    _check_keys(keys, solver)
    margin, error, R = _positions(solver)
    if margin.numel() == 0:
        raise InvalidInputError("the margin set is empty: alpha is piecewise constant here (no gradient)")
    K = rbf_gram(keys, sigma=solver.sigma)
    return ImplicitSVDD.apply(K, margin, error, solver.C, R)


def svdd_alpha_rho_reference(keys: torch.Tensor, solver: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain reference of :func:`svdd_alpha_rho`: autograd through ``torch.linalg.solve`` of the bordered
    system on the solver's partition (a second solve; for tests)."""
    _check_keys(keys, solver)
    margin, error, _ = _positions(solver)
    K = rbf_gram(keys, sigma=solver.sigma)
    s = margin
    top = torch.cat([torch.zeros(1, dtype=K.dtype), torch.ones(s.numel(), dtype=K.dtype)])
    body = torch.cat([torch.ones(s.numel(), 1, dtype=K.dtype), 2.0 * K[s][:, s]], dim=1)
    M = torch.cat([top.unsqueeze(0), body], dim=0)
    c = torch.cat([torch.tensor([1.0 - error.numel() * solver.C], dtype=K.dtype),
                   torch.diagonal(K)[s] - 2.0 * solver.C * K[s][:, error].sum(dim=1)])
    x = torch.linalg.solve(M, c)
    alpha = torch.zeros(keys.shape[0], dtype=K.dtype).index_put((error,), torch.full((error.numel(),), solver.C,
                                                                                     dtype=K.dtype))
    alpha = alpha.index_put((s,), x[1:])
    return alpha, x[0]


def decision_scores(X: torch.Tensor, keys: torch.Tensor, alpha: torch.Tensor, rho: torch.Tensor,
                    sigma: float) -> torch.Tensor:
    """``f(x) = 2 sum_j alpha_j k(x, x_j) - rho``: ``X [q, d]``, ``keys [n, d]``, ``alpha [n]`` -> ``[q]``."""
    return 2.0 * rbf_gram(X, keys, sigma=sigma) @ alpha - rho


def rbf_readout(Q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, alpha: torch.Tensor,
                sigma: float) -> torch.Tensor:
    """RBF readout ``sum_i alpha_i k(q, x_i) v_i / sum_i alpha_i k(q, x_i)`` over the support (alpha > 0).

    ``Q [q, d]``, ``keys [n, d]``, ``values [n, dv]``, ``alpha [n]`` -> ``[q, dv]``. Computed as a softmax
    of ``log alpha_i - ||q - x_i||^2 / sigma^2`` restricted to the support (alpha = 0 keys carry no weight
    and no gradient).
    """
    sup = (alpha.detach() > 0).nonzero().squeeze(1)
    xs, vs, a = keys[sup], values[sup], alpha[sup]
    d2 = (Q.unsqueeze(1) - xs.unsqueeze(0)).pow(2).sum(-1)
    w = torch.softmax(torch.log(a).unsqueeze(0) - d2 / (sigma * sigma), dim=1)
    return w @ vs
