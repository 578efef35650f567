"""sv_attention.hf: the transformers plug-in.

- :func:`register_all` registers ``"sv_attention"`` and ``"ceq"`` (attention + paired mask functions);
  ``import sv_attention`` calls it.
- :func:`enable` switches a model's attention with validated hyperparameters stored in its config.
- :func:`reset_state` drops the per-layer decoding state the functions keep on a model.
- ``sv_attention.hf.cache.CertifiedCache``: the certified KV cache (own module).
"""

from __future__ import annotations

from sv_attention.hf.attention import ceq_attention_forward, reset_state, sv_attention_forward
from sv_attention.hf.enable import enable
from sv_attention.hf.registration import is_registered, register_all
from sv_attention.hf.settings import CeqSettings, SVSettings

__all__ = ["CeqSettings", "SVSettings", "ceq_attention_forward", "enable", "is_registered", "register_all",
           "reset_state", "sv_attention_forward"]
