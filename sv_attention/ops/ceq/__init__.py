"""ceq: the signed causal path-sum operator family (DESIGN §2.6), one operator package.

A is a strictly lower-triangular (j < i), signed ``[b, h, q, kv]`` matrix built from the logits
``w = q k^T * scaling`` (``scaling = 1/sqrt(d)`` unless given):

``sgate`` (default; rho = 1.5, lam = 0.10, hops = 2)
    ``A = rho * (softmax(w) - lam * softmax(-w)) / (1 + lam)``, both softmaxes over the strictly-causal,
    non-padded keys; a row with no such key is exactly 0. Rows with keys sum to ``rho (1-lam)/(1+lam)``.
``signed`` (rho = 0.9, hops = 3)
    ``A = rho * w / sum_j |w_ij|`` over the same keys (a row whose visible logits are all 0 is 0).

Forms: ``hybrid`` ``stock_attention(q, k, v) + sum_{h=1..K} (alpha A)^h v`` (``alpha = 0`` is the stock
attention bitwise: the stock path *is* transformers' ``sdpa_attention_forward``); ``path_sum``
``(I + A + ... + A^K) v``.

Layout (flash-linear-attention style, the reference beside the fast path):

- :mod:`~sv_attention.ops.ceq.naive`: the plain reference (A materialised, dense products, autograd):
  :func:`ceq_matrix`, :func:`ceq_attention_reference`.
- :mod:`~sv_attention.ops.ceq.common`: hyperparameters (:func:`resolve_params`, :func:`truncation_bound`),
  argument checks, visibility, GQA expansion.
- :mod:`~sv_attention.ops.ceq.stock`: :func:`stock_attention` (transformers' SDPA path).
- :mod:`~sv_attention.ops.ceq.engine`: the row-block hop engine, its autograd function and the
  single-row decoding kernel.
- :mod:`~sv_attention.ops.ceq.attention`: :func:`ceq_attention`, the stateless functional form.
- :mod:`~sv_attention.ops.ceq.state`: :class:`HopState`, the one decoding state (hop history in capacity
  buffers, the fingerprint rule).
- :mod:`~sv_attention.ops.ceq.layer`: :func:`ceq_layer_attention`, the entry point the plug-in and the
  model call with their settings and state.

This package replaces the module ``sv_attention/ops/ceq.py`` and ``ops/hop_cache.py`` under the same
public names (``sv_attention.ops.hop_cache`` re-exports for one release).
"""

from __future__ import annotations

from sv_attention.ops.ceq.attention import ceq_attention
from sv_attention.ops.ceq.common import (
    DEFAULT_CHUNK,
    DEFAULTS,
    FORMS,
    OPERATORS,
    CeqParams,
    allowed_mask,
    repeat_kv,
    resolve_params,
    truncation_bound,
    visible_block,
)
from sv_attention.ops.ceq.engine import CeqHopsFunction, auto_chunk, hops_forward
from sv_attention.ops.ceq.layer import CeqLayerResult, ceq_attention_cached, ceq_layer_attention
from sv_attention.ops.ceq.naive import a_from_logits, ceq_attention_reference, ceq_matrix
from sv_attention.ops.ceq.state import PREFILL_HEADROOM, HopCaches, HopState
from sv_attention.ops.ceq.stock import stock_attention

__all__ = [
    "DEFAULTS", "DEFAULT_CHUNK", "FORMS", "OPERATORS", "PREFILL_HEADROOM", "CeqHopsFunction", "CeqLayerResult",
    "CeqParams", "HopCaches", "HopState", "a_from_logits", "allowed_mask", "auto_chunk", "ceq_attention", "ceq_attention_cached",
    "ceq_attention_reference", "ceq_layer_attention", "ceq_matrix", "hops_forward", "repeat_kv", "resolve_params",
    "stock_attention", "truncation_bound", "visible_block",
]
