"""Attention-mask normalisation shared by every operator.

transformers hands attention functions several mask conventions (see ``shared/TRANSFORMERS.md``):
boolean ``[b, 1, q, kv]`` (True = attend), additive float ``[b, 1, q, kv]`` (0 = attend, a very
negative number = blocked), a 2-D ``[b, kv]`` padding mask (1/True = real token), or ``None``.
Operators work on one form: a boolean tensor broadcastable to ``[b, h, q, kv]`` with True = attend.
"""

from __future__ import annotations

import torch

from sv_attention.errors import MaskError


def to_bool_mask(mask: torch.Tensor | None, q_len: int, kv_len: int) -> torch.Tensor | None:
    """Convert any supported mask to a boolean mask ``[b, 1|h, q_len, kv_len]`` (True = attend).

    Parameters
    ----------
    mask : None, bool / float / integer Tensor
        ``[b, 1|h, q, kv]`` boolean or additive float (0 = attend, ``<= finfo.min / 2`` or ``-inf`` =
        blocked), or a 2-D ``[b, kv]`` padding mask (True / 1 = real token). A 4-D mask may be longer
        than ``kv_len`` in its last dim (static caches); it is cut to the last ``kv_len`` columns only
        when it is longer, never padded.
    q_len, kv_len : int

    Returns
    -------
    bool Tensor ``[b, 1|h, q_len, kv_len]`` or None.

    Raises
    ------
    MaskError
        Wrong rank / shape, or an additive mask with a value strictly between ``min/2`` and 0, or a
        positive value (ambiguous: neither "attend" nor "blocked"), or NaN.
    """
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise MaskError(f"attention mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dim() == 2:
        if mask.shape[-1] != kv_len:
            raise MaskError(f"2-D padding mask has {mask.shape[-1]} columns, expected kv_len={kv_len}")
        if mask.dtype == torch.bool:
            pad = mask
        elif mask.is_floating_point():
            if torch.isnan(mask).any():
                raise MaskError("2-D padding mask contains NaN")
            pad = mask != 0
        else:
            pad = mask != 0
        return pad[:, None, None, :].expand(mask.shape[0], 1, q_len, kv_len)
    if mask.dim() != 4:
        raise MaskError(f"attention mask must be 2-D [b, kv] or 4-D [b, 1|h, q, kv], got shape {tuple(mask.shape)}")
    if mask.shape[-1] < kv_len:
        raise MaskError(f"attention mask has {mask.shape[-1]} key columns, fewer than kv_len={kv_len}")
    if mask.shape[-1] > kv_len:
        mask = mask[..., : kv_len]
    if mask.shape[-2] != q_len and mask.shape[-2] != 1:
        raise MaskError(f"attention mask has {mask.shape[-2]} query rows, expected q_len={q_len}")
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        if torch.isnan(mask).any():
            raise MaskError("additive attention mask contains NaN")
        lo = torch.finfo(mask.dtype).min / 2
        attend = mask == 0
        blocked = mask <= lo
        if not bool((attend | blocked).all()):
            bad = mask[~(attend | blocked)]
            raise MaskError(
                "ambiguous additive attention mask: values must be 0 (attend) or <= finfo.min/2 (blocked), "
                f"found e.g. {float(bad.flatten()[0]):.4g}; pass a boolean mask (True = attend) instead"
            )
        return attend
    # integer 0/1 masks
    return mask != 0


def causal_mask(q_len: int, kv_len: int, device: torch.device | str | None = None, *, strict: bool = False,
                ) -> torch.Tensor:
    """Boolean causal mask ``[q_len, kv_len]`` for queries that are the *last* ``q_len`` positions.

    Query row i sits at absolute position ``p_i = kv_len - q_len + i``; key j is visible when
    ``j <= p_i`` (``j < p_i`` when ``strict``).
    """
    if q_len > kv_len:
        raise MaskError(f"q_len={q_len} exceeds kv_len={kv_len}: queries must be the last positions")
    qpos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    kpos = torch.arange(kv_len, device=device)[None, :]
    return kpos < qpos if strict else kpos <= qpos
