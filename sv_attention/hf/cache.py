"""The certified KV cache: a transformers ``Cache`` that evicts with a certificate and deletes exactly.

:class:`CertifiedCache` stores keys and values like ``DynamicCache`` and, per (layer, batch row,
kv-head), maintains an exact fp64 SVDD solver over the admitted long-range keys (the gate's exact path,
:class:`~sv_attention.ops.sv_gate.exact.SolverBank`). It implements the chunk-frozen SV gate of DESIGN §2.5
with the gate's own schedule (:mod:`sv_attention.ops.sv_gate.schedule`: boundaries, warm-up, bandwidth) and
hands it to the ``"sv_attention"`` attention function through :mod:`sv_attention.hf.gate_handoff`:

- a query at real position ``t`` reads boundary ``s = boundary_of(t, chunk)``: weight ``alpha_j`` on the
  row's keys at real positions ``< s``, 1 on the current chunk (read densely); chunk 0 and warm-up
  (``is_gated`` false, or fewer than ``ceil(1/C) + 2`` admitted keys after deletions) are ungated;
- each batch row admits its keys chunk by chunk at its own boundaries (a prefill that crosses several
  boundaries streams the row's solvers through them and reads the gate at each).

Positions, slots and masks
--------------------------
Every token gets a *position* (0, 1, 2, ... in arrival order, padding included). Within a batch row, a
real (non-padding) token also has a *real position*: the number of real tokens before it in that row (a
query's real position is the number of real keys it sees minus one, as in the gate's schedule); chunk
boundaries, warm-up and the bandwidth count real positions, so every row has its own boundaries. A
layer's tensors hold *slots*; after eviction or deletion a layer holds fewer slots than positions. ``get_seq_length()`` and
``get_mask_sizes()`` speak in positions (``kv_length = positions seen + query length``, offset 0), so
transformers keeps counting positions (RoPE, ``cache_position``) and builds its mask over positions.
The gate handed to the attention function carries ``key_positions`` (the position of each returned
slot) and ``query_positions``; the attention function takes the mask columns at ``key_positions`` and
applies causality from the positions.

Certified eviction (:meth:`CertifiedCache.evict`)
-------------------------------------------------
Per solver, reserve keys (alpha exactly 0) are evicted at the solver level (their fp64 keys stay in the
solver's compact store and are re-checked, ``g >= 0``, at every later admission and deletion).
**Physical rule:** a token leaves a layer's key/value tensors when it is evicted in *every* (batch row,
kv-head) solver that holds it, and no row still reads it densely (a row's current chunk); its key/value move to the offload tier (CPU memory by default; ``offload=None`` discards
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
:func:`sv_attention.enable` (the first forward's 2-D mask, when it has padding): pad keys then never
enter a row's solvers, and the row's boundaries, warm-up and bandwidth count its real tokens only, so a
padded row computes exactly what the same sequence computes alone, for any pad count. Without the
declaration (a model switched by ``set_attn_implementation`` alone, not declared by hand), pad keys are
admitted like real keys (eviction stays exact, but a padded row's gate differs from the one the
attention function fits itself).

Eviction policies
-----------------
``CertifiedCache(config, policy=...)`` takes any policy of :mod:`sv_attention.hf.policies` (default:
:class:`~sv_attention.hf.policies.CertifiedPolicy`). Only the certified policy on a certified bank
evicts with a certificate (reserve tokens only: later outputs unchanged); the heuristic policies
(heavy-hitter, recency, random) drop long-range slots to meet the budget without one, and the receipt
says so (``certified=False``, the largest alpha dropped). Current-chunk tokens are never evicted by any
policy (the next admission reads them).

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
from sv_attention.hf.gate_handoff import GateHandoff, clear_pending_gates, set_pending_gate
from sv_attention.hf.policies import CertifiedPolicy, EvictionPolicy, PolicyContext, get_policy
from sv_attention.hf.policies.heavy_hitter import softmax_attention_mass
from sv_attention.hf.settings import SV_NAME, SVSettings, settings_from_config
from sv_attention.ops.sv_gate.exact import BankCertificate, SolverBank
from sv_attention.ops.sv_gate.schedule import boundary_of, is_gated


class CertifiedLayer(CacheLayerMixin):
    """One layer's slots, positions, solvers and offload tier.

    Attributes
    ----------
    keys, values : Tensor ``[b, kv_heads, slots, head_dim]``
    positions : LongTensor ``[slots]`` (ascending)
    seen : int
        Positions consumed so far (what ``get_seq_length`` reports).
    admitted : list[int]
        Per batch row, the boundary (a real position) its solvers stand at: the row's real keys at real
        positions ``< admitted[i]`` (minus forgotten ones) are in its solvers; 0 before the row started.
    bank : SolverBank or None
        The solvers (created when a first row reaches its first chunk boundary).
    evicted : dict[int, tuple[Tensor, Tensor] | None]
        Physically evicted positions -> their key/value ``[b, kv_heads, head_dim]`` on the offload
        device (None when there is no offload tier).
    uncertified : set[int]
        The evicted positions that a heuristic (uncertified) policy dropped.
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
        self.admitted: list[int] = []
        self.bank: SolverBank | None = None
        self.evicted: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}
        self.uncertified: set[int] = set()
        self.forgotten: set[int] = set()
        self._snaps: dict[tuple[int, int], np.ndarray] = {}  # (row, boundary) -> alpha by position [h, L]
        self._row: tuple[tuple[int, ...], int, torch.Tensor] | None = None

    # ------------------------------------------------------------------ CacheLayerMixin API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.keys = key_states[..., :0, :].clone()
        self.values = value_states[..., :0, :].clone()
        self.positions = torch.zeros(0, dtype=torch.long, device=key_states.device)
        self.admitted = [0] * key_states.shape[0]
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
        """Forget the gate snapshots (the solvers changed)."""
        self._snaps, self._row = {}, None

    def offload_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for kv in self.evicted.values() if kv is not None for k, v in [kv])

    _SNAPSHOT_FIELDS = ("keys", "values", "positions", "seen", "is_initialized", "device")

    def snapshot(self, deep: bool = True) -> dict[str, Any]:
        """Everything a mutation may change, for :meth:`rollback`.

        The key/value/position tensors are kept by reference (every mutation builds new tensors, none
        writes in place); the solvers are deep-copied (they are updated in place) unless ``deep=False``
        (for a step that does not touch them).
        """
        st = {f: getattr(self, f, None) for f in self._SNAPSHOT_FIELDS}
        st.update(bank=copy.deepcopy(self.bank) if deep else self.bank, evicted=dict(self.evicted),
                  forgotten=set(self.forgotten), admitted=list(self.admitted), uncertified=set(self.uncertified))
        return st

    def rollback(self, st: dict[str, Any]) -> None:
        """Return to the state :meth:`snapshot` recorded."""
        for f in self._SNAPSHOT_FIELDS:
            setattr(self, f, st[f])
        self.bank, self.evicted, self.forgotten = st["bank"], st["evicted"], st["forgotten"]
        self.admitted, self.uncertified = list(st["admitted"]), set(st["uncertified"])
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
    policy : EvictionPolicy, str or None
        The eviction policy of :meth:`evict`: an instance from :mod:`sv_attention.hf.policies` or its name
        (``"certified"``, ``"h2o"``, ``"recency"``, ``"random"``). None: :class:`CertifiedPolicy`, the
        only one whose evictions are certified.
    **overrides
        Any ``"sv_attention"`` hyperparameter (``nu``, ``C``, ``n0``, ``chunk``, ``sigma``, ``gated``),
        overriding the config.

    Raises
    ------
    ConfigError
        An unknown policy name.
    InvalidInputError
        ``policy`` is neither a name nor an :class:`EvictionPolicy`; no config and no ``num_layers``.
    UnsupportedFeatureError
        A model with sliding-window layers.

    Examples
    --------
    >>> cache = CertifiedCache(model.config)                      # doctest: +SKIP
    >>> out = model.generate(ids, cache=cache, max_new_tokens=64)   # doctest: +SKIP
    >>> rep = cache.evict()                                         # doctest: +SKIP
    >>> rep = cache.forget([5])                                     # doctest: +SKIP
    """

    def __init__(self, config: Any = None, *, num_layers: int | None = None, offload: Any = "cpu",
                 policy: EvictionPolicy | str | None = None, **overrides: Any) -> None:
        text_cfg = config.get_text_config(decoder=True) if config is not None else None
        base = settings_from_config(text_cfg if text_cfg is not None else config, SV_NAME) \
            if config is not None else SVSettings()
        self.settings: SVSettings = base.replace(**overrides) if overrides else base  # renamed keywords accepted
        if num_layers is None:
            if text_cfg is None:
                raise InvalidInputError("CertifiedCache needs a model config or num_layers=")
            num_layers = int(text_cfg.num_hidden_layers)
            types = getattr(text_cfg, "layer_types", None) or []
            if any(t != "full_attention" for t in types):
                raise UnsupportedFeatureError(
                    f"CertifiedCache supports full-attention layers only, got layer_types {sorted(set(types))}; "
                    "use the model's own cache for sliding-window / hybrid models")
        if policy is None:
            policy = CertifiedPolicy()
        elif isinstance(policy, str):
            policy = get_policy(policy)
        if not isinstance(policy, EvictionPolicy):
            raise InvalidInputError(f"policy must be an EvictionPolicy from sv_attention.hf.policies or its name, got "
                                    f"{policy!r}")
        self.policy: EvictionPolicy = policy
        self.offload_device = None if offload is None else torch.device(offload)
        self.restore_events: list[RestoreEvent] = []
        self._step: tuple[int, int, dict[int, dict[str, Any]]] | None = None  # (p0, restore events, snapshots)
        self._valid = None  # [b, L] bool: real tokens (set_padding); None: no padding
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

    @property
    def _valid(self) -> np.ndarray | None:
        """Bool ``[b, L]``: True where a position ``< L`` holds a real token (:meth:`set_padding`); None: no padding."""
        return self._valid_mask

    @_valid.setter
    def _valid(self, valid: np.ndarray | None) -> None:
        self._valid_mask = valid
        self._real_upto = None if valid is None else np.cumsum(valid, axis=1)  # real tokens at positions <= p

    # ------------------------------------------------------------------ transformers API
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys/values of ``layer_idx``, admit completed chunks into the solvers (each row at
        its own boundaries), and deposit the gate for the returned slots
        (:func:`~sv_attention.hf.gate_handoff.set_pending_gate`).

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
        # a call that takes some row past its admitted boundary admits keys into the solvers: snapshot them first
        st = layer.snapshot(deep=layer.is_initialized and self._admits(layer, p0 + q - 1))
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
            raise UnsupportedFeatureError("the SV gate is disabled (gated=False): the cache admits no long-range "
                                          "tokens and reserve tokens are not inert, so it has nothing to evict; "
                                          "enable the gate")
        if not self._gate_consumed():
            impl = getattr(self._config, "_attn_implementation", None)
            raise UnsupportedFeatureError(
                f"the model runs attention {impl!r}, which ignores the SV gate (evicting reserve tokens would change "
                "its outputs) and reads key/value slots by column index (fewer slots than positions after an "
                "eviction); call sv_attention.enable(model, 'sv_attention') first")

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
    def _boundaries(self, positions: np.ndarray, b: int) -> np.ndarray:
        """Int ``[b, n]``: the boundary (a real position) each row's query at ``positions`` reads
        (:func:`~sv_attention.ops.sv_gate.schedule.boundary_of` of its real position; 0 for a query that sees
        no real key)."""
        qreal = self._query_real(positions, b)
        return boundary_of(torch.from_numpy(qreal).clamp_min(0), self.chunk).numpy()

    def _admits(self, layer: CertifiedLayer, last: int) -> bool:
        """Whether a call whose last query is at position ``last`` takes some row past its admitted boundary."""
        if not self.settings.gated or not layer.admitted:
            return False
        bnd = self._boundaries(np.array([last]), len(layer.admitted))[:, 0]
        return any(s >= self.chunk and s > a for s, a in zip(bnd.tolist(), layer.admitted, strict=True))

    def _gate(self, layer: CertifiedLayer, p0: int, q: int) -> torch.Tensor:
        """Gate weights ``[b, kv_heads, q, slots]`` for queries at positions ``p0 .. p0+q-1``.

        Row ``i``'s query at real position ``t`` reads boundary ``s = boundary_of(t)``: alpha of the row's
        solvers (streamed to hold its real keys at real positions ``< s``) on those keys, 1 on the rest;
        all ones when ``s`` is not gated (chunk 0, warm-up) or the row fell back to warm-up after deletions.
        """
        b, h = layer.keys.shape[0], layer.keys.shape[1]
        dtype, device = layer.keys.dtype, layer.keys.device
        if not self.settings.gated:
            return torch.ones(b, h, q, layer.n_slots, dtype=dtype, device=device)
        bnd = self._boundaries(np.arange(p0, p0 + q), b)  # [b, q]
        key = tuple(int(x) for x in bnd[:, -1])
        # decode fast path: every row reads the boundary of the previous call, one new slot appended
        if (q == 1 and layer._row is not None and layer._row[0] == key and layer._row[1] == layer.n_slots - 1):
            row = torch.cat([layer._row[2], torch.ones(b, h, 1, dtype=dtype, device=device)], dim=-1)
            layer._row = (key, layer.n_slots, row)
            return row[:, :, None, :]
        # stream each row's solvers through its boundaries, reading its gate at each (admissions may restore
        # evicted slots, so the slots are read only once every row has advanced)
        need = [sorted(set(bnd[i].tolist())) for i in range(b)]
        alphas: dict[tuple[int, int], np.ndarray | None] = {}
        for i in range(b):
            for s in need[i]:
                self._advance_row(layer, i, s)
                alphas[i, s] = self._snapshot(layer, i, s)
        pos = layer.slot_positions()
        real = self._real_positions(pos, b)  # [b, slots]
        slots = pos.size
        table, index = [], np.zeros((b, q), dtype=np.int64)
        for i in range(b):
            for s in need[i]:
                alpha = alphas[i, s]
                if alpha is None:
                    w = np.ones((h, slots))
                else:
                    adm = (real[i] >= 0) & (real[i] < s) & (pos < alpha.shape[1])
                    w = np.ones((h, slots))
                    w[:, adm] = alpha[:, pos[adm]]
                index[i, bnd[i] == s] = len(table)
                table.append(w)
        W = torch.from_numpy(np.stack(table)).to(device=device, dtype=dtype)  # [rows read, h, slots]
        layer._row = (key, slots, W[index[:, -1]])
        if len(table) == b and all(len(n) == 1 for n in need):  # one boundary per row
            return W[:, :, None, :].expand(b, h, q, slots)
        return W[torch.from_numpy(index).to(device)].permute(0, 2, 1, 3)

    def _snapshot(self, layer: CertifiedLayer, i: int, s: int) -> np.ndarray | None:
        """Row ``i``'s gate at boundary ``s`` by position, float64 ``[h, seen]`` (None: ungated there)."""
        bank = layer.bank
        if (not is_gated(s, self.chunk, self.warmup_size) or bank is None or not bank.started(i)
                or not bank.row_gated(i)):
            return None
        snap = layer._snaps.get((i, s))
        if snap is None:  # the row's admitted positions are < seen; the snapshot lives until the solvers change
            snap = layer._snaps[i, s] = bank.alpha_row(i, layer.seen)
        return snap

    def _advance_row(self, layer: CertifiedLayer, i: int, s: int) -> None:
        """Bring row ``i``'s solvers to boundary ``s`` (a real position): admit the row's real keys at real
        positions ``[admitted, s)``, one chunk at a time (as a token-by-token decode would); the first time,
        start the row's solvers with the bandwidth of its first ``chunk`` real keys
        (:func:`~sv_attention.ops.sv_gate.schedule.bandwidth`)."""
        c = self.chunk
        lo = layer.admitted[i]
        if s < c or lo >= s:
            return
        b, h = layer.keys.shape[0], layer.keys.shape[1]
        if layer.bank is None:
            layer.bank = SolverBank.empty(self.C, b, h)
        bank = layer.bank
        pos = layer.slot_positions()
        real = self._real_positions(pos, b)[i]
        dev = layer.keys.device
        if not bank.started(i):
            lead = np.flatnonzero((real >= 0) & (real < c))
            keys_i = layer.keys[i].index_select(-2, torch.from_numpy(lead).to(dev))
            bank.start_row(i, SolverBank.bandwidth(keys_i, self.settings.sigma, c), c)
            lo = 0
        revived: set[int] = set()
        sel = np.flatnonzero((real >= lo) & (real < s))
        if sel.size:
            kd = layer.keys[i].index_select(-2, torch.from_numpy(sel).to(dev)).detach().to("cpu", torch.float64).numpy()
            for start in range(lo, s, c):
                blk = (real[sel] >= start) & (real[sel] < start + c)
                if blk.any():
                    revived |= bank.admit_row(i, kd[:, blk], pos[sel][blk]).readmitted
        layer.admitted[i] = s
        self._restore(layer, revived, trigger=f"admission of batch row {i}'s chunk ending at real position {s}")
        layer.invalidate_snapshot()

    # ------------------------------------------------------------------ padding
    @property
    def padding_declared(self) -> bool:
        """Whether :meth:`set_padding` declared padding for the current contents (reset clears it)."""
        return self._valid is not None

    def set_padding(self, attention_mask: torch.Tensor) -> None:
        """Declare which of the first positions are padding, per batch row (before the first forward).

        Padding keys then never enter a row's solvers, and the row's chunk boundaries, warm-up and
        bandwidth count its real tokens (a query's real position is the number of real keys it sees minus
        one), so a left-padded row computes exactly what the same sequence computes alone, for any pad
        count. The model still needs the same ``attention_mask`` (``generate`` passes it) to mask the pad
        slots, and position ids that count real tokens (``generate`` builds them from the mask).

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

    def _check_rows(self, b: int) -> None:
        if self._valid is not None and self._valid.shape[0] != b:
            raise InvalidInputError(f"set_padding declared {self._valid.shape[0]} batch rows, the model runs {b}; "
                                    "declare the padding of this batch")

    def _valid_at(self, positions: np.ndarray, b: int) -> np.ndarray:
        """Bool ``[b, len(positions)]``: True where the position holds a real token in that row."""
        positions = np.asarray(positions, dtype=np.int64)
        out = np.ones((b, positions.size), dtype=bool)
        if self._valid is None:
            return out
        self._check_rows(b)
        inside = positions < self._valid.shape[1]
        out[:, inside] = self._valid[:, positions[inside]]
        return out

    def _query_real(self, positions: np.ndarray, b: int) -> np.ndarray:
        """Int ``[b, n]``: a query's real position, the number of real keys it sees (positions ``<= p``) minus one
        (-1 for a query that sees none)."""
        positions = np.asarray(positions, dtype=np.int64)
        if self._valid is None:
            return np.broadcast_to(positions, (b, positions.size)).copy()
        self._check_rows(b)
        L = self._valid.shape[1]
        upto = self._real_upto  # [b, L]
        out = np.empty((b, positions.size), dtype=np.int64)
        inside = positions < L
        out[:, inside] = upto[:, positions[inside]] - 1
        out[:, ~inside] = upto[:, -1:] + (positions[~inside] - L)[None, :] if L else positions[~inside][None, :]
        return out

    def _real_positions(self, positions: np.ndarray, b: int) -> np.ndarray:
        """Int ``[b, n]``: each key's real position in each row (its index among the row's real tokens), -1
        where it is padding."""
        real = self._query_real(positions, b)
        return np.where(self._valid_at(positions, b), real, -1)

    def _local(self, layer: CertifiedLayer, positions: np.ndarray) -> np.ndarray:
        """Bool ``[n]``: True where some row holds the position as a real token it has not admitted (its current
        chunk, or a row whose solvers have not started): read densely there, never evicted."""
        positions = np.asarray(positions, dtype=np.int64)
        if not layer.admitted or positions.size == 0:
            return np.zeros(positions.size, dtype=bool)
        real = self._real_positions(positions, len(layer.admitted))
        return ((real >= 0) & (real >= np.asarray(layer.admitted)[:, None])).any(axis=0)

    def _active(self, layer: CertifiedLayer, positions: np.ndarray) -> np.ndarray:
        """Bool ``[n]``: True where some row holds the position as a real token active (not evicted at the solver
        level) in one of its solvers."""
        positions = np.asarray(positions, dtype=np.int64)
        out = np.zeros(positions.size, dtype=bool)
        bank = layer.bank
        if bank is None or positions.size == 0:
            return out
        valid = self._valid_at(positions, bank.shape[0])
        for i in range(bank.shape[0]):
            if bank.started(i):
                out |= valid[i] & np.isin(positions, list(bank.active_row(i)))
        return out

    def _restore(self, layer: CertifiedLayer, revived: set[int], trigger: str) -> list[RestoreEvent]:
        """Bring back physically evicted tokens that a solver re-admitted."""
        events = []
        for p in sorted(int(x) for x in revived):
            if p not in layer.evicted:
                continue  # still present in this layer (evicted in some heads only)
            kv = layer.evicted.pop(p)
            layer.uncertified.discard(p)
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
            "gate_bytes": sum(a.nbytes for layer in self.layers for a in layer._snaps.values()),
            "solver_bytes": sum(layer.bank.nbytes() for layer in self.layers if layer.bank is not None),
        }

    def slots_per_layer(self) -> list[int]:
        return [layer.n_slots for layer in self.layers]

    # ------------------------------------------------------------------ eviction
    def evict(self, budget: int | None = None) -> EvictionReceipt:
        """Evict long-range key/value slots with the cache's policy (:attr:`policy`).

        With the certified policy (the default) only tokens whose alpha is exactly 0 in every solver of a
        layer that holds them (every batch row where they are real tokens) leave it, so every later output is
        unchanged. A heuristic policy (heavy-hitter, recency, random) drops long-range slots to meet the
        budget whatever their alpha: not certified, and the receipt says so. Current-chunk tokens (of any
        row) are never evicted.

        Parameters
        ----------
        budget : int or None
            Target number of slots per layer. None (certified policy only) evicts every certified-inert
            token. A certified eviction never drops a support vector, so the budget may be missed
            (``receipt.budget_met``); it is then filled with the most recent reserve tokens. Every policy
            keeps the current-chunk tokens, so a budget below their number is missed too.

        Returns
        -------
        EvictionReceipt

        Raises
        ------
        InvalidInputError
            ``budget`` is not a non-negative integer; None with a heuristic policy; with the certified
            policy, below the warm-up threshold ``ceil(1/C) + 2`` (no certificate can exist for fewer keys).
            The cache is unchanged.
        UnsupportedFeatureError
            The model does not run the ``"sv_attention"`` function (it would read the remaining slots by
            column index, or ignore the gate), or the gate is disabled. The cache is unchanged.
        SolverError
            An unexpected failure part-way; the cache is rolled back to its state before the call.
        """
        self._check_certifiable()
        certified = self.policy.certified
        if budget is None:
            if not certified:
                raise InvalidInputError(f"policy {self.policy.name!r} needs a budget (slots per layer); only the "
                                        "certified policy evicts 'every inert token' with budget=None")
        else:
            if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 0:
                raise InvalidInputError(f"budget must be a non-negative integer or None, got {budget!r}")
            if certified and budget < self.warmup_size:
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

    def _attention_mass(self, layer: CertifiedLayer, pos: np.ndarray) -> np.ndarray:
        """The heavy-hitter score of every slot ``[slots]``: the causal softmax attention mass it receives,
        summed over batch rows and kv-heads, with the layer's cached keys standing in for the queries (the
        cache never sees the queries); padding neither gives nor receives mass."""
        b, h = layer.keys.shape[0], layer.keys.shape[1]
        valid = self._valid_at(pos, b)
        mass = np.zeros(pos.size)
        kd = layer.keys.detach().to("cpu", torch.float64).numpy()
        for i in range(b):
            sel = np.flatnonzero(valid[i])
            for j in range(h):
                x = kd[i, j, sel]
                mass[sel] += softmax_attention_mass(x, x, causal=True, query_positions=pos[sel], key_positions=pos[sel])
        return mass

    def _evict_layer(self, layer: CertifiedLayer, budget: int | None) -> LayerEviction:
        policy = self.policy
        n0 = layer.n_slots
        pos = layer.slot_positions()
        local = self._local(layer, pos)
        n_local = int(local.sum())
        bank = layer.bank
        n_adm = len(bank.history) if bank is not None else 0
        b = layer.keys.shape[0] if layer.is_initialized else 0
        frac = bank.reserve_fraction() if bank is not None else [[0.0] * layer.keys.shape[1] for _ in range(b)]
        cert = bank.certified() if bank is not None else \
            BankCertificate(False, "no chunk boundary yet: nothing admitted, no certificate", 0.0)

        def skipped(reason: str, kkt: float = 0.0) -> LayerEviction:
            return LayerEviction(layer.layer_idx, False, reason, n0, n0, n_adm, n_local, frac, (), 0.0, kkt,
                                 policy=policy.name)

        if policy.certified and not cert.certified:
            return skipped(cert.reason, cert.kkt_max)
        if bank is None:
            return skipped(f"policy {policy.name!r}: no chunk boundary yet, no long-range token to evict")
        # the gate each row reads now: alpha on its admitted keys (gated rows), 1 (ungated rows)
        alpha_before = np.stack([bank.alpha_row(i, layer.seen) for i in range(b)])  # [b, h, seen]
        if policy.certified:
            bank.evict_reserve()
        cand = pos[~local]
        support = self._active(layer, cand)  # certified policy: every position some row still needs
        if not policy.certified:  # informative only: a heuristic policy does not need it
            support = (alpha_before[:, :, cand] > 0).any(axis=(0, 1))
        ctx = PolicyContext(positions=cand, support=support,
                            attention_mass=self._attention_mass(layer, pos)[~local] if "attention_mass" in policy.needs
                            else None)
        if budget is None:
            target = int(support.sum())
        else:
            target = max(0, budget - n_local)
        dec = policy.select(ctx, target)
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
            if not policy.certified:
                layer.uncertified.update(drop)
            layer.drop_positions(set(drop))
        # the largest weight a dropped token carried in a row where it is a real token
        real = self._valid_at(np.asarray(drop, dtype=np.int64), b)
        held = [alpha_before[i][:, drop][:, real[i]] for i in range(b)] if drop else []
        max_alpha = max((float(x.max()) for x in held if x.size), default=0.0)
        kkt = bank.certified().kkt_max
        ok = policy.certified and cert.certified
        reason = cert.reason if ok else (f"policy {policy.name!r} evicts without a certificate (dropped tokens held "
                                         f"alpha up to {max_alpha:.3g}); the bank: {cert.reason}")
        return LayerEviction(layer.layer_idx, ok, reason, n0, layer.n_slots, n_adm, n_local, frac, tuple(drop),
                             len(drop) / n_adm if n_adm else 0.0, kkt, max_alpha, policy=policy.name)

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
            local = self._local(layer, np.array(lst, dtype=np.int64))
            for p, loc in zip(lst, local.tolist(), strict=True):
                path = PATH_EXACT if p in long else PATH_LOCAL
                if p in long and loc:  # admitted by some rows, in the current chunk (or not started) of others
                    path = f"{PATH_EXACT} (rows that admitted it), {PATH_LOCAL} (rows that did not yet)"
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
            layer.uncertified.difference_update(lst)
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
        """Keep positions ``< m`` only. A batch row whose boundary stays where it is keeps its solvers exactly
        as they are (``crop(seen)`` changes nothing); the solvers of a row whose boundary moves back are
        rebuilt from their stored fp64 keys, chunk by chunk, so that they hold exactly what a cache that saw
        only those ``m`` positions would hold."""
        c = self.chunk
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            drop = {int(p) for p in layer.slot_positions() if p >= m}
            layer.drop_positions(drop)
            layer.evicted = {p: kv for p, kv in layer.evicted.items() if p < m}
            layer.uncertified = {p for p in layer.uncertified if p < m}
            layer.forgotten = {p for p in layer.forgotten if p < m}
            layer.seen = min(layer.seen, m)
            b = len(layer.admitted)
            # each row's boundary after the truncation: the one its last kept query reads (0 before chunk 1)
            target = self._boundaries(np.array([m - 1]), b)[:, 0].tolist() if m > 0 else [0] * b
            target = [t if t >= c else 0 for t in target]
            bank = layer.bank
            rebuild = [i for i in range(b) if target[i] < layer.admitted[i]]
            layer.admitted = [min(a, t) for a, t in zip(layer.admitted, target, strict=True)]
            if bank is None or not rebuild:  # every admitted position is kept: the solvers stay as they are
                layer.invalidate_snapshot()
                continue
            keys = self._history_keys(bank)  # {(row, kv-head): {pos: key}}
            for i in rebuild:
                sigma = bank.sigma[i].copy()
                hist = np.array(sorted(bank.row_history[i]), dtype=np.int64)
                bank.clear_row(i)
                if target[i] < c:
                    continue
                bank.start_row(i, sigma, c)
                real = self._real_positions(hist, b)[i]
                for lo in range(0, target[i], c):  # the admissions a fresh cache makes: one chunk at a time
                    blk = hist[(real >= lo) & (real < lo + c)]
                    if blk.size:
                        kd = np.stack([np.stack([keys[i, j][int(p)] for p in blk]) for j in range(bank.shape[1])])
                        bank.admit_row(i, kd, blk)
            if not any(bank.started(i) for i in range(b)):
                layer.bank = None
            self._reevict(layer, trigger=f"rebuild of the cache for the first {m} positions", rows=rebuild)
            layer.invalidate_snapshot()

    def _reevict(self, layer: CertifiedLayer, trigger: str, rows: list[int] | None = None) -> None:
        """After a rebuild (of ``rows``; None: every row), keep the layer's physically evicted tokens
        evicted where that stays exact: tokens still admitted go back into the solvers' evicted stores
        (re-checked at every later admission). A token that some row no longer has admitted (its current
        chunk again, or a row not started) is restored, and so is a certified-evicted token that is not
        reserve in the rebuilt solvers of a row where it is real. (Tokens a heuristic policy dropped stay
        dropped while admitted.)"""
        if not layer.evicted:
            return
        if layer.bank is not None:
            layer.bank.evict_reserve(rows=rows)
        ev = np.array(sorted(layer.evicted), dtype=np.int64)
        restore = self._local(layer, ev)
        certified = ~np.isin(ev, list(layer.uncertified))
        restore |= certified & self._active(layer, ev)
        self._restore(layer, {int(p) for p in ev[restore]}, trigger=trigger)

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
        """Per layer: gated / warm-up, admitted keys, slots, physically evicted tokens (and how many of them a
        heuristic policy dropped), whether every solver holds a certificate, the largest KKT residual; plus
        the restore events so far. ``exact`` is False once a revived token could not be restored or a
        heuristic policy dropped a token that is still gone."""
        layers = []
        for layer in self.layers:
            bank = layer.bank
            cert = bank.certified() if bank is not None else BankCertificate(False, "no chunk boundary yet", 0.0)
            layers.append({"layer": layer.layer_idx, "gated": bool(bank is not None and bank.gated),
                           "admitted": len(bank.history) if bank is not None else 0, "slots": layer.n_slots,
                           "evicted": len(layer.evicted), "evicted_uncertified": len(layer.uncertified),
                           "certified": cert.certified, "reason": cert.reason, "kkt_max": cert.kkt_max})
        lost = [e for e in self.restore_events if not e.restored]
        return {"layers": layers, "exact": not lost and not any(layer.uncertified for layer in self.layers),
                "restore_events": [(e.layer, e.position, e.restored, e.trigger) for e in self.restore_events]}

    def __repr__(self) -> str:
        return (f"CertifiedCache(layers={len(self.layers)}, seen={self.get_seq_length()}, "
                f"slots={self.slots_per_layer()}, C={self.C:.4g}, chunk={self.chunk})")
