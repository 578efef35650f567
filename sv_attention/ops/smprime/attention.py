"""The fast path of smprime: stable path products (reversed cumulative products, never ``exp(cumsum(log m))``)
and one vectorised pass over the rows asked for.

``|G_ij|`` is a *reversed cumulative product* of ``m`` along each row (NaN-free at ``m = 0``); the phase is
a difference of cumulative sums of ``theta``. Prefill memory is ``O(b h s^2)`` (this arm is a research
operator, not a long-context path); a decoded row costs ``O(s d)``.
"""

from __future__ import annotations

import math

import torch

from sv_attention.errors import InvalidInputError
from sv_attention.ops.ceq.common import repeat_kv
from sv_attention.ops.masking import causal_mask, to_bool_mask


def path_modulus(m: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """``|G_ij| = prod_{k=j+1..i} m_k`` for ``j <= i`` (0 above the diagonal).

    Parameters
    ----------
    m : ``[..., s]`` in [0, 1].
    rows : int or None
        Only the last ``rows`` rows (positions ``s - rows .. s - 1``; decoding); None: all ``s``.

    Returns
    -------
    ``[..., rows, s]``. Row i is the reversed cumulative product of ``(m_1..m_i, 1, ..., 1)`` shifted by one,
    so zeros in m give exact zeros (and finite gradients), never NaN. A row costs ``O(s)`` and is computed
    by the same operations whether or not the other rows are.
    """
    s = m.shape[-1]
    t = s if rows is None else int(rows)
    lower = causal_mask(t, s, device=m.device)  # k <= i
    mm = torch.where(lower, m[..., None, :], torch.ones((), dtype=m.dtype, device=m.device))  # [.., i, k]
    # R[i, j] = prod_{k >= j} mm[i, k] = prod_{k=j..i} m_k
    r = torch.flip(torch.cumprod(torch.flip(mm, dims=(-1,)), dim=-1), dims=(-1,))
    ones = torch.ones(mm.shape[:-1] + (1,), dtype=m.dtype, device=m.device)
    g = torch.cat([r[..., 1:], ones], dim=-1)  # G[i, j] = R[i, j+1]
    return g * lower


def path_phase(theta: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """``phi_ij = sum_{k=j+1..i} theta_k`` for ``j <= i`` (0 elsewhere); ``theta`` ``[..., s]``; the last
    ``rows`` rows ``[..., rows, s]`` (None: all)."""
    c = torch.cumsum(theta, dim=-1)
    s = theta.shape[-1]
    t = s if rows is None else int(rows)
    lower = causal_mask(t, s, device=theta.device)
    return (c[..., s - t:, None] - c[..., None, :]) * lower


def smprime_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor, theta: torch.Tensor, *,
                      beta: float | torch.Tensor = 1.0, qk: float | torch.Tensor = 1.0,
                      mask: torch.Tensor | None = None, scaling: float | None = None) -> torch.Tensor:
    """Functional smprime attention: prefill (``q_len == kv_len``) or the last ``q_len`` rows (decoding).

    Parameters
    ----------
    q : ``[b, h, q_len, d]``, the queries of the last ``q_len`` positions; k, v : ``[b, h_kv, s, d]`` (GQA
        by shape), ``q_len <= s``
    m : ``[b, h, s]`` path moduli in [0, 1]; theta : ``[b, h, s]`` phases (already multiplied by g), for
        every position (a row's path product reaches back to its first key).
    beta, qk : float or 0-dim Tensor
        Normaliser exponent and logit gain.
    mask : anything :func:`sv_attention.ops.masking.to_bool_mask` accepts (``[.., q_len, s]`` or a key
        mask); causality (j <= i) on top.
    scaling : float, optional
        ``1/sqrt(d)`` when None.

    Returns
    -------
    ``[b, h, q_len, d]`` (the real part). Rows with no visible key are 0. A row costs ``O(s d)`` (the
    rows are computed by the same operations as in the prefill), so decoding one token is ``O(s d)``.
    """
    b, h, t, d = q.shape
    s = k.shape[2]
    if v.shape[2] != s or t > s:
        raise InvalidInputError(f"smprime_attention needs q_len <= kv_len and equal key/value lengths, got "
                                f"q {t}, k {s}, v {v.shape[2]}")
    if h % k.shape[1] != 0:
        raise InvalidInputError(f"query heads ({h}) must be a multiple of key/value heads ({k.shape[1]})")
    if m.shape != (b, h, s) or theta.shape != (b, h, s):
        raise InvalidInputError(f"m and theta must be [b, h, kv_len] = {(b, h, s)}, got {tuple(m.shape)}, "
                                f"{tuple(theta.shape)}")
    rep = h // k.shape[1]
    k, v = repeat_kv(k, rep), repeat_kv(v, rep)
    sc = 1.0 / math.sqrt(d) if scaling is None else float(scaling)
    vis = causal_mask(t, s, device=q.device)[None, None]
    bm = to_bool_mask(mask, t, s)
    if bm is not None:
        vis = vis & bm
    logits = qk * (q @ k.transpose(-1, -2)) * sc
    neg = torch.finfo(logits.dtype).min
    lm = logits.masked_fill(~vis, neg)
    mx = lm.amax(dim=-1, keepdim=True).detach()
    mx = torch.where(vis.any(-1, keepdim=True), mx, torch.zeros_like(mx))
    e = torch.exp(lm - mx) * vis  # E_ij e^{-M_i}
    gmod = path_modulus(m, t)
    z = (gmod * e).sum(-1, keepdim=True)  # Z_i e^{-M_i}
    has = z > 0
    zs = torch.where(has, z, torch.ones_like(z))
    # W = G E / Z^beta = G (E e^{-M}) / (Z e^{-M})^beta * e^{(1 - beta) M}
    factor = torch.exp((1.0 - beta) * mx) / zs ** beta * has
    wr = gmod * torch.cos(path_phase(theta, t)) * e * factor
    return wr @ v


__all__ = ["path_modulus", "path_phase", "smprime_attention"]
