"""The training configuration: one dataclass, saved with every run and checkpoint."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from sv_attention.errors import ConfigError, InvalidHyperparameterError

MODEL_FAMILIES = ("sv", "gpt2")


@dataclass
class TrainConfig:
    """Everything that determines a training run (the run is a function of this and the code).

    Attributes
    ----------
    run_dir : str
        Where checkpoints, ``log.jsonl`` and ``run.json`` go.
    dataset, dataset_config, dataset_split, text_column : str
        See :func:`sv_attention.data.load_corpus`.
    embedded_bytes : int
        Size of the embedded corpus.
    max_bytes : int or None
        Truncate the corpus to this many bytes.
    val_fraction : float
        Contiguous tail held out for validation.
    model_family : str
        ``"sv"`` (the repository's :class:`SVForCausalLM`, any operator) or ``"gpt2"`` (a stock transformers
        GPT-2 of the same size: a reference that the loop works with any causal LM).
    operator : str
        ``SVConfig.operator`` (``sv``, ``softmax``, ``swa``, ``ceq``, ``ceq_path_sum``, ``smprime``).
    operator_config : dict
        The operator's knobs (validated by ``SVConfig``).
    hidden_size, num_layers, num_heads, block_size : int
        Model size; ``block_size`` is the context length (and the positional-embedding table size).
    dropout : float
    steps : int
        Total optimiser steps.
    batch_size : int
        Global batch (sequences per step, summed over processes; must divide by the process count).
    lr, min_lr_ratio, warmup_steps : float, float, int
        Peak learning rate, final learning rate as a fraction of it (cosine decay), linear warm-up steps.
    weight_decay, beta1, beta2, grad_clip : float
        AdamW (decay on matrices only) and global gradient-norm clipping.
    eval_every, eval_bytes, eval_batch_size : int
        Evaluate validation bits-per-byte every ``eval_every`` steps (and at the end) on the first
        ``eval_bytes`` bytes of the validation split, in non-overlapping windows.
    log_every : int
        Write a training event to ``log.jsonl`` every ``log_every`` steps.
    save_every : int
        Checkpoint every ``save_every`` steps (0: only at the end). ``keep_checkpoints`` newest are kept.
    seed : int
        Initialisation, batch sampling and dropout seed (the corpus seed is ``data_seed``).
    cpu : bool
        Force the CPU even when an accelerator is present.
    """

    run_dir: str = "runs/train"
    dataset: str = "embedded"
    dataset_config: str | None = None
    dataset_split: str = "train"
    text_column: str = "text"
    embedded_bytes: int = 4_000_000
    data_seed: int = 0
    max_bytes: int | None = None
    val_fraction: float = 0.05
    model_family: str = "sv"
    operator: str = "sv"
    operator_config: dict[str, Any] = field(default_factory=dict)
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    block_size: int = 128
    dropout: float = 0.0
    steps: int = 300
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_bytes: int = 65_536
    eval_batch_size: int = 16
    log_every: int = 10
    save_every: int = 0
    keep_checkpoints: int = 2
    seed: int = 0
    cpu: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise a typed error for any out-of-range field."""
        if self.model_family not in MODEL_FAMILIES:
            raise ConfigError(f"model_family must be one of {list(MODEL_FAMILIES)}, got {self.model_family!r}")
        if not isinstance(self.operator_config, dict):
            raise ConfigError(f"operator_config must be a dict, got {type(self.operator_config).__name__}")
        positive = ("hidden_size", "num_layers", "num_heads", "steps", "batch_size", "eval_batch_size",
                    "eval_every", "log_every", "eval_bytes", "keep_checkpoints", "embedded_bytes")
        for name in positive:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidHyperparameterError(f"{name} must be a positive integer, got {v!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 2:
            raise InvalidHyperparameterError(f"block_size must be an integer >= 2, got {self.block_size!r}")
        for name in ("warmup_steps", "save_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidHyperparameterError(f"{name} must be a non-negative integer, got {v!r}")
        if self.warmup_steps >= self.steps and self.steps > 1:
            raise InvalidHyperparameterError(
                f"warmup_steps ({self.warmup_steps}) must be smaller than steps ({self.steps})")
        if not (self.lr > 0):
            raise InvalidHyperparameterError(f"lr must be > 0, got {self.lr}")
        if not (0.0 <= self.min_lr_ratio <= 1.0):
            raise InvalidHyperparameterError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not (0.0 <= self.weight_decay):
            raise InvalidHyperparameterError(f"weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            if not (0.0 <= v < 1.0):
                raise InvalidHyperparameterError(f"{name} must be in [0, 1), got {v}")
        if not (self.grad_clip > 0):
            raise InvalidHyperparameterError(f"grad_clip must be > 0, got {self.grad_clip}")
        if not (0.0 <= self.dropout < 1.0):
            raise InvalidHyperparameterError(f"dropout must be in [0, 1), got {self.dropout}")
        if not (0.0 < self.val_fraction <= 0.5):
            raise InvalidHyperparameterError(f"val_fraction must be in (0, 0.5], got {self.val_fraction}")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown TrainConfig keys {unknown}; valid keys: {sorted(known)}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> TrainConfig:
        return cls.from_json(json.loads(Path(path).read_text()))
