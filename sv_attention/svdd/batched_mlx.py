"""MLX backend of the batched SVDD partition finder (same algorithm as :mod:`.batched_torch`).

Only the non-differentiable FISTA finder runs in MLX; the polish and the differentiable ridged solve
stay in torch. MLX arrays never leave this module: torch tensors go in, a torch tensor comes out.

MLX pitfalls handled here (DESIGN §2.4): ``mx.array`` of float64 data silently becomes float32 unless
asked, so the dtype is explicit (float32 is used: the MLX CPU backend has no float64 matmul); the result
is copied back through numpy (``torch.from_dlpack`` of an MLX array would alias MLX memory writably);
evaluation is lazy, so the loop is forced with ``mx.eval`` every few iterations to bound the graph.
``mx.compile`` is not used: it runs g++ at run time (a 19-100 s cold start) and bakes Python scalars
into the compiled function.
"""

from __future__ import annotations

import numpy as np
import torch

from sv_attention.errors import BackendUnavailableError
from sv_attention.svdd.batched_torch import COLD_STEPS, fixed_start_vector


def _mx():
    """``mlx.core``, imported on first use (a guarded import: MLX is an optional acceleration, and the Hub
    artifact's copy of this module must load where it is not installed)."""
    try:
        import mlx.core as mx
    except ImportError as exc:
        raise BackendUnavailableError("the MLX finder needs mlx (pip install 'mlx[cpu]' on Linux); use "
                                      "gate_backend='torch' or 'auto'") from exc
    return mx


def _tangent_lipschitz(mx, K, m, power_iters: int):
    G, n, _ = K.shape
    cnt = mx.maximum(m.sum(-1, keepdims=True), 1.0)

    def tangent(v):
        v = v * m
        return (v - v.sum(-1, keepdims=True) / cnt) * m

    start = mx.array(fixed_start_vector(n, torch.float32, "cpu").numpy())
    v = tangent(mx.broadcast_to(start, (G, n)))
    tiny = float(np.finfo(np.float32).tiny)
    for _ in range(power_iters):
        w = tangent((K @ v[..., None])[..., 0])
        v = w / mx.maximum(mx.sqrt((w * w).sum(-1, keepdims=True)), tiny)
    lam = (v * tangent((K @ v[..., None])[..., 0])).sum(-1)
    diag = mx.diagonal(K, axis1=-2, axis2=-1)
    floor = mx.maximum((diag * m).sum(-1), 1.0) * 1e-3
    return 2.2 * mx.maximum(lam, floor)


def _project(mx, y, m, C, steps: int, tau):
    big = float(np.finfo(np.float32).max) / 8
    Cc = C[:, None]
    valid = m > 0
    ym = mx.where(valid, y, -big)
    hi = ym.max(-1)
    lo = mx.where(valid, y, big).min(-1) - C
    tau = 0.5 * (lo + hi) if tau is None else mx.minimum(mx.maximum(tau, lo), hi)
    for _ in range(steps):
        z = ym - tau[:, None]
        s = mx.minimum(mx.maximum(z, 0.0), Cc).sum(-1)
        nf = ((z > 0) & (z < Cc)).astype(mx.float32).sum(-1)
        over = s > 1.0
        lo = mx.where(over, tau, lo)
        hi = mx.where(over, hi, tau)
        newton = tau + (s - 1.0) / mx.maximum(nf, 1.0)
        inside = (nf > 0) & (newton >= lo) & (newton <= hi)
        tau = mx.where(inside, newton, 0.5 * (lo + hi))
    z = ym - tau[:, None]
    free = (z > 0) & (z < Cc)
    upper = (z >= Cc).astype(mx.float32).sum(-1)
    nf = free.astype(mx.float32).sum(-1)
    tau_exact = (mx.where(free, ym, 0.0).sum(-1) - (1.0 - C * upper)) / mx.maximum(nf, 1.0)
    tau = mx.where(nf > 0, tau_exact, tau)
    return mx.minimum(mx.maximum(ym - tau[:, None], 0.0), Cc) * m, tau


def fista_finder_mlx(gram: torch.Tensor, maskf: torch.Tensor, C: torch.Tensor, *, iters: int, projection_steps: int,
                     power_iters: int, restart: bool = True, eval_every: int = 8) -> torch.Tensor:
    """MLX twin of :func:`sv_attention.svdd.batched_torch.fista_finder` (float32).

    Parameters
    ----------
    gram : Tensor ``[G, n, n]`` (CPU or CUDA; copied to MLX as float32)
    maskf : Tensor ``[G, n]`` 1.0 on valid keys
    C : Tensor ``[G]``
    iters, projection_steps, power_iters : int
    restart : bool  adaptive momentum restart (default True)
    eval_every : int  force evaluation of the lazy graph every this many iterations

    Returns
    -------
    Tensor ``[G, n]`` on ``gram``'s device and dtype (a copy; no MLX memory is shared).
    """
    mx = _mx()
    K = mx.array(gram.detach().cpu().to(torch.float32).numpy())
    m = mx.array(maskf.detach().cpu().to(torch.float32).numpy())
    Cm = mx.array(C.detach().cpu().to(torch.float32).numpy())
    step = (1.0 / _tangent_lipschitz(mx, K, m, power_iters))[:, None]
    diag = mx.diagonal(K, axis1=-2, axis2=-1)
    a = m / mx.maximum(m.sum(-1, keepdims=True), 1.0)
    y = a
    t = mx.ones((K.shape[0], 1))
    tau = None
    for k in range(iters):
        grad = 2.0 * (K @ y[..., None])[..., 0] - diag
        a_new, tau = _project(mx, y - step * grad, m, Cm, projection_steps if tau is not None else COLD_STEPS, tau)
        t_new = 0.5 * (1.0 + mx.sqrt(1.0 + 4.0 * t * t))
        y_new = a_new + ((t - 1.0) / t_new) * (a_new - a)
        if restart:
            bad = ((y - a_new) * (a_new - a)).sum(-1, keepdims=True) > 0
            t_new = mx.where(bad, 1.0, t_new)
            y_new = mx.where(bad, a_new, y_new)
        a, y, t = a_new, y_new, t_new
        if (k + 1) % eval_every == 0:
            mx.eval(a, y, t, tau)
    mx.eval(a)
    out = np.array(a, copy=True)
    return torch.from_numpy(out).to(device=gram.device, dtype=gram.dtype)
