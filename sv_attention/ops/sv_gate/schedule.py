"""The gate's schedule: which keys a gate is fitted on and which gate each query reads.

This module is the only place that knows the chunk-frozen rule (DESIGN §2.5), the warm-up rule
(DESIGN §2.1) and the bandwidth rule; every path of the SV gate (the batched training / plug-in path,
the exact incremental path, the certified cache and the naive reference) asks it.

- **Positions** come from the visibility mask, not from column indices: a key's position is the number of
  valid keys before it in its sequence (``base``, the valid keys a rolling cache already dropped, plus the
  valid columns before it), a query's position is the position of the last key it sees (its own). So left
  padding (any count), static caches and per-sequence lengths give each sequence exactly the schedule it
  has alone. A key is valid when some query of the call may attend it, unless the caller knows better
  (``valid=``: a sliding-window layer's decode step, where older keys are out of the window but not padding).
- **Boundary** of a query at position ``t``: ``s = chunk * floor(t / chunk)`` (:func:`boundary_of`); the query
  reads the gate fitted on the keys at positions ``[a, s)`` and its own chunk ``[s, t]`` densely, where ``a``
  is the position of the first key it sees.
- **Sliding windows** (the window rule): the window is only visibility. While the window covers every
  earlier key (``a = 0``) the query reads exactly the full-attention gate of boundary ``s``. Beyond that
  (``a > 0``: a window of ``W`` keys, ``a = t - W + 1``) the query reads a gate fitted on the keys its window
  leaves visible before its boundary, ``[a, s)``, one fit per distinct ``(a, s)``; keys in ``[a, s)`` are
  weighted by that gate, its chunk ``[s, t]`` by 1. Every key of such a fit is visible to the query, so a
  decode step (whose cache holds only the window) computes the same gate as the prefill.
- **Warm-up**: a boundary is gated only when ``s >= chunk`` and ``s - a >= ceil(1/C) + 2``
  (:func:`sv_attention.ops.settings.warmup_size`); otherwise the query reads plain softmax (within its window).
- **Bandwidth** (``sigma=None``): the median pairwise distance of the keys at positions ``[a, a + chunk)``
  (clipped to ``< s``) of the fit, per (sequence, kv-head): for ``a = 0`` the keys at positions ``< chunk``,
  fixed for the sequence; for a non-causal layer the median over all valid keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sv_attention.kernels import median_bandwidth
from sv_attention.ops.settings import SVSettings, warmup_size
from sv_attention.ops.sv_gate.visibility import summarize

__all__ = ["GateSchedule", "bandwidth", "boundary_of", "decode_boundaries", "is_gated", "warmup_size"]


def boundary_of(position: torch.Tensor | int, chunk: int) -> torch.Tensor | int:
    """The chunk boundary ``s = chunk * floor(t / chunk)`` a query at position ``t`` reads (works on ints and
    integer tensors; negative positions give negative boundaries, which are never gated)."""
    if isinstance(position, torch.Tensor):
        return torch.div(position, chunk, rounding_mode="floor") * chunk
    return (int(position) // chunk) * chunk


def is_gated(boundary: torch.Tensor | int, chunk: int, warmup: int) -> torch.Tensor | bool:
    """Whether boundary ``s`` holds a gate: past chunk 0 and out of warm-up (``s >= ceil(1/C) + 2``)."""
    return (boundary >= chunk) & (boundary >= warmup) if isinstance(boundary, torch.Tensor) else \
        (boundary >= chunk and boundary >= warmup)


def decode_boundaries(positions: list[int], chunk: int, warmup: int) -> tuple[list[int], list[int]]:
    """The schedule of a decode step in Python (no tensor, no host sync), for queries that see every earlier key
    (``a = 0``) of their sequence: the same rule as :meth:`GateSchedule.from_visible`.

    Parameters
    ----------
    positions : list[int]  ``[b]``  each sequence's query position (>= 0)
    chunk, warmup : int

    Returns
    -------
    boundary : list[int] ``[b]``  the boundary each query reads (:func:`boundary_of`)
    read : list[int] ``[b]``  that boundary where it is gated (:func:`is_gated`), else -1
    """
    boundary = [boundary_of(t, chunk) for t in positions]
    return boundary, [s if is_gated(s, chunk, warmup) else -1 for s in boundary]


def bandwidth(keys_by_position: torch.Tensor, lengths: torch.Tensor, chunk: int | None) -> torch.Tensor:
    """The median-rule bandwidth ``[b, g]``: median pairwise distance of the keys at positions ``< chunk``
    (``chunk=None``: of all keys).

    Parameters
    ----------
    keys_by_position : Tensor ``[b, g, P, d]``  keys ordered by position (rows past a sequence's length
        are ignored)
    lengths : long Tensor ``[b]``  keys per sequence
    chunk : int or None
    """
    b, g, P, _ = keys_by_position.shape
    c = P if chunk is None else min(chunk, P)
    m = (torch.arange(c, device=keys_by_position.device)[None, :] < lengths[:, None])[:, None, :].expand(b, g, c)
    return median_bandwidth(keys_by_position[:, :, :c].detach(), m)


@dataclass
class GateSchedule:
    """Positions, boundaries and warm-up of one layer call, read off the visibility mask.

    Attributes
    ----------
    valid : bool ``[b, kv]``  keys some query may attend (not padding, not an empty static slot)
    key_position : long ``[b, kv]``  position of each valid key, -1 if invalid
    query_position : long ``[b, q]``  position of each query, -1 if it sees no key
    lengths : long ``[b]``  valid keys per sequence in this call's columns
    boundary : long ``[b, q]``  the boundary each query reads (:func:`boundary_of`)
    gated : bool ``[b, q]``  the query reads a fitted gate (its boundary is past chunk 0 and warm-up)
    chunk, warmup : int
    start : long ``[b, q]``  position ``a`` of the first key each query sees (0: the full-attention gate)
    base : long ``[b]``  valid keys before column 0 (dropped by a rolling cache); local position =
        ``key_position - base``
    """

    valid: torch.Tensor
    key_position: torch.Tensor
    query_position: torch.Tensor
    lengths: torch.Tensor
    boundary: torch.Tensor
    gated: torch.Tensor
    chunk: int
    warmup: int
    start: torch.Tensor | None = None
    base: torch.Tensor | None = None

    @classmethod
    def from_visible(cls, visible: torch.Tensor, settings: SVSettings, *, valid: torch.Tensor | None = None,
                     base: torch.Tensor | None = None) -> GateSchedule:
        """The schedule of a causal layer call.

        Parameters
        ----------
        visible : bool Tensor ``[b, q, kv]``  True where the query row may attend the key column
            (causality, padding and windows applied)
        settings : SVSettings
        valid : bool Tensor ``[b, kv]`` or None  which key columns are real keys (default: visible to some
            query); a sliding-window caller passes it so keys out of every window still count
        base : long Tensor ``[b]`` or None  valid keys before column 0 (default 0)
        """
        seen_by = summarize(visible)  # remembered per mask: every layer of a forward reads the same one
        if valid is None:
            valid = seen_by.valid
        b, q, kv = visible.shape
        base = torch.zeros(b, dtype=torch.long, device=visible.device) if base is None else base.long()
        kpos = torch.where(valid, valid.long().cumsum(-1) - 1 + base[:, None],
                           torch.full_like(valid, -1, dtype=torch.long))
        seen, first, last = seen_by.seen, seen_by.first, seen_by.last
        qpos = torch.where(seen, kpos.gather(1, last.clamp_min(0)), torch.full_like(last, -1))
        start = torch.where(seen, kpos.gather(1, first.clamp(0, max(kv - 1, 0))).clamp_min(0),
                            torch.zeros_like(first))
        chunk, warmup = settings.chunk, settings.warmup
        bnd = boundary_of(qpos.clamp_min(0), chunk)
        gated = (bnd >= chunk) & (bnd - start >= warmup) & (qpos >= 0)
        return cls(valid=valid, key_position=kpos, query_position=qpos, lengths=valid.sum(-1), boundary=bnd,
                   gated=gated, chunk=chunk, warmup=warmup, start=start, base=base)

    @property
    def full(self) -> torch.Tensor:
        """bool ``[b, q]``: gated queries whose window covers every earlier key (``a = 0``)."""
        return self.gated if self.start is None else self.gated & (self.start == 0)

    @property
    def windowed(self) -> torch.Tensor:
        """bool ``[b, q]``: gated queries whose window starts after position 0 (the window rule)."""
        return self.gated & ~self.full

    def boundaries(self) -> list[int]:
        """The full-attention boundaries (``a = 0``) some query of the call reads, ascending."""
        return sorted({int(s) for s in self.boundary[self.full].unique().tolist()})

    def window_slots(self) -> list[tuple[int, int]]:
        """The distinct ``(a, s)`` of the windowed queries of the call (the window rule), ascending."""
        w = self.windowed
        if not bool(w.any()):
            return []
        pairs = torch.stack([self.start[w], self.boundary[w]], -1).unique(dim=0)
        return [(int(a), int(s)) for a, s in pairs.tolist()]

    def local_position(self) -> torch.Tensor:
        """long ``[b, kv]``: each valid key's position counted from column 0 (``key_position - base``), -1
        if invalid."""
        if self.base is None:
            return self.key_position
        return torch.where(self.valid, self.key_position - self.base[:, None], self.key_position)

    def keys_by_position(self, key: torch.Tensor, P: int | None = None) -> torch.Tensor:
        """Keys reordered by local position (:meth:`local_position`): ``[b, g, P, d]`` (rows past a sequence's length are zeros;
        differentiable w.r.t. ``key``). ``P`` defaults to the longest sequence."""
        b, g, kv, d = key.shape
        P = int(self.lengths.max()) if P is None else P
        lpos = self.local_position()
        tgt = torch.where(self.valid, lpos, torch.full_like(lpos, P))  # invalid: dropped
        idx_full = torch.zeros(b, P + 1, dtype=torch.long, device=key.device)
        idx_full.scatter_(1, tgt, torch.arange(kv, device=key.device).expand(b, kv).contiguous())
        out = torch.gather(key, 2, idx_full[:, None, :P, None].expand(b, g, P, d))
        keep = torch.arange(P, device=key.device)[None, :] < self.lengths[:, None]
        return out * keep[:, None, :, None].to(key.dtype)
