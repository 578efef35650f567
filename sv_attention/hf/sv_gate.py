"""The chunk-frozen SV gate on the keys a pretrained model already computes (DESIGN §2.1, §2.5).

Used by the ``"sv_attention"`` attention function. For every sequence ``b`` and kv-head ``g`` of a
layer, the queries at (real, padding-free) positions ``[s, s + chunk)`` read a gate fitted on the keys
at positions ``< s``: the SVDD coefficients ``alpha_j`` (box ``C`` fixed, RBF bandwidth ``sigma``).
The softmax weights over the visible keys are multiplied by ``alpha_j`` on that gated prefix and by 1
on the local chunk, then renormalised; chunk 0 and boundaries below the warm-up size
``ceil(1/C) + 2`` are plain causal softmax. This module returns the multiplicative weights as a
log-bias ``[b, g, q, kv]`` (``log alpha``, ``-inf`` for reserve keys, 0 elsewhere) that the attention
function adds to its logits before one softmax.

Positions come from the mask, not from column indices: a key's position is the number of valid keys
before it in its row, a query's position is the number of keys it sees minus one. So left padding,
static caches and per-sequence lengths give each sequence exactly the gates it would get alone.

Bandwidth rule (``sigma=None``): the median pairwise distance of the keys at positions ``< chunk`` (the
first boundary) per (sequence, kv-head), computed once and then fixed; for non-causal layers the
median over all valid keys.

Decoding state (:class:`GateState`): gates are cached per boundary by position, with the bandwidth and a
fingerprint of the keys (their first feature per column). Each call checks the fingerprint on the
columns it shares with the previous call: a fresh prefill, a crop, a reorder (beam search) or another
conversation is detected there and only gates whose keys are unchanged are kept, so a cached decode
always equals the recomputation without state.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from sv_attention.errors import InvalidInputError
from sv_attention.kernels import median_bandwidth, rbf_gram
from sv_attention.svdd.gram_rows import LazyRBFGram
from sv_attention.svdd.warm_fit import fit_warm, fit_working_set
from sv_attention.threads import torch_threads

#: Counters of what the gate did in this process (fits, solver statuses, reuse); see :func:`gate_stats`.
STATS: dict[str, int] = {}
_WARNED: set[str] = set()


def _count(key: str, n: int = 1) -> None:
    STATS[key] = STATS.get(key, 0) + int(n)


def gate_stats() -> dict[str, int]:
    """A copy of the process-wide gate counters (``fits``, ``warm_fits``, ``problems``, ``status:<name>``,
    ``reused``...)."""
    return dict(STATS)


def warn_once(key: str, message: str) -> None:
    """``warnings.warn`` a message once per process and key."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


@dataclass
class GateState:
    """Per-layer decoding state of the gate (held on the attention module between calls).

    Attributes
    ----------
    batch, kv_heads : int
    fingerprint : Tensor ``[b, kv_heads, n_cols]``  first feature of every key column seen
    sigma : Tensor ``[b, kv_heads]``  bandwidth per sequence (NaN where not computed yet)
    gates : dict ``s -> Tensor [b, kv_heads, s]``  alpha by position for boundary ``s`` (only the boundaries
        that later queries can still read are kept)
    done : dict ``s -> bool Tensor [b]``  which sequences hold a fitted gate for ``s``
    """

    batch: int
    kv_heads: int
    fingerprint: torch.Tensor
    sigma: torch.Tensor
    gates: dict[int, torch.Tensor] = field(default_factory=dict)
    done: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class GateBias:
    """The log-gate bias ``[b, g, q, kv]`` of a causal layer, kept factored (it is never needed whole by
    the fused readout, which reads it block by block and only up to each block's last visible column).

    ``bias[b, g, r, j] = log_table[b, g, slot[b, r], key_position[b, j]]``.

    Attributes
    ----------
    log_table : Tensor ``[b, g, S + 1, P]``  log alpha by (boundary slot, key position); slot ``S`` is
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


def positions_from_mask(visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Key validity and real positions of keys and queries from a visibility mask.

    Parameters
    ----------
    visible : bool Tensor ``[b, q, kv]`` (True = query row may attend the key column)

    Returns
    -------
    valid : bool ``[b, kv]``  keys some query may attend (not padding, not an empty static slot)
    kpos : long ``[b, kv]``  position of each valid key (number of valid keys before it), -1 if invalid
    qpos : long ``[b, q]``  position of each query (number of keys it sees minus one), -1 if it sees none
    """
    flags = visible.view(torch.uint8)  # same bytes: uint8 reductions are ~10-20x faster than bool ones on CPU
    valid = flags.amax(dim=1).bool() if flags.shape[1] else visible.any(dim=1)
    kpos = torch.where(valid, valid.long().cumsum(-1) - 1, torch.full_like(valid, -1, dtype=torch.long))
    qpos = flags.sum(-1, dtype=torch.int32).long() - 1
    return valid, kpos, qpos


