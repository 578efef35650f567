"""The eager gated readout: grouped softmax attention with an optional per-kv-head additive bias.

:func:`grouped_attention` is the plain formula with explicit weights (used when the weights are wanted, for
dropout, half precision, or no gate at all) and the reference of the fused readout
(:func:`sv_attention.ops.sv_gate.fused.fused_gated_sdpa`, the path a gated fp32 / fp64 call takes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor,
                      bias: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention with an optional per-kv-head additive bias, explicit weights (the eager
    formula: used when the weights are wanted, for dropout, half precision, or no gate at all).

    Parameters
    ----------
    query : Tensor ``[b, h, q, d]``; key, value : Tensor ``[b, g, kv, d]`` (``h % g == 0``)
    visible : bool Tensor ``[b, q, kv]``
    bias : Tensor ``[b, g, q | 1, kv]`` or None  added to the scaled logits
    scaling : float
    dropout : float  dropout probability on the weights (0: none)

    Returns
    -------
    ``(out [b, h, q, dv], weights [b, h, q, kv])``; rows with no visible key are 0.
    """
    b, h, q, d = query.shape
    g, kv = key.shape[1], key.shape[2]
    r = h // g
    logits = torch.matmul(query.reshape(b, g, r * q, d), key.transpose(-1, -2)).view(b, g, r, q, kv) * scaling
    if bias is not None:  # fp32 bias: the softmax runs in fp32 anyway
        logits = logits.to(torch.promote_types(logits.dtype, bias.dtype)) + bias[:, :, None]
    allowed = visible[:, None, None]
    logits = logits.masked_fill(~allowed, float("-inf"))
    w = torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    w = torch.where(torch.isnan(w), torch.zeros_like(w), w).to(query.dtype)  # rows with nothing visible
    if dropout > 0.0:
        w = F.dropout(w, p=dropout, training=True)
    out = torch.matmul(w.reshape(b, g, r * q, kv), value).view(b, h, q, value.shape[-1])
    return out, w.reshape(b, h, q, kv)
