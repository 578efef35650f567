"""``sv_attention.enable(model, name, **hyperparameters)``: switch a transformers model's attention.

Validates the hyperparameters first (typed errors, model untouched), writes them to ``config.NAME``
(a plain dict, so ``save_pretrained`` stores it in ``config.json``) and calls
``model.set_attn_implementation(NAME)``. ``enable(model, "sdpa")`` (or any built-in / registered name)
switches back; the stored hyperparameters are left in the config, unused.
"""

from __future__ import annotations

from typing import Any

import torch

from sv_attention.errors import ConfigError
from sv_attention.hf.attention import reset_state
from sv_attention.hf.registration import register_all
from sv_attention.hf.settings import IMPLEMENTATIONS, SETTINGS_CLASSES


def _configs(model: torch.nn.Module) -> list[Any]:
    from transformers import PretrainedConfig

    seen: dict[int, Any] = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if isinstance(cfg, PretrainedConfig):
            seen.setdefault(id(cfg), cfg)
    return list(seen.values())


def enable(model: torch.nn.Module, name: str, **hyperparameters: Any) -> torch.nn.Module:
    """Use attention implementation ``name`` on ``model`` (in place), with validated hyperparameters.

    Parameters
    ----------
    model : transformers.PreTrainedModel
    name : str
        ``"sv_attention"``, ``"ceq"``, or any name transformers accepts (``"sdpa"``, ``"eager"``, ...).
    **hyperparameters
        For ``"sv_attention"`` / ``"ceq"``: see :mod:`sv_attention.hf.settings` (every key, default and
        meaning). Missing keys take their defaults; the full resolved dict is written to
        ``config.sv_attention`` / ``config.ceq`` of every config in the model.

    Returns
    -------
    The same model.

    Raises
    ------
    ConfigError
        Unknown hyperparameter key, hyperparameters for a built-in implementation, an unknown
        implementation name, or a model that cannot switch its attention dynamically.
    InvalidHyperparameterError
        A value out of range or of the wrong type.

    Nothing on the model changes when an error is raised.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    register_all()
    if not isinstance(name, str):
        raise ConfigError(f"attention implementation name must be a string, got {type(name).__name__}")
    settings = None
    if name in IMPLEMENTATIONS:
        settings = SETTINGS_CLASSES[name].from_dict(dict(hyperparameters))
    else:
        if hyperparameters:
            raise ConfigError(f"hyperparameters {sorted(hyperparameters)} only apply to {list(IMPLEMENTATIONS)}, "
                              f"not to {name!r}")
        if name not in ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]:
            raise ConfigError(f"unknown attention implementation {name!r}; choose 'eager' or one of "
                              f"{sorted(ALL_ATTENTION_FUNCTIONS.valid_keys())}")
    if not hasattr(model, "set_attn_implementation"):
        raise ConfigError(f"{type(model).__name__} is not a transformers PreTrainedModel (no set_attn_implementation)")
    try:
        model.set_attn_implementation(name)
    except (ValueError, ImportError) as e:
        raise ConfigError(f"transformers refused attn_implementation={name!r} for {type(model).__name__}: {e}") from e
    if model.config._attn_implementation != name:
        raise ConfigError(
            f"{type(model).__name__} did not switch to {name!r} (it stays on "
            f"{model.config._attn_implementation!r}): its modeling code does not look up AttentionInterface "
            "dynamically; load it with from_pretrained(..., attn_implementation=name) instead")
    if settings is not None:
        for cfg in _configs(model):
            setattr(cfg, name, settings.to_dict())
    reset_state(model)
    return model
