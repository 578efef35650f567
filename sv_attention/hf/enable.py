"""``sv_attention.enable(model, name, **hyperparameters)``: switch a transformers model's attention.

Validates the hyperparameters first (typed errors, model untouched), writes them to ``config.NAME``
(a plain dict, so ``save_pretrained`` stores it in ``config.json``) and calls
``model.set_attn_implementation(NAME)``. ``enable(model, "sdpa")`` (or any built-in / registered name)
switches back; the stored hyperparameters are left in the config, unused.

It also installs (once per model) a forward pre-hook that declares a left-padded batch to a fresh
:class:`~sv_attention.hf.cache.CertifiedCache`: when a forward receives a 2-D ``attention_mask`` with
padding and an empty ``CertifiedCache`` (as ``past_key_values`` or ``cache``) whose padding was not
declared, the hook calls ``cache.set_padding(attention_mask)``, so ``model.generate(**enc, cache=cache)``
keeps pad keys out of the cache's solvers without the caller declaring them.
"""

from __future__ import annotations

from typing import Any

import torch

from sv_attention.errors import ConfigError
from sv_attention.hf.attention import reset_state
from sv_attention.hf.compat import check, refusal, switch_checked
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
        implementation name.
    UnsupportedFeatureError
        The model uses a feature ``name`` does not implement (:func:`sv_attention.check` lists them, each
        with the attention module's path), or its modeling code cannot switch attention (Falcon).
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
    if settings is not None:
        problems = check(model, name, **settings.to_dict())
        if problems:
            raise refusal(model, name, problems)
    before = {id(c): (c, c.__dict__.get("_attn_implementation_internal")) for c in _configs(model)}
    try:
        with switch_checked():
            model.set_attn_implementation(name)
    except (ValueError, ImportError) as e:
        _restore(before)
        raise ConfigError(f"transformers refused attn_implementation={name!r} for {type(model).__name__}: {e}") from e
    stuck = [type(m).__name__ for m in [model] if getattr(m.config, "_attn_implementation", name) != name]
    if stuck:
        _restore(before)
        advice = ("no registered implementation can run in it; keep 'eager' or 'sdpa' for this model"
                  if settings is not None else
                  f"build it with {name!r} instead: from_pretrained(..., attn_implementation={name!r})")
        raise ConfigError(
            f"{type(model).__name__} did not switch to {name!r} (it stays on {before[id(model.config)][1]!r}): its "
            f"modeling code picks its attention class when the model is built (no AttentionInterface lookup); {advice}")
    if settings is not None:
        for cfg in _configs(model):
            setattr(cfg, name, settings.to_dict())
    reset_state(model)
    if PADDING_HOOK_ATTR not in model.__dict__:
        model.__dict__[PADDING_HOOK_ATTR] = model.register_forward_pre_hook(declare_cache_padding, with_kwargs=True)
    return model


def _restore(before: dict[int, tuple[Any, Any]]) -> None:
    """Put every config's attention setting back as it was (a failed switch changes nothing)."""
    for cfg, value in before.values():
        cfg.__dict__["_attn_implementation_internal"] = value


#: Attribute of a model holding the handle of its padding pre-hook (installed once by :func:`enable`).
PADDING_HOOK_ATTR = "_sv_attention_padding_hook"


def declare_cache_padding(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """Forward pre-hook: declare a padded 2-D ``attention_mask`` to a fresh, undeclared ``CertifiedCache``.

    Acts only when the cache (``past_key_values`` or ``cache`` keyword) is a ``CertifiedCache`` holding
    no position yet with no padding declared, and the mask is 2-D ``[b, L]`` with at least one 0; anything
    else passes through untouched. The mask's own checks apply (``set_padding`` raises on a non-0/1 mask).
    """
    from sv_attention.hf.cache import CertifiedCache

    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    mask = kwargs.get("attention_mask")
    if (isinstance(cache, CertifiedCache) and isinstance(mask, torch.Tensor) and mask.dim() == 2
            and not cache.padding_declared and cache.get_seq_length() == 0 and not bool(mask.bool().all())):
        cache.set_padding(mask)
    return None
