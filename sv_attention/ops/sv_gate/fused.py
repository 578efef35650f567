"""The fused readout: the log-gate folded into the attention's dot products, one SDPA call per layer.

The gated readout is ``softmax(scale q_r . k_j + bias[r, j])`` with the factored log-gate
(:class:`~sv_attention.ops.sv_gate.gate.GateBias`) ``bias[b, g, r, j] = log_table[b, g, slot[b, r],
key_position[b, j]]``: every query row reads one of ``T`` gated slots (or none), and a slot's bias is a
vector over the keys. Appending ``T`` columns to every key and ``T`` to every query,

    k'_j = [k_j, L_j]     with L_j[t] = log_table[t, key_position[j]]   (t = 0 .. T-1)
    q'_r = [scale q_r, e_slot(r)]   (the slot's one-hot; the zero vector for an ungated row)

gives ``q'_r . k'_j = scale q_r . k_j + bias[r, j]``: the one-hot picks one column and every other product
is an exact 0. So SDPA with ``scale=1`` on ``(q', k', v)`` is the gated readout, and it runs torch's fused
kernel -- with ``is_causal`` (tile skipping) when the visibility is plain causal -- forward and backward,
instead of a float mask the size of the attention matrix. The values get zero columns up to the same
head dim (the fused CPU kernel needs equal head dims); the output drops them.

``log 0 = -inf`` on reserve keys becomes :data:`NEG_BIAS` (a finite ``-inf`` would give ``0 * -inf = NaN``
in the other slots' products): ``exp`` of it underflows to exactly 0 in float32 and float64, so a reserve
key's weight stays exactly 0, and its gradient too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sv_attention.ops.sv_gate.gate import GateBias
from sv_attention.ops.sv_gate.visibility import summarize

#: Stand-in for ``log 0`` in the key columns (exp(NEG_BIAS + x) == 0 for any logit x in fp32 / fp64).
NEG_BIAS = -1e30


def gate_columns(bias: GateBias | torch.Tensor, b: int, g: int, q: int, kv: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The key columns and query one-hots of a log-gate.

    Parameters
    ----------
    bias : GateBias (causal: ``log_table [b, g, T + 1, P]``, last slot ungated) or Tensor ``[b, g, 1, kv]``
        (one gate for every row: a non-causal layer)

    Returns
    -------
    cols : Tensor ``[b, g, kv, T]``  ``L_j[t]`` (``-inf`` replaced by :data:`NEG_BIAS`)
    onehot : Tensor ``[b, q, T]``  each row's slot (zeros for an ungated row)
    """
    if isinstance(bias, GateBias):
        T = bias.log_table.shape[2] - 1  # the last slot is "ungated" (log 1 = 0 everywhere)
        cols = bias.log_table[:, :, :T].gather(3, bias.key_position[:, None, None, :].expand(b, g, T, kv))
        cols = cols.transpose(2, 3)
        onehot = (bias.slot[:, :, None] == torch.arange(T, device=bias.slot.device)).to(dtype)
    else:
        if bias.shape[2] != 1:
            raise ValueError(f"a tensor bias must be [b, g, 1, kv] (one gate per row), got {tuple(bias.shape)}")
        cols = bias.transpose(2, 3)
        onehot = torch.ones(b, q, 1, dtype=dtype, device=bias.device)
    return cols.to(dtype).clamp_min(NEG_BIAS), onehot


