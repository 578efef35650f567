import pytest
import torch

from sv_attention.errors import ConfigError, InvalidInputError
from sv_attention.train.config import TrainConfig
from sv_attention.train.loop import TrainResult
from sv_attention.train.model import build_model
from sv_attention.train.twins import measure_throughput, twin_config


def test_twins_share_everything_but_the_operator():
    base = TrainConfig(operator="sv", operator_config={"chunk": 16, "nu": 0.25}, block_size=64, steps=9,
                       warmup_steps=2)
    sm = twin_config(base, "softmax", "runs/x/softmax")
    swa = twin_config(base, "swa", "runs/x/swa")
    sv = twin_config(base, "sv", "runs/x/sv")
    assert sm.operator_config == {} and sv.operator_config == base.operator_config
    assert swa.operator_config == {"window": 16}  # matched to the SV local window (the chunk)
    for twin in (sm, swa, sv):
        diff = {k for k, v in twin.to_json().items() if base.to_json()[k] != v}
        assert diff <= {"operator", "operator_config", "run_dir"}
    local = TrainConfig(operator="sv", operator_config={"chunk": 16, "local_window": 24}, block_size=64)
    assert twin_config(local, "swa", "r").operator_config == {"window": 24}
    assert twin_config(TrainConfig(operator="sv", block_size=32), "swa", "r").operator_config == {"window": 32}
    with pytest.raises(ConfigError):
        twin_config(TrainConfig(model_family="gpt2"), "softmax", "r")


def test_interleaved_throughput_leaves_weights_unchanged():
    cfg = TrainConfig(operator="softmax", hidden_size=32, num_layers=1, num_heads=2, block_size=16)
    m = build_model(cfg)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    tps = measure_throughput({"a": m}, torch.randint(0, 256, (2, 17)), repeats=2)
    assert tps["a"] > 0
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert all(p.grad is None for p in m.parameters())


def test_unfinished_run_is_reported(tmp_path):
    with pytest.raises(InvalidInputError, match="did not finish"):
        TrainResult.from_run_dir(tmp_path)
