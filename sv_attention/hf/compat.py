"""Compatibility of a transformers model with ``"sv_attention"`` / ``"ceq"``, checked at switch time.

A feature the registered functions do not implement must be refused when the attention is switched,
not at the first forward, and never ignored. :func:`check` lists the problems of a model without
changing it; :func:`sv_attention.enable` and ``model.set_attn_implementation(name)`` (through the hook
:func:`install_switch_hook` puts on ``PreTrainedModel.set_attn_implementation``) raise
:class:`~sv_attention.errors.UnsupportedFeatureError` with that list and leave the config as it was. A
model switched by another route (``from_config(..., attn_implementation=name)``, a config edited by hand)
is checked at the first call of each attention module (:func:`ensure_compatible`).

What is refused (each message starts with the attention module's path, e.g. ``model.layers.3.self_attn``):

- a model whose modeling code does not call ``AttentionInterface`` (Falcon: its attention class is picked
  from a fixed table when the model is built, so no registered implementation can run in it); refused by
  every door, building included: ``from_pretrained(..., attn_implementation="sv_attention")`` raises
  :class:`~sv_attention.errors.UnsupportedFeatureError` (:func:`build_refusal`) instead of transformers' bare
  ``KeyError``;
- attention-logit softcapping (Gemma2: ``attn_logit_softcapping``);
- learned attention sinks (``s_aux``; a ``sinks`` parameter on the module, gpt-oss);
- T5-style relative position bias (``position_bias``);
- for ``"ceq"``: hops (``path_weight != 0`` or ``form != "hybrid"``) on a non-causal layer (encoders,
  vision towers, cross-attention): ceq's ``A`` is strictly lower-triangular;
- for ``"sv_attention"`` with ``sliding_window="refuse"``: a layer with a sliding window.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
from collections.abc import Iterator
from typing import Any

import torch

from sv_attention.errors import UnsupportedFeatureError
from sv_attention.hf.settings import CEQ_NAME, IMPLEMENTATIONS, SV_NAME, settings_from_config
from sv_attention.ops.settings import CeqSettings, OperatorSettings, SVSettings

#: attribute of an attention module holding its dotted path in the model (set by :func:`label_modules`)
PATH_ATTR = "_sv_attention_path"
#: attribute of an attention module holding ``(name, settings)`` it was last checked for
CHECKED_ATTR = "_sv_attention_checked"
_ATTENTION_CLASS = re.compile(r"Attention")
_SKIP_SWITCH_CHECK: contextvars.ContextVar[bool] = contextvars.ContextVar("sv_attention_skip_check", default=False)

__all__ = ["attention_modules", "build_refusal", "check", "ensure_compatible", "fixed_attention_problem",
           "install_switch_hook", "label_modules", "module_label", "module_problems"]


def attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The attention modules of ``model``: ``(dotted path, module)`` for every module whose class name
    contains ``Attention`` and none of whose submodules' class names does (``BertSelfAttention`` inside
    ``BertAttention``, ``T5Attention`` inside ``T5LayerSelfAttention``)."""
    found = []
    for path, m in model.named_modules():
        if not _ATTENTION_CLASS.search(type(m).__name__):
            continue
        if any(_ATTENTION_CLASS.search(type(c).__name__) for _, c in m.named_modules() if c is not m):
            continue
        found.append((path, m))
    return found


def label_modules(model: torch.nn.Module) -> None:
    """Record each attention module's dotted path on it (for messages raised at call time)."""
    for path, m in attention_modules(model):
        m.__dict__[PATH_ATTR] = path or type(model).__name__


def module_label(module: torch.nn.Module) -> str:
    """``model.layers.3.self_attn`` when known, else the class name (and ``layer N`` when it has one)."""
    path = module.__dict__.get(PATH_ATTR)
    if path:
        return path
    idx = getattr(module, "layer_idx", None)
    return type(module).__name__ + ("" if idx is None else f" (layer {idx})")


def _ceq_hops(settings: CeqSettings, module: torch.nn.Module) -> bool:
    own = getattr(module, "ceq_alpha", None)
    weight = own if isinstance(own, torch.Tensor) else settings.path_weight
    return not (settings.form == "hybrid" and isinstance(weight, float) and weight == 0.0)


def _window(module: torch.nn.Module) -> int | None:
    w = getattr(module, "sliding_window", None)
    return w if isinstance(w, int) and not isinstance(w, bool) else None


