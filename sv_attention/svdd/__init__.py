"""SVDD solvers: the exact fp64 maintained solver, the from-scratch reference, the batched path.

Names are resolved lazily from their defining modules.
"""

from __future__ import annotations

from sv_attention._lazy import lazy_exports

_LAZY = {
    "IncrementalSVDD": "sv_attention.svdd.exact",
    "refit": "sv_attention.svdd.reference",
    "SVDDSolution": "sv_attention.svdd.reference",
    "solve_batched": "sv_attention.svdd.batched",
    "BatchedSolution": "sv_attention.svdd.batched",
}


__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)
