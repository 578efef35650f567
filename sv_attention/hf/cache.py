"""The certified KV cache: a transformers ``Cache`` that evicts with a certificate and deletes exactly.

:class:`CertifiedCache` stores keys and values like ``DynamicCache`` and, per (layer, batch row,
kv-head), maintains an exact fp64 SVDD solver (:class:`~sv_attention.svdd.exact.IncrementalSVDD`) over
the admitted long-range keys. It implements the chunk-frozen SV gate of DESIGN §2.5 and hands it to the
``"sv_attention"`` attention function through :mod:`sv_attention.hf.gate_handoff`:

- queries in chunk ``[s, s + chunk)`` read the gate fitted on the keys at positions ``< s``: weight
  ``alpha_j`` on the long-range prefix, 1 on the current chunk (read densely); chunk 0 and warm-up
  (fewer than ``ceil(1/C) + 2`` admitted keys) are ungated (all weights 1);
- at each chunk boundary the new chunk's keys are admitted to every solver (a prefill that crosses
  several boundaries streams the solvers through them and snapshots alpha for each query chunk).

Positions, slots and masks
--------------------------
Every token gets a *position* (0, 1, 2, ... in arrival order). A layer's tensors hold *slots*; after
eviction or deletion a layer holds fewer slots than positions. ``get_seq_length()`` and
``get_mask_sizes()`` speak in positions (``kv_length = positions seen + query length``, offset 0), so
transformers keeps counting positions (RoPE, ``cache_position``) and builds its mask over positions.
The gate handed to the attention function carries ``key_positions`` (the position of each returned
slot) and ``query_positions``; the attention function takes the mask columns at ``key_positions`` and
applies causality from the positions.

Certified eviction (:meth:`CertifiedCache.evict`)
-------------------------------------------------
Per solver, reserve keys (alpha exactly 0) are evicted at the solver level (their fp64 keys stay in the
solver's compact store and are re-checked, ``g >= 0``, at every later admission and deletion).
**Physical rule:** a
token leaves a layer's key/value tensors when it is evicted in *every* (batch row, kv-head) solver of
that layer; its key/value move to the offload tier (CPU memory by default; ``offload=None`` discards
them). The receipt reports the per-head reserve fraction and the realised (physical) fraction. When a
later admission revives an evicted token (it fails the re-check, DESIGN §2.2), the token is restored
from the offload tier; without one, the loss of exactness is recorded (:attr:`restore_events`) and
warned about.

Exact deletion (:meth:`CertifiedCache.forget`)
----------------------------------------------
An admitted long-range token is removed from every solver by the fixed-C exact decrement; a token of
the current chunk (not yet admitted) is masked (its slot removed, the weights renormalised by the
attention function): no SV certificate, reported as ``"uncertified (local path)"``. Either way the
slot's key/value are released. ``reencode=True`` recomputes the suffix after the first deleted
position without the deleted tokens (needs ``model`` and ``input_ids``): the cache then equals a cache
that never saw them.

Padding (:meth:`CertifiedCache.set_padding`)
--------------------------------------------
The cache does not see the model's attention mask. Left padding is declared on the fresh cache with
``cache.set_padding(attention_mask)`` -- automatically, by a forward pre-hook, on a model switched with
:func:`sv_attention.enable` (the first forward's 2-D mask, when it has padding): each batch row then keeps its own admitted history (pad keys never
enter its solvers) and starts its solvers at the first chunk boundary by which it has ``chunk`` real
tokens, with the bandwidth of those tokens. With a pad count that is a multiple of ``chunk``, a padded row
computes exactly what the same sequence computes alone (tested through generate and eviction); otherwise
its boundaries stay the global ones. Without the declaration (a model switched by
``set_attn_implementation`` alone, not declared by hand), pad keys are admitted like real keys (eviction
stays exact, but a padded row's gate differs from the one the attention function fits itself).

Transactions
------------
``evict``, ``forget`` (with or without ``reencode``) and ``crop`` snapshot the cache first (tensors by
reference, solvers deep-copied); a failure part-way restores the snapshot, so every error leaves the
cache as it was. A forward step whose chunk admission fails in some layer is undone in every layer (each
from the snapshot it took at the start of the step, so bit-identically) and raises
:class:`~sv_attention.errors.SolverError`.

Known limits: sliding-window layers are refused; beam search (cache reordering) is refused.
"""

from __future__ import annotations

import copy
import inspect
import time
import warnings
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from sv_attention.errors import (
    DuplicateIdError,
    InvalidInputError,
    SolverError,
    SVAttentionError,
    UnknownIdError,
    UnsupportedFeatureError,
)
from sv_attention.hf.cache_receipts import (
    PATH_EXACT,
    PATH_LOCAL,
    PATH_REENCODED,
    SCOPE_STATEMENT,
    SCOPE_STATEMENT_REENCODED,
    DeletionReceipt,
    EvictionReceipt,
    LayerEviction,
    RestoreEvent,
    SolverDeletion,
)
from sv_attention.hf.cache_solvers import SolverBank
from sv_attention.hf.gate_handoff import GateHandoff, clear_pending_gates, set_pending_gate
from sv_attention.hf.policies import CertifiedPolicy, PolicyContext
from sv_attention.hf.settings import SV_NAME, SVSettings, settings_from_config


