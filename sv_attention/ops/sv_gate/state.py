"""The decoding state of one layer's gate, with the one fingerprint rule.

Gates are kept per boundary by position, with the bandwidth and a fingerprint of the keys. The
fingerprint of a key column is its first feature, compared exactly (:func:`key_fingerprint`): each call
checks it on the columns it shares with the previous call, so a fresh prefill, a crop, a beam reorder or
another conversation is detected and only gates whose keys are unchanged are kept. A cached decode
therefore always equals the recomputation without state.

The state also carries what a call leaves for the next decode step (:class:`DecodeCache`): the schedule pieces a
decode step only extends by one key column, Python copies of the state's per-sequence flags and the log-table of
the gates the step reads, so a step whose gate is already fitted (most steps) skips the schedule and table
rebuild of the general path (:func:`sv_attention.ops.sv_gate.gate.causal_gate`) with the same result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


def key_fingerprint(key: torch.Tensor) -> torch.Tensor:
    """The fingerprint of every key column: its first feature, ``[b, g, kv]`` (detached copy)."""
    return key[:, :, :, 0].detach().clone()


@dataclass
class GateState:
    """Per-layer decoding state of the gate (held between calls by the caller: the attention module, the
    model's cache, or a :class:`CausalSVAttention` caller).

    Attributes
    ----------
    batch, kv_heads : int
    fingerprint : Tensor ``[b, kv_heads, n_cols]``  :func:`key_fingerprint` of every key column seen
    sigma : Tensor ``[b, kv_heads]``  bandwidth per sequence (NaN where not computed yet)
    gates : dict ``s -> Tensor [b, kv_heads, s]``  alpha by position for boundary ``s`` (only the boundaries
        that later queries can still read are kept)
    done : dict ``s -> bool Tensor [b]``  which sequences hold a fitted gate for ``s``
    exact : list or None  the fp64 maintained solvers per (sequence, kv-head) of ``solver="exact"``, with
        ``exact_ingested [b]``: keys streamed so far per sequence
    decode : DecodeCache or None  what the last call left for the next decode step's fast path (rebuilt or
        dropped by every call of the general path, kept in step by the fast path)
    """

    batch: int
    kv_heads: int
    fingerprint: torch.Tensor
    sigma: torch.Tensor
    gates: dict[int, torch.Tensor] = field(default_factory=dict)
    done: dict[int, torch.Tensor] = field(default_factory=dict)
    exact: list[list[Any]] | None = None
    exact_ingested: list[int] | None = None
    decode: DecodeCache | None = field(default=None, repr=False)

    @classmethod
    def new(cls, key: torch.Tensor, sigma: torch.Tensor | None = None) -> GateState:
        """An empty state for keys ``[b, g, kv, d]``."""
        b, g = key.shape[:2]
        sig = sigma.detach() if sigma is not None else torch.full((b, g), float("nan"), dtype=key.dtype,
                                                                  device=key.device)
        return cls(batch=b, kv_heads=g, fingerprint=key_fingerprint(key), sigma=sig)

    def matches(self, key: torch.Tensor, q_len: int) -> bool:
        """Whether the key columns shared with the previous call are unchanged (``q_len`` new columns)."""
        b, g, kv, _ = key.shape
        if self.batch != b or self.kv_heads != g:
            return False
        overlap = min(kv - q_len, self.fingerprint.shape[-1])
        if overlap <= 0:
            return False
        return torch.equal(self.fingerprint[..., :overlap], key[:, :, :overlap, 0].detach())

    def record(self, key: torch.Tensor, sigma: torch.Tensor | None, fingerprint: torch.Tensor | None = None) -> None:
        """Remember the fingerprint of ``key`` (and the bandwidth) after a call; ``fingerprint``: that fingerprint
        when the caller already took it (:func:`key_fingerprint` of ``key``, ``[b, g, kv]``)."""
        self.fingerprint = key_fingerprint(key) if fingerprint is None else fingerprint
        if sigma is not None:
            self.sigma = sigma.detach()


@dataclass
class DecodeTable:
    """The factored log-gate of a decode step whose sequences read the gates of boundaries ``read``.

    Attributes
    ----------
    read : tuple[int, ...]  per sequence, the boundary its query reads (-1: ungated)
    log_table : Tensor ``[b, g, S + 1, width]``  slot ``i < S``: ``log max(alpha, gate_floor)`` of the ``i``-th
        distinct boundary read (ascending) at positions below it, 0 beyond; slot ``S``: ungated (0)
    slot : long Tensor ``[b, 1]``  the slot each sequence's query reads
    alphas : dict ``s -> Tensor [b, g, s]``  the gate of every boundary read (0 for the sequences not reading it)
    """

    read: tuple[int, ...]
    log_table: torch.Tensor
    slot: torch.Tensor
    alphas: dict[int, torch.Tensor]


@dataclass
class DecodeCache:
    """What a layer call leaves for the next decode steps (one query per sequence, one new key column each).

    A decode step whose new column is a valid key of every sequence, whose older columns are unchanged (the
    fingerprint) and whose gates are all in the state reads everything from here: positions are the kept
    counts plus one, the key positions of the columns are a prefix of :attr:`key_position`, and the log-table is
    built once per set of boundaries read. Every tensor is written when built and never after (calls may hand
    out views of them).

    Attributes
    ----------
    settings : object  the settings object the cache was built for (identity: a quick check)
    settings_key : tuple  ``(chunk, warmup, gate_floor, sigma, dtype)`` it was built for
    n : int  key columns of the last call
    lengths : list[int]  valid keys per sequence after the last call
    valid : bool Tensor ``[b, cap]``  ``[:, :n]``: the last call's valid key columns; then True (what a decode step's
        new column must be)
    key_position : long Tensor ``[b, cap]``  the log-bias key position of every column: ``[:, :n]`` the last call's,
        then ``lengths + j`` (new valid keys)
    done : dict ``s -> list[bool]``  ``GateState.done`` as Python flags (no host sync to read them)
    sigma_known : list[bool]  per sequence: ``GateState.sigma`` has no NaN
    table : DecodeTable or None  the log-gate of the last fast step
    sigma_const : Tensor ``[b, g]`` or None  the fixed bandwidth (``settings.sigma``), built once
    """

    settings: Any
    settings_key: tuple
    n: int
    lengths: list[int]
    valid: torch.Tensor
    key_position: torch.Tensor
    done: dict[int, list[bool]]
    sigma_known: list[bool]
    table: DecodeTable | None = None
    sigma_const: torch.Tensor | None = None

    @classmethod
    def build(cls, settings: Any, settings_key: tuple, valid: torch.Tensor, key_position: torch.Tensor,
              lengths: torch.Tensor, state: GateState, headroom: int) -> DecodeCache:
        """The cache after a call of the general path.

        Parameters
        ----------
        settings, settings_key : see the attributes
        valid : bool Tensor ``[b, n]``  the call's valid key columns
        key_position : long Tensor ``[b, n]``  the call's log-bias key positions
        lengths : long Tensor ``[b]``  valid keys per sequence
        state : GateState  the state after the call (its ``done`` and ``sigma`` are mirrored)
        headroom : int  columns the buffers hold past ``n`` (>= 1)
        """
        b, n = valid.shape
        cache = cls(settings=settings, settings_key=settings_key, n=n, lengths=[int(x) for x in lengths.tolist()],
                    valid=valid, key_position=key_position, done={s: t.tolist() for s, t in state.done.items()},
                    sigma_known=(~torch.isnan(state.sigma)).all(-1).tolist())
        cache.grow(n + headroom, lengths)
        return cache

    def grow(self, cap: int, lengths: torch.Tensor | None = None) -> None:
        """Extend the buffers to ``cap`` columns (new columns: valid keys, positions counting on).

        ``lengths`` (long ``[b]``): valid keys before the new columns, when the buffers hold exactly the last
        call's columns; otherwise read off the buffers' last column."""
        b, have = self.valid.shape
        extra = cap - have
        if extra <= 0:
            return
        dev = self.valid.device
        nxt = lengths[:, None] if lengths is not None else self.key_position[:, -1:] + 1
        steps = torch.arange(extra, dtype=torch.long, device=dev)
        self.valid = torch.cat([self.valid, torch.ones(b, extra, dtype=torch.bool, device=dev)], 1)
        self.key_position = torch.cat([self.key_position, nxt.to(torch.long) + steps], 1)

    def advance(self, kv: int, lengths: list[int]) -> None:
        """Record a fast decode step: ``kv`` key columns, ``lengths`` valid keys per sequence."""
        self.n, self.lengths = kv, lengths
