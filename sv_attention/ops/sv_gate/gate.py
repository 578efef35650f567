"""The chunk-frozen SV gate of one layer call: schedule, fits (batched or exact), the log-gate bias.

For every sequence ``b`` and kv-head ``g``, the queries at positions ``[s, s + chunk)`` read a gate fitted
on the keys at positions ``< s`` (:mod:`sv_attention.ops.sv_gate.schedule`): the SVDD coefficients
``alpha_j`` (box ``C`` fixed, RBF bandwidth ``sigma``). The readout multiplies the softmax weights by
``alpha_j`` on that gated prefix and by 1 on the local chunk, then renormalises; this module returns the
multiplicative weights as a factored log-bias (:class:`GateBias`: ``log alpha``, ``-inf`` on reserve keys,
0 elsewhere) that the readout adds to its logits before one softmax.

Fits (:mod:`sv_attention.ops.sv_gate.fit`): ``solver="batched"`` runs the warm-started batched chain
(boundaries in increasing order, each warm from the previous one's gate) and, with
``detach_gate=False``, the differentiable final solve; ``solver="exact"`` streams the keys into fp64
maintained solvers (:mod:`sv_attention.ops.sv_gate.exact`).

Decode fast path: a decode step (one query per sequence, kept state) whose new key column is a valid key of
every sequence, whose older columns are the previous call's, and whose gates are all fitted already (the step
crosses no boundary) is served from what the previous call left in the state
(:class:`~sv_attention.ops.sv_gate.state.DecodeCache`): the positions are counts kept in Python, the key
positions a prefix of a kept buffer, and the log-table (only the slots the step reads, laid out as the general
path lays them out) is built once per set of boundaries read, not per step. It returns the same gate, bias (table,
slots, key positions), bandwidth and state as the general path (tested bit for bit); :data:`DECODE_FAST_PATH`
turns it off, ``gate_stats()`` counts it (``decode_fast_path``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from sv_attention.kernels import median_bandwidth, rbf_gram
from sv_attention.ops.settings import SVSettings
from sv_attention.ops.sv_gate.fit import (
    CountingSolve,
    count,
    differentiable_gate,
    fit_chain_from,
    fit_cold,
    fit_from,
    fit_masked,
)
from sv_attention.ops.sv_gate.schedule import GateSchedule, bandwidth, decode_boundaries
from sv_attention.ops.sv_gate.state import DecodeCache, DecodeTable, GateState, key_fingerprint
from sv_attention.svdd.gram_rows import LazyRBFGram
from sv_attention.threads import torch_threads

#: Largest dense Gram (bytes, all sequences and kv-heads of a layer call) the gate builds; beyond it, and for
#: a call that fits a single boundary, rows are computed on demand (:class:`~sv_attention.svdd.gram_rows.LazyRBFGram`).
DENSE_GRAM_MAX_BYTES = 256 * 2**20
#: torch intra-op threads while the gate fits its boundaries on a CPU (None: leave torch's setting).
#: The fits are chains of small operations (solves of a few hundred unknowns, row gathers) for which
#: extra threads cost more in synchronisation than they save -- measured 5-10x slower with 2 threads
#: than with 1 on a loaded 2-core machine; the Gram and the attention itself keep every thread.
GATE_FIT_THREADS: int | None = 1
#: Fit the boundaries of a layer call as one chain in one native call (:func:`fit_chain_from`) when it has at most
#: this many problems (sequences x kv-heads): a prefill of one sequence is dominated by the per-boundary round
#: trips the chain removes (2048 tokens, 2 kv-heads: 445 -> 328 ms); a training batch of 64 problems x 3
#: boundaries was measured 2-4% faster boundary by boundary (each call shares 64 problems over the threads).
CHAIN_MAX_PROBLEMS = 16
#: A chain reads a row store the kernel fills (True) or the dense Gram (False).
CHAIN_ROW_STORE = True
#: Serve decode steps whose gates are already fitted from the state's :class:`DecodeCache` (same result as the
#: general path, a fraction of its bookkeeping). False: every call takes the general path and no cache is kept.
DECODE_FAST_PATH = True
#: Key columns the decode cache's buffers hold past the call that builds them (grown on demand).
DECODE_HEADROOM = 64


#: Callbacks ``fn(s, alpha [m, g, s])`` called with the gate of every boundary a causal call reads (``m``: the
#: sequences reading it); see :func:`observe_gates`.
_OBSERVERS: list[Callable[[int, torch.Tensor], None]] = []


@contextlib.contextmanager
def observe_gates(callback: Callable[[int, torch.Tensor], None]) -> Iterator[None]:
    """While active, ``callback(s, alpha)`` receives the gate (detached, ``[m, g, s]``) of every boundary
    ``s`` that a causal layer call reads, for the ``m`` sequences that read it (studies, e.g. gate support)."""
    _OBSERVERS.append(callback)
    try:
        yield
    finally:
        _OBSERVERS.remove(callback)


def safe_log(weights: torch.Tensor) -> torch.Tensor:
    """``log(w)`` with ``-inf`` where ``w <= 0`` and a zero (not NaN) gradient there."""
    pos = weights > 0
    if not (weights.requires_grad and torch.is_grad_enabled()):  # no gradient: log 0 = -inf does it in one pass
        return torch.log(torch.where(pos, weights, 0.0))
    return torch.where(pos, torch.log(torch.where(pos, weights, torch.ones_like(weights))),
                       torch.full_like(weights, float("-inf")))


@dataclass
class GateBias:
    """The log-gate bias ``[b, g, q, kv]`` of a causal layer, kept factored (the fused readout turns the
    table into key columns and each row's slot into a one-hot: :mod:`sv_attention.ops.sv_gate.fused`).

    ``bias[b, g, r, j] = log_table[b, g, slot[b, r], key_position[b, j]]``.

    Attributes
    ----------
    log_table : Tensor ``[b, g, S + 1, P]``  log gate by (boundary slot, key position); slot ``S`` is
        "ungated" (all 0)
    slot : long Tensor ``[b, q]``  the boundary slot each query reads
    key_position : long Tensor ``[b, kv]``  position of each key column (0 for invalid columns, which the
        visibility mask hides anyway)
    """

    log_table: torch.Tensor
    slot: torch.Tensor
    key_position: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        b, g = self.log_table.shape[:2]
        return torch.Size((b, g, self.slot.shape[1], self.key_position.shape[1]))

    def rows(self, r0: int, r1: int, end: int) -> torch.Tensor:
        """``bias[:, :, r0:r1, :end]`` as a new tensor ``[b, g, r1 - r0, end]``."""
        b, g, slots, P = self.log_table.shape
        lin = self.slot[:, r0:r1, None] * P + self.key_position[:, None, :end]  # [b, rows, end]
        n = lin.shape[1] * lin.shape[2]
        flat = self.log_table.reshape(b, g, slots * P)
        return torch.gather(flat, 2, lin.reshape(b, 1, n).expand(b, g, n)).reshape(b, g, r1 - r0, end)

    def dense(self) -> torch.Tensor:
        """The whole bias ``[b, g, q, kv]``."""
        return self.rows(0, self.slot.shape[1], self.key_position.shape[1])


@dataclass
class Gate:
    """What a layer call's gate computation returns.

    Attributes
    ----------
    bias : GateBias, Tensor ``[b, g, 1, kv]`` (non-causal) or None when no query reads a fitted gate
    sigma : Tensor ``[b, g]`` or None  the bandwidth used (None when nothing was fitted)
    alphas : dict ``s -> Tensor [b, g, s]``  the gate of every boundary read in this call, by position
    state : GateState or None  the updated decoding state (when asked to keep one)
    """

    bias: GateBias | torch.Tensor | None
    sigma: torch.Tensor | None
    alphas: dict[int, torch.Tensor]
    state: GateState | None


def _fit_threads(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """Context of the boundary fits: :data:`GATE_FIT_THREADS` intra-op threads on a CPU (process-wide
    while it lasts, restored after), nothing on other devices."""
    if GATE_FIT_THREADS is None or device.type != "cpu" or torch.get_num_threads() <= GATE_FIT_THREADS:
        return contextlib.nullcontext()
    return torch_threads(GATE_FIT_THREADS)


def _usable_state(state: GateState | None, key: torch.Tensor, sched: GateSchedule, q: int) -> GateState | None:
    """``state`` when its key columns are unchanged, with the gates whose prefix is gone (a crop) dropped."""
    if state is None:
        return None
    if not state.matches(key, q):
        count("state_reset")
        return None
    kv = key.shape[2]
    kept = sched.valid[:, : kv - q].sum(-1) if kv > q else torch.zeros_like(sched.lengths)
    for s in list(state.gates):
        state.done[s] = state.done[s] & (kept >= s)
    state.sigma = torch.where((kept >= sched.chunk)[:, None], state.sigma, torch.full_like(state.sigma, float("nan")))
    if state.exact is not None and state.exact_ingested is not None \
            and any(int(k) < n for k, n in zip(kept.tolist(), state.exact_ingested)):
        state.exact, state.exact_ingested = None, None  # a crop: the exact solvers restart from the keys
    return state


@torch.compiler.disable  # the solver boundary: under torch.compile the gate runs eagerly (one graph break per call)
def causal_gate(key: torch.Tensor, visible: torch.Tensor, settings: SVSettings, *,
                state: GateState | None = None, keep_state: bool = False, detach: bool = True,
                valid: torch.Tensor | None = None, base: torch.Tensor | None = None) -> Gate:
    """The gate of a causal layer call.

    Parameters
    ----------
    key : Tensor ``[b, g, kv, d]`` (all keys of the layer, past included; fp32 / fp64)
    visible : bool Tensor ``[b, q, kv]``  what each query may attend (padding, causality, windows)
    settings : SVSettings
    state : GateState or None  from the previous call of this layer
    keep_state : bool  return an updated state (decoding)
    detach : bool  False: the gates carry the autograd graph of ``key`` (batched solver only)
    valid, base : see :meth:`GateSchedule.from_visible` (a sliding-window layer's decode steps)

    Returns
    -------
    Gate  (``alphas`` holds the full-attention boundaries; the window rule's gates, refitted every call,
    are in the bias only)
    """
    b, g, kv, d = key.shape
    q = visible.shape[1]
    if q == 1 and keep_state and detach and state is not None and state.decode is not None:
        fast = _decode_step(key, visible, settings, state, valid, base)
        if fast is not None:
            return fast
    sched = GateSchedule.from_visible(visible, settings, valid=valid, base=base)
    state = _usable_state(state, key, sched, q) if keep_state else None
    if not bool(sched.gated.any()):
        if keep_state:
            state = state or GateState.new(key)
            state.record(key, None)
            _leave_decode_cache(state, sched, None, settings, key.dtype, windowed=False)
        return Gate(bias=None, sigma=None, alphas={}, state=state)
    P = int(sched.lengths.max())
    dt = key.dtype
    kbp_cache: list[torch.Tensor] = []

    def kbp() -> torch.Tensor:  # keys by position [b, g, P, d], built only when a fit or a bandwidth needs it
        if not kbp_cache:
            kbp_cache.append(sched.keys_by_position(key.detach(), P))
        return kbp_cache[0]

    # bandwidth per (sequence, kv-head)
    if settings.sigma is not None:
        sig = torch.full((b, g), settings.sigma, dtype=dt, device=key.device)
    else:
        sig = state.sigma.to(dt) if state is not None else torch.full((b, g), float("nan"), dtype=dt,
                                                                     device=key.device)
        need = sched.full.any(-1)[:, None] & torch.isnan(sig)
        if bool(need.any()):
            sig = torch.where(need, bandwidth(kbp(), sched.lengths, settings.chunk).to(dt), sig)

    bounds = sched.boundaries()
    S = len(bounds)
    bounds_t = torch.tensor(bounds, dtype=torch.long, device=key.device)
    # reads[b, i]: sequence b has a full-attention query reading boundary i (one pass for every boundary)
    reads = (sched.full[:, None, :] & (sched.boundary[:, None, :] == bounds_t[None, :, None])).any(-1)
    rows_of = list(reads.unbind(1))  # [b] sequences reading each boundary
    have = torch.zeros_like(reads)  # gates kept in the state (decoding), not refitted
    alphas: list[torch.Tensor] = []
    zeros = torch.zeros(b, g, S, max(bounds, default=0), dtype=dt, device=key.device)  # one fill, a view each
    for i, s in enumerate(bounds):
        alpha = zeros[:, :, i, :s]
        if state is not None and s in state.gates and detach:
            have[:, i] = state.done[s] & rows_of[i]
            alpha = torch.where(have[:, i, None, None], state.gates[s].to(dt), alpha)
            count("reused", int(have[:, i].sum()))
        alphas.append(alpha)
    need = reads & ~have
    todo: list[tuple[int, int, torch.Tensor]] = []  # (boundary index, s, sequences to fit)
    for i, rows in enumerate(need.T.tolist()):
        if any(rows):
            todo.append((i, bounds[i], torch.tensor([r for r, x in enumerate(rows) if x], device=key.device)))
    if todo:
        if settings.solver == "exact":
            from sv_attention.ops.sv_gate.exact import exact_gates

            state_for_exact = state if keep_state else None
            fitted, exact_solvers = exact_gates(kbp(), sched.lengths, sig, settings.box, todo, state_for_exact)
            for i, s, rows in todo:
                alphas[i] = alphas[i].index_copy(0, rows, fitted[(i, s)].to(dt))
            if keep_state:
                state = state or GateState.new(key, sig)
                state.exact, state.exact_ingested = exact_solvers
        else:
            _fit_batched(alphas, bounds, reads & ~need, todo, kbp, sig, settings, state, d)
    if not detach:  # the same gates, recomputed on a Gram that carries the keys' autograd graph
        kbp_grad = sched.keys_by_position(key, P)
        for i, s in enumerate(bounds):
            rows = rows_of[i].nonzero().flatten()
            keys = kbp_grad[rows][:, :, :s].reshape(-1, s, d)
            gram = rbf_gram(keys, sigma=sig[rows].reshape(-1)[:, None, None].detach())
            grad_alpha = differentiable_gate(gram, alphas[i][rows].reshape(-1, s), settings.box)
            alphas[i] = alphas[i].index_copy(0, rows, grad_alpha.reshape(len(rows), g, s))
    for observer in _OBSERVERS:
        for i, s in enumerate(bounds):
            observer(s, alphas[i][rows_of[i]].detach())
    table = torch.ones(b, g, S + 1, P, dtype=dt, device=key.device)  # slot S: "ungated"
    for i in range(S):
        a = alphas[i].clamp_min(settings.gate_floor) if settings.gate_floor > 0 else alphas[i]
        if a.requires_grad:
            table = _set_slot(table, i, a)  # out of place: autograd reaches the gate
        else:
            table[:, :, i, : a.shape[-1]] = a
    windows = sched.window_slots()
    if windows:  # the window rule: one gate per distinct (a, s), on the keys at positions [a, s)
        rows = _window_rows(key, sched, windows, kbp, P, settings, detach)
        table = torch.cat([table[:, :, :S], rows, table[:, :, S:]], 2)
    if keep_state:
        state = state or GateState.new(key, sig)
        every = reads.all(0).tolist()  # boundaries every sequence reads: the new gate replaces the kept one
        for i, s in enumerate(bounds):
            if every[i] or s not in state.gates:
                state.gates[s] = alphas[i].detach() if every[i] else torch.where(
                    rows_of[i][:, None, None], alphas[i].detach(), torch.zeros_like(alphas[i]))
                state.done[s] = rows_of[i].clone()
            else:
                state.gates[s] = torch.where(rows_of[i][:, None, None], alphas[i].detach(), state.gates[s])
                state.done[s] = state.done[s] | rows_of[i]
        state.record(key, sig)
        # later queries only read their current boundary or later ones: drop older gates (state stays O(kv))
        qpos_last = sched.query_position[:, -1]
        last = torch.where(qpos_last >= 0, sched.boundary[:, -1], torch.zeros_like(qpos_last))
        oldest = int(last.min())
        for s_old in [s_ for s_ in state.gates if s_ < oldest]:
            del state.gates[s_old], state.done[s_old]
    # a full-attention query reads the slot of its boundary (every such boundary is in ``bounds``, ascending)
    slot = torch.where(sched.full, torch.searchsorted(bounds_t, sched.boundary),
                       torch.full((b, q), S + len(windows), dtype=torch.long, device=key.device))
    for j, (a, s) in enumerate(windows):
        hit = sched.windowed & (sched.start == a) & (sched.boundary == s)
        slot = torch.where(hit, torch.full_like(slot, S + j), slot)
    bias = GateBias(log_table=safe_log(table), slot=slot, key_position=sched.local_position().clamp_min(0))
    if keep_state:
        _leave_decode_cache(state, sched, bias.key_position, settings, dt, windowed=bool(windows))
    return Gate(bias=bias, sigma=sig, alphas=dict(zip(bounds, alphas)), state=state)


def _settings_key(settings: SVSettings, dtype: torch.dtype) -> tuple:
    """What a :class:`DecodeCache` depends on besides the state: ``(chunk, warmup, gate_floor, sigma, dtype)``."""
    return settings.chunk, settings.warmup, settings.gate_floor, settings.sigma, dtype


def _leave_decode_cache(state: GateState, sched: GateSchedule, key_position: torch.Tensor | None,
                        settings: SVSettings, dtype: torch.dtype, windowed: bool) -> None:
    """Set ``state.decode`` after a call of the general path: a fresh :class:`DecodeCache`, or None where no
    decode step can take the fast path (fast path off, windowed queries, keys dropped by a rolling cache).

    Parameters
    ----------
    state : GateState  the state after the call
    sched : GateSchedule  the call's schedule
    key_position : long Tensor ``[b, kv]`` or None  the call's log-bias key positions (None: computed here)
    settings : SVSettings; dtype : the gate's dtype
    windowed : bool  some query of the call read a window-rule gate
    """
    state.decode = None
    if not DECODE_FAST_PATH or windowed or (sched.base is not None and bool(sched.base.any())):
        return
    if key_position is None:
        key_position = sched.local_position().clamp_min(0)
    state.decode = DecodeCache.build(settings, _settings_key(settings, dtype), sched.valid, key_position,
                                     sched.lengths, state, max(DECODE_HEADROOM, 1))


def _decode_step(key: torch.Tensor, visible: torch.Tensor, settings: SVSettings, state: GateState,
                 valid: torch.Tensor | None, base: torch.Tensor | None) -> Gate | None:
    """The decode fast path: the gate of a one-query call from ``state.decode``, or None (the state unchanged)
    when the call needs the general path (:func:`_decode_plan`).

    Parameters
    ----------
    key : Tensor ``[b, g, kv, d]``; visible : bool Tensor ``[b, 1, kv]``
    settings : SVSettings; state : GateState (with ``decode``)
    valid : bool Tensor ``[b, kv]`` or None; base : long Tensor ``[b]`` or None  (see :func:`causal_gate`)

    Returns
    -------
    Gate or None  (as the general path's: ``bias`` None when no sequence is gated)
    """
    plan = _decode_plan(key, visible, settings, state, valid, base)
    if plan is None:
        return None
    boundary, read, fingerprint = plan
    cache = state.decode
    b, g, kv, _ = key.shape
    count("decode_fast_path")
    kept = cache.lengths  # valid keys before the new column = each query's position
    _forget_cropped(state, cache, kept, settings.chunk)
    lengths = [n + 1 for n in kept]
    if all(s < 0 for s in read):
        state.record(key, None, fingerprint)
        cache.advance(kv, lengths)
        return Gate(bias=None, sigma=None, alphas={}, state=state)
    if settings.sigma is None:
        sig = state.sigma
    else:
        if cache.sigma_const is None:
            cache.sigma_const = torch.full((b, g), settings.sigma, dtype=key.dtype, device=key.device)
        sig = cache.sigma_const
    count("reused", sum(s >= 0 for s in read))
    P = max(lengths)
    table = cache.table
    if table is None or table.read != tuple(read) or table.log_table.shape[-1] < P:
        table = cache.table = _decode_table(state, tuple(read), settings.gate_floor, P + max(DECODE_HEADROOM, 1))
    bias = GateBias(log_table=table.log_table[..., :P], slot=table.slot, key_position=cache.key_position[:, :kv])
    state.record(key, sig, fingerprint)
    oldest = min(boundary)  # later queries only read this boundary or later ones
    for s_old in [s_ for s_ in state.gates if s_ < oldest]:
        del state.gates[s_old], state.done[s_old]
        cache.done.pop(s_old, None)
    cache.advance(kv, lengths)
    return Gate(bias=bias, sigma=sig, alphas=dict(table.alphas), state=state)


def _decode_plan(key: torch.Tensor, visible: torch.Tensor, settings: SVSettings, state: GateState,
                 valid: torch.Tensor | None, base: torch.Tensor | None
                 ) -> tuple[list[int], list[int], torch.Tensor] | None:
    """Whether a one-query call can take the decode fast path, and its schedule.

    It can when the cache was built for these settings and dtype, the call adds exactly one key column, valid and
    visible in every sequence, to the previous call's columns (unchanged: validity and fingerprint), every query
    sees all valid keys of its sequence (``a = 0``, nothing dropped by a rolling cache) and every gated query's
    gate and bandwidth are in the state: no fit, and the general path's result. Host syncs: the two
    ``torch.equal`` (validity, fingerprint), two more for a sliding-window layer (``valid``, ``base``).

    Returns
    -------
    ``(boundary, read, fingerprint)``: :func:`~sv_attention.ops.sv_gate.schedule.decode_boundaries` (``[b]``
    each) and the key's :func:`~sv_attention.ops.sv_gate.state.key_fingerprint` ``[b, g, kv]`` (read once: the
    check and the new state's); or None
    """
    cache = state.decode
    if not DECODE_FAST_PATH or _OBSERVERS:
        return None
    b, _, kv, _ = key.shape
    dt = key.dtype
    if cache.n != kv - 1 or kv < 2 or state.fingerprint.shape[-1] != kv - 1 or cache.valid.shape[0] != b:
        return None
    if cache.settings is not settings:
        if cache.settings_key != _settings_key(settings, dt):
            return None
        cache.settings = settings
    elif cache.settings_key[-1] != dt:
        return None
    vis = visible[:, 0]
    if valid is not None and not torch.equal(valid, vis):
        return None  # keys out of the window: the window rule
    if base is not None and bool(base.any()):
        return None
    if kv > cache.valid.shape[1]:
        cache.grow(kv + max(DECODE_HEADROOM, 1))
    if not torch.equal(vis, cache.valid[:, :kv]):
        return None
    fingerprint = key_fingerprint(key)
    if not torch.equal(state.fingerprint, fingerprint[..., :kv - 1]):  # GateState.matches(key, 1)
        return None
    chunk, warmup = cache.settings_key[:2]
    boundary, read = decode_boundaries(cache.lengths, chunk, warmup)
    if not _gates_ready(state, cache, read, settings, dt):
        return None
    return boundary, read, fingerprint


def _gates_ready(state: GateState, cache: DecodeCache, read: list[int], settings: SVSettings,
                 dtype: torch.dtype) -> bool:
    """Whether every gated sequence's gate (boundary ``read[i]``) and bandwidth are in the state, in ``dtype``."""
    for i, s in enumerate(read):
        if s < 0:
            continue
        flags = cache.done.get(s)
        gate = state.gates.get(s)
        if flags is None or gate is None or not flags[i] or gate.dtype != dtype:
            return False
        if settings.sigma is None and (not cache.sigma_known[i] or state.sigma.dtype != dtype):
            return False
    return True


def _forget_cropped(state: GateState, cache: DecodeCache, kept: list[int], chunk: int) -> None:
    """What :func:`_usable_state` does to a matching state, from the kept counts ``kept [b]`` (Python): gates whose
    prefix is longer than the kept keys are not done, nor a bandwidth of fewer than ``chunk`` keys, and the exact
    solvers restart when keys they ingested are gone. (A plain decode step changes nothing here.)"""
    dev = state.sigma.device
    for s, flags in cache.done.items():
        if any(f and n < s for f, n in zip(flags, kept)):
            keep = [n >= s for n in kept]
            state.done[s] = state.done[s] & torch.tensor(keep, device=dev)
            cache.done[s] = [f and k for f, k in zip(flags, keep)]
    if any(n < chunk for n in kept):
        long_enough = [n >= chunk for n in kept]
        state.sigma = torch.where(torch.tensor(long_enough, device=dev)[:, None], state.sigma,
                                  torch.full_like(state.sigma, float("nan")))
        cache.sigma_known = [k and e for k, e in zip(cache.sigma_known, long_enough)]
    if state.exact is not None and state.exact_ingested is not None \
            and any(n < m for n, m in zip(kept, state.exact_ingested)):
        state.exact, state.exact_ingested = None, None


def _decode_table(state: GateState, read: tuple[int, ...], gate_floor: float, width: int) -> DecodeTable:
    """The log-gate of a decode step (:class:`DecodeTable`), laid out as the general path lays it out: one slot
    per distinct boundary read (ascending), then the ungated slot; ``width`` positions (>= the longest sequence).
    So a readout sees the same factored bias (the fused one appends one column per gated slot)."""
    gates = state.gates
    bounds = sorted({s for s in read if s >= 0})
    b, g, _ = gates[bounds[0]].shape
    dt, dev = gates[bounds[0]].dtype, gates[bounds[0]].device
    log_table = torch.zeros(b, g, len(bounds) + 1, width, dtype=dt, device=dev)  # log 1 = 0: ungated
    alphas: dict[int, torch.Tensor] = {}
    for i, s in enumerate(bounds):
        reads = [r == s for r in read]
        gate = gates[s]
        alpha = gate if all(reads) else torch.where(torch.tensor(reads, device=dev)[:, None, None], gate,
                                                    torch.zeros_like(gate))  # 0 where not read, as the general path
        floored = alpha.clamp_min(gate_floor) if gate_floor > 0 else alpha
        log_table[:, :, i, :s] = safe_log(floored)
        alphas[s] = alpha
    slot = torch.tensor([[bounds.index(r) if r >= 0 else len(bounds)] for r in read], dtype=torch.long, device=dev)
    return DecodeTable(read=read, log_table=log_table, slot=slot, alphas=alphas)


def _window_rows(key: torch.Tensor, sched: GateSchedule, windows: list[tuple[int, int]], kbp, P: int,
                 settings: SVSettings, detach: bool) -> torch.Tensor:
    """The table rows ``[b, g, len(windows), P]`` of the window rule (:mod:`~sv_attention.ops.sv_gate.schedule`):
    for slot ``(a, s)``, the gate of the keys at positions ``[a, s)`` (cold fit, bandwidth from the keys at
    ``[a, min(a + chunk, s))`` unless ``settings.sigma``) at their local positions, 1 elsewhere."""
    b, g, _, d = key.shape
    dt, dev = key.dtype, key.device
    base = sched.base if sched.base is not None else torch.zeros(b, dtype=torch.long, device=dev)
    keys_all = kbp() if detach else sched.keys_by_position(key, P)
    solve = CountingSolve(settings.gate_backend)
    out = []
    for a, s in windows:
        readers = (sched.windowed & (sched.start == a) & (sched.boundary == s)).any(-1).nonzero().flatten().tolist()
        n = s - a
        starts = [a - int(base[r]) for r in readers]
        keys = torch.stack([keys_all[r, :, lo:lo + n] for r, lo in zip(readers, starts)]).reshape(-1, n, d)
        if settings.sigma is not None:
            sig = torch.full((keys.shape[0],), settings.sigma, dtype=dt, device=dev)
        else:
            sig = median_bandwidth(keys[:, :min(settings.chunk, n)].detach()).to(dt)
        with torch.no_grad(), _fit_threads(dev):
            alpha = fit_cold(rbf_gram(keys.detach(), sigma=sig[:, None, None]), settings.box, solve)
        count("window_fits", len(readers))
        if not detach:
            alpha = differentiable_gate(rbf_gram(keys, sigma=sig[:, None, None].detach()), alpha.detach(),
                                        settings.box)
        alpha = alpha.to(dt).reshape(len(readers), g, n)
        if settings.gate_floor > 0:
            alpha = alpha.clamp_min(settings.gate_floor)
        per_row = [torch.ones(g, P, dtype=dt, device=dev) for _ in range(b)]
        for k, (r, lo) in enumerate(zip(readers, starts)):
            per_row[r] = torch.cat([per_row[r][:, :lo], alpha[k], per_row[r][:, lo + n:]], -1)
        out.append(torch.stack(per_row))
    return torch.stack(out, 2)


def _set_slot(table: torch.Tensor, i: int, alpha: torch.Tensor) -> torch.Tensor:
    """``table`` with ``table[:, :, i, :s] = alpha`` (out of place, so autograd reaches ``alpha``)."""
    s = alpha.shape[-1]
    row = torch.cat([alpha, table[:, :, i, s:]], -1) if s < table.shape[-1] else alpha
    return torch.cat([table[:, :, :i], row[:, :, None], table[:, :, i + 1:]], 2)


def _fit_batched(alphas: list[torch.Tensor], bounds: list[int], ready: torch.Tensor,
                 todo: list[tuple[int, int, torch.Tensor]], kbp, sig: torch.Tensor, settings: SVSettings,
                 state: GateState | None, d: int) -> None:
    """Fit every missing (boundary, sequence) gate of ``todo`` in place into ``alphas`` (no autograd):
    warm from the gate of the previous boundary ``s - chunk`` where it is known (fitted just before, or
    kept in the decoding state), else cold; boundaries in increasing order so each warm start is ready.
    ``ready`` (bool ``[b, len(bounds)]``) marks the gates of ``alphas`` already known (kept in the state)."""
    keys = kbp()
    b, g = keys.shape[:2]
    dt, dev = keys.dtype, keys.device
    chunk, C = settings.chunk, settings.box
    solve = CountingSolve(settings.gate_backend)
    n_all = max(s for _, s, _ in todo)
    # One dense Gram per (sequence, kv-head), sliced per boundary, when several boundaries are fitted and it
    # fits DENSE_GRAM_MAX_BYTES (fastest: one big kernel); otherwise (a decoding step crossing one boundary,
    # long contexts) Gram rows on demand, kept across boundaries: the fits read only the margin / error rows.
    dense = len(todo) > 1 and b * g * n_all * n_all * keys.element_size() <= DENSE_GRAM_MAX_BYTES
    # a sequence with no full-attention query here has no bandwidth (NaN) and nothing to fit: any positive value
    # keeps the Gram kernel's check quiet (its rows are never read)
    sig = torch.where(torch.isnan(sig), torch.ones_like(sig), sig)
    known: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # s -> (alpha [b, g, s], have [b])
    if state is not None:
        for s_, a_ in state.gates.items():
            known[s_] = (a_.to(dt), state.done[s_].clone())
    for i, s in enumerate(bounds):
        known[s] = (alphas[i], ready[:, i])  # (rows not ready are not in alphas[i] yet)
    with torch.no_grad():
        chain = _chain_of(todo, known, chunk, b, g, dense)
        if chain is not None:
            # every boundary of every sequence, consecutive: one native call for the chain, on a row store the
            # kernel fills with the rows it reads (the keys ever on the margin or at the bound, not n^2 entries)
            order, previous = chain
            if CHAIN_ROW_STORE:
                store = LazyRBFGram(keys[:, :, :n_all].reshape(b * g, n_all, d), sig.reshape(-1), capacity=0)
                gram = store.prefix(n_all)
            else:
                with torch.profiler.record_function("sv.gram"):
                    gram = rbf_gram(keys[:, :, :n_all], sigma=sig[:, :, None, None]).reshape(b * g, n_all, n_all)
            with _fit_threads(dev):
                fitted = fit_chain_from(gram, [s for _, s in order], previous, C, solve)
            if fitted is not None:
                if CHAIN_ROW_STORE:
                    count("chain_row_rows", store.rows_computed)
                for (i, s), a in zip(order, fitted):
                    alphas[i] = a.reshape(b, g, s).to(dt)
                return
        if dense:
            with torch.profiler.record_function("sv.gram"):
                full = rbf_gram(keys[:, :, :n_all], sigma=sig[:, :, None, None])
            count("dense_gram_calls")
        else:
            lazy_all = LazyRBFGram(keys[:, :, :n_all].reshape(b * g, n_all, d), sig.reshape(-1))
            count("lazy_gram_calls")
        with _fit_threads(dev):  # restored on any exit
            for i, s, rows in sorted(todo, key=lambda t: t[1]):
                prev = known.get(s - chunk)
                warm = prev[1][rows] if prev is not None else torch.zeros(len(rows), dtype=torch.bool, device=dev)
                for rows_b, is_warm in ((rows[~warm], False), (rows[warm], True)):
                    if not len(rows_b):
                        continue
                    if dense:
                        blk = full[:, :, :s, :s]  # a view: no copy when every sequence is fitted
                        gram = (blk if len(rows_b) == b else blk[rows_b]).reshape(-1, s, s)
                    else:
                        lazy = lazy_all if len(rows_b) == b else LazyRBFGram(
                            keys[rows_b][:, :, :n_all].reshape(-1, n_all, d), sig[rows_b].reshape(-1))
                        gram = lazy.prefix(s)
                    if is_warm:
                        fitted = fit_from(gram, prev[0][rows_b].reshape(-1, s - chunk), C, chunk, solve)
                    else:
                        fitted = fit_cold(gram, C, solve)
                    alphas[i] = alphas[i].index_copy(0, rows_b, fitted.reshape(len(rows_b), g, s).to(dt))
                done = known[s][1].clone()
                done[rows] = True
                known[s] = (alphas[i], done)


def _chain_of(todo: list[tuple[int, int, torch.Tensor]], known: dict, chunk: int, b: int, g: int,
              dense: bool) -> tuple[list[tuple[int, int]], torch.Tensor | None] | None:
    """The boundaries of ``todo`` as one chain for :func:`fit_chain_from`: ``([(index, s), ...] ascending,
    the first boundary's previous gate [b g, s - chunk] or None)``, or None when they are not one (a lazy
    Gram, a single boundary, more than :data:`CHAIN_MAX_PROBLEMS` problems, boundaries not ``chunk`` apart, a
    sequence that needs only some of them, a previous gate known for some sequences only)."""
    if not dense or len(todo) < 2 or b * g > CHAIN_MAX_PROBLEMS or any(len(rows) != b for _, _, rows in todo):
        return None
    order = sorted(((i, s) for i, s, _ in todo), key=lambda t: t[1])
    if any(s1 - s0 != chunk for (_, s0), (_, s1) in zip(order, order[1:])):
        return None
    prev = known.get(order[0][1] - chunk)
    if prev is None or not bool(prev[1].any()):
        return order, None
    if not bool(prev[1].all()):
        return None
    return order, prev[0].reshape(-1, prev[0].shape[-1])


@torch.compiler.disable  # the solver boundary (see causal_gate)
def full_gate(key: torch.Tensor, visible: torch.Tensor, settings: SVSettings, *, detach: bool = True) -> Gate:
    """The gate of a non-causal (encoder) layer: one gate per (sequence, kv-head) on all valid keys.

    Parameters
    ----------
    key : Tensor ``[b, g, kv, d]``
    visible : bool Tensor ``[b, q, kv]``

    Returns
    -------
    Gate with ``bias`` ``[b, g, 1, kv]``, or None when every sequence is in warm-up.
    """
    b, g, kv, d = key.shape
    valid = visible.any(dim=1)  # [b, kv]
    rows = valid.sum(-1) >= settings.warmup
    if not bool(rows.any()):
        return Gate(bias=None, sigma=None, alphas={}, state=None)
    m = valid[:, None, :].expand(b, g, kv)
    if settings.sigma is None:
        sig = median_bandwidth(key.detach(), m).to(key.dtype)
    else:
        sig = torch.full((b, g), settings.sigma, dtype=key.dtype, device=key.device)
    ib = rows.nonzero().flatten()
    mask = m[ib].reshape(-1, kv)
    with torch.no_grad():
        gram = rbf_gram(key[ib].detach().reshape(-1, kv, d), sigma=sig[ib].reshape(-1)[:, None, None])
        fitted = fit_masked(gram, mask, settings.box, CountingSolve(settings.gate_backend))
    if not detach:
        gram = rbf_gram(key[ib].reshape(-1, kv, d), sigma=sig[ib].reshape(-1)[:, None, None])
        fitted = differentiable_gate(gram, fitted, settings.box, mask)
    fitted = fitted.reshape(len(ib), g, kv)
    if settings.gate_floor > 0:
        fitted = fitted.clamp_min(settings.gate_floor)
    w = torch.ones(b, g, kv, dtype=key.dtype, device=key.device).index_copy(0, ib, fitted.to(key.dtype))
    w = torch.where(m, w, torch.ones_like(w))  # invalid keys stay masked by `visible`
    return Gate(bias=safe_log(w)[:, :, None, :], sigma=sig, alphas={kv: w}, state=None)
