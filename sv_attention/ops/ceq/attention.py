"""``ceq_attention``: the stateless functional form of the operator (prefill, or decoding rows given the
hop history), dispatching to the stock SDPA path, the row-block engine or its autograd function."""

from __future__ import annotations

import math

import torch

from sv_attention.errors import ConfigError, InvalidHyperparameterError, InvalidInputError
from sv_attention.ops.ceq.common import (
    DEFAULT_CHUNK,
    FORMS,
    check_qkv,
    repeat_kv,
    resolve_params,
    scale_of,
)
from sv_attention.ops.ceq.engine import CeqHopsFunction, _hops_forward, auto_chunk, hops_inplace
from sv_attention.ops.ceq.naive import ceq_matrix
from sv_attention.ops.ceq.stock import stock_attention
from sv_attention.ops.masking import causal_mask, to_bool_mask


def _coef(alpha: float | torch.Tensor, form: str, hops: int, like: torch.Tensor) -> torch.Tensor:
    powers = torch.arange(1, hops + 1, dtype=like.dtype, device=like.device)
    if form == "path_sum":
        return torch.ones(hops, dtype=like.dtype, device=like.device)
    if isinstance(alpha, torch.Tensor):
        return alpha.to(like.dtype) ** powers
    return torch.full((hops,), float(alpha), dtype=like.dtype, device=like.device) ** powers


def _check_alpha(alpha: float | torch.Tensor) -> None:
    if isinstance(alpha, torch.Tensor):
        if alpha.numel() != 1:
            raise InvalidInputError(f"alpha must be a float or a 0-dim tensor, got shape {tuple(alpha.shape)}")
        if not bool(torch.isfinite(alpha.detach()).all()):
            raise InvalidHyperparameterError("alpha is not finite")
    elif not isinstance(alpha, (int, float)) or not math.isfinite(float(alpha)):
        raise InvalidHyperparameterError(f"alpha must be a finite float or 0-dim tensor, got {alpha!r}")


def _fused_stock_mode(mask: torch.Tensor | None, bm: torch.Tensor | None, q_len: int, kv_len: int,
                      device: torch.device) -> str | None:
    """Visibility mode of the stock softmax for the fused path, or None when it cannot be fused.

    No mask / a 2-D padding mask: causal (``j <= position``, and the padding), as :func:`stock_attention`
    builds it. A 4-D mask: the mask alone (SDPA's reading), fusable only when it hides every future key
    (each row block of the fused path reads keys up to its last query's position only).
    """
    if mask is None or mask.dim() == 2:
        return "causal"
    if torch.compiler.is_compiling():  # no data-dependent branch in a graph: the unfused path is always exact
        return None
    future = ~causal_mask(q_len, kv_len, device=device)[None, None]
    return None if bool((bm.to(device) & future).any()) else "mask"


