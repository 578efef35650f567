"""One settings dataclass per operator, one defaults table, one validation.

Every door into an operator reads its hyperparameters from here: the plug-in (``sv_attention.enable`` /
``model.set_attn_implementation``), the remote-code model (``SVConfig.operator_config``), the certified
cache and the training module (``CausalSVAttention``). A setting's default is written once, in
:data:`DEFAULTS`; its validation once, in the dataclass's ``__post_init__``.

This module imports only the standard library, :mod:`sv_attention.errors` and :mod:`sv_attention.svdd.box` (it is also shipped, with
its imports rewritten, as a flat sibling file of the Hub artifact's remote code).

Every setting, its default and its meaning
------------------------------------------
:class:`SVSettings` (``"sv_attention"`` plug-in, the model's ``sv`` operator)
    nu = 0.5
        Calibrates the fixed box ``C = 1 / (nu * n0)`` once (DESIGN §2.1); in ``(0, 1]``.
    C = None
        The box constraint itself (``> 0``); when given it overrides ``nu``.
    n0 = None
        Reference size of the ``nu`` calibration; None means ``chunk`` (the first boundary).
    chunk = 64
        Queries at positions ``[s, s + chunk)`` read the gate fitted on the keys at positions ``< s``
        and read their own chunk densely.
    sigma = None
        RBF bandwidth (``k(a, b) = exp(-||a - b||^2 / sigma^2)``); None: the median pairwise distance of
        the keys at positions ``< chunk`` per (sequence, kv-head), then fixed.
    gated = True
        False turns the gate off: plain (masked) softmax attention.
    solver = "batched"
        ``"batched"``: partition finder + bordered solve (trainable); ``"exact"``: fp64 maintained
        solvers (no gradient).
    detach_gate = True
        No gradient through the gate's solve (as published); False differentiates through it.
    gate_floor = 0.0
        The prefix weight is ``max(alpha_j, gate_floor)``; in ``[0, 1]``.
    gate_backend = "auto"
        Backend of the batched partition finder: ``"torch"``, ``"mlx"`` or ``"auto"`` (MLX on Apple
        silicon when importable, torch elsewhere).
    sliding_window = "gate"
        Layers with a sliding window: ``"gate"`` gates them by the window rule of
        :mod:`sv_attention.ops.sv_gate.schedule` (exactly the full-attention gate while the window covers
        every earlier key), ``"softmax"`` runs plain softmax inside the window, ``"refuse"`` raises
        :class:`~sv_attention.errors.UnsupportedFeatureError` when the attention is switched.

:class:`CeqSettings` (``"ceq"`` plug-in, the model's ``ceq`` / ``ceq_path_sum`` operators)
    path_weight = 0.05
        Weight ``alpha`` of the hops in the hybrid form ``stock + sum_h (alpha A)^h v``; ``>= 0``
        (0 is the stock attention, bitwise). A module with its own learned weight (the model's
        ``ceq_alpha``) uses that instead.
    variant = "sgate"
        The signed causal matrix A: ``"sgate"`` or ``"signed"`` (DESIGN §2.6).
    form = "hybrid"
        ``"hybrid"`` adds the hops to the stock attention; ``"path_sum"`` is ``(I + A + ... + A^K) v``.
    hops, rho, lam = None
        Hop count ``K`` (1..16), row scale (``> 0``) and the negative-softmax weight of sgate (``>= 0``);
        None takes the variant's value from :data:`CEQ_VARIANT_DEFAULTS`.

:class:`SMPrimeSettings` (the model's ``smprime`` operator)
    beta_init, qk_init, g_init = 1.0
        Initial values of the learnable per-layer scalars (``>= 0``).

:class:`SWASettings` (the model's ``swa`` operator)
    window = 64
        Each query reads its last ``window`` positions (itself included).

Renamed keywords (accepted for one release with a ``FutureWarning``): SV ``gate`` -> ``gated``; ceq
``alpha`` -> ``path_weight``, ``operator`` / ``gate`` -> ``variant``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

from sv_attention.errors import ConfigError, InvalidHyperparameterError
from sv_attention.svdd.box import warmup_size

#: variant -> hops / rho / lam of the ceq matrix A (DESIGN §2.6)
CEQ_VARIANT_DEFAULTS: dict[str, dict[str, Any]] = {
    "sgate": {"hops": 2, "rho": 1.5, "lam": 0.10},
    "signed": {"hops": 3, "rho": 0.9, "lam": None},
}
#: Largest warm-up size ``ceil(1/C) + 2`` accepted: a smaller C could never leave warm-up on any real
#: sequence, and its integer arithmetic would overflow tensor indices.
MAX_WARMUP = 2**31 - 1


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidHyperparameterError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    v = float(value)
    if not math.isfinite(v):
        raise InvalidHyperparameterError(f"{name} must be finite, got {value!r}")
    return v


def _int(name: str, value: Any, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)) \
            or not float(value).is_integer():
        raise InvalidHyperparameterError(f"{name} must be an integer, got {value!r}")
    v = int(value)
    if v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise InvalidHyperparameterError(f"{name} must be an integer {rng}, got {value!r}")
    return v


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise InvalidHyperparameterError(f"{name} must be one of {list(allowed)}, got {value!r}")
    return value


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidHyperparameterError(f"{name} must be True or False, got {value!r}")
    return value


class OperatorSettings:
    """Common behaviour: construction from a dict (unknown keys refused, renamed keys warned about)."""

    #: the operator name used in messages and as the config attribute of the plug-in
    NAME: ClassVar[str] = ""
    #: old keyword -> new keyword (accepted for one release with a FutureWarning)
    RENAMED: ClassVar[dict[str, str]] = {}

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None, *, where: str | None = None) -> OperatorSettings:
        """Validate ``values`` (missing keys take their defaults).

        Parameters
        ----------
        values : dict or None
        where : str or None
            Where the values come from, for messages (default ``config.NAME``).

        Raises
        ------
        ConfigError
            ``values`` is not a dict, or holds a key the operator does not know.
        InvalidHyperparameterError
            A value has the wrong type or is out of range.
        """
        where = where or f"config.{cls.NAME}"
        if values is None:
            return cls()
        if not isinstance(values, dict):
            raise ConfigError(f"{where} must be a dict of hyperparameters, got {type(values).__name__}")
        return cls(**cls.upgrade(values, where))

    @classmethod
    def upgrade(cls, values: dict[str, Any], where: str | None = None) -> dict[str, Any]:
        """``values`` with renamed keywords mapped to their new names (one ``FutureWarning`` each).

        Raises
        ------
        ConfigError
            An unknown key, or an old and a new name given together.
        """
        where = where or cls.NAME
        known = {f.name for f in dataclasses.fields(cls)}
        out: dict[str, Any] = {}
        for key, value in values.items():
            new = cls.RENAMED.get(key)
            if new is not None:
                if new in values:
                    raise ConfigError(f"{where}: give {new!r} only ({key!r} is its old name)")
                warnings.warn(f"{where}: {key!r} is renamed {new!r}; the old name is accepted until the next "
                              "release", FutureWarning, stacklevel=3)
                key = new
            elif key not in known:
                raise ConfigError(f"unknown {cls.NAME} hyperparameter {key!r} in {where}; known ones: "
                                  f"{sorted(known)}")
            out[key] = value
        return out

    def to_dict(self) -> dict[str, Any]:
        """A plain, JSON-serialisable dict (what goes into a config)."""
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> OperatorSettings:
        """A validated copy with ``changes`` applied (renamed keywords accepted)."""
        return dataclasses.replace(self, **self.upgrade(changes))


@dataclass(frozen=True)
class SVSettings(OperatorSettings):
    """Hyperparameters of the SV gate; see the module docstring for each one's meaning."""

    NAME: ClassVar[str] = "sv_attention"
    RENAMED: ClassVar[dict[str, str]] = {"gate": "gated"}

    nu: float = 0.5
    C: float | None = None
    n0: int | None = None
    chunk: int = 64
    sigma: float | None = None
    gated: bool = True
    solver: str = "batched"
    detach_gate: bool = True
    gate_floor: float = 0.0
    gate_backend: str = "auto"
    sliding_window: str = "gate"

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        nu = _real("nu", self.nu)
        if not 0.0 < nu <= 1.0:
            raise InvalidHyperparameterError(f"nu must be in (0, 1], got {self.nu!r}")
        set_(self, "nu", nu)
        set_(self, "chunk", _int("chunk", self.chunk, 1))
        if self.n0 is not None:
            set_(self, "n0", _int("n0", self.n0, 1))
        if self.C is not None:
            C = _real("C", self.C)
            if C <= 0:
                raise InvalidHyperparameterError(f"C must be > 0, got {self.C!r}")
            set_(self, "C", C)
        if 1.0 / self.box > MAX_WARMUP - 3:
            raise InvalidHyperparameterError(
                f"C = {self.box:.3g} needs ceil(1/C) + 2 = {1.0 / self.box:.3g} keys before the gate is defined "
                f"(at most {MAX_WARMUP} are supported); raise C (or lower nu * n0)")
        if self.sigma is not None:
            sigma = _real("sigma", self.sigma)
            if sigma <= 0:
                raise InvalidHyperparameterError(f"sigma must be > 0 (or None for the median rule), got {self.sigma!r}")
            set_(self, "sigma", sigma)
        _flag("gated", self.gated)
        _choice("solver", self.solver, ("batched", "exact"))
        _flag("detach_gate", self.detach_gate)
        if self.solver == "exact" and not self.detach_gate:
            raise InvalidHyperparameterError("the exact solver is not differentiable: use detach_gate=True or "
                                             "solver='batched'")
        floor = _real("gate_floor", self.gate_floor)
        if not 0.0 <= floor <= 1.0:
            raise InvalidHyperparameterError(f"gate_floor must be in [0, 1], got {self.gate_floor!r}")
        set_(self, "gate_floor", floor)
        _choice("gate_backend", self.gate_backend, ("auto", "torch", "mlx"))
        _choice("sliding_window", self.sliding_window, ("gate", "softmax", "refuse"))

    @property
    def box(self) -> float:
        """The fixed box ``C``: given, or ``1 / (nu * n0)`` with ``n0`` defaulting to ``chunk``."""
        if self.C is not None:
            return float(self.C)
        return 1.0 / (self.nu * (self.n0 if self.n0 is not None else self.chunk))

    @property
    def warmup(self) -> int:
        """Fewest keys for which the gate is defined: ``ceil(1/C) + 2`` (:func:`warmup_size`)."""
        return warmup_size(self.box)


