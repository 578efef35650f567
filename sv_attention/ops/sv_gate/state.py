"""The decoding state of one layer's gate, with the one fingerprint rule.

Gates are kept per boundary by position, with the bandwidth and a fingerprint of the keys. The
fingerprint of a key column is its first feature, compared exactly (:func:`key_fingerprint`): each call
checks it on the columns it shares with the previous call, so a fresh prefill, a crop, a beam reorder or
another conversation is detected and only gates whose keys are unchanged are kept. A cached decode
therefore always equals the recomputation without state.
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
    """

    batch: int
    kv_heads: int
    fingerprint: torch.Tensor
    sigma: torch.Tensor
    gates: dict[int, torch.Tensor] = field(default_factory=dict)
    done: dict[int, torch.Tensor] = field(default_factory=dict)
    exact: list[list[Any]] | None = None
    exact_ingested: list[int] | None = None

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

    def record(self, key: torch.Tensor, sigma: torch.Tensor | None) -> None:
        """Remember the fingerprint of ``key`` (and the bandwidth) after a call."""
        self.fingerprint = key_fingerprint(key)
        if sigma is not None:
            self.sigma = sigma.detach()
