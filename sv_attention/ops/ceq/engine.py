"""The fast (row-block, memory-lean) hop engine of ceq.

A^h is never materialised: A is applied to v repeatedly, ``y_h = A y_{h-1}``, ``y_0 = v``. Because A is
strictly lower-triangular, one block of query rows of A is enough to advance *every* hop for those rows
(``y_h`` rows ``< i`` are already final when row i is reached), so the engine builds A one row block at a
time (``chunk_size`` rows) and never holds more than ``chunk_size x kv`` of it. In training the custom
autograd function :class:`CeqHopsFunction` saves only q, k, v and the hop outputs (``O(s d)`` each) and
recomputes each row block of A in backward, walking the blocks in reverse.

Queries may be the last ``q_len`` positions of a longer key sequence (decoding): query row r sits at
absolute position ``kv_len - q_len + r``, and the hop history of the earlier positions comes from capacity
buffers (:class:`sv_attention.ops.ceq.state.HopState`) that :func:`hops_inplace` extends in place; a
single unmasked decoding query with the sgate operator takes the row kernel :func:`_sgate_decode_row`
(one logits row, one ``[stock; A] v`` matmul, one single-row matmul per hop).
"""

from __future__ import annotations

import torch

from sv_attention.errors import InvalidInputError
from sv_attention.ops.ceq.common import DEFAULT_CHUNK, CeqParams, visible_block
from sv_attention.ops.ceq.row_native import sgate_decode_row


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
    if torch.compiler.is_compiling() or not bool(has.all()):  # compiled: no data-dependent branch (x * 1 == x)
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
                      store: list[torch.Tensor], with_stock: bool,
                      engine: str = "auto") -> tuple[list[torch.Tensor], torch.Tensor | None]:
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
    engine : ``"auto"`` (the C kernel :func:`sv_attention.ops.ceq.row_native.sgate_decode_row` where it runs,
        else the torch operations below), ``"torch"`` (the torch operations: the reference) or ``"native"``
        (the kernel; :class:`RuntimeError` where it cannot run)

    Returns
    -------
    ys : K tensors ``[b, h, 1, dv]`` (``y_1 .. y_K`` of the row; the first K-1 are views into ``store``)
    out0 : ``[b, h, 1, dv]`` stock attention, or None
    """
    if engine != "torch" and not torch.compiler.is_compiling():  # (a compiled graph traces the torch row)
        if engine != "auto" and engine != "native":
            raise ValueError(f"engine must be 'auto', 'torch' or 'native', got {engine!r}")
        fast = sgate_decode_row(q, k, v, sc, params.rho, params.lam, store, with_stock)
        if fast is not None:
            return fast
        if engine == "native":
            raise RuntimeError("the native ceq row kernel cannot run here (no compiler, SV_ATTENTION_NATIVE=0, "
                               "or inputs it does not take)")
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


def hops_inplace(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bm: torch.Tensor | None, params: CeqParams,
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