def module_problems(module: torch.nn.Module, name: str, settings: OperatorSettings | None) -> list[str]:
    """What implementation ``name`` (with ``settings``) does not implement for this attention module.

    Returns
    -------
    list of str : one sentence per problem (without the module path), empty when compatible.
    """
    out = []
    cfg = getattr(module, "config", None)
    softcap = getattr(module, "attn_logit_softcapping", None)
    if softcap is None:
        softcap = getattr(cfg, "attn_logit_softcapping", None)
    if softcap:
        out.append(f"attention-logit softcapping (attn_logit_softcapping={softcap}, passed as softcap=) is not "
                   f"implemented by {name!r}; use 'eager' or 'sdpa', or a config with attn_logit_softcapping=None "
                   "(this changes the model)")
    if isinstance(getattr(module, "sinks", None), torch.Tensor):
        out.append(f"learned attention sinks (passed as s_aux=) are not implemented by {name!r}; use 'eager' "
                   "or 'sdpa'")
    if hasattr(module, "has_relative_attention_bias") or hasattr(module, "relative_attention_bias"):
        out.append(f"T5-style relative position bias (passed as position_bias=) is not implemented by {name!r}; "
                   "use 'eager' or 'sdpa'")
    causal = bool(getattr(module, "is_causal", True))
    if name == CEQ_NAME and isinstance(settings, CeqSettings) and not causal and _ceq_hops(settings, module):
        out.append("ceq hops are causal (A is strictly lower-triangular) but this layer is not causal (an encoder, "
                   "a vision tower or cross-attention); enable 'ceq' with path_weight=0 (stock attention) or use "
                   "another implementation")
    if name == SV_NAME and isinstance(settings, SVSettings) and settings.gated \
            and settings.sliding_window == "refuse" and _window(module) is not None:
        out.append(f"this layer uses a sliding window ({_window(module)}) and sv_attention was configured with "
                   "sliding_window='refuse'; use sliding_window='gate' (the default)")
    return out


def fixed_attention_problem(cls: type, name: str) -> str | None:
    """Why a model class cannot run implementation ``name`` at all, or None.

    The one rule for every door (:func:`check`, :func:`sv_attention.enable`, ``set_attn_implementation``
    and building the model with ``attn_implementation=name``): a ``PreTrainedModel`` class whose modeling code
    does not call ``AttentionInterface`` (transformers' own test, ``_can_set_attn_implementation``) picks its
    attention class when it is built (Falcon: a fixed table that has no entry for ``name``), so no registered
    implementation can run in it.

    Returns
    -------
    str or None : one sentence (without a module path) that says what to do instead.
    """
    can_set = getattr(cls, "_can_set_attn_implementation", None)
    if can_set is None or can_set():
        return None
    return (f"{cls.__name__}'s modeling code ({cls.__module__}) does not call AttentionInterface: its attention "
            f"class is fixed when the model is built, so {name!r} can run neither through set_attn_implementation "
            "nor through from_pretrained(..., attn_implementation=...); keep 'eager' or 'sdpa' for this model")


def _model_problems(model: torch.nn.Module, name: str) -> list[str]:
    from transformers import PreTrainedModel

    out = []
    seen = set()
    for path, m in model.named_modules():
        if not isinstance(m, PreTrainedModel) or type(m).__module__ in seen:
            continue
        seen.add(type(m).__module__)
        problem = fixed_attention_problem(type(m), name)
        if problem is not None:
            out.append(f"{path or type(m).__name__}: {problem}")
    return out


def check(model: torch.nn.Module, impl: str, **settings: Any) -> list[str]:
    """The problems that prevent ``impl`` from running faithfully on ``model``, without switching anything.

    Parameters
    ----------
    model : transformers.PreTrainedModel
    impl : str  ``"sv_attention"`` or ``"ceq"`` (any other name: no problem is reported)
    **settings : the hyperparameters to check with (as for :func:`sv_attention.enable`); without any, each
        module's own stored settings (``config.sv_attention`` / ``config.ceq``, else the defaults)

    Returns
    -------
    list of str : one message per problem, each naming the attention module's path; empty when compatible.

    Raises
    ------
    ConfigError, InvalidHyperparameterError
        ``settings`` hold an unknown key or an invalid value.
    """
    from sv_attention.hf.settings import SETTINGS_CLASSES

    if impl not in IMPLEMENTATIONS:
        return []
    given = SETTINGS_CLASSES[impl].from_dict(dict(settings)) if settings else None
    problems = _model_problems(model, impl)
    label_modules(model)
    for path, m in attention_modules(model):
        s = given if given is not None else settings_from_config(getattr(m, "config", None), impl)
        problems += [f"{path or type(m).__name__}: {p}" for p in module_problems(m, impl, s)]
    return problems


def refusal(model: torch.nn.Module, impl: str, problems: list[str]) -> UnsupportedFeatureError:
    """The error raised at switch time for ``problems`` (from :func:`check`)."""
    return UnsupportedFeatureError(
        f"{type(model).__name__} cannot switch to {impl!r} (its attention setting is unchanged):\n  - "
        + "\n  - ".join(problems))


def attention_settings(config: Any) -> list[tuple[Any, Any]]:
    """``(config, stored attention setting)`` for ``config`` and every sub-config under it (any depth)."""
    out, todo, seen = [], [config], set()
    while todo:
        cfg = todo.pop()
        if cfg is None or id(cfg) in seen or not hasattr(cfg, "__dict__"):
            continue
        seen.add(id(cfg))
        out.append((cfg, cfg.__dict__.get("_attn_implementation_internal")))
        todo += [getattr(cfg, k, None) for k in getattr(cfg, "sub_configs", {}) or {}]
    return out


