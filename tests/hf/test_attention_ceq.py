"""The "ceq" attention function, called directly with the transformers v5 contract."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from sv_attention.errors import HopCacheError, UnsupportedFeatureError
from sv_attention.hf.attention import STATE_ATTR, ceq_attention_forward
from sv_attention.ops.ceq import ceq_attention_reference, ceq_matrix


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
    mod = Mod(alpha=0.0)
    out, w = ceq_attention_forward(mod, q, k, v, mask, scaling=0.3)
    ref, _ = sdpa_attention_forward(mod, q, k, v, mask, scaling=0.3)
    assert out.shape == (2, 10, 4, 8) and w is None
    assert torch.equal(out, ref)


@pytest.mark.parametrize("operator,form", [("sgate", "hybrid"), ("signed", "hybrid"), ("sgate", "path_sum")])
def test_hops_match_the_dense_reference(operator, form):
    q, k, v = qkv(seed=1)
    mod = Mod(alpha=0.2, operator=operator, form=form)
    out, _ = ceq_attention_forward(mod, q, k, v, None, scaling=0.25, use_cache=False)
    ref = ceq_attention_reference(q, k, v, None, form=form, operator=operator, alpha=0.2, scaling=0.25)
    assert torch.allclose(out, ref.transpose(1, 2), atol=1e-5)
    stock, _ = sdpa_attention_forward(mod, q, k, v, None, scaling=0.25)
    assert not torch.allclose(out, stock, atol=1e-4)


def test_decode_with_hop_state_equals_recomputation():
    q, k, v = qkv(q=14, kv=14, seed=2)
    mask = causal(2, 14, 14).clone()
    mask[1, ..., :3] = False
    full, _ = ceq_attention_forward(Mod(alpha=0.3), q, k, v, mask, use_cache=False)
    mod = Mod(alpha=0.3)
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
    mod = Mod(alpha=0.3)
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
        ceq_attention_forward(Mod(is_causal=False, alpha=0.1), q, k, v, None)
    out, _ = ceq_attention_forward(Mod(is_causal=False, alpha=0.0), q, k, v, None)
    ref, _ = sdpa_attention_forward(Mod(is_causal=False), q, k, v, None)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("kw", [{"softcap": 1.0}, {"s_aux": torch.zeros(1)}, {"position_bias": torch.zeros(1)}])
def test_semantic_kwargs_are_refused(kw):
    q, k, v = qkv()
    with pytest.raises(UnsupportedFeatureError):
        ceq_attention_forward(Mod(), q, k, v, None, **kw)


def test_output_attentions_returns_a_and_dropout_in_training():
    q, k, v = qkv(seed=4)
    out, a = ceq_attention_forward(Mod(alpha=0.1), q, k, v, None, output_attentions=True, use_cache=False)
    assert torch.allclose(a, ceq_matrix(q, k, None))
    assert (a.triu(0) == 0).all()
    mod = Mod(alpha=0.1)
    mod.train()
    torch.manual_seed(0)
    out_t, _ = ceq_attention_forward(mod, q, k, v, None, dropout=0.5)
    assert not torch.allclose(out_t, out)
    assert STATE_ATTR not in mod.__dict__  # no decoding state in training
