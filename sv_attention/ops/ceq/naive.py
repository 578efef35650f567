"""The plain reference of ceq: A materialised, hops applied by dense matrix products, autograd for gradients.

:func:`ceq_matrix` builds A exactly as DESIGN §2.6 writes it; :func:`ceq_attention_reference` applies it
K times and adds the stock part as plain masked softmax attention written out (not SDPA). Every path of the
operator (the row-block engine, the hop-history decoding state, the plug-in and the model) is tested
against it, outputs and gradients.
"""

from __future__ import annotations

import torch

from sv_attention.errors import InvalidInputError
from sv_attention.ops.ceq.common import (
    CeqParams,
    allowed_mask,
    check_qkv,
    repeat_kv,
    resolve_params,
    scale_of,
)
from sv_attention.ops.masking import causal_mask, to_bool_mask


def _masked_softmax(w: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax over allowed entries; rows without any allowed entry are exactly 0 (no NaN)."""
    neg = torch.finfo(w.dtype).min
    wm = w.masked_fill(~allowed, neg)
    m = wm.amax(dim=-1, keepdim=True).detach()
    e = torch.exp(wm - m) * allowed
    z = e.sum(dim=-1, keepdim=True)
    return e / torch.where(z > 0, z, torch.ones_like(z))


def a_from_logits(w: torch.Tensor, allowed: torch.Tensor, params: CeqParams) -> torch.Tensor:
    """A from scaled logits ``w [b, h, q, kv]`` and the visibility mask (plain, autograd-friendly)."""
    if params.operator == "sgate":
        pp = _masked_softmax(w, allowed)
        pm = _masked_softmax(-w, allowed)
        return (params.rho / (1.0 + params.lam)) * (pp - params.lam * pm)
    wt = w * allowed
    s = wt.abs().sum(dim=-1, keepdim=True)
    return params.rho * wt / torch.where(s > 0, s, torch.ones_like(s))


def ceq_matrix(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None = None, *, operator: str = "sgate",
               rho: float | None = None, lam: float | None = None, scaling: float | None = None) -> torch.Tensor:
    """The ceq matrix A, materialised (reference / inspection; differentiable by autograd).

    Parameters
    ----------
    q : Tensor ``[b, h, q_len, d]``
        Queries; row r is absolute position ``kv_len - q_len + r``.
    k : Tensor ``[b, h_kv, kv_len, d]``
        Keys; ``h % h_kv == 0`` (GQA: query head i reads key head ``i // (h / h_kv)``).
    mask : None or Tensor
        Anything :func:`sv_attention.ops.masking.to_bool_mask` accepts (bool True = attend, additive
        float 0 / ``<= finfo.min/2``, 2-D ``[b, kv]`` padding). Strict causality (j < i) is always
        applied on top.
    operator : {"sgate", "signed"}
    rho, lam : float, optional
        Operator gain / negative-softmax weight (defaults per operator; see :func:`resolve_params`).
    scaling : float, optional
        Logit scale; ``1/sqrt(d)`` when None.

    Returns
    -------
    Tensor ``[b, h, q_len, kv_len]``, zero on and above the (shifted) diagonal and on masked keys.
    """
    b, h, hkv, q_len, kv_len = check_qkv(q, k)
    params = resolve_params(operator, rho, lam, None)
    sc = scale_of(q.shape[-1], scaling)
    w = torch.matmul(q, repeat_kv(k, h // hkv).transpose(-1, -2)) * sc
    allowed = allowed_mask(mask, q_len, kv_len, q.device)
    return a_from_logits(w, allowed, params)


def ceq_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                            *, form: str = "hybrid", operator: str = "sgate", alpha: float | torch.Tensor = 1.0,
                            hops: int | None = None, rho: float | None = None, lam: float | None = None,
                            scaling: float | None = None) -> torch.Tensor:
    """Plain dense reference of :func:`ceq_attention` (prefill only, ``q_len == kv_len``, no dropout).

    Materialises A with :func:`ceq_matrix`, applies it K times with autograd; the stock part is plain
    masked softmax attention written out (not SDPA).
    """
    b, h, hkv, q_len, kv_len = check_qkv(q, k, v)
    if q_len != kv_len:
        raise InvalidInputError("ceq_attention_reference covers prefill only (q_len == kv_len)")
    params = resolve_params(operator, rho, lam, hops)
    a = ceq_matrix(q, k, mask, operator=operator, rho=params.rho,
                   lam=params.lam if operator == "sgate" else None, scaling=scaling)
    vr = repeat_kv(v, h // hkv)
    y, total = vr, torch.zeros_like(vr)
    for i in range(1, params.hops + 1):
        y = a @ y
        total = total + (1.0 if form == "path_sum" else alpha ** i) * y
    if form == "path_sum":
        return vr + total
    sc = scale_of(q.shape[-1], scaling)
    w = (q @ repeat_kv(k, h // hkv).transpose(-1, -2)) * sc
    vis = causal_mask(q_len, kv_len, device=q.device)[None, None]
    bm = to_bool_mask(mask, q_len, kv_len)
    if bm is not None:
        vis = vis & bm
    p = _masked_softmax(w, vis)
    return p @ vr + total
