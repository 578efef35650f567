"""The gate's schedule: which keys a gate is fitted on and which gate each query reads.

This module is the only place that knows the chunk-frozen rule (DESIGN §2.5), the warm-up rule
(DESIGN §2.1) and the bandwidth rule; every path of the SV gate (the batched training / plug-in path,
the exact incremental path, the certified cache and the naive reference) asks it.

- **Positions** come from the visibility mask, not from column indices: a key's position is the number of
  valid keys before it in its row, a query's position is the number of keys it sees minus one. So left
  padding (any count), static caches and per-sequence lengths give each sequence exactly the schedule it
  has alone.
- **Boundary** of a query at position ``t``: ``s = (t // chunk) * chunk`` (:func:`boundary_of`); the query
  reads the gate fitted on the keys at positions ``[0, s)`` and its own chunk ``[s, t]`` densely.
- **Warm-up**: a boundary is gated only when ``s >= chunk`` and ``s >= ceil(1/C) + 2``
  (:func:`sv_attention.ops.settings.warmup_size`); otherwise the query reads plain softmax.
- **Bandwidth** (``sigma=None``): the median pairwise distance of the keys at positions ``< chunk``
  (:data:`bandwidth_keys`), per (sequence, kv-head), fixed for the sequence; for a non-causal layer the
  median over all valid keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sv_attention.kernels import median_bandwidth
from sv_attention.ops.settings import SVSettings, warmup_size

__all__ = ["GateSchedule", "bandwidth", "boundary_of", "is_gated", "warmup_size"]


def boundary_of(position: torch.Tensor | int, chunk: int) -> torch.Tensor | int:
    """The chunk boundary ``s = (t // chunk) * chunk`` a query at position ``t`` reads (works on ints and
    integer tensors; negative positions give negative boundaries, which are never gated)."""
    if isinstance(position, torch.Tensor):
        return torch.div(position, chunk, rounding_mode="floor") * chunk
    return (int(position) // chunk) * chunk


def is_gated(boundary: torch.Tensor | int, chunk: int, warmup: int) -> torch.Tensor | bool:
    """Whether boundary ``s`` holds a gate: past chunk 0 and out of warm-up (``s >= ceil(1/C) + 2``)."""
    return (boundary >= chunk) & (boundary >= warmup) if isinstance(boundary, torch.Tensor) else \
        (boundary >= chunk and boundary >= warmup)


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
    lengths : long ``[b]``  valid keys per sequence
    boundary : long ``[b, q]``  the boundary each query reads (:func:`boundary_of`)
    gated : bool ``[b, q]``  the query reads a fitted gate (its boundary is past chunk 0 and warm-up)
    chunk, warmup : int
    """

    valid: torch.Tensor
    key_position: torch.Tensor
    query_position: torch.Tensor
    lengths: torch.Tensor
    boundary: torch.Tensor
    gated: torch.Tensor
    chunk: int
    warmup: int

    @classmethod
    def from_visible(cls, visible: torch.Tensor, settings: SVSettings) -> GateSchedule:
        """The schedule of a causal layer call.

        Parameters
        ----------
        visible : bool Tensor ``[b, q, kv]``  True where the query row may attend the key column
            (causality, padding and windows applied)
        settings : SVSettings
        """
        flags = visible.view(torch.uint8)  # same bytes: uint8 reductions are ~10-20x faster than bool ones on CPU
        valid = flags.amax(dim=1).bool() if flags.shape[1] else visible.any(dim=1)
        kpos = torch.where(valid, valid.long().cumsum(-1) - 1, torch.full_like(valid, -1, dtype=torch.long))
        qpos = flags.sum(-1, dtype=torch.int32).long() - 1
        chunk, warmup = settings.chunk, settings.warmup
        bnd = boundary_of(qpos.clamp_min(0), chunk)
        gated = is_gated(bnd, chunk, warmup) & (qpos >= 0)
        return cls(valid=valid, key_position=kpos, query_position=qpos, lengths=valid.sum(-1), boundary=bnd,
                   gated=gated, chunk=chunk, warmup=warmup)

    def boundaries(self) -> list[int]:
        """The gated boundaries some query of the call reads, ascending."""
        return sorted({int(s) for s in self.boundary[self.gated].unique().tolist()})

    def keys_by_position(self, key: torch.Tensor, P: int | None = None) -> torch.Tensor:
        """Keys reordered by position: ``[b, g, P, d]`` (rows past a sequence's length are zeros;
        differentiable w.r.t. ``key``). ``P`` defaults to the longest sequence."""
        b, g, kv, d = key.shape
        P = int(self.lengths.max()) if P is None else P
        tgt = torch.where(self.valid, self.key_position, torch.full_like(self.key_position, P))  # invalid: dropped
        idx_full = torch.zeros(b, P + 1, dtype=torch.long, device=key.device)
        idx_full.scatter_(1, tgt, torch.arange(kv, device=key.device).expand(b, kv).contiguous())
        out = torch.gather(key, 2, idx_full[:, None, :P, None].expand(b, g, P, d))
        keep = torch.arange(P, device=key.device)[None, :] < self.lengths[:, None]
        return out * keep[:, None, :, None].to(key.dtype)