def ceq_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, *,
                  form: str = "hybrid", operator: str = "sgate", alpha: float | torch.Tensor = 1.0,
                  hops: int | None = None, rho: float | None = None, lam: float | None = None,
                  scaling: float | None = None, dropout: float = 0.0, training: bool = False,
                  return_weights: bool = False, is_causal: bool | None = None,
                  chunk_size: int | None = DEFAULT_CHUNK, fuse_stock: bool = True,
                  _history: list[torch.Tensor] | None = None, _sink: list[torch.Tensor] | None = None,
                  _store: list[torch.Tensor] | None = None,
                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """ceq attention: ``hybrid`` (stock + sum_h (alpha A)^h v) or ``path_sum`` ((I + A + ... + A^K) v).

    Parameters
    ----------
    q : Tensor ``[b, h, q_len, d]``
        Queries: the last ``q_len`` positions of the key sequence.
    k, v : Tensor ``[b, h_kv, kv_len, d]``
        Keys / values; ``h % h_kv == 0`` (GQA).
    mask : None or Tensor
        As the model's sdpa gets it: None, 4-D bool (True = attend) or additive float, or 2-D padding
        ``[b, kv]``. The stock path receives it unchanged; A uses it (via ``to_bool_mask``) with strict
        causality on top. An additive mask with values in ``(min/2, 0)`` raises :class:`MaskError`.
    form : {"hybrid", "path_sum"}
    operator : {"sgate", "signed"}
    alpha : float or 0-dim Tensor
        Hybrid hop weight (may be a learnable parameter; gradients flow to it). ``alpha == 0`` gives the
        stock attention bitwise. Ignored by ``path_sum``.
    hops : int, optional
        K (default 2 for sgate, 3 for signed).
    rho, lam : float, optional
        Operator hyperparameters (see :func:`resolve_params`).
    scaling : float, optional
        Logit scale for both paths; ``1/sqrt(d)`` when None.
    dropout : float
        Attention dropout of the stock path (applied only when ``training``); A is not dropped.
    training : bool
        Whether dropout is active.
    return_weights : bool
        Also return the materialised A ``[b, h, q_len, kv_len]`` (costs ``O(s^2)`` memory).
    is_causal : bool, optional
        The attention module's ``is_causal`` for the stock path (default True).
    chunk_size : int, optional
        Rows of A built at once (memory / speed trade-off); None picks :func:`auto_chunk` ``(kv_len)``
        (about 32k entries of A per head per block).
    fuse_stock : bool
        Hybrid with ``alpha != 0``: compute the stock softmax attention inside the row-block engine from
        the same logits (one QK^T for both; no separate SDPA call), which is faster and leaner. It equals
        the SDPA stock path to rounding (not bitwise). Not used (SDPA is called) when alpha is 0 (float or
        tensor: the bitwise guarantee), with active dropout, for a non-causal module, or for a 4-D mask
        that shows future keys. False always calls SDPA.
    _history, _sink : private (hop caches): ``y_1 .. y_{K-1}`` of the earlier positions ``[b, h, off, d]``;
        a list that receives the K hop outputs ``[b, h, kv_len, d]``.
    _store : private (hop caches), instead of ``_history`` / ``_sink``: K-1 capacity buffers
        ``[b, h, cap >= kv_len, d]`` whose rows ``[:off]`` hold the history; the query rows' hop outputs
        are written into rows ``[off, kv_len)`` in place (no copy of the history; see :func:`_hops_inplace`).

    Returns
    -------
    Tensor ``[b, h, q_len, d]`` (or ``(out, A)`` with ``return_weights``).

    Raises
    ------
    InvalidInputError, MaskError, ConfigError, InvalidHyperparameterError
    """
    b, h, hkv, q_len, kv_len = check_qkv(q, k, v)
    if form not in FORMS:
        raise ConfigError(f"unknown ceq form {form!r}; choose one of {FORMS}")
    _check_alpha(alpha)
    params = resolve_params(operator, rho, lam, hops)
    if chunk_size is None:
        chunk_size = auto_chunk(kv_len)
    if isinstance(chunk_size, bool) or int(chunk_size) != chunk_size or chunk_size < 1:
        raise InvalidHyperparameterError(f"chunk_size must be an integer >= 1 or None, got {chunk_size!r}")
    if dropout < 0 or dropout >= 1:
        raise InvalidHyperparameterError(f"dropout must be in [0, 1), got {dropout}")
    sc = scale_of(q.shape[-1], scaling)
    bm = to_bool_mask(mask, q_len, kv_len)  # validates the mask before any work
    off = kv_len - q_len
    skip_hops = form == "hybrid" and not isinstance(alpha, torch.Tensor) and float(alpha) == 0.0
    if _store is not None and (_history is not None or _sink is not None):
        raise InvalidInputError("pass either _store or _history / _sink, not both")
    if skip_hops and _sink is None and _store is None:
        out = stock_attention(q, k, v, mask, scaling=scaling, dropout=dropout, training=training,
                              is_causal=is_causal)
    else:
        alpha_zero = skip_hops or (isinstance(alpha, torch.Tensor) and float(alpha.detach()) == 0.0)
        stock_mode = None
        if form == "hybrid" and fuse_stock and not alpha_zero and not (training and dropout > 0) \
                and is_causal is not False:
            stock_mode = _fused_stock_mode(mask, bm, q_len, kv_len, q.device)
        # float coefficients on the in-place (decoding) path: no small tensors to build per call
        coef = _coef(alpha, form, params.hops, q) if _store is None or isinstance(alpha, torch.Tensor) else None
        need_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, coef))
        if need_grad and _store is not None:  # autograd engine on views of the store, then written back
            sink: list[torch.Tensor] = []
            y = CeqHopsFunction.apply(q, k, v, coef if coef is not None else _coef(alpha, form, params.hops, q),
                                      bm, params, sc, [t[:, :, :off] for t in _store], int(chunk_size), sink,
                                      stock_mode)
            for t, full in zip(_store, sink, strict=False):
                t[:, :, off:kv_len] = full[:, :, off:]
        elif need_grad:
            y = CeqHopsFunction.apply(q, k, v, coef, bm, params, sc, _history, int(chunk_size), _sink, stock_mode)
        elif _store is not None:
            ys, out0 = hops_inplace(q, k, v, bm, params, sc, _store, int(chunk_size), stock_mode)
            if coef is None:
                cf = [1.0] * params.hops if form == "path_sum" else [float(alpha) ** i for i in range(1, params.hops + 1)]
                y = torch.mul(ys[0], cf[0]) if out0 is None else out0.add_(ys[0], alpha=cf[0])
                for i in range(1, params.hops):
                    y.add_(ys[i], alpha=cf[i])
            else:
                y = sum(coef[i] * ys[i] for i in range(params.hops))
                if out0 is not None:
                    y = out0.add_(y)
        else:
            bufs, out0 = _hops_forward(q, k, v, bm, params, sc, _history, int(chunk_size), stock_mode)
            if _sink is not None:
                _sink.extend(bufs)
            y = sum(coef[i] * bufs[i][:, :, off:] for i in range(params.hops))
            if out0 is not None:
                y = out0.add_(y)
        if form == "hybrid" and stock_mode is not None:
            out = y  # stock softmax already inside, from the same logits
        elif form == "hybrid":
            stock = stock_attention(q, k, v, mask, scaling=scaling, dropout=dropout, training=training,
                                    is_causal=is_causal)
            out = stock if skip_hops else stock + y
        else:
            out = repeat_kv(v, h // hkv)[:, :, off:] + y
    if return_weights:
        return out, ceq_matrix(q, k, mask, operator=operator, rho=params.rho,
                               lam=params.lam if operator == "sgate" else None, scaling=scaling)
    return out