def fused_gated_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor,
                     bias: GateBias | torch.Tensor, scaling: float) -> torch.Tensor:
    """Masked softmax attention with the log-gate added to the logits, as one fused SDPA call.

    Parameters
    ----------
    query : Tensor ``[b, h, q, d]`` (fp32 / fp64)
    key, value : Tensor ``[b, g, kv, d]`` and ``[b, g, kv, dv]`` (``h % g == 0``: GQA by shape)
    visible : bool Tensor ``[b, q, kv]``  True where the query row may attend the key column
    bias : GateBias or Tensor ``[b, g, 1, kv]``  (see :func:`gate_columns`)
    scaling : float  logit scale

    Returns
    -------
    Tensor ``[b, h, q, dv]``; rows with no visible key are 0 (and pass no gradient).
    """
    b, h, q, d = query.shape
    g, kv, dv = key.shape[1], key.shape[2], value.shape[-1]
    if q == 0:
        return query.new_zeros(b, h, 0, dv)
    if q == 1:  # a decoding step: the bias is one row, a float mask costs less than widening every key
        return _one_row(query, key, value, visible, bias, scaling)
    empty = None
    seen_by = summarize(visible)  # remembered per mask: every layer of a forward reads the same one
    if seen_by.all_visible:  # a decoding step, an unpadded encoder: no mask
        mask: dict = {}
    elif seen_by.plain_causal:
        if q >= SEGMENTS_MIN_ROWS and isinstance(bias, GateBias) and not (torch.is_grad_enabled() and any(
                t.requires_grad for t in (query, key, value, bias.log_table))):
            out = _causal_by_segments(query, key, value, bias, scaling)
            if out is not None:
                return out
        mask = {"is_causal": True}  # plain causal: the kernel skips the tiles above the diagonal
    else:
        visible, empty = _read_key_zero_if_blind(visible)
        mask = {"attn_mask": visible[:, None]}
    # (built only here: the segment path above reads the keys as they are)
    cols, onehot = gate_columns(bias, b, g, q, kv, query.dtype)
    T = cols.shape[-1]
    width = max(d + T, dv)
    q2 = torch.cat([query * scaling, onehot[:, None].expand(b, h, q, T)], -1)
    k2 = torch.cat([key, cols], -1)
    if width > d + T:
        q2, k2 = F.pad(q2, (0, width - d - T)), F.pad(k2, (0, width - d - T))
    v2 = F.pad(value, (0, width - dv))
    out = F.scaled_dot_product_attention(q2, k2, v2, scale=1.0, enable_gqa=h != g, **mask)[..., :dv]
    if empty is not None:
        out = out * (~empty)[:, None, :, None].to(out.dtype)
    return out


#: A plain-causal call of at least this many rows, without autograd, takes :func:`_causal_by_segments` (measured
#: break-even against the one fused call between 512 and 1024 rows: 8 heads over 2 kv-heads, head dim 32, chunk 64).
SEGMENTS_MIN_ROWS = 1024


def _causal_by_segments(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: GateBias,
                        scaling: float) -> torch.Tensor | None:
    """:func:`fused_gated_sdpa` for a plain-causal prefill without autograd, segment by segment.

    The rows of a segment (a run of rows reading the same gate slot: a chunk, or the ungated chunks of the
    warm-up) see the keys before the segment with the slot's log-gate, and the keys of their own segment
    causally with bias 0 (a slot's gate covers only keys before its boundary). So each segment is two flash
    attentions at the model's own head dimension -- the earlier keys with the gate row as a float mask
    (broadcast over the rows; the query heads of a kv head stacked as rows, so neither the keys nor the mask
    are expanded per head), the segment itself with ``is_causal`` (all segments of one length in one call,
    :func:`_causal_blocks`) -- merged by their log-sum-exps (torch's CPU flash kernel returns them), in one
    pass over all the rows. Against the one fused call (31 gate columns next to each key's features) this
    halves the work of a long prefill. Returns None (the caller uses the fused call) when the rows of the
    batch read different slots, a slot's bias is not 0 inside its own segment, or the values' head size
    differs from the queries'.
    """
    b, h, q, d = query.shape
    g = key.shape[1]
    slot = bias.slot
    if value.shape[-1] != d:  # (the CPU flash kernel needs one head size)
        return None
    if not bool(torch.equal(slot, slot[:1].expand_as(slot))) or not bool(torch.equal(
            bias.key_position, torch.arange(q, device=slot.device).expand_as(bias.key_position))):
        return None
    starts = ((slot[0, 1:] != slot[0, :-1]).nonzero().flatten() + 1).tolist()
    bounds = list(zip([0, *starts], [*starts, q]))
    slots = slot[0, [r0 for r0, _ in bounds]].tolist()
    table = bias.log_table  # [b, g, T + 1, q]: key position = column
    # every column j belongs to one segment, whose slot is the slot of row j: its bias there must be 0
    own = table.gather(2, slot[0].expand(b, g, 1, q)) if table.shape[2] > 1 else table
    if not bool((own == 0).all()):
        return None
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    r = h // g
    out = query.new_empty(b, h, q, d)
    # the first segment sees no earlier key: its causal block is its output
    r0, r1 = bounds[0]
    out[:, :, r0:r1] = flash(query[:, :, r0:r1], key[:, :, r0:r1], value[:, :, r0:r1], 0.0, True, scale=scaling)[0]
    if len(bounds) == 1:
        return out
    start = bounds[1][0]
    local, lse_local = _causal_blocks(query, key, value, bounds[1:], scaling)  # [b, h, q - start, d], [b, h, q - start]
    prefix = query.new_empty(b, h, q - start, d)
    lse_prefix = query.new_empty(b, h, q - start)
    for (r0, r1), i in zip(bounds[1:], slots[1:]):
        # the r query heads of a kv head as r (r1 - r0) rows of one call: the gate row [b, g, 1, r0] is the float
        # mask of all of them, broadcast, and the keys are not expanded per query head
        rows = query[:, :, r0:r1].reshape(b, g, r * (r1 - r0), d)
        gate_row = table[:, :, i, None, :r0].clamp_min(NEG_BIAS)
        o, lse = flash(rows, key[:, :, :r0], value[:, :, :r0], 0.0, False, attn_mask=gate_row, scale=scaling)
        prefix[:, :, r0 - start:r1 - start] = o.reshape(b, h, r1 - r0, d)
        lse_prefix[:, :, r0 - start:r1 - start] = lse.reshape(b, h, r1 - r0)
    # the two parts of every row, weighted by their log-sum-exps (one pass over all the gated rows)
    top = torch.maximum(lse_local, lse_prefix)
    w_local, w_prefix = lse_local.sub_(top).exp_(), lse_prefix.sub_(top).exp_()
    total = w_local + w_prefix
    torch.mul(local, w_local.div_(total)[..., None], out=out[:, :, start:])
    out[:, :, start:].addcmul_(prefix, w_prefix.div_(total)[..., None])
    return out


