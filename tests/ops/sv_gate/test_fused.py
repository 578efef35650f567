"""The fused readout (log-gate folded into the dot products, one SDPA call) equals the eager readout,
outputs and gradients, for every visibility pattern the gate meets."""

import pytest
import torch

from sv_attention.ops.sv_gate import GateBias
from sv_attention.ops.sv_gate.fused import NEG_BIAS, fused_gated_sdpa, gate_columns
from sv_attention.ops.sv_gate.readout import grouped_attention


def _gate_bias(gen, b, g, q, kv, slots, dtype=torch.float64, reserve=True):
    table = torch.log(torch.rand(b, g, slots + 1, kv, generator=gen, dtype=dtype))
    table[:, :, slots] = 0.0  # the "ungated" slot
    if reserve:
        table[0, 1 % g, 0, 2] = float("-inf")  # reserve keys: weight exactly 0
        table[-1, 0, slots - 1, 0] = float("-inf")
    slot = torch.randint(0, slots + 1, (b, q), generator=gen)
    return GateBias(log_table=table, slot=slot, key_position=torch.arange(kv).expand(b, kv).contiguous())


def _visible(kind, b, q, kv):
    if kind == "causal":
        return torch.ones(q, kv, dtype=torch.bool).tril().expand(b, q, kv).clone()
    if kind == "all":
        return torch.ones(b, q, kv, dtype=torch.bool)
    if kind == "row":  # one decoding row per sequence: padded keys in sequence 0, nothing visible in sequence 1
        vis = torch.ones(b, q, kv, dtype=torch.bool)
        vis[0, :, :3] = False
        vis[1] = False
        return vis
    vis = torch.ones(q, kv, dtype=torch.bool).tril(kv - q).expand(b, q, kv).clone()  # bottom-right causal
    vis[1, :, :3] = False  # left padding of sequence 1
    vis[1, 0] = False  # a row that sees nothing
    return vis


@pytest.mark.parametrize("kind,q,kv", [("causal", 12, 12), ("all", 1, 12), ("row", 1, 12), ("all", 5, 9),
                                       ("padded", 7, 12)])
@pytest.mark.parametrize("g,dv", [(2, 3), (4, 9), (1, 5)])
def test_fused_readout_equals_the_eager_readout_outputs_and_gradients(kind, q, kv, g, dv):
    gen = torch.Generator().manual_seed(q * 100 + kv + g)
    b, h, d = 2, 4, 5
    query = torch.randn(b, h, q, d, generator=gen, dtype=torch.float64, requires_grad=True)
    key = torch.randn(b, g, kv, d, generator=gen, dtype=torch.float64, requires_grad=True)
    value = torch.randn(b, g, kv, dv, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = _gate_bias(gen, b, g, q, kv, slots=3)
    visible = _visible(kind, b, q, kv)
    out = fused_gated_sdpa(query, key, value, visible, bias, 0.4)
    ref, _ = grouped_attention(query, key, value, visible, bias.dense(), 0.4)
    assert out.shape == ref.shape == (b, h, q, dv)
    assert torch.isfinite(out).all()
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
    up = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((out * up).sum(), (query, key, value))
    refs = torch.autograd.grad((ref * up).sum(), (query, key, value))
    for a, r in zip(grads, refs):
        assert torch.isfinite(a).all()
        assert torch.allclose(a, r, rtol=1e-10, atol=1e-12)
    if kind in ("padded", "row"):
        assert (out[1, :, 0] == 0).all()


def test_a_reserve_key_gets_weight_exactly_zero_in_float32():
    """log 0 becomes NEG_BIAS: exp underflows to exactly 0, so the reserve key's value never reaches the output."""
    gen = torch.Generator().manual_seed(3)
    b, h, g, n, d = 1, 2, 1, 6, 4
    query = torch.randn(b, h, n, d, generator=gen)
    key = torch.randn(b, g, n, d, generator=gen)
    value = torch.zeros(b, g, n, d)
    value[0, 0, 1] = 1e6  # only the reserve key carries a value
    table = torch.zeros(b, g, 2, n)
    table[0, 0, 0, 1] = float("-inf")
    slot = torch.zeros(b, n, dtype=torch.long)  # every row reads slot 0
    bias = GateBias(log_table=table, slot=slot, key_position=torch.arange(n)[None])
    vis = torch.ones(n, n, dtype=torch.bool).tril()[None]
    out = fused_gated_sdpa(query, key, value, vis, bias, 0.5)
    assert (out == 0).all()
    cols, onehot = gate_columns(bias, b, g, n, n, torch.float32)
    assert cols[0, 0, 1, 0] == NEG_BIAS and onehot.sum(-1).eq(1).all()


def test_a_one_row_gate_tensor_is_read_by_every_row():
    """Non-causal layers pass the gate as a [b, g, 1, kv] tensor: the same bias on every query row."""
    gen = torch.Generator().manual_seed(5)
    b, h, g, q, kv, d = 2, 4, 2, 7, 9, 3
    query = torch.randn(b, h, q, d, generator=gen, dtype=torch.float64)
    key = torch.randn(b, g, kv, d, generator=gen, dtype=torch.float64)
    value = torch.randn(b, g, kv, d, generator=gen, dtype=torch.float64)
    bias = torch.log(torch.rand(b, g, 1, kv, generator=gen, dtype=torch.float64))
    visible = torch.ones(b, q, kv, dtype=torch.bool)
    visible[0, :, -2:] = False  # padded keys
    out = fused_gated_sdpa(query, key, value, visible, bias, 0.3)
    ref, _ = grouped_attention(query, key, value, visible, bias, 0.3)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"\[b, g, 1, kv\]"):
        fused_gated_sdpa(query, key, value, visible, bias.expand(b, g, q, kv), 0.3)