@dataclass(frozen=True)
class CeqSettings(OperatorSettings):
    """Hyperparameters of ceq; see the module docstring for each one's meaning."""

    NAME: ClassVar[str] = "ceq"
    RENAMED: ClassVar[dict[str, str]] = {"alpha": "path_weight", "operator": "variant", "gate": "variant"}

    path_weight: float = 0.05
    variant: str = "sgate"
    form: str = "hybrid"
    hops: int | None = None
    rho: float | None = None
    lam: float | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        w = _real("path_weight", self.path_weight)
        if w < 0:
            raise InvalidHyperparameterError(f"path_weight must be >= 0, got {self.path_weight!r}")
        set_(self, "path_weight", w)
        _choice("variant", self.variant, tuple(CEQ_VARIANT_DEFAULTS))
        _choice("form", self.form, ("hybrid", "path_sum"))
        if self.hops is not None:
            set_(self, "hops", _int("hops", self.hops, 1, 16))
        if self.rho is not None:
            rho = _real("rho", self.rho)
            if rho <= 0:
                raise InvalidHyperparameterError(f"rho must be > 0, got {self.rho!r}")
            set_(self, "rho", rho)
        if self.lam is not None:
            if self.variant != "sgate":
                raise ConfigError(f"lam only applies to variant='sgate', not {self.variant!r}; drop it")
            lam = _real("lam", self.lam)
            if lam < 0:
                raise InvalidHyperparameterError(f"lam must be >= 0, got {self.lam!r}")
            set_(self, "lam", lam)

    def resolved(self) -> dict[str, Any]:
        """``variant``, ``form``, ``path_weight``, ``hops``, ``rho``, ``lam`` with the variant's defaults filled in."""
        d = CEQ_VARIANT_DEFAULTS[self.variant]
        return {
            "variant": self.variant,
            "form": self.form,
            "path_weight": self.path_weight,
            "hops": self.hops if self.hops is not None else d["hops"],
            "rho": self.rho if self.rho is not None else d["rho"],
            "lam": self.lam if self.lam is not None else d["lam"],
        }


