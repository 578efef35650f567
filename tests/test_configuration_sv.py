"""SVConfig: operator knobs validated with typed errors, defaults filled, version recorded and checked."""

from __future__ import annotations

import json

import pytest

import sv_attention
from configuration_sv import OPERATORS, SVConfig, check_version_compatible
from sv_attention.errors import ConfigError, InvalidHyperparameterError, VersionMismatchError


def test_defaults_and_version_recorded():
    c = SVConfig()
    assert c.model_type == "sv_lm"
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.max_position_embeddings) == (256, 4, 4, 256)
    assert c.intermediate_size == 1024 and c.vocab_size == 256 and c.tie_word_embeddings is True
    assert c.sv_attention_version == sv_attention.__version__
    assert c.operator == "softmax" and c.operator_config == {}


@pytest.mark.parametrize("op", OPERATORS)
def test_every_operator_builds_with_defaults(op):
    c = SVConfig(operator=op)
    assert c.operator == op
    assert isinstance(c.operator_config, dict)


def test_ceq_defaults_depend_on_gate():
    from sv_attention.ops.settings import CeqSettings

    cfg = SVConfig(operator="ceq").operator_config
    assert cfg == CeqSettings(form="hybrid").to_dict() and cfg["variant"] == "sgate"
    assert CeqSettings.from_dict(cfg).resolved() == {"variant": "sgate", "form": "hybrid", "path_weight": 0.05,
                                                     "rho": 1.5, "lam": 0.10, "hops": 2}
    with pytest.warns(FutureWarning, match="'gate' is renamed 'variant'"):
        old = SVConfig(operator="ceq_path_sum", operator_config={"gate": "signed"}).operator_config
    assert CeqSettings.from_dict(old).resolved()["hops"] == 3 and old["form"] == "path_sum"


@pytest.mark.parametrize("op, knobs, err, words", [
    ("attention", {}, ConfigError, "unknown operator"),
    ("softmax", {"window": 4}, ConfigError, "does not belong"),
    ("swa", {"chunk": 4}, ConfigError, "belongs to ['sv']"),
    ("ceq", {"variant": "signed", "lam": 0.1}, ConfigError, "sgate"),
    ("swa", {"window": 0}, InvalidHyperparameterError, ">= 1"),
    ("swa", {"window": 2.5}, InvalidHyperparameterError, "integer"),
    ("swa", {"window": True}, InvalidHyperparameterError, "integer"),
    ("sv", {"nu": 1.5}, InvalidHyperparameterError, "(0, 1]"),
    ("sv", {"sigma": -1.0}, InvalidHyperparameterError, "sigma"),
    ("ceq", {"rho": float("nan")}, InvalidHyperparameterError, "finite"),
    ("ceq", {"variant": "other"}, InvalidHyperparameterError, "one of"),
    ("ceq_path_sum", {"hops": 0}, InvalidHyperparameterError, "in [1, 16]"),
    ("smprime", {"beta_init": -1.0}, InvalidHyperparameterError, "beta_init"),
])
def test_bad_operator_settings_raise_typed_errors(op, knobs, err, words):
    with pytest.raises(err, match=None) as info:
        SVConfig(operator=op, operator_config=knobs)
    assert words in str(info.value)


def test_operator_config_must_be_a_dict():
    with pytest.raises(ConfigError, match="dict"):
        SVConfig(operator="swa", operator_config=[("window", 3)])


def test_backbone_errors():
    with pytest.raises(ConfigError, match="divisible"):
        SVConfig(hidden_size=30, num_attention_heads=4)
    with pytest.raises(InvalidHyperparameterError):
        SVConfig(num_hidden_layers=0)
    with pytest.raises(InvalidHyperparameterError):
        SVConfig(dropout=1.0)
    with pytest.raises(InvalidHyperparameterError, match="attention_bias must be true or false"):
        SVConfig(attention_bias="no")  # bool("no") would silently be True
    with pytest.raises(InvalidHyperparameterError, match="initializer_range"):
        SVConfig(initializer_range=-0.02)


def test_round_trip(tmp_path):
    c = SVConfig(operator="swa", operator_config={"window": 7}, hidden_size=32, num_attention_heads=2)
    c.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["sv_attention_version"] == sv_attention.__version__
    c2 = SVConfig.from_pretrained(tmp_path)
    assert c2.operator_config == {"window": 7} and c2.head_dim == 16


def test_incompatible_version_fails_naming_both(tmp_path):
    c = SVConfig(hidden_size=32, num_attention_heads=2)
    c.save_pretrained(tmp_path)
    p = tmp_path / "config.json"
    d = json.loads(p.read_text())
    d["sv_attention_version"] = "7.0.0"
    p.write_text(json.dumps(d))
    with pytest.raises(VersionMismatchError) as info:
        SVConfig.from_pretrained(tmp_path)
    msg = str(info.value)
    assert "7.0.0" in msg and sv_attention.__version__ in msg


def test_version_series_rule():
    check_version_compatible("0.1.0", "0.1.7")
    check_version_compatible("1.2.0", "1.9.1")
    for written, installed in (("0.2.0", "0.1.0"), ("1.0.0", "2.0.0"), ("0.1.0", "1.0.0")):
        with pytest.raises(VersionMismatchError):
            check_version_compatible(written, installed)


def test_sv_chunk_at_or_beyond_the_block_warns():
    with pytest.warns(UserWarning, match="never gates"):
        SVConfig(operator="sv", operator_config={"chunk": 64}, max_position_embeddings=64)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SVConfig(operator="sv", operator_config={"chunk": 32}, max_position_embeddings=64)
