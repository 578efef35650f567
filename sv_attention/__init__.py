"""sv-attention: support-vector attention with certified KV eviction and exact deletion, and ceq.

Public names are imported lazily so that ``import sv_attention`` stays light for the solver-only user.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> module that defines it (loaded on first access)
_LAZY = {
    "IncrementalSVDD": "sv_attention.svdd",
    "refit": "sv_attention.svdd",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'sv_attention' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
