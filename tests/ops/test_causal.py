"""Tests of the chunk-frozen causal hybrid SV-Attention layer (sv_attention.ops.causal)."""

import pytest
import torch

from sv_attention.errors import InfeasibleBoxError, InvalidHyperparameterError, InvalidInputError
from sv_attention.ops.causal import (
    CausalSVAttention,
    GateCache,
    compute_boundary_gates,
    sv_hybrid_attention,
    sv_hybrid_reference,
    warmup_size,
)

C16 = 1.0 / (0.5 * 16)  # nu = 0.5 at n0 = chunk = 16: warm-up below 4 keys


def _qkv(seed=0, b=2, h=4, hk=2, T=40, d=6, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, T, d, generator=g, dtype=dtype)
    k = torch.randn(b, hk, T, d, generator=g, dtype=dtype)
    v = torch.randn(b, hk, T, d, generator=g, dtype=dtype)
    return q, k, v


def test_chunk_frozen_formula_matches_plain_reference():
    q, k, v = _qkv()
    out, w = sv_hybrid_attention(q, k, v, C=C16, chunk=16, return_weights=True)
    gates = compute_boundary_gates(k, [16, 32], C=C16, chunk=16)
    assert all(bool(a.all()) for a in gates.active.values())
    ref = sv_hybrid_reference(q, k, v, gates.alpha, gates.active, chunk=16)
    assert torch.allclose(out, ref, atol=1e-12)
    # gated prefix: reserve keys (alpha = 0) get exactly zero weight for queries of later chunks
    a16 = gates.alpha[16]  # [b, hk, 16]
    zero = a16[0, 0] == 0
    assert zero.any()
    assert (w[0, 0, 16:32, :16][:, zero] == 0).all()


def test_chunk0_and_warmup_are_plain_causal_softmax():
    q, k, v = _qkv(T=24)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                            is_causal=True)
    out, _ = sv_hybrid_attention(q, k, v, C=C16, chunk=16)
    assert torch.allclose(out[:, :, :16], sdpa[:, :, :16], atol=1e-12)
    # C = 0.05 needs ceil(1/C) + 2 = 22 keys > 16: boundary 16 is warm-up, so everything is plain softmax
    assert warmup_size(0.05) == 22
    out_w, _ = sv_hybrid_attention(q, k, v, C=0.05, chunk=16)
    assert torch.allclose(out_w, sdpa, atol=1e-12)


def test_no_future_leak_fp64():
    q, k, v = _qkv(seed=1, T=26)
    base, _ = sv_hybrid_attention(q, k, v, C=C16, chunk=8)
    for t in (5, 8, 20):
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        q2[:, :, t] += 3.0
        k2[:, :, t] -= 2.0
        v2[:, :, t] *= -4.0
        out, _ = sv_hybrid_attention(q2, k2, v2, C=C16, chunk=8)
        assert (out[:, :, :t] - base[:, :, :t]).abs().max() <= 1e-10
        assert (out[:, :, t:] - base[:, :, t:]).abs().max() > 1e-6


def test_prefill_equals_token_by_token_decode_fp32():
    q, k, v = _qkv(seed=2, T=40, dtype=torch.float32)
    full, _ = sv_hybrid_attention(q, k, v, C=C16, chunk=16)
    steps = [0, 7, 15, 16, 17, 31, 32, 33, 39]
    for cache in (GateCache(), None):
        outs = [sv_hybrid_attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], C=C16, chunk=16,
                                    gate_cache=cache)[0] for t in steps]
        assert (torch.cat(outs, dim=2) - full[:, :, steps]).abs().max() <= 1e-5
    # the cache fits each boundary once and detects a changed prefix
    cache = GateCache()
    for t in range(34, 40):
        sv_hybrid_attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], C=C16, chunk=16, gate_cache=cache)
    assert cache.boundaries() == [32] and cache.misses == 1 and cache.hits == 5
    sv_hybrid_attention(q[:, :, -1:], k + 1.0, v, C=C16, chunk=16, gate_cache=cache)
    assert cache.invalidations == 1


def test_exact_solver_matches_batched():
    q, k, v = _qkv(seed=3, b=1, h=2, hk=1, T=48, d=4)
    gb = compute_boundary_gates(k, [16, 32], C=C16, chunk=16, sigma=2.0, solve_kwargs={"ridge": 0.0})
    cache = GateCache()
    ge = compute_boundary_gates(k, [16, 32], C=C16, chunk=16, sigma=2.0, solver="exact", cache=cache)
    for s in (16, 32):
        a_b, a_e = gb.alpha[s], ge.alpha[s]
        assert torch.equal(a_b > 1e-9, a_e > 1e-9)
        assert (a_b - a_e).abs().max() < 1e-5
    ob, _ = sv_hybrid_attention(q, k, v, C=C16, chunk=16, sigma=2.0)  # default ridge 1e-3
    oe, _ = sv_hybrid_attention(q, k, v, C=C16, chunk=16, sigma=2.0, solver="exact")
    assert (ob - oe).abs().max() < 2e-3  # published tolerance 5e-3


