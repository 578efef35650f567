"""Torch backend of the batched SVDD partition finder: FISTA on the capped simplex.

Minimises ``a^T K a - diag(K)^T a`` subject to ``sum a = 1, 0 <= a <= C`` for ``G`` problems at once
(DESIGN §2.4 measured facts):

* step ``1 / L`` with ``L = 1.1 * 2 * lambda_max(P K P)``, ``P = I - 1 1^T / n_b`` (the curvature on the
  tangent space of ``sum a = 1``; iterates never leave it), from ``power_iters`` power iterations with a
  fixed start vector so every backend agrees;
* projection onto the capped simplex: the shift ``tau`` of ``clip(y - tau, 0, C)`` by a few safeguarded
  Newton steps inside a bisection bracket, warm-started from the previous iteration's shift, then the
  shift recomputed exactly from the active set found ("polish"). DESIGN §2.4 used 16-20 plain bisection
  steps; the loop is launch-bound, and warm-started Newton needs 1-3 steps for the same answer;
* FISTA momentum with the gradient-based adaptive restart (O'Donoghue & Candes), which removes the
  oscillation of plain FISTA on clustered keys at no extra cost.

Padded keys (``mask`` False) are held at exactly 0.
"""

from __future__ import annotations

import torch

#: Newton/bisection steps of the first (cold-started) projection of a FISTA run.
COLD_STEPS = 16


def fixed_start_vector(n: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Deterministic power-iteration start ``[n]`` shared by every backend: ``1 + 0.5 sin(1.7 i + 0.3)``."""
    i = torch.arange(n, dtype=torch.float64)
    return (1.0 + 0.5 * torch.sin(1.7 * i + 0.3)).to(dtype=dtype, device=device)


def _matvec(gram_mv: torch.Tensor, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``K @ x`` per problem with ``K`` stored in ``gram_mv``'s dtype (x scaled into range first)."""
    if gram_mv.dtype == x.dtype:
        return (gram_mv @ x[..., None])[..., 0]
    s = x.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny) if scale is None else scale
    return (gram_mv @ (x / s).to(gram_mv.dtype)[..., None])[..., 0].to(x.dtype) * s


def tangent_lipschitz(gram: torch.Tensor, maskf: torch.Tensor, power_iters: int,
                      gram_mv: torch.Tensor | None = None) -> torch.Tensor:
    """``1.1 * 2 * lambda_max(P K P)`` per problem, ``[G]`` (P projects on the valid-key tangent space)."""
    G, n, _ = gram.shape
    gram_mv = gram if gram_mv is None else gram_mv
    cnt = maskf.sum(-1, keepdim=True).clamp_min(1.0)

    def tangent(v: torch.Tensor) -> torch.Tensor:
        v = v * maskf
        return (v - v.sum(-1, keepdim=True) / cnt) * maskf

    v = tangent(fixed_start_vector(n, gram.dtype, gram.device).expand(G, n))
    for _ in range(power_iters):
        w = tangent(_matvec(gram_mv, v))
        v = w / w.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(gram.dtype).tiny)
    lam = (v * tangent(_matvec(gram_mv, v))).sum(-1)
    # A degenerate problem (one key, identical keys) has lam = 0: any step works, use the trace bound.
    floor = torch.diagonal(gram, dim1=-2, dim2=-1).mul(maskf).sum(-1).clamp_min(1.0) * 1e-3
    return 2.2 * torch.maximum(lam, floor)


