"""Tests for sv_attention.ops.hop_cache: decoding with the hop cache equals the full prefill."""

from __future__ import annotations

import pytest
import torch

from sv_attention.errors import HopCacheError
from sv_attention.ops.ceq import ceq_attention
from sv_attention.ops.hop_cache import HopCache, HopCaches, ceq_attention_cached

F64 = torch.float64


def _qkv(b=2, h=4, hkv=2, s=10, d=5, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, s, d, dtype=dtype, generator=g), torch.randn(b, hkv, s, d, dtype=dtype, generator=g),
            torch.randn(b, hkv, s, d, dtype=dtype, generator=g))


def _decode(q, k, v, pad, cache, prefill, step=1, **kw):
    s = q.shape[2]
    outs = [ceq_attention_cached(q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill],
                                 None if pad is None else pad[:, :prefill], cache, **kw)]
    t = prefill
    while t < s:
        e = min(t + step, s)
        m = None if pad is None else pad[:, :e]
        outs.append(ceq_attention_cached(q[:, :, t:e], k[:, :, :e], v[:, :, :e], m, cache, **kw))
        t = e
    return torch.cat(outs, dim=2)


@pytest.mark.parametrize("operator,form", [("sgate", "hybrid"), ("sgate", "path_sum"), ("signed", "hybrid"),
                                           ("signed", "path_sum")])
def test_token_by_token_equals_prefill_fp64(operator, form):
    q, k, v = _qkv()
    pad = torch.ones(2, 10, dtype=torch.bool)
    pad[1, :2] = False
    full = ceq_attention(q, k, v, pad, operator=operator, form=form, alpha=0.8)
    cache = HopCache()
    dec = _decode(q, k, v, pad, cache, prefill=3, operator=operator, form=form, alpha=0.8)
    assert (dec - full)[:, :, 3:].abs().max() <= 1e-12
    assert cache.length == 10


def test_multi_token_steps_and_fp32():
    q, k, v = _qkv(dtype=torch.float32, s=12)
    full = ceq_attention(q, k, v, alpha=0.9, hops=3)
    dec = _decode(q, k, v, None, HopCache(), prefill=4, step=3, alpha=0.9, hops=3)
    assert (dec - full).abs().max() <= 1e-6


def test_crop_then_redecode_matches_prefill():
    q, k, v = _qkv()
    full = ceq_attention(q, k, v, form="path_sum")
    cache = HopCache()
    _decode(q, k, v, None, cache, prefill=4, form="path_sum")
    cache.crop(6)
    assert cache.length == 6
    out = torch.cat([ceq_attention_cached(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], None, cache,
                                          form="path_sum") for t in range(6, 10)], dim=2)
    assert (out - full[:, :, 6:]).abs().max() <= 1e-12
    cache.crop(-2)
    assert cache.length == 8


def test_reorder_matches_prefill_of_reordered_batch():
    q, k, v = _qkv(b=3)
    idx = torch.tensor([2, 0, 0])
    full = ceq_attention(q[idx], k[idx], v[idx], alpha=0.5)
    cache = HopCache()
    ceq_attention_cached(q[:, :, :7], k[:, :, :7], v[:, :, :7], None, cache, alpha=0.5)
    cache.reorder(idx)
    q, k, v = q[idx], k[idx], v[idx]
    out = torch.cat([ceq_attention_cached(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], None, cache,
                                          alpha=0.5) for t in range(7, 10)], dim=2)
    assert (out - full[:, :, 7:]).abs().max() <= 1e-12


def test_inconsistent_cache_raises_and_is_unchanged():
    q, k, v = _qkv()
    cache = HopCache()
    ceq_attention_cached(q[:, :, :5], k[:, :, :5], v[:, :, :5], None, cache)
    before = [t.clone() for t in cache.history]
    with pytest.raises(HopCacheError):  # skips position 5
        ceq_attention_cached(q[:, :, 6:7], k[:, :, :7], v[:, :, :7], None, cache)
    with pytest.raises(HopCacheError):  # different operator hyperparameters
        ceq_attention_cached(q[:, :, 5:6], k[:, :, :6], v[:, :, :6], None, cache, rho=1.2)
    assert cache.length == 5 and all(torch.equal(a, b) for a, b in zip(cache.history, before, strict=True))
    with pytest.raises(HopCacheError):
        ceq_attention_cached(q[:, :, 5:6], k[:, :, :6], v[:, :, :6], None, HopCache())


def test_hop_caches_container_and_alpha_zero():
    q, k, v = _qkv()
    caches = HopCaches()
    out = ceq_attention_cached(q, k, v, None, caches.layer(0), alpha=0.0)
    assert torch.equal(out, ceq_attention(q, k, v, alpha=0.0))  # stock bitwise, cache still filled
    ceq_attention_cached(q, k, v, None, caches[1])
    assert caches[0].length == 10 and caches[1].length == 10
    caches.crop(4)
    assert caches[0].length == 4 and caches[1].length == 4
    caches.batch_repeat_interleave(2)
    assert caches[0].history[0].shape[0] == 4
    caches.reset()
    assert caches[0].length == 0


@pytest.mark.parametrize("dtype,tol", [(F64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("form,hops,hkv", [("hybrid", 2, 2), ("hybrid", 3, 1), ("hybrid", 1, 4), ("path_sum", 2, 2)])
def test_unmasked_single_token_decode_equals_prefill(dtype, tol, form, hops, hkv, monkeypatch):
    # no mask and one token per step: the single-row decode kernel; a tiny headroom makes the
    # capacity buffers regrow several times on the way
    monkeypatch.setattr("sv_attention.ops.ceq.state.PREFILL_HEADROOM", 1)
    q, k, v = _qkv(b=2, h=4, hkv=hkv, s=24, d=6, dtype=dtype, seed=5)
    full = ceq_attention(q, k, v, form=form, alpha=0.7, hops=hops)
    cache = HopCache()
    dec = _decode(q, k, v, None, cache, prefill=1, form=form, alpha=0.7, hops=hops)
    assert (dec - full).abs().max() <= tol
    assert cache.length == 24 and all(t.shape[2] >= 24 for t in cache.store)
    assert not dec.isnan().any()


def test_crop_is_constant_time_and_redecode_matches():
    q, k, v = _qkv(s=12)
    full = ceq_attention(q, k, v, alpha=0.6)
    cache = HopCache()
    _decode(q, k, v, None, cache, prefill=5, alpha=0.6)
    store = cache.store
    cache.crop(7)  # no copy: the same buffers, later columns overwritten by the next steps
    assert cache.store is store and cache.history[0].shape[2] == 7
    out = torch.cat([ceq_attention_cached(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], None, cache,
                                          alpha=0.6) for t in range(7, 12)], dim=2)
    assert (out - full[:, :, 7:]).abs().max() <= 1e-12


def test_learnable_alpha_decode_keeps_gradients_and_cache():
    q, k, v = _qkv(s=9)
    alpha = torch.tensor(0.4, dtype=F64, requires_grad=True)
    full = ceq_attention(q, k, v, alpha=alpha)
    cache = HopCache()
    dec = _decode(q, k, v, None, cache, prefill=4, alpha=alpha)
    assert (dec - full).abs().max() <= 1e-12
    (g_dec,) = torch.autograd.grad(dec[:, :, 4:].sum(), alpha)
    (g_full,) = torch.autograd.grad(full[:, :, 4:].sum(), alpha)
    assert torch.allclose(g_dec, g_full, atol=1e-10)
