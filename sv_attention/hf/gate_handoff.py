"""Hand a precomputed SV gate from a cache to the attention function of the same layer.

A transformers attention module calls ``cache.update(k, v, layer_idx)`` and then, immediately and in
the same thread, the registered attention function. A cache that maintains exact gates (the
:class:`~sv_attention.hf.cache.CertifiedCache`) deposits the gate for the returned key slots here in
``update``; the ``sv_attention`` attention function takes it (``pop``) for ``module.layer_idx``. The
slot is thread-local and consumed once, so a stale gate can never be applied to another call.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

_local = threading.local()


@dataclass
class GateHandoff:
    """A gate for one layer call.

    Attributes
    ----------
    layer_idx : int
    weights : Tensor ``[b, kv_heads, q_len, kv_len]``
        Multiplicative, non-negative weights applied to the softmax weights before renormalisation
        (alpha_j on the gated prefix, 1 on the local window, 0 on masked / forgotten slots). Causality
        is still applied by the attention function.
    key_positions : Tensor ``[kv_len]`` or None
        Absolute position of each returned key slot (slots may be missing after eviction).
    query_positions : Tensor ``[q_len]`` or None
        Absolute positions of the queries.
    """

    layer_idx: int
    weights: torch.Tensor
    key_positions: torch.Tensor | None = None
    query_positions: torch.Tensor | None = None


def set_pending_gate(handoff: GateHandoff) -> None:
    """Deposit a gate for the next attention call of ``handoff.layer_idx`` in this thread."""
    pending = getattr(_local, "pending", None)
    if pending is None:
        pending = _local.pending = {}
    pending[handoff.layer_idx] = handoff


def pop_pending_gate(layer_idx: int | None) -> GateHandoff | None:
    """Take (and remove) the pending gate for ``layer_idx``, or None."""
    pending = getattr(_local, "pending", None)
    if not pending or layer_idx is None:
        return None
    return pending.pop(layer_idx, None)


def clear_pending_gates() -> None:
    """Drop every pending gate of this thread."""
    _local.pending = {}
