"""Shared pieces of the ceq operator: hyperparameters, argument checks, visibility, GQA expansion.

A is a strictly lower-triangular (j < i), signed ``[b, h, q, kv]`` matrix built from the logits
``w = q k^T * scaling`` (``scaling = 1/sqrt(d)`` unless given); see :mod:`sv_attention.ops.ceq` for the
operator family and :mod:`sv_attention.ops.ceq.naive` for its plain definition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sv_attention.errors import ConfigError, InvalidHyperparameterError, InvalidInputError
from sv_attention.ops.masking import causal_mask, to_bool_mask
from sv_attention.ops.settings import CEQ_VARIANT_DEFAULTS

OPERATORS = ("sgate", "signed")
FORMS = ("hybrid", "path_sum")
#: variant -> default hops / rho / lam (the one table, :data:`sv_attention.ops.settings.CEQ_VARIANT_DEFAULTS`)
DEFAULTS = CEQ_VARIANT_DEFAULTS
DEFAULT_CHUNK: int | None = None  # None: auto_chunk(kv_len)


# ----------------------------------------------------------------------------------------------------------
# argument checking
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CeqParams:
    """Resolved operator hyperparameters.

    Attributes
    ----------
    operator : str
        ``"sgate"`` or ``"signed"``.
    rho : float
        Overall gain of A.
    lam : float
        Weight of the negative softmax (sgate only; 0.0 for signed).
    hops : int
        Number of hops K >= 1.
    """

    operator: str
    rho: float
    lam: float
    hops: int


def resolve_params(operator: str = "sgate", rho: float | None = None, lam: float | None = None,
                   hops: int | None = None) -> CeqParams:
    """Fill operator defaults and validate.

    Parameters
    ----------
    operator : {"sgate", "signed"}
    rho : float, optional
        Gain; default 1.5 (sgate) / 0.9 (signed). Must be finite.
    lam : float, optional
        sgate only; in [0, inf), default 0.10. Passing ``lam`` to ``signed`` is a :class:`ConfigError`.
    hops : int, optional
        K >= 1; default 2 (sgate) / 3 (signed).

    Raises
    ------
    ConfigError
        Unknown operator, or ``lam`` given for ``signed``.
    InvalidHyperparameterError
        Non-finite rho, negative lam, hops < 1.
    """
    if operator not in OPERATORS:
        raise ConfigError(f"unknown ceq operator {operator!r}; choose one of {OPERATORS}")
    d = DEFAULTS[operator]
    if operator == "signed" and lam is not None:
        raise ConfigError("lam belongs to the 'sgate' operator; do not pass it with operator='signed'")
    rho = float(d["rho"] if rho is None else rho)
    lam = float((d["lam"] or 0.0) if lam is None else lam)
    hops_v = d["hops"] if hops is None else hops
    if not math.isfinite(rho):
        raise InvalidHyperparameterError(f"rho must be finite, got {rho}")
    if not math.isfinite(lam) or lam < 0:
        raise InvalidHyperparameterError(f"lam must be finite and >= 0, got {lam}")
    if isinstance(hops_v, bool) or int(hops_v) != hops_v or int(hops_v) < 1:
        raise InvalidHyperparameterError(f"hops must be an integer >= 1, got {hops_v!r}")
    return CeqParams(operator, rho, lam, int(hops_v))


def truncation_bound(rho: float, hops: int) -> float:
    """Bound on the tail ``sum_{h > K} rho^h = rho^(K+1) / (1 - rho)`` dropped by a K-hop path sum.

    Valid when every row of A has absolute sum <= rho (sgate with lam = 0, signed), so
    ``||A^h||_inf <= rho^h``.

    Parameters
    ----------
    rho : float
        In [0, 1).
    hops : int
        K >= 0.

    Raises
    ------
    InvalidHyperparameterError
        rho >= 1 (the geometric tail diverges: no bound), rho < 0, or hops < 0.
    """
    rho = float(rho)
    if not math.isfinite(rho) or rho >= 1.0:
        raise InvalidHyperparameterError(
            f"truncation_bound needs rho < 1 (the tail sum rho^(K+1)/(1-rho) diverges), got rho={rho}")
    if rho < 0:
        raise InvalidHyperparameterError(f"rho must be >= 0, got {rho}")
    if isinstance(hops, bool) or int(hops) != hops or hops < 0:
        raise InvalidHyperparameterError(f"hops must be an integer >= 0, got {hops!r}")
    return rho ** (int(hops) + 1) / (1.0 - rho)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> tuple[int, int, int, int, int]:
    """Validate shapes; return ``(b, h, h_kv, q_len, kv_len)``."""
    for name, t in (("q", q), ("k", k)) + ((("v", v),) if v is not None else ()):
        if not isinstance(t, torch.Tensor):
            raise InvalidInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise InvalidInputError(f"{name} must be 4-D [batch, heads, seq, dim], got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise InvalidInputError(f"{name} must be floating point, got {t.dtype}")
    b, h, q_len, d = q.shape
    if k.shape[0] != b or k.shape[-1] != d:
        raise InvalidInputError(f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} (batch / dim)")
    h_kv, kv_len = k.shape[1], k.shape[2]
    if h_kv < 1 or h % h_kv != 0:
        raise InvalidInputError(f"query heads ({h}) must be a multiple of key/value heads ({h_kv}) (GQA)")
    if q_len > kv_len:
        raise InvalidInputError(f"q_len={q_len} exceeds kv_len={kv_len}: queries must be the last key positions")
    if v is not None and (v.shape[:3] != k.shape[:3]):
        raise InvalidInputError(f"v shape {tuple(v.shape)} does not match k shape {tuple(k.shape)} in [b, h_kv, s]")
    if q.dtype != k.dtype or (v is not None and v.dtype != q.dtype):
        raise InvalidInputError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {None if v is None else v.dtype}")
    return b, h, h_kv, q_len, kv_len


def allowed_mask(mask: torch.Tensor | None, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Boolean ``[b|1, h|1, q_len, kv_len]``: key j visible to query row r (strictly causal, not masked).

    Query row r sits at absolute position ``kv_len - q_len + r``; visibility needs ``j < position`` and
    the caller's mask (any form :func:`sv_attention.ops.masking.to_bool_mask` accepts).
    """
    strict = causal_mask(q_len, kv_len, device=device, strict=True)[None, None]
    bm = to_bool_mask(mask, q_len, kv_len)
    if bm is None:
        return strict
    return bm.to(device) & strict


