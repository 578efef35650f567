"""Configuration of the sv-attention byte-level causal language model (remote code).

This file ships inside the Hub artifact next to ``modeling_sv.py`` and ``tokenization_sv.py`` and is
loaded with ``AutoConfig.from_pretrained(dir, trust_remote_code=True)``. It imports only
``transformers`` and the settings module (a flat sibling file in the artifact).

The backbone is identical for every operator: a pre-norm decoder with token + learned positional
embeddings, a GELU MLP (4x), LayerNorms with bias and a weight-tied output head. Only the attention
operator (``operator``) and its hyperparameters (``operator_config``) change.

Operators: ``sv``, ``ceq``, ``ceq_path_sum``, ``smprime``, ``softmax``, ``swa``. Each one's knobs, their
defaults, ranges and meaning are one settings dataclass of ``sv_attention.ops.settings`` (``SVSettings``,
``CeqSettings``, ``SMPrimeSettings``, ``SWASettings``): ``operator_config`` is validated by it and stored
with every default filled in. The ceq forms learn their hop weight per layer (``ceq_alpha``, initialised 0);
their ``path_weight`` setting is the plug-in's fixed weight and is not used by the model.
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Any

from transformers import PretrainedConfig

from sv_attention.errors import ConfigError, InvalidHyperparameterError, VersionMismatchError
from sv_attention.ops.settings import MODEL_OPERATORS, model_operator_settings
from sv_attention.version import __version__

OPERATORS = tuple(MODEL_OPERATORS)


def _int_at_least(lo: int):
    def check(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidHyperparameterError(f"{name} must be an integer >= {lo}, got {value!r}")
        if value < lo:
            raise InvalidHyperparameterError(f"{name} must be >= {lo}, got {value}")
        return value

    return check


def _float_in(lo: float, hi: float, lo_open: bool = True, hi_open: bool = False):
    def check(name: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
            raise InvalidHyperparameterError(f"{name} must be a finite number, got {value!r}")
        v = float(value)
        bad_lo = v <= lo if lo_open else v < lo
        bad_hi = v >= hi if hi_open else v > hi
        if bad_lo or bad_hi:
            lb = "(" if lo_open else "["
            hb = ")" if hi_open else "]"
            raise InvalidHyperparameterError(f"{name} must lie in {lb}{lo}, {hi}{hb}, got {v}")
        return v

    return check


def _bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidHyperparameterError(f"{name} must be true or false, got {value!r}")


def validate_operator_config(operator: Any, knobs: dict[str, Any] | None) -> dict[str, Any]:
    """Check ``operator`` and its knobs; return the full knob dict with defaults filled in
    (``sv_attention.ops.settings.model_operator_settings(...).to_dict()``).

    Raises
    ------
    ConfigError
        Unknown operator or knob (``lam`` with the signed ceq variant included), or ``operator_config``
        that is not a dict.
    InvalidHyperparameterError
        A knob value of the wrong type or out of range.
    """
    return model_operator_settings(operator, knobs).to_dict()


def _release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string (``packaging`` when importable: a guarded import, so the Hub
    artifact's configuration needs nothing but transformers; else the leading ``N.N...`` of PEP 440)."""
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:
        found = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
        if found is None:
            raise VersionMismatchError(f"unparseable sv-attention version {version!r} in the config") from None
        return tuple(int(p) for p in found.group(1).split("."))
    try:
        return Version(version).release
    except InvalidVersion as exc:
        raise VersionMismatchError(f"unparseable sv-attention version {version!r} in the config") from exc


def _series(version: str) -> tuple[int, ...]:
    major, minor = (_release(version) + (0, 0))[:2]
    return (major, minor) if major == 0 else (major,)


def check_version_compatible(written: str, installed: str) -> None:
    """Refuse a config written by an incompatible sv-attention release series.

    Compatible means the same major version (and, before 1.0, the same minor version).

    Raises
    ------
    VersionMismatchError
        Naming both versions and what to install.
    """
    if _series(written) != _series(installed):
        raise VersionMismatchError(
            f"this model was written by sv-attention {written}, but sv-attention {installed} is installed; "
            f"these release series are incompatible. Install a matching version: "
            f"pip install 'sv-attention=={written}'"
        )