@dataclass(frozen=True)
class SMPrimeSettings(OperatorSettings):
    """Initial values of smprime's learnable per-layer scalars."""

    NAME: ClassVar[str] = "smprime"

    beta_init: float = 1.0
    qk_init: float = 1.0
    g_init: float = 1.0

    def __post_init__(self) -> None:
        for name in ("beta_init", "qk_init", "g_init"):
            v = _real(name, getattr(self, name))
            if v < 0:
                raise InvalidHyperparameterError(f"{name} must be >= 0, got {getattr(self, name)!r}")
            object.__setattr__(self, name, v)


@dataclass(frozen=True)
class SWASettings(OperatorSettings):
    """Sliding-window softmax attention (the matched-window baseline)."""

    NAME: ClassVar[str] = "swa"

    window: int = 64

    def __post_init__(self) -> None:
        object.__setattr__(self, "window", _int("window", self.window, 1))


@dataclass(frozen=True)
class SoftmaxSettings(OperatorSettings):
    """Plain causal softmax attention: no hyperparameters."""

    NAME: ClassVar[str] = "softmax"


#: the remote-code model's operator name -> its settings class
MODEL_OPERATORS: dict[str, type[OperatorSettings]] = {
    "sv": SVSettings,
    "ceq": CeqSettings,
    "ceq_path_sum": CeqSettings,
    "smprime": SMPrimeSettings,
    "softmax": SoftmaxSettings,
    "swa": SWASettings,
}
#: the plug-in's registered implementation name -> its settings class
PLUGIN_SETTINGS: dict[str, type[OperatorSettings]] = {"sv_attention": SVSettings, "ceq": CeqSettings}
#: the model operator each plug-in implementation reproduces (its "twin")
PLUGIN_TWINS: dict[str, tuple[str, ...]] = {"sv_attention": ("sv",), "ceq": ("ceq", "ceq_path_sum")}
#: every default, by settings class (the single table; the dataclass fields are its source)
DEFAULTS: dict[str, dict[str, Any]] = {cls.NAME: cls().to_dict() for cls in
                                      (SVSettings, CeqSettings, SMPrimeSettings, SWASettings, SoftmaxSettings)}


