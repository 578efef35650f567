"""The smprime arm of ceq (DESIGN §2.6): a complex path-product gate on exp attention.

For ``j <= i`` (causal, diagonal included)::

    W_ij = G_ij exp(qk * q_i . k_j * scaling) / Z_i^beta
    G_ij = prod_{k=j+1..i} m_k e^{i theta_k}          (G_ii = 1)
    Z_i  = sum_{j<=i} |G_ij| exp(qk * q_i . k_j * scaling)
    out_i = Re(sum_j W_ij v_j)

``m = clamp(1 + g (u - 1), 0, 1)`` and ``theta' = g theta`` come from per-position linear heads (one
value per head and position); ``beta``, ``qk``, ``g`` are learnable scalars per layer, initialised at 1.
Corners: (beta=1, g=0) is softmax attention; (beta=0, g=0) unnormalised exp attention; (beta=0, qk=0) the
pure path product.

Layout (one operator package, the reference beside the fast path):

- :mod:`~sv_attention.ops.smprime.naive`: :func:`smprime_reference`, the formula entry by entry.
- :mod:`~sv_attention.ops.smprime.attention`: :func:`smprime_attention` (stable path products),
  :func:`path_modulus`, :func:`path_phase`.
- :mod:`~sv_attention.ops.smprime.module`: :class:`SMPrime`, one layer's scalars and gate heads.
- :mod:`~sv_attention.ops.smprime.layer`: :class:`SMPrimeState` (the gates of the cached positions) and
  :func:`smprime_layer_attention`, the entry point the remote-code model's ``smprime`` operator calls.

This package replaces the module ``sv_attention/ops/smprime.py`` under the same public names.
"""

from __future__ import annotations

from sv_attention.ops.smprime.attention import path_modulus, path_phase, smprime_attention
from sv_attention.ops.smprime.layer import SMPrimeLayerResult, SMPrimeState, smprime_layer_attention
from sv_attention.ops.smprime.module import M_BIAS, THETA_BIAS, SMPrime
from sv_attention.ops.smprime.naive import smprime_reference

__all__ = ["M_BIAS", "THETA_BIAS", "SMPrime", "SMPrimeLayerResult", "SMPrimeState", "path_modulus", "path_phase",
           "smprime_attention", "smprime_layer_attention", "smprime_reference"]
