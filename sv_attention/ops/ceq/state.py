"""The one decoding state of ceq: a layer's hop history in capacity buffers, and its fingerprint rule.

``(A^h v)_i = sum_{j<i} A_ij (A^{h-1} v)_j``: with the hop outputs ``y_1 .. y_{K-1}`` of every earlier
position kept, a new query needs only its own row of A (O(n d)) and K matrix-vector products. The
history is alpha-independent (``y_h`` are hop outputs, not weighted), so a learnable alpha never
invalidates it.

:class:`HopState` holds one layer's history; the plug-in keeps it on the attention module, the
remote-code model in its cache (``SVLMCache.operator_state``), and both hand it to the one entry point
:func:`sv_attention.ops.ceq.layer.ceq_layer_attention`. The history lives in capacity buffers
``[b, h, cap, d]`` that decoding extends in place (one column per new position, no copy of the earlier
ones); when a buffer is full its live columns move to a new one of twice the needed size
(:func:`reserve_columns`), so appending costs amortised O(1) copies per position.

Fingerprint rule: store column ``base + j`` belongs to key column ``j`` and records that key's first
feature. Every decoding call compares the key columns it receives with the fingerprints of the live
columns (exactly; O(past) elements, ``1 / d`` of the key cache the attention reads anyway), so a fresh
prefill, a crop, a sliding window, a beam reorder (rows are matched) or another conversation is detected
whether or not the holder was told. A holder that *is* told (a transformers ``Cache``) calls
:meth:`HopState.crop` / :meth:`HopState.reorder` / ... and the check then passes directly.
"""

from __future__ import annotations

import torch

from sv_attention.errors import HopCacheError, InvalidInputError, UnsupportedFeatureError
from sv_attention.ops.masking import to_bool_mask

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
    # (a compiled graph cannot ask is_inference(); dynamo refuses inference tensors anyway)
    writable = torch.compiler.is_compiling() or not bufs[0].is_inference() or torch.is_inference_mode_enabled()
    if writable and start + need <= bufs[0].shape[2]:
        return bufs, start
    return take_columns(bufs, start, live, need), 0


