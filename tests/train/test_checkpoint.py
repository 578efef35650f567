import torch

from sv_attention.train.checkpoint import (
    latest_checkpoint,
    load_training_state,
    read_trainer_state,
    save_checkpoint,
)
from sv_attention.train.config import TrainConfig
from sv_attention.train.model import build_model
from sv_attention.train.schedule import make_scheduler


def _parts():
    model = build_model(TrainConfig(operator="softmax", hidden_size=16, num_layers=1, num_heads=2, block_size=8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, make_scheduler(opt, 10, 2, 0.1)


def test_keeps_newest_and_drops_stale_later_steps(tmp_path):
    model, opt, sched = _parts()
    for step in (4, 5, 6):  # an earlier, longer run
        save_checkpoint(tmp_path, step, model, opt, sched, {"note": "old"}, keep=3)
    out = save_checkpoint(tmp_path, 2, model, opt, sched, {"note": "new"}, keep=2)  # a fresh run, same folder
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir())
    assert names == ["step_000002"] and latest_checkpoint(tmp_path) == out
    state = read_trainer_state(out)
    assert state["step"] == 2 and state["note"] == "new" and state["format"].startswith("sv-attention-checkpoint")
    assert load_training_state(out)["step"] == 2
    for step in (3, 4, 5):
        save_checkpoint(tmp_path, step, model, opt, sched, {}, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir()) == ["step_000004", "step_000005"]


def test_no_checkpoint_is_none(tmp_path):
    assert latest_checkpoint(tmp_path) is None
