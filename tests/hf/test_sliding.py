"""Sliding-window layers are gated by the window rule (ops/sv_gate/schedule.py), not run as plain softmax:
Mistral (default config and small windows), Starcoder2, Qwen2, Gemma3 with windows smaller and larger than
the prompt; cache == no-cache; the Mistral default config equals the naive reference."""

from __future__ import annotations

import warnings

import pytest
import torch

import sv_attention
from sv_attention.ops.settings import SVSettings
from sv_attention.ops.sv_gate import naive_sv_gate_attention

from . import tiny

IDS = torch.randint(1, 97, (2, 14), generator=torch.Generator().manual_seed(5))
KW = {"nu": 0.5, "chunk": 4}
MODELS = {
    "mistral": lambda w: tiny.mistral(sliding_window=w),
    "starcoder2": lambda w: tiny.starcoder2(window=w),
    "qwen2": lambda w: tiny.qwen2_sliding(window=w),
    "gemma3": lambda w: tiny.gemma3(window=w),
}


def logits(m, ids=IDS):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return m(ids).logits


@pytest.mark.parametrize("arch", list(MODELS))
@pytest.mark.parametrize("window", [5, 64])
def test_sliding_layers_gated_and_decode_equals_prefill(arch, window):
    m = MODELS[arch](window)
    eager = logits(m)  # sdpa: the model's own attention
    sv_attention.enable(m, "sv_attention", **KW)
    full = logits(m)
    assert (full - eager).abs().max() > 1e-3  # gated, not plain softmax
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = tiny.step_logits(m, IDS, 3)  # decode crosses boundaries 4, 8, 12 and (window 5) the window
    assert (step - full).abs().max() <= 1e-5
    if window == 64:  # a window covering every key is full attention: the same gate exactly
        nowin = MODELS[arch](None if arch in ("mistral", "starcoder2") else 256)
        sv_attention.enable(nowin, "sv_attention", **KW)
        assert (logits(nowin) - full).abs().max() <= 1e-6


def test_softmax_setting_keeps_plain_softmax_inside_the_window():
    m = tiny.mistral(sliding_window=5)
    ref = logits(m)
    sv_attention.enable(m, "sv_attention", sliding_window="softmax", **KW)
    assert (logits(m) - ref).abs().max() <= 1e-5


def test_mistral_default_config_is_gated_and_equals_the_naive_reference():
    from transformers import AttentionInterface, AttentionMaskInterface

    from sv_attention.hf.attention import sv_attention_forward, visible_mask
    from sv_attention.hf.masks import sv_attention_mask

    m = tiny.mistral_default()
    assert m.config.sliding_window == 4096
    eager = logits(m, IDS[:1])
    seen = []

    def capture(module, query, key, value, attention_mask, **kw):
        out = sv_attention_forward(module, query, key, value, attention_mask, **kw)
        seen.append((query, key, value, attention_mask, kw.get("scaling"), out[0]))
        return out

    AttentionInterface.register("sv_capture", capture)
    AttentionMaskInterface.register("sv_capture", sv_attention_mask)
    sv_attention.enable(m, "sv_attention", **KW)
    gated = logits(m, IDS[:1])
    assert (gated - eager).abs().max() > 1e-3  # not a no-op any more
    m.set_attn_implementation("sv_capture")
    assert torch.equal(logits(m, IDS[:1]), gated)
    q, k, v, mask, sc, out = seen[0]
    vis = visible_mask(mask, 1, q.shape[2], k.shape[2], True, q.device)
    ref = naive_sv_gate_attention(q.double(), k.double(), v.double(), vis, SVSettings(**KW), scaling=sc)
    assert (out.transpose(1, 2).double() - ref).abs().max() <= 1e-5


def test_the_notice_says_what_is_and_is_not_gated():
    from sv_attention.ops.sv_gate import fit

    fit._WARNED.discard("sliding-gate")
    m = tiny.mistral(sliding_window=5)
    sv_attention.enable(m, "sv_attention", **KW)
    with pytest.warns(RuntimeWarning) as rec, torch.no_grad():
        m(IDS)
    msg = " ".join(str(r.message) for r in rec)
    assert "exactly the full-attention gate" in msg
    assert "keys its window leaves visible before its chunk boundary" in msg
    assert "keys outside the window are not attended and not gated" in msg
