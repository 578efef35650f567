"""The ceq hop cache: decode one token in O(n) per hop.

``(A^h v)_i = sum_{j<i} A_ij (A^{h-1} v)_j``: with the hop outputs ``y_1 .. y_{K-1}`` of every earlier
position kept, a new query needs only its own row of A (O(n d)) and K matrix-vector products. The cache
is alpha-independent (``y_h`` are hop outputs, not weighted), so a learnable alpha never invalidates it.

One :class:`HopCache` holds one layer's history; :class:`HopCaches` is a lazily-filled per-layer
container with the same ``crop`` / ``reset`` / ``reorder`` applied to every layer, meant to sit beside
(or inside) a transformers ``Cache`` whose key/value tensors it mirrors position for position.
"""

from __future__ import annotations

import torch

from sv_attention.errors import HopCacheError, InvalidInputError
from sv_attention.ops.ceq import DEFAULT_CHUNK, _check_qkv, ceq_attention, resolve_params


class HopCache:
    """One layer's hop history: ``y_1 .. y_{K-1}``, each ``[b, h, n, d]`` (n = cached positions).

    Attributes
    ----------
    history : list of Tensor
        ``K - 1`` tensors ``[b, h, length, d]`` (empty for K = 1).
    length : int
        Number of cached positions (must equal the key/value cache length before each decode call).
    signature : tuple or None
        ``(operator, rho, lam, hops, scaling)`` of the call that filled it; a decode call with a
        different signature raises :class:`HopCacheError`.
    """

    def __init__(self) -> None:
        self.history: list[torch.Tensor] = []
        self.length: int = 0
        self.batch: int | None = None
        self.signature: tuple | None = None

    def __len__(self) -> int:
        return self.length

    def __repr__(self) -> str:
        return f"HopCache(length={self.length}, batch={self.batch}, signature={self.signature})"

    def reset(self) -> None:
        """Forget everything (the next call must be a prefill)."""
        self.history, self.length, self.batch, self.signature = [], 0, None, None

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` positions (negative: drop that many from the end), like
        ``DynamicCache.crop``. Cropping to a length >= the current one is a no-op."""
        if isinstance(max_length, bool) or not isinstance(max_length, int):
            raise InvalidInputError(f"crop length must be an int, got {max_length!r}")
        n = self.length + max_length if max_length < 0 else max_length
        if n < 0:
            raise InvalidInputError(f"cannot crop {-max_length} positions from a cache of length {self.length}")
        if n >= self.length:
            return
        self.history = [t[:, :, :n].clone() for t in self.history]
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
        self.history = [t.index_select(0, idx.to(t.device)) for t in self.history]
        self.batch = int(idx.numel())

    reorder_cache = reorder

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows ``indices`` (transformers' contrastive search hook)."""
        self.reorder(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times (transformers' beam expansion hook)."""
        if self.batch is None:
            return
        self.history = [t.repeat_interleave(repeats, dim=0) for t in self.history]
        self.batch *= repeats

    def fill(self, bufs: list[torch.Tensor], signature: tuple) -> None:
        """Store ``y_1 .. y_{K-1}`` (all positions) from :func:`ceq_attention`'s hop outputs."""
        hops = signature[3]
        hist = [t.detach() for t in bufs[: hops - 1]]
        self.history = hist
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
    history = None
    if past > 0:
        if hop_cache.length != past:
            raise HopCacheError(
                f"hop cache holds {hop_cache.length} positions but the call has kv_len - q_len = {past}; "
                "the hop cache must mirror the key/value cache (crop / reset it together with that cache)")
        if hop_cache.signature != signature:
            raise HopCacheError(f"hop cache was filled with {hop_cache.signature}, this call uses {signature}; "
                                "reset the cache and prefill again")
        if hop_cache.batch != b or any(t.shape[1] != h for t in hop_cache.history):
            raise HopCacheError(f"hop cache batch/heads ({hop_cache.batch}) do not match the call (b={b}, h={h})")
        history = hop_cache.history
    sink: list[torch.Tensor] = []
    out = ceq_attention(q, k, v, mask, form=form, operator=operator, alpha=alpha, hops=params.hops,
                        rho=params.rho, lam=params.lam if params.operator == "sgate" else None, scaling=scaling,
                        dropout=dropout, training=training, is_causal=is_causal, chunk_size=chunk_size,
                        fuse_stock=fuse_stock, _history=history, _sink=sink)
    hop_cache.fill(sink, signature)
    return out


__all__ = ["HopCache", "HopCaches", "ceq_attention_cached"]