def match_rows(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor | None:
    """Index ``idx`` with ``old[idx] == new`` row by row (a beam reorder nobody announced), or None."""
    idx = []
    for r in range(new.shape[0]):
        hit = [o for o in range(old.shape[0]) if torch.equal(old[o], new[r])]
        if not hit:
            return None
        idx.append(hit[0])
    return torch.tensor(idx, dtype=torch.long, device=old.device)


def require_queries_last(mask: torch.Tensor | None, q_len: int, kv_len: int, layer_idx: int | None) -> None:
    """The hop engine needs query row r at key column ``kv_len - q_len + r`` (a dynamic cache's layout).

    Raises
    ------
    UnsupportedFeatureError
        The mask (or sdpa's no-mask convention for ``1 < q_len < kv_len``) puts the queries elsewhere,
        e.g. a static / pre-allocated cache.
    """
    bad = False
    if mask is None:
        bad = 1 < q_len < kv_len  # sdpa's convention for an empty static cache: queries at the first columns
    elif isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[-1] == kv_len:
        vis = to_bool_mask(mask, q_len, kv_len)[:, 0]  # [b, q, kv]
        has = vis.any(-1)
        last = kv_len - 1 - vis.flip(-1).long().argmax(-1)  # last visible column of each row
        want = torch.arange(kv_len - q_len, kv_len, device=vis.device)[None, :]
        wrong = ((last != want) & has).any()
        if torch.compiler.is_compiling():  # checked inside the graph (no .item(): no graph break)
            torch._assert_async(~wrong, "ceq: the queries are not the last key columns (a static cache)")
            return
        bad = bool(wrong)
    if bad:
        raise UnsupportedFeatureError(
            f"ceq layer {layer_idx}: the queries are not the last key columns (a static / pre-allocated cache); "
            "the hop engine needs a DynamicCache-style layout: generate with the default cache")


class HopState:
    """One layer's hop history: ``y_1 .. y_{K-1}`` of the cached positions, in capacity buffers.

    Attributes
    ----------
    store : list of Tensor ``[b, h, cap, dv]``
        The K-1 capacity buffers; columns ``[base, end)`` are live (column ``base + j``: position ``j``).
    fingerprint : Tensor ``[b, h_kv, cap]`` or None
        First feature of the key of every live column (the fingerprint rule of the module docstring).
    base, end : int
        The live columns.
    signature : tuple or None
        ``(variant, rho, lam, hops, scaling, form)`` of the calls that filled it; a decoding call with
        another signature is refused (:class:`~sv_attention.errors.HopCacheError`).
    length : int (property)
        Number of cached positions, ``end - base``.
    batch : int or None (property)
    history : list of Tensor (property)
        ``K - 1`` views ``[b, h, length, dv]`` of the live columns.

    The batch / length hooks of a transformers ``Cache`` (:meth:`crop`, :meth:`reorder`,
    :meth:`batch_select_indices`, :meth:`batch_repeat_interleave`, :meth:`reset`) keep it in step with the
    key/value cache it mirrors; without them the fingerprint check still finds crops, windows and reorders.
    """

    def __init__(self) -> None:
        self.store: list[torch.Tensor] = []
        self.fingerprint: torch.Tensor | None = None
        self.base = 0
        self.end = 0
        self.signature: tuple | None = None

    # -- views ---------------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        return self.end - self.base

    @property
    def batch(self) -> int | None:
        return None if self.fingerprint is None else int(self.fingerprint.shape[0])

    @property
    def history(self) -> list[torch.Tensor]:
        return [t[:, :, self.base:self.end] for t in self.store]

    def __len__(self) -> int:
        return self.length

    def __repr__(self) -> str:
        return f"HopState(length={self.length}, batch={self.batch}, signature={self.signature})"

    def _set(self, store: list[torch.Tensor], fingerprint: torch.Tensor | None, base: int, end: int,
             signature: tuple | None) -> None:
        self.store, self.fingerprint, self.base, self.end, self.signature = store, fingerprint, base, end, signature

    def copy(self) -> HopState:
        """A state sharing this one's buffers (columns past ``end`` may then be written by either)."""
        other = HopState()
        other._set(list(self.store), self.fingerprint, self.base, self.end, self.signature)
        return other

    # -- the hooks of a transformers Cache -----------------------------------------------------------
    def reset(self) -> None:
        """Forget everything (the next call must be a prefill)."""
        self._set([], None, 0, 0, None)

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
        if n == 0:
            self.reset()
        else:
            self.end = self.base + n

    def reorder(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch (beam search): row r becomes old row ``beam_idx[r]``."""
        if self.fingerprint is None:
            return
        b = self.batch
        idx = torch.as_tensor(beam_idx, dtype=torch.long)
        if idx.dim() != 1 or (idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= b)):
            raise InvalidInputError(f"beam_idx must be 1-D with entries in [0, {b}), got {idx.tolist()}")
        bufs = take_columns([*self.store, self.fingerprint], self.base, self.length,
                            self.length + PREFILL_HEADROOM, rows=idx)
        self._set(bufs[:-1], bufs[-1], 0, self.length, self.signature)

    reorder_cache = reorder

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows ``indices`` (transformers' contrastive search hook)."""
        self.reorder(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times (transformers' beam expansion hook)."""
        if self.fingerprint is not None:
            self.reorder(torch.arange(self.batch).repeat_interleave(repeats))

    # -- the decoding protocol (used by ceq_layer_attention) ------------------------------------------
    @classmethod
    def for_prefill(cls, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, hops: int,
                    signature: tuple, headroom: bool = True) -> HopState:
        """An empty state with room for ``kv_len`` columns, plus :data:`PREFILL_HEADROOM` for the decoding
        steps that follow when ``headroom`` (K-1 hop buffers ``[b, h, cap, dv]`` + fingerprint ``[b, g, cap]``)."""
        b, h = query.shape[:2]
        g, kv_len, dv = key.shape[1], key.shape[2], value.shape[-1]
        cap = kv_len + (PREFILL_HEADROOM if headroom else 0)
        state = cls()
        state._set([query.new_empty(b, h, cap, dv) for _ in range(hops - 1)], key.new_empty(b, g, cap), 0, 0,
                   signature)
        return state

    def prepared(self, key: torch.Tensor, q_len: int, signature: tuple, sliding: bool, private: bool,
                 layer_idx: int | None = None) -> HopState:
        """The state of this call's past columns, with room for ``q_len`` more; raises when it is unknown.

        Checks, in order: this state was filled with ``signature``; it holds at least the
        ``past = kv_len - q_len`` columns the key cache has (a sliding window keeps the last ones, a crop
        the first ones); the fingerprints of those columns equal the keys' first features (rows in
        another order, a beam search, are matched and gathered).

        Returns
        -------
        HopState with ``end = base + past``: this state's buffers (its columns from ``end`` on may be
        overwritten) unless they were gathered, grown or ``private`` (a copy: this state stays intact).
        Nothing of ``self`` is modified.

        Raises
        ------
        HopCacheError
            No history with this signature, fewer cached columns than the key cache's past, or other keys.
        """
        b, _, kv_len, _ = key.shape
        past = kv_len - q_len
        if self.fingerprint is None or self.signature != signature:
            raise HopCacheError(
                f"ceq layer {layer_idx}: decoding {q_len} token(s) after {past} cached positions, but no hop "
                f"history for them with these settings is held (held: {self.signature}, this call: {signature}; "
                "the cache was filled by another attention implementation, with other ceq settings, or the "
                "state was reset); run the prompt again through the model with this setting")
        n_prev = self.length
        if past > n_prev:
            raise HopCacheError(f"ceq layer {layer_idx}: the key cache holds {past} past positions but the hop "
                                f"history only {n_prev}; the hop history must mirror the key/value cache "
                                "(crop / reset them together), or prefill again")
        start = self.base + (n_prev - past if sliding else 0)  # windows keep the last columns, crops the first
        fp_old = self.fingerprint[:, :, start:start + past]
        fp_new = key[:, :, :past, 0]
        bufs = [*self.store, self.fingerprint]
        if torch.compiler.is_compiling() and fp_old.shape == fp_new.shape:
            # in a compiled graph the check is an assertion (no data-dependent branch): a beam reorder or another
            # conversation raises at run time instead of being matched; decode those eagerly
            torch._assert_async((fp_old == fp_new).all(), "ceq: the cached keys differ from the hop history's "
                                "(another conversation, a crop or a beam reorder); reset the state and prefill again")
            same = True
        else:
            same = fp_old.shape[:2] == fp_new.shape[:2] and torch.equal(fp_old, fp_new)
        if same:
            if private:
                bufs, start = take_columns(bufs, start, past, kv_len), 0
            else:
                bufs, start = reserve_columns(bufs, start, past, kv_len)
        else:
            idx = match_rows(fp_old, fp_new) if fp_old.shape[1:] == fp_new.shape[1:] else None
            if idx is None:
                raise HopCacheError(
                    f"ceq layer {layer_idx}: the cached keys differ from those the hop history was built on "
                    "(another conversation or an edited cache); reset the state (sv_attention.hf.reset_state("
                    "model), or a fresh cache) and prefill again")
            bufs, start = take_columns(bufs, start, past, kv_len, rows=idx), 0
        out = HopState()
        out._set(bufs[:-1], bufs[-1], start, start + past, signature)
        return out

    def adopt(self, other: HopState) -> None:
        """Take ``other``'s buffers and columns (so a holder's reference stays valid)."""
        self._set(other.store, other.fingerprint, other.base, other.end, other.signature)

    def record(self, key: torch.Tensor, q_len: int) -> None:
        """After a call wrote the hop rows of the last ``q_len`` key columns: fingerprint them, extend ``end``."""
        past = key.shape[2] - q_len
        self.fingerprint[:, :, self.end:self.end + q_len] = key[:, :, past:, 0]
        self.end += q_len


class HopCaches:
    """Per-layer :class:`HopState` container (created on first use of a layer index).

    ``crop`` / ``reset`` / ``reorder`` / ``batch_select_indices`` / ``batch_repeat_interleave`` are
    applied to every layer, so a transformers ``Cache`` subclass can forward its own hooks here.
    """

    def __init__(self) -> None:
        self.layers: dict[int, HopState] = {}

    def layer(self, layer_idx: int) -> HopState:
        """The state of layer ``layer_idx`` (created empty on first access)."""
        if layer_idx not in self.layers:
            self.layers[layer_idx] = HopState()
        return self.layers[layer_idx]

    __getitem__ = layer

    def __len__(self) -> int:
        return len(self.layers)

    def _each(self, method: str, *args: object) -> None:
        for state in self.layers.values():
            getattr(state, method)(*args)

    def reset(self) -> None:  # noqa: D102
        self._each("reset")

    def crop(self, max_length: int) -> None:  # noqa: D102
        self._each("crop", max_length)

    def reorder(self, beam_idx: torch.LongTensor) -> None:  # noqa: D102
        self._each("reorder", beam_idx)

    reorder_cache = reorder

    def batch_select_indices(self, indices: torch.Tensor) -> None:  # noqa: D102
        self._each("batch_select_indices", indices)

    def batch_repeat_interleave(self, repeats: int) -> None:  # noqa: D102
        self._each("batch_repeat_interleave", repeats)


__all__ = ["PREFILL_HEADROOM", "HopCaches", "HopState", "match_rows", "require_queries_last", "reserve_columns",
           "take_columns"]