def test_padding_mask_honoured():
    q, k, v = _qkv(seed=4, b=2, T=32)
    pad = torch.ones(2, 32, dtype=torch.bool)
    pad[1, :5] = False  # left padding of the second sequence
    out, w = sv_hybrid_attention(q, k, v, C=C16, chunk=16, mask=pad, return_weights=True)
    assert (w[1, :, :, :5] == 0).all()
    assert torch.isfinite(out).all()
    # padded keys do not enter the SVDD problem: changing them changes nothing for real queries
    k2, v2 = k.clone(), v.clone()
    k2[1, :, :5] = 100.0
    v2[1, :, :5] = -7.0
    out2, _ = sv_hybrid_attention(q, k2, v2, C=C16, chunk=16, mask=pad)
    assert torch.allclose(out[:, :, 5:], out2[:, :, 5:], atol=1e-12)


def test_gradcheck_layer_through_batched_path():
    torch.manual_seed(0)
    layer = CausalSVAttention(4, 2, C=1 / 2, chunk=4, sigma=1.5, detach_gate=False,
                              solve_kwargs={"backend": "torch"}).double()
    x = torch.randn(1, 10, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: layer(t), (x,), atol=1e-6)
    # detached gate (default as published): gradient still flows through the readout
    layer.detach_gate = True
    y = layer(x)
    y.sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_rbf_readout_and_gate_floor_and_non_causal():
    q, k, v = _qkv(seed=5, T=32)
    o_rbf, _ = sv_hybrid_attention(q, k, v, C=C16, chunk=16, readout="rbf")
    assert torch.isfinite(o_rbf).all()
    o_f, w_f = sv_hybrid_attention(q, k, v, C=C16, chunk=16, gate_floor=1.0, return_weights=True)
    plain = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                             is_causal=True)
    assert torch.allclose(o_f, plain, atol=1e-12)  # floor 1 = every gate weight 1 = plain softmax
    o_nc, w_nc = sv_hybrid_attention(q, k, v, C=C16, chunk=16, causal=False, return_weights=True)
    g = compute_boundary_gates(k, [32], C=C16, chunk=16)
    assert torch.equal(w_nc[:, ::2] > 0, (g.alpha[32] > 0)[:, :, None, :].expand(2, 2, 32, 32))


def test_module_shapes_padding_and_bad_input():
    torch.manual_seed(1)
    m = CausalSVAttention(16, 4, chunk=8)
    assert m.C == pytest.approx(1 / (0.5 * 8))
    x = torch.randn(2, 20, 16)
    pad = torch.ones(2, 20, dtype=torch.long)
    pad[0, :3] = 0
    y = m(x, attention_mask=pad)
    assert y.shape == (2, 20, 16) and torch.isfinite(y).all()
    # status counts of the last call: boundaries 8 and 16, 2 sequences x 4 heads each
    assert sum(m.last_status_counts.values()) == 2 * 2 * 4
    with pytest.raises(InvalidInputError):
        m(torch.randn(2, 20, 15))
    bad = x.clone()
    bad[0, 3, 1] = float("nan")
    with pytest.raises(InvalidInputError):
        m(bad)
    with pytest.raises(InvalidHyperparameterError):
        CausalSVAttention(16, 4, chunk=0)
    with pytest.raises(InvalidHyperparameterError):
        CausalSVAttention(16, 3)
    with pytest.raises(InfeasibleBoxError):
        CausalSVAttention(16, 4, C=0.01, chunk=64)
    q, k, v = _qkv(T=20)
    with pytest.raises(InvalidInputError):
        sv_hybrid_attention(q, k[:, :, :10], v[:, :, :10], C=C16, chunk=8)
    with pytest.raises(InvalidInputError):
        sv_hybrid_attention(q[:, :3], k, v, C=C16, chunk=8)
    k_bad = k.clone()
    k_bad[0, 0, 2, 0] = float("inf")
    with pytest.raises(InvalidInputError):
        sv_hybrid_attention(q, k_bad, v, C=C16, chunk=8)
    with pytest.raises(InvalidHyperparameterError):
        sv_hybrid_attention(q, k, v, C=C16, chunk=-1)
    with pytest.raises(InvalidHyperparameterError):
        sv_hybrid_attention(q, k, v, C=0.0, chunk=8)


def test_exact_mode_module_runs_and_is_detached():
    torch.manual_seed(2)
    m = CausalSVAttention(8, 2, chunk=8, solver="exact", sigma=2.0)
    y = m(torch.randn(1, 20, 8))
    assert y.shape == (1, 20, 8) and m.last_status_counts.get("ok", 0) > 0