def _keys_by_position(key: torch.Tensor, valid: torch.Tensor, kpos: torch.Tensor, P: int) -> torch.Tensor:
    """Keys reordered by position: ``[b, g, P, d]`` (rows past a sequence's length are zeros)."""
    b, g, kv, d = key.shape
    idx = torch.zeros(b, P, dtype=torch.long, device=key.device)
    tgt = torch.where(valid, kpos, torch.full_like(kpos, P))  # invalid keys to a dropped slot
    idx_full = torch.zeros(b, P + 1, dtype=torch.long, device=key.device)
    idx_full.scatter_(1, tgt, torch.arange(kv, device=key.device).expand(b, kv).contiguous())
    idx = idx_full[:, :P]
    out = torch.gather(key, 2, idx[:, None, :, None].expand(b, g, P, d))
    n = valid.sum(-1)
    keep = torch.arange(P, device=key.device)[None, :] < n[:, None]
    return out * keep[:, None, :, None].to(key.dtype)


def _solve(gram: torch.Tensor, mask: torch.Tensor, C: float, init: torch.Tensor | None = None):
    """``solve_batched`` with the gate's settings, counting statuses in :data:`STATS` (returns the solution).

    ``init`` ``[G, n]``: a warm start (the previous boundary's gate padded with zeros); the finder then runs
    only :data:`WARM_FISTA_ITERS` iterations and the polish makes the partition exact.
    """
    from sv_attention.svdd.batched import STATUS_NAMES, solve_batched
    from sv_attention.svdd.polish import POLISH_RIDGE

    # the gate is not trained here: the exact optimum of the found partition (the polish's tiny ridge only)
    if init is None:
        sol = solve_batched(gram, mask, C, check_inputs=False, ridge=POLISH_RIDGE)
    else:
        sol = solve_batched(gram, mask, C, check_inputs=False, init_alpha=init, fista_iters=WARM_FISTA_ITERS,
                            power_iters=WARM_POWER_ITERS, ridge=POLISH_RIDGE)
        _count("warm_fits")
    _count("fits")
    _count("problems", gram.shape[0])
    for code, name in STATUS_NAMES.items():
        k = int((sol.status == code).sum())
        if k:
            _count(f"status:{name}", k)
            if name in ("solve fallback", "not converged", "infeasible"):
                warn_once(f"status:{name}", f"sv_attention gate: {k} SVDD problem(s) ended with status "
                          f"'{name}'; their alpha is the best available approximation "
                          "(see sv_attention.hf.sv_gate.gate_stats())")
    return sol


def _fit(gram: torch.Tensor, mask: torch.Tensor, C: float, init: torch.Tensor | None = None) -> torch.Tensor:
    """Fit SVDD gates: RBF Gram ``[G, n, n]``, mask ``[G, n]`` -> alpha ``[G, n]`` (>= 0, 0 where masked)."""
    alpha = _solve(gram, mask, C, init).alpha.clamp_min(0.0)
    return torch.where(mask, alpha, torch.zeros_like(alpha))


