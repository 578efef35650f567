"""The "ceq" attention function, called directly with the transformers v5 contract."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from sv_attention.errors import HopCacheError, UnsupportedFeatureError
from sv_attention.hf.attention import STATE_ATTR, ceq_attention_forward
from sv_attention.ops.ceq import ceq_attention, ceq_attention_reference, ceq_matrix


class Cfg:
    def __init__(self, **ceq):
        if ceq:
            self.ceq = ceq


class Mod(torch.nn.Module):
    def __init__(self, is_causal=True, groups=2, window=None, **ceq):
        super().__init__()
        self.config = Cfg(**ceq)
        self.is_causal = is_causal
        self.layer_idx = 0
        self.num_key_value_groups = groups
        self.sliding_window = window
        self.eval()


def qkv(b=2, h=4, g=2, q=10, kv=10, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, q, d, generator=gen), torch.randn(b, g, kv, d, generator=gen),
            torch.randn(b, g, kv, d, generator=gen))


def causal(b, q, kv):
    return (torch.arange(kv)[None, :] <= torch.arange(kv - q, kv)[:, None])[None, None].expand(b, 1, q, kv)


@pytest.mark.parametrize("mask_kind", ["none", "bool"])
def test_alpha_zero_is_bitwise_sdpa(mask_kind):
    q, k, v = qkv()
    mask = None if mask_kind == "none" else causal(2, 10, 10).clone()
    if mask is not None:
        mask[1, ..., :2] = False
    mod = Mod(path_weight=0.0)
    out, w = ceq_attention_forward(mod, q, k, v, mask, scaling=0.3)
    ref, _ = sdpa_attention_forward(mod, q, k, v, mask, scaling=0.3)
    assert out.shape == (2, 10, 4, 8) and w is None
    assert torch.equal(out, ref)


@pytest.mark.parametrize("operator,form", [("sgate", "hybrid"), ("signed", "hybrid"), ("sgate", "path_sum")])
def test_hops_match_the_dense_reference(operator, form):
    q, k, v = qkv(seed=1)
    mod = Mod(path_weight=0.2, variant=operator, form=form)
    out, _ = ceq_attention_forward(mod, q, k, v, None, scaling=0.25, use_cache=False)
    ref = ceq_attention_reference(q, k, v, None, form=form, operator=operator, alpha=0.2, scaling=0.25)
    assert torch.allclose(out, ref.transpose(1, 2), atol=1e-5)
    stock, _ = sdpa_attention_forward(mod, q, k, v, None, scaling=0.25)
    assert not torch.allclose(out, stock, atol=1e-4)


def test_decode_with_hop_state_equals_recomputation():
    q, k, v = qkv(q=14, kv=14, seed=2)
    mask = causal(2, 14, 14).clone()
    mask[1, ..., :3] = False
    full, _ = ceq_attention_forward(Mod(path_weight=0.3), q, k, v, mask, use_cache=False)
    mod = Mod(path_weight=0.3)
    steps = [ceq_attention_forward(mod, q[:, :, :6], k[:, :, :6], v[:, :, :6], mask[..., :6, :6])[0]]
    for t in range(6, 14):
        steps.append(ceq_attention_forward(mod, q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1],
                                           mask[..., t:t + 1, :t + 1])[0])
    rows = mask[:, 0].any(-1)[:, :, None, None].expand_as(full)  # fully padded rows are undefined
    assert (torch.cat(steps, 1) - full)[rows].abs().max() <= 1e-5
    # beam reorder: rows permuted, history follows by fingerprint
    perm = torch.tensor([1, 0])
    out_p, _ = ceq_attention_forward(mod, q[perm][:, :, 13:], k[perm], v[perm], mask[perm][..., 13:, :])
    assert torch.allclose(out_p, full[perm][:, 13:], atol=1e-5)


def test_decode_without_history_raises_and_keeps_state():
    q, k, v = qkv(q=1, kv=5)
    mod = Mod(path_weight=0.3)
    with pytest.raises(HopCacheError, match="hop history"):
        ceq_attention_forward(mod, q, k, v, None)
    assert STATE_ATTR not in mod.__dict__
    q2, k2, v2 = qkv(q=4, kv=4, seed=3)
    ceq_attention_forward(mod, q2, k2, v2, None)
    with pytest.raises(HopCacheError, match="differ"):  # other keys than the history was built on
        ceq_attention_forward(mod, q, k, v, None)


def test_encoder_hops_refused_but_alpha_zero_allowed():
    q, k, v = qkv()
    with pytest.raises(UnsupportedFeatureError, match="causal"):
        ceq_attention_forward(Mod(is_causal=False, path_weight=0.1), q, k, v, None)
    out, _ = ceq_attention_forward(Mod(is_causal=False, path_weight=0.0), q, k, v, None)
    ref, _ = sdpa_attention_forward(Mod(is_causal=False), q, k, v, None)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("kw", [{"softcap": 1.0}, {"s_aux": torch.zeros(1)}, {"position_bias": torch.zeros(1)}])
def test_semantic_kwargs_are_refused(kw):
    q, k, v = qkv()
    with pytest.raises(UnsupportedFeatureError):
        ceq_attention_forward(Mod(), q, k, v, None, **kw)


def test_output_attentions_returns_a_and_dropout_in_training():
    q, k, v = qkv(seed=4)
    out, a = ceq_attention_forward(Mod(path_weight=0.1), q, k, v, None, output_attentions=True, use_cache=False)
    assert torch.allclose(a, ceq_matrix(q, k, None))
    assert (a.triu(0) == 0).all()
    mod = Mod(path_weight=0.1)
    mod.train()
    torch.manual_seed(0)
    out_t, _ = ceq_attention_forward(mod, q, k, v, None, dropout=0.5)
    assert not torch.allclose(out_t, out)
    assert STATE_ATTR not in mod.__dict__  # no decoding state in training


def _steps(mod, q, k, v, prefill, end, **kw):
    outs = [ceq_attention_forward(mod, q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill], None, **kw)[0]]
    for t in range(prefill, end):
        outs.append(ceq_attention_forward(mod, q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], None, **kw)[0])
    return torch.cat(outs, 1)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_unmasked_decode_equals_recomputation_across_regrowth_and_crop(dtype, tol, monkeypatch):
    # transformers passes no mask when decoding one token with a DynamicCache: the single-row kernel
    monkeypatch.setattr("sv_attention.ops.ceq.state.PREFILL_HEADROOM", 2)  # regrow the buffers on the way
    q, k, v = (t.to(dtype) for t in qkv(q=20, kv=20, seed=6))
    full, _ = ceq_attention_forward(Mod(path_weight=0.3, hops=3), q, k, v, None, use_cache=False)
    mod = Mod(path_weight=0.3, hops=3)
    assert (_steps(mod, q, k, v, 3, 20) - full).abs().max() <= tol
    state = mod.__dict__[STATE_ATTR]
    assert state.end - state.base == 20 and state.store[0].shape[2] >= 20
    # a crop of the key cache (assisted decoding, DynamicCache.crop): the first 11 columns are reused
    redo = [ceq_attention_forward(mod, q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], None)[0]
            for t in range(11, 20)]
    assert (torch.cat(redo, 1) - full[:, 11:]).abs().max() <= tol


def test_sliding_window_keeps_the_last_columns():
    q, k, v = qkv(q=12, kv=12, seed=7)
    mod = Mod(path_weight=0.3, window=4)
    ceq_attention_forward(mod, q[:, :, :8], k[:, :, :8], v[:, :, :8], None)
    ref = Mod(path_weight=0.3)
    ceq_attention_forward(ref, q[:, :, :8], k[:, :, :8], v[:, :, :8], None)
    # a window layer's cache hands back only its last columns; the history rows follow them
    out, _ = ceq_attention_forward(mod, q[:, :, 8:9], k[:, :, 5:9], v[:, :, 5:9], None)
    st = ref.__dict__[STATE_ATTR]
    hist = st.store[0][:, :, st.base + 5:st.base + 8]
    exp = ceq_attention(q[:, :, 8:9], k[:, :, 5:9], v[:, :, 5:9], None, alpha=0.3, _history=[hist])
    assert torch.allclose(out, exp.transpose(1, 2), atol=1e-6)


def test_steady_state_beam_reorder_and_other_conversation_detected():
    q, k, v = qkv(b=3, q=9, kv=9, seed=8)
    full, _ = ceq_attention_forward(Mod(path_weight=0.3), q, k, v, None, use_cache=False)
    mod = Mod(path_weight=0.3)
    _steps(mod, q, k, v, 4, 8)
    perm = torch.tensor([2, 0, 0])  # reorder without telling the state: matched by the key fingerprint
    out, _ = ceq_attention_forward(mod, q[perm][:, :, 8:], k[perm], v[perm], None)
    assert torch.allclose(out, full[perm][:, 8:], atol=1e-5)
    k2 = k.clone()
    k2[:, :, 3, 0] += 1.0  # one cached key column edited in the middle: the full fingerprint catches it
    with pytest.raises(HopCacheError, match="differ"):
        ceq_attention_forward(mod, q[perm][:, :, 8:], k2[perm], v[perm], None)


def test_decode_without_use_cache_leaves_the_state_intact():
    q, k, v = qkv(q=10, kv=10, seed=9)
    mod = Mod(path_weight=0.3)
    _steps(mod, q, k, v, 4, 8)
    st = mod.__dict__[STATE_ATTR]
    before = (st.base, st.end, st.store[0][:, :, st.base:st.end].clone())
    # a one-off query on a shorter prefix (a crop) with use_cache=False must not clobber columns 6..7
    ceq_attention_forward(mod, q[:, :, 6:7], k[:, :, :7], v[:, :, :7], None, use_cache=False)
    st2 = mod.__dict__[STATE_ATTR]
    assert st2 is st and (st.base, st.end) == before[:2]
    assert torch.equal(st.store[0][:, :, st.base:st.end], before[2])


def test_prefill_in_inference_mode_then_decode_under_no_grad():
    q, k, v = qkv(q=7, kv=7, seed=10)
    full, _ = ceq_attention_forward(Mod(path_weight=0.3), q, k, v, None, use_cache=False)
    mod = Mod(path_weight=0.3)
    with torch.inference_mode():  # inference tensors cannot be extended in place outside this mode: copied
        ceq_attention_forward(mod, q[:, :, :5], k[:, :, :5], v[:, :, :5], None)
    with torch.no_grad():
        out = torch.cat([ceq_attention_forward(mod, q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], None)[0]
                         for t in (5, 6)], 1)
    assert torch.allclose(out, full[:, 5:], atol=1e-5)


def test_beam_search_with_the_cache_equals_beam_search_without():
    import warnings

    import sv_attention
    from tests.hf import tiny

    m = tiny.llama()
    sv_attention.enable(m, "ceq", path_weight=0.3)
    ids = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    gk = dict(max_new_tokens=6, do_sample=False, num_beams=3, num_return_sequences=2, eos_token_id=None,
              pad_token_id=0)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        cached = m.generate(ids, **gk)  # beam reorders: the hop history follows by the key fingerprint
        recomputed = m.generate(ids, use_cache=False, **gk)
    assert torch.equal(cached, recomputed)


# ------------------------------------------------------------------------------------------------------------
# every plug-in path against the naive reference (fp64, relative error), unpadded and left-padded
# ------------------------------------------------------------------------------------------------------------
F64 = torch.float64
VARIANTS = [("sgate", "hybrid"), ("signed", "hybrid"), ("sgate", "path_sum"), ("signed", "path_sum")]


def _rel(a, b):
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _left_padded_mask(b, s, pads):
    """Causal 4-D bool mask with ``pads[r]`` padded key columns at the start of row r."""
    real = torch.arange(s)[None, :] >= torch.tensor(pads)[:, None]  # [b, s]
    return causal(b, s, s) & real[:, None, None, :]


def _reference(q, k, v, mask, operator, form, alpha, scaling):
    return ceq_attention_reference(q, k, v, mask, form=form, operator=operator, alpha=alpha, scaling=scaling)


@pytest.mark.parametrize("operator,form", VARIANTS)
@pytest.mark.parametrize("pads", [None, (0, 3)])
@pytest.mark.parametrize("use_cache", [True, False])
def test_prefill_equals_the_naive_reference_values_and_grads(operator, form, pads, use_cache):
    q, k, v = (t.to(F64).requires_grad_(True) for t in qkv(q=9, kv=9, d=6, seed=11))
    mask = None if pads is None else _left_padded_mask(2, 9, pads)
    out, _ = ceq_attention_forward(Mod(path_weight=0.4, variant=operator, form=form), q, k, v, mask, scaling=0.3,
                                   use_cache=use_cache)
    ref = _reference(q, k, v, mask, operator, form, 0.4, 0.3).transpose(1, 2)
    assert _rel(out, ref) < 1e-13
    go = torch.randn(out.shape, dtype=F64, generator=torch.Generator().manual_seed(0))
    for a, b in zip(torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(ref, (q, k, v), go), strict=True):
        assert _rel(a, b) < 1e-12


@pytest.mark.parametrize("operator,form", VARIANTS)
@pytest.mark.parametrize("pads", [None, (0, 2)])
def test_decode_equals_the_naive_reference_values_and_query_grads(operator, form, pads):
    s, pre = 10, 4
    q, k, v = (t.to(F64) for t in qkv(q=s, kv=s, d=6, seed=12))
    mask = None if pads is None else _left_padded_mask(2, s, pads)
    ref = _reference(q, k, v, mask, operator, form, 0.4, None)
    mod = Mod(path_weight=0.4, variant=operator, form=form)
    ceq_attention_forward(mod, q[:, :, :pre], k[:, :, :pre], v[:, :, :pre],
                          None if mask is None else mask[..., :pre, :pre])
    for t in range(pre, s):
        qt = q[:, :, t:t + 1].clone().requires_grad_(True)
        mt = None if mask is None else mask[..., t:t + 1, :t + 1]  # transformers passes no mask unpadded
        out, _ = ceq_attention_forward(mod, qt, k[:, :, :t + 1], v[:, :, :t + 1], mt)
        want = ref[:, :, t:t + 1]
        assert _rel(out, want.transpose(1, 2)) < 1e-12
        # a query row's output depends on its own query through its row of A and the stock softmax only
        # (the history rows come from earlier queries): its gradient equals the reference's
        qr = q.clone().requires_grad_(True)
        row = _reference(qr, k, v, mask, operator, form, 0.4, None)[:, :, t:t + 1]
        go = torch.randn(out.shape, dtype=F64, generator=torch.Generator().manual_seed(t))
        (g_dec,) = torch.autograd.grad(out, qt, go)
        (g_ref,) = torch.autograd.grad(row, qr, go.transpose(1, 2))
        assert _rel(g_dec, g_ref[:, :, t:t + 1]) < 1e-12
