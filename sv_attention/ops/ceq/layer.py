"""One layer call of ceq with its decoding state: the single entry point the plug-in and the model call.

``ceq_layer_attention(query, key, value, mask, settings, ...)`` runs :func:`~sv_attention.ops.ceq.attention.ceq_attention`
with the layer's :class:`~sv_attention.ops.ceq.state.HopState`: a prefill starts a new history, a decoding
step checks the history against the keys (the fingerprint rule) and extends it in place. The plug-in
(``"ceq"``, :mod:`sv_attention.hf.attention`) keeps the state on the attention module, the remote-code
model's ``ceq`` / ``ceq_path_sum`` operators in their cache; :mod:`sv_attention.ops.ceq.naive` is the
reference both are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sv_attention.errors import InvalidInputError
from sv_attention.ops.ceq.attention import ceq_attention
from sv_attention.ops.ceq.common import check_qkv
from sv_attention.ops.ceq.naive import ceq_matrix
from sv_attention.ops.ceq.state import HopState, require_queries_last
from sv_attention.ops.settings import CeqSettings


@dataclass
class CeqLayerResult:
    """Result of :func:`ceq_layer_attention`.

    Attributes
    ----------
    out : Tensor ``[b, h, q, dv]``
    weights : Tensor ``[b, h, q, kv]`` (the ceq matrix A) or None
    state : HopState or None  the layer's history after the call (None when not kept)
    """

    out: torch.Tensor
    weights: torch.Tensor | None
    state: HopState | None


def signature_of(settings: CeqSettings, scaling: float | None) -> tuple:
    """What a hop history depends on: ``(variant, rho, lam, hops, scaling, form)`` (not the path weight)."""
    return _signature(settings.resolved(), scaling)


def _signature(p: dict, scaling: float | None) -> tuple:
    return (p["variant"], p["rho"], p["lam"], p["hops"], None if scaling is None else float(scaling), p["form"])


def ceq_layer_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                        settings: CeqSettings, *, path_weight: float | torch.Tensor | None = None,
                        scaling: float | None = None, dropout: float = 0.0, training: bool = False,
                        is_causal: bool | None = None, state: HopState | None = None, keep_state: bool = False,
                        sliding: bool = False, check_layout: bool = True, layer_idx: int | None = None,
                        return_weights: bool = False, chunk_size: int | None = None,
                        fuse_stock: bool = True) -> CeqLayerResult:
    """ceq for one attention layer, prefill or decoding, with the layer's hop history.

    Parameters
    ----------
    query : Tensor ``[b, h, q_len, d]``  the last ``q_len`` positions
    key, value : Tensor ``[b, h_kv, kv_len, d]``  every cached position plus the new ones (``h % h_kv == 0``)
    mask : None or Tensor
        As for :func:`~sv_attention.ops.ceq.attention.ceq_attention` (None, 4-D bool / additive float,
        2-D padding ``[b, kv_len]``).
    settings : CeqSettings
        Variant, form, hops, rho, lam and the default path weight.
    path_weight : float or 0-dim Tensor, optional
        The hybrid hop weight ``alpha`` (a learnable parameter: gradients flow to it); None takes
        ``settings.path_weight``. Ignored by ``path_sum``.
    scaling : float, optional  logit scale (``1/sqrt(d)``)
    dropout, training, is_causal : the stock path's dropout / whether it is active / the module's causality
    state : HopState or None
        The layer's history from its previous calls. ``q_len < kv_len`` (decoding) needs one that covers
        the ``kv_len - q_len`` past columns; a prefill (``q_len == kv_len``) ignores it.
    keep_state : bool
        Keep the history: ``state`` (or a new :class:`HopState` when None) is updated in place and
        returned. False leaves ``state`` untouched (a decoding step then works on a private copy).
    sliding : bool
        The key cache is a sliding window (it keeps the last columns, not the first).
    check_layout : bool
        Refuse a mask whose queries are not the last key columns (a static cache); a caller that builds
        its own mask over positions may skip the check.
    layer_idx : int, optional  for messages
    return_weights : bool  also return the ceq matrix A ``[b, h, q_len, kv_len]``
    chunk_size, fuse_stock : as for :func:`~sv_attention.ops.ceq.attention.ceq_attention`

    Returns
    -------
    CeqLayerResult

    Raises
    ------
    HopCacheError
        A decoding step whose history is missing, filled with other settings, shorter than the key cache,
        or built on other keys. ``state`` is left unchanged.
    UnsupportedFeatureError
        ``check_layout`` and the queries are not the last key columns.
    """
    if state is not None and not isinstance(state, HopState):
        raise InvalidInputError(f"state must be a HopState or None, got {type(state).__name__}")
    b, h, hkv, q_len, kv_len = check_qkv(query, key, value)
    p = settings.resolved()
    weight = p["path_weight"] if path_weight is None else path_weight
    lam = p["lam"] if p["variant"] == "sgate" else None
    common = dict(form=p["form"], operator=p["variant"], alpha=weight if p["form"] == "hybrid" else 1.0,
                  hops=p["hops"], rho=p["rho"], lam=lam, scaling=scaling, dropout=float(dropout),
                  training=training, is_causal=is_causal, chunk_size=chunk_size, fuse_stock=fuse_stock)
    if check_layout:
        require_queries_last(mask, q_len, kv_len, layer_idx)
    signature = _signature(p, scaling)
    past = kv_len - q_len
    if past == 0 and not keep_state:  # a prefill whose history nobody keeps: no buffers at all
        out = ceq_attention(query, key, value, mask, **common)
        work = None
    else:
        if past == 0:
            work = HopState.for_prefill(query, key, value, p["hops"], signature, headroom=keep_state)
        else:
            work = (state if state is not None else HopState()).prepared(
                key, q_len, signature, sliding, private=not keep_state, layer_idx=layer_idx)
        if keep_state:
            # the holder's state becomes the prepared one (valid as is: columns [base, end)) before the
            # call writes the new rows after it, so an error below leaves a consistent history
            if state is None:
                state = HopState()
            state.adopt(work)
            work = state
        out = ceq_attention(query, key, value, mask, **common, _store=[t[:, :, work.base:] for t in work.store])
        if keep_state:
            work.record(key, q_len)
    weights = None
    if return_weights:
        weights = ceq_matrix(query, key, mask, operator=p["variant"], rho=p["rho"], lam=lam, scaling=scaling)
    return CeqLayerResult(out=out, weights=weights, state=work if keep_state else None)


def ceq_attention_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         hop_cache: HopState, *, form: str = "hybrid", operator: str = "sgate",
                         alpha: float | torch.Tensor = 1.0, hops: int | None = None, rho: float | None = None,
                         lam: float | None = None, scaling: float | None = None, dropout: float = 0.0,
                         training: bool = False, is_causal: bool | None = None,
                         chunk_size: int | None = None, fuse_stock: bool = True) -> torch.Tensor:
    """:func:`~sv_attention.ops.ceq.attention.ceq_attention`'s keywords with a hop history (kept for one
    release; new code calls :func:`ceq_layer_attention` with a :class:`CeqSettings`).

    Parameters
    ----------
    q : ``[b, h, q_len, d]``; k, v : ``[b, h_kv, kv_len, d]`` (the full key/value cache after update)
    mask : as for ``ceq_attention``; None means the queries are the last ``q_len`` key positions.
    hop_cache : HopState (``HopCache``)
        Updated in place: a prefill (``q_len == kv_len``) refills it, a decoding step extends it.
    form, operator, alpha, hops, rho, lam, scaling, dropout, training, is_causal, chunk_size, fuse_stock
        As for ``ceq_attention``.

    Returns
    -------
    Tensor ``[b, h, q_len, d]``, equal to the rows of a full prefill (fp64 <= 1e-12, fp32 <= 1e-6).

    Raises
    ------
    HopCacheError
        See :func:`ceq_layer_attention`; the cache is left unchanged.
    """
    if not isinstance(hop_cache, HopState):
        raise InvalidInputError(f"hop_cache must be a HopCache, got {type(hop_cache).__name__}")
    # the weight is passed on its own (any finite float or a tensor, as ceq_attention accepts)
    settings = CeqSettings(variant=operator, form=form, hops=hops, rho=rho, lam=lam, path_weight=0.0)
    return ceq_layer_attention(q, k, v, mask, settings, path_weight=alpha, scaling=scaling, dropout=dropout,
                               training=training, is_causal=is_causal, state=hop_cache, keep_state=True,
                               check_layout=False, chunk_size=chunk_size, fuse_stock=fuse_stock).out


__all__ = ["CeqLayerResult", "ceq_attention_cached", "ceq_layer_attention", "signature_of"]