class SVConfig(PretrainedConfig):
    r"""Configuration of :class:`SVForCausalLM`.

    Parameters
    ----------
    vocab_size : int, default 256
        Byte-level vocabulary.
    hidden_size : int, default 256
    num_hidden_layers : int, default 4
    num_attention_heads : int, default 4
    intermediate_size : int or None, default None
        MLP width; ``None`` means ``4 * hidden_size``.
    max_position_embeddings : int, default 256
        Block size (learned positional embeddings); longer inputs are refused.
    attention_bias : bool, default False
        Biases on the q/k/v/o projections. False reproduces the published 3,220,992-parameter count.
    mlp_bias : bool, default True
    layer_norm_eps : float, default 1e-5
    dropout : float, default 0.0
        Dropout on embeddings, attention output and MLP output (training only).
    initializer_range : float, default 0.02
    operator : str, default "softmax"
        One of ``"sv"``, ``"ceq"``, ``"ceq_path_sum"``, ``"smprime"``, ``"softmax"``, ``"swa"``.
    operator_config : dict or None
        The operator's knobs (see the module docstring); validated, defaults filled in.
    tie_word_embeddings : bool, default True
    sv_attention_version : str or None
        The sv-attention version that wrote the config; ``None`` records the installed one. Loading a
        config written by an incompatible version raises :class:`~sv_attention.errors.VersionMismatchError`.
    """

    model_type = "sv_lm"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(
        self,
        vocab_size: int = 256,
        hidden_size: int = 256,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        intermediate_size: int | None = None,
        max_position_embeddings: int = 256,
        attention_bias: bool = False,
        mlp_bias: bool = True,
        layer_norm_eps: float = 1e-5,
        dropout: float = 0.0,
        initializer_range: float = 0.02,
        operator: str = "softmax",
        operator_config: dict[str, Any] | None = None,
        tie_word_embeddings: bool = True,
        use_cache: bool = True,
        sv_attention_version: str | None = None,
        **kwargs: Any,
    ) -> None:
        for name, value, lo in (
            ("vocab_size", vocab_size, 1),
            ("hidden_size", hidden_size, 1),
            ("num_hidden_layers", num_hidden_layers, 1),
            ("num_attention_heads", num_attention_heads, 1),
            ("max_position_embeddings", max_position_embeddings, 1),
        ):
            _int_at_least(lo)(name, value)
        if hidden_size % num_attention_heads != 0:
            raise ConfigError(
                f"hidden_size={hidden_size} is not divisible by num_attention_heads={num_attention_heads}"
            )
        if intermediate_size is not None:
            _int_at_least(1)("intermediate_size", intermediate_size)
        _float_in(0.0, 1.0, lo_open=False, hi_open=True)("dropout", dropout)
        _float_in(0.0, math.inf, hi_open=True)("initializer_range", initializer_range)
        for name, value in (("attention_bias", attention_bias), ("mlp_bias", mlp_bias),
                            ("tie_word_embeddings", tie_word_embeddings), ("use_cache", use_cache)):
            _bool(name, value)
        _float_in(0.0, 1.0, hi_open=True)("layer_norm_eps", layer_norm_eps)
        kwargs.pop("head_dim", None)  # derived below; saved configs carry them
        kwargs.pop("num_key_value_heads", None)
        installed = __version__
        if sv_attention_version is not None:
            check_version_compatible(str(sv_attention_version), installed)
        self.sv_attention_version = installed if sv_attention_version is None else str(sv_attention_version)
        self.operator_config = validate_operator_config(operator, operator_config)
        if operator == "sv" and self.operator_config["chunk"] >= max_position_embeddings:
            warnings.warn(
                f"operator 'sv' with chunk={self.operator_config['chunk']} >= max_position_embeddings="
                f"{max_position_embeddings}: every position lies in chunk 0, so the layer is plain causal softmax "
                "and never gates; choose a chunk below the block size",
                UserWarning, stacklevel=2,
            )
        self.operator = operator
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads
        self.head_dim = hidden_size // num_attention_heads
        self.intermediate_size = 4 * hidden_size if intermediate_size is None else intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.attention_bias = bool(attention_bias)
        self.mlp_bias = bool(mlp_bias)
        self.layer_norm_eps = float(layer_norm_eps)
        self.dropout = float(dropout)
        self.initializer_range = float(initializer_range)
        self.use_cache = use_cache
        self.tie_word_embeddings = tie_word_embeddings
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
