"""The SV gate as one operator package (flash-linear-attention layout: the reference beside the paths).

- :mod:`~sv_attention.ops.sv_gate.naive`: the plain-loop reference (exact solver per boundary).
- :mod:`~sv_attention.ops.sv_gate.schedule`: positions, boundaries, warm-up and bandwidth rules (the only
  place that knows them).
- :mod:`~sv_attention.ops.sv_gate.fit`: the batched fit chain (warm starts, counted fallbacks, the
  differentiable final solve).
- :mod:`~sv_attention.ops.sv_gate.exact`: the incremental exact path (``solver="exact"``).
- :mod:`~sv_attention.ops.sv_gate.state`: the decoding state and its fingerprint rule.
- :mod:`~sv_attention.ops.sv_gate.gate`: one layer call's gate (the log-gate bias).
- :mod:`~sv_attention.ops.sv_gate.fused`: the fused readout (the log-gate folded into the dot products, one
  SDPA call).
- :mod:`~sv_attention.ops.sv_gate.readout`: the explicit (eager) readout, the fused one's reference.
- :mod:`~sv_attention.ops.sv_gate.attention`: :func:`sv_gate_attention`, the entry point every door calls.
"""

from __future__ import annotations

from sv_attention.ops.sv_gate.attention import GatedAttention, check_gqa, sv_gate_attention
from sv_attention.ops.sv_gate.fit import gate_stats
from sv_attention.ops.sv_gate.gate import Gate, GateBias
from sv_attention.ops.sv_gate.naive import naive_sv_gate_attention
from sv_attention.ops.sv_gate.schedule import GateSchedule, boundary_of
from sv_attention.ops.sv_gate.state import GateState

__all__ = ["Gate", "GateBias", "GateSchedule", "GateState", "GatedAttention", "boundary_of", "check_gqa",
           "gate_stats", "naive_sv_gate_attention", "sv_gate_attention"]
