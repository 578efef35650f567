"""The training loop, on the ``accelerate`` API.

One process or many: ``torchrun --nproc_per_node N`` / ``accelerate launch`` start several, and an
``Accelerator`` inside picks them up. The global batch ``batch_size`` is fixed; each process takes its
``batch_size / N`` slice of the same sampled batch and gradients are averaged, so the optimiser sees the
same gradient (up to floating-point summation order) for any ``N``.

Determinism: the batch of step ``s`` is drawn from a generator seeded with ``(seed, s)``, and the global
torch seed is reset from ``(seed, s, rank)`` before each step (dropout), so a resumed run continues exactly
as the uninterrupted one would have.

Outputs under ``run_dir``: ``log.jsonl`` (one JSON event per line: ``train`` every ``log_every`` steps,
``eval`` every ``eval_every``), ``run.json`` (config, recorded data split, model size, metrics,
throughput, provenance), ``checkpoints/``.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from sv_attention.errors import InvalidInputError, TrainingDivergedError
from sv_attention.train.checkpoint import (
    latest_checkpoint,
    load_training_state,
    read_trainer_state,
    save_checkpoint,
)
from sv_attention.train.config import TrainConfig
from sv_attention.train.model import build_model, load_pretrained
from sv_attention.train.schedule import make_scheduler, param_groups

LN2 = math.log(2.0)
RESUME_FREE = frozenset({"run_dir", "keep_checkpoints", "save_every", "eval_every", "log_every", "cpu",
                         "eval_batch_size"})
"""TrainConfig fields that may differ between a checkpoint and the run resuming it (bookkeeping only)."""


@dataclass
class TrainResult:
    """What :func:`train` returns (also written to ``run_dir/run.json``).

    Attributes
    ----------
    run_dir : Path
    checkpoint : Path
        The final checkpoint (loadable with ``from_pretrained``; input of ``sv-attention export``).
    step : int
        Steps completed.
    val_bpb : float
        Validation bits-per-byte at the end.
    train_loss : float
        Mean training loss (nats/byte) over the last ``log_every`` steps.
    tokens_per_s : float
        Training throughput (bytes per second, all processes), forward + backward + update only.
    history : list of dict
        The events written to ``log.jsonl``.
    summary : dict
        The content of ``run.json``.
    """

    run_dir: Path
    checkpoint: Path
    step: int
    val_bpb: float
    train_loss: float
    tokens_per_s: float
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_run_dir(cls, run_dir: str | Path) -> TrainResult:
        """Rebuild the result of a finished run from its ``run.json`` and ``log.jsonl``."""
        run_dir = Path(run_dir)
        if not (run_dir / "run.json").is_file():
            raise InvalidInputError(f"{run_dir} holds no run.json: the run did not finish (resume it with --resume).")
        s = json.loads((run_dir / "run.json").read_text())
        history = _read_log(run_dir / "log.jsonl", int(s["steps"]))
        return cls(run_dir=run_dir, checkpoint=Path(s["checkpoint"]), step=int(s["steps"]), val_bpb=float(s["val_bpb"]),
                   train_loss=float(s["train_loss"]), tokens_per_s=float(s["tokens_per_s"]), history=history, summary=s)


def sample_batch(train: torch.Tensor, step: int, batch_size: int, block_size: int, seed: int) -> torch.Tensor:
    """The global batch of step ``step``: ``[batch_size, block_size + 1]`` int64 windows of ``train``.

    ``train`` is the ``[n]`` uint8 training split; start offsets are uniform over all full windows and
    depend only on ``(seed, step)``.
    """
    n_windows = train.numel() - block_size
    if n_windows < 1:
        raise InvalidInputError(f"training split ({train.numel()} bytes) is shorter than block_size + 1.")
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(step))
    starts = torch.randint(0, n_windows, (batch_size,), generator=g)
    idx = starts[:, None] + torch.arange(block_size + 1)[None, :]
    return train[idx].long()


def eval_windows(validation: torch.Tensor, block_size: int, eval_bytes: int) -> torch.Tensor:
    """Non-overlapping ``[n_windows, block_size + 1]`` windows from the start of the validation split
    (windows overlap by one byte so every validation byte after the first is predicted exactly once),
    covering at most ``eval_bytes`` predicted bytes."""
    n = validation.numel()
    n_windows = min((n - 1) // block_size, max(eval_bytes // block_size, 1))
    if n_windows < 1:
        raise InvalidInputError(f"validation split ({n} bytes) is shorter than block_size + 1 ({block_size + 1}).")
    idx = torch.arange(n_windows)[:, None] * block_size + torch.arange(block_size + 1)[None, :]
    return validation[idx].long()


def _loss(model: torch.nn.Module, batch: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    x, y = batch[:, :-1], batch[:, 1:]
    logits = model(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction=reduction)


@torch.no_grad()
def evaluate_bpb(model: torch.nn.Module, windows: torch.Tensor, batch_size: int, accelerator: Any = None) -> float:
    """Validation bits-per-byte: total cross-entropy (nats) over all predicted bytes / count / ln 2.

    With an ``accelerator`` the windows are shared round-robin between processes and the sums reduced.
    """
    rank = accelerator.process_index if accelerator is not None else 0
    world = accelerator.num_processes if accelerator is not None else 1
    device = accelerator.device if accelerator is not None else torch.device("cpu")
    was_training = model.training
    model.eval()
    mine = windows[rank::world]
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    for i in range(0, mine.shape[0], batch_size):
        b = mine[i:i + batch_size].to(device)
        total += _loss(model, b, reduction="sum").double()
        count += b[:, 1:].numel()
    if accelerator is not None and world > 1:
        total = accelerator.reduce(total, reduction="sum")
        count = accelerator.reduce(count, reduction="sum")
    model.train(was_training)
    return float(total / count / LN2)


def _param_counts(model: torch.nn.Module) -> dict[str, int]:
    seen: set[int] = set()
    total = trainable = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return {"total": total, "trainable": trainable}


def _append_log(path: Path, event: dict[str, Any]) -> None:
    with path.open("a") as fh:
        fh.write(json.dumps(event) + "\n")


def _read_log(path: Path, up_to_step: int) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in events if e.get("step", 0) <= up_to_step]


def train(cfg: TrainConfig, resume: bool = False, progress: bool = True, accelerator: Any = None) -> TrainResult:
    """Train the model ``cfg`` describes; see the module docstring.

    Parameters
    ----------
    cfg : TrainConfig
    resume : bool
        Continue from the newest checkpoint in ``cfg.run_dir`` (its config must equal ``cfg`` except for
        ``steps``-independent bookkeeping; a mismatch raises). Without a checkpoint, starts fresh.
    progress : bool
        Show a tqdm bar (main process only) with loss and tokens/s.
    accelerator : accelerate.Accelerator, optional
        Reuse one; by default ``Accelerator(cpu=cfg.cpu)``.

    Returns
    -------
    TrainResult
    """
    from accelerate import Accelerator
    from tqdm.auto import tqdm

    from sv_attention.data import load_corpus, split_contiguous
    from sv_attention.results import provenance

    cfg.validate()
    acc = accelerator if accelerator is not None else Accelerator(cpu=cfg.cpu)
    world, rank = acc.num_processes, acc.process_index
    if cfg.batch_size % world:
        raise InvalidInputError(
            f"batch_size {cfg.batch_size} (global) does not divide by the {world} processes; use a multiple of {world}.")
    run_dir = Path(cfg.run_dir)
    log_path = run_dir / "log.jsonl"

    corpus = load_corpus(cfg.dataset, embedded_bytes=cfg.embedded_bytes, seed=cfg.data_seed,
                         dataset_config=cfg.dataset_config, dataset_split=cfg.dataset_split,
                         text_column=cfg.text_column, max_bytes=cfg.max_bytes)
    split = split_contiguous(corpus, cfg.val_fraction, min_val_bytes=cfg.block_size + 1)
    train_data = torch.from_numpy(np.array(split.train))
    windows = eval_windows(torch.from_numpy(np.array(split.validation)), cfg.block_size, cfg.eval_bytes)
    data_record = {**split.info, "eval": {"n_windows": int(windows.shape[0]), "block_size": cfg.block_size,
                                          "predicted_bytes": int(windows.shape[0] * cfg.block_size),
                                          "first_validation_byte": split.info["validation"]["start"]}}

    start_step = 0
    ckpt = latest_checkpoint(run_dir) if resume else None
    if ckpt is not None:
        state = read_trainer_state(ckpt)
        saved = TrainConfig.from_json(state["train_config"])
        diff = {k for k, v in saved.to_json().items() if cfg.to_json()[k] != v} - RESUME_FREE
        if diff == {"steps"}:
            warnings.warn(f"resuming {ckpt} with steps={cfg.steps} instead of {saved.steps}: the cosine schedule "
                          "changes from here on, so the run differs from an uninterrupted one.", stacklevel=2)
        elif diff:
            raise InvalidInputError(
                f"cannot resume {ckpt}: the config differs in {sorted(diff)}; use the saved config "
                f"({ckpt / 'trainer_state.json'}) or a new --run-dir.")
        if state["data"]["train"]["sha256"] != data_record["train"]["sha256"]:
            raise InvalidInputError(f"cannot resume {ckpt}: the training data differs from the checkpoint's.")
        if int(state["step"]) >= cfg.steps and (run_dir / "run.json").is_file():
            done = TrainResult.from_run_dir(run_dir)
            if done.step == int(state["step"]):
                return done  # already complete: nothing to train, the finished run's record is kept
        model = load_pretrained(cfg, ckpt)
        start_step = int(state["step"])
        resumed_losses = [float(v) for v in state.get("unlogged_losses", [])]
    else:
        model = build_model(cfg)
    model.train()
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr,
                                  betas=(cfg.beta1, cfg.beta2), eps=1e-8)
    scheduler = make_scheduler(optimizer, cfg.steps, cfg.warmup_steps, cfg.min_lr_ratio)
    if ckpt is not None:
        ts = load_training_state(ckpt)
        optimizer.load_state_dict(ts["optimizer"])
        scheduler.load_state_dict(ts["scheduler"])
    # The scheduler is stepped by hand (not passed to prepare): accelerate would step it once per process.
    model, optimizer = acc.prepare(model, optimizer)
    unwrapped = acc.unwrap_model(model)
    params = _param_counts(unwrapped)

    # a fresh run starts a fresh log; a resumed one keeps the events up to its checkpoint
    history = _read_log(log_path, start_step) if (acc.is_main_process and ckpt is not None) else []
    if acc.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        log_path.write_text("".join(json.dumps(e) + "\n" for e in history))
        cfg.save(run_dir / "train_config.json")
        if start_step == 0:
            ev = {"event": "start", "step": 0, "data": data_record, "parameters": params,
                  "processes": world, "device": str(acc.device)}
            history.append(ev)
            _append_log(log_path, ev)

    local_b = cfg.batch_size // world
    tokens_per_step = cfg.batch_size * cfg.block_size
    step_times: list[float] = []
    recent: list[float] = list(resumed_losses) if ckpt is not None else []
    last_eval: dict[str, Any] | None = next((e for e in reversed(history) if e["event"] == "eval"), None)
    bar = tqdm(total=cfg.steps, initial=start_step, disable=not (progress and acc.is_main_process),
               desc=f"train {cfg.operator if cfg.model_family == 'sv' else cfg.model_family}", unit="step",
               dynamic_ncols=True)
    step = start_step
    try:
        while step < cfg.steps:
            batch = sample_batch(train_data, step, cfg.batch_size, cfg.block_size, cfg.seed)
            mine = batch[rank * local_b:(rank + 1) * local_b].to(acc.device)
            torch.manual_seed(cfg.seed * 7919 + step * 104_729 + rank)
            t0 = time.perf_counter()
            loss = _loss(model, mine)
            acc.backward(loss)
            grad_norm = acc.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            mean_loss = float(acc.reduce(loss.detach(), reduction="mean")) if world > 1 else float(loss.detach())
            if not math.isfinite(mean_loss):
                raise TrainingDivergedError(
                    f"training loss became {mean_loss} at step {step + 1}; lower --lr (now {cfg.lr}) or raise "
                    f"--warmup-steps. Nothing was saved for this step.")
            step += 1
            if step > start_step + 1 or cfg.steps - start_step == 1:
                step_times.append(dt)
            recent.append(mean_loss)
            tps = tokens_per_step / dt
            bar.update(1)
            bar.set_postfix(loss=f"{mean_loss:.3f}", tok_s=f"{tps:,.0f}",
                            bpb=f"{last_eval['val_bpb']:.3f}" if last_eval else "-")
            if acc.is_main_process and (step % cfg.log_every == 0 or step == cfg.steps) and recent:
                ev = {"event": "train", "step": step, "loss": float(np.mean(recent)),
                      "bpb": float(np.mean(recent)) / LN2, "lr": scheduler.get_last_lr()[0],
                      "grad_norm": float(grad_norm), "tokens_per_s": tps, "tokens_seen": step * tokens_per_step}
                history.append(ev)
                _append_log(log_path, ev)
            if step % cfg.log_every == 0 or step == cfg.steps:
                recent = []
            if step % cfg.eval_every == 0 or step == cfg.steps:
                bpb = evaluate_bpb(model, windows, cfg.eval_batch_size, acc)
                last_eval = {"event": "eval", "step": step, "val_bpb": bpb, "tokens_seen": step * tokens_per_step}
                if acc.is_main_process:
                    history.append(last_eval)
                    _append_log(log_path, last_eval)
            if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps:
                acc.wait_for_everyone()
                if acc.is_main_process:
                    record = {"train_config": cfg.to_json(), "data": data_record, "parameters": params,
                              "tokens_seen": step * tokens_per_step,
                              "unlogged_losses": list(recent),
                              "metrics": {"val_bpb": last_eval["val_bpb"] if last_eval else None,
                                          "tokens_seen": step * tokens_per_step}}
                    save_checkpoint(run_dir, step, unwrapped, optimizer, scheduler, record, cfg.keep_checkpoints)
                acc.wait_for_everyone()
    finally:
        bar.close()

    train_events = [e for e in history if e["event"] == "train"]
    tokens_per_s = (tokens_per_step * len(step_times) / sum(step_times)) if step_times else float("nan")
    val_bpb = last_eval["val_bpb"] if last_eval else float("nan")
    final_ckpt = latest_checkpoint(run_dir) or run_dir
    summary = {
        "train_config": cfg.to_json(), "data": data_record, "parameters": params, "processes": world,
        "device": str(acc.device), "steps": step, "resumed_from_step": start_step or None,
        "tokens_seen": step * tokens_per_step, "val_bpb": val_bpb,
        "train_loss": train_events[-1]["loss"] if train_events else float("nan"),
        "tokens_per_s": tokens_per_s, "timed_steps": len(step_times),
        "checkpoint": str(final_ckpt), "provenance": provenance(),
    }
    if acc.is_main_process:
        (run_dir / "run.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return TrainResult(run_dir=run_dir, checkpoint=final_ckpt, step=step, val_bpb=val_bpb,
                       train_loss=summary["train_loss"], tokens_per_s=tokens_per_s, history=history,
                       summary=summary)
