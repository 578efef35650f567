import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sv_attention.errors import InvalidInputError, TrainingDivergedError
from sv_attention.train.checkpoint import latest_checkpoint, read_trainer_state
from sv_attention.train.config import TrainConfig
from sv_attention.train.loop import eval_windows, evaluate_bpb, sample_batch, train
from sv_attention.train.model import build_model, load_pretrained

HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SV_ATTENTION_CACHE", str(tmp_path_factory.getbasetemp() / "corpus-cache"))


def tiny(run_dir, **kw) -> TrainConfig:
    base = dict(run_dir=str(run_dir), operator="softmax", hidden_size=32, num_layers=1, num_heads=2, block_size=32,
                steps=6, batch_size=4, warmup_steps=2, eval_every=3, eval_bytes=512, eval_batch_size=8,
                log_every=1, embedded_bytes=40_000, cpu=True, lr=3e-3)
    base.update(kw)
    return TrainConfig(**base)


def test_sample_batch_is_deterministic_windows():
    data = torch.arange(200, dtype=torch.uint8)
    a = sample_batch(data, 5, 4, 16, seed=1)
    assert torch.equal(a, sample_batch(data, 5, 4, 16, seed=1))
    assert not torch.equal(a, sample_batch(data, 6, 4, 16, seed=1))
    assert a.shape == (4, 17) and a.dtype == torch.int64
    for row in a:  # contiguous windows of the data
        assert torch.equal(row, data[int(row[0]):int(row[0]) + 17].long())


def test_eval_windows_cover_each_byte_once():
    val = torch.arange(100, dtype=torch.uint8)
    w = eval_windows(val, 10, 10_000)
    assert w.shape == (9, 11)
    targets = w[:, 1:].reshape(-1)
    assert torch.equal(targets, torch.arange(1, 91))  # every predicted byte exactly once, in order
    assert eval_windows(val, 10, 30).shape == (3, 11)
    with pytest.raises(InvalidInputError):
        eval_windows(val[:5], 10, 100)


def test_evaluate_bpb_matches_reference(tmp_path):
    model = build_model(tiny(tmp_path))
    windows = torch.randint(0, 256, (5, 33), generator=torch.Generator().manual_seed(0))
    got = evaluate_bpb(model, windows, batch_size=2)
    nats, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            logp = torch.log_softmax(model(input_ids=w[None, :-1]).logits[0].double(), -1)
            nats -= logp[torch.arange(32), w[1:]].sum().item()
            count += 32
    assert got == pytest.approx(nats / count / math.log(2), rel=1e-5)


def test_training_learns_logs_and_checkpoints(tmp_path):
    cfg = tiny(tmp_path / "run", steps=12, eval_every=6)
    res = train(cfg, progress=False)
    evals = [e for e in res.history if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [6, 12]
    assert evals[1]["val_bpb"] < evals[0]["val_bpb"] < 8.0  # uniform over bytes is 8 bits
    lines = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert lines == res.history
    again = train(cfg, progress=False)  # a fresh run into the same folder starts a fresh log
    assert [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()] == again.history
    assert sum(e["event"] == "start" for e in again.history) == 1 and again.val_bpb == res.val_bpb
    train_ev = [e for e in lines if e["event"] == "train"]
    assert [e["step"] for e in train_ev] == list(range(1, 13))
    assert all(e["grad_norm"] > 0 and e["tokens_per_s"] > 0 for e in train_ev)
    summary = json.loads((tmp_path / "run" / "run.json").read_text())
    assert summary["data"]["validation"]["start"] == summary["data"]["train"]["end"]
    assert summary["val_bpb"] == res.val_bpb and summary["steps"] == 12
    ckpt = latest_checkpoint(tmp_path / "run")
    assert ckpt == res.checkpoint and read_trainer_state(ckpt)["step"] == 12
    assert read_trainer_state(ckpt)["data"] == summary["data"]  # the hold-out is recorded with the weights
    reloaded = load_pretrained(cfg, ckpt)
    windows = eval_windows(torch.arange(300, dtype=torch.uint8) % 97, 32, 256)
    ref = evaluate_bpb(build_model(cfg), windows, 8)
    assert evaluate_bpb(reloaded, windows, 8) != pytest.approx(ref)  # weights changed from init


def test_resume_continues_identically(tmp_path):
    full = train(tiny(tmp_path / "a", save_every=3, keep_checkpoints=3), progress=False)
    # a run interrupted after step 3: only its step-3 checkpoint exists
    b = tmp_path / "b" / "checkpoints"
    b.mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step_000003", b / "step_000003")
    (b / "LAST").write_text("step_000003\n")
    lines = (tmp_path / "a" / "log.jsonl").read_text().splitlines()
    (tmp_path / "b" / "log.jsonl").write_text("\n".join(lines[:5]) + "\n")  # start + 3 train + 1 eval
    resumed = train(tiny(tmp_path / "b"), resume=True, progress=False)
    assert resumed.summary["resumed_from_step"] == 3
    ma = load_pretrained(tiny(tmp_path), full.checkpoint).state_dict()
    mb = load_pretrained(tiny(tmp_path), resumed.checkpoint).state_dict()
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    assert resumed.val_bpb == full.val_bpb

    def strip(history):
        return [{k: v for k, v in e.items() if k != "tokens_per_s"} for e in history if e["event"] != "start"]

    assert strip(resumed.history) == strip(full.history)  # the log continues exactly as well
    again = train(tiny(tmp_path / "b"), resume=True, progress=False)  # complete: returns the finished record
    assert again.summary == resumed.summary and again.checkpoint == resumed.checkpoint


def test_resume_refuses_a_different_config(tmp_path):
    train(tiny(tmp_path / "r", steps=3, warmup_steps=1, eval_every=3), progress=False)
    with pytest.raises(InvalidInputError, match="hidden_size"):
        train(tiny(tmp_path / "r", hidden_size=64, steps=3, warmup_steps=1), resume=True, progress=False)


def test_divergence_is_a_typed_error(tmp_path):
    with pytest.raises(TrainingDivergedError, match="lower --lr"):
        train(tiny(tmp_path / "nan", lr=1e12, warmup_steps=0, grad_clip=1e30), progress=False)
    assert latest_checkpoint(tmp_path / "nan") is None


def test_any_transformers_causal_lm(tmp_path):
    res = train(tiny(tmp_path / "g", model_family="gpt2", steps=3, warmup_steps=1, eval_every=3), progress=False)
    assert math.isfinite(res.val_bpb) and res.summary["parameters"]["total"] > 0


def test_two_processes_match_one_process(tmp_path):
    """torchrun --nproc_per_node 2 (CPU, gloo) on the same global batch reproduces the 1-process run."""
    one = train(tiny(tmp_path / "one", steps=4, eval_every=4), progress=False)
    cfg2 = tiny(tmp_path / "two", steps=4, eval_every=4)
    cfg2.save(tmp_path / "cfg2.json")
    out = tmp_path / "two.json"
    env_cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(HERE / "_ddp_train.py"), str(tmp_path / "cfg2.json"), str(out)]
    proc = subprocess.run(env_cmd, capture_output=True, text=True, timeout=240,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads(out.read_text())
    assert two["processes"] == 2
    losses_one = [e["loss"] for e in one.history if e["event"] == "train"]
    assert two["losses"] == pytest.approx(losses_one, rel=2e-4)
    assert two["val_bpb"] == pytest.approx(one.val_bpb, rel=2e-4)
