"""Tests for sv_attention.ops.ceq: the operator matrices, both forms, the fast path and its reference."""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from sv_attention.errors import ConfigError, InvalidHyperparameterError, InvalidInputError, MaskError
from sv_attention.ops.ceq import (
    ceq_attention,
    ceq_attention_reference,
    ceq_matrix,
    repeat_kv,
    stock_attention,
    truncation_bound,
)

F64 = torch.float64


def _qkv(b=2, h=4, hkv=2, s=9, d=5, dtype=F64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s, d, dtype=dtype, generator=g)
    k = torch.randn(b, hkv, s, d, dtype=dtype, generator=g)
    v = torch.randn(b, hkv, s, d, dtype=dtype, generator=g)
    if grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def _pad(b=2, s=9):
    pad = torch.ones(b, s, dtype=torch.bool)
    pad[1, :3] = False  # left padding on the second sequence
    return pad


def _rel(a, b):
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@pytest.mark.parametrize("operator", ["sgate", "signed"])
def test_nilpotent_and_strictly_causal(operator):
    q, k, _ = _qkv(s=7)
    a = ceq_matrix(q, k, _pad(s=7), operator=operator)
    assert torch.equal(torch.triu(a), torch.zeros_like(a))
    p = torch.linalg.matrix_power(a, 7)
    assert torch.equal(p, torch.zeros_like(p))
    assert torch.count_nonzero(torch.linalg.matrix_power(a, 6)) > 0  # the bound is tight for the real rows
    assert not torch.isnan(a).any()


def test_sgate_row_sums_and_empty_rows():
    q, k, _ = _qkv(s=8)
    pad = _pad(s=8)
    rho, lam = 1.5, 0.1
    a = ceq_matrix(q, k, pad, rho=rho, lam=lam)
    sums = a.sum(-1)
    target = rho * (1 - lam) / (1 + lam)
    has_key = torch.zeros(2, 8, dtype=torch.bool)
    has_key[0, 1:] = True
    has_key[1, 4:] = True  # keys 0..2 padded: rows <= 3 see no strictly-earlier real key
    assert torch.allclose(sums[has_key[:, None].expand_as(sums)], torch.tensor(target, dtype=F64), atol=1e-14)
    assert torch.equal(a[~has_key[:, None].expand(2, 4, 8)], torch.zeros_like(a[~has_key[:, None].expand(2, 4, 8)]))
    a1 = ceq_matrix(q, k, pad, lam=1.0)
    assert a1.sum(-1).abs().max() < 1e-14


def test_signed_row_abs_sums():
    q, k, _ = _qkv(s=6)
    a = ceq_matrix(q, k, operator="signed")
    assert torch.allclose(a.abs().sum(-1)[..., 1:], torch.full((2, 4, 5), 0.9, dtype=F64), atol=1e-14)
    assert torch.equal(a[..., 0, :], torch.zeros_like(a[..., 0, :]))


@pytest.mark.parametrize("operator", ["sgate", "signed"])
def test_path_sum_full_depth_is_resolvent(operator):
    s = 6
    q, k, v = _qkv(s=s, hkv=4)
    a = ceq_matrix(q, k, operator=operator)
    out = ceq_attention(q, k, v, form="path_sum", operator=operator, hops=s - 1, chunk_size=4)
    eye = torch.eye(s, dtype=F64)
    want = torch.linalg.solve(eye - a, v)
    assert _rel(out, want) < 1e-13


@pytest.mark.parametrize("operator", ["sgate", "signed"])
@pytest.mark.parametrize("form", ["hybrid", "path_sum"])
def test_fast_matches_reference_values_and_grads(operator, form):
    q, k, v = _qkv(grad=True)
    alpha = torch.tensor(0.7, dtype=F64, requires_grad=True)
    pad = _pad()
    out = ceq_attention(q, k, v, pad, form=form, operator=operator, alpha=alpha, chunk_size=4)
    ref = ceq_attention_reference(q, k, v, pad, form=form, operator=operator, alpha=alpha)
    assert _rel(out, ref) < 1e-13
    go = torch.randn_like(out)
    ins = (q, k, v, alpha) if form == "hybrid" else (q, k, v)
    g1 = torch.autograd.grad(out, ins, go)
    g2 = torch.autograd.grad(ref, ins, go)
    for a, b in zip(g1, g2, strict=True):
        assert _rel(a, b) < 1e-12


