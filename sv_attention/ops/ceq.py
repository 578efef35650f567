"""ceq: the signed causal path-sum operator family (DESIGN §2.6).

A is a strictly lower-triangular (j < i), signed ``[b, h, q, kv]`` matrix built from the logits
``w = q k^T * scaling`` (``scaling = 1/sqrt(d)`` unless given):

``sgate`` (default; rho = 1.5, lam = 0.10, hops = 2)
    ``A = rho * (softmax(w) - lam * softmax(-w)) / (1 + lam)``, both softmaxes over the strictly-causal,
    non-padded keys; a row with no such key is exactly 0. Rows with keys sum to ``rho (1-lam)/(1+lam)``.
``signed`` (rho = 0.9, hops = 3)
    ``A = rho * w / sum_j |w_ij|`` over the same keys (a row whose visible logits are all 0 is 0).

Forms (:func:`ceq_attention`):

``hybrid``
    ``stock_attention(q, k, v) + sum_{h=1..K} (alpha A)^h v``; ``alpha = 0`` (float or tensor) returns
    the stock attention bitwise (the stock path *is* transformers' ``sdpa_attention_forward``). With
    ``alpha != 0`` the stock softmax is, by default, computed inside the row-block engine from the same
    logits as A (``fuse_stock``; equal to the SDPA path to rounding, faster and leaner).
``path_sum``
    ``(I + A + ... + A^K) v``.

A^h is never materialised: A is applied to v repeatedly, ``y_h = A y_{h-1}``, ``y_0 = v``. Because A is
strictly lower-triangular, one block of query rows of A is enough to advance *every* hop for those
rows (``y_h`` rows ``< i`` are already final when row i is reached), so the fast path builds A one
row-block at a time (``chunk_size`` rows) and never holds more than ``chunk_size x kv`` of it. In
training the custom autograd function :class:`CeqHopsFunction` saves only q, k, v and the hop outputs
(``O(s d)`` each) and recomputes each row block of A in backward, walking the blocks in reverse.
:func:`ceq_attention_reference` is the plain dense version beside it (materialises A, autograd).

Queries may be the last ``q_len`` positions of a longer key sequence (decoding): query row r sits at
absolute position ``kv_len - q_len + r``. The hop history of earlier positions then comes from a
:class:`sv_attention.ops.hop_cache.HopCache` (see :func:`sv_attention.ops.hop_cache.ceq_attention_cached`),
whose capacity buffers the engine extends in place (:func:`_hops_inplace`: no copy of the history per
token); a single unmasked decoding query with the sgate operator takes the row kernel
:func:`_sgate_decode_row` (one logits row, one ``[stock; A] v`` matmul, one single-row matmul per hop).
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


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> tuple[int, int, int, int, int]:
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


# ----------------------------------------------------------------------------------------------------------
# the matrix A (plain reference; autograd differentiates it)
# ----------------------------------------------------------------------------------------------------------
def _masked_softmax(w: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax over allowed entries; rows without any allowed entry are exactly 0 (no NaN)."""
    neg = torch.finfo(w.dtype).min
    wm = w.masked_fill(~allowed, neg)
    m = wm.amax(dim=-1, keepdim=True).detach()
    e = torch.exp(wm - m) * allowed
    z = e.sum(dim=-1, keepdim=True)
    return e / torch.where(z > 0, z, torch.ones_like(z))


def a_from_logits(w: torch.Tensor, allowed: torch.Tensor, params: CeqParams) -> torch.Tensor:
    """A from scaled logits ``w [b, h, q, kv]`` and the visibility mask (plain, autograd-friendly)."""
    if params.operator == "sgate":
        pp = _masked_softmax(w, allowed)
        pm = _masked_softmax(-w, allowed)
        return (params.rho / (1.0 + params.lam)) * (pp - params.lam * pm)
    wt = w * allowed
    s = wt.abs().sum(dim=-1, keepdim=True)
    return params.rho * wt / torch.where(s > 0, s, torch.ones_like(s))


