"""Build the model a :class:`~sv_attention.train.config.TrainConfig` describes.

The repository's model lives in two remote-code files at the repository root (``configuration_sv.py``,
``modeling_sv.py``), not inside the package, because a Hub artifact must carry them as flat files. They
are imported as top-level modules ``configuration_sv`` / ``modeling_sv``: from ``sys.path`` when the
repository root is on it (tests, ``python -m`` from a checkout), otherwise from the file next to the
installed package (an editable install or a source checkout), registered under the same names so every
caller sees one class object.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from sv_attention.errors import ConfigError
from sv_attention.train.config import TrainConfig


def _candidate_dirs() -> list[Path]:
    pkg = Path(__file__).resolve().parent.parent  # sv_attention/
    return [pkg.parent, pkg / "artifact" / "template", pkg / "artifact" / "remote_code"]


def load_root_module(name: str) -> ModuleType:
    """Import a repository-root remote-code module (``configuration_sv`` or ``modeling_sv``).

    Raises
    ------
    ConfigError
        When the file cannot be found (a non-editable install without the model files).
    """
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.origin:
        return importlib.import_module(name)
    for d in _candidate_dirs():
        path = d / f"{name}.py"
        if path.is_file():
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
            return module
    raise ConfigError(
        f"cannot find {name}.py (looked on sys.path and in {[str(d) for d in _candidate_dirs()]}); "
        "install sv-attention from a source checkout (pip install -e .) or run from the repository root.")


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
