"""Checkpoints: a ``save_pretrained`` model folder plus the optimiser / scheduler state and a JSON record.

Layout (``run_dir/checkpoints/step_000300/``)::

    config.json, model.safetensors     the model, loadable with from_pretrained / sv-attention export
    training_state.pt                  optimiser and scheduler state dicts, step
    trainer_state.json                 step, train_config (TrainConfig), data (the recorded contiguous
                                       split with hashes), tokens_seen, parameters, metrics so far

``run_dir/checkpoints/LAST`` names the newest complete checkpoint (written after the folder is complete,
so an interrupted save never becomes the resume point).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from sv_attention.errors import InvalidInputError

CHECKPOINT_FORMAT = "sv-attention-checkpoint/1"
TRAINER_STATE = "trainer_state.json"
TRAINING_STATE = "training_state.pt"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def save_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any, record: dict[str, Any], keep: int = 2) -> Path:
    """Write a checkpoint for ``step`` and mark it as the newest; keep the ``keep`` newest ones.

    Checkpoints of later steps (left by an earlier run in the same folder) are removed.

    ``model`` must be the unwrapped model (``accelerator.unwrap_model``). Call on the main process only.
    """
    root = checkpoints_dir(run_dir)
    out = root / checkpoint_name(step)
    tmp = root / (checkpoint_name(step) + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step},
               tmp / TRAINING_STATE)
    (tmp / TRAINER_STATE).write_text(json.dumps({"format": CHECKPOINT_FORMAT, "step": step, **record}, indent=2)
                                     + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    (root / "LAST").write_text(out.name + "\n")
    existing = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_")
                      and not p.name.endswith(".partial"))
    # later steps than this one belong to an earlier run written into the same folder: stale
    stale = [p for p in existing if p.name > out.name]
    kept = [p for p in existing if p.name <= out.name]
    for old in stale + kept[:-keep]:
        shutil.rmtree(old)
    return out


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of ``run_dir``, or None."""
    root = checkpoints_dir(run_dir)
    last = root / "LAST"
    if not last.exists():
        return None
    path = root / last.read_text().strip()
    return path if (path / TRAINER_STATE).exists() else None


def read_trainer_state(checkpoint: str | Path) -> dict[str, Any]:
    """The JSON record of a checkpoint folder."""
    p = Path(checkpoint) / TRAINER_STATE
    if not p.exists():
        raise InvalidInputError(f"{checkpoint} is not a training checkpoint (no {TRAINER_STATE}).")
    return json.loads(p.read_text())


def load_training_state(checkpoint: str | Path) -> dict[str, Any]:
    """Optimiser / scheduler state dicts and step of a checkpoint folder."""
    return torch.load(Path(checkpoint) / TRAINING_STATE, map_location="cpu", weights_only=False)
