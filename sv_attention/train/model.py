"""Build the model a :class:`~sv_attention.train.config.TrainConfig` describes.

The repository's model lives in two remote-code files at the repository root (``configuration_sv.py``,
``modeling_sv.py``), not inside the package, because a Hub artifact must carry them as flat files. They
are imported as top-level modules ``configuration_sv`` / ``modeling_sv`` through
:func:`sv_attention.artifact.remote.load_module` (from ``sys.path`` when the repository root is on it,
otherwise from the source checkout next to the installed package), so every caller sees one class
object.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from sv_attention.errors import ConfigError
from sv_attention.train.config import TrainConfig


def load_root_module(name: str) -> ModuleType:
    """Import a repository-root remote-code module (``configuration_sv`` or ``modeling_sv``).

    One mechanism for the whole package: :func:`sv_attention.artifact.remote.load_module` (the exporter
    uses it too), so training and export see the same class objects.

    Raises
    ------
    ConfigError
        When the file cannot be found (a non-editable install without the model files).
    """
    from sv_attention.artifact.remote import load_module
    from sv_attention.errors import ArtifactError

    try:
        return load_module(name)
    except ArtifactError as exc:
        raise ConfigError(str(exc)) from exc


def sv_classes() -> tuple[type, type]:
    """``(SVConfig, SVForCausalLM)`` from the repository-root remote-code files."""
    cfg_mod = load_root_module("configuration_sv")
    model_mod = load_root_module("modeling_sv")
    return cfg_mod.SVConfig, model_mod.SVForCausalLM


def model_config(cfg: TrainConfig) -> Any:
    """The transformers config object for ``cfg`` (SVConfig or GPT2Config)."""
    if cfg.model_family == "sv":
        SVConfig, _ = sv_classes()
        return SVConfig(
            vocab_size=256, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads, max_position_embeddings=cfg.block_size, dropout=cfg.dropout,
            operator=cfg.operator, operator_config=dict(cfg.operator_config),
        )
    if cfg.model_family == "gpt2":
        from transformers import GPT2Config

        if cfg.operator_config:
            raise ConfigError("operator_config applies to model_family 'sv' only; remove it for 'gpt2'.")
        return GPT2Config(
            vocab_size=256, n_positions=cfg.block_size, n_embd=cfg.hidden_size, n_layer=cfg.num_layers,
            n_head=cfg.num_heads, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
            bos_token_id=None, eos_token_id=None,
        )
    raise ConfigError(f"unknown model_family {cfg.model_family!r}")


def build_model(cfg: TrainConfig) -> torch.nn.Module:
    """A freshly initialised causal LM for ``cfg`` (initialised from ``cfg.seed``, identically everywhere)."""
    config = model_config(cfg)
    torch.manual_seed(cfg.seed)
    if cfg.model_family == "sv":
        _, SVForCausalLM = sv_classes()
        return SVForCausalLM(config)
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel(config)


def load_pretrained(cfg: TrainConfig, directory: str | Path) -> torch.nn.Module:
    """Load a checkpoint's model (written by ``save_pretrained``) with the class ``cfg`` names."""
    if cfg.model_family == "sv":
        _, SVForCausalLM = sv_classes()
        return SVForCausalLM.from_pretrained(str(directory))
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(str(directory))
