"""The plug-in on real transformers models: tiny Llama (GQA), Qwen2 (sliding layer), GPT-2, Mistral, MiniLM."""

from __future__ import annotations

import warnings

import pytest
import torch

import sv_attention
from sv_attention.errors import UnsupportedFeatureError

from . import tiny

FACTORIES = {"llama": tiny.llama, "qwen2": tiny.qwen2_sliding, "gpt2": tiny.gpt2, "mistral": tiny.mistral}
IDS = torch.randint(1, 97, (2, 14), generator=torch.Generator().manual_seed(1))


def full_logits(m, ids=IDS, **kw):
    with torch.no_grad():
        return m(ids, **kw).logits


@pytest.fixture(scope="module", params=list(FACTORIES))
def model(request):
    return FACTORIES[request.param]()


def test_ceq_alpha_zero_bitwise_sdpa_and_alpha_positive_differs(model):
    sv_attention.enable(model, "sdpa")
    ref = full_logits(model)
    sv_attention.enable(model, "ceq", path_weight=0.0)
    assert torch.equal(full_logits(model), ref)
    sv_attention.enable(model, "ceq", path_weight=0.1)
    assert (full_logits(model) - ref).abs().max() > 1e-3


@pytest.mark.parametrize("name,kw", [("sv_attention", {"nu": 0.5, "chunk": 4}), ("ceq", {"path_weight": 0.2})])
def test_prefill_equals_token_by_token_decode(model, name, kw):
    sv_attention.enable(model, name, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the sliding-window notice on Qwen2
        full = full_logits(model)
        step = tiny.step_logits(model, IDS, 3)  # decode crosses the boundaries 4, 8 and 12
    assert (step - full).abs().max() <= 1e-5


def test_gate_active_on_llama_and_past_key_values_spelling():
    m = tiny.llama()
    ref = full_logits(m)
    sv_attention.enable(m, "sv_attention", nu=0.5, chunk=8)
    full = full_logits(m)
    assert torch.allclose(full[:, :8], ref[:, :8], atol=1e-5)  # chunk 0: plain causal softmax
    assert (full[:, 8:] - ref[:, 8:]).abs().max() > 1e-3  # gated prefix from the first boundary on
    step = tiny.step_logits(m, IDS, 6)  # crosses the boundary 8 while decoding
    assert (step - full).abs().max() <= 1e-5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        step = tiny.step_logits(m, IDS, 6, spelling="past_key_values")
    assert (step - full).abs().max() <= 1e-5


@pytest.mark.parametrize("name,kw", [("sv_attention", {"nu": 0.5, "chunk": 4}), ("ceq", {"path_weight": 0.3})])
def test_left_padded_batch_generation_equals_per_sequence(model, name, kw):
    sv_attention.enable(model, name, **kw)
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(1, 97, (1, 9), generator=g), torch.randint(1, 97, (1, 6), generator=g)
    batch = torch.cat([a, torch.cat([torch.zeros(1, 3, dtype=torch.long), b], 1)], 0)
    am = torch.ones_like(batch)
    am[1, :3] = 0
    gk = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        both = model.generate(batch, attention_mask=am, **gk)
        one_a, one_b = model.generate(a, **gk), model.generate(b, **gk)
    assert torch.equal(both[0, 9:], one_a[0, 9:])
    assert torch.equal(both[1, 9:], one_b[0, 6:])


def test_qwen2_sliding_layer_honoured_and_refusable():
    m = tiny.qwen2_sliding()
    ids = IDS[:, :14]
    eager = tiny.qwen2_sliding()
    eager.set_attn_implementation("eager")
    ref = full_logits(eager, ids)
    sv_attention.enable(m, "sv_attention", gated=False)
    assert torch.allclose(full_logits(m, ids), ref, atol=1e-5)  # the window reaches the function
    with pytest.raises(UnsupportedFeatureError, match=r"model\.layers\.1\.self_attn: this layer uses a sliding window"):
        sv_attention.enable(m, "sv_attention", nu=0.5, chunk=4, sliding_window="refuse")  # refused at switch time


def test_output_attentions_returns_weights():
    m = tiny.llama()
    sv_attention.enable(m, "sv_attention", nu=0.5, chunk=4)
    with torch.no_grad():
        out = m(IDS[:, :10], output_attentions=True)
    w = out.attentions[0]
    assert w.shape == (2, 4, 10, 10)
    assert torch.allclose(w.sum(-1), torch.ones(2, 4, 10), atol=1e-5)


def test_minilm_encoder():
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(tiny.minilm_path()))
    enc = tok(["support vectors gate the attention of this encoder over a long enough sentence here",
               "short one"], padding=True, return_tensors="pt")
    m = tiny.minilm("eager")
    with torch.no_grad():
        ref = m(**enc).last_hidden_state
        sv_attention.enable(m, "sv_attention", gated=False)
        off = m(**enc).last_hidden_state
        sv_attention.enable(m, "sv_attention", nu=0.5, chunk=4)
        on = m(**enc).last_hidden_state
    assert (off - ref).abs().max() <= 1e-5
    real = enc["attention_mask"].bool()
    assert torch.isfinite(on).all()
    assert (on[real] - ref[real]).abs().max() > 1e-4  # the gate is active on the long sentence
    with pytest.raises(UnsupportedFeatureError, match=r"encoder\.layer\.0\.attention\.self: ceq hops are causal"):
        sv_attention.enable(m, "ceq", path_weight=0.1)  # refused at switch time, with the module's path
    assert m.config._attn_implementation == "sv_attention"


def test_static_cache_sv_works_and_ceq_hops_refuse():
    from transformers import StaticCache

    m = tiny.llama()
    sv_attention.enable(m, "sv_attention", nu=0.5, chunk=4)
    full = full_logits(m, IDS[:, :10])
    cache = StaticCache(config=m.config, max_cache_len=16)
    with torch.no_grad():
        first = m(IDS[:, :6], cache=cache, use_cache=True).logits
        nxt = [m(IDS[:, t:t + 1], cache=cache, use_cache=True).logits for t in range(6, 10)]
    assert (torch.cat([first, *nxt], 1) - full).abs().max() <= 1e-5
    sv_attention.enable(m, "ceq", path_weight=0.2)
    with pytest.raises(UnsupportedFeatureError, match="static"), torch.no_grad():
        m(IDS[:, :6], cache=StaticCache(config=m.config, max_cache_len=16), use_cache=True)


@pytest.mark.parametrize("name,kw", [("sv_attention", {"nu": 0.5, "chunk": 4}), ("ceq", {"path_weight": 0.2})])
def test_generate_with_a_user_cache_under_both_spellings(name, kw):
    from transformers import DynamicCache

    m = tiny.llama()
    sv_attention.enable(m, name, **kw)
    gk = dict(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    ids = IDS[:1, :7]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        plain = m.generate(ids, **gk)
        ca, cb = DynamicCache(config=m.config), DynamicCache(config=m.config)
        a = m.generate(ids, cache=ca, **gk)
        b = m.generate(ids, past_key_values=cb, **gk)
    assert torch.equal(a, plain) and torch.equal(b, plain)
    assert ca.get_seq_length() == cb.get_seq_length() == 11  # the caller's cache was the one used
