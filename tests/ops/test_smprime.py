"""Tests for sv_attention.ops.smprime: the three corners, the stable path product, the module."""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from sv_attention.errors import InvalidInputError
from sv_attention.ops.smprime import SMPrime, path_modulus, smprime_attention, smprime_reference

F64 = torch.float64


def _qkv(b=2, h=2, s=6, d=4, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, s, d, dtype=dtype, generator=g) for _ in range(3))


def _gates(b=2, h=2, s=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(b, h, s, dtype=F64, generator=g)
    m[0, 0, 3] = 0.0  # an annihilating position
    theta = torch.randn(b, h, s, dtype=F64, generator=g)
    return m, theta


def test_corner_beta1_g0_is_softmax():
    q, k, v = _qkv(dtype=torch.float32)
    mod = SMPrime(8, 2)
    with torch.no_grad():
        mod.g.zero_()
        mod.u_head.weight.normal_()
        mod.theta_head.weight.normal_()
    hidden = torch.randn(2, 6, 8)
    out = mod(hidden, q, k, v)
    want = scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (out - want).abs().max() <= 1e-6


def test_corner_beta0_g0_is_unnormalised_exp():
    q, k, v = _qkv()
    ones, zeros = torch.ones(2, 2, 6, dtype=F64), torch.zeros(2, 2, 6, dtype=F64)
    out = smprime_attention(q, k, v, ones, zeros, beta=0.0)
    w = torch.exp(q @ k.transpose(-1, -2) / 2.0) * torch.tril(torch.ones(6, 6, dtype=F64))
    assert torch.allclose(out, w @ v, rtol=1e-12, atol=1e-12)


def test_corner_beta0_qk0_is_double_loop_path_product():
    q, k, v = _qkv()
    m, theta = _gates()
    out = smprime_attention(q, k, v, m, theta, beta=0.0, qk=0.0)
    want = smprime_reference(q, k, v, m, theta, beta=0.0, qk=0.0)
    assert torch.allclose(out, want, rtol=1e-12, atol=1e-12)


def test_general_point_matches_reference():
    q, k, v = _qkv(b=1, s=5)
    m, theta = _gates(b=1, s=5)
    out = smprime_attention(q, k, v, m, theta, beta=0.7, qk=1.3)
    want = smprime_reference(q, k, v, m, theta, beta=0.7, qk=1.3)
    assert torch.allclose(out, want, rtol=1e-12, atol=1e-12)


def test_path_modulus_zero_is_finite_with_grad():
    m = torch.tensor([0.5, 0.0, 0.8, 0.9], dtype=F64, requires_grad=True)
    g = path_modulus(m)
    gd = g.detach()
    assert gd[3, 0] == 0.0 and float(gd[3, 1]) == pytest.approx(0.72) and gd[2, 2] == 1.0 and gd[1, 2] == 0.0
    g.sum().backward()
    assert torch.isfinite(m.grad).all()
    assert m.grad[1] != 0  # d/dm at the annihilating point is not lost


def test_module_init_and_gradients():
    mod = SMPrime(8, 2)
    assert mod.beta.item() == mod.qk.item() == mod.g.item() == 1.0
    m, th = mod.gates(torch.randn(1, 5, 8))
    assert torch.allclose(m, torch.full_like(m, 1 - 1e-3)) and torch.allclose(th, torch.full_like(th, 1e-3))
    q, k, v = _qkv(b=1, s=5, dtype=torch.float32)
    out = mod(torch.randn(1, 5, 8), q, k, v)
    out.sum().backward()
    for p in (mod.beta, mod.qk, mod.g, mod.u_head.weight, mod.theta_head.weight):
        assert p.grad is not None and torch.isfinite(p.grad).all()
    with pytest.raises(InvalidInputError):
        mod(torch.randn(1, 4, 8), q, k, v)


def test_padding_mask_rows_finite():
    q, k, v = _qkv()
    m, theta = _gates()
    pad = torch.ones(2, 6, dtype=torch.bool)
    pad[1, :2] = False
    out = smprime_attention(q, k, v, m, theta, beta=0.5, mask=pad)
    assert torch.isfinite(out).all()
    assert torch.equal(out[1, :, :2], torch.zeros_like(out[1, :, :2]))


@pytest.mark.parametrize("rows", [1, 3, 6])
def test_last_rows_equal_the_prefill_rows(rows):
    """Decoding computes only the last rows, each by the prefill's own per-row operations."""
    q, k, v = _qkv(s=6)
    m, theta = _gates(s=6)
    pad = torch.tensor([[True] * 6, [False, True, True, True, True, True]])  # a left-padded row
    full = smprime_attention(q, k, v, m, theta, beta=0.6, qk=1.2, mask=pad)
    last = smprime_attention(q[:, :, -rows:], k, v, m, theta, beta=0.6, qk=1.2, mask=pad)
    assert last.shape == (2, 2, rows, 4)
    assert torch.allclose(last, full[:, :, -rows:], atol=1e-12)
    assert torch.allclose(path_modulus(m, rows), path_modulus(m)[..., -rows:, :], atol=0)
    with pytest.raises(InvalidInputError, match="q_len <= kv_len"):
        smprime_attention(torch.cat([q, q], 2), k, v, m, theta)


def _rel(a, b):
    return float((a.detach() - b.detach()).norm() / b.detach().norm().clamp_min(1e-300))


@pytest.mark.parametrize("rows", [None, 2])
def test_fast_path_equals_the_naive_reference_with_padding_gqa_values_and_grads(rows):
    g = torch.Generator().manual_seed(7)
    b, h, hkv, s, d = 2, 4, 2, 7, 3
    q = torch.randn(b, h, s, d, dtype=F64, generator=g)
    k, v = (torch.randn(b, hkv, s, d, dtype=F64, generator=g) for _ in range(2))
    m = (0.2 + 0.8 * torch.rand(b, h, s, dtype=F64, generator=g))  # m > 0: |G| differentiable everywhere
    theta = torch.randn(b, h, s, dtype=F64, generator=g)
    beta, qk = torch.tensor(0.7, dtype=F64), torch.tensor(1.3, dtype=F64)
    pad = torch.ones(b, s, dtype=torch.bool)
    pad[1, :3] = False  # left padding
    t = s if rows is None else rows
    ins = [x.clone().requires_grad_(True) for x in (q[:, :, s - t:], k, v, m, theta, beta, qk)]
    fast = smprime_attention(*ins[:5], beta=ins[5], qk=ins[6], mask=pad, scaling=0.4)
    ref = smprime_reference(*ins[:5], beta=ins[5], qk=ins[6], mask=pad, scaling=0.4)
    assert _rel(fast, ref) < 1e-13
    go = torch.randn(fast.shape, dtype=F64, generator=g)
    for a, c in zip(torch.autograd.grad(fast, ins, go), torch.autograd.grad(ref, ins, go), strict=True):
        assert _rel(a, c) < 1e-11
