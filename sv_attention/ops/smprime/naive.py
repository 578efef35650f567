"""The plain reference of smprime: the formula of DESIGN §2.6 entry by entry, in complex arithmetic.

For ``j <= i`` with key j visible to row i::

    G_ij = prod_{k=j+1..i} m_k e^{i theta_k}       (G_ii = 1; a product of complex factors, one per k)
    W_ij = G_ij exp(qk * q_i . k_j * scaling) / Z_i^beta,   Z_i = sum_j |G_ij| exp(qk * q_i . k_j * scaling)
    out_i = Re(sum_j W_ij v_j)

No cumulative products, no shifted maxima: loops over (i, j, k), vectorised over batch and heads only.
Differentiable by autograd (w.r.t. q, k, v, m, theta, beta, qk; keep ``m > 0`` where the gradient of
``|G|`` is wanted). Slow by design (``O(s^3)`` Python steps): use it on a few dozen positions. The fast
path (:func:`sv_attention.ops.smprime.attention.smprime_attention`) and the model's decoding state are
tested against it.
"""

from __future__ import annotations

import math

import torch

from sv_attention.errors import InvalidInputError
from sv_attention.ops.masking import to_bool_mask


def smprime_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor, theta: torch.Tensor, *,
                      beta: float | torch.Tensor = 1.0, qk: float | torch.Tensor = 1.0, scaling: float | None = None,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """Reference smprime attention, ``[b, h, q_len, d]`` (rows with no visible key are 0).

    Parameters
    ----------
    q : ``[b, h, q_len, d]``, the queries of the last ``q_len`` positions; k, v : ``[b, h_kv, s, d]``
        (GQA: head ``i`` reads kv head ``i // (h / h_kv)``)
    m, theta : ``[b, h, s]`` path moduli and phases of every position
    beta, qk : float or 0-dim Tensor
    scaling : float, optional  ``1/sqrt(d)`` when None
    mask : anything :func:`sv_attention.ops.masking.to_bool_mask` accepts; causality (j <= i) on top
    """
    b, h, t, d = q.shape
    s = k.shape[2]
    if t > s or m.shape != (b, h, s) or theta.shape != (b, h, s) or h % k.shape[1] != 0:
        raise InvalidInputError(f"smprime_reference: q {tuple(q.shape)}, k {tuple(k.shape)}, m {tuple(m.shape)}, "
                                f"theta {tuple(theta.shape)} do not fit together")
    group = h // k.shape[1]
    sc = 1.0 / math.sqrt(d) if scaling is None else float(scaling)
    bm = to_bool_mask(mask, t, s)
    vis = None if bm is None else bm.expand(b, h, t, s)
    cdtype = torch.complex128 if q.dtype == torch.float64 else torch.complex64
    factor = torch.polar(m, theta).to(cdtype)  # m_k e^{i theta_k}  [b, h, s]
    kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    rows = []
    for r in range(t):
        i = s - t + r
        acc = torch.zeros(b, h, d, dtype=cdtype)
        z = torch.zeros(b, h, dtype=q.dtype)
        terms = []
        for j in range(i + 1):
            g = torch.ones(b, h, dtype=cdtype)
            for kx in range(j + 1, i + 1):
                g = g * factor[:, :, kx]
            e = torch.exp(qk * (q[:, :, r] * kk[:, :, j]).sum(-1) * sc)
            if vis is not None:
                e = e * vis[:, :, r, j]
            terms.append((g, e))
            z = z + g.abs() * e
        zs = torch.where(z > 0, z, torch.ones_like(z))
        for j, (g, e) in enumerate(terms):
            w = g * (e * (z > 0) / zs ** beta)
            acc = acc + w[..., None] * vv[:, :, j].to(cdtype)
        rows.append(acc.real.to(q.dtype))
    return torch.stack(rows, dim=2)


__all__ = ["smprime_reference"]
