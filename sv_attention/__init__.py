"""sv-attention: support-vector attention with certified KV eviction and exact deletion, and ceq.

Public names are imported lazily so that ``import sv_attention`` stays light for the solver-only user.
Importing the package registers the attention implementations ``"sv_attention"`` and ``"ceq"`` with
transformers (``AttentionInterface`` and the paired ``AttentionMaskInterface``), so that
``model.set_attn_implementation("sv_attention")`` works right after ``import sv_attention``.
"""

from __future__ import annotations

from sv_attention._lazy import lazy_exports
from sv_attention.version import __version__ as __version__

# name -> module that defines it (loaded on first access)
_LAZY = {
    "IncrementalSVDD": "sv_attention.svdd",
    "refit": "sv_attention.svdd",
    "enable": "sv_attention.hf.enable",
    "check": "sv_attention.hf.compat",
    "CertifiedCache": "sv_attention.hf.cache",
}


__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)


def _register() -> None:
    from sv_attention.hf.registration import register_all

    register_all()


_register()
