"""The stock attention of the hybrid form: transformers' own ``sdpa_attention_forward``, so that
``alpha = 0`` is bitwise what a model with ``attn_implementation="sdpa"`` computes."""

from __future__ import annotations

import torch

from sv_attention.ops.ceq.common import check_qkv
from sv_attention.ops.masking import causal_mask, to_bool_mask


class _StockModule:
    """Stand-in for the attention module that ``sdpa_attention_forward`` reads two attributes from."""

    def __init__(self, num_key_value_groups: int, is_causal: bool) -> None:
        self.num_key_value_groups = num_key_value_groups
        self.is_causal = is_causal


def stock_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, *,
                    scaling: float | None = None, dropout: float = 0.0, training: bool = False,
                    is_causal: bool | None = None) -> torch.Tensor:
    """Stock softmax attention exactly as transformers' ``sdpa`` attention computes it.

    Calls ``transformers.integrations.sdpa_attention.sdpa_attention_forward`` (same GQA handling,
    ``is_causal`` rules and kernel), so for the same inputs and mask it is bitwise what a model using
    ``attn_implementation="sdpa"`` computes.

    Parameters
    ----------
    q : ``[b, h, q_len, d]``; k, v : ``[b, h_kv, kv_len, d]``
    mask : None, 4-D bool / additive float mask (passed to SDPA unchanged, as the model's sdpa gets it),
        or a 2-D ``[b, kv]`` padding mask (combined with the causal mask into a 4-D bool mask first).
        With ``mask=None`` and ``1 < q_len < kv_len`` the queries are taken as the last positions (an
        explicit causal mask is built; transformers itself never sends that combination for a dynamic
        cache).
    scaling : float, optional
    dropout : float
        Attention dropout probability, applied only when ``training``.
    is_causal : bool, optional
        The module's ``is_causal`` (default True).

    Returns
    -------
    Tensor ``[b, h, q_len, d]`` (a transposed view of SDPA's ``[b, q_len, h, d]`` output).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, h, hkv, q_len, kv_len = check_qkv(q, k, v)
    causal = True if is_causal is None else bool(is_causal)
    if mask is not None and mask.dim() == 2:
        pad = to_bool_mask(mask, q_len, kv_len)
        mask = pad & causal_mask(q_len, kv_len, device=q.device)[None, None] if causal else pad
    elif mask is None and causal and 1 < q_len < kv_len:
        mask = causal_mask(q_len, kv_len, device=q.device)[None, None]
    module = _StockModule(h // hkv, causal)
    out, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=dropout if training else 0.0,
                                    scaling=scaling, is_causal=causal)
    return out.transpose(1, 2)