def _chunked_gate_bias(gen, b, g, q, chunk, warmup_chunks, dtype=torch.float64):
    """The bias of a real causal gate: rows of chunk c read slot c - 1 (the gate of the keys before the chunk,
    log 1 = 0 from the boundary on), the first ``warmup_chunks`` chunks the ungated slot; some reserve keys."""
    n_chunks = -(-q // chunk)
    slots = n_chunks - 1
    table = torch.zeros(b, g, slots + 1, q, dtype=dtype)
    slot = torch.full((b, q), slots)
    for c in range(max(warmup_chunks, 1), n_chunks):
        s = c * chunk
        a = torch.rand(b, g, s, generator=gen, dtype=dtype)
        a = torch.where(a < 0.2, torch.zeros_like(a), a)
        table[:, :, c - 1, :s] = torch.log(a / a.sum(-1, keepdim=True))
        slot[:, s:s + chunk] = c - 1
    return GateBias(log_table=table, slot=slot, key_position=torch.arange(q).expand(b, q).contiguous())


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("g,warmup", [(2, 1), (4, 2), (1, 3)])
def test_a_long_causal_prefill_by_segments_equals_the_eager_readout(monkeypatch, dtype, tol, g, warmup):
    """Without autograd, a long plain-causal call runs segment by segment (the earlier keys with the gate row,
    the segment itself causally, merged by log-sum-exp); it equals the eager readout and the one fused call."""
    from sv_attention.ops.sv_gate import fused

    gen = torch.Generator().manual_seed(g * 10 + warmup)
    b, h, q, d, chunk = 2, 4, 45, 6, 8  # a last chunk shorter than the others
    query = torch.randn(b, h, q, d, generator=gen, dtype=dtype)
    key = torch.randn(b, g, q, d, generator=gen, dtype=dtype)
    value = torch.randn(b, g, q, d, generator=gen, dtype=dtype)
    bias = _chunked_gate_bias(gen, b, g, q, chunk, warmup, dtype)
    visible = _visible("causal", b, q, q)
    ref, _ = grouped_attention(query, key, value, visible, bias.dense(), 0.4)
    with torch.no_grad():
        fused_once = fused_gated_sdpa(query, key, value, visible, bias, 0.4)
        segments = fused._causal_by_segments(query, key, value, bias, 0.4)
        monkeypatch.setattr(fused, "SEGMENTS_MIN_ROWS", 1)
        routed = fused_gated_sdpa(query, key, value, visible, bias, 0.4)
    assert segments is not None and torch.equal(routed, segments)
    scale = ref.abs().max()
    assert (segments - ref).abs().max() <= tol * scale and (fused_once - ref).abs().max() <= tol * scale


def test_segments_are_refused_when_the_bias_is_not_a_chunked_gate(monkeypatch):
    """Rows of one batch reading different slots, or a slot with a bias inside its own segment: the segment
    path declines and the one fused call runs (still the eager readout)."""
    from sv_attention.ops.sv_gate import fused

    gen = torch.Generator().manual_seed(7)
    b, h, g, q, d = 2, 4, 2, 24, 5
    query = torch.randn(b, h, q, d, generator=gen, dtype=torch.float64)
    key = torch.randn(b, g, q, d, generator=gen, dtype=torch.float64)
    value = torch.randn(b, g, q, d, generator=gen, dtype=torch.float64)
    visible = _visible("causal", b, q, q)
    random_bias = _gate_bias(gen, b, g, q, q, slots=3)
    assert fused._causal_by_segments(query, key, value, random_bias, 0.4) is None
    chunked = _chunked_gate_bias(gen, b, g, q, 8, 1)
    assert fused._causal_by_segments(query, key, value, chunked, 0.4) is not None
    assert fused._causal_by_segments(query, key, value[..., :3], chunked, 0.4) is None  # another head size
    inside = GateBias(log_table=chunked.log_table.clone(), slot=chunked.slot, key_position=chunked.key_position)
    inside.log_table[:, :, 1, 17] = -0.5  # slot 1 is read by rows 16..23: a bias inside its own segment
    assert fused._causal_by_segments(query, key, value, inside, 0.4) is None
    monkeypatch.setattr(fused, "SEGMENTS_MIN_ROWS", 1)
    with torch.no_grad():
        out = fused_gated_sdpa(query, key, value, visible, random_bias, 0.4)
    ref, _ = grouped_attention(query, key, value, visible, random_bias.dense(), 0.4)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
