"""The attention functions registered as ``"sv_attention"`` and ``"ceq"`` (transformers v5 contract).

Both are called by a transformers attention module as
``fn(module, query, key, value, attention_mask, dropout=..., scaling=..., **kwargs)`` with ``query``
``[b, h, q_len, d]`` (RoPE applied) and ``key`` / ``value`` ``[b, h_kv, kv_len, d]`` already including
the cached past, and return ``(out [b, q_len, h, d], weights_or_None)``.

Common behaviour
----------------
- GQA by shape (``h // h_kv`` query heads per kv-head; GPT-2 has no ``num_key_value_groups``).
- Masks: boolean ``[b, 1, q, kv]`` (True = attend), additive float, 2-D padding, or None. None with
  ``module.is_causal`` means causality is applied here, with sdpa's conventions (``q_len == 1``: every
  key; otherwise key ``j`` visible to row ``i`` when ``j <= i``). ``module.is_causal = False``
  (encoders) is honoured; an ``is_causal`` keyword overrides the module attribute.
- Dropout on the attention weights when the model passes a non-zero ``dropout`` (it does in training).
- ``output_attentions=True`` returns the weights (``"sv_attention"``: the gated, renormalised softmax
  ``[b, h, q, kv]``; ``"ceq"``: the ceq matrix ``A``).
- ``softcap``, ``s_aux``, ``position_bias`` and ``block_indices`` change the semantics and are not
  implemented: they raise :class:`~sv_attention.errors.UnsupportedFeatureError` (naming the module path and
  the model) instead of being ignored; :mod:`sv_attention.hf.compat` refuses most of them at switch time.
- ``indices`` (DeepSeek-V3.2's sparse top-k selection, handed to every implementation but eager / sdpa) is
  folded into the boolean mask before the operator, as the model does for sdpa (:func:`fold_indices`).
- Hyperparameters are read from ``module.config.sv_attention`` / ``module.config.ceq`` at call time
  (:mod:`sv_attention.hf.settings`; documented defaults when absent).

Decoding state: both functions keep a small per-layer state on the attention module (attribute
``_sv_attention_state``): the SV gates per chunk boundary, or the ceq hop history. It is checked against
a fingerprint of the keys on every call, so fresh prefills, crops and beam reorders are detected; call
:func:`reset_state` to drop it (e.g. to free memory after generation). A non-causal layer (cross-attention,
an encoder) keeps its last gate (:class:`FixedKeysGate`) and reuses it while the keys are unchanged (every
key's first feature compared exactly): a cross-attention gate is fitted once per generation.

torch.compile: the gate fit is data-dependent (boundaries, active sets, the decoding state above), so a
``"sv_attention"`` layer call always runs eagerly. Traced without autograd (``torch.no_grad()``,
``generate()``) it is one opaque custom operator, ``torch.ops.sv_attention.layer_call``: a node of the graph,
not a graph break, so the model compiles to one graph (``fullgraph=True`` works) and computes exactly what it
computes eagerly, decoding state included. Traced with autograd (training) it is the custom operator
``torch.ops.sv_attention.trainable_layer_call``, whose backward formula recomputes only the readout on the gate
the forward used (the gate is a constant: ``detach_gate``), so training compiles without a graph break either;
what the formula does not cover (``detach_gate=False``, dropout, ``output_attentions``, half precision) runs
behind one ``torch.compiler.disable`` boundary (:func:`compiled_call`). ``"ceq"`` traces to one graph as it is.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from sv_attention.errors import InvalidInputError, MaskError, UnsupportedFeatureError
from sv_attention.hf.compat import ensure_compatible, module_label
from sv_attention.hf.gate_handoff import GateHandoff, pop_pending_gate
from sv_attention.hf.settings import (
    CEQ_NAME,
    SV_NAME,
    CeqSettings,
    SVSettings,
    module_settings,
    twin_operator,
)
from sv_attention.ops.ceq import HopState, ceq_layer_attention, ceq_matrix
from sv_attention.ops.masking import to_bool_mask
from sv_attention.ops.sv_gate import GateState, check_gqa, sv_gate_attention
from sv_attention.ops.sv_gate.fit import count, warn_once
from sv_attention.ops.sv_gate.gate import Gate, GateBias
from sv_attention.ops.sv_gate.readout import grouped_attention
from sv_attention.ops.sv_gate.state import key_fingerprint

STATE_ATTR = "_sv_attention_state"
_UNSUPPORTED = ("softcap", "s_aux", "position_bias", "block_indices")


def reset_state(model: torch.nn.Module) -> int:
    """Drop the decoding state the registered functions keep on ``model``'s attention modules.

    Returns
    -------
    int : number of modules whose state was dropped.
    """
    n = 0
    for m in model.modules():
        held = [a for a in (STATE_ATTR, POSITIONS_ATTR) if a in m.__dict__]
        for a in held:
            del m.__dict__[a]
        n += bool(held)
    return n


def _refuse_unsupported(name: str, module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    for key in _UNSUPPORTED:
        if kwargs.get(key) is not None:
            model = getattr(getattr(module, "config", None), "model_type", None) or type(module).__name__
            raise UnsupportedFeatureError(
                f"{module_label(module)} ({model}): {name!r} attention does not implement the {key!r} argument "
                "(this model passes it, and ignoring it would change the model's outputs); use "
                "attn_implementation='eager' or 'sdpa' for this model")


def fold_indices(module: torch.nn.Module, attention_mask: torch.Tensor | None, kwargs: dict[str, Any],
                 q_len: int, kv_len: int, batch: int, device: torch.device) -> torch.Tensor | None:
    """Fold a sparse key selection passed as ``indices=`` into the mask (popped from ``kwargs``).

    DeepSeek-V3.2-style models fold their indexer's top-k selection into the mask only for ``"eager"`` /
    ``"sdpa"``; any other implementation receives it as ``indices`` ``[b, q_len, topk]`` (key columns each
    query may attend). Returns the mask with exactly that selection applied the way the model does for
    sdpa: a boolean mask ``& selected``, an additive one filled with the dtype's minimum off the selection;
    ``None`` (or a 2-D padding mask) becomes the boolean visibility of :func:`visible_mask` first.
    """
    indices = kwargs.pop("indices", None)
    if indices is None:
        return attention_mask
    if not isinstance(indices, torch.Tensor) or indices.dim() != 3 or indices.shape[:2] != (batch, q_len):
        raise InvalidInputError(
            f"{module_label(module)}: indices= must be an integer tensor [b, q_len, topk] = [{batch}, {q_len}, k], "
            f"got {getattr(indices, 'shape', type(indices).__name__)}")
    selected = torch.zeros(batch, q_len, kv_len, dtype=torch.bool, device=device)
    selected = selected.scatter(-1, indices.long().to(device), True)[:, None]
    if attention_mask is None or attention_mask.dim() == 2:
        causal = _is_causal(module, kwargs)
        return visible_mask(attention_mask, batch, q_len, kv_len, causal, device)[:, None] & selected
    if attention_mask.dtype == torch.bool:
        return attention_mask & selected
    return attention_mask.masked_fill(~selected, torch.finfo(attention_mask.dtype).min)


def _is_causal(module: torch.nn.Module, kwargs: dict[str, Any]) -> bool:
    ic = kwargs.get("is_causal")
    return bool(getattr(module, "is_causal", True) if ic is None else ic)


def _sliding_window(module: torch.nn.Module, kwargs: dict[str, Any]) -> int | None:
    if "sliding_window" in kwargs:
        return kwargs["sliding_window"]
    return getattr(module, "sliding_window", None)


def visible_mask(mask: torch.Tensor | None, b: int, q_len: int, kv_len: int, causal: bool,
                 device: torch.device) -> torch.Tensor:
    """Boolean ``[b, q_len, kv_len]``: which key each query row may attend.

    ``mask`` is anything :func:`sv_attention.ops.masking.to_bool_mask` accepts; its head dimension must
    be 1 (transformers' masks are shared by the heads). ``None`` follows sdpa: all keys when not causal
    or ``q_len == 1``, else ``j <= i``. A 2-D padding mask on a causal layer gets causality added (queries
    are the last ``q_len`` positions).
    """
    bm = to_bool_mask(mask, q_len, kv_len)
    if bm is None:
        if not causal or q_len == 1:
            return torch.ones(b, q_len, kv_len, dtype=torch.bool, device=device)
        tri = torch.arange(kv_len, device=device)[None, :] <= torch.arange(q_len, device=device)[:, None]
        return tri[None].expand(b, q_len, kv_len)
    if mask.dim() == 2 and causal:  # a 2-D padding mask carries no causality: queries are the last positions
        tri = torch.arange(kv_len, device=device)[None, :] <= torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
        bm = bm.to(device) & tri[None, None]
    if bm.shape[1] != 1:
        if not bool((bm == bm[:, :1]).all()):
            raise MaskError(f"per-head attention masks {tuple(bm.shape)} are not supported; pass one mask shared "
                            "by the heads ([b, 1, q, kv])")
        bm = bm[:, :1]
    return bm[:, 0].to(device).expand(b, q_len, kv_len)


#: The notice (once per process) on the first gated call of a sliding-window layer.
SLIDING_NOTICE = (
    "sv_attention on sliding-window layers (window rule, sv_attention.ops.sv_gate.schedule): a query whose "
    "window covers every earlier key reads exactly the full-attention gate; a query whose window has dropped the "
    "oldest keys reads a gate fitted on the keys its window leaves visible before its chunk boundary (refitted per "
    "distinct window start, not kept across decode steps); keys outside the window are not attended and not "
    "gated; a query with fewer than ceil(1/C) + 2 gated keys in its window, or in chunk 0, reads plain softmax. "
    "Set sliding_window='softmax' for plain softmax on these layers or 'refuse' to refuse them.")
#: attribute of an attention module holding the key positions of a sliding-window layer (:func:`_window_positions`)
POSITIONS_ATTR = "_sv_attention_positions"


def _window_positions(module: torch.nn.Module, key: torch.Tensor, visible: torch.Tensor,
                      keep: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Which key columns are real keys and how many valid keys a rolling cache dropped before column 0.

    A sliding-window layer's decode step sees only its window: keys out of it are invisible but are not
    padding, and a rolling cache (``DynamicSlidingWindowLayer``) drops the oldest columns. Both are read off
    the previous call of the module (kept when ``keep``): when its last key columns equal this call's first
    ``kv - q`` ones (first feature, compared exactly), the dropped columns and the old columns' validity
    come from it; otherwise (a fresh prefill) a key is valid when some query sees it and nothing was dropped.

    Returns
    -------
    valid : bool ``[b, kv]``; base : long ``[b]``
    """
    b, g, kv, _ = key.shape
    q = visible.shape[1]
    now = visible.any(1)
    fp = key[:, :, :, 0].detach()
    valid, base = now, torch.zeros(b, dtype=torch.long, device=key.device)
    prev = module.__dict__.get(POSITIONS_ATTR) if keep else None
    kept = kv - q
    if prev is not None and prev[0].shape[:2] == (b, g) and 0 < kept <= prev[0].shape[-1]:
        old_fp, old_valid, old_base = prev
        dropped = old_fp.shape[-1] - kept
        if torch.equal(old_fp[..., dropped:], fp[..., :kept]):
            base = old_base + old_valid[:, :dropped].sum(-1)
            valid = torch.cat([old_valid[:, dropped:], now[:, kept:]], 1)
    if keep:
        module.__dict__[POSITIONS_ATTR] = (fp.clone(), valid, base)
    return valid, base


@dataclass
class FixedKeysGate:
    """The gate of a non-causal layer kept for the next call on the same keys (cross-attention: the encoder
    keys do not change during a generation, so the gate is fitted once per generation).

    Attributes
    ----------
    fingerprint : Tensor ``[b, g, kv]``  first feature of every key (compared exactly)
    valid : bool Tensor ``[b, kv]``  keys some query may attend
    settings : SVSettings  the settings object the gate was fitted with (compared by identity)
    gate : Gate
    """

    fingerprint: torch.Tensor
    valid: torch.Tensor
    settings: SVSettings
    gate: Gate


def _reusable_gate(held: Any, key: torch.Tensor, visible: torch.Tensor, settings: SVSettings) -> Gate | None:
    """The kept non-causal gate when it was fitted on exactly these keys, visibility and settings."""
    if not isinstance(held, FixedKeysGate) or held.settings is not settings \
            or held.fingerprint.shape != key.shape[:3] or held.valid.shape != (key.shape[0], key.shape[2]):
        return None
    if not (torch.equal(held.fingerprint, key[:, :, :, 0]) and torch.equal(held.valid, visible.any(1))):
        return None
    count("cross_gate_reused")
    return held.gate


def _handoff_bias(handoff: GateHandoff, visible: torch.Tensor, causal: bool, b: int, g: int, q_len: int,
                  kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-bias and visibility from a gate deposited by a certified cache."""
    w = handoff.weights
    if w.dim() != 4 or w.shape[-2:] != (q_len, kv_len) or w.shape[1] not in (1, g) or w.shape[0] not in (1, b):
        raise InvalidInputError(
            f"gate handoff for layer {handoff.layer_idx} has weights {tuple(w.shape)}, expected "
            f"[{b}, {g}, {q_len}, {kv_len}]; the cache and the attention call disagree")
    if causal and handoff.key_positions is not None and handoff.query_positions is not None:
        kp = handoff.key_positions.to(visible.device)
        qp = handoff.query_positions.to(visible.device)
        visible = visible & (kp[None, None, :] <= qp[None, :, None])
    bias = torch.log(w.to(torch.float32).clamp_min(0.0)).expand(b, g, q_len, kv_len)
    return bias, visible


def sv_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SV-Attention on a pretrained model: softmax-hybrid readout with a chunk-frozen SVDD gate.

    Per (sequence, layer, kv-head), queries at positions ``[s, s + chunk)`` read the gate fitted on the
    keys at positions ``< s`` (DESIGN §2.5; see :mod:`sv_attention.ops.sv_gate`): softmax weights times
    ``alpha_j`` on that prefix, times 1 on the local chunk, renormalised. Chunk 0 and warm-up are plain
    causal softmax. Encoders (``is_causal=False``) use one gate per sequence on all valid keys.

    A gate deposited by a certified cache for this layer (:mod:`sv_attention.hf.gate_handoff`) is used
    instead of computing one: its weights multiply the softmax; causality follows its key / query
    positions when given (evicted slots make columns differ from positions); the mask's padding is kept
    (a mask built over positions, wider than the returned slots, is read at the columns ``key_positions``).

    Parameters
    ----------
    module : the transformers attention module (reads ``config``, ``layer_idx``, ``is_causal``,
        ``sliding_window``, ``training``)
    query : Tensor ``[b, h, q_len, d]``
    key, value : Tensor ``[b, h_kv, kv_len, d]``
    attention_mask : None, bool / additive float ``[b, 1, q_len, kv_len]`` or 2-D ``[b, kv_len]``
    dropout : float  attention-weight dropout probability (the model passes 0 outside training)
    scaling : float or None  logit scale (``d ** -0.5`` when None)
    **kwargs : ``output_attentions``, ``use_cache``, ``sliding_window``, ``is_causal`` are read; ``indices``
        (a DeepSeek-V3.2-style top-k key selection) is folded into the mask (:func:`fold_indices`);
        ``softcap`` / ``s_aux`` / ``position_bias`` / ``block_indices`` raise UnsupportedFeatureError; others
        are ignored.

    Returns
    -------
    out : Tensor ``[b, q_len, h, d]``
    weights : Tensor ``[b, h, q_len, kv_len]`` when ``output_attentions`` else None

    Notes
    -----
    Eagerly this is :func:`sv_attention_eager`. Under ``torch.compile`` (:mod:`torch._dynamo` tracing) a call
    that needs no autograd graph is one opaque operator (:func:`compiled_call`): the whole layer call, the gate
    fit included, runs eagerly inside it, so a model traces to one graph without a break; a call that needs
    gradients is one operator with a backward formula, or (``detach_gate=False``, dropout, weights, half
    precision) runs :func:`sv_attention_eager` behind one ``torch.compiler.disable`` boundary.
    """
    if torch.compiler.is_compiling():
        return compiled_call(module, query, key, value, attention_mask, dropout, scaling, kwargs)
    return sv_attention_eager(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


def sv_attention_eager(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The eager body of :func:`sv_attention_forward` (same arguments and result)."""
    out, weights, _ = _eager_call(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    return out, weights


@dataclass
class Readout:
    """How a layer call read its values (:func:`_eager_call`), for the compiled training path's backward.

    Attributes
    ----------
    visible : bool Tensor ``[b, q, kv]``  the visibility the readout used
    bias : GateBias, Tensor ``[b, g, 1, kv]`` or None  the gate's log-bias (None: no gate)
    handoff : bool  the bias came from a certified cache's gate handoff (not representable as key columns)
    """

    visible: torch.Tensor
    bias: Any
    handoff: bool = False


def _eager_call(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None, Readout]:
    """:func:`sv_attention_eager`, also returning how the values were read (:class:`Readout`)."""
    settings: SVSettings = module_settings(module, SV_NAME)  # type: ignore[assignment]
    ensure_compatible(module, SV_NAME, settings)
    _refuse_unsupported(SV_NAME, module, kwargs)
    check_gqa(query, key, value)
    b, h, q_len, d = query.shape
    g, kv_len = key.shape[1], key.shape[2]
    attention_mask = fold_indices(module, attention_mask, kwargs, q_len, kv_len, b, query.device)
    sc = float(scaling) if scaling is not None else d ** -0.5
    causal = _is_causal(module, kwargs)
    layer_idx = getattr(module, "layer_idx", None)
    output_attentions = bool(kwargs.get("output_attentions"))
    handoff = pop_pending_gate(layer_idx)
    if handoff is not None and handoff.key_positions is not None and isinstance(attention_mask, torch.Tensor):
        # a certified cache builds the mask over positions; its slots are the columns at key_positions
        kp = handoff.key_positions.to(attention_mask.device, torch.long)
        if attention_mask.shape[-1] != kv_len and attention_mask.shape[-1] > int(kp.max()):
            attention_mask = attention_mask.index_select(-1, kp)
    visible = visible_mask(attention_mask, b, q_len, kv_len, causal, query.device)
    if handoff is not None:
        bias, visible = _handoff_bias(handoff, visible, causal, b, g, q_len, kv_len)
        out, weights = grouped_attention(query, key, value, visible, bias, sc, float(dropout))
        return out.transpose(1, 2).contiguous(), (weights if output_attentions else None), \
            Readout(visible, bias, handoff=True)
    window = _sliding_window(module, kwargs)
    if window is not None and settings.gated:
        if settings.sliding_window == "refuse":
            raise UnsupportedFeatureError(
                f"{module_label(module)} uses a sliding window ({window}); sv_attention was configured with "
                "sliding_window='refuse'. Use sliding_window='gate' (the default) or disable the window in the "
                "model config")
        if settings.sliding_window == "softmax":
            warn_once("sliding-softmax", "sv_attention: sliding_window='softmax': layers with a sliding window run "
                      "plain softmax inside the window (the window is honoured, the SV gate is not applied there)")
            settings = settings.replace(gated=False)
        else:
            warn_once("sliding-gate", SLIDING_NOTICE)
    keep_state = bool(kwargs.get("use_cache", True)) and not module.training
    state = module.__dict__.get(STATE_ATTR) if keep_state else None
    valid, base = (_window_positions(module, key, visible, keep_state)
                   if causal and window is not None and settings.gated else (None, None))
    fitted = _reusable_gate(state, key, visible, settings) if keep_state and not causal and settings.gated else None
    result = sv_gate_attention(query, key, value, visible, settings, scaling=sc, causal=causal,
                               state=state if isinstance(state, GateState) else None, keep_state=keep_state,
                               dropout=float(dropout), return_weights=output_attentions, valid=valid, base=base,
                               gate=fitted)
    if keep_state and causal:
        module.__dict__[STATE_ATTR] = result.state
    elif keep_state and settings.gated and result.gate is not None and fitted is None:
        module.__dict__[STATE_ATTR] = FixedKeysGate(key_fingerprint(key), visible.any(1), settings, result.gate)
    return result.out.transpose(1, 2).contiguous(), result.weights, \
        Readout(visible, None if result.gate is None else result.gate.bias)


# ------------------------------------------------------------------------------------------------------------
# sv_attention under torch.compile: the layer call as one opaque operator
# ------------------------------------------------------------------------------------------------------------
#: The attention modules a compiled graph calls the operator for, by number (filled while tracing), and back.
_TRACED_MODULES: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()
_MODULE_NUMBERS: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()
_NEXT_NUMBER = itertools.count()
#: Schema of :func:`_layer_call` (written out: ``infer_schema`` of older torch misreads postponed annotations).
_LAYER_CALL_SCHEMA = ("(Tensor query, Tensor key, Tensor value, Tensor? attention_mask, Tensor? indices, int module_number, "
                      "float dropout, float? scaling, bool use_cache, bool output_attentions, bool? is_causal, "
                      "bool has_window, int? sliding_window) -> (Tensor, Tensor)")


def _assume_constant(fn):
    """``torch._dynamo.assume_constant_result`` (run once while tracing, its result a constant)."""
    mark = getattr(torch._dynamo, "assume_constant_result", None)
    return fn if mark is None else mark(fn)


@_assume_constant
def remember_module(module: torch.nn.Module) -> int:
    """The number of ``module`` for the operator, recorded weakly; runs at trace time only (its result is a
    constant of the graph). Numbers count from 0 in tracing order, so the same program traces the same graph
    in every process (``id`` would not, defeating inductor's graph cache)."""
    number = _MODULE_NUMBERS.get(module)
    if number is None:
        number = _MODULE_NUMBERS[module] = next(_NEXT_NUMBER)
        _TRACED_MODULES[number] = module
    return number


def _traced_module(module_number: int) -> torch.nn.Module:
    module = _TRACED_MODULES.get(module_number)
    if module is None:
        raise InvalidInputError(
            "a compiled sv_attention graph called an attention module that no longer exists; call "
            "torch._dynamo.reset() (or compile the model again) after replacing its modules")
    return module


def _call_kwargs(use_cache: bool, is_causal: bool | None, has_window: bool, sliding_window: int | None,
                 indices: torch.Tensor | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"use_cache": use_cache}
    if is_causal is not None:
        kwargs["is_causal"] = is_causal
    if has_window:
        kwargs["sliding_window"] = sliding_window
    if indices is not None:
        kwargs["indices"] = indices
    return kwargs


@torch.library.custom_op("sv_attention::layer_call", mutates_args=(), schema=_LAYER_CALL_SCHEMA)
def _layer_call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                indices: torch.Tensor | None, module_number: int, dropout: float, scaling: float | None,
                use_cache: bool, output_attentions: bool, is_causal: bool | None, has_window: bool,
                sliding_window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One eager :func:`sv_attention_eager` call of the module numbered ``module_number`` (see :func:`compiled_call`).

    Returns
    -------
    out : Tensor ``[b, q_len, h, dv]``
    weights : Tensor ``[b, h, q_len, kv_len]`` with ``output_attentions``, else an empty tensor
    """
    module = _traced_module(module_number)
    kwargs = _call_kwargs(use_cache, is_causal, has_window, sliding_window, indices)
    kwargs["output_attentions"] = output_attentions
    out, weights = sv_attention_eager(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    return out, (weights if weights is not None else query.new_empty(0))


@_layer_call.register_fake
def _layer_call_fake(query, key, value, attention_mask, indices, module_number, dropout, scaling, use_cache,
                     output_attentions, is_causal, has_window, sliding_window):
    b, h, q_len, _ = query.shape
    out = query.new_empty(b, q_len, h, value.shape[-1])
    weights = query.new_empty(b, h, q_len, key.shape[2]) if output_attentions else query.new_empty(0)
    return out, weights


# ------------------------------------------------------------------------------------------------------------
# sv_attention under torch.compile with autograd: the layer call as one operator with a backward formula
# ------------------------------------------------------------------------------------------------------------
#: Schema of :func:`_trainable_call` (a layer call without dropout or weights: what the formula covers).
_TRAINABLE_CALL_SCHEMA = ("(Tensor query, Tensor key, Tensor value, Tensor? attention_mask, Tensor? indices, "
                          "int module_number, float? scaling, bool use_cache, bool? is_causal, bool has_window, "
                          "int? sliding_window, int slot_bound) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
#: Schema of :func:`_readout_grads` (the backward of :func:`_trainable_call`).
_READOUT_GRADS_SCHEMA = ("(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor cols, Tensor onehot, "
                         "Tensor visible, Tensor slots, Tensor? attention_mask, Tensor? indices, int module_number, "
                         "float? scaling, bool? is_causal, bool has_window, int? sliding_window) "
                         "-> (Tensor, Tensor, Tensor)")
#: ``slots`` codes of :func:`_trainable_call` besides a column count: no gate (plain softmax readout), and a
#: gate with more slots than the static bound (the backward recomputes the layer call).
_NO_GATE, _RECOMPUTE = -1, -2


@_assume_constant
def _formula_settings(module: torch.nn.Module) -> tuple[bool, bool, int]:
    """``(detach_gate, gated, chunk)`` of the module's settings when traced (a constant of the graph; the
    operator checks at run time that the gate still fits what the trace assumed). ``(False, False, 1)`` when
    the settings do not resolve (the eager boundary then raises the error)."""
    try:
        settings: SVSettings = module_settings(module, SV_NAME)  # type: ignore[assignment]
    except Exception:  # noqa: BLE001 -- the eager call raises it, with its message
        return False, False, 1
    return bool(settings.detach_gate), bool(settings.gated), int(settings.chunk)


def _slot_bound(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, dropout: Any,
                kwargs: dict[str, Any]) -> int | None:
    """The static number of gate slots :func:`_trainable_call` returns for this call, or None when the backward
    formula does not cover the call (it then runs :func:`eager_boundary`).

    The formula covers a call whose output depends on query, key and value only through the readout
    ``softmax(scale q k^T + bias)`` with a constant bias: a detached gate (``detach_gate=True``), no dropout,
    no weights asked for, fp32 / fp64. Slots: 0 without a gate, 1 for a non-causal gate; a causal gate has
    one per chunk boundary read, ``<= (kv - 1) // chunk`` (key positions are below ``kv``), and one per
    window-rule gate (sliding windows, packed documents), which the bound does not count: such a call
    returns no columns and its backward recomputes the layer call (training: no decoding state, the same
    deterministic gate). A call keeping decoding state (not training, ``use_cache``) may reuse gates of
    its state: its bound is ``b * q`` (each slot is read by some query row), so it never recomputes.
    """
    if kwargs.get("output_attentions") or float(dropout) != 0.0 \
            or query.dtype not in (torch.float32, torch.float64) or key.dtype != query.dtype:
        return None
    detach_gate, gated, chunk = _formula_settings(module)
    if not detach_gate:
        return None
    if not gated:
        return 0
    if not _is_causal(module, kwargs):
        return 1
    b, q, kv = query.shape[0], query.shape[2], key.shape[2]
    if bool(kwargs.get("use_cache", True)) and not module.training:
        return b * q
    return min(b * q, max(kv - 1, 0) // chunk)


@torch.library.custom_op("sv_attention::trainable_layer_call", mutates_args=(), schema=_TRAINABLE_CALL_SCHEMA)
def _trainable_call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, indices: torch.Tensor | None, module_number: int,
                    scaling: float | None, use_cache: bool, is_causal: bool | None, has_window: bool,
                    sliding_window: int | None, slot_bound: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One eager layer call (no dropout, no weights) of the module numbered ``module_number``, with what its
    backward needs to recompute the readout without the gate fit (see :func:`compiled_call`).

    Returns
    -------
    out : Tensor ``[b, q_len, h, dv]``
    cols : Tensor ``[b, g, kv, slot_bound]``  the gate's key columns (:func:`~sv_attention.ops.sv_gate.fused.gate_columns`),
        zero past the used slots
    onehot : Tensor ``[b, q_len, slot_bound]``  each query row's slot, zero past the used slots
    visible : bool Tensor ``[b, q_len, kv]``  the visibility the readout used
    slots : long scalar Tensor (CPU)  the used slots; ``-1``: no gate (plain softmax readout); ``-2``: more
        slots than ``slot_bound`` (the backward recomputes the call)
    """
    from sv_attention.ops.sv_gate.fused import gate_columns

    module = _traced_module(module_number)
    kwargs = _call_kwargs(use_cache, is_causal, has_window, sliding_window, indices)
    out, _, readout = _eager_call(module, query, key, value, attention_mask, 0.0, scaling, **kwargs)
    b, _, q, _ = query.shape
    g, kv = key.shape[1], key.shape[2]
    if readout.handoff:
        raise UnsupportedFeatureError(
            f"{module_label(module)}: a gate handed off by a certified cache cannot be differentiated under "
            "torch.compile; run this call eagerly or without gradients")
    settings: SVSettings = module_settings(module, SV_NAME)  # type: ignore[assignment]
    if not settings.detach_gate:
        raise InvalidInputError(
            f"{module_label(module)}: the sv_attention settings changed to detach_gate=False after the model was "
            "compiled; call torch._dynamo.reset() (or compile the model again)")
    cols = query.new_zeros(b, g, kv, slot_bound)
    onehot = query.new_zeros(b, q, slot_bound)
    n = _NO_GATE
    if readout.bias is not None:
        c, o = gate_columns(readout.bias, b, g, q, kv, query.dtype)
        n = c.shape[-1]
        if n <= slot_bound:
            cols[..., :n] = c
            onehot[..., :n] = o
        else:
            n = _RECOMPUTE
    visible = readout.visible.clone(memory_format=torch.contiguous_format)
    return out, cols, onehot, visible, torch.tensor(n, dtype=torch.long)


@_trainable_call.register_fake
def _trainable_call_fake(query, key, value, attention_mask, indices, module_number, scaling, use_cache, is_causal,
                         has_window, sliding_window, slot_bound):
    b, h, q, _ = query.shape
    g, kv = key.shape[1], key.shape[2]
    return (query.new_empty(b, q, h, value.shape[-1]), query.new_empty(b, g, kv, slot_bound),
            query.new_empty(b, q, slot_bound), query.new_empty(b, q, kv, dtype=torch.bool),
            torch.empty((), dtype=torch.long))


def _autograd_inside_operator() -> contextlib.AbstractContextManager[Any]:
    """Autograd back on inside a custom operator's implementation (which the dispatcher runs below the
    autograd keys): the thread's dispatch-key sets with the autograd keys no longer excluded, restored on exit."""
    C = torch._C
    if not all(hasattr(C, n) for n in ("_ForceDispatchKeyGuard", "_dispatch_tls_local_exclude_set",
                                       "_dispatch_tls_local_include_set")):
        return contextlib.nullcontext()
    exclude = C._dispatch_tls_local_exclude_set()
    for k in (C.DispatchKey.AutogradFunctionality, C.DispatchKey.AutogradOther, C.DispatchKey.AutogradNestedTensor):
        exclude = exclude.remove(k)
    return C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), exclude)


def _columns_bias(cols: torch.Tensor, onehot: torch.Tensor) -> GateBias:
    """The log-gate whose key columns and query one-hots
    (:func:`~sv_attention.ops.sv_gate.fused.gate_columns`) are exactly ``cols [b, g, kv, T]`` and
    ``onehot [b, q, T]``: a table of ``T`` slots over the key columns (plus the ungated slot ``T``), each key at
    its own column, each row at its one-hot's slot. :func:`~sv_attention.ops.sv_gate.fused.fused_gated_sdpa` on it
    runs the very computation of the call that produced the columns."""
    b, g, kv, T = cols.shape
    table = torch.cat([cols.transpose(2, 3), cols.new_zeros(b, g, 1, kv)], 2)  # [b, g, T + 1, kv]
    slot = torch.where(onehot.bool().any(-1), onehot.argmax(-1), torch.full_like(onehot[..., 0], T, dtype=torch.long))
    position = torch.arange(kv, device=cols.device).expand(b, kv)
    return GateBias(log_table=table, slot=slot, key_position=position)


@torch.library.custom_op("sv_attention::readout_grads", mutates_args=(), schema=_READOUT_GRADS_SCHEMA)
def _readout_grads(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   cols: torch.Tensor, onehot: torch.Tensor, visible: torch.Tensor, slots: torch.Tensor,
                   attention_mask: torch.Tensor | None, indices: torch.Tensor | None, module_number: int,
                   scaling: float | None, is_causal: bool | None, has_window: bool, sliding_window: int | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`_trainable_call`'s output with respect to query, key and value: the readout the
    call ran (the fused gated SDPA on the kept key columns, or the plain softmax readout without a gate)
    recomputed with autograd, the gate a constant (``detach_gate``); a call whose gate had more slots than
    its bound is recomputed whole (``use_cache=False``: no decoding state is read or written)."""
    from sv_attention.ops.sv_gate.fused import fused_gated_sdpa

    n = int(slots)
    q, d = query.shape[2], query.shape[3]
    sc = float(scaling) if scaling is not None else d ** -0.5
    if q == 0:
        return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    with _autograd_inside_operator(), torch.enable_grad():
        qg, kg, vg = (t.detach().requires_grad_() for t in (query, key, value))
        if n == _RECOMPUTE:
            module = _traced_module(module_number)
            kwargs = _call_kwargs(False, is_causal, has_window, sliding_window, indices)
            out, _, readout = _eager_call(module, qg, kg, vg, attention_mask, 0.0, scaling, **kwargs)
            if readout.handoff:  # a gate deposited for this layer's next call, taken here: not this call's gate
                raise UnsupportedFeatureError(
                    f"{module_label(module)}: a certified cache handed off a gate while a compiled backward "
                    "recomputed this layer call; run the backward before the next cached call")
        else:
            if n == _NO_GATE:
                out = grouped_attention(qg, kg, vg, visible, None, sc, 0.0)[0]
            else:
                out = fused_gated_sdpa(qg, kg, vg, visible, _columns_bias(cols[..., :n], onehot[..., :n]), sc)
            out = out.transpose(1, 2).contiguous()
        grads = torch.autograd.grad(out, (qg, kg, vg), grad_out, allow_unused=True)
    # laid out like the inputs, as the fake implementation says (a compiler checks the strides)
    return tuple(torch.zeros_like(t) if gr is None else torch.empty_like(t).copy_(gr)
                 for gr, t in zip(grads, (query, key, value)))


@_readout_grads.register_fake
def _readout_grads_fake(grad_out, query, key, value, cols, onehot, visible, slots, attention_mask, indices,
                        module_number, scaling, is_causal, has_window, sliding_window):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _trainable_setup(ctx, inputs, output) -> None:
    query, key, value, attention_mask, indices, module_number, scaling, _, is_causal, has_window, sliding_window, \
        _ = inputs
    _, cols, onehot, visible, slots = output
    ctx.save_for_backward(query, key, value, cols, onehot, visible, slots, attention_mask, indices)
    ctx.call = (module_number, scaling, is_causal, has_window, sliding_window)
    ctx.mark_non_differentiable(cols, onehot, visible, slots)


def _trainable_backward(ctx, grad_out, *_):
    query, key, value, cols, onehot, visible, slots, attention_mask, indices = ctx.saved_tensors
    dq, dk, dv = torch.ops.sv_attention.readout_grads(grad_out, query, key, value, cols, onehot, visible, slots,
                                                      attention_mask, indices, *ctx.call)
    return (dq, dk, dv) + (None,) * 9


_trainable_call.register_autograd(_trainable_backward, setup_context=_trainable_setup)


#: :func:`sv_attention_eager` behind one ``torch.compiler.disable`` boundary (calls that need gradients the
#: backward formula of :func:`_trainable_call` does not cover).
eager_boundary = torch.compiler.disable(sv_attention_eager)


def _operator_ready(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, dropout: Any,
                    scaling: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a traced call can be one of the opaque operators: every argument the eager body reads has a
    type the operators carry, and no refused argument is passed (the eager body then raises)."""
    if any(kwargs.get(k) is not None for k in _UNSUPPORTED):
        return False
    window = kwargs.get("sliding_window")
    return (attention_mask is None or isinstance(attention_mask, torch.Tensor)) \
        and isinstance(kwargs.get("indices"), (torch.Tensor, type(None))) \
        and isinstance(dropout, (int, float)) and isinstance(scaling, (int, float, type(None))) \
        and isinstance(kwargs.get("is_causal"), (bool, type(None))) \
        and (window is None or (isinstance(window, int) and not isinstance(window, bool)))


def compiled_call(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: Any, scaling: Any,
                  kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`sv_attention_forward` while :mod:`torch._dynamo` traces it.

    The gate fit is data-dependent (boundaries, active sets, decoding state kept on the module), so the
    layer call runs eagerly either way. Without autograd it is the custom operator
    ``torch.ops.sv_attention.layer_call``: opaque to the tracer, it is a node of the graph, not a graph
    break, and its output shapes follow from the inputs. The module travels as a number
    (:func:`remember_module`, a constant of the graph; the trace guards on the module's identity). A call that
    needs gradients is the operator ``torch.ops.sv_attention.trainable_layer_call`` (:func:`_trainable_call`):
    the same eager call, which also returns the gate as padded key columns and one-hots and the visibility, and
    whose backward (:func:`_readout_grads`, opaque too) recomputes the readout on them with autograd; no
    graph break either. A call the formula does not cover (:func:`_slot_bound`) or that carries an argument
    the operators do not runs :func:`eager_boundary` instead: one graph break.

    Returns
    -------
    As :func:`sv_attention_forward`.
    """
    if not _operator_ready(query, key, value, attention_mask, dropout, scaling, kwargs):
        return eager_boundary(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    slot_bound = _slot_bound(module, query, key, dropout, kwargs) if grad else None
    if grad and slot_bound is None:
        return eager_boundary(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    id(module)  # traced: guards the graph on this very module (the number below is a constant without a guard)
    number = remember_module(module)
    if grad:
        out = _trainable_call(
            query, key, value, attention_mask, kwargs.get("indices"), number,
            None if scaling is None else float(scaling), bool(kwargs.get("use_cache", True)), kwargs.get("is_causal"),
            "sliding_window" in kwargs, kwargs.get("sliding_window"), slot_bound)[0]
        return out, None
    output_attentions = bool(kwargs.get("output_attentions"))
    out, weights = _layer_call(
        query, key, value, attention_mask, kwargs.get("indices"), number, float(dropout),
        None if scaling is None else float(scaling), bool(kwargs.get("use_cache", True)), output_attentions,
        kwargs.get("is_causal"), "sliding_window" in kwargs, kwargs.get("sliding_window"))
    return out, (weights if output_attentions else None)


# ------------------------------------------------------------------------------------------------------------
# ceq
# ------------------------------------------------------------------------------------------------------------
def _path_weight(module: torch.nn.Module, settings: CeqSettings) -> float | torch.Tensor:
    """The hop weight ``alpha``: the module's own learned ``ceq_alpha`` when the module belongs to an sv_lm
    model whose operator is ceq (the plug-in then computes what the model computes), else the setting."""
    params = getattr(module, "_parameters", None)  # (a dict lookup: getattr on a Module falls back slowly)
    own = params.get("ceq_alpha") if isinstance(params, dict) else getattr(module, "ceq_alpha", None)
    if isinstance(own, torch.Tensor) and twin_operator(getattr(module, "config", None), CEQ_NAME) == "ceq":
        return own
    return settings.path_weight


def ceq_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ceq on a pretrained model: the model's own sdpa attention plus ``sum_{h<=K} (alpha A)^h v``.

    A thin caller of :func:`sv_attention.ops.ceq.ceq_layer_attention` (the entry the remote-code model's
    ceq operators call too). The stock term is transformers' ``sdpa_attention_forward`` on the mask the
    paired ``"ceq"`` mask function built (sdpa's own), so ``alpha = 0`` is bitwise the model's sdpa output.
    Decoding with the model's cache extends the layer's hop history
    (:class:`sv_attention.ops.ceq.HopState`), kept on the module and checked against the keys on every
    call, equal to the no-cache recomputation.

    Parameters
    ----------
    module, query, key, value, attention_mask, dropout, scaling
        As for :func:`sv_attention_forward`.
    **kwargs : ``output_attentions`` (returns the ceq matrix A ``[b, h, q, kv]``), ``use_cache``,
        ``sliding_window``, ``is_causal`` are read; ``indices`` is folded into the mask;
        ``softcap`` / ``s_aux`` / ``position_bias`` / ``block_indices`` raise.

    Returns
    -------
    out : Tensor ``[b, q_len, h, d]``
    weights : the ceq matrix ``A`` when ``output_attentions`` else None

    Raises
    ------
    UnsupportedFeatureError
        Hops on a non-causal (encoder) layer (ceq is a causal operator; ``alpha = 0`` is allowed), or
        queries that are not the last key columns (a static cache).
    HopCacheError
        A decode step whose hop history is unknown (see :func:`reset_state`).
    """
    settings: CeqSettings = module_settings(module, CEQ_NAME)  # type: ignore[assignment]
    ensure_compatible(module, CEQ_NAME, settings)
    _refuse_unsupported(CEQ_NAME, module, kwargs)
    unselected = attention_mask  # the layout (queries = last key columns) is checked before the selection
    attention_mask = fold_indices(module, attention_mask, kwargs, query.shape[2], key.shape[2], query.shape[0],
                                  query.device)
    weight = _path_weight(module, settings)
    output_attentions = bool(kwargs.get("output_attentions"))
    stock_only = settings.form == "hybrid" and isinstance(weight, float) and weight == 0.0
    if stock_only and not output_attentions:
        # fast path: exactly the model's sdpa call (same function, same arguments), bitwise and as fast
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                        scaling=scaling, **kwargs)
        return out, None
    check_gqa(query, key, value)
    causal = _is_causal(module, kwargs)
    training = bool(module.training)
    layer_idx = getattr(module, "layer_idx", None)
    if stock_only:  # with output_attentions: the sdpa output and the ceq matrix A
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=float(dropout),
                                        scaling=scaling, **kwargs)
        p = settings.resolved()
        weights = ceq_matrix(query, key, attention_mask, operator=p["variant"], rho=p["rho"],
                             lam=p["lam"] if p["variant"] == "sgate" else None, scaling=scaling)
        return out.contiguous(), weights
    if not causal:
        raise UnsupportedFeatureError(
            f"{module_label(module)}: ceq hops are causal (A is strictly lower-triangular) but this layer is not "
            "causal (an encoder); use path_weight=0 or another attention implementation there")
    if unselected is not attention_mask:
        from sv_attention.ops.ceq.state import require_queries_last

        require_queries_last(unselected, query.shape[2], key.shape[2], layer_idx)
    keep_state = bool(kwargs.get("use_cache", True)) and not training
    held = module.__dict__.get(STATE_ATTR)
    result = ceq_layer_attention(
        query, key, value, attention_mask, settings, path_weight=weight, scaling=scaling, dropout=float(dropout),
        training=training or float(dropout) > 0.0, is_causal=causal,
        state=held if isinstance(held, HopState) else None, keep_state=keep_state,
        sliding=_sliding_window(module, kwargs) is not None, layer_idx=layer_idx, return_weights=output_attentions,
        check_layout=unselected is attention_mask)
    if keep_state:
        module.__dict__[STATE_ATTR] = result.state
    return result.out.transpose(1, 2).contiguous(), result.weights