@pytest.mark.parametrize("operator", ["sgate", "signed"])
@pytest.mark.parametrize("form", ["hybrid", "path_sum"])
def test_gradcheck_fp64(operator, form):
    q, k, v = _qkv(b=1, h=2, hkv=1, s=4, d=2, grad=True, seed=3)
    alpha = torch.tensor(0.6, dtype=F64, requires_grad=True)

    def f(q, k, v, alpha):
        return ceq_attention(q, k, v, form=form, operator=operator, alpha=alpha, chunk_size=2)

    assert torch.autograd.gradcheck(f, (q, k, v, alpha), eps=1e-6, atol=1e-7)


def test_alpha_zero_is_stock_bitwise():
    for hkv, dtype in ((4, torch.float32), (2, torch.float32), (2, F64)):
        q, k, v = _qkv(hkv=hkv, dtype=dtype)
        stock = stock_attention(q, k, v)
        want = scaled_dot_product_attention(q, repeat_kv(k, 4 // hkv), repeat_kv(v, 4 // hkv), is_causal=True,
                                            enable_gqa=False) if hkv == 4 else None
        if want is not None:
            assert torch.equal(stock, want)
        assert torch.equal(ceq_attention(q, k, v, alpha=0.0), stock)
        alpha = torch.zeros((), dtype=dtype, requires_grad=True)
        assert torch.equal(ceq_attention(q, k, v, alpha=alpha), stock)
        # with a transformers-style 4-D bool mask the stock path gets the mask unchanged
        m = torch.tril(torch.ones(9, 9, dtype=torch.bool))[None, None].expand(2, 1, 9, 9).clone()
        m[1, :, :, :2] = False
        assert torch.equal(ceq_attention(q, k, v, m, alpha=alpha), stock_attention(q, k, v, m))


def test_stock_matches_transformers_sdpa_forward():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class M(torch.nn.Module):
        num_key_value_groups = 2
        is_causal = True

    q, k, v = _qkv(hkv=2, dtype=torch.float32)
    for mask in (None, torch.zeros(2, 1, 9, 9).masked_fill(~torch.tril(torch.ones(9, 9, dtype=torch.bool)), -3e38)):
        want, _ = sdpa_attention_forward(M(), q, k, v, mask, scaling=0.3)
        got = stock_attention(q, k, v, mask, scaling=0.3)
        assert torch.equal(got.transpose(1, 2).contiguous(), want)
    # decode row (q_len = 1) takes the packed-GQA path in transformers
    want, _ = sdpa_attention_forward(M(), q[:, :, -1:], k, v, None)
    assert torch.equal(stock_attention(q[:, :, -1:], k, v).transpose(1, 2).contiguous(), want)


def test_alpha_gradient_at_zero_is_first_hop():
    q, k, v = _qkv()
    alpha = torch.zeros((), dtype=F64, requires_grad=True)
    out = ceq_attention(q, k, v, alpha=alpha)
    go = torch.randn_like(out)
    (g,) = torch.autograd.grad(out, alpha, go)
    av = ceq_matrix(q, k) @ repeat_kv(v, 2)
    assert abs(float(g) - float((go * av).sum())) < 1e-12 * float(av.abs().sum())


def test_additive_mask_equals_bool_and_ambiguous_raises():
    q, k, v = _qkv()
    bm = torch.tril(torch.ones(9, 9, dtype=torch.bool))[None, None].expand(2, 1, 9, 9).clone()
    bm[1, :, :, :3] = False
    add = torch.zeros(2, 1, 9, 9, dtype=F64).masked_fill(~bm, torch.finfo(F64).min)
    a1 = ceq_attention(q, k, v, bm, form="path_sum")
    a2 = ceq_attention(q, k, v, add, form="path_sum")
    assert torch.equal(a1, a2)
    bad = add.clone()
    bad[0, 0, 5, 2] = -1.0
    with pytest.raises(MaskError):
        ceq_attention(q, k, v, bad)
    with pytest.raises(MaskError):
        ceq_matrix(q, k, bad)


def test_fully_padded_rows_no_nan_and_grads_finite():
    q, k, v = _qkv(grad=True)
    pad = torch.ones(2, 9, dtype=torch.bool)
    pad[0, :] = False
    out = ceq_attention(q, k, v, pad, form="path_sum")
    out.sum().backward()
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_training_memory_saves_no_square_tensor():
    s = 64
    q, k, v = _qkv(b=1, h=2, hkv=2, s=s, d=4, dtype=torch.float32, grad=True)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = ceq_attention(q, k, v, form="path_sum", chunk_size=16)
    assert max(saved) < s * s  # only O(s d) tensors are saved (q, k, v, hop outputs), never an [s, s] one
    out.sum().backward()


def test_truncation_bound():
    assert truncation_bound(0.5, 2) == pytest.approx(0.25)
    assert truncation_bound(0.9, 3) == pytest.approx(0.9 ** 4 / 0.1)
    for bad in (1.0, 1.5, float("nan")):
        with pytest.raises(InvalidHyperparameterError):
            truncation_bound(bad, 2)
    with pytest.raises(InvalidHyperparameterError):
        truncation_bound(0.5, -1)


def test_bound_holds_for_signed_tail():
    q, k, v = _qkv(hkv=4, s=12)
    full = ceq_attention(q, k, v, form="path_sum", operator="signed", hops=11)
    cut = ceq_attention(q, k, v, form="path_sum", operator="signed", hops=3)
    vmax = v.abs().amax(dim=-2, keepdim=True)
    assert ((full - cut).abs() <= truncation_bound(0.9, 3) * vmax + 1e-12).all()


def test_bad_inputs_raise():
    q, k, v = _qkv()
    with pytest.raises(ConfigError):
        ceq_attention(q, k, v, operator="nope")
    with pytest.raises(ConfigError):
        ceq_attention(q, k, v, form="nope")
    with pytest.raises(ConfigError):
        ceq_matrix(q, k, operator="signed", lam=0.2)
    with pytest.raises(InvalidInputError):
        ceq_attention(q, k[:, :, :, :3], v)
    with pytest.raises(InvalidInputError):
        ceq_attention(q[:, :3], k, v)  # 3 heads over 2 kv heads
    with pytest.raises(InvalidHyperparameterError):
        ceq_attention(q, k, v, hops=0)
    with pytest.raises(InvalidHyperparameterError):
        ceq_attention(q, k, v, alpha=float("nan"))
    with pytest.raises(InvalidInputError):
        ceq_attention(q, k, v, alpha=torch.ones(2))


def test_return_weights_and_fp32_close_to_reference():
    q, k, v = _qkv(dtype=torch.float32)
    out, a = ceq_attention(q, k, v, _pad(), return_weights=True, alpha=0.5)
    assert a.shape == (2, 4, 9, 9)
    ref = ceq_attention_reference(q, k, v, _pad(), alpha=0.5)
    assert _rel(out, ref) < 1e-6


@pytest.mark.parametrize("operator", ["sgate", "signed"])
def test_fused_stock_matches_sdpa_stock_path(operator):
    q, k, v = _qkv(grad=True)
    alpha = torch.tensor(0.4, dtype=F64, requires_grad=True)
    m4 = torch.tril(torch.ones(9, 9, dtype=torch.bool))[None, None].expand(2, 1, 9, 9).clone()
    m4[1, :, :, :2] = False
    m4[1, :, :2, 0] = True  # keep every row non-empty (SDPA's empty rows are NaN, the fused path's 0)
    for mask in (None, _pad(), m4):
        fused = ceq_attention(q, k, v, mask, operator=operator, alpha=alpha, chunk_size=4)
        plain = ceq_attention(q, k, v, mask, operator=operator, alpha=alpha, chunk_size=4, fuse_stock=False)
        rows = slice(3, None) if mask is not None else slice(None)  # padded query rows: SDPA NaN vs 0
        assert _rel(fused[:, :, rows], plain[:, :, rows]) < 1e-13
        go = torch.randn_like(fused)
        go[:, :, :3] = 0 if mask is not None else go[:, :, :3]
        g1 = torch.autograd.grad(fused, (q, k, v, alpha), go)
        g2 = torch.autograd.grad(plain, (q, k, v, alpha), go)
        for a, b in zip(g1, g2, strict=True):
            assert _rel(a, b) < 1e-12
    # decode rows (queries at the end) and no-grad path
    with torch.no_grad():
        assert _rel(ceq_attention(q[:, :, -1:], k, v, alpha=0.4, form="hybrid", _history=None, hops=1),
                    ceq_attention(q[:, :, -1:], k, v, alpha=0.4, hops=1, fuse_stock=False)) < 1e-13


def test_non_causal_4d_mask_is_not_fused():
    q, k, v = _qkv()
    full = torch.ones(2, 1, 9, 9, dtype=torch.bool)  # shows future keys to the stock path
    a = ceq_attention(q, k, v, full, alpha=0.4)
    b = ceq_attention(q, k, v, full, alpha=0.4, fuse_stock=False)
    assert torch.equal(a, b)
