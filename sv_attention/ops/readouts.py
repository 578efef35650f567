"""SV readouts on ``[batch, heads, seq, dim]`` tensors (DESIGN §2.1), each with a plain reference.

Both readouts weight every visible key j of query i by a base weight times a non-negative **gate**
``W_ij`` (alpha_j on the gated long-range prefix, 1 on the local window, 0 on blocked slots) and
renormalise:

    out_i = sum_j b_ij W_ij v_j / sum_j b_ij W_ij

* **softmax-hybrid** (the one that works inside language models): ``b_ij = exp(s q_i . k_j)``, i.e.
  softmax weights over the visible keys multiplied by the gate, then renormalised;
* **rbf**: ``b_ij = k(q_i, k_j) = exp(-||q_i - k_j||^2 / sigma^2)``; with ``W = alpha`` on every key
  this is ``o(q) = sum_i alpha_i k(q, x_i) v_i / sum_i alpha_i k(q, x_i)``.

Both are computed in the log domain (the row maximum is taken over keys with a positive gate) so tiny
gates and distant keys do not underflow. A row with no visible key of positive gate returns 0 (not NaN).
"""

from __future__ import annotations

import torch

from sv_attention.errors import InvalidInputError


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise InvalidInputError(f"q, k, v must be [batch, heads, seq, dim]; got {tuple(q.shape)}, "
                                f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:3] != v.shape[:3] or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise InvalidInputError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                                "(repeat GQA kv-heads before calling a readout)")


def gated_readout_from_logits(logits: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None,
                              mask: torch.Tensor | None, return_weights: bool = False,
                              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``out_i = sum_j exp(l_ij) W_ij v_j / sum_j exp(l_ij) W_ij`` over keys allowed by ``mask``.

    Parameters
    ----------
    logits : Tensor ``[b, h, q, kv]``
    v : Tensor ``[b, h, kv, dv]``
    gate : Tensor broadcastable to ``[b, h, q, kv]``, non-negative, or None (all ones)
    mask : bool Tensor broadcastable to ``[b, h, q, kv]`` (True = attend) or None
    return_weights : bool  also return the normalised weights ``[b, h, q, kv]``

    Returns
    -------
    (out ``[b, h, q, dv]``, weights or None)
    """
    live = torch.ones_like(logits, dtype=torch.bool) if mask is None else mask.expand_as(logits)
    if gate is not None:
        live = live & (gate > 0).expand_as(logits)
    neg = torch.finfo(logits.dtype).min
    masked = torch.where(live, logits, torch.full_like(logits, neg))
    m = masked.amax(-1, keepdim=True).detach()
    m = torch.where(m > neg, m, torch.zeros_like(m))
    e = torch.exp(torch.where(live, logits - m, torch.full_like(logits, neg)))
    e = torch.where(live, e, torch.zeros_like(e))
    if gate is not None:
        e = e * torch.where(live, gate.expand_as(logits), torch.zeros_like(e))
    den = e.sum(-1, keepdim=True)
    has = den > 0
    w = e / torch.where(has, den, torch.ones_like(den))
    out = w @ v
    return out, (w if return_weights else None)


def softmax_hybrid_readout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None,
                           mask: torch.Tensor | None = None, scaling: float | None = None,
                           return_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax-hybrid readout: softmax weights over visible keys times the gate, renormalised.

    Parameters
    ----------
    q : Tensor ``[b, h, q_len, d]``; k : Tensor ``[b, h, kv_len, d]``; v : Tensor ``[b, h, kv_len, dv]``
    gate : Tensor broadcastable to ``[b, h, q_len, kv_len]`` (>= 0) or None (plain softmax attention)
    mask : bool Tensor broadcastable to ``[b, h, q_len, kv_len]`` (True = attend) or None
    scaling : float or None (default ``1 / sqrt(d)``)
    return_weights : bool, default False

    Returns
    -------
    (out ``[b, h, q_len, dv]``, weights ``[b, h, q_len, kv_len]`` or None)
    """
    _check(q, k, v)
    s = q.shape[-1] ** -0.5 if scaling is None else scaling
    if not return_weights and (gate is None or not (torch.is_grad_enabled() and gate.requires_grad)):
        fast = _sdpa_readout(q, k, v, gate, mask, s)
        if fast is not None:
            return fast, None
    return gated_readout_from_logits((q @ k.transpose(-1, -2)) * s, v, gate, mask, return_weights)


def _sdpa_readout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None,
                  mask: torch.Tensor | None, scale: float) -> torch.Tensor | None:
    """Fused path for a gate without gradient: ``softmax(s q k^T + log W)`` with torch SDPA.

    Multiplying the softmax weights by ``W`` and renormalising is the softmax of the logits plus
    ``log W`` (``-inf`` where ``W = 0`` or the mask blocks), so the fused kernel computes the same
    readout (and its gradient w.r.t. q, k, v) without materialising the weights for the backward.
    Returns None (caller uses the explicit path) when some query row has no live key.
    """
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    live = torch.ones(shape, dtype=torch.bool, device=q.device) if mask is None else mask.expand(shape)
    if gate is not None:
        live = live & (gate > 0).expand(shape)
    if not bool(live.any(-1).all()):
        return None
    if gate is None:
        bias = torch.zeros(shape, dtype=q.dtype, device=q.device)
    else:
        bias = torch.log(gate.detach().to(q.dtype).expand(shape).clamp_min(torch.finfo(q.dtype).tiny))
    bias = bias.masked_fill(~live, float("-inf"))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)


