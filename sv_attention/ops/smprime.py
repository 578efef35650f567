"""The smprime arm of ceq (DESIGN §2.6): a complex path-product gate on exp attention.

For ``j <= i`` (causal, diagonal included)::

    W_ij = G_ij exp(qk * q_i . k_j * scaling) / Z_i^beta
    G_ij = prod_{k=j+1..i} m_k e^{i theta_k}          (G_ii = 1)
    Z_i  = sum_{j<=i} |G_ij| exp(qk * q_i . k_j * scaling)
    out_i = Re(sum_j W_ij v_j)

``m = clamp(1 + g (u - 1), 0, 1)`` and ``theta' = g theta`` come from per-position linear heads (one
value per head and position); ``beta``, ``qk``, ``g`` are learnable scalars per layer, initialised at 1.
Corners: (beta=1, g=0) is softmax attention; (beta=0, g=0) unnormalised exp attention; (beta=0, qk=0) the
pure path product.

``|G_ij|`` is a *reversed cumulative product* of ``m`` along each row (never ``exp`` of a cumulative
``log m``, which is NaN at ``m = 0``); the phase is a difference of cumulative sums of ``theta``.
Prefill memory is ``O(b h s^2)`` (this arm is a research operator, not a long-context path); a decoded
row costs ``O(s d)``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from sv_attention.errors import InvalidInputError
from sv_attention.ops.ceq import repeat_kv
from sv_attention.ops.masking import causal_mask, to_bool_mask

M_BIAS = 1.0 - 1e-3
THETA_BIAS = 1e-3


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


def smprime_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor, theta: torch.Tensor, *,
                      beta: float = 1.0, qk: float = 1.0, scaling: float | None = None) -> torch.Tensor:
    """Independent double-loop complex reference (no mask, ``h == h_kv``); slow, for tests only."""
    b, h, s, d = q.shape
    sc = 1.0 / math.sqrt(d) if scaling is None else float(scaling)
    out = torch.zeros(b, h, s, d, dtype=q.dtype)
    for bi in range(b):
        for hi in range(h):
            for i in range(s):
                terms = []
                for j in range(i + 1):
                    gij = complex(1.0, 0.0)
                    for kk in range(j + 1, i + 1):
                        gij *= complex(float(m[bi, hi, kk]), 0.0) * complex(
                            math.cos(float(theta[bi, hi, kk])), math.sin(float(theta[bi, hi, kk])))
                    ex = math.exp(qk * float(q[bi, hi, i] @ k[bi, hi, j]) * sc)
                    terms.append((gij, ex))
                z = sum(abs(gg) * ex for gg, ex in terms)
                acc = torch.zeros(d, dtype=torch.complex128)
                for j, (gg, ex) in enumerate(terms):
                    acc += gg * ex / z ** beta * v[bi, hi, j].to(torch.complex128)
                out[bi, hi, i] = acc.real.to(q.dtype)
    return out


class SMPrime(nn.Module):
    """One layer's smprime arm: learnable scalars ``beta``, ``qk``, ``g`` (init 1) and the per-position
    linear heads for u (-> m) and theta.

    Parameters
    ----------
    d_model : int
        Hidden size the heads read.
    n_heads : int
        Query heads (one m and one theta per head and position).

    Notes
    -----
    The heads start with zero weights and biases ``1 - 1e-3`` (u) / ``1e-3`` (theta), so at init
    ``m = 1 - 1e-3`` everywhere: away from the annihilating ``m = 0`` point and from the ``m = 1`` clamp
    (where the gradient would vanish).
    """

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        if d_model < 1 or n_heads < 1:
            raise InvalidInputError(f"d_model and n_heads must be >= 1, got {d_model}, {n_heads}")
        self.n_heads = n_heads
        self.beta = nn.Parameter(torch.tensor(1.0))
        self.qk = nn.Parameter(torch.tensor(1.0))
        self.g = nn.Parameter(torch.tensor(1.0))
        self.u_head = nn.Linear(d_model, n_heads)
        self.theta_head = nn.Linear(d_model, n_heads)
        with torch.no_grad():
            self.u_head.weight.zero_()
            self.u_head.bias.fill_(M_BIAS)
            self.theta_head.weight.zero_()
            self.theta_head.bias.fill_(THETA_BIAS)

    def gates(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``m, theta'`` ``[b, h, s]`` from hidden states ``[b, s, d_model]``."""
        u = self.u_head(hidden).transpose(1, 2)
        th = self.theta_head(hidden).transpose(1, 2)
        g = self.g.to(u.dtype)
        m = torch.clamp(1.0 + g * (u - 1.0), 0.0, 1.0)
        return m, g * th

    def forward(self, hidden: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None = None, scaling: float | None = None) -> torch.Tensor:
        """``[b, s, d_model]`` hidden + q ``[b, h, s, d]``, k/v ``[b, h_kv, s, d]`` -> ``[b, h, s, d]``."""
        if hidden.dim() != 3 or hidden.shape[0] != q.shape[0] or hidden.shape[1] != q.shape[2]:
            raise InvalidInputError(f"hidden must be [b, s, d_model] matching q {tuple(q.shape)}, "
                                    f"got {tuple(hidden.shape)}")
        if q.shape[1] != self.n_heads:
            raise InvalidInputError(f"q has {q.shape[1]} heads, this SMPrime was built for {self.n_heads}")
        m, th = self.gates(hidden)
        return smprime_attention(q, k, v, m.to(q.dtype), th.to(q.dtype), beta=self.beta.to(q.dtype),
                                 qk=self.qk.to(q.dtype), mask=mask, scaling=scaling)


__all__ = ["SMPrime", "path_modulus", "path_phase", "smprime_attention", "smprime_reference"]
