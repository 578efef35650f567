"""The SV-gated attention of one layer call: the single entry point every door calls.

``sv_gate_attention(query, key, value, visible, settings, ...)`` computes the gate
(:func:`~sv_attention.ops.sv_gate.gate.causal_gate` / :func:`~sv_attention.ops.sv_gate.gate.full_gate`)
and the softmax-hybrid readout: softmax weights over the visible keys, times ``alpha_j`` on the gated
prefix and 1 on the local chunk, renormalised (``softmax(logits + log gate)``). The plug-in
(``"sv_attention"``), the remote-code model's ``sv`` operator and :class:`~sv_attention.ops.causal.CausalSVAttention`
are thin callers; :mod:`sv_attention.ops.sv_gate.naive` is the reference they are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sv_attention.errors import InvalidInputError
from sv_attention.ops.settings import SVSettings
from sv_attention.ops.sv_gate.fused import fused_gated_sdpa
from sv_attention.ops.sv_gate.gate import Gate, GateBias, causal_gate, full_gate
from sv_attention.ops.sv_gate.readout import grouped_attention
from sv_attention.ops.sv_gate.state import GateState


@dataclass
class GatedAttention:
    """Result of :func:`sv_gate_attention`.

    Attributes
    ----------
    out : Tensor ``[b, h, q, dv]``
    weights : Tensor ``[b, h, q, kv]`` or None  (when asked for)
    gate : Gate or None  (None with ``settings.gated=False``)
    """

    out: torch.Tensor
    weights: torch.Tensor | None
    gate: Gate | None

    @property
    def state(self) -> GateState | None:
        return None if self.gate is None else self.gate.state


def check_gqa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> int:
    """Number of query heads per kv-head; raises :class:`InvalidInputError` on inconsistent shapes."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise InvalidInputError(f"query/key/value must be 4-D [b, heads, seq, dim], got {tuple(query.shape)}, "
                                f"{tuple(key.shape)}, {tuple(value.shape)}")
    if key.shape[1] != value.shape[1] or key.shape[2] != value.shape[2] or key.shape[0] != value.shape[0]:
        raise InvalidInputError(f"key {tuple(key.shape)} and value {tuple(value.shape)} disagree")
    if query.shape[0] != key.shape[0] or query.shape[-1] != key.shape[-1]:
        raise InvalidInputError(f"query {tuple(query.shape)} and key {tuple(key.shape)} disagree")
    if query.shape[1] % key.shape[1] != 0:
        raise InvalidInputError(f"{query.shape[1]} query heads are not a multiple of {key.shape[1]} kv heads")
    return query.shape[1] // key.shape[1]


def sv_gate_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor,
                      settings: SVSettings, *, scaling: float | None = None, causal: bool = True,
                      state: GateState | None = None, keep_state: bool = False, dropout: float = 0.0,
                      return_weights: bool = False, valid: torch.Tensor | None = None,
                      base: torch.Tensor | None = None, gate: Gate | None = None) -> GatedAttention:
    """SV-gated softmax-hybrid attention.

    Parameters
    ----------
    query : Tensor ``[b, h, q, d]``
    key, value : Tensor ``[b, g, kv, d]`` (all keys, past included; ``h % g == 0``)
    visible : bool Tensor ``[b, q, kv]``  what each query row may attend (causality, padding, windows
        applied); positions are read off it (:class:`~sv_attention.ops.sv_gate.schedule.GateSchedule`)
    settings : SVSettings
    scaling : float or None  logit scale (``d ** -0.5``)
    causal : bool  False: one gate per sequence on all valid keys, no local window (encoders)
    state : GateState or None  the layer's decoding state from its previous call
    keep_state : bool  return the updated state in ``result.gate.state``
    dropout : float  attention-weight dropout (training)
    return_weights : bool  also return the weights
    valid, base : the key columns that are real keys and the valid keys before column 0, when the caller
        knows them (a sliding-window layer's decode step over a rolling cache; see
        :meth:`~sv_attention.ops.sv_gate.schedule.GateSchedule.from_visible`)
    gate : Gate or None  a non-causal gate already fitted on exactly these keys and this visibility (a
        cross-attention layer's encoder keys, reused across decode steps); not refitted

    Returns
    -------
    GatedAttention
    """
    check_gqa(query, key, value)
    b, h, q, d = query.shape
    if visible.shape != (b, q, key.shape[2]):
        raise InvalidInputError(f"visible mask {tuple(visible.shape)} does not match [b, q, kv] = "
                                f"[{b}, {q}, {key.shape[2]}]")
    sc = float(scaling) if scaling is not None else d ** -0.5
    if gate is not None and (causal or not settings.gated):
        raise InvalidInputError("a precomputed gate is only accepted for a gated non-causal call")
    if settings.gated and gate is None:
        # the gate is fitted in fp32 (or fp64) whatever the model's dtype
        gate_keys = key if key.dtype in (torch.float32, torch.float64) else key.float()
        detach = settings.detach_gate or not (torch.is_grad_enabled() and gate_keys.requires_grad)
        with torch.profiler.record_function("sv.gate"):
            if causal:
                gate = causal_gate(gate_keys, visible, settings, state=state, keep_state=keep_state, detach=detach,
                                   valid=valid, base=base)
            else:
                gate = full_gate(gate_keys, visible, settings, detach=detach)
    bias = None if gate is None else gate.bias
    if bias is None or return_weights or dropout > 0.0 or query.dtype not in (torch.float32, torch.float64):
        # no gate (gate off, warm-up, chunk 0): the eager computation, so it matches eager attention exactly
        with torch.profiler.record_function("sv.readout"):
            dense = bias.dense() if isinstance(bias, GateBias) else bias
            out, weights = grouped_attention(query, key, value, visible, dense, sc, dropout)
        return GatedAttention(out=out, weights=weights if return_weights else None, gate=gate)
    # a gate: the log-gate folded into the dot products, one fused SDPA call, equal to grouped_attention to
    # rounding, outputs and gradients (tested)
    with torch.profiler.record_function("sv.readout"):
        out = fused_gated_sdpa(query, key, value, visible, bias, sc)
    return GatedAttention(out=out, weights=None, gate=gate)