def _scale(d: int, scaling: float | None) -> float:
    if scaling is None:
        return 1.0 / math.sqrt(d)
    scaling = float(scaling)
    if not math.isfinite(scaling):
        raise InvalidHyperparameterError(f"scaling must be finite, got {scaling}")
    return scaling


def ceq_matrix(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None = None, *, operator: str = "sgate",
               rho: float | None = None, lam: float | None = None, scaling: float | None = None) -> torch.Tensor:
    """The ceq matrix A, materialised (reference / inspection; differentiable by autograd).

    Parameters
    ----------
    q : Tensor ``[b, h, q_len, d]``
        Queries; row r is absolute position ``kv_len - q_len + r``.
    k : Tensor ``[b, h_kv, kv_len, d]``
        Keys; ``h % h_kv == 0`` (GQA: query head i reads key head ``i // (h / h_kv)``).
    mask : None or Tensor
        Anything :func:`sv_attention.ops.masking.to_bool_mask` accepts (bool True = attend, additive
        float 0 / ``<= finfo.min/2``, 2-D ``[b, kv]`` padding). Strict causality (j < i) is always
        applied on top.
    operator : {"sgate", "signed"}
    rho, lam : float, optional
        Operator gain / negative-softmax weight (defaults per operator; see :func:`resolve_params`).
    scaling : float, optional
        Logit scale; ``1/sqrt(d)`` when None.

    Returns
    -------
    Tensor ``[b, h, q_len, kv_len]``, zero on and above the (shifted) diagonal and on masked keys.
    """
    b, h, hkv, q_len, kv_len = _check_qkv(q, k)
    params = resolve_params(operator, rho, lam, None)
    sc = _scale(q.shape[-1], scaling)
    w = torch.matmul(q, repeat_kv(k, h // hkv).transpose(-1, -2)) * sc
    allowed = allowed_mask(mask, q_len, kv_len, q.device)
    return a_from_logits(w, allowed, params)


# ----------------------------------------------------------------------------------------------------------
# the stock attention (transformers' own sdpa path, so alpha = 0 is bitwise the model's sdpa)
# ----------------------------------------------------------------------------------------------------------
class _StockModule:
    """Stand-in for the attention module that ``sdpa_attention_forward`` reads two attributes from."""

    def __init__(self, num_key_value_groups: int, is_causal: bool) -> None:
        self.num_key_value_groups = num_key_value_groups
        self.is_causal = is_causal


def stock_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, *,
                    scaling: float | None = None, dropout: float = 0.0, training: bool = False,
                    is_causal: bool | None = None) -> torch.Tensor:
    """Stock softmax attention exactly as transformers' ``sdpa`` attention computes it.

    Calls ``transformers.integrations.sdpa_attention.sdpa_attention_forward`` (same GQA handling,
    ``is_causal`` rules and kernel), so for the same inputs and mask it is bitwise what a model using
    ``attn_implementation="sdpa"`` computes.

    Parameters
    ----------
    q : ``[b, h, q_len, d]``; k, v : ``[b, h_kv, kv_len, d]``
    mask : None, 4-D bool / additive float mask (passed to SDPA unchanged, as the model's sdpa gets it),
        or a 2-D ``[b, kv]`` padding mask (combined with the causal mask into a 4-D bool mask first).
        With ``mask=None`` and ``1 < q_len < kv_len`` the queries are taken as the last positions (an
        explicit causal mask is built; transformers itself never sends that combination for a dynamic
        cache).
    scaling : float, optional
    dropout : float
        Attention dropout probability, applied only when ``training``.
    is_causal : bool, optional
        The module's ``is_causal`` (default True).

    Returns
    -------
    Tensor ``[b, h, q_len, d]`` (a transposed view of SDPA's ``[b, q_len, h, d]`` output).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, h, hkv, q_len, kv_len = _check_qkv(q, k, v)
    causal = True if is_causal is None else bool(is_causal)
    if mask is not None and mask.dim() == 2:
        pad = to_bool_mask(mask, q_len, kv_len)
        mask = pad & causal_mask(q_len, kv_len, device=q.device)[None, None] if causal else pad
    elif mask is None and causal and 1 < q_len < kv_len:
        mask = causal_mask(q_len, kv_len, device=q.device)[None, None]
    module = _StockModule(h // hkv, causal)
    out, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=dropout if training else 0.0,
                                    scaling=scaling, is_causal=causal)
    return out.transpose(1, 2)


# ----------------------------------------------------------------------------------------------------------
# the fast (row-block, memory-lean) hop engine
# ----------------------------------------------------------------------------------------------------------
def _grouped(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[b, h, c, X] -> [b, h_kv, g*c, X]`` (rows of the g query heads sharing one kv head stacked)."""
    b, h, c, n = x.shape
    return x.reshape(b, hkv, (h // hkv) * c, n)


# Below this many elements the softmax (and its backward) is composed from elementwise ops: torch's CPU
# softmax kernels enter a parallel region even for tiny tensors, which costs milliseconds per call when
# the cores are busy (token-by-token decoding calls it on one row per layer and hop).
_SMALL_SOFTMAX = 1 << 14


def _softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim (fused kernel for large tensors, elementwise ops for small ones)."""
    if x.numel() > _SMALL_SOFTMAX or x.device.type != "cpu":
        return torch.softmax(x, dim=-1)
    e = torch.exp(x - x.amax(dim=-1, keepdim=True))
    return e.div_(e.sum(dim=-1, keepdim=True))


def _softmax_backward(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``p * (g - sum(g p))``: the softmax vector-Jacobian product (fused kernel for large tensors)."""
    if g.numel() > _SMALL_SOFTMAX or g.device.type != "cpu":
        return torch._softmax_backward_data(g, p, -1, g.dtype)
    return p * (g - (g * p).sum(dim=-1, keepdim=True))


def _masked_probs(w: torch.Tensor, vis: torch.Tensor) -> torch.Tensor:
    """Softmax of ``w`` over visible keys; rows with no visible key are exactly 0."""
    bias = torch.zeros(vis.shape, dtype=w.dtype, device=w.device).masked_fill_(~vis, torch.finfo(w.dtype).min / 2)
    p = _softmax(w + bias)
    has = vis.any(dim=-1, keepdim=True)
    if not bool(has.all()):
        p.mul_(has)
    return p


def _block_a(qs: torch.Tensor, k: torch.Tensor, vis: torch.Tensor, params: CeqParams,
             need_parts: bool, vis_stock: torch.Tensor | None = None,
             ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor | None]:
    """A for one row block (and, optionally, the stock softmax of the same logits).

    Parameters
    ----------
    qs : ``[b, h, c, d]`` queries already multiplied by the logit scale.
    k : ``[b, h_kv, e, d]`` keys ``[0, e)``.
    vis : bool ``[b|1, h|1, c, e]`` visibility of A (:func:`visible_block`, strict).
    need_parts : keep what the backward needs (the two softmaxes / the masked logits).
    vis_stock : bool visibility of the stock softmax, or None to skip it.

    Returns
    -------
    A ``[b, h, c, e]``, the parts tuple, and the stock probabilities ``[b, h, c, e]`` (or None). Fused
    ``torch.softmax`` on logits with an additive ``finfo.min / 2`` bias on hidden keys; rows with no
    visible key are zeroed afterwards.
    """
    b, h, c, _ = qs.shape
    hkv, e = k.shape[1], k.shape[2]
    w = torch.matmul(_grouped(qs, hkv), k.transpose(-1, -2)).view(b, h, c, e)
    ps = None if vis_stock is None else _masked_probs(w, vis_stock)
    if params.operator == "sgate":
        pp = _masked_probs(w, vis)
        pm = _masked_probs(w.neg_(), vis)
        del w
        if need_parts:
            a = torch.add(pp, pm, alpha=-params.lam).mul_(params.rho / (1.0 + params.lam))
            return a, (pp, pm), ps
        a = pp.sub_(pm, alpha=params.lam).mul_(params.rho / (1.0 + params.lam))
        return a, (), ps
    wt = w.mul_(vis)
    s = wt.abs().sum(dim=-1, keepdim=True)
    s = torch.where(s > 0, s, torch.ones_like(s))
    a = wt * (params.rho / s)
    return a, ((wt, s, vis) if need_parts else ()), ps


def _block_a_backward(da: torch.Tensor, parts: tuple[torch.Tensor, ...], params: CeqParams) -> torch.Tensor:
    """dL/dw for one row block from dL/dA (w = the scaled logits)."""
    if params.operator == "sgate":
        pp, pm = parts
        c = params.rho / (1.0 + params.lam)
        dw = _softmax_backward(da, pp)
        dw.add_(_softmax_backward(da, pm), alpha=params.lam)
        return dw.mul_(c)
    wt, s, vis = parts
    proj = (da * wt).sum(-1, keepdim=True)
    return params.rho * (da * vis / s - torch.sign(wt) * proj / (s * s))


def auto_chunk(kv_len: int) -> int:
    """Default row-block size: about 32k entries of A per head per block, between 16 and 128 rows (64 at
    kv_len 512, 32 at 1024: efficient matmuls, and peak training memory of the fused hybrid within about
    1.6x SDPA's at kv_len 1024; ``sv-attention bench ceq`` measures both)."""
    return int(max(16, min(128, 32768 // max(kv_len, 1))))


def _chunks(q_len: int, chunk: int) -> list[tuple[int, int]]:
    return [(r0, min(r0 + chunk, q_len)) for r0 in range(0, q_len, chunk)]


def hops_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bm: torch.Tensor | None, params: CeqParams,
                 sc: float, history: list[torch.Tensor] | None = None, chunk_size: int | None = DEFAULT_CHUNK,
                 ) -> list[torch.Tensor]:
    """All hop outputs ``y_h = A y_{h-1}`` (``y_0 = v``) for the query rows, one row block of A at a time.

    Parameters
    ----------
    q : ``[b, h, q_len, d]``; k, v : ``[b, h_kv, kv_len, d]``
    bm : bool ``[b|1, h|1, q_len|1, kv_len]`` or None
        The caller's mask as :func:`sv_attention.ops.masking.to_bool_mask` returns it (strict causality is
        added per row block).
    params : CeqParams
    sc : float
        Logit scale.
    history : list of K-1 tensors ``[b, h, kv_len - q_len, d]``, optional
        ``y_1 .. y_{K-1}`` of the earlier positions (decoding). Required when ``q_len < kv_len`` and K > 1.
    chunk_size : int, optional
        Query rows of A built at once (None: :func:`auto_chunk`).

    Returns
    -------
    list of K tensors ``[b, h, kv_len, d]``: ``y_1 .. y_K`` on all positions (history rows copied in;
    ``y_K`` history rows are zero, never needed).
    """
    return _hops_forward(q, k, v, bm, params, sc, history, chunk_size, None)[0]


def _hops_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bm: torch.Tensor | None, params: CeqParams,
                  sc: float, history: list[torch.Tensor] | None, chunk_size: int | None, stock: str | None,
                  ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """:func:`hops_forward`, plus the stock softmax attention of the query rows when ``stock`` is
    ``"causal"`` / ``"mask"`` (visibility mode of :func:`visible_block`)."""
    b, h, q_len, d = q.shape
    kv_len = k.shape[2]
    dv = v.shape[-1]
    off = kv_len - q_len
    K = params.hops
    if off > 0 and K > 1 and (history is None or len(history) != K - 1):
        raise InvalidInputError(f"decoding {q_len} queries after {off} positions needs the hop history "
                                f"y_1..y_{K - 1} of those positions (use a HopCache)")
    # every query row is written below; only the history rows need filling (zeros for y_K, never read)
    bufs = [q.new_empty(b, h, kv_len, dv) for _ in range(K)]
    if off > 0:
        bufs[K - 1][:, :, :off] = 0
        for hh in range(1, K):
            bufs[hh - 1][:, :, :off] = history[hh - 1]
    out0 = None if stock is None else q.new_empty(b, h, q_len, dv)
    _hop_blocks(q, k, v, bm, params, sc, bufs[: K - 1], bufs[K - 1][:, :, off:], chunk_size, stock, out0)
    return bufs, out0


def _hop_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bm: torch.Tensor | None, params: CeqParams,
                sc: float, store: list[torch.Tensor], last: torch.Tensor, chunk_size: int | None,
                stock: str | None, out0: torch.Tensor | None) -> None:
    """The row-block loop of the hop engine, writing its results in place.

    Parameters
    ----------
    q, k, v, bm, params, sc, chunk_size, stock : as for :func:`_hops_forward`.
    store : K-1 tensors ``[b, h, >= kv_len, dv]`` indexed by key column: rows ``[:off]`` hold
        ``y_1 .. y_{K-1}`` of the earlier positions (read), rows ``[off, kv_len)`` are written.
    last : ``[b, h, q_len, dv]`` receives ``y_K`` of the query rows.
    out0 : ``[b, h, q_len, dv]`` receives the stock softmax attention (``stock`` not None) or None.
    """
    b, h, q_len, d = q.shape
    hkv, kv_len = k.shape[1], k.shape[2]
    dv = v.shape[-1]
    off = kv_len - q_len
    K = params.hops
    for r0, r1 in _chunks(q_len, chunk_size or auto_chunk(kv_len)):
        e = off + r1
        c = r1 - r0
        vis = visible_block(bm, off, r0, r1, e, q.device)
        vs = None if stock is None else visible_block(bm, off, r0, r1, e, q.device, mode=stock)
        a, _, ps = _block_a(q[:, :, r0:r1] * sc, k[:, :, :e], vis, params, need_parts=False, vis_stock=vs)
        if ps is not None:
            out0[:, :, r0:r1] = torch.matmul(_grouped(ps, hkv), v[:, :, :e]).view(b, h, c, dv)
            del ps
        y = torch.matmul(_grouped(a, hkv), v[:, :, :e]).view(b, h, c, dv)
        for hh in range(1, K + 1):
            if hh > 1:
                y = torch.matmul(a, store[hh - 2][:, :, :e])
            if hh < K:
                store[hh - 1][:, :, off + r0:off + r1] = y
            else:
                last[:, :, r0:r1] = y


_ROW_CONSTANTS: dict[tuple, torch.Tensor] = {}


def _row_constant(values: tuple[float, ...], like: torch.Tensor) -> torch.Tensor:
    """The column ``[len(values), 1]`` of ``values`` in ``like``'s dtype / device, built once and reused."""
    key = (values, like.dtype, like.device)
    t = _ROW_CONSTANTS.get(key)
    if t is None:
        if len(_ROW_CONSTANTS) > 64:
            _ROW_CONSTANTS.clear()
        t = _ROW_CONSTANTS[key] = torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]
    return t


_ROW_BIASES: dict[tuple, torch.Tensor] = {}


def _row_bias(n: int, e: int, like: torch.Tensor) -> torch.Tensor:
    """``[n, 1, e]``: 0, except ``-inf`` in the last column of the last two kinds (A's strict causality).

    A view of a cached buffer whose ``-inf`` column is its last one, regrown (doubled) when ``e`` exceeds it.
    """
    key = (n, like.dtype, like.device)
    t = _ROW_BIASES.get(key)
    if t is None or t.shape[-1] < e:
        if len(_ROW_BIASES) > 64:
            _ROW_BIASES.clear()
        t = torch.zeros(n, 1, max(2 * e, 256), dtype=like.dtype, device=like.device)
        t[n - 2:, :, -1] = float("-inf")
        _ROW_BIASES[key] = t
    return t[..., t.shape[-1] - e:]


def _sgate_decode_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: CeqParams, sc: float,
                      store: list[torch.Tensor], with_stock: bool) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """One decoding query (``q_len == 1``, no mask, ``kv_len >= 2``) of the sgate hop engine, in few kernels.

    The same quantities as :func:`_hop_blocks` for that row (to rounding: the scale multiplies ``q k^T``
    here, ``q`` there), from one logits row ``w = sc q k^T`` stacked as ``E = [w; w; -w]`` (``[b, h_kv, 3, r, kv]``: kind, then the r query heads of a kv head): the stock
    softmax over keys ``[0, off]`` (``off = kv_len - 1``, the query's own position) and ``softmax(+-w)``
    over the strictly-causal keys ``[0, off)``, each over its own maximum, are normalised and scaled by
    ``[1, c, -c lam]`` (``c = rho / (1 + lam)``) in one pass; ``A = E_1 + E_2``. One matmul of the
    ``[stock; A]`` rows against ``v`` gives the stock output and ``y_1 = A v`` (``v`` read once), and hop
    ``h >= 2`` is one single-row matmul of A against the history ``y_{h-1}`` (read once). About 20 tensor
    operations and no O(kv_len) copy (small-M matmuls cost about one row each: no spare rows are sent).

    Parameters
    ----------
    q : ``[b, h, 1, d]``; k, v : ``[b, h_kv, kv_len, d]``
    params : sgate CeqParams; sc : the logit scale
    store : K-1 tensors ``[b, h, >= kv_len, dv]`` (rows ``[:off]`` read, row ``off`` written), as for
        :func:`_hop_blocks`.
    with_stock : also return the stock softmax attention of the row (else the stock kind is left out).

    Returns
    -------
    ys : K tensors ``[b, h, 1, dv]`` (``y_1 .. y_K`` of the row; the first K-1 are views into ``store``)
    out0 : ``[b, h, 1, dv]`` stock attention, or None
    """
    b, h, _, d = q.shape
    hkv, e = k.shape[1], k.shape[2]
    dv = v.shape[-1]
    off = e - 1
    r = h // hkv
    c = params.rho / (1.0 + params.lam)
    signs, scales = (sc, sc, -sc), (1.0, c, -c * params.lam)
    if not with_stock:
        signs, scales = signs[1:], scales[1:]
    n = len(signs)  # kinds: [stock,] c P+ (becomes A), -c lam P-
    ia = n - 2
    w = torch.bmm(q.reshape(b * hkv, r, d), k.reshape(b * hkv, e, d).transpose(1, 2))  # [b g, r, e], unscaled
    # [b, g, n, r, e]: +-sc w per kind, -inf on the query's own column for A's kinds (strict causality)
    big = torch.addcmul(_row_bias(n, e, w), w.view(b, hkv, 1, r, e), _row_constant(signs, w)[..., None])
    big.sub_(big.amax(dim=-1, keepdim=True)).exp_()
    big.mul_(big.sum(dim=-1, keepdim=True).reciprocal_().mul_(_row_constant(scales, w)[..., None]))
    big[:, :, ia].add_(big[:, :, ia + 1])  # A = c P+ - c lam P- (0 at the query's own column)
    y = torch.bmm(big.view(b * hkv, n * r, e)[:, :(ia + 1) * r], v.reshape(b * hkv, e, dv))
    y = y.view(b, hkv, ia + 1, r, dv)
    a = big[:, :, ia, :, :off].reshape(b * h, 1, off)  # A's rows per query head (one small copy)
    ys = []
    y_next = y[:, :, ia]  # [b, g, r, dv]
    for t in store:  # y_{hh+1} = A y_hh over the earlier positions
        t.view(b, hkv, r, t.shape[2], dv)[:, :, :, off] = y_next
        ys.append(t[:, :, off:off + 1])
        y_next = torch.bmm(a, t.reshape(b * h, t.shape[2], dv)[:, :off]).view(b, hkv, r, dv)
    ys.append(y_next.reshape(b, h, 1, dv))
    return ys, (y[:, :, 0].reshape(b, h, 1, dv) if with_stock else None)


def _hops_inplace(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bm: torch.Tensor | None, params: CeqParams,
                  sc: float, store: list[torch.Tensor], chunk_size: int | None, stock: str | None,
                  ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Hop outputs of the query rows, extending a hop history held in capacity buffers in place.

    ``store`` as for :func:`_hop_blocks` (K-1 buffers ``[b, h, cap >= kv_len, dv]``, rows ``[:off]`` the
    history of the earlier positions; rows ``[off, kv_len)`` are written, nothing else is touched).
    A single unmasked decoding query with the sgate operator takes :func:`_sgate_decode_row`.

    Returns
    -------
    ys : K tensors ``[b, h, q_len, dv]`` (``y_1 .. y_K`` of the query rows; the first K-1 are views into
        ``store``)
    out0 : ``[b, h, q_len, dv]`` stock attention when ``stock`` is not None, else None
    """
    b, h, q_len, _ = q.shape
    kv_len = k.shape[2]
    dv = v.shape[-1]
    off = kv_len - q_len
    K = params.hops
    if len(store) != K - 1 or any(t.shape[:2] != (b, h) or t.shape[2] < kv_len or t.shape[3] != dv for t in store):
        raise InvalidInputError(f"the hop store must be {K - 1} tensors [{b}, {h}, >= {kv_len}, {dv}], got "
                                f"{[tuple(t.shape) for t in store]}")
    if q_len == 1 and off >= 1 and bm is None and params.operator == "sgate" and stock in (None, "causal"):
        return _sgate_decode_row(q, k, v, params, sc, store, stock is not None)
    last = q.new_empty(b, h, q_len, dv)
    out0 = None if stock is None else q.new_empty(b, h, q_len, dv)
    _hop_blocks(q, k, v, bm, params, sc, store, last, chunk_size, stock, out0)
    return [t[:, :, off:kv_len] for t in store] + [last], out0


class CeqHopsFunction(torch.autograd.Function):
    """``Y = [stock] + sum_h coef[h-1] * y_h`` on the query rows, memory-lean.

    Saves q, k, v, coef and the hop outputs (``O(s d)`` each); recomputes A one row block at a time in
    backward (blocks in reverse order, since A^T is upper-triangular). Gradients flow to q, k, v and coef;
    the hop history of earlier positions (decoding) is treated as a constant.

    ``apply(q, k, v, coef, bm, params, sc, history, chunk_size, sink, stock)``; ``sink`` (a list or None)
    receives the hop outputs (detached) for a hop cache; ``stock`` (None, ``"causal"`` or ``"mask"``) adds
    the stock softmax attention computed from the same logits (the fused hybrid path).
    """

    @staticmethod
    def forward(ctx, q, k, v, coef, bm, params, sc, history, chunk_size, sink, stock=None):  # noqa: D102
        with torch.no_grad():
            bufs, out0 = _hops_forward(q, k, v, bm, params, sc, history, chunk_size, stock)
            off = k.shape[2] - q.shape[2]
            out = sum(coef[i] * bufs[i][:, :, off:] for i in range(params.hops))
            if out0 is not None:
                out = out0.add_(out)
        if sink is not None:
            sink.extend(bufs)
        ctx.save_for_backward(q, k, v, coef, *bufs)
        ctx.bm = bm  # the caller's (non-differentiable) mask; kept by reference, never expanded to [s, s]
        ctx.params, ctx.sc, ctx.chunk, ctx.stock = params, sc, chunk_size, stock
        return out

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        q, k, v, coef, *bufs = ctx.saved_tensors
        params, sc, chunk, stock = ctx.params, ctx.sc, ctx.chunk, ctx.stock
        K = params.hops
        b, h, q_len, d = q.shape
        hkv, kv_len = k.shape[1], k.shape[2]
        dv_dim = v.shape[-1]
        off = kv_len - q_len
        chunk = chunk or auto_chunk(kv_len)
        g = g.contiguous()
        dcoef = torch.stack([(g * bufs[i][:, :, off:]).sum() for i in range(K)]).to(coef.dtype)
        acc = [torch.zeros_like(v)] + [q.new_zeros(b, h, kv_len, dv_dim) for _ in range(1, K)]
        dq = torch.empty_like(q)  # every row block writes its rows
        dk = torch.zeros_like(k)
        for r0, r1 in reversed(_chunks(q_len, chunk)):
            e = off + r1
            c = r1 - r0
            vis = visible_block(ctx.bm, off, r0, r1, e, q.device)
            vs = None if stock is None else visible_block(ctx.bm, off, r0, r1, e, q.device, mode=stock)
            qs = q[:, :, r0:r1] * sc
            a, parts, ps = _block_a(qs, k[:, :, :e], vis, params, need_parts=True, vis_stock=vs)
            gc = g[:, :, r0:r1]
            gy: list[torch.Tensor | None] = [None] * (K + 1)
            for hh in range(K, 0, -1):
                gyh = coef[hh - 1] * gc
                if hh < K:
                    gyh = gyh + acc[hh][:, :, off + r0:off + r1]
                gy[hh] = gyh
                if hh == 1:
                    acc[0][:, :, :e] += torch.matmul(_grouped(a, hkv).transpose(-1, -2), _grouped(gyh, hkv))
                else:
                    acc[hh - 1][:, :, :e] += torch.matmul(a.transpose(-1, -2), gyh)
            da = torch.matmul(_grouped(gy[1], hkv), v[:, :, :e].transpose(-1, -2)).view(b, h, c, e)
            for hh in range(2, K + 1):
                da += torch.matmul(gy[hh], bufs[hh - 2][:, :, :e].transpose(-1, -2))
            del a
            dw = _block_a_backward(da, parts, params)
            del da, parts
            if ps is not None:
                gcg = _grouped(gc, hkv)
                acc[0][:, :, :e] += torch.matmul(_grouped(ps, hkv).transpose(-1, -2), gcg)
                dps = torch.matmul(gcg, v[:, :, :e].transpose(-1, -2)).view(b, h, c, e)
                dw += _softmax_backward(dps, ps)
                del dps, ps
            dwg = _grouped(dw, hkv)
            dq[:, :, r0:r1] = torch.matmul(dwg, k[:, :, :e]).view(b, h, c, d).mul_(sc)
            dk[:, :, :e] += torch.matmul(dwg.transpose(-1, -2), _grouped(qs, hkv))
        return dq, dk, acc[0], dcoef, None, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------------------
# public entry point
# ----------------------------------------------------------------------------------------------------------
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
    b, h, hkv, q_len, kv_len = _check_qkv(q, k, v)
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
    sc = _scale(q.shape[-1], scaling)
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
            ys, out0 = _hops_inplace(q, k, v, bm, params, sc, _store, int(chunk_size), stock_mode)
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


def ceq_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                            *, form: str = "hybrid", operator: str = "sgate", alpha: float | torch.Tensor = 1.0,
                            hops: int | None = None, rho: float | None = None, lam: float | None = None,
                            scaling: float | None = None) -> torch.Tensor:
    """Plain dense reference of :func:`ceq_attention` (prefill only, ``q_len == kv_len``, no dropout).

    Materialises A with :func:`ceq_matrix`, applies it K times with autograd; the stock part is plain
    masked softmax attention written out (not SDPA).
    """
    b, h, hkv, q_len, kv_len = _check_qkv(q, k, v)
    if q_len != kv_len:
        raise InvalidInputError("ceq_attention_reference covers prefill only (q_len == kv_len)")
    params = resolve_params(operator, rho, lam, hops)
    a = ceq_matrix(q, k, mask, operator=operator, rho=params.rho,
                   lam=params.lam if operator == "sgate" else None, scaling=scaling)
    vr = repeat_kv(v, h // hkv)
    y, total = vr, torch.zeros_like(vr)
    for i in range(1, params.hops + 1):
        y = a @ y
        total = total + (1.0 if form == "path_sum" else alpha ** i) * y
    if form == "path_sum":
        return vr + total
    sc = _scale(q.shape[-1], scaling)
    w = (q @ repeat_kv(k, h // hkv).transpose(-1, -2)) * sc
    vis = causal_mask(q_len, kv_len, device=q.device)[None, None]
    bm = to_bool_mask(mask, q_len, kv_len)
    if bm is not None:
        vis = vis & bm
    p = _masked_softmax(w, vis)
    return p @ vr + total


__all__ = [
    "CeqHopsFunction", "CeqParams", "DEFAULTS", "a_from_logits", "allowed_mask", "auto_chunk", "ceq_attention",
    "ceq_attention_reference", "ceq_matrix", "hops_forward", "repeat_kv", "resolve_params", "stock_attention",
    "truncation_bound", "visible_block",
]
