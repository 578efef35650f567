"""The causal hybrid SV-Attention layer (DESIGN §2.5) as a trainable module: a thin caller of the gate.

:class:`CausalSVAttention` projects ``q, k, v`` and calls :func:`sv_hybrid_attention`, which calls the
single gate implementation :func:`sv_attention.ops.sv_gate.sv_gate_attention` (schedule, batched or exact
fits, softmax-hybrid readout). Queries in chunk ``[s, s + chunk)`` read the prefix ``[0, s)`` weighted by
the SVDD coefficients of the gate fitted on it and their own chunk densely, one softmax renormalised;
chunk 0 and warm-up are plain causal softmax. Hyperparameters are one
:class:`~sv_attention.ops.settings.SVSettings`, resolved at construction.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sv_attention.errors import InfeasibleBoxError, InvalidHyperparameterError, InvalidInputError
from sv_attention.ops.masking import causal_mask, to_bool_mask
from sv_attention.ops.settings import SVSettings
from sv_attention.ops.sv_gate import sv_gate_attention


def visible_from_mask(mask: torch.Tensor | None, b: int, q_len: int, kv_len: int, causal: bool,
                      device: torch.device) -> torch.Tensor:
    """Boolean ``[b, q_len, kv_len]`` visibility from ``mask`` (anything
    :func:`~sv_attention.ops.masking.to_bool_mask` accepts, head dimension 1; None: no padding), AND-ed
    with causality when ``causal`` (queries are the last ``q_len`` positions)."""
    bm = to_bool_mask(mask, q_len, kv_len) if mask is not None else None
    if bm is not None:
        if bm.dim() == 4:
            if bm.shape[1] != 1:
                raise InvalidInputError(f"per-head masks {tuple(bm.shape)} are not supported; pass [b, 1, q, kv]")
            bm = bm[:, 0]
        bm = bm.to(device)
    vis = causal_mask(q_len, kv_len, device)[None] if causal else None
    if bm is None:
        vis = torch.ones(1, q_len, kv_len, dtype=torch.bool, device=device) if vis is None else vis
    else:
        vis = bm if vis is None else (bm & vis)
    return vis.expand(b, q_len, kv_len)


def sv_hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, settings: SVSettings | None = None, *,
                        mask: torch.Tensor | None = None, scaling: float | None = None, causal: bool = True,
                        return_weights: bool = False, **setting_overrides: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunk-frozen hybrid SV attention on projected ``q, k, v`` (queries = last positions).

    Parameters
    ----------
    q : Tensor ``[b, h, q_len, d]``; k, v : Tensor ``[b, h_kv, kv_len, d]`` (``h % h_kv == 0``)
    settings : SVSettings or None  (None: defaults); ``setting_overrides`` (e.g. ``chunk=16``, ``C=0.1``)
        are applied on top
    mask : Tensor or None  bool (True = attend) / additive / 2-D padding, shared by the heads; AND-ed with
        causality when ``causal``. Keys no query attends are padding (left out of the gate's problems).
    scaling : float or None  (``1/sqrt(d)``)
    causal : bool  False: one gate on all keys, no local window
    return_weights : bool  also return the attention weights ``[b, h, q_len, kv_len]``

    Returns
    -------
    (out ``[b, h, q_len, d_v]``, weights or None). Decoding with a kept state goes through
    :func:`sv_attention.ops.sv_gate.sv_gate_attention` directly.

    Raises
    ------
    InvalidInputError  wrong shapes, non-finite q / k, q_len > kv_len
    InvalidHyperparameterError  invalid settings
    """
    settings = settings if settings is not None else SVSettings()
    if setting_overrides:
        settings = settings.replace(**setting_overrides)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise InvalidInputError(f"q, k, v must be 4-D [b, heads, seq, d]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                                f"{tuple(v.shape)}")
    if q.shape[2] > k.shape[2]:
        raise InvalidInputError(f"q_len={q.shape[2]} exceeds kv_len={k.shape[2]}")
    if not bool(torch.isfinite(q).all()) or not bool(torch.isfinite(k).all()):
        raise InvalidInputError("q or k has non-finite entries")
    vis = visible_from_mask(mask, q.shape[0], q.shape[2], k.shape[2], causal, q.device)
    res = sv_gate_attention(q, k, v, vis, settings, scaling=scaling, causal=causal, return_weights=return_weights)
    return res.out, res.weights


class CausalSVAttention(nn.Module):
    """Multi-head causal hybrid SV-Attention (q/k/v/o projections + :func:`sv_hybrid_attention`).

    Parameters
    ----------
    d_model : int
    n_heads : int  (``d_model % n_heads == 0``)
    settings : SVSettings or None  the gate's hyperparameters (None: defaults)
    bias : bool, default False  biases of the projections
    **setting_overrides
        Any :class:`~sv_attention.ops.settings.SVSettings` field (``C``, ``nu``, ``n0``, ``chunk``,
        ``sigma``, ``solver``, ``detach_gate``, ``gate_floor``, ``gate_backend``), applied on top of
        ``settings``.

    Raises
    ------
    InvalidHyperparameterError  bad sizes or settings
    InfeasibleBoxError  ``chunk * C < 1``: the first chunk boundary could never hold a feasible gate
    """

    def __init__(self, d_model: int, n_heads: int, *, settings: SVSettings | None = None, bias: bool = False,
                 **setting_overrides: Any) -> None:
        super().__init__()
        if d_model <= 0 or n_heads <= 0 or d_model % n_heads != 0:
            raise InvalidHyperparameterError(f"d_model ({d_model}) must be a positive multiple of n_heads ({n_heads})")
        settings = settings if settings is not None else SVSettings()
        if setting_overrides:
            settings = settings.replace(**setting_overrides)
        if settings.chunk * settings.box < 1:
            raise InfeasibleBoxError(
                f"chunk={settings.chunk} keys with C={settings.box:.4g} give chunk*C={settings.chunk * settings.box:.4g} "
                "< 1: the gate at the first boundary is infeasible; raise C, use a longer chunk, or calibrate with "
                "nu and n0 <= chunk")
        self.settings = settings
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, d_model // n_heads
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, d_model, bias=bias)
        self.v_proj = nn.Linear(d_model, d_model, bias=bias)
        self.o_proj = nn.Linear(d_model, d_model, bias=bias)

    @property
    def C(self) -> float:
        """The fixed box of the gate."""
        return self.settings.box

    @property
    def chunk(self) -> int:
        return self.settings.chunk

    def extra_repr(self) -> str:
        s = self.settings
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, C={s.box:.4g}, chunk={s.chunk}, "
                f"solver={s.solver!r}, gate_floor={s.gate_floor}, detach_gate={s.detach_gate}")

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x [b, s, d_model]`` -> ``[b, s, d_model]``.

        ``attention_mask``: None (causal), a 2-D ``[b, s]`` padding mask (True / 1 = real token) or a
        4-D mask accepted by :func:`to_bool_mask`.
        """
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise InvalidInputError(f"x must be [batch, seq, d_model={self.d_model}], got {tuple(x.shape)}")
        if not bool(torch.isfinite(x).all()):
            raise InvalidInputError("x has non-finite entries")
        b, s, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out, _ = sv_hybrid_attention(q, k, v, self.settings, mask=attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.d_model))
