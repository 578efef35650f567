"""The box rules of the SVDD problem (DESIGN §2.1), in one place: warm-up size and the nu calibration."""

from __future__ import annotations

import math
from typing import TypeVar

T = TypeVar("T")


def warmup_size(C: T) -> T:
    """Fewest keys for which the gate is defined: ``ceil(1/C) + 2`` (below it: warm-up, no certificate).

    ``C`` is a float (returns an int) or a tensor of boxes (returns a tensor of the same shape); the
    ``1e-9`` guard keeps ``C = 1/k`` from rounding up to ``k + 3``.
    """
    if isinstance(C, (int, float)):
        return int(math.ceil(1.0 / C - 1e-9)) + 2  # type: ignore[return-value]
    # the tensor's own method, no torch import: this module is reached from the remote-code configuration,
    # which must load with transformers alone
    return (1.0 / C - 1e-9).ceil() + 2  # type: ignore[operator,return-value]


def feasible_size(C: float) -> int:
    """Fewest keys for which ``n * C >= 1`` (a feasible problem): ``ceil(1/C)``."""
    return int(math.ceil(1.0 / C - 1e-9))
