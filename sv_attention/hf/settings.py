"""Where the registered attention functions find their settings (the settings themselves, their
defaults and their validation live in :mod:`sv_attention.ops.settings`).

The hyperparameters of implementation ``NAME`` live in ``model.config.NAME`` as a plain ``dict`` (so
``save_pretrained`` writes them to ``config.json``): ``config.sv_attention`` for ``"sv_attention"`` and
``config.ceq`` for ``"ceq"``; :func:`sv_attention.enable` validates and writes them. A model of this
project (``model_type == "sv_lm"``) whose own operator is the implementation's twin (``sv`` for
``"sv_attention"``, ``ceq`` / ``ceq_path_sum`` for ``"ceq"``) and that holds no such dict uses its own
``config.operator_config``, so ``model.set_attn_implementation("sv_attention")`` computes what the model
computes. Anything else uses the defaults.

Settings are resolved once per attention module and re-validated only when the stored dict changes.
"""

from __future__ import annotations

from typing import Any

from sv_attention.ops.settings import (
    PLUGIN_SETTINGS,
    PLUGIN_TWINS,
    CeqSettings,
    OperatorSettings,
    SVSettings,
    model_operator_settings,
)

SV_NAME = "sv_attention"
CEQ_NAME = "ceq"
IMPLEMENTATIONS = (SV_NAME, CEQ_NAME)
SETTINGS_CLASSES = PLUGIN_SETTINGS
#: attribute of an attention module holding its resolved settings per implementation
SETTINGS_ATTR = "_sv_attention_settings"

__all__ = ["CEQ_NAME", "IMPLEMENTATIONS", "SETTINGS_CLASSES", "SV_NAME", "CeqSettings", "SVSettings",
           "module_settings", "settings_from_config", "twin_operator"]


def twin_operator(config: Any, name: str) -> str | None:
    """The model operator of an ``sv_lm`` ``config`` when it is the twin of implementation ``name``."""
    if config is None or getattr(config, "model_type", None) != "sv_lm":
        return None
    op = getattr(config, "operator", None)
    return op if op in PLUGIN_TWINS.get(name, ()) else None


def _source(config: Any, name: str) -> Any:
    values = getattr(config, name, None) if config is not None else None
    if values is not None:
        return values
    if twin_operator(config, name) is not None:
        return config.operator_config
    return None


def settings_from_config(config: Any, name: str) -> OperatorSettings:
    """The validated settings of implementation ``name`` for ``config`` (see the module docstring).

    Raises
    ------
    ConfigError, InvalidHyperparameterError
        The stored dict holds an unknown key or an invalid value.
    """
    values = _source(config, name)
    if values is None or getattr(config, name, None) is not None:
        return PLUGIN_SETTINGS[name].from_dict(values)
    return model_operator_settings(config.operator, values)


def module_settings(module: Any, name: str) -> OperatorSettings:
    """The settings of implementation ``name`` for an attention ``module`` (resolved once, kept on the
    module, re-validated only when the config's dict changes)."""
    config = getattr(module, "config", None)
    values = _source(config, name)
    memo = module.__dict__.setdefault(SETTINGS_ATTR, {}) if hasattr(module, "__dict__") else {}
    hit = memo.get(name)
    if hit is not None and hit[0] is values and hit[1] == values:
        return hit[2]
    settings = settings_from_config(config, name)
    memo[name] = (values, dict(values) if isinstance(values, dict) else values, settings)
    return settings