def rbf_logits(q: torch.Tensor, k: torch.Tensor, sigma: float | torch.Tensor) -> torch.Tensor:
    """``-||q_i - k_j||^2 / sigma^2`` as ``[b, h, q, kv]``; ``sigma`` a float or broadcastable to
    ``[b, h, 1, 1]`` (e.g. ``[b, h]`` gives one bandwidth per (batch, head))."""
    if isinstance(sigma, torch.Tensor) and sigma.dim() == 2:
        sigma = sigma[:, :, None, None]
    d2 = (q * q).sum(-1)[..., :, None] + (k * k).sum(-1)[..., None, :] - 2.0 * (q @ k.transpose(-1, -2))
    return -d2.clamp_min(0.0) / (sigma * sigma)


def rbf_readout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None,
                sigma: float | torch.Tensor, mask: torch.Tensor | None = None, return_weights: bool = False,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RBF readout ``sum_j W_ij k(q_i, k_j) v_j / sum_j W_ij k(q_i, k_j)`` (kernel ``exp(-d^2/sigma^2)``).

    Parameters
    ----------
    q, k, v, gate, mask, return_weights : as :func:`softmax_hybrid_readout`
    sigma : float or Tensor ``[b, h]`` / broadcastable to ``[b, h, 1, 1]``

    Returns
    -------
    (out ``[b, h, q_len, dv]``, weights or None)
    """
    _check(q, k, v)
    return gated_readout_from_logits(rbf_logits(q, k, sigma), v, gate, mask, return_weights)


# ----------------------------------------------------------------------------- plain references
def readout_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None,
                      mask: torch.Tensor | None = None, *, kind: str = "softmax", scaling: float | None = None,
                      sigma: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Plain loops over (batch, head, query): the obviously-correct version of both readouts.

    For every query: collect the visible keys with positive gate, compute their base weights
    (``exp(s q.k)`` or ``exp(-||q-k||^2/sigma^2)``) relative to their maximum, multiply by the gate,
    normalise, sum the values. Returns ``[b, h, q_len, dv]``.
    """
    b, h, nq, d = q.shape
    nk = k.shape[2]
    s = d ** -0.5 if scaling is None else scaling
    gate_full = None if gate is None else gate.expand(b, h, nq, nk)
    mask_full = None if mask is None else mask.expand(b, h, nq, nk)
    out = torch.zeros(b, h, nq, v.shape[-1], dtype=v.dtype)
    for bi in range(b):
        for hi in range(h):
            sig = sigma[bi, hi] if isinstance(sigma, torch.Tensor) and sigma.dim() == 2 else sigma
            for i in range(nq):
                js = [j for j in range(nk)
                      if (mask_full is None or bool(mask_full[bi, hi, i, j]))
                      and (gate_full is None or float(gate_full[bi, hi, i, j].detach()) > 0)]
                if not js:
                    continue
                if kind == "softmax":
                    logit = torch.stack([(q[bi, hi, i] * k[bi, hi, j]).sum() * s for j in js])
                else:
                    logit = torch.stack([-((q[bi, hi, i] - k[bi, hi, j]) ** 2).sum() / sig**2 for j in js])
                w = torch.exp(logit - logit.max())
                if gate_full is not None:
                    w = w * torch.stack([gate_full[bi, hi, i, j] for j in js])
                w = w / w.sum()
                out[bi, hi, i] = sum(w[t] * v[bi, hi, j] for t, j in enumerate(js))
    return out
