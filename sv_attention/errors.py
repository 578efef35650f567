"""Typed errors for sv-attention, in one place.

Every error says what was wrong and what to do about it. Every mutating API that raises one of these
leaves its object exactly as it was before the call.

All errors derive from :class:`SVAttentionError`; input errors also derive from ``ValueError`` (or
``KeyError`` / ``TypeError``) so generic handlers keep working.
"""

from __future__ import annotations


class SVAttentionError(Exception):
    """Base class of every error raised by sv-attention."""


class InvalidInputError(SVAttentionError, ValueError):
    """An input tensor or argument is malformed: wrong shape, dtype, non-finite values, bad range."""


class InvalidHyperparameterError(InvalidInputError):
    """A hyperparameter is out of range (C <= 0, sigma <= 0, nu outside (0, 1], chunk <= 0, ...)."""


class ConfigError(InvalidInputError):
    """A configuration is inconsistent: unknown key, a knob that does not belong to the operator, ..."""


class UnknownIdError(SVAttentionError, KeyError):
    """An id / position does not exist (or was already removed / forgotten)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable.
        return str(self.args[0]) if self.args else "unknown id"


class DuplicateIdError(InvalidInputError):
    """The same id / position was given more than once in one call."""


class InfeasibleBoxError(SVAttentionError, ValueError):
    """The box constraint cannot be met: n * C < 1 (too few keys for the fixed C)."""


class WarmupError(SVAttentionError, RuntimeError):
    """The gate is in warm-up (fewer than ceil(1/C) + 2 keys): no certificate can be issued."""


class SolverError(SVAttentionError, RuntimeError):
    """A solver failed to reach a KKT point within its iteration / guard budget."""


class MaskError(InvalidInputError):
    """An attention mask is malformed or ambiguous (e.g. an additive mask with values in (min/2, 0))."""


class UnsupportedFeatureError(SVAttentionError, NotImplementedError):
    """A caller asked for a feature this operator does not implement (softcap, s_aux, position_bias, ...)."""


class BackendUnavailableError(SVAttentionError, RuntimeError):
    """A requested compute backend (e.g. MLX) is not importable on this machine."""


class ArtifactError(SVAttentionError, RuntimeError):
    """A Hub artifact failed verification: a hash, size, tensor or parameter count does not match."""


class VersionMismatchError(SVAttentionError, RuntimeError):
    """A saved config was written by an sv-attention version the installed one cannot load."""


class NetworkUnavailableError(SVAttentionError, RuntimeError):
    """An operation needs the network (e.g. pushing to the Hub) and the network is unreachable."""


class TrainingDivergedError(SVAttentionError, RuntimeError):
    """Training produced a non-finite loss (lower the learning rate or lengthen the warm-up)."""


class HopCacheError(InvalidInputError):
    """A ceq hop cache does not match the call (its length is not kv_len - q_len, or the batch / heads /
    operator / hops differ from what filled it): reset the cache and prefill again."""


class TemplateError(InvalidInputError):
    """A README section template is malformed (unknown filter, bad placeholder syntax, an ambiguous list
    selector, an unclosed ``{{ for }}`` block): fix the placeholder in ``docs/readme/*.md``."""
