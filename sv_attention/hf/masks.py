"""Mask functions paired (by identical name) with the registered attention functions.

transformers only builds a mask for an attention implementation that has a mask function registered
under the *same* name; without one the attention gets ``attention_mask=None`` even with padding, and
sliding windows vanish, silently (``shared/TRANSFORMERS.md``). Both functions here build transformers'
own boolean mask (True = attend, ``[b, 1, q, kv]``), so padding, sliding windows, chunked and packed
layouts are exactly what the model would use with sdpa. They accept any keyword arguments, so the
signature changes across transformers 5.x (``cache_position`` in 5.0, ``local_size`` for windows,
...) pass through.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.masking_utils import sdpa_mask


def ceq_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """Mask for ``"ceq"``: exactly sdpa's mask, including sdpa's ``None`` shortcuts.

    Keeping sdpa's shortcuts is what makes ``alpha = 0`` bitwise equal to the model's sdpa path (the
    stock term then runs the very same kernel call). When it returns ``None`` the ceq function applies
    causality itself (``module.is_causal``).

    Returns
    -------
    bool Tensor ``[b, 1, q, kv]`` (True = attend) or None.
    """
    return sdpa_mask(*args, **kwargs)


def sv_attention_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """Mask for ``"sv_attention"``: sdpa's boolean mask, always materialised for causal layers.

    The causal ``None`` shortcut is switched off (``allow_is_causal_skip=False``): the SV gate needs
    the per-sequence key validity that the materialised mask carries. Bidirectional (encoder) masks may
    still be ``None`` when nothing is padded, which means "every key is visible".

    Returns
    -------
    bool Tensor ``[b, 1, q, kv]`` (True = attend) or None.
    """
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)
