"""Switch-time refusals (sv_attention.check, enable, set_attn_implementation) with the module's path;
a refused switch leaves every config as it was."""

from __future__ import annotations

import pytest
import torch

import sv_attention
from sv_attention.errors import ConfigError, UnsupportedFeatureError

from . import tiny

IDS = torch.randint(1, 97, (1, 10), generator=torch.Generator().manual_seed(3))


def _impls(model):
    return [c._attn_implementation for c in (model.config, *[getattr(model.config, k) for k in model.config.sub_configs
                                                               if getattr(model.config, k, None) is not None])]


@pytest.mark.parametrize("factory,impl,kw,needle,path", [
    (tiny.gemma2, "sv_attention", {}, "softcapping", "model.layers.0.self_attn"),
    (tiny.t5, "sv_attention", {}, "position_bias", "encoder.block.0.layer.0.SelfAttention"),
    (tiny.bart, "ceq", {"path_weight": 0.1}, "not causal", "model.encoder.layers.0.self_attn"),
    (tiny.distilbert, "ceq", {"path_weight": 0.1}, "not causal", "distilbert.transformer.layer.0.attention"),
    (tiny.vit, "ceq", {"path_weight": 0.1}, "not causal", "layers.0.attention"),
    (tiny.whisper, "ceq", {"path_weight": 0.1}, "not causal", "model.encoder.layers.0.self_attn"),
    (tiny.falcon, "sv_attention", {}, "does not call AttentionInterface", "FalconForCausalLM"),
])
def test_refused_at_switch_time_with_the_module_path_and_config_unchanged(factory, impl, kw, needle, path):
    m = factory()
    before = _impls(m)
    problems = sv_attention.check(m, impl, **kw)
    assert problems and any(p.startswith(path + ":") and needle in p for p in problems), problems
    assert not any("layer None" in p for p in problems)
    with pytest.raises(UnsupportedFeatureError, match=needle) as e:
        sv_attention.enable(m, impl, **kw)
    assert path in str(e.value)
    assert _impls(m) == before  # nothing switched
    assert getattr(m.config, impl, None) is None  # no hyperparameters written
    if not kw:  # the plain route refuses too, before anything changes
        with pytest.raises(UnsupportedFeatureError, match=needle):
            m.set_attn_implementation(impl)
        assert _impls(m) == before


def test_check_passes_compatible_models_and_alpha_zero_encoders():
    assert sv_attention.check(tiny.llama(), "sv_attention") == []
    assert sv_attention.check(tiny.llama(), "ceq", path_weight=0.3) == []
    assert sv_attention.check(tiny.bart(), "ceq", path_weight=0.0) == []
    assert sv_attention.check(tiny.bart(), "sv_attention") == []
    with pytest.raises(ConfigError):
        sv_attention.check(tiny.llama(), "ceq", no_such_key=1)


def test_plain_set_attn_implementation_checks_stored_settings():
    m = tiny.bart()
    m.config.ceq = {"path_weight": 0.2}
    with pytest.raises(UnsupportedFeatureError, match="model.decoder.layers.0.encoder_attn"):
        m.set_attn_implementation("ceq")
    assert m.config._attn_implementation == "sdpa"


def test_from_config_route_refuses_at_first_call_with_the_path():
    from transformers import AutoModelForCausalLM

    cfg = tiny.gemma2().config
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation="sv_attention").eval()
    with pytest.raises(UnsupportedFeatureError, match=r"model\.layers\.0\.self_attn: attention-logit softcapping"):
        with torch.no_grad():
            m(IDS)


def test_falcon_switch_refused_and_config_untouched():
    m = tiny.falcon()
    with pytest.raises(UnsupportedFeatureError, match="keep 'eager' or 'sdpa'"):
        sv_attention.enable(m, "ceq", path_weight=0.1)
    assert m.config._attn_implementation == "sdpa"
    assert getattr(m.config, "ceq", None) is None
    with pytest.raises(ConfigError, match=r"from_pretrained\(\.\.\., attn_implementation='eager'\)"):
        sv_attention.enable(m, "eager")  # a correct instruction for the built-in names too
    assert m.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("impl", ["sv_attention", "ceq"])
def test_falcon_from_pretrained_refused_with_the_check_verdict_and_config_untouched(impl, tmp_path):
    """Building Falcon with a registered name fails with our typed error (not transformers' bare KeyError from
    its fixed attention table), with the very sentence check() and enable() give, before any layer is built."""
    from transformers import AutoModelForCausalLM, FalconConfig, FalconForCausalLM

    m = tiny.falcon()
    m.save_pretrained(tmp_path)
    (verdict,) = sv_attention.check(m, impl)
    sentence = verdict.split(": ", 1)[1]
    with pytest.raises(UnsupportedFeatureError) as switched:
        sv_attention.enable(m, impl)
    assert sentence in str(switched.value)
    with pytest.raises(UnsupportedFeatureError) as built:
        FalconForCausalLM.from_pretrained(tmp_path, attn_implementation=impl)
    assert not isinstance(built.value, KeyError)
    assert sentence in str(built.value) and "keep 'eager' or 'sdpa'" in str(built.value)
    cfg = FalconConfig.from_pretrained(tmp_path)
    before = cfg._attn_implementation
    for build in (lambda: FalconForCausalLM.from_pretrained(tmp_path, config=cfg, attn_implementation=impl),
                  lambda: AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=impl),
                  lambda: AutoModelForCausalLM.from_config(cfg, attn_implementation=impl)):
        with pytest.raises(UnsupportedFeatureError, match="cannot be built with"):
            build()
        assert cfg._attn_implementation == before  # from_config writes into the caller's config: put back
    loaded = FalconForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")  # other names untouched
    assert loaded.config._attn_implementation == "eager"
    with torch.no_grad():
        assert torch.allclose(loaded(IDS).logits, m(IDS).logits, atol=1e-5)


def test_from_pretrained_with_sv_attention_still_builds_a_model_that_calls_it(tmp_path):
    from transformers import AutoModelForCausalLM

    from sv_attention.hf.attention import STATE_ATTR

    m = tiny.llama()
    m.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sv_attention").eval()
    assert loaded.config._attn_implementation == "sv_attention"
    sv_attention.enable(m, "sv_attention")
    with torch.no_grad():
        assert torch.allclose(loaded(IDS).logits, m(IDS).logits, atol=1e-5)
    assert all(STATE_ATTR in layer.self_attn.__dict__ for layer in loaded.model.layers)  # its layers ran sv_attention
