"""SVDD solvers: the exact fp64 maintained solver, the from-scratch reference, the batched path.

Names are resolved lazily from their defining modules.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "IncrementalSVDD": "sv_attention.svdd.exact",
    "refit": "sv_attention.svdd.reference",
    "SVDDSolution": "sv_attention.svdd.reference",
    "solve_batched": "sv_attention.svdd.batched",
    "BatchedSolution": "sv_attention.svdd.batched",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'sv_attention.svdd' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