def project_capped_simplex(y: torch.Tensor, maskf: torch.Tensor, C: torch.Tensor, steps: int,
                           tau0: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Project rows of ``y [G, n]`` onto ``{0 <= a <= C, sum a = 1}`` (valid entries; padded -> 0).

    Finds the shift ``tau`` of ``sum clip(y - tau, 0, C) = 1`` (a decreasing piecewise-linear function)
    by ``steps`` safeguarded Newton steps inside a bisection bracket: a Newton step
    ``tau + (s(tau) - 1) / |free|`` is taken when it stays inside the bracket, else the bracket
    midpoint. Newton is exact as soon as the free set is right, so a warm start ``tau0`` (the previous
    FISTA iteration's shift) usually needs 1-3 steps; with ``tau0=None`` it starts from the bracket
    midpoint. A final closed-form shift from the free set found ("polish", DESIGN §2.4) follows.
    Requires ``n_b C >= 1`` (checked by the caller).

    Returns
    -------
    (a, tau) : Tensor ``[G, n]`` projection and Tensor ``[G]`` shift (warm start of the next call).
    """
    big = torch.finfo(y.dtype).max / 8
    Cc = C[:, None]
    valid = maskf > 0
    ym = torch.where(valid, y, torch.full_like(y, -big))
    hi = ym.amax(-1)
    lo = torch.where(valid, y, torch.full_like(y, big)).amin(-1) - C
    tau = 0.5 * (lo + hi) if tau0 is None else torch.minimum(torch.maximum(tau0, lo), hi)
    for _ in range(steps):
        z = ym - tau[:, None]
        s = z.clamp(0.0, None).minimum(Cc).sum(-1)
        nf = ((z > 0) & (z < Cc)).sum(-1)
        over = s > 1.0
        lo = torch.where(over, tau, lo)
        hi = torch.where(over, hi, tau)
        newton = tau + (s - 1.0) / nf.clamp_min(1)
        inside = (nf > 0) & (newton >= lo) & (newton <= hi)
        tau = torch.where(inside, newton, 0.5 * (lo + hi))
    z = ym - tau[:, None]
    free = (z > 0) & (z < Cc)
    upper = z >= Cc
    nf = free.sum(-1)
    tau_exact = (torch.where(free, ym, torch.zeros_like(ym)).sum(-1) - (1.0 - C * upper.sum(-1))) / nf.clamp_min(1)
    tau = torch.where(nf > 0, tau_exact, tau)
    return (ym - tau[:, None]).clamp(0.0, None).minimum(Cc) * maskf, tau


def fista_finder(gram: torch.Tensor, maskf: torch.Tensor, C: torch.Tensor, *, iters: int, projection_steps: int,
                 power_iters: int, restart: bool = True, matvec_dtype: torch.dtype | None = None,
                 init: torch.Tensor | None = None) -> torch.Tensor:
    """Run FISTA on every problem; returns the last iterate ``alpha [G, n]`` (no autograd).

    Parameters
    ----------
    gram : Tensor ``[G, n, n]`` detached, zero on padded rows / columns
    maskf : Tensor ``[G, n]`` 1.0 on valid keys, 0.0 on padding (same dtype as gram)
    C : Tensor ``[G]``
    iters, power_iters : int
    projection_steps : int  safeguarded Newton / bisection steps per projection
    restart : bool  gradient-based adaptive restart of the momentum (default True)
    matvec_dtype : torch.dtype or None  store K in this dtype for the matrix-vector products (e.g.
        ``torch.float16``: half the memory traffic, and on CPU a kernel that does not suffer from thread
        oversubscription); iterates stay in ``gram.dtype``, vectors are scaled into range first
    init : Tensor ``[G, n]`` or None
        Warm start (e.g. the solution of a shorter prefix padded with zeros); projected onto the feasible
        set first. None: the uniform point. With ``iters == 0`` the projected start is returned as is
        (no power iteration either).
    """
    with torch.no_grad():
        cnt = maskf.sum(-1, keepdim=True).clamp_min(1.0)
        if init is None:
            a = maskf / cnt
        else:
            a, _ = project_capped_simplex(init.to(gram.dtype) * maskf, maskf, C, COLD_STEPS)
        if iters == 0:
            return a
        gram_mv = gram if matvec_dtype is None or matvec_dtype == gram.dtype else gram.to(matvec_dtype)
        step = 1.0 / tangent_lipschitz(gram, maskf, power_iters, gram_mv)[:, None]
        yscale = C[:, None]
        diag = torch.diagonal(gram, dim1=-2, dim2=-1)
        y = a
        t = torch.ones(gram.shape[0], 1, dtype=gram.dtype, device=gram.device)
        tau = None
        for _ in range(iters):
            grad = 2.0 * _matvec(gram_mv, y, yscale) - diag
            # cold first projection: enough steps to converge from the bracket midpoint
            a_new, tau = project_capped_simplex(y - step * grad, maskf, C,
                                                projection_steps if tau is not None else COLD_STEPS, tau)
            t_new = 0.5 * (1.0 + torch.sqrt(1.0 + 4.0 * t * t))
            y_new = a_new + ((t - 1.0) / t_new) * (a_new - a)
            if restart:
                bad = ((y - a_new) * (a_new - a)).sum(-1, keepdim=True) > 0
                t_new = torch.where(bad, torch.ones_like(t_new), t_new)
                y_new = torch.where(bad, a_new, y_new)
            a, y, t = a_new, y_new, t_new
        return a