def restore_attention_settings(saved: list[tuple[Any, Any]]) -> None:
    """Put back what :func:`attention_settings` recorded."""
    for cfg, value in saved:
        cfg.__dict__["_attn_implementation_internal"] = value


def build_refusal(cls: type, impl: str, problem: str) -> UnsupportedFeatureError:
    """The error raised when a model of class ``cls`` is built with ``attn_implementation=impl`` (``from_pretrained``,
    ``from_config``, or a config that already names ``impl``) and :func:`fixed_attention_problem` says it cannot run
    it; raised before any layer is built (transformers itself would fail later with a bare ``KeyError``)."""
    return UnsupportedFeatureError(f"{cls.__name__} cannot be built with attn_implementation={impl!r} (the config "
                                   f"passed in is unchanged): {problem}")


def ensure_compatible(module: torch.nn.Module, name: str, settings: OperatorSettings) -> None:
    """First-call check of one attention module (memoised per implementation and settings object).

    Raises
    ------
    UnsupportedFeatureError
        :func:`module_problems` reports something; the message names the module's path.
    """
    hit = module.__dict__.get(CHECKED_ATTR)
    if hit is not None and hit[0] == name and hit[1] is settings:
        return
    problems = module_problems(module, name, settings)
    if problems:
        raise UnsupportedFeatureError(f"{module_label(module)}: " + "; ".join(problems))
    module.__dict__[CHECKED_ATTR] = (name, settings)


@contextlib.contextmanager
def switch_checked() -> Iterator[None]:
    """Within: the ``set_attn_implementation`` hook does not re-check (the caller already did)."""
    token = _SKIP_SWITCH_CHECK.set(True)
    try:
        yield
    finally:
        _SKIP_SWITCH_CHECK.reset(token)


def install_switch_hook() -> None:
    """Wrap ``PreTrainedModel.set_attn_implementation`` (once) so that switching to ``"sv_attention"`` or
    ``"ceq"`` runs :func:`check` first and raises :func:`refusal` before anything changes;
    ``PreTrainedModel._check_and_adjust_attn_implementation`` (the check ``PreTrainedModel.__init__`` runs before
    any layer is built) so that building a model whose attention is fixed (:func:`fixed_attention_problem`) with
    one of them raises :func:`build_refusal` (``PreTrainedModel._from_config``, which writes
    ``attn_implementation=`` into the caller's config, puts the config back when that happens); and
    ``PreTrainedModel.post_init`` so that a model built with one of them records its module paths."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.set_attn_implementation
    if not getattr(original, "_sv_attention_hook", False):
        @functools.wraps(original)
        def set_attn_implementation(self, attn_implementation, *args, **kwargs):
            if isinstance(attn_implementation, str) and attn_implementation in IMPLEMENTATIONS \
                    and not _SKIP_SWITCH_CHECK.get():
                problems = check(self, attn_implementation)
                if problems:
                    raise refusal(self, attn_implementation, problems)
            return original(self, attn_implementation, *args, **kwargs)

        set_attn_implementation._sv_attention_hook = True  # type: ignore[attr-defined]
        PreTrainedModel.set_attn_implementation = set_attn_implementation  # type: ignore[method-assign]

    adjust = PreTrainedModel._check_and_adjust_attn_implementation
    if not getattr(adjust, "_sv_attention_hook", False):
        @functools.wraps(adjust)
        def checked_adjust(self, attn_implementation, *args, **kwargs):
            if isinstance(attn_implementation, str) and attn_implementation in IMPLEMENTATIONS:
                problem = fixed_attention_problem(type(self), attn_implementation)
                if problem is not None:
                    raise build_refusal(type(self), attn_implementation, problem)
            return adjust(self, attn_implementation, *args, **kwargs)

        checked_adjust._sv_attention_hook = True  # type: ignore[attr-defined]
        PreTrainedModel._check_and_adjust_attn_implementation = checked_adjust  # type: ignore[method-assign]

    from_config = PreTrainedModel.__dict__["_from_config"].__func__
    if not getattr(from_config, "_sv_attention_hook", False):
        @functools.wraps(from_config)
        def restoring_from_config(cls, config, **kwargs):
            before = attention_settings(config)
            try:
                return from_config(cls, config, **kwargs)
            except UnsupportedFeatureError:
                restore_attention_settings(before)  # transformers wrote attn_implementation= into the caller's config
                raise

        restoring_from_config._sv_attention_hook = True  # type: ignore[attr-defined]
        PreTrainedModel._from_config = classmethod(restoring_from_config)  # type: ignore[method-assign,assignment]

    post_init = PreTrainedModel.post_init
    if not getattr(post_init, "_sv_attention_hook", False):
        @functools.wraps(post_init)
        def labelled_post_init(self, *args, **kwargs):
            result = post_init(self, *args, **kwargs)
            if getattr(getattr(self, "config", None), "_attn_implementation", None) in IMPLEMENTATIONS:
                label_modules(self)
            return result

        labelled_post_init._sv_attention_hook = True  # type: ignore[attr-defined]
        PreTrainedModel.post_init = labelled_post_init  # type: ignore[method-assign]
