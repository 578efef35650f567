"""Deprecated location (kept for one release): the ceq hop history now lives in :mod:`sv_attention.ops.ceq`.

``HopCache`` is :class:`sv_attention.ops.ceq.state.HopState` (the one decoding state the plug-in and the
model share); ``ceq_attention_cached`` is :func:`sv_attention.ops.ceq.layer.ceq_attention_cached`.
"""

from __future__ import annotations

from sv_attention.ops.ceq.layer import ceq_attention_cached
from sv_attention.ops.ceq.state import PREFILL_HEADROOM, HopCaches, HopState, reserve_columns, take_columns

HopCache = HopState

__all__ = ["PREFILL_HEADROOM", "HopCache", "HopCaches", "ceq_attention_cached", "reserve_columns",
           "take_columns"]
