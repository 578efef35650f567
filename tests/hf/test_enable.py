"""enable(): validated hyperparameters in config (saved by save_pretrained), switching both ways."""

from __future__ import annotations

import json

import pytest
import torch

import sv_attention
from sv_attention.errors import ConfigError, InvalidHyperparameterError
from sv_attention.hf.settings import CeqSettings, SVSettings

from .tiny import llama

IDS = torch.randint(1, 97, (1, 12), generator=torch.Generator().manual_seed(0))


def logits(m):
    with torch.no_grad():
        return m(IDS).logits


def test_enable_writes_config_and_switches_both_ways(tmp_path):
    m = llama()
    ref = logits(m)
    sv_attention.enable(m, "sv_attention", nu=0.3, chunk=4)
    assert m.config._attn_implementation == "sv_attention"
    assert m.config.sv_attention == SVSettings(nu=0.3, chunk=4).to_dict()
    assert m.model.layers[0].self_attn.config.sv_attention["chunk"] == 4  # what the module reads
    gated = logits(m)
    assert not torch.allclose(gated, ref, atol=1e-4)
    m.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["sv_attention"]["nu"] == 0.3 and saved["sv_attention"]["chunk"] == 4
    from transformers import AutoModelForCausalLM

    m2 = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sv_attention").eval()
    assert torch.allclose(logits(m2), gated, atol=1e-6)
    sv_attention.enable(m, "sdpa")
    assert m.config._attn_implementation == "sdpa"
    assert torch.equal(logits(m), ref)
    sv_attention.enable(m, "ceq", path_weight=0.05, variant="sgate", hops=2)
    assert m.config.ceq == CeqSettings(path_weight=0.05, hops=2).to_dict()
    assert not torch.allclose(logits(m), ref, atol=1e-5)


@pytest.mark.parametrize("name,kw,err", [
    ("sv_attention", {"nuu": 0.3}, ConfigError),
    ("sv_attention", {"nu": 1.5}, InvalidHyperparameterError),
    ("sv_attention", {"chunk": 0}, InvalidHyperparameterError),
    ("sv_attention", {"chunk": 2.5}, InvalidHyperparameterError),
    ("sv_attention", {"sigma": -1.0}, InvalidHyperparameterError),
    ("sv_attention", {"gated": "yes"}, InvalidHyperparameterError),
    ("sv_attention", {"C": 1e-20}, InvalidHyperparameterError),
    ("sv_attention", {"C": True}, InvalidHyperparameterError),
    ("sv_attention", {"gate": True, "gated": True}, ConfigError),
    ("sv_attention", {"sliding_window": "drop"}, InvalidHyperparameterError),
    ("ceq", {"path_weight": -0.1}, InvalidHyperparameterError),
    ("ceq", {"variant": "cosine"}, InvalidHyperparameterError),
    ("ceq", {"hops": 0}, InvalidHyperparameterError),
    ("ceq", {"variant": "signed", "lam": 0.1}, ConfigError),
    ("ceq", {"beta": 1.0}, ConfigError),
    ("sdpa", {"nu": 0.3}, ConfigError),
    ("no_such_attention", {}, ConfigError),
])
def test_bad_hyperparameters_raise_at_set_time_and_leave_model_unchanged(name, kw, err):
    m = llama()
    before = m.config.to_dict()
    with pytest.raises(err):
        sv_attention.enable(m, name, **kw)
    assert m.config.to_dict() == before
    assert m.config._attn_implementation == "sdpa"


def test_plain_transformers_route_uses_documented_defaults():
    m = llama()
    ref = logits(m)
    m.set_attn_implementation("sv_attention")
    assert not hasattr(m.config, "sv_attention")
    # defaults: chunk 64, so a 12-token input is all chunk 0 = plain causal softmax
    assert torch.allclose(logits(m), ref, atol=1e-5)
    m.set_attn_implementation("ceq")  # default alpha 0.05 changes the logits
    assert not torch.allclose(logits(m), ref, atol=1e-5)


def test_config_edited_by_hand_is_validated_at_call_time():
    m = llama()
    sv_attention.enable(m, "sv_attention")
    m.config.sv_attention = {"nu": 0.3, "bogus": 1}
    with pytest.raises(ConfigError, match="bogus"):
        logits(m)


def test_in_place_edit_of_the_stored_dict_is_revalidated():
    m = llama()
    sv_attention.enable(m, "ceq", path_weight=0.0)
    logits(m)  # parsed and cached
    m.config.ceq["path_weight"] = -1.0
    with pytest.raises(InvalidHyperparameterError, match="path_weight"):
        logits(m)


def test_renamed_keywords_warn_and_numpy_scalars_are_accepted():
    import numpy as np

    m = llama()
    with pytest.warns(FutureWarning) as record:
        sv_attention.enable(m, "ceq", alpha=0.1, operator="signed")
    messages = " ".join(str(w.message) for w in record)
    assert "'alpha' is renamed 'path_weight'" in messages and "'operator' is renamed 'variant'" in messages
    assert m.config.ceq["path_weight"] == 0.1 and m.config.ceq["variant"] == "signed"
    with pytest.warns(FutureWarning, match="'gate' is renamed 'gated'"):
        sv_attention.enable(m, "sv_attention", gate=False)
    assert m.config.sv_attention["gated"] is False
    sv_attention.enable(m, "sv_attention", nu=np.float32(0.25), chunk=np.int64(8))
    assert m.config.sv_attention["nu"] == 0.25 and m.config.sv_attention["chunk"] == 8
    assert type(m.config.sv_attention["chunk"]) is int
