"""Validated hyperparameters of the two registered attention implementations.

The hyperparameters of implementation ``NAME`` live in ``model.config.NAME`` as a plain ``dict`` (so
``save_pretrained`` writes them to ``config.json``): ``config.sv_attention`` for ``"sv_attention"`` and
``config.ceq`` for ``"ceq"``. :func:`sv_attention.enable` validates and writes them; the attention
functions read (and re-validate) them from ``module.config`` at call time, and use the documented
defaults below when the attribute is absent (the plain ``model.set_attn_implementation(NAME)`` route).

Every hyperparameter, its default and its meaning
-------------------------------------------------
``"sv_attention"`` (:class:`SVSettings`)
    nu : float = 0.3
        Calibrates the fixed box ``C = 1 / (nu * n0)`` once (DESIGN §2.1); in ``(0, 1]``. Roughly the
        fraction of the first ``n0`` keys that end up at the bound or on the margin.
    C : float or None = None
        The box constraint itself; when given it overrides ``nu``. ``> 0``.
    n0 : int or None = None
        Reference size for the ``nu`` calibration; None means ``chunk`` (the first boundary).
    chunk : int = 64
        Chunk length of the chunk-frozen gate: queries in chunk ``[s, s + chunk)`` read the gate fitted
        on the keys at positions ``< s`` and read their own chunk densely. ``>= 1``.
    sigma : float or None = None
        RBF bandwidth (``k(a, b) = exp(-||a - b||^2 / sigma^2)``). None: the median pairwise key
        distance per (sequence, kv-head) over the keys of the first boundary (positions ``< chunk``),
        computed once and then fixed for that sequence (for encoders: over all valid keys).
    gate : bool = True
        False disables the gate: the function is then plain (masked) softmax attention.
    sliding_window : {"softmax", "refuse"} = "softmax"
        What to do on a layer with a sliding window: ``"softmax"`` runs plain softmax inside the window
        (the window is honoured, the gate is not applied, a warning says so once per process);
        ``"refuse"`` raises :class:`~sv_attention.errors.UnsupportedFeatureError`.

``"ceq"`` (:class:`CeqSettings`)
    alpha : float = 0.05
        Weight of the path-sum terms in the hybrid form ``stock + sum_h (alpha A)^h v``; ``>= 0``.
        ``alpha = 0`` reproduces the model's own sdpa attention bitwise.
    operator : {"sgate", "signed"} = "sgate"
        The signed causal matrix A (DESIGN §2.6).
    form : {"hybrid", "path_sum"} = "hybrid"
        ``hybrid`` adds the hops to the stock attention; ``path_sum`` replaces it by
        ``(I + A + ... + A^K) v``.
    hops : int or None = None
        Number of hops K; None: 2 for ``sgate``, 3 for ``signed``. ``1 <= hops <= 16``.
    rho : float or None = None
        Row scale of A; None: 1.5 for ``sgate``, 0.9 for ``signed``. ``> 0``.
    lam : float or None = None
        Weight of the negative softmax in ``sgate`` (None: 0.10); in ``[0, 1]``. Not used by ``signed``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from sv_attention.errors import ConfigError, InvalidHyperparameterError

SV_NAME = "sv_attention"
CEQ_NAME = "ceq"
IMPLEMENTATIONS = (SV_NAME, CEQ_NAME)

CEQ_OPERATOR_DEFAULTS = {"sgate": {"rho": 1.5, "lam": 0.10, "hops": 2}, "signed": {"rho": 0.9, "lam": None, "hops": 3}}


def _num(name: str, value: Any, *, integer: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        kind = "an integer" if integer else "a number"
        raise InvalidHyperparameterError(f"{name} must be {kind}, got {value!r} ({type(value).__name__})")
    if integer and not float(value).is_integer():
        raise InvalidHyperparameterError(f"{name} must be an integer, got {value!r}")
    if not math.isfinite(float(value)):
        raise InvalidHyperparameterError(f"{name} must be finite, got {value!r}")
    return value


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise InvalidHyperparameterError(f"{name} must be one of {list(allowed)}, got {value!r}")
    return value


class _Settings:
    """Common helpers: construction from a dict with unknown-key checks, and back to a plain dict."""

    NAME = ""

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> _Settings:
        """Validate ``values`` (missing keys take their defaults).

        Raises
        ------
        ConfigError
            ``values`` is not a dict, or holds a key this implementation does not know.
        InvalidHyperparameterError
            A value has the wrong type or is out of range.
        """
        if values is None:
            return cls()
        if not isinstance(values, dict):
            raise ConfigError(
                f"config.{cls.NAME} must be a dict of hyperparameters, got {type(values).__name__}; "
                f"use sv_attention.enable(model, {cls.NAME!r}, ...) to write it"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"unknown {cls.NAME} hyperparameter(s) {unknown}; known ones: {sorted(known)}"
            )
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """A plain, JSON-serialisable dict (what goes into ``config.NAME``)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SVSettings(_Settings):
    """Hyperparameters of ``"sv_attention"``; see the module docstring for their meaning."""

    NAME = SV_NAME

    nu: float = 0.3
    C: float | None = None
    n0: int | None = None
    chunk: int = 64
    sigma: float | None = None
    gate: bool = True
    sliding_window: str = "softmax"

    def __post_init__(self) -> None:
        nu = _num("nu", self.nu)
        if not 0.0 < nu <= 1.0:
            raise InvalidHyperparameterError(f"nu must be in (0, 1], got {nu!r}")
        if self.C is not None and _num("C", self.C) <= 0:
            raise InvalidHyperparameterError(f"C must be > 0, got {self.C!r}")
        if self.n0 is not None and _num("n0", self.n0, integer=True) < 1:
            raise InvalidHyperparameterError(f"n0 must be an integer >= 1, got {self.n0!r}")
        if _num("chunk", self.chunk, integer=True) < 1:
            raise InvalidHyperparameterError(f"chunk must be an integer >= 1, got {self.chunk!r}")
        if self.sigma is not None and _num("sigma", self.sigma) <= 0:
            raise InvalidHyperparameterError(f"sigma must be > 0 (or None for the median rule), got {self.sigma!r}")
        if not isinstance(self.gate, bool):
            raise InvalidHyperparameterError(f"gate must be True or False, got {self.gate!r}")
        _choice("sliding_window", self.sliding_window, ("softmax", "refuse"))
        # normalise integer-valued floats (e.g. from JSON) to int
        object.__setattr__(self, "chunk", int(self.chunk))
        if self.n0 is not None:
            object.__setattr__(self, "n0", int(self.n0))

    @property
    def box(self) -> float:
        """The fixed box constraint ``C`` (given, or ``1 / (nu * n0)`` with ``n0`` defaulting to ``chunk``)."""
        if self.C is not None:
            return float(self.C)
        n0 = self.n0 if self.n0 is not None else self.chunk
        return 1.0 / (float(self.nu) * n0)

    @property
    def warmup(self) -> int:
        """Fewest keys for which the gate is active: ``ceil(1 / C) + 2`` (below it: plain softmax)."""
        return math.ceil(1.0 / self.box - 1e-9) + 2


