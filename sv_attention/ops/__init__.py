"""Attention operators on ``[batch, heads, seq, dim]`` tensors, each with a plain reference beside it.

Names are resolved lazily from their defining modules:

- Settings: :class:`SVSettings`, :class:`CeqSettings`, :class:`SMPrimeSettings` (``settings.py``: one
  dataclass per operator, one defaults table, one validation).
- SV gate: :func:`sv_gate_attention`, :func:`naive_sv_gate_attention` (the ``sv_gate/`` package);
  :class:`CausalSVAttention`, :func:`sv_hybrid_attention` (``causal.py``); readouts (``readouts.py``).
- ceq: :func:`ceq_matrix`, :func:`ceq_attention`, :func:`ceq_layer_attention`, :func:`truncation_bound`,
  :class:`HopState` (``HopCache``), :func:`ceq_attention_cached` (the ``ceq/`` package; ``hop_cache.py``
  re-exports for one release); smprime: :class:`SMPrime` (the ``smprime/`` package).
- Not operators, re-exported for one release: :func:`beta_lrt`, :func:`lrt_report`,
  :class:`BetaGradientCensus` (now :mod:`sv_attention.analysis.beta_test`).
- Baselines: linear attention and DeltaNet (``baselines.py``).
"""

from __future__ import annotations

from sv_attention._lazy import lazy_exports

_LAZY = {
    "CausalSVAttention": "sv_attention.ops.causal",
    "sv_hybrid_attention": "sv_attention.ops.causal",
    "SVSettings": "sv_attention.ops.settings",
    "CeqSettings": "sv_attention.ops.settings",
    "SMPrimeSettings": "sv_attention.ops.settings",
    "sv_gate_attention": "sv_attention.ops.sv_gate",
    "naive_sv_gate_attention": "sv_attention.ops.sv_gate",
    "softmax_hybrid_readout": "sv_attention.ops.readouts",
    "rbf_readout": "sv_attention.ops.readouts",
    "ceq_matrix": "sv_attention.ops.ceq",
    "ceq_attention": "sv_attention.ops.ceq",
    "truncation_bound": "sv_attention.ops.ceq",
    "ceq_layer_attention": "sv_attention.ops.ceq",
    "HopState": "sv_attention.ops.ceq",
    "HopCache": "sv_attention.ops.hop_cache",
    "ceq_attention_cached": "sv_attention.ops.ceq",
    "SMPrime": "sv_attention.ops.smprime",
    "beta_lrt": "sv_attention.analysis.beta_test",
    "lrt_report": "sv_attention.analysis.beta_test",
    "BetaGradientCensus": "sv_attention.analysis.beta_test",
}


__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)
