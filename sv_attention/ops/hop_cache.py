"""The ceq hop cache: decode one token in O(n) per hop.

``(A^h v)_i = sum_{j<i} A_ij (A^{h-1} v)_j``: with the hop outputs ``y_1 .. y_{K-1}`` of every earlier
position kept, a new query needs only its own row of A (O(n d)) and K matrix-vector products. The cache
is alpha-independent (``y_h`` are hop outputs, not weighted), so a learnable alpha never invalidates it.

The history lives in capacity buffers ``[b, h, cap, d]`` that decoding extends in place (one column per
new position, no copy of the earlier ones); when a buffer is full its live columns move to a new one of
twice the needed size (:func:`reserve_columns`), so appending costs amortised O(1) copies per position.

One :class:`HopCache` holds one layer's history; :class:`HopCaches` is a lazily-filled per-layer
container with the same ``crop`` / ``reset`` / ``reorder`` applied to every layer, meant to sit beside
(or inside) a transformers ``Cache`` whose key/value tensors it mirrors position for position.
"""

from __future__ import annotations

import torch

from sv_attention.errors import HopCacheError, InvalidInputError
from sv_attention.ops.ceq import DEFAULT_CHUNK, _check_qkv, ceq_attention, resolve_params

PREFILL_HEADROOM = 128
"""Free columns a prefill reserves after its own for the decoding steps that follow (before a regrowth)."""


def take_columns(bufs: list[torch.Tensor], start: int, live: int, need: int,
                 rows: torch.Tensor | None = None) -> list[torch.Tensor]:
    """New capacity buffers with the live columns ``[start, start + live)`` of ``bufs`` at ``[0, live)``.

    Parameters
    ----------
    bufs : tensors ``[b, x, cap, ...]`` (the column axis is dim 2)
    start, live : the live columns
    need : columns the new buffers must offer (``>= live``); they get ``2 * need`` (capacity doubling)
    rows : optional batch rows to take (``index_select`` on dim 0: beam reorder / selection)

    Returns
    -------
    list of tensors ``[b', x, 2 * need, ...]``; columns ``>= live`` are uninitialised.
    """
    out = []
    for t in bufs:
        src = t[:, :, start:start + live]
        if rows is not None:
            src = src.index_select(0, rows.to(t.device))
        new = t.new_empty(src.shape[0], t.shape[1], 2 * max(need, 1), *t.shape[3:])
        new[:, :, :live] = src
        out.append(new)
    return out


def reserve_columns(bufs: list[torch.Tensor], start: int, live: int, need: int) -> tuple[list[torch.Tensor], int]:
    """Make columns ``[start, start + need)`` of the capacity buffers available (``need >= live``).

    The buffers are returned unchanged while they are large enough (and writable: inference-mode tensors
    cannot be updated in place outside inference mode); otherwise the live columns ``[start, start + live)``
    move to new buffers of capacity ``2 * need`` (:func:`take_columns`) and the new start is 0. Returns
    ``(bufs, start)``.
    """
    if not bufs:
        return bufs, start
    writable = not bufs[0].is_inference() or torch.is_inference_mode_enabled()
    if writable and start + need <= bufs[0].shape[2]:
        return bufs, start
    return take_columns(bufs, start, live, need), 0


