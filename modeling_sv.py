"""The sv-attention byte-level causal language model (remote code).

Loaded with ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)``. The backbone is a
pre-norm decoder (token + learned positional embeddings, GELU MLP, LayerNorm with bias, weight-tied
output head) identical for every operator; ``config.operator`` selects the attention operator.

Attention dispatch
------------------
Every attention layer calls ``ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
sv_operator_attention)``. The model declares no SDPA / flash / flex support, so the default
implementation resolves to ``"eager"``, which is not in the registry, so the default argument
:func:`sv_operator_attention` runs: the operator named by ``config.operator``. ``set_attn_implementation``
with a registered name (e.g. the ``"sv_attention"`` / ``"ceq"`` functions the ``sv_attention.hf`` plugin
registers) swaps the function in place; ``"eager"`` switches back to ``config.operator``.

The attention function receives a boolean mask ``[b, 1, q, kv]`` (True = attend; causal and padding
already applied) and the keyword arguments ``operator_state`` (a per-layer dict held by the cache, or
None), ``query_slots`` ``[q]`` and ``key_slots`` ``[kv]`` (sequence indices of the rows / columns) and
``hidden_states`` (the layer input, read by smprime's gate heads); other functions ignore them.

Operators (building blocks from the installed ``sv_attention`` package)
---------------------------------------------------------------------
``softmax`` (``sv_attention.ops.ceq.stock_attention``, transformers' SDPA path), ``swa`` (the same with a
window), ``sv`` (``sv_attention.ops.sv_gate.sv_gate_attention`` + its ``GateState``), ``ceq`` /
``ceq_path_sum`` (``sv_attention.ops.ceq.ceq_layer_attention`` + its ``HopState``), ``smprime``
(``sv_attention.ops.smprime.smprime_layer_attention`` + its ``SMPrimeState``): the same entry points the
plug-in calls. Explicit-weight references sit beside them (:func:`softmax_reference`) and in the package
(``ceq_attention_reference``, ``naive_sv_gate_attention``, ``smprime_reference``). Every operator's
settings are one dataclass of ``sv_attention.ops.settings``
(``SVConfig.operator_config`` holds its dict), resolved once per layer (``SVAttention.operator_settings``).

Caching
-------
:class:`SVLMCache` is a ``DynamicCache`` with a per-layer ``operator_state`` dict (ceq hop histories,
SV gate state). ``generate`` builds one automatically. Both ``cache=`` (transformers >= 5.24) and
``past_key_values=`` are accepted; the output field is named after what the installed
``CausalLMOutputWithPast`` defines.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging

from sv_attention.errors import BackendUnavailableError, InvalidInputError, MaskError, UnsupportedFeatureError
from sv_attention.ops.masking import to_bool_mask
from sv_attention.ops.settings import PLUGIN_TWINS, model_operator_settings
from sv_attention.ops.sv_gate import sv_gate_attention

try:  # flat sibling file in the artifact; a top-level module inside the repository checkout
    from .configuration_sv import SVConfig
except ImportError:  # pragma: no cover - exercised when imported from the repository root
    from configuration_sv import SVConfig

try:
    from transformers import initialization as hf_init
except ImportError:  # pragma: no cover - older transformers
    hf_init = None

logger = logging.get_logger(__name__)

#: name of the cache field of the installed transformers' output classes ("cache" from 5.24 on)
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


# --------------------------------------------------------------------------------------------------
# cache
# --------------------------------------------------------------------------------------------------
class SVLMCache(DynamicCache):
    """A ``DynamicCache`` plus per-layer operator state.

    ``operator_state[layer_idx]`` is a dict the layer's operator owns (``"hop"``: the ceq forms' ``HopState``,
    ``"gate"``: the ``sv`` gate state, ``"gates"``: smprime's ``SMPrimeState``). State objects with the
    batch / length hooks (``reorder``, ``batch_select_indices``, ``batch_repeat_interleave``, ``crop``)
    follow beam-search reordering, batch selection and :meth:`crop` (assisted / prompt-lookup decoding)
    as keys and values do; plain tensors in it (batch on dim 0, position on dim 2) are mapped directly.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.operator_state: dict[int, dict[str, Any]] = {}

    def _map_state(self, fn: Callable[[torch.Tensor], torch.Tensor], method: str, arg: Any) -> None:
        """Apply a batch operation to every piece of operator state.

        Tensors / lists of tensors are mapped with ``fn``; state objects with the method (``HopState``,
        ``SMPrimeState``) apply it; state objects without it but with ``reset`` are reset and recompute
        from the cached keys on the next call.
        """
        for state in self.operator_state.values():
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor):
                    state[key] = fn(value)
                elif isinstance(value, list):
                    state[key] = [fn(v) if isinstance(v, torch.Tensor) else v for v in value]
                elif hasattr(value, method):
                    getattr(value, method)(arg)
                elif hasattr(value, "reset"):
                    value.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:  # noqa: D102 - transformers API
        super().reorder_cache(beam_idx)
        self._map_state(lambda t: t.index_select(0, beam_idx.to(t.device)), "reorder", beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:  # noqa: D102
        super().batch_repeat_interleave(repeats)
        self._map_state(lambda t: t.repeat_interleave(repeats, dim=0), "batch_repeat_interleave", repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:  # noqa: D102
        super().batch_select_indices(indices)
        self._map_state(lambda t: t[indices], "batch_select_indices", indices)

    def crop(self, max_length: int) -> None:
        """Drop cached positions; the operator state follows the keys and values.

        ``max_length`` has the installed transformers' meaning (5.24: ``<= 0`` removes that many tokens
        from the end and ``crop(0)`` is a no-op; older releases: ``> 0`` keeps the first ``max_length``).
        Operator-state tensors (position on dim 2) are sliced, state objects with ``crop`` (``HopState``,
        ``SMPrimeState``) are cropped to the same length, the others with ``reset`` are reset and refit
        from the cached keys on the next call.
        """
        before = self.get_seq_length()
        super().crop(max_length)
        after = self.get_seq_length()
        if after == before:
            return
        for state in self.operator_state.values():
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor):
                    state[key] = value[:, :, :after]
                elif isinstance(value, list):
                    state[key] = [v[:, :, :after] if isinstance(v, torch.Tensor) else v for v in value]
                elif hasattr(value, "crop"):
                    value.crop(after)
                elif hasattr(value, "reset"):
                    value.reset()

    def reset(self) -> None:  # noqa: D102
        super().reset()
        self.operator_state = {}


def layer_state(cache: Cache | None, layer_idx: int) -> dict[str, Any] | None:
    """The operator-state dict of ``layer_idx`` (created on first use), or None without a cache.

    A cache that is not an :class:`SVLMCache` gets the dict attached as ``sv_operator_state``.
    """
    if cache is None:
        return None
    store = getattr(cache, "operator_state", None)
    if store is None:
        store = cache.__dict__.setdefault("sv_operator_state", {})
    return store.setdefault(layer_idx, {})


# --------------------------------------------------------------------------------------------------
# operators: each takes (module, query [b,h,q,d], key/value [b,h,kv,d], mask bool [b,1,q,kv]) and
# returns (out [b, q, h, d], weights or None)
# --------------------------------------------------------------------------------------------------
def masked_softmax_weights(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None,
                           scaling: float) -> torch.Tensor:
    """Softmax attention weights ``[b, h, q, kv]``; rows with no visible key are exactly zero.

    Computed in float32 (or the input dtype when wider) without NaN: masked logits are set to the
    dtype's minimum and the rows with no visible key are multiplied by 0.
    """
    dtype = torch.promote_types(query.dtype, torch.float32)
    scores = torch.matmul(query.to(dtype), key.to(dtype).transpose(-1, -2)) * scaling
    if mask is None:
        return torch.softmax(scores, dim=-1)
    scores = scores.masked_fill(~mask, torch.finfo(dtype).min)
    weights = torch.softmax(scores, dim=-1)
    return weights * mask.any(dim=-1, keepdim=True).to(dtype)


def _dropout(weights: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    return F.dropout(weights, p=p, training=training) if p > 0.0 else weights


def softmax_reference(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention with explicit weights (the plain reference; used for ``output_attentions``)."""
    weights = masked_softmax_weights(query, key, mask, scaling)
    out = torch.matmul(_dropout(weights, dropout, module.training), value.to(weights.dtype))
    return out.to(query.dtype).transpose(1, 2).contiguous(), weights.to(query.dtype)


def softmax_operator(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, *,
                     output_attentions: bool = False, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal softmax attention (the mask carries causality and padding).

    Runs :func:`sv_attention.ops.ceq.stock_attention` (transformers' SDPA path), the same stock path the
    ceq hybrid adds its hops to, so ``ceq`` with alpha = 0 is bitwise this operator. With
    ``output_attentions`` the explicit :func:`softmax_reference` runs instead and returns the weights.
    """
    if output_attentions:
        return softmax_reference(module, query, key, value, mask, scaling, dropout)
    from sv_attention.ops.ceq import stock_attention

    out = stock_attention(query, key, value, mask, scaling=scaling, dropout=dropout, training=module.training)
    return out.transpose(1, 2).contiguous(), None


def window_mask(query_slots: torch.Tensor, key_slots: torch.Tensor, window: int) -> torch.Tensor:
    """Boolean ``[q, kv]``: key slot j visible from query slot i when ``i - window < j`` (causality apart)."""
    return key_slots[None, :] > query_slots[:, None] - window


def swa_operator(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, *,
                 query_slots: torch.Tensor | None = None, key_slots: torch.Tensor | None = None,
                 **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Sliding-window softmax attention: query i reads the slots ``(i - window, i]``."""
    window = module.operator_settings.window
    q_len, kv_len = query.shape[-2], key.shape[-2]
    if key_slots is None:
        key_slots = torch.arange(kv_len, device=query.device)
    if query_slots is None:
        query_slots = torch.arange(kv_len - q_len, kv_len, device=query.device)
    local = window_mask(query_slots, key_slots, window)[None, None]
    mask = local if mask is None else (mask & local)
    return softmax_operator(module, query, key, value, mask, scaling, dropout, **kwargs)


def ceq_operator(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, *,
                 operator_state: dict[str, Any] | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """ceq (``hybrid``: softmax + sum_h (alpha A)^h v, alpha = ``module.ceq_alpha``) and ceq_path_sum.

    A thin caller of ``sv_attention.ops.ceq.ceq_layer_attention`` (the entry the ``"ceq"`` plug-in calls
    too) with the model's own settings. With a cache, the layer's hop history
    (``sv_attention.ops.ceq.HopState``, in ``operator_state["hop"]``) makes decoding equal the full prefill.
    """
    from sv_attention.ops.ceq import ceq_layer_attention

    settings = module.operator_settings
    state = None if operator_state is None else operator_state.get("hop")
    result = ceq_layer_attention(query, key, value, mask, settings,
                                 path_weight=module.ceq_alpha if settings.form == "hybrid" else None,
                                 scaling=scaling, dropout=dropout, training=module.training, state=state,
                                 keep_state=operator_state is not None, check_layout=False,
                                 layer_idx=getattr(module, "layer_idx", None))
    if operator_state is not None:
        operator_state["hop"] = result.state
    return result.out.transpose(1, 2).contiguous(), None


def smprime_operator(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, *,
                     operator_state: dict[str, Any] | None = None, hidden_states: torch.Tensor | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """smprime (``sv_attention.ops.smprime``, one ``SMPrime`` per layer in ``module.smprime``).

    A thin caller of ``sv_attention.ops.smprime.smprime_layer_attention``: the gates ``m``, ``theta`` come
    from the layer's input ``hidden_states``; with a cache, the gates of the earlier positions
    (``SMPrimeState``, in ``operator_state["gates"]``) let decoding compute only the new rows, with the same
    per-row operations as the prefill.
    """
    from sv_attention.ops.smprime import smprime_layer_attention

    if dropout > 0.0 and module.training:
        warnings.warn("smprime applies no attention-weight dropout (its weights are never materialised); "
                      "the residual dropout of the backbone still applies", UserWarning, stacklevel=2)
    if hidden_states is None:
        raise UnsupportedFeatureError("smprime needs the layer's hidden_states (call it through SVAttention)")
    state = None if operator_state is None else operator_state.get("gates")
    result = smprime_layer_attention(query, key, value, mask, module.smprime, hidden_states, scaling=scaling,
                                     state=state, keep_state=operator_state is not None)
    if operator_state is not None:
        operator_state["gates"] = result.state
    return result.out.transpose(1, 2).contiguous(), None


def sv_operator(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, *,
                operator_state: dict[str, Any] | None = None, output_attentions: bool = False,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The causal hybrid SV layer (DESIGN §2.5): a thin caller of the single gate implementation
    (``sv_attention.ops.sv_gate.sv_gate_attention``) with the model's own settings.

    Queries at positions ``[s, s + chunk)`` read the gate fitted on the keys at positions ``< s``: softmax
    weights times ``alpha_j`` on that prefix, times 1 on the current chunk, renormalised. Chunk 0 and
    boundaries below the warm-up size are plain causal softmax. Positions come from the mask, so a
    left-padded row (any pad count) computes what the same text computes alone. With a cache, the layer's
    gate state (``operator_state["gate"]``) keeps the fitted boundaries, so decoding fits each boundary once
    and equals the recomputation.

    Parameters
    ----------
    query : ``[b, h, q, d]``; key, value : ``[b, h, kv, d]``; mask : bool ``[b|1, 1, q, kv]`` or None

    Returns
    -------
    out ``[b, q, h, d]``, weights ``[b, h, q, kv]`` (with ``output_attentions``) or None
    """
    b, q_len = query.shape[0], query.shape[2]
    kv_len = key.shape[2]
    if mask is None:
        visible = (torch.arange(kv_len, device=query.device)[None, :]
                   <= torch.arange(kv_len - q_len, kv_len, device=query.device)[:, None])[None].expand(b, q_len, kv_len)
    else:
        visible = mask[:, 0].expand(b, q_len, kv_len)
    state = None if operator_state is None else operator_state.get("gate")
    result = sv_gate_attention(query, key, value, visible, module.operator_settings, scaling=scaling, causal=True,
                               state=state, keep_state=operator_state is not None,
                               dropout=dropout if module.training else 0.0, return_weights=output_attentions)
    if operator_state is not None:
        operator_state["gate"] = result.state
    return result.out.transpose(1, 2).contiguous(), result.weights


OPERATOR_FUNCTIONS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor | None]]] = {
    "sv": sv_operator,
    "smprime": smprime_operator,
    "softmax": softmax_operator,
    "swa": swa_operator,
    "ceq": ceq_operator,
    "ceq_path_sum": ceq_operator,
}


def sv_operator_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float | None = None,
                          dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model's own attention: dispatch to the operator named by ``module.config.operator``.

    Parameters
    ----------
    module : the attention module (holds ``config`` and the operator's parameters)
    query : ``[b, h, q, d]``; key, value : ``[b, h, kv, d]`` (cached past included)
    attention_mask : bool / additive ``[b, 1, q, kv]`` or None
    scaling : logit scale (default ``1/sqrt(d)``)

    Returns
    -------
    out ``[b, q, h, d]``, weights ``[b, h, q, kv]`` or None
    """
    for name in ("softcap", "s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise UnsupportedFeatureError(f"the sv_lm operators do not implement {name!r}")
    q_len, kv_len = query.shape[-2], key.shape[-2]
    mask = to_bool_mask(attention_mask, q_len, kv_len)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return OPERATOR_FUNCTIONS[module.config.operator](module, query, key, value, mask, scaling, dropout, **kwargs)


# --------------------------------------------------------------------------------------------------
# layers
# --------------------------------------------------------------------------------------------------
class SVAttention(nn.Module):
    """Multi-head attention with q/k/v/o projections and a pluggable operator.

    Operator-specific parameters live here (``ceq_alpha`` for ``ceq``; the smprime heads and scalars
    for ``smprime``) so that the backbone is identical across operators.
    """

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim ** -0.5
        self.is_causal = True
        self.attention_dropout = config.dropout
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=bias)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=bias)
        #: the operator's validated settings, resolved once (``sv_attention.ops.settings``)
        self.operator_settings = model_operator_settings(config.operator, config.operator_config)
        build_operator_parameters(self, config)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: Cache | None = None, query_slots: torch.Tensor | None = None,
                key_slots: torch.Tensor | None = None, **kwargs: Any,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``hidden_states`` ``[b, t, hidden]`` -> ``([b, t, hidden], weights or None)``."""
        b, t, _ = hidden_states.shape
        shape = (b, t, self.num_heads, self.head_dim)
        query = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, sv_operator_attention
        )
        out, weights = attention_interface(
            self, query, key, value, attention_mask,
            scaling=self.scaling,
            dropout=self.attention_dropout if self.training else 0.0,
            operator_state=layer_state(cache, self.layer_idx),
            query_slots=query_slots, key_slots=key_slots,
            hidden_states=hidden_states,
            **kwargs,
        )
        out = out.reshape(b, t, -1).contiguous()
        return self.o_proj(out), weights


def build_operator_parameters(module: SVAttention, config: Any) -> None:
    """Create the operator-specific parameters of one attention layer."""
    if config.operator == "ceq":
        # alpha = 0: the layer is exactly softmax attention at initialisation
        module.ceq_alpha = nn.Parameter(torch.zeros(()))
    elif config.operator == "smprime":
        from sv_attention.ops.smprime import M_BIAS, THETA_BIAS, SMPrime

        module.smprime = SMPrime(config.hidden_size, config.num_attention_heads)
        # _init_weights would give these heads the generic normal init (m ~ 0 annihilates every path):
        # mark them so it restores SMPrime's own init (zero weights, biases 1 - 1e-3 / 1e-3)
        module.smprime.u_head._sv_head_bias = M_BIAS
        module.smprime.theta_head._sv_head_bias = THETA_BIAS
        st = module.operator_settings
        module.smprime._sv_scalar_init = {name: getattr(st, f"{name}_init") for name in ("beta", "qk", "g")}


class SVMLP(nn.Module):
    """``Linear(hidden, 4 hidden) -> GELU -> Linear(4 hidden, hidden)``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.fc_in = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.fc_out = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))


class SVDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = SVAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = SVMLP(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: Cache | None = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        attn_out, weights = self.attn(self.ln_1(hidden_states), attention_mask=attention_mask, cache=cache,
                                      **kwargs)
        hidden_states = hidden_states + self.dropout(attn_out)
        hidden_states = hidden_states + self.dropout(self.mlp(self.ln_2(hidden_states)))
        return hidden_states, weights


# --------------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------------
class SVPreTrainedModel(PreTrainedModel):
    """Shared plumbing: config class, weight init, capability flags.

    ``_supports_sdpa`` / ``_supports_flash_attn`` / ``_supports_flex_attn`` are False on purpose: the
    default attention implementation then resolves to ``"eager"``, which dispatches to the model's own
    operator (:func:`sv_operator_attention`).
    """

    config_class = SVConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["SVDecoderLayer"]
    _supports_sdpa = False
    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = True
    _can_compile_fullgraph = False

    def set_attn_implementation(self, attn_implementation: str | dict, *args: Any, **kwargs: Any) -> None:
        """transformers' ``set_attn_implementation``, refusing the stock kernels with a typed error.

        ``"eager"`` runs ``config.operator`` (``softmax`` already calls torch SDPA inside); a name registered
        with ``AttentionInterface.register`` (e.g. the plug-in's ``"sv_attention"`` / ``"ceq"``) swaps that
        function in. ``"sdpa"`` / flash / flex would silently drop the operator, so they are refused.

        Raises
        ------
        UnsupportedFeatureError
            For ``sdpa``, ``flash_attention_*``, ``flex_attention`` and ``paged|`` names.
        """
        names = attn_implementation.values() if isinstance(attn_implementation, dict) else [attn_implementation]
        for name in names:
            if isinstance(name, str) and any(k in name for k in ("sdpa", "flash", "flex", "paged|")):
                raise UnsupportedFeatureError(
                    f"sv_lm models run their own attention operator ({self.config.operator!r}); {name!r} would "
                    "replace it with a stock kernel. Use 'eager' for the configured operator (softmax already "
                    "uses torch SDPA inside) or a function registered with AttentionInterface.register "
                    "(e.g. 'sv_attention', 'ceq' after `import sv_attention`)"
                )
        super().set_attn_implementation(attn_implementation, *args, **kwargs)
        for name in names:
            twins = PLUGIN_TWINS.get(name) if isinstance(name, str) else None
            if twins is not None and self.config.operator not in twins:
                logger.warning(
                    "this checkpoint was trained with operator %r; %r is the plug-in twin of %s, so it now runs a "
                    "different operator than the one the weights were trained with (its settings: the config's "
                    "%r dict, or the defaults)", self.config.operator, name, " / ".join(repr(t) for t in twins), name)

    def _init_weights(self, module: nn.Module) -> None:
        head_bias = getattr(module, "_sv_head_bias", None)
        if head_bias is not None and isinstance(module, nn.Linear):  # smprime gate heads
            _fill(module.weight, 0.0)
            _fill(module.bias, head_bias)
            return
        super()._init_weights(module)
        # (a module without parameters of its own, e.g. SVAttention under smprime, is skipped by
        # transformers for remote code: so each operator-specific initialisation hangs on the module that
        # owns the parameter)
        if isinstance(module, SVAttention):
            init_operator_parameters(module)
        scalars = getattr(module, "_sv_scalar_init", None)
        if scalars is not None:  # SMPrime: beta, qk, g from the config's *_init knobs
            for name, value in scalars.items():
                _fill(getattr(module, name), value)
        if isinstance(module, SVModel):
            # non-persistent buffer: recomputed here because from_pretrained builds on the meta device
            positions = torch.arange(module.config.max_position_embeddings, device=module.position_ids.device)
            _copy(module.position_ids, positions)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if hf_init is not None and hasattr(hf_init, "copy_"):
        hf_init.copy_(dst, src)
    else:  # pragma: no cover
        with torch.no_grad():
            dst.copy_(src)


def _fill(param: torch.Tensor, value: float) -> None:
    if hf_init is not None and hasattr(hf_init, "constant_"):
        hf_init.constant_(param, value)
    else:  # pragma: no cover
        with torch.no_grad():
            param.fill_(value)


def init_operator_parameters(module: SVAttention) -> None:
    """Initialise the operator-specific parameters of the attention module (ceq alpha = 0, so ceq starts
    as softmax attention)."""
    if hasattr(module, "ceq_alpha"):
        _fill(module.ceq_alpha, 0.0)


def backend_summary(config: Any) -> str:
    """One line naming the attention path the model runs (logged at ``info`` level when a model is built).

    For ``sv``: the gate solver (``batched``: the differentiable batched fits, whose partition finder runs in
    torch, or in MLX on Apple silicon where the optional ``mlx`` imports; ``exact``: the fp64 maintained
    solvers, numpy) and whether the optional MLX finder is importable. The other operators are torch only.
    """
    if config.operator != "sv":
        return f"sv_lm: operator {config.operator!r} (torch)"
    from sv_attention.svdd.batched import mlx_available, select_backend

    settings = model_operator_settings(config.operator, config.operator_config)
    mlx = "installed" if mlx_available() else "not installed"
    if settings.solver == "exact":
        return f"sv_lm: operator 'sv', gate solver 'exact' (fp64 maintained solvers, numpy; MLX {mlx}, unused)"
    try:
        finder = select_backend(settings.gate_backend, torch.device("cpu"))
    except BackendUnavailableError:
        finder = "mlx requested but not importable: fits will fail"
    return (f"sv_lm: operator 'sv', gate solver 'batched', partition finder {finder} for CPU tensors "
            f"(gate_backend {settings.gate_backend!r}; optional MLX finder {mlx})")


class SVModel(SVPreTrainedModel):
    """The decoder without the head: ``input_ids [b, t]`` -> hidden states ``[b, t, hidden]``."""

    def __init__(self, config: SVConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.drop = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList([SVDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.register_buffer("position_ids", torch.arange(config.max_position_embeddings), persistent=False)
        self.gradient_checkpointing = False
        self.post_init()
        logger.info(backend_summary(config))

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                past_key_values: Cache | None = None, return_dict: bool | None = None,
                **kwargs: Any) -> BaseModelOutputWithPast:
        """Run the decoder.

        Parameters
        ----------
        input_ids : ``[b, t]`` byte ids, or ``inputs_embeds`` ``[b, t, hidden]``
        attention_mask : ``[b, past + t]`` padding mask (1 = real token), a 4-D bool / additive mask, or None
        position_ids : ``[b|1, t]``; default ``past + arange(t)``, or counted over the real tokens of a 2-D
            padding mask (see :func:`default_position_ids`); must stay below ``max_position_embeddings``
        cache / past_key_values : a transformers ``Cache`` (both spellings accepted)

        Raises
        ------
        InvalidInputError
            No tokens (an empty prompt), or a 2-D ``attention_mask`` with a row that has no real token.
        """
        cache = cache if cache is not None else past_key_values
        if (input_ids is None) == (inputs_embeds is None):
            raise InvalidInputError("pass exactly one of input_ids or inputs_embeds")
        if input_ids is not None:
            if input_ids.dim() != 2:
                raise InvalidInputError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
            if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
                raise InvalidInputError(f"input_ids must be an integer tensor of byte ids, got {input_ids.dtype}")
            if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size):
                raise InvalidInputError(
                    f"input_ids must lie in [0, {self.config.vocab_size}); got values in "
                    f"[{int(input_ids.min())}, {int(input_ids.max())}]"
                )
            inputs_embeds = self.embed_tokens(input_ids)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if self.training and (self.gradient_checkpointing
                              or any(getattr(layer, "gradient_checkpointing", False) for layer in self.layers)):
            use_cache = False  # (transformers >= 5 flags the layers, not the model)
        if use_cache and cache is None:
            cache = SVLMCache(config=self.config)
        if not use_cache:
            cache = None
        output_attentions = bool(output_attentions)
        b, t = inputs_embeds.shape[:2]
        check_not_empty(t, attention_mask)
        device = inputs_embeds.device
        past = cache.get_seq_length() if cache is not None else 0
        kv_len = past + t
        query_slots = torch.arange(past, kv_len, device=device)
        key_slots = torch.arange(kv_len, device=device)
        mask = build_mask(attention_mask, query_slots, key_slots, b)
        if position_ids is None:
            position_ids = default_position_ids(attention_mask, past, t, device)
        if position_ids.numel() and int(position_ids.max()) >= self.config.max_position_embeddings:
            raise InvalidInputError(
                f"position {int(position_ids.max())} is beyond the block size "
                f"max_position_embeddings={self.config.max_position_embeddings}; shorten the input "
                f"(or the generation length) so that prompt + new tokens <= {self.config.max_position_embeddings}"
            )
        hidden = self.drop(inputs_embeds + self.embed_positions(position_ids))

        all_hidden: tuple[torch.Tensor, ...] | None = () if output_hidden_states else None
        all_attn: tuple[torch.Tensor, ...] | None = () if output_attentions else None
        for layer in self.layers:
            if all_hidden is not None:
                all_hidden += (hidden,)
            hidden, weights = layer(hidden, attention_mask=mask, cache=cache, query_slots=query_slots,
                                    key_slots=key_slots, output_attentions=output_attentions)
            if all_attn is not None:
                all_attn += (weights,)
        hidden = self.norm(hidden)
        if all_hidden is not None:
            all_hidden += (hidden,)
        out = BaseModelOutputWithPast(last_hidden_state=hidden, hidden_states=all_hidden, attentions=all_attn,
                                      **{CACHE_FIELD: cache})
        return out.to_tuple() if return_dict is False else out


def check_not_empty(t: int, attention_mask: torch.Tensor | None) -> None:
    """Refuse an input with no token, or a 2-D padding mask ``[b, past + t]`` with a row of padding only.

    Raises
    ------
    InvalidInputError
        Naming what was empty and what to pass instead.
    """
    if t == 0:
        raise InvalidInputError(
            "empty input: no tokens to run (input_ids of shape [batch, 0]); an empty prompt gives the model nothing "
            "to condition on. Pass at least one token, e.g. start the prompt with a newline"
        )
    if attention_mask is not None and attention_mask.dim() == 2:
        empty = (~attention_mask.ne(0).any(-1)).nonzero().flatten().tolist()
        if empty:
            raise InvalidInputError(
                f"attention_mask row(s) {empty} have no real token (all padding): an empty prompt in a batch. "
                "Give every row at least one token, or drop the empty prompts from the batch"
            )


def default_position_ids(attention_mask: torch.Tensor | None, past: int, t: int,
                         device: torch.device) -> torch.Tensor:
    """Positions ``[b|1, t]`` of the new tokens when the caller gives none.

    With a 2-D padding mask ``[b, past + t]`` that hides some tokens, a row's positions count its real
    tokens (``cumsum(mask) - 1``, pads at 0), so a left-padded row gets the positions of the same text
    without padding; otherwise ``past + arange(t)``.
    """
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.to(torch.bool).all()):
        real = attention_mask.to(device=device, dtype=torch.long).ne(0).long()
        return (real.cumsum(-1) - 1).clamp(min=0)[:, -t:]
    return (past + torch.arange(t, device=device))[None, :]


def build_mask(attention_mask: torch.Tensor | None, query_slots: torch.Tensor, key_slots: torch.Tensor,
               batch: int) -> torch.Tensor:
    """Causal (+ padding) boolean mask ``[b|1, 1, q, kv]``, True = attend.

    A 2-D padding mask must cover the cached past and the new tokens (``[b, past + t]``).
    """
    q_len, kv_len = query_slots.numel(), key_slots.numel()
    causal = (key_slots[None, :] <= query_slots[:, None])[None, None]
    if attention_mask is None:
        return causal
    if attention_mask.dim() == 2:
        if attention_mask.shape != (batch, kv_len):
            raise MaskError(
                f"2-D attention_mask has shape {tuple(attention_mask.shape)}; expected [batch, past + new] = "
                f"[{batch}, {kv_len}] (cover the cached tokens too)"
            )
        if bool(attention_mask.to(torch.bool).all()):
            return causal
    pad = to_bool_mask(attention_mask, q_len, kv_len)
    return causal & pad


class SVForCausalLM(SVPreTrainedModel, GenerationMixin):
    """:class:`SVModel` with the weight-tied byte head (``lm_head.weight is model.embed_tokens.weight``)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: SVConfig) -> None:
        super().__init__(config)
        self.model = SVModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, output_attentions: bool | None = None,
                output_hidden_states: bool | None = None, logits_to_keep: int | torch.Tensor = 0,
                past_key_values: Cache | None = None, return_dict: bool | None = None,
                **kwargs: Any) -> CausalLMOutputWithPast:
        """Logits ``[b, t, 256]``; with ``labels`` ``[b, t]`` the next-byte cross-entropy (-100 ignored)."""
        cache = cache if cache is not None else past_key_values
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         output_attentions=output_attentions, output_hidden_states=output_hidden_states)
        hidden = out.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            hidden = hidden[:, logits_to_keep]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            if labels.shape != logits.shape[:2]:
                raise InvalidInputError(
                    f"labels must have the shape of the input [batch, seq] = {tuple(logits.shape[:2])} (the "
                    f"model shifts them by one itself), got {tuple(labels.shape)}; with logits_to_keep, "
                    "compute the loss yourself"
                )
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                   labels[:, 1:].reshape(-1).to(logits.device), ignore_index=-100)
        result = CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                        attentions=out.attentions, **{CACHE_FIELD: getattr(out, CACHE_FIELD)})
        return result.to_tuple() if return_dict is False else result

    def _prepare_cache_for_generation(self, generation_config: Any, model_kwargs: dict, *args: Any,
                                      **kwargs: Any) -> Any:
        """Like transformers' own, but the default cache is an :class:`SVLMCache`."""
        result = super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        for name in ("cache", "past_key_values"):
            made = model_kwargs.get(name)
            if type(made) is DynamicCache and not getattr(made, "_is_user_defined", False):
                model_kwargs[name] = SVLMCache(config=self.config)
        return result


__all__ = ["SVConfig", "SVModel", "SVForCausalLM", "SVPreTrainedModel", "SVLMCache", "sv_operator_attention"]
