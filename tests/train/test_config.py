import pytest

from sv_attention.errors import ConfigError, InvalidHyperparameterError
from sv_attention.train.config import TrainConfig


def test_round_trip(tmp_path):
    cfg = TrainConfig(operator="swa", operator_config={"window": 16}, steps=7, warmup_steps=2)
    cfg.save(tmp_path / "c.json")
    assert TrainConfig.load(tmp_path / "c.json") == cfg


@pytest.mark.parametrize("kw,err,msg", [
    ({"model_family": "bert"}, ConfigError, "model_family"),
    ({"steps": 0}, InvalidHyperparameterError, "steps"),
    ({"lr": -1.0}, InvalidHyperparameterError, "lr"),
    ({"warmup_steps": 10, "steps": 10}, InvalidHyperparameterError, "warmup_steps"),
    ({"hidden_size": 30, "num_heads": 4}, ConfigError, "divisible"),
    ({"val_fraction": 0.9}, InvalidHyperparameterError, "val_fraction"),
    ({"beta2": 1.0}, InvalidHyperparameterError, "beta2"),
    ({"block_size": 1}, InvalidHyperparameterError, "block_size"),
])
def test_bad_values_raise(kw, err, msg):
    with pytest.raises(err, match=msg):
        TrainConfig(**kw)


def test_unknown_key_raises():
    with pytest.raises(ConfigError, match="unknown TrainConfig keys"):
        TrainConfig.from_json({"stepz": 3})