class HopCache:
    """One layer's hop history: ``y_1 .. y_{K-1}`` of the cached positions, in capacity buffers.

    Attributes
    ----------
    history : list of Tensor (read-only property)
        ``K - 1`` views ``[b, h, length, d]`` (empty for K = 1) into the capacity buffers.
    length : int
        Number of cached positions (must equal the key/value cache length before each decode call).
    signature : tuple or None
        ``(operator, rho, lam, hops, scaling)`` of the call that filled it; a decode call with a
        different signature raises :class:`HopCacheError`.
    """

    def __init__(self) -> None:
        self.store: list[torch.Tensor] = []  # K-1 buffers [b, h, cap, d]; columns [:length] are live
        self.length: int = 0
        self.batch: int | None = None
        self.signature: tuple | None = None

    @property
    def history(self) -> list[torch.Tensor]:
        return [t[:, :, :self.length] for t in self.store]

    def __len__(self) -> int:
        return self.length

    def __repr__(self) -> str:
        return f"HopCache(length={self.length}, batch={self.batch}, signature={self.signature})"

    def reset(self) -> None:
        """Forget everything (the next call must be a prefill)."""
        self.store, self.length, self.batch, self.signature = [], 0, None, None

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` positions (negative: drop that many from the end), like
        ``DynamicCache.crop``. Cropping to a length >= the current one is a no-op. O(1): the dropped
        columns are overwritten by the next decoding steps."""
        if isinstance(max_length, bool) or not isinstance(max_length, int):
            raise InvalidInputError(f"crop length must be an int, got {max_length!r}")
        n = self.length + max_length if max_length < 0 else max_length
        if n < 0:
            raise InvalidInputError(f"cannot crop {-max_length} positions from a cache of length {self.length}")
        if n >= self.length:
            return
        self.length = n
        if n == 0:
            self.reset()

    def reorder(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch (beam search): row r becomes old row ``beam_idx[r]``."""
        if self.batch is None:
            return
        idx = torch.as_tensor(beam_idx, dtype=torch.long)
        if idx.dim() != 1 or (idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.batch)):
            raise InvalidInputError(f"beam_idx must be 1-D with entries in [0, {self.batch}), got {idx.tolist()}")
        self.store = take_columns(self.store, 0, self.length, self.length + PREFILL_HEADROOM, rows=idx)
        self.batch = int(idx.numel())

    reorder_cache = reorder

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows ``indices`` (transformers' contrastive search hook)."""
        self.reorder(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times (transformers' beam expansion hook)."""
        if self.batch is None:
            return
        self.reorder(torch.arange(self.batch).repeat_interleave(repeats))

    def fill(self, bufs: list[torch.Tensor], signature: tuple) -> None:
        """Store ``y_1 .. y_{K-1}`` (all positions) from :func:`ceq_attention`'s hop outputs (``_sink``)."""
        hops = signature[3]
        self.store = [t.detach() for t in bufs[: hops - 1]]
        self.length = bufs[0].shape[2]
        self.batch = bufs[0].shape[0]
        self.signature = signature


class HopCaches:
    """Per-layer :class:`HopCache` container (created on first use of a layer index).

    ``crop`` / ``reset`` / ``reorder`` / ``batch_select_indices`` / ``batch_repeat_interleave`` are
    applied to every layer, so a transformers ``Cache`` subclass can forward its own hooks here.
    """

    def __init__(self) -> None:
        self.layers: dict[int, HopCache] = {}

    def layer(self, layer_idx: int) -> HopCache:
        """The cache of layer ``layer_idx`` (created empty on first access)."""
        if layer_idx not in self.layers:
            self.layers[layer_idx] = HopCache()
        return self.layers[layer_idx]

    __getitem__ = layer

    def __len__(self) -> int:
        return len(self.layers)

    def reset(self) -> None:
        for c in self.layers.values():
            c.reset()

    def crop(self, max_length: int) -> None:
        for c in self.layers.values():
            c.crop(max_length)

    def reorder(self, beam_idx: torch.LongTensor) -> None:
        for c in self.layers.values():
            c.reorder(beam_idx)

    reorder_cache = reorder

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for c in self.layers.values():
            c.batch_select_indices(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        for c in self.layers.values():
            c.batch_repeat_interleave(repeats)


def ceq_attention_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         hop_cache: HopCache, *, form: str = "hybrid", operator: str = "sgate",
                         alpha: float | torch.Tensor = 1.0, hops: int | None = None, rho: float | None = None,
                         lam: float | None = None, scaling: float | None = None, dropout: float = 0.0,
                         training: bool = False, is_causal: bool | None = None,
                         chunk_size: int | None = DEFAULT_CHUNK, fuse_stock: bool = True) -> torch.Tensor:
    """:func:`sv_attention.ops.ceq.ceq_attention` with a hop cache: prefill fills it, decode extends it.

    Parameters
    ----------
    q : ``[b, h, q_len, d]``; k, v : ``[b, h_kv, kv_len, d]`` (the full key/value cache after update)
    mask : as for :func:`ceq_attention` (None, 4-D bool / additive float, 2-D padding).
    hop_cache : HopCache
        This layer's cache. ``q_len == kv_len``: prefill — the cache is reset and filled.
        ``q_len < kv_len``: decode — the cache must hold exactly ``kv_len - q_len`` positions, filled with
        the same operator / rho / lam / hops / scaling; it is extended by ``q_len`` positions.
    form, operator, alpha, hops, rho, lam, scaling, dropout, training, is_causal, chunk_size, fuse_stock
        As for :func:`ceq_attention`.

    Returns
    -------
    Tensor ``[b, h, q_len, d]``, equal to the rows of a full prefill (fp64 <= 1e-12, fp32 <= 1e-6).

    Raises
    ------
    HopCacheError
        The cache length is not ``kv_len - q_len``, or its batch / heads / operator signature differ.
        The cache is left unchanged on any error.
    """
    if not isinstance(hop_cache, HopCache):
        raise InvalidInputError(f"hop_cache must be a HopCache, got {type(hop_cache).__name__}")
    b, h, hkv, q_len, kv_len = _check_qkv(q, k, v)
    params = resolve_params(operator, rho, lam, hops)
    signature = (params.operator, params.rho, params.lam, params.hops, None if scaling is None else float(scaling))
    past = kv_len - q_len
    dv = v.shape[-1]
    if past > 0:
        if hop_cache.length != past:
            raise HopCacheError(
                f"hop cache holds {hop_cache.length} positions but the call has kv_len - q_len = {past}; "
                "the hop cache must mirror the key/value cache (crop / reset it together with that cache)")
        if hop_cache.signature != signature:
            raise HopCacheError(f"hop cache was filled with {hop_cache.signature}, this call uses {signature}; "
                                "reset the cache and prefill again")
        if hop_cache.batch != b or any(t.shape[1] != h or t.shape[3] != dv for t in hop_cache.store):
            raise HopCacheError(f"hop cache batch/heads ({hop_cache.batch}) do not match the call (b={b}, h={h})")
        store, _ = reserve_columns(hop_cache.store, 0, past, kv_len)
    else:
        store = [q.new_empty(b, h, kv_len + PREFILL_HEADROOM, dv) for _ in range(params.hops - 1)]
    # the query rows are written at columns [past, kv_len), beyond the live ones: an error leaves the cache as is
    out = ceq_attention(q, k, v, mask, form=form, operator=operator, alpha=alpha, hops=params.hops,
                        rho=params.rho, lam=params.lam if params.operator == "sgate" else None, scaling=scaling,
                        dropout=dropout, training=training, is_causal=is_causal, chunk_size=chunk_size,
                        fuse_stock=fuse_stock, _store=store)
    hop_cache.store, hop_cache.length, hop_cache.batch, hop_cache.signature = store, kv_len, b, signature
    return out


__all__ = ["PREFILL_HEADROOM", "HopCache", "HopCaches", "ceq_attention_cached", "reserve_columns",
           "take_columns"]
