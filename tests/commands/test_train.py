import json

import pytest

from sv_attention.cli import build_parser, main
from sv_attention.commands.train import config_from_args
from sv_attention.train.config import TrainConfig

TINY = ["--hidden-size", "32", "--layers", "1", "--heads", "2", "--block-size", "32", "--steps", "3",
        "--warmup-steps", "1", "--batch-size", "4", "--embedded-bytes", "40000", "--eval-bytes", "256",
        "--eval-every", "3", "--no-progress", "--cpu"]


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SV_ATTENTION_CACHE", str(tmp_path_factory.getbasetemp() / "corpus-cache"))


def _args(argv):
    return build_parser().parse_args(["train", *argv])


def test_flags_override_config_file_and_preset(tmp_path):
    TrainConfig(steps=50, lr=1e-3, warmup_steps=5).save(tmp_path / "c.json")
    cfg = config_from_args(_args(["--config", str(tmp_path / "c.json"), "--preset", "paper", "--steps", "7",
                                  "--operator", "sv", "--knob", "chunk=16", "--knob", "nu=0.25"]))
    assert cfg.steps == 7 and cfg.lr == 1e-3  # flag beats file; file kept where no flag
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.block_size) == (256, 4, 4, 256)
    assert cfg.operator == "sv" and cfg.operator_config == {"chunk": 16, "nu": 0.25}


def test_single_run_writes_summary(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["train", *TINY, "--operator", "softmax", "--run-dir", str(tmp_path / "run"), "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["steps"] == 3 and data["train_config"]["operator"] == "softmax"
    assert data["provenance"]["command"]
    assert "val bpb" in capsys.readouterr().out


def test_twins_write_comparison(tmp_path):
    out = tmp_path / "tw.json"
    rc = main(["train", *TINY, "--operators", "softmax", "swa", "--parallel", "--run-dir", str(tmp_path / "tw"), "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert set(data["val_bpb"]) == {"softmax", "swa"}
    assert data["operator_config"]["swa"] == {"window": 32}  # SV local window (chunk 64) capped at the block
    assert "NOT enwik8" in data["summary"]
    rows = {r["metric"]: r for r in data["table"]}  # the card's published-vs-ours rows
    swa = rows["validation bits-per-byte, matched-window SWA twin"]
    assert swa["published"] == 2.383 and swa["ours"] == data["val_bpb"]["swa"] and "not enwik8" in swa["note"]
    assert rows["validation bits-per-byte, softmax twin"]["published"] is None
    assert all(v > 0 for v in data["tokens_per_s_interleaved"].values())


def test_bad_knob_is_a_clean_error(tmp_path, capsys):
    rc = main(["train", *TINY, "--operator", "softmax", "--knob", "window=8", "--run-dir", str(tmp_path / "x")])
    assert rc == 2
    assert "does not belong to operator 'softmax'" in capsys.readouterr().err
