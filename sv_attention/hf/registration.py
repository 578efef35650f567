"""Register ``"sv_attention"`` and ``"ceq"`` with transformers (idempotent).

Each name is registered twice, as transformers pairs them by identical name: in ``AttentionInterface``
(the attention function) and in ``AttentionMaskInterface`` (the mask function). A name registered only
as an attention function silently receives ``attention_mask=None`` even with padding
(``shared/TRANSFORMERS.md``). ``import sv_attention`` calls :func:`register_all`.
"""

from __future__ import annotations

from transformers import AttentionInterface, AttentionMaskInterface

from sv_attention.hf.attention import ceq_attention_forward, sv_attention_forward
from sv_attention.hf.compat import install_switch_hook
from sv_attention.hf.masks import ceq_mask, sv_attention_mask
from sv_attention.hf.settings import CEQ_NAME, SV_NAME

#: name -> (attention function, mask function)
REGISTRY = {
    SV_NAME: (sv_attention_forward, sv_attention_mask),
    CEQ_NAME: (ceq_attention_forward, ceq_mask),
}


def register_all() -> list[str]:
    """Register both implementations in ``AttentionInterface`` and ``AttentionMaskInterface``.

    Safe to call any number of times (the same functions are written under the same names). Also installs
    the switch-time compatibility check on ``PreTrainedModel.set_attn_implementation``
    (:func:`sv_attention.hf.compat.install_switch_hook`).

    Returns
    -------
    list of str : the registered names, ``["sv_attention", "ceq"]``.
    """
    for name, (attn_fn, mask_fn) in REGISTRY.items():
        AttentionInterface.register(name, attn_fn)
        AttentionMaskInterface.register(name, mask_fn)
    install_switch_hook()
    return list(REGISTRY)


def is_registered(name: str) -> bool:
    """True when ``name`` maps to our functions in both interfaces."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name not in REGISTRY:
        return False
    attn_fn, mask_fn = REGISTRY[name]
    return (ALL_ATTENTION_FUNCTIONS._global_mapping.get(name) is attn_fn
            and ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(name) is mask_fn)
