"""Grouped softmax attention with a per-kv-head additive bias through ``scaled_dot_product_attention``.

The sv_attention readout adds the log-gate ``[b, g, q, kv]`` to the logits, so it cannot use SDPA's
``is_causal`` shortcut: a float mask makes the kernel visit every (query, key) pair, twice the work of
causal attention. :func:`grouped_biased_sdpa` splits the queries into row blocks and gives each block
only the key columns some of its rows can see (``visible``), so a causal layer does about the causal
amount of work; columns cut away are exactly the ones masked to ``-inf`` (weight 0).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

#: Query rows per SDPA call of :func:`grouped_biased_sdpa`.
ROW_BLOCK = 128


def grouped_biased_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor,
                        bias: Any, scaling: float, row_block: int = ROW_BLOCK) -> torch.Tensor:
    """Masked softmax attention with an optional additive per-kv-head bias (no weights, no dropout).

    Parameters
    ----------
    query : Tensor ``[b, h, q, d]`` (fp32 / fp64)
    key, value : Tensor ``[b, g, kv, d]`` and ``[b, g, kv, dv]`` with ``h % g == 0`` (GQA by shape)
    visible : bool Tensor ``[b, q, kv]``  True where the query row may attend the key column
    bias : Tensor ``[b, g, q | 1, kv]``, an object with ``rows(r0, r1, end) -> [b, g, r1 - r0, end]`` (the
        factored :class:`sv_attention.ops.sv_gate.gate.GateBias`), or None; added to the scaled logits (cast to
        the query dtype)
    scaling : float  logit scale
    row_block : int  query rows per call (each call keeps the key columns up to its last visible one)

    Returns
    -------
    Tensor ``[b, h, q, dv]``; rows with no visible key are 0.
    """
    b, h, q, d = query.shape
    g = key.shape[1]
    r = h // g
    if q == 0:
        return query.new_zeros(b, h, 0, value.shape[-1])
    rb = max(int(row_block), 1)
    qg = query.view(b, g, r, q, d)
    seen = visible.any(0)  # [q, kv]: columns any sequence's row may attend
    outs = []
    for r0 in range(0, q, rb):
        r1 = min(r0 + rb, q)
        cols = seen[r0:r1].any(0).nonzero()
        end = int(cols.max()) + 1 if cols.numel() else 1
        vis = visible[:, None, r0:r1, :end]  # [b, 1, rows, end]
        if bias is None:
            mask = vis
        else:
            if isinstance(bias, torch.Tensor):
                bb = bias[:, :, r0:r1, :end] if bias.shape[2] == q else bias[:, :, :, :end]
            else:  # a factored bias (sv_gate.GateBias): only this block's visible columns are built
                bb = bias.rows(r0, r1, end)
            mask = bb.to(query.dtype).masked_fill(~vis, float("-inf"))
        k_blk, v_blk = key[:, :, :end], value[:, :, :end]
        outs.append(torch.stack([F.scaled_dot_product_attention(qg[:, :, i, r0:r1], k_blk, v_blk, attn_mask=mask,
                                                                scale=scaling) for i in range(r)], 2))
    out = torch.cat(outs, dim=3) if len(outs) > 1 else outs[0]  # [b, g, r, q, dv]
    out = out.reshape(b, h, q, value.shape[-1])
    return torch.where(torch.isnan(out), torch.zeros_like(out), out)


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