@dataclass(frozen=True)
class CeqSettings(_Settings):
    """Hyperparameters of ``"ceq"``; see the module docstring for their meaning."""

    NAME = CEQ_NAME

    alpha: float = 0.05
    operator: str = "sgate"
    form: str = "hybrid"
    hops: int | None = None
    rho: float | None = None
    lam: float | None = None

    def __post_init__(self) -> None:
        if _num("alpha", self.alpha) < 0:
            raise InvalidHyperparameterError(f"alpha must be >= 0, got {self.alpha!r}")
        _choice("operator", self.operator, tuple(CEQ_OPERATOR_DEFAULTS))
        _choice("form", self.form, ("hybrid", "path_sum"))
        if self.hops is not None:
            h = _num("hops", self.hops, integer=True)
            if not 1 <= h <= 16:
                raise InvalidHyperparameterError(f"hops must be an integer in [1, 16], got {self.hops!r}")
            object.__setattr__(self, "hops", int(h))
        if self.rho is not None and _num("rho", self.rho) <= 0:
            raise InvalidHyperparameterError(f"rho must be > 0, got {self.rho!r}")
        if self.lam is not None:
            if self.operator != "sgate":
                raise ConfigError(f"lam only applies to operator='sgate', not {self.operator!r}; drop it")
            if not 0.0 <= _num("lam", self.lam) <= 1.0:
                raise InvalidHyperparameterError(f"lam must be in [0, 1], got {self.lam!r}")

    def resolved(self) -> dict[str, Any]:
        """``operator``, ``form``, ``alpha`` and ``hops`` / ``rho`` / ``lam`` with operator defaults filled in."""
        d = CEQ_OPERATOR_DEFAULTS[self.operator]
        return {
            "operator": self.operator,
            "form": self.form,
            "alpha": float(self.alpha),
            "hops": self.hops if self.hops is not None else d["hops"],
            "rho": float(self.rho) if self.rho is not None else d["rho"],
            "lam": (float(self.lam) if self.lam is not None else d["lam"]),
        }


SETTINGS_CLASSES: dict[str, type[_Settings]] = {SV_NAME: SVSettings, CEQ_NAME: CeqSettings}


_DEFAULTS: dict[str, _Settings] = {n: c() for n, c in SETTINGS_CLASSES.items()}
# (name, id(dict)) -> (copy of the dict, validated settings): attention functions look their settings up on
# every layer call; re-validating only when the dict's contents change keeps that lookup ~1 us.
_PARSED: dict[tuple[str, int], tuple[dict[str, Any], _Settings]] = {}


def settings_from_config(config: Any, name: str) -> _Settings:
    """The validated settings of implementation ``name`` stored in ``config`` (defaults when absent).

    Parameters
    ----------
    config : a transformers ``PretrainedConfig`` (or None)
    name : ``"sv_attention"`` or ``"ceq"``

    Raises
    ------
    ConfigError, InvalidHyperparameterError
        The stored dict holds an unknown key or an invalid value (checked again whenever it changes).
    """
    values = getattr(config, name, None) if config is not None else None
    if values is None:
        return _DEFAULTS[name]
    key = (name, id(values))
    hit = _PARSED.get(key)
    if hit is not None and hit[0] == values:
        return hit[1]
    parsed = SETTINGS_CLASSES[name].from_dict(values)
    if len(_PARSED) > 256:
        _PARSED.clear()
    _PARSED[key] = (dict(values), parsed)
    return parsed