def _causal_blocks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[tuple[int, int]],
                   scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each segment of ``bounds`` (consecutive, from ``bounds[0][0]`` to the end) on its
    own keys, with its log-sum-exps: ``[b, h, rows, d]`` and ``[b, h, rows]``. Segments of one length run as
    the batch of one flash call (a prefill's chunks: one call instead of one per chunk)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    b, h, _, d = query.shape
    start, end = bounds[0][0], bounds[-1][1]
    length = bounds[0][1] - bounds[0][0]
    m = 1  # the leading run of segments of one length, batched
    while m < len(bounds) and bounds[m][1] - bounds[m][0] == length:
        m += 1
    mid = start + m * length

    def blocks(x: torch.Tensor) -> torch.Tensor:  # [b, H, m L, d] -> [b m, H, L, d]
        x = x[:, :, start:mid]
        return x.reshape(b, x.shape[1], m, length, d).transpose(1, 2).reshape(b * m, x.shape[1], length, d)

    o, lse = flash(blocks(query), blocks(key), blocks(value), 0.0, True, scale=scaling)
    local = o.reshape(b, m, h, length, d).transpose(1, 2).reshape(b, h, m * length, d)
    lse_local = lse.reshape(b, m, h, length).transpose(1, 2).reshape(b, h, m * length)
    if mid == end:
        return local, lse_local
    rest = [flash(query[:, :, r0:r1], key[:, :, r0:r1], value[:, :, r0:r1], 0.0, True, scale=scaling)
            for r0, r1 in bounds[m:]]
    return torch.cat([local] + [p[0] for p in rest], 2), torch.cat([lse_local] + [p[1] for p in rest], 2)


def _one_row(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor,
             bias: GateBias | torch.Tensor, scaling: float) -> torch.Tensor:
    """:func:`fused_gated_sdpa` for one query row: the ``r = h / g`` query heads of a kv-head become ``r`` rows
    of one SDPA call per kv-head, so the bias row ``[b, g, 1, kv]`` is SDPA's float mask as it is (no copy per
    query head, no GQA expansion of the keys)."""
    b, h, _, d = query.shape
    g, kv = key.shape[1], key.shape[2]
    row = bias.rows(0, 1, kv) if isinstance(bias, GateBias) else bias  # [b, g, 1, kv]
    row = row.to(query.dtype)
    empty = None
    if not bool(visible.all()):
        visible, empty = _read_key_zero_if_blind(visible)
        row = row.masked_fill(~visible[:, None], float("-inf"))
        if empty is not None:  # a blind row's key 0 gets bias 0 (its own gate may be log 0 = -inf)
            row = torch.where(empty[:, None, :, None] & (torch.arange(kv, device=row.device) == 0),
                              torch.zeros_like(row), row)
    out = F.scaled_dot_product_attention(query.reshape(b, g, h // g, d), key, value, attn_mask=row, scale=scaling)
    out = out.reshape(b, h, 1, value.shape[-1])
    return out if empty is None else out * (~empty)[:, None, :, None].to(out.dtype)


def _read_key_zero_if_blind(visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``visible [b, q, kv]`` with key 0 made visible to every row that sees nothing (so the softmax stays
    finite, forward and backward), and those rows ``[b, q]`` (None when there are none) for the caller to zero."""
    empty = ~visible.any(-1)
    if not bool(empty.any()):
        return visible, None
    return visible | (empty[:, :, None] & (torch.arange(visible.shape[-1], device=visible.device) == 0)), empty