class CertifiedLayer(CacheLayerMixin):
    """One layer's slots, positions, solvers and offload tier.

    Attributes
    ----------
    keys, values : Tensor ``[b, kv_heads, slots, head_dim]``
    positions : LongTensor ``[slots]`` (ascending)
    seen : int
        Positions consumed so far (what ``get_seq_length`` reports).
    admitted_upto : int
        Keys at positions ``< admitted_upto`` (minus forgotten ones) are in the solvers.
    bank : SolverBank or None
        The solvers (created at the first chunk boundary, when the bandwidth is fixed).
    evicted : dict[int, tuple[Tensor, Tensor] | None]
        Physically evicted positions -> their key/value ``[b, kv_heads, head_dim]`` on the offload
        device (None when there is no offload tier).
    forgotten : set[int]
    """

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.positions: torch.Tensor | None = None
        self.seen = 0
        self.admitted_upto = 0
        self.bank: SolverBank | None = None
        self.evicted: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}
        self.forgotten: set[int] = set()
        self._snap_s = -1
        self._snap_alpha: torch.Tensor | None = None
        self._row: tuple[int, int, torch.Tensor] | None = None

    # ------------------------------------------------------------------ CacheLayerMixin API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.keys = key_states[..., :0, :].clone()
        self.values = value_states[..., :0, :].clone()
        self.positions = torch.zeros(0, dtype=torch.long, device=key_states.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states`` / ``value_states`` ``[b, kv_heads, q, head_dim]`` at the next positions."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[:2] != self.keys.shape[:2] or key_states.shape[-1] != self.keys.shape[-1]:
            raise InvalidInputError(
                f"layer {self.layer_idx}: new keys {tuple(key_states.shape)} do not match the cached "
                f"{tuple(self.keys.shape)} in batch, kv-head or head dims; use a fresh cache per batch")
        q = key_states.shape[-2]
        new_pos = torch.arange(self.seen, self.seen + q, dtype=torch.long, device=self.positions.device)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.positions = torch.cat([self.positions, new_pos])
        self.seen += q
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Mask sizes in *positions*: ``(positions seen + query_length, 0)``."""
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        """Positions seen (not slots held: after eviction a layer holds fewer slots)."""
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__(self.layer_idx)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise UnsupportedFeatureError("CertifiedCache does not support beam search (cache reordering): its "
                                      "solvers are per batch row; use greedy or sampling decoding")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise UnsupportedFeatureError("CertifiedCache cannot repeat batch rows (num_return_sequences / beams "
                                          "> 1); generate one sequence per prompt")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise UnsupportedFeatureError("CertifiedCache cannot select batch rows; use a fresh cache")

    def crop(self, tokens_to_remove: int) -> None:  # handled by CertifiedCache.crop
        raise UnsupportedFeatureError("crop a CertifiedCache through CertifiedCache.crop")

    # ------------------------------------------------------------------ slots
    @property
    def n_slots(self) -> int:
        return 0 if self.positions is None else int(self.positions.numel())

    def slot_positions(self) -> np.ndarray:
        return np.zeros(0, dtype=np.int64) if self.positions is None else self.positions.cpu().numpy()

    def drop_positions(self, drop: set[int]) -> None:
        """Release the slots of ``drop`` (new, smaller tensors; the old storage is freed)."""
        if not drop or self.positions is None:
            return
        pos = self.slot_positions()
        keep = torch.from_numpy(np.flatnonzero(~np.isin(pos, list(drop)))).to(self.keys.device)
        self.keys = self.keys.index_select(-2, keep)
        self.values = self.values.index_select(-2, keep)
        self.positions = self.positions.index_select(0, keep.to(self.positions.device))
        self.invalidate()

    def insert(self, position: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put back a slot ``k, v [b, kv_heads, head_dim]`` at ``position`` (kept in position order)."""
        idx = int(np.searchsorted(self.slot_positions(), position))
        k = k.to(self.keys.device, self.keys.dtype)[:, :, None, :]
        v = v.to(self.values.device, self.values.dtype)[:, :, None, :]
        self.keys = torch.cat([self.keys[..., :idx, :], k, self.keys[..., idx:, :]], dim=-2)
        self.values = torch.cat([self.values[..., :idx, :], v, self.values[..., idx:, :]], dim=-2)
        p = torch.tensor([position], dtype=torch.long, device=self.positions.device)
        self.positions = torch.cat([self.positions[:idx], p, self.positions[idx:]])
        self.invalidate()

    def invalidate(self) -> None:
        """Forget the cached gate row (slots or solvers changed)."""
        self._row = None

    def invalidate_snapshot(self) -> None:
        self._snap_s, self._snap_alpha, self._row = -1, None, None

    def offload_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for kv in self.evicted.values() if kv is not None for k, v in [kv])

    _SNAPSHOT_FIELDS = ("keys", "values", "positions", "seen", "admitted_upto", "is_initialized", "device")

    def snapshot(self, deep: bool = True) -> dict[str, Any]:
        """Everything a mutation may change, for :meth:`rollback`.

        The key/value/position tensors are kept by reference (every mutation builds new tensors, none
        writes in place); the solvers are deep-copied (they are updated in place) unless ``deep=False``
        (for a step that does not touch them).
        """
        st = {f: getattr(self, f, None) for f in self._SNAPSHOT_FIELDS}
        st.update(bank=copy.deepcopy(self.bank) if deep else self.bank, evicted=dict(self.evicted),
                  forgotten=set(self.forgotten))
        return st

    def rollback(self, st: dict[str, Any]) -> None:
        """Return to the state :meth:`snapshot` recorded."""
        for f in self._SNAPSHOT_FIELDS:
            setattr(self, f, st[f])
        self.bank, self.evicted, self.forgotten = st["bank"], st["evicted"], st["forgotten"]
        self.invalidate_snapshot()


