"""Parameter counts: exact arithmetic, the published 3,220,992 reading, operator-specific tensors."""

from __future__ import annotations

import torch

from configuration_sv import SVConfig
from modeling_sv import SVForCausalLM
from sv_attention.artifact.params import PUBLISHED_EXCLUDING_TIED_HEAD, count_parameters, published_reading


def _meta(**kw):
    with torch.device("meta"):
        return SVForCausalLM(SVConfig(**kw))


def test_counts_match_hand_arithmetic():
    d, L, ff, V, P = 48, 3, 96, 256, 40
    model = _meta(hidden_size=d, num_hidden_layers=L, num_attention_heads=4, intermediate_size=ff,
                  max_position_embeddings=P)
    per_layer = 4 * d * d + (d * ff + ff + ff * d + d) + 2 * 2 * d
    total = V * d + P * d + L * per_layer + 2 * d
    c = count_parameters(model)
    assert c["total"] == total == sum(p.numel() for p in model.parameters())
    assert c["trainable"] == total
    assert c["excluding_embeddings"] == total - V * d - P * d
    assert c["excluding_tied_head"] == total - V * d
    assert sum(c["per_module"].values()) == total
    assert c["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}


def test_published_reading_softmax_and_sv():
    for op in ("softmax", "sv", "swa"):
        model = _meta(operator=op)
        c = count_parameters(model)
        r = published_reading(c, model.config)
        assert r["applies"] and r["matches"] and r["backbone"] == PUBLISHED_EXCLUDING_TIED_HEAD
        assert "3,220,992" in r["explanation"]
    biased = _meta(attention_bias=True)
    r = published_reading(count_parameters(biased), biased.config)
    assert not r["matches"] and r["difference"] == 4 * 4 * 256


def test_operator_specific_tensors():
    c = count_parameters(_meta(operator="smprime", hidden_size=32, num_attention_heads=2, num_hidden_layers=1))
    assert c["operator_specific"] == {
        "model.layers.0.attn.smprime.beta": 1, "model.layers.0.attn.smprime.qk": 1,
        "model.layers.0.attn.smprime.g": 1, "model.layers.0.attn.smprime.u_head.weight": 64,
        "model.layers.0.attn.smprime.u_head.bias": 2, "model.layers.0.attn.smprime.theta_head.weight": 64,
        "model.layers.0.attn.smprime.theta_head.bias": 2}
    assert c["operator_specific_total"] == 135


def test_frozen_parameters_are_not_trainable():
    model = _meta(hidden_size=32, num_attention_heads=2, num_hidden_layers=1)
    model.model.embed_positions.weight.requires_grad_(False)
    c = count_parameters(model)
    assert c["trainable"] == c["total"] - model.config.max_position_embeddings * 32


def test_smaller_model_states_the_difference_and_the_count_at_the_published_shape():
    model = _meta(operator="sv", hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=128)
    c = count_parameters(model)
    r = published_reading(c, model.config, SVForCausalLM)
    assert not r["applies"] and r["difference"] == c["excluding_tied_head"] - PUBLISHED_EXCLUDING_TIED_HEAD
    assert r["at_published_shape"] == PUBLISHED_EXCLUDING_TIED_HEAD
    assert f"by {r['difference']:+,}" in r["explanation"] and "equal to the published figure" in r["explanation"]
    biased = _meta(hidden_size=64, num_attention_heads=4, attention_bias=True)
    r = published_reading(count_parameters(biased), biased.config, SVForCausalLM)
    assert r["at_published_shape"] == PUBLISHED_EXCLUDING_TIED_HEAD + 4 * 4 * 256
    assert "+4,096 from it" in r["explanation"]