def _fit_working_set(gram: torch.Tensor, init: torch.Tensor, C: float, new: int) -> torch.Tensor:
    """Warm fit on a working set of keys (:func:`sv_attention.svdd.warm_fit.fit_working_set` with the gate's
    counting solve; all keys valid)."""
    return fit_working_set(gram, init, C, new, solve=_solve, count=_count)


#: FISTA / power iterations of a warm-started gate fit (the polish makes the found partition exact).
WARM_FISTA_ITERS = 10
WARM_POWER_ITERS = 5
#: Largest dense Gram (bytes, all sequences and kv-heads of a layer call) the gate builds; beyond it, and for
#: a call that fits a single boundary, rows are computed on demand (:class:`~sv_attention.svdd.gram_rows.LazyRBFGram`).
DENSE_GRAM_MAX_BYTES = 256 * 2**20
#: Cold fits up to this many keys start the active-set steps from uniform alpha (every key on the margin)
#: instead of running the FISTA finder; larger cold fits (a crop, a state reset) use ``solve_batched``.
COLD_PDAS_MAX_KEYS = 256


def _fit_warm(gram: torch.Tensor, init: torch.Tensor, C: float, new: int, stat: str = "warm_fits") -> torch.Tensor:
    """Warm fit of full problems ``gram [G, n, n]`` (all keys valid) straight from the previous partition.

    :func:`sv_attention.svdd.warm_fit.fit_warm` with the gate's counting solve and :data:`STATS`: the
    active-set steps from the partition of ``init [G, n]`` (the previous boundary's gate, zero on the ``new``
    last keys), the exact optimum of a settled partition (ridge :data:`~sv_attention.svdd.polish.POLISH_RIDGE`),
    and :func:`_fit_working_set` for the problems that did not settle (counted as ``warm_pdas_fallback``).
    ``stat`` names the counter of this call (``warm_fits``; ``cold_pdas_fits`` for a small first boundary
    started from uniform alpha).
    """
    return fit_warm(gram, init, C, new, solve=_solve, count=_count, stat=stat)

#: torch intra-op threads while the gate fits its boundaries on a CPU (None: leave torch's setting).
#: The fits are chains of small operations (solves of a few hundred unknowns, row gathers) for which
#: extra threads cost more in synchronisation than they save -- measured 5-10x slower with 2 threads
#: than with 1 on a loaded 2-core machine; the Gram and the attention itself keep every thread.
GATE_FIT_THREADS: int | None = 1