def model_operator_settings(operator: Any, values: dict[str, Any] | None) -> OperatorSettings:
    """The validated settings of the model operator ``operator`` (``SVConfig.operator_config``).

    ``ceq_path_sum`` fixes ``form="path_sum"``, ``ceq`` fixes ``form="hybrid"``.

    Raises
    ------
    ConfigError
        Unknown operator, unknown key, or a ``form`` that contradicts the operator.
    InvalidHyperparameterError
        A value of the wrong type or out of range.
    """
    cls = MODEL_OPERATORS.get(operator) if isinstance(operator, str) else None
    if cls is None:
        raise ConfigError(f"unknown operator {operator!r}; choose one of {list(MODEL_OPERATORS)}")
    if values is not None and not isinstance(values, dict):
        raise ConfigError(f"operator_config must be a dict of knobs, got {type(values).__name__}")
    values = dict(values or {})
    known = {f.name for f in dataclasses.fields(cls)} | set(cls.RENAMED)
    for name in values:
        if name not in known:
            owners = [op for op, c in MODEL_OPERATORS.items() if name in {f.name for f in dataclasses.fields(c)}]
            hint = f" (it belongs to {owners})" if owners else ""
            raise ConfigError(f"knob {name!r} does not belong to operator {operator!r}{hint}; valid knobs for "
                              f"{operator!r}: {sorted(f.name for f in dataclasses.fields(cls)) or 'none'}")
    if cls is CeqSettings:
        form = "path_sum" if operator == "ceq_path_sum" else "hybrid"
        if values.get("form", form) != form:
            raise ConfigError(f"operator {operator!r} has form {form!r}, not {values['form']!r}")
        values["form"] = form
    return cls.from_dict(values, where=f"operator_config of operator {operator!r}")