class CertifiedCache(Cache):
    """A transformers ``Cache`` with certified eviction and exact deletion (see the module docstring).

    Parameters
    ----------
    config : transformers ``PretrainedConfig`` or None
        The model's config: the number of layers and the ``"sv_attention"`` hyperparameters
        (``config.sv_attention``, written by ``sv_attention.enable``; documented defaults when absent:
        nu = 0.3, n0 = chunk, chunk = 64, sigma = median pairwise key distance of the first chunk per
        (batch row, kv-head), then fixed).
    num_layers : int or None
        Number of layers when no config is given.
    offload : "cpu", a torch.device, or None
        Where evicted keys/values go (to be restored if a later admission revives them). None discards
        them; a revival is then recorded as a loss of exactness.
    **overrides
        Any ``"sv_attention"`` hyperparameter (``nu``, ``C``, ``n0``, ``chunk``, ``sigma``, ``gate``),
        overriding the config.

    Examples
    --------
    >>> cache = CertifiedCache(model.config)                      # doctest: +SKIP
    >>> out = model.generate(ids, cache=cache, max_new_tokens=64)   # doctest: +SKIP
    >>> rep = cache.evict()                                         # doctest: +SKIP
    >>> rep = cache.forget([5])                                     # doctest: +SKIP
    """

    def __init__(self, config: Any = None, *, num_layers: int | None = None, offload: Any = "cpu",
                 **overrides: Any) -> None:
        text_cfg = config.get_text_config(decoder=True) if config is not None else None
        base = settings_from_config(text_cfg if text_cfg is not None else config, SV_NAME).to_dict() \
            if config is not None else SVSettings().to_dict()
        base.update(overrides)
        self.settings: SVSettings = SVSettings.from_dict(base)
        if num_layers is None:
            if text_cfg is None:
                raise InvalidInputError("CertifiedCache needs a model config or num_layers=")
            num_layers = int(text_cfg.num_hidden_layers)
            types = getattr(text_cfg, "layer_types", None) or []
            if any(t != "full_attention" for t in types):
                raise UnsupportedFeatureError(
                    f"CertifiedCache supports full-attention layers only, got layer_types {sorted(set(types))}; "
                    "use the model's own cache for sliding-window / hybrid models")
        self.offload_device = None if offload is None else torch.device(offload)
        self.restore_events: list[RestoreEvent] = []
        self._step: tuple[int, int, dict[int, dict[str, Any]]] | None = None  # (p0, restore events, snapshots)
        self._valid: np.ndarray | None = None  # [b, L] bool: real tokens (set_padding); None: no padding
        self._config = text_cfg
        super().__init__(layers=[CertifiedLayer(i) for i in range(num_layers)])

    # ------------------------------------------------------------------ hyperparameters
    @property
    def C(self) -> float:
        """The fixed box ``C`` of every solver."""
        return self.settings.box

    @property
    def chunk(self) -> int:
        return self.settings.chunk

    @property
    def warmup_size(self) -> int:
        """``ceil(1/C) + 2``: fewest admitted keys for which a layer's gate is active."""
        return self.settings.warmup

    # ------------------------------------------------------------------ transformers API
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys/values of ``layer_idx``, admit completed chunks into the solvers, and
        deposit the gate for the returned slots (:func:`~sv_attention.hf.gate_handoff.set_pending_gate`).

        Accepts the 5.24 call ``update(k, v, layer_idx, kwargs=...)`` and the older
        ``update(k, v, layer_idx, cache_kwargs)``; the extra arguments are not needed.

        Returns
        -------
        keys, values : Tensor ``[b, kv_heads, slots, head_dim]``
        """
        layer = self.layers[layer_idx]
        if self._valid is not None and key_states.shape[0] != self._valid.shape[0]:
            raise InvalidInputError(f"set_padding declared {self._valid.shape[0]} batch rows, the model runs "
                                    f"{key_states.shape[0]}; declare the padding of this batch")
        p0 = layer.seen
        q = key_states.shape[-2]
        # a call that crosses a chunk boundary admits keys into the solvers: snapshot them first
        admits = layer.is_initialized and ((p0 + q - 1) // self.chunk) * self.chunk > layer.admitted_upto
        st = layer.snapshot(deep=admits)
        if self._step is None or self._step[0] != p0:
            self._step = (p0, len(self.restore_events), {})
        self._step[2][layer_idx] = st
        layer.update(key_states, value_states)
        try:
            weights = self._gate(layer, p0, q)
        except BaseException as exc:
            self._undo_step(layer_idx, st, p0)
            if isinstance(exc, SVAttentionError) or not isinstance(exc, Exception):
                raise
            raise SolverError(f"layer {layer_idx}: admitting the chunk before position {p0 + q} failed "
                              f"({type(exc).__name__}: {exc}); the step was undone in every layer (the cache holds "
                              f"positions 0..{p0 - 1} as before the call)") from exc
        if layer_idx == len(self.layers) - 1:
            self._step = None  # the step went through every layer: its snapshots are no longer needed
        if self._gate_consumed():
            qpos = torch.arange(p0, p0 + q, dtype=torch.long, device=layer.positions.device)
            set_pending_gate(GateHandoff(layer_idx=layer_idx, weights=weights, key_positions=layer.positions,
                                         query_positions=qpos))
        return layer.keys, layer.values

    # ------------------------------------------------------------------ transactions
    def _undo_step(self, layer_idx: int, st: dict[str, Any], p0: int) -> None:
        """Undo a forward step that failed in ``layer_idx``: every layer the step went through returns to the
        snapshot it took at the start of the step (bit-identical: solvers, slots, offload tier), the restore
        events of the step are dropped, and no gate is left pending. A layer without a snapshot of this step
        (not expected) drops the step's positions by a rebuild, as :meth:`crop` does."""
        self.layers[layer_idx].rollback(st)
        clear_pending_gates()
        step = self._step if self._step is not None and self._step[0] == p0 else None
        self._step = None
        if step is not None:
            del self.restore_events[step[1]:]
            for idx, snap in step[2].items():
                if idx != layer_idx and self.layers[idx].seen > p0:
                    self.layers[idx].rollback(snap)
        if any(layer.seen > p0 for layer in self.layers):
            self._truncate(p0)

    def _transaction(self, what: str, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)``; if it raises, put every layer back as it was and re-raise.

        Typed sv-attention errors are re-raised as they are; any other exception (an unexpected solver or
        model failure in the middle of the mutation) becomes a :class:`SolverError` naming ``what``. Either
        way the cache is exactly as before the call (slots, positions, solvers, offload tier, forgotten
        set, restore events) and no gate is left pending for another call.
        """
        snaps = [layer.snapshot() for layer in self.layers]
        n_events, valid = len(self.restore_events), self._valid
        try:
            return fn(*args)
        except BaseException as exc:
            for layer, st in zip(self.layers, snaps, strict=True):
                layer.rollback(st)
            del self.restore_events[n_events:]
            self._valid = valid
            clear_pending_gates()
            if isinstance(exc, SVAttentionError) or not isinstance(exc, Exception):
                raise
            raise SolverError(f"{what} failed part-way ({type(exc).__name__}: {exc}); the cache was rolled back "
                              "to its state before the call, nothing was evicted or deleted") from exc

    def _gate_consumed(self) -> bool:
        """True when the model runs the ``"sv_attention"`` function, which consumes the deposited gate
        (read live from the config, so ``set_attn_implementation`` after building the cache counts).
        Without a config (``num_layers=``) the caller is assumed to consume it."""
        if self._config is None:
            return True
        return getattr(self._config, "_attn_implementation", None) == SV_NAME

    def _check_certifiable(self) -> None:
        if not self.settings.gated:
            raise UnsupportedFeatureError("the SV gate is disabled (gated=False): reserve tokens are not inert "
                                          "then, so no eviction can be certified; enable the gate")
        if not self._gate_consumed():
            impl = getattr(self._config, "_attn_implementation", None)
            raise UnsupportedFeatureError(
                f"the model runs attention {impl!r}, which ignores the SV gate, so evicting reserve tokens would "
                "change its outputs; call sv_attention.enable(model, 'sv_attention') first")

    def reset(self) -> None:
        """Drop every slot, solver, offloaded token and restore event (the settings stay)."""
        super().reset()
        self.restore_events = []
        self._valid = None

    def crop(self, max_length: int) -> None:
        """Keep the first positions only: ``max_length < 0`` removes that many trailing positions (the
        transformers 5.x convention), ``max_length >= 0`` keeps that many positions."""
        seen = self.get_seq_length()
        m = seen + max_length if max_length < 0 else min(max_length, seen)
        self._transaction(f"crop({max_length})", self._truncate, max(0, m))

    # ------------------------------------------------------------------ gate
    def _gate(self, layer: CertifiedLayer, p0: int, q: int) -> torch.Tensor:
        """Gate weights ``[b, kv_heads, q, slots]`` for queries at positions ``p0 .. p0+q-1``."""
        c = self.chunk
        b, h = layer.keys.shape[0], layer.keys.shape[1]
        slots = layer.n_slots
        dtype, device = layer.keys.dtype, layer.keys.device
        if not self.settings.gated:
            return torch.ones(b, h, q, slots, dtype=dtype, device=device)
        starts = sorted({(t // c) * c for t in range(p0, p0 + q)})
        # decode fast path: same chunk as the previous call, one new slot appended
        if q == 1 and layer._row is not None and layer._row[0] == starts[0] and layer._row[1] == slots - 1:
            row = torch.cat([layer._row[2], torch.ones(b, h, 1, dtype=dtype, device=device)], dim=-1)
            layer._row = (starts[0], slots, row)
            return row[:, :, None, :]
        snaps: list[torch.Tensor | None] = []
        for s in starts:
            if s > 0:
                self._advance(layer, s)
            snaps.append(self._snapshot(layer, s))
        pos = layer.positions
        slots = layer.n_slots
        rows = []
        for s, alpha in zip(starts, snaps, strict=True):
            if alpha is None:
                rows.append(torch.ones(b, h, slots, dtype=dtype, device=device))
            else:
                gathered = alpha.index_select(-1, pos.clamp(max=s - 1).to(alpha.device))
                rows.append(torch.where((pos < s).to(device), gathered, torch.ones_like(gathered)))
        layer._row = (starts[-1], slots, rows[-1])
        if len(rows) == 1:
            return rows[0][:, :, None, :].expand(b, h, q, slots)
        R = torch.stack(rows, dim=2)  # [b, h, n_starts, slots]
        qchunk = torch.tensor([starts.index((t // c) * c) for t in range(p0, p0 + q)], device=device)
        return R.index_select(2, qchunk)

    def _snapshot(self, layer: CertifiedLayer, s: int) -> torch.Tensor | None:
        """Alpha by position ``[b, h, s]`` of the gate fitted on positions ``< s`` (None: ungated)."""
        if s == 0 or layer.bank is None or not layer.bank.gated:
            return None
        if layer._snap_s != s or layer._snap_alpha is None:
            layer._snap_alpha = layer.bank.alpha_dense(s, layer.keys.dtype, layer.keys.device)
            layer._snap_s = s
        return layer._snap_alpha

    def _advance(self, layer: CertifiedLayer, s: int) -> None:
        """Admit the real (non-padding) keys at positions ``[admitted_upto, s)`` into the solvers of the
        started rows; start every row that now has its first chunk of real keys (its bandwidth from those
        keys) and admit its real keys at positions ``< s``."""
        if layer.admitted_upto >= s:
            return
        pos = layer.slot_positions()
        b, h = layer.keys.shape[0], layer.keys.shape[1]
        if layer.bank is None:
            layer.bank = SolverBank.empty(self.C, b, h)
        bank = layer.bank
        valid = self._valid_at(pos, b)  # [b, slots]
        dev = layer.keys.device
        revived: set[int] = set()
        rows = [i for i in range(b) if bank.started(i)]
        sel = np.flatnonzero((pos >= layer.admitted_upto) & (pos < s))
        if sel.size and rows:
            idx = torch.from_numpy(sel).to(dev)
            revived |= bank.admit(layer.keys.index_select(-2, idx), pos[sel], valid[:, sel], rows=rows).readmitted
        for i in range(b):
            first = self._first_chunk_end(i, s)
            if bank.started(i) or first is None:
                continue
            lead = np.flatnonzero(valid[i] & (pos <= first))
            keys_i = layer.keys[i].index_select(-2, torch.from_numpy(lead).to(dev))
            bank.start_row(i, SolverBank.bandwidth(keys_i, self.settings.sigma), s)
            sel = np.flatnonzero(valid[i] & (pos < s))
            if sel.size:
                idx = torch.from_numpy(sel).to(dev)
                revived |= bank.admit(layer.keys.index_select(-2, idx), pos[sel], rows=[i]).readmitted
        self._restore(layer, revived, trigger=f"admission of chunk ending at position {s}")
        layer.admitted_upto = s
        layer.invalidate_snapshot()

    # ------------------------------------------------------------------ padding
    @property
    def padding_declared(self) -> bool:
        """Whether :meth:`set_padding` declared padding for the current contents (reset clears it)."""
        return self._valid is not None

    def set_padding(self, attention_mask: torch.Tensor) -> None:
        """Declare which of the first positions are padding, per batch row (before the first forward).

        Padding keys then never enter a row's solvers: each row's gate is fitted on its real keys only,
        and a row's chunk boundaries count its real tokens (a row starts its solvers once it has
        ``chunk`` real keys, with the bandwidth of those keys). With as many pads as a multiple of the
        chunk, a left-padded row then computes exactly what the same sequence computes alone. The model
        still needs the same ``attention_mask`` (``generate`` passes it) to mask the pad slots.

        Parameters
        ----------
        attention_mask : Tensor ``[b, L]`` of 0/1 (or bool)
            1 for a real token, 0 for padding, for positions ``0 .. L-1``; later positions are real.

        Raises
        ------
        InvalidInputError
            Not a 2-D 0/1 tensor, or the cache already holds tokens (declare padding on a fresh cache).
        """
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
            raise InvalidInputError("set_padding needs attention_mask as a 2-D tensor [batch, positions] of 0/1")
        m = attention_mask.detach().cpu()
        if m.dtype != torch.bool and not bool(((m == 0) | (m == 1)).all()):
            raise InvalidInputError("attention_mask must hold only 0 (padding) and 1 (token)")
        if self.get_seq_length() != 0:
            raise InvalidInputError(f"the cache already holds {self.get_seq_length()} positions; declare padding on a "
                                    "fresh cache (or after reset()) before the first forward")
        self._valid = m.to(torch.bool).numpy().copy()

    def _valid_at(self, positions: np.ndarray, b: int) -> np.ndarray:
        """Bool ``[b, len(positions)]``: True where the position holds a real token in that row."""
        positions = np.asarray(positions, dtype=np.int64)
        out = np.ones((b, positions.size), dtype=bool)
        if self._valid is None:
            return out
        if self._valid.shape[0] != b:
            raise InvalidInputError(f"set_padding declared {self._valid.shape[0]} batch rows, the model runs {b}; "
                                    "declare the padding of this batch")
        inside = positions < self._valid.shape[1]
        out[:, inside] = self._valid[:, positions[inside]]
        return out

    def _first_chunk_end(self, i: int, s: int) -> int | None:
        """The position of row ``i``'s ``chunk``-th real token when it is ``< s``, else None."""
        c = self.chunk
        if self._valid is None:
            return c - 1 if s >= c else None
        L = self._valid.shape[1]
        real = np.flatnonzero(self._valid[i, : min(s, L)])
        if real.size >= c:
            return int(real[c - 1])
        p = L + (c - real.size) - 1  # every position >= L is real
        return p if p < s else None

    def _restore(self, layer: CertifiedLayer, revived: set[int], trigger: str) -> list[RestoreEvent]:
        """Bring back physically evicted tokens that a solver re-admitted."""
        events = []
        for p in sorted(int(x) for x in revived):
            if p not in layer.evicted:
                continue  # still present in this layer (evicted in some heads only)
            kv = layer.evicted.pop(p)
            if kv is not None:
                layer.insert(p, kv[0], kv[1])
                ev = RestoreEvent(layer.layer_idx, p, True, trigger)
            else:
                ev = RestoreEvent(layer.layer_idx, p, False, trigger)
                warnings.warn(
                    f"CertifiedCache layer {layer.layer_idx}: evicted token at position {p} became a support "
                    "vector again after " + trigger + ", but no offload tier holds its key/value: exactness "
                    "is lost for this layer (use offload='cpu' to keep it)", stacklevel=3)
            events.append(ev)
        self.restore_events.extend(events)
        return events

    # ------------------------------------------------------------------ memory
    def memory_bytes(self) -> int:
        """Bytes of the key/value tensors (and their position index) the cache holds for attention."""
        total = 0
        for layer in self.layers:
            if layer.is_initialized:
                total += layer.keys.nbytes + layer.values.nbytes + layer.positions.nbytes
        return total

    def memory_report(self) -> dict[str, int]:
        """Every tier: ``kv_bytes`` (what :meth:`memory_bytes` reports), ``offload_bytes`` (evicted
        keys/values kept for restoration), ``gate_bytes`` (alpha snapshots), ``solver_bytes`` (fp64 keys,
        Gram, bordered inverse and compact evicted-key store of the solvers)."""
        return {
            "kv_bytes": self.memory_bytes(),
            "offload_bytes": sum(layer.offload_bytes() for layer in self.layers),
            "gate_bytes": sum(layer._snap_alpha.nbytes for layer in self.layers if layer._snap_alpha is not None),
            "solver_bytes": sum(layer.bank.nbytes() for layer in self.layers if layer.bank is not None),
        }

    def slots_per_layer(self) -> list[int]:
        return [layer.n_slots for layer in self.layers]

    # ------------------------------------------------------------------ eviction
    def evict(self, budget: int | None = None) -> EvictionReceipt:
        """Certified eviction: only tokens whose alpha is exactly 0 in every solver of a layer leave it.

        Parameters
        ----------
        budget : int or None
            Target number of slots per layer. None evicts every certified-inert token. A certified
            eviction never drops a support vector or a current-chunk token, so the budget may be
            missed (``receipt.budget_met``); it is then filled with the most recent reserve tokens.

        Returns
        -------
        EvictionReceipt

        Raises
        ------
        InvalidInputError
            ``budget`` is not an integer, or is below the warm-up threshold ``ceil(1/C) + 2`` (no
            certificate can exist for fewer keys). The cache is unchanged.
        UnsupportedFeatureError
            The model does not run the ``"sv_attention"`` function (or the gate is disabled): the gate
            would not be applied, so no eviction is certified. The cache is unchanged.
        SolverError
            An unexpected failure part-way; the cache is rolled back to its state before the call.
        """
        self._check_certifiable()
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
                raise InvalidInputError(f"budget must be an integer or None, got {budget!r}")
            if budget < self.warmup_size:
                raise InvalidInputError(
                    f"budget {budget} is below the warm-up threshold ceil(1/C)+2 = {self.warmup_size} "
                    f"(C = {self.C:.4g}): no certificate exists for fewer keys; pass budget >= {self.warmup_size}")
        t0 = time.perf_counter()
        mem0 = self.memory_bytes()
        out = self._transaction(f"evict(budget={budget})",
                                lambda: [self._evict_layer(layer, budget) for layer in self.layers])
        met = budget is None or all(le.n_slots_after <= budget for le in out)
        return EvictionReceipt(layers=tuple(out), budget=budget, budget_met=met, memory_bytes_before=mem0,
                               memory_bytes_after=self.memory_bytes(),
                               offload_bytes=sum(layer.offload_bytes() for layer in self.layers),
                               elapsed_s=time.perf_counter() - t0)

    def _evict_layer(self, layer: CertifiedLayer, budget: int | None) -> LayerEviction:
        n0 = layer.n_slots
        pos = layer.slot_positions()
        n_local = int((pos >= layer.admitted_upto).sum())
        bank = layer.bank
        n_adm = len(bank.history) if bank is not None else 0

        def skipped(reason: str, kkt: float = 0.0) -> LayerEviction:
            return LayerEviction(layer.layer_idx, False, reason, n0, n0, n_adm, n_local, [], (), 0.0, kkt)

        if bank is None:
            return skipped("no chunk boundary yet: nothing admitted, no certificate")
        ok, reason, kkt = bank.certified()
        if not ok:
            return skipped(reason, kkt)
        frac = bank.reserve_fraction()
        gated_rows = [i for i in range(bank.shape[0]) if bank.row_gated(i)]
        alpha_before = bank.alpha_dense(layer.admitted_upto, torch.float64, torch.device("cpu"))[gated_rows]
        bank.evict_reserve()
        active = bank.active_positions()
        cand = pos[pos < layer.admitted_upto]
        # a token stays when some solver holds it active, or when it is a real token of a row whose solvers
        # have not started (no certificate there)
        support = np.isin(cand, list(active))
        waiting = [i for i in range(bank.shape[0]) if not bank.started(i)]
        if waiting and cand.size:
            support |= self._valid_at(cand, bank.shape[0])[waiting].any(axis=0)
        target = int(support.sum()) if budget is None else max(0, budget - n_local)
        dec = CertifiedPolicy().select(PolicyContext(positions=cand, support=support), target)
        drop = [int(p) for p in cand[~dec.keep]]
        if drop:
            idx = torch.from_numpy(np.flatnonzero(np.isin(pos, drop))).to(layer.keys.device)
            ks, vs = layer.keys.index_select(-2, idx), layer.values.index_select(-2, idx)
            for n, p in enumerate(drop):
                if self.offload_device is None:
                    layer.evicted[p] = None
                else:
                    layer.evicted[p] = (ks[:, :, n].to(self.offload_device, copy=True),
                                        vs[:, :, n].to(self.offload_device, copy=True))
            layer.drop_positions(set(drop))
        _, _, kkt = bank.certified()
        max_alpha = float(alpha_before[:, :, drop].max()) if drop else 0.0
        return LayerEviction(layer.layer_idx, True, reason, n0, layer.n_slots, n_adm, n_local, frac, tuple(drop),
                             len(drop) / n_adm if n_adm else 0.0, kkt, max_alpha)

    # ------------------------------------------------------------------ deletion
    def _check_positions(self, positions: Any) -> list[int]:
        if isinstance(positions, torch.Tensor):
            positions = positions.detach().cpu().reshape(-1).tolist()
        if isinstance(positions, (int, np.integer)) and not isinstance(positions, bool):
            positions = [positions]
        try:
            lst = list(positions)
        except TypeError as exc:
            raise InvalidInputError(f"positions must be an int or a sequence of ints, got {positions!r}") from exc
        if not lst:
            raise InvalidInputError("positions is empty; pass at least one position to forget")
        if any(isinstance(p, bool) or not isinstance(p, (int, np.integer)) for p in lst):
            raise InvalidInputError(f"positions must be integers, got {lst!r}")
        lst = [int(p) for p in lst]
        if len(set(lst)) != len(lst):
            raise DuplicateIdError(f"positions repeated: {sorted({p for p in lst if lst.count(p) > 1})}; "
                                   "pass each position once")
        seen = self.get_seq_length()
        bad = [p for p in lst if p < 0 or p >= seen]
        if bad:
            raise InvalidInputError(f"positions {bad} are out of range: the cache holds positions 0..{seen - 1}")
        gone = sorted(set(lst) & set().union(*(layer.forgotten for layer in self.layers)))
        if gone:
            raise UnknownIdError(f"positions {gone} were already forgotten; nothing to delete")
        return sorted(lst)

    def forget(self, positions: Any, reencode: bool = False, verify: bool = False, *, model: Any = None,
               input_ids: torch.Tensor | None = None) -> DeletionReceipt:
        """Delete tokens exactly.

        Parameters
        ----------
        positions : int or sequence of int
            Positions (0-based, in arrival order) to forget.
        reencode : bool
            Also recompute the keys/values of every position after the first deleted one without the
            deleted tokens, so that the cache equals a cache that never saw them. Needs ``model`` and
            ``input_ids``. Positions after the first deleted one shift (``receipt.position_map``).
        verify : bool
            Compare each decremented solver with a from-scratch refit of its retained history (same C
            and sigma): ``max |f_decrement - f_refit|`` on the retained and deleted keys.
        model : transformers model (reencode only)
        input_ids : LongTensor ``[b, positions seen]`` (reencode only)
            The token ids at every position of this cache (already-forgotten positions included).

        Returns
        -------
        DeletionReceipt

        Raises
        ------
        InvalidInputError
            Positions out of range, not integers, empty; ``reencode`` without ``model`` / ``input_ids``.
        DuplicateIdError
            A position repeated.
        UnknownIdError
            A position already forgotten.
        UnsupportedFeatureError
            The model does not run the ``"sv_attention"`` attention function.
        InfeasibleBoxError
            A solver would keep fewer than ``1/C`` keys (``n * C < 1``) after the deletion.
        SolverError
            An unexpected failure part-way (a solver, or the model when re-encoding).

        Every error leaves the cache unchanged: input errors are decided before any mutation, and a
        failure part-way rolls the cache back to a snapshot taken at the start of the call.
        """
        t0 = time.perf_counter()
        if not self._gate_consumed():
            impl = getattr(self._config, "_attn_implementation", None)
            raise UnsupportedFeatureError(
                f"the model runs attention {impl!r}, which reads key/value slots by column index; after a "
                "deletion the cache holds fewer slots than positions, which only the 'sv_attention' function "
                "handles (it reads the gate's key positions): call sv_attention.enable(model, 'sv_attention')")
        lst = self._check_positions(positions)
        if reencode:
            if model is None or not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
                raise InvalidInputError("reencode=True needs model= and input_ids= (LongTensor [b, positions seen])")
            if input_ids.shape[1] != self.get_seq_length():
                raise InvalidInputError(f"input_ids has {input_ids.shape[1]} positions, the cache has seen "
                                        f"{self.get_seq_length()}; pass the ids of every cached position")
            return self._transaction(f"forget({lst}, reencode=True)", self._forget_reencode, lst, model,
                                     input_ids, t0)
        for layer in self.layers:
            if layer.bank is not None:
                layer.bank.check_removable([p for p in lst if p in layer.bank.history])
        # Every refusal (range, repeats, already forgotten, n*C < 1) is decided above, before any mutation;
        # an unexpected failure part-way (a solver error) rolls the whole cache back.
        return self._transaction(f"forget({lst})", self._forget, lst, verify, t0, self.memory_bytes())

    def _forget(self, lst: list[int], verify: bool, t0: float, mem0: int) -> DeletionReceipt:
        paths: dict[int, str] = {}
        solver_recs: list[SolverDeletion] = []
        fallbacks, restored, lost = [], [], []
        for layer in self.layers:
            bank = layer.bank
            long = [p for p in lst if bank is not None and p in bank.history]
            waiting = [] if bank is None else [i for i in range(bank.shape[0]) if not bank.started(i)]
            for p in lst:
                path = PATH_EXACT if p in long else PATH_LOCAL
                if p in long and waiting and self._valid_at(np.array([p]), bank.shape[0])[waiting].any():
                    path = f"{PATH_EXACT} (rows with solvers), {PATH_LOCAL} (rows not started)"
                if paths.get(p, path) != path and path in (PATH_EXACT, PATH_LOCAL):
                    path = f"{PATH_EXACT} (some layers), {PATH_LOCAL} (others)"
                paths[p] = path
            if long:
                was_gated = [bank.row_gated(i) for i in range(bank.shape[0])]
                removed_keys = self._keys_of(bank, long) if verify else None
                for i, j, rec, dt in bank.remove(long):
                    dev = self._refit_deviation(bank.solvers[i][j], removed_keys[i, j]) if verify else None
                    solver_recs.append(SolverDeletion(layer.layer_idx, i, j, rec.kkt.as_dict(), dt, dev,
                                                      tuple(int(x) for x in rec.readmitted), rec.in_warmup))
                    for ev in self._restore(layer, set(rec.readmitted), trigger=f"forget({lst})"):
                        (restored if ev.restored else lost).append((ev.layer, ev.position))
                if any(g and not bank.row_gated(i) for i, g in enumerate(was_gated)):
                    fallbacks.append(layer.layer_idx)
                    warnings.warn(f"CertifiedCache layer {layer.layer_idx}: after forget({lst}) only "
                                  f"{bank.min_row_history()} admitted keys remain in some batch row (< ceil(1/C)+2 = "
                                  f"{self.warmup_size}); "
                                  "the gate falls back to warm-up (ungated softmax)", stacklevel=3)
            for p in lst:
                layer.evicted.pop(p, None)
            layer.drop_positions(set(lst))
            layer.forgotten.update(lst)
            layer.invalidate_snapshot()
        return DeletionReceipt(
            positions=tuple(lst), paths=paths, solvers=tuple(solver_recs), verified=verify, reencoded=False,
            position_map=None, warmup_fallback_layers=tuple(fallbacks), restored=tuple(restored),
            exactness_lost=tuple(lost), elapsed_s=time.perf_counter() - t0,
            solver_elapsed_s=sum(r.elapsed_s for r in solver_recs), memory_bytes_before=mem0,
            memory_bytes_after=self.memory_bytes(), scope=SCOPE_STATEMENT)

    @staticmethod
    def _keys_of(bank: SolverBank, positions: list[int]) -> dict[tuple[int, int], np.ndarray]:
        """Per solver ``(row, kv-head)``: the fp64 keys ``[m, d]`` of the ``positions`` it holds (active or
        evicted)."""
        out = {}
        for i, j, s in bank.each():
            mine = SolverBank.held(s, positions)
            if not mine:
                continue
            st = s.state_dict()
            ids = {int(x): k for k, x in enumerate(s.ids)}
            X = s.keys
            out[i, j] = np.stack([X[ids[p]] if p in ids else st["evicted"][p] for p in mine])
        return out

    @staticmethod
    def _refit_deviation(solver: Any, removed: np.ndarray) -> float | None:
        """``max |f_solver - f_refit|`` on the retained history and the removed keys."""
        from sv_attention.svdd import refit

        if not solver.has_solution:
            return None
        ev = solver.state_dict()["evicted"]
        ids = np.concatenate([solver.ids, np.array(sorted(ev), dtype=np.int64)])
        X = np.concatenate([solver.keys] + ([np.stack([ev[i] for i in sorted(ev)])] if ev else []))
        ref = refit(X, C=solver.C, sigma=solver.sigma, ids=ids)
        probes = np.concatenate([X, removed])
        return float(np.abs(solver.decision_function(probes) - ref.decision_function(probes)).max())

    # ------------------------------------------------------------------ re-encoding / truncation
    def _truncate(self, m: int) -> None:
        """Keep positions ``< m`` only. A layer that keeps every admitted position keeps its solvers exactly
        as they are (``crop(seen)`` changes nothing); otherwise its solvers are rebuilt from their stored fp64
        keys so that they hold exactly what a cache that saw only those ``m`` positions would hold."""
        c = self.chunk
        target = ((m - 1) // c) * c if m > 0 else 0
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            drop = {int(p) for p in layer.slot_positions() if p >= m}
            layer.drop_positions(drop)
            layer.evicted = {p: kv for p, kv in layer.evicted.items() if p < m}
            layer.forgotten = {p for p in layer.forgotten if p < m}
            layer.seen = min(layer.seen, m)
            bank = layer.bank
            if bank is not None and target >= layer.admitted_upto:
                # every admitted position is kept: the solvers stay exactly as they are
                layer.invalidate_snapshot()
                continue
            if bank is not None:
                keys = self._history_keys(bank)  # {(row, kv-head): {pos: key}}
                if target < c:
                    layer.bank = None
                else:
                    b, h = bank.shape
                    new = SolverBank.empty(bank.C, b, h)
                    for i in range(b):
                        start = bank.row_start[i] if bank.row_start[i] is not None else c
                        if not bank.started(i) or start > target:
                            continue
                        new.start_row(i, bank.sigma[i], start)
                        hist = sorted(p for p in bank.row_history[i] if p < target)
                        # replay the admissions a fresh cache makes: all keys before the row's start, then chunks
                        blocks = [[p for p in hist if p < start]]
                        blocks += [[p for p in hist if lo <= p < lo + c] for lo in range(start, target, c)]
                        for blk in blocks:
                            if not blk:
                                continue
                            for j, sv in enumerate(new.solvers[i]):
                                sv.add(np.stack([keys[i, j][p] for p in blk]), ids=blk)
                            new.row_history[i].update(blk)
                    layer.bank = new
            layer.admitted_upto = min(layer.admitted_upto, target)
            self._reevict(layer, trigger=f"rebuild of the cache for the first {m} positions")
            layer.invalidate_snapshot()

    def _reevict(self, layer: CertifiedLayer, trigger: str) -> None:
        """After a rebuild, keep the layer's physically evicted tokens certified: those still admitted go
        back into the solvers' evicted stores (re-checked at every later admission); a token that is not
        reserve in the rebuilt solvers, that is no longer admitted (it is in the current chunk again, read
        densely), or that is a real token of a row whose solvers have not started, is restored."""
        if not layer.evicted:
            return
        bank = layer.bank
        held: set[int] = set(layer.evicted)
        if bank is not None:
            bank.evict_reserve()
            hist = bank.history
            held = {p for p in layer.evicted if p not in hist} | (set(layer.evicted) & bank.active_positions())
            waiting = [i for i in range(bank.shape[0]) if not bank.started(i)]
            if waiting:
                ev = np.array(sorted(layer.evicted), dtype=np.int64)
                held |= {int(p) for p in ev[self._valid_at(ev, bank.shape[0])[waiting].any(axis=0)]}
        self._restore(layer, held, trigger=trigger)

    @staticmethod
    def _history_keys(bank: SolverBank) -> dict[tuple[int, int], dict[int, np.ndarray]]:
        out = {}
        for i, j, s in bank.each():
            d = {int(x): k for x, k in zip(s.ids, s.keys, strict=True)}
            d.update({int(x): k for x, k in s.state_dict()["evicted"].items()})
            out[i, j] = d
        return out

    def _forget_reencode(self, lst: list[int], model: Any, input_ids: torch.Tensor, t0: float) -> DeletionReceipt:
        mem0 = self.memory_bytes()
        seen = self.get_seq_length()
        m = lst[0]
        gone = set(lst) | set().union(*(layer.forgotten for layer in self.layers))
        kept = [p for p in range(m, seen) if p not in gone]
        suffix = input_ids[:, kept]
        self._truncate(m)
        extra: dict[str, torch.Tensor] = {}
        if self._valid is not None:
            # positions shift: the padding of the new numbering, and the mask / position ids generate would use
            b = self._valid.shape[0]
            valid = torch.from_numpy(self._valid_at(np.array(list(range(m)) + kept, dtype=np.int64), b))
            self._valid = valid.numpy()
            mask = valid.to(torch.long)
            pid = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
            extra = {"attention_mask": mask.to(model.device), "position_ids": pid[:, m:].to(model.device)}
        if suffix.shape[1]:
            params = inspect.signature(model.forward).parameters
            kw = {"cache": self} if "cache" in params else {"past_key_values": self}
            with torch.no_grad():
                model(input_ids=suffix.to(model.device), use_cache=True, **kw, **extra)
        pmap = {p: m + k for k, p in enumerate(kept)}
        return DeletionReceipt(
            positions=tuple(lst), paths={p: PATH_REENCODED for p in lst}, solvers=(), verified=False,
            reencoded=True, position_map=pmap, warmup_fallback_layers=(), restored=(), exactness_lost=(),
            elapsed_s=time.perf_counter() - t0, solver_elapsed_s=0.0, memory_bytes_before=mem0,
            memory_bytes_after=self.memory_bytes(), scope=SCOPE_STATEMENT_REENCODED)

    # ------------------------------------------------------------------ status
    def certificate(self) -> dict[str, Any]:
        """Per layer: gated / warm-up, admitted keys, slots, physically evicted tokens, whether every
        solver holds a certificate, the largest KKT residual; plus the restore events so far."""
        layers = []
        for layer in self.layers:
            bank = layer.bank
            ok, reason, kkt = bank.certified() if bank is not None else (False, "no chunk boundary yet", 0.0)
            layers.append({"layer": layer.layer_idx, "gated": bool(bank is not None and bank.gated),
                           "admitted": len(bank.history) if bank is not None else 0, "slots": layer.n_slots,
                           "evicted": len(layer.evicted), "certified": ok, "reason": reason, "kkt_max": kkt})
        lost = [e for e in self.restore_events if not e.restored]
        return {"layers": layers, "exact": not lost,
                "restore_events": [(e.layer, e.position, e.restored, e.trigger) for e in self.restore_events]}

    def __repr__(self) -> str:
        return (f"CertifiedCache(layers={len(self.layers)}, seen={self.get_seq_length()}, "
                f"slots={self.slots_per_layer()}, C={self.C:.4g}, chunk={self.chunk})")