def visible_block(bm: torch.Tensor | None, off: int, r0: int, r1: int, e: int, device: torch.device,
                  mode: str = "strict") -> torch.Tensor:
    """Visibility of keys ``[0, e)`` for query rows ``[r0, r1)`` (positions ``off + r``).

    ``mode="strict"``: strict causality (j < position) and the caller's boolean mask ``bm``
    (``[b|1, h|1, q_len|1, kv_len]`` or None) — the ceq matrix A. ``"causal"``: j <= position and ``bm``
    — stock attention with no 4-D mask. ``"mask"``: ``bm`` alone — stock attention with a 4-D mask (SDPA
    reads such a mask without adding causality). Shape ``[b|1, h|1, r1 - r0, e]``; built per row block so
    no ``[s, s]`` mask is kept.
    """
    rows = None
    if bm is not None:
        rows = (bm[..., :, :e] if bm.shape[-2] == 1 else bm[..., r0:r1, :e]).to(device)
        if mode == "mask":
            return rows.expand(*rows.shape[:-2], r1 - r0, e)
    pos = torch.arange(off + r0, off + r1, device=device)[:, None]
    cols = torch.arange(e, device=device)[None, :]
    vis = ((cols < pos) if mode == "strict" else (cols <= pos))[None, None]
    return vis if rows is None else vis & rows


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[b, h_kv, s, d] -> [b, h_kv * n_rep, s, d]`` (head ``i`` reads kv head ``i // n_rep``)."""
    if n_rep == 1:
        return x
    b, hkv, s, d = x.shape
    return x[:, :, None].expand(b, hkv, n_rep, s, d).reshape(b, hkv * n_rep, s, d)


def scale_of(d: int, scaling: float | None) -> float:
    if scaling is None:
        return 1.0 / math.sqrt(d)
    scaling = float(scaling)
    if not math.isfinite(scaling):
        raise InvalidHyperparameterError(f"scaling must be finite, got {scaling}")
    return scaling