def _gate_threads(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """Context of the boundary fits: :data:`GATE_FIT_THREADS` intra-op threads on a CPU (process-wide
    while it lasts, restored after), nothing on other devices."""
    if GATE_FIT_THREADS is None or device.type != "cpu" or torch.get_num_threads() <= GATE_FIT_THREADS:
        return contextlib.nullcontext()
    return torch_threads(GATE_FIT_THREADS)


def _check_state(state: GateState | None, key: torch.Tensor, q_len: int) -> GateState | None:
    """Keep ``state`` only for the columns whose keys are unchanged since the previous call."""
    b, g, kv, _ = key.shape
    if state is None or state.batch != b or state.kv_heads != g:
        return None
    old = kv - q_len  # columns that existed before this call (a crop makes this smaller)
    n_prev = state.fingerprint.shape[-1]
    overlap = min(old, n_prev)
    if overlap <= 0:
        return None
    if not torch.equal(state.fingerprint[..., :overlap], key[:, :, :overlap, 0].detach()):
        _count("state_reset")
        return None
    return state


def causal_gate_bias(key: torch.Tensor, visible: torch.Tensor, *, C: float, warmup: int, chunk: int,
                     sigma: float | None, state: GateState | None = None, keep_state: bool = False,
                     ) -> tuple[GateBias | None, GateState | None]:
    """Log-gate bias of a causal layer.

    Parameters
    ----------
    key : Tensor ``[b, g, kv, d]`` (all keys of the layer, past included)
    visible : bool Tensor ``[b, q, kv]``  what each query may attend (padding, causality, windows)
    C : float  fixed box
    warmup : int  ``ceil(1/C) + 2``: boundaries with fewer keys are ungated
    chunk : int
    sigma : float or None  None: median rule (see module docstring)
    state : GateState or None  from the previous call of this layer
    keep_state : bool  return an updated state (decoding); otherwise None is returned

    Returns
    -------
    bias : GateBias ``[b, g, q, kv]`` (``log alpha`` on the gated prefix, ``-inf`` on reserve keys, 0
        elsewhere) or None when no query of the call is past its first active boundary.
    state : GateState or None
    """
    b, g, kv, d = key.shape
    q = visible.shape[1]
    valid, kpos, qpos = positions_from_mask(visible)
    n = valid.sum(-1)  # [b]
    bnd = torch.div(qpos.clamp_min(0), chunk, rounding_mode="floor") * chunk  # boundary of each query
    active = (bnd >= chunk) & (bnd >= warmup) & (qpos >= 0)  # [b, q]
    state = _check_state(state, key, q) if keep_state else None
    if state is not None:
        # drop gates whose prefix is no longer fully present (crop) for some sequence
        kept = valid[:, : kv - q].sum(-1) if kv > q else torch.zeros_like(n)
        for s in list(state.gates):
            state.done[s] = state.done[s] & (kept >= s)
        state.sigma = torch.where((kept >= chunk)[:, None], state.sigma, torch.full_like(state.sigma, float("nan")))
    if not bool(active.any()):
        return None, _new_state(state, key, keep_state)
    P = int(n.max())
    dt = key.dtype
    kbp_cache: list[torch.Tensor] = []

    def kbp() -> torch.Tensor:  # keys by position [b, g, P, d], built only when a fit or a bandwidth needs it
        if not kbp_cache:
            kbp_cache.append(_keys_by_position(key, valid, kpos, P))
        return kbp_cache[0]

    # bandwidth per (sequence, kv-head)
    if sigma is not None:
        sig = torch.full((b, g), float(sigma), dtype=dt, device=key.device)
    else:
        sig = state.sigma.to(dt) if state is not None else torch.full((b, g), float("nan"), dtype=dt,
                                                                     device=key.device)
        need = active.any(-1)[:, None] & torch.isnan(sig)
        if bool(need.any()):
            m = (torch.arange(chunk, device=key.device)[None, :] < n[:, None])[:, None, :].expand(b, g, chunk)
            med = median_bandwidth(kbp()[:, :, :chunk], m)
            sig = torch.where(need, med.to(dt), sig)

    # gates per boundary, by position
    bounds = sorted({int(s) for s in bnd[active].unique().tolist()})
    S = len(bounds)
    table = torch.ones(b, g, S + 1, P, dtype=dt, device=key.device)  # slot S: "ungated"
    alphas: list[torch.Tensor] = []
    rows_of: list[torch.Tensor] = []
    todo_list: list[tuple[int, int, torch.Tensor]] = []  # (boundary index, s, batch rows to fit)
    for i, s in enumerate(bounds):
        rows = (active & (bnd == s)).any(-1)  # [b] sequences with a query reading boundary s
        alpha = torch.zeros(b, g, s, dtype=dt, device=key.device)
        have = torch.zeros(b, dtype=torch.bool, device=key.device)
        if state is not None and s in state.gates:
            have = state.done[s] & rows
            alpha = torch.where(have[:, None, None], state.gates[s].to(dt), alpha)
            _count("reused", int(have.sum()))
        todo = rows & ~have
        if bool(todo.any()):
            todo_list.append((i, s, todo.nonzero().flatten()))
        alphas.append(alpha)
        rows_of.append(rows)
    # fit every missing (boundary, sequence) gate: warm-started from the gate of the previous boundary
    # (s - chunk) where it is known (fitted just before, or kept in the decoding state), else cold (FISTA);
    # boundaries are fitted in increasing order so each warm start is ready
    if todo_list:  # one Gram per (sequence, kv-head) on the keys up to the last boundary; blocks are sliced
        n_all = max(s for _, s, _ in todo_list)
        # One dense Gram per (sequence, kv-head), sliced per boundary, when several boundaries are fitted and
        # it fits DENSE_GRAM_MAX_BYTES (fastest: one big kernel); otherwise (a decoding step crossing one
        # boundary, long contexts) Gram rows on demand, kept across boundaries: the fits read only the
        # margin / error rows, O(|U| n) instead of O(n^2).
        dense = len(todo_list) > 1 and b * g * n_all * n_all * key.element_size() <= DENSE_GRAM_MAX_BYTES
        if dense:
            full = rbf_gram(kbp()[:, :, :n_all], sigma=sig[:, :, None, None])
            _count("dense_gram_calls")
        else:
            lazy_all = LazyRBFGram(kbp()[:, :, :n_all].reshape(b * g, n_all, d), sig.reshape(-1))
            _count("lazy_gram_calls")
        known: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # s -> (alpha [b, g, s], have [b])
        if state is not None:
            for s_, a_ in state.gates.items():
                known[s_] = (a_.to(dt), state.done[s_].clone())
        pending = {i: ib for i, _, ib in todo_list}
        with _gate_threads(key.device):  # restored on any exit
            for i, s in enumerate(bounds):
                have_i = rows_of[i].clone()
                if i in pending:
                    have_i[pending[i]] = False
                known[s] = (alphas[i], have_i)  # (rows of the state outside rows_of[i] are not in alphas[i])
            for i, s, ib in sorted(todo_list, key=lambda t: t[1]):
                prev = known.get(s - chunk)
                warm_rows = prev[1][ib] if prev is not None else torch.zeros(len(ib), dtype=torch.bool,
                                                                             device=key.device)
                for rows_b, warm in ((ib[~warm_rows], False), (ib[warm_rows], True)):
                    if not len(rows_b):
                        continue
                    if dense:
                        blk = full[:, :, :s, :s]  # a view: no copy of the block when every sequence is fitted
                        gr = (blk if len(rows_b) == b else blk[rows_b]).reshape(-1, s, s)
                    else:
                        lazy = lazy_all if len(rows_b) == b else LazyRBFGram(  # a subset of sequences
                            kbp()[rows_b][:, :, :n_all].reshape(-1, n_all, d), sig[rows_b].reshape(-1))
                        gr = lazy.prefix(s)
                    if warm:
                        init = F.pad(prev[0][rows_b].to(dt), (0, chunk)).reshape(-1, s)
                        fitted = _fit_warm(gr, init, C, chunk)
                    elif s <= COLD_PDAS_MAX_KEYS:
                        # a small first boundary: the active-set steps from "every key on the margin"
                        fitted = _fit_warm(gr, torch.full(gr.shape[:2], 1.0 / s, dtype=dt, device=key.device), C, 0,
                                           stat="cold_pdas_fits")
                    else:
                        fitted = _fit(gr if dense else gr.dense(),
                                      torch.ones(len(rows_b) * g, s, dtype=torch.bool, device=key.device), C)
                    alphas[i] = alphas[i].index_copy(0, rows_b, fitted.reshape(len(rows_b), g, s))
                done_s = known[s][1].clone()
                done_s[ib] = True
                known[s] = (alphas[i], done_s)
    for i, s in enumerate(bounds):
        table[:, :, i, :s] = alphas[i]
        if keep_state:
            if state is None:
                state = _new_state(None, key, True, sig)
            rows = rows_of[i]
            done = state.done.get(s, torch.zeros(b, dtype=torch.bool, device=key.device)) | rows
            prev = state.gates.get(s, torch.zeros(b, g, s, dtype=dt, device=key.device))
            state.gates[s] = torch.where(rows[:, None, None], alphas[i].detach(), prev)
            state.done[s] = done
    # gather weight[b, g, r, j] = table[b, g, slot(b, r), kpos(b, j)]
    slot = torch.full((b, q), S, dtype=torch.long, device=key.device)
    for i, s in enumerate(bounds):
        slot = torch.where(active & (bnd == s), torch.full_like(slot, i), slot)
    kp = kpos.clamp_min(0)  # invalid keys are masked by `visible` anyway
    bias = GateBias(log_table=torch.log(table), slot=slot, key_position=kp)  # log on the small table
    if keep_state:
        state = _new_state(state, key, True, sig)
        # later queries of a sequence only read its current boundary or later ones: drop older gates, so the
        # state stays O(kv) (a crop back to an earlier chunk refits the gate it needs)
        last = torch.where(qpos[:, -1] >= 0, bnd[:, -1], torch.zeros_like(bnd[:, -1]))
        oldest = int(last.min())
        for s_old in [s_ for s_ in state.gates if s_ < oldest]:
            del state.gates[s_old], state.done[s_old]
    return bias, state


def _new_state(state: GateState | None, key: torch.Tensor, keep: bool,
               sigma: torch.Tensor | None = None) -> GateState | None:
    if not keep:
        return None
    b, g = key.shape[:2]
    fp = key[:, :, :, 0].detach().clone()
    if state is None:
        sig = sigma.detach() if sigma is not None else torch.full((b, g), float("nan"), dtype=key.dtype,
                                                                  device=key.device)
        return GateState(batch=b, kv_heads=g, fingerprint=fp, sigma=sig)
    state.fingerprint = fp
    if sigma is not None:
        state.sigma = sigma.detach()
    return state


def full_gate_bias(key: torch.Tensor, visible: torch.Tensor, *, C: float, warmup: int,
                   sigma: float | None) -> torch.Tensor | None:
    """Log-gate bias of a non-causal (encoder) layer: one gate per (sequence, kv-head) on all valid keys.

    Parameters
    ----------
    key : Tensor ``[b, g, kv, d]``
    visible : bool Tensor ``[b, q, kv]``

    Returns
    -------
    Tensor ``[b, g, 1, kv]`` or None when every sequence is in warm-up (fewer than ``warmup`` keys).
    """
    b, g, kv, d = key.shape
    valid = visible.any(dim=1)  # [b, kv]
    n = valid.sum(-1)
    rows = n >= warmup
    if not bool(rows.any()):
        return None
    m = valid[:, None, :].expand(b, g, kv)
    if sigma is None:
        sig = median_bandwidth(key, m).to(key.dtype)
    else:
        sig = torch.full((b, g), float(sigma), dtype=key.dtype, device=key.device)
    ib = rows.nonzero().flatten()
    gram = rbf_gram(key[ib].reshape(-1, kv, d), sigma=sig[ib].reshape(-1)[:, None, None])
    fitted = _fit(gram, m[ib].reshape(-1, kv), C).reshape(len(ib), g, kv)
    w = torch.ones(b, g, kv, dtype=key.dtype, device=key.device).index_copy(0, ib, fitted)
    w = torch.where(m, w, torch.ones_like(w))  # invalid keys stay masked by `visible`
    return torch.log(w)[:, :, None, :]


def check_gqa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> int:
    """Number of query heads per kv-head; raises on inconsistent shapes."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise InvalidInputError(f"query/key/value must be 4-D [b, heads, seq, dim], got {tuple(query.shape)}, "
                                f"{tuple(key.shape)}, {tuple(value.shape)}")
    if key.shape[1] != value.shape[1] or key.shape[2] != value.shape[2] or key.shape[0] != value.shape[0]:
        raise InvalidInputError(f"key {tuple(key.shape)} and value {tuple(value.shape)} disagree")
    if query.shape[1] % key.shape[1] != 0:
        raise InvalidInputError(f"{query.shape[1]} query heads are not a multiple of {key.shape[1]} kv heads")
    return query.shape[1] // key.shape[1]
