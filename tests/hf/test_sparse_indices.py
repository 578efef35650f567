"""Mask-carrying keywords: DeepSeek-V3.2's top-k selection (indices=) folded into the mask; block_indices refused."""

from __future__ import annotations

import pytest
import torch

import sv_attention
from sv_attention.errors import UnsupportedFeatureError
from sv_attention.hf.attention import ceq_attention_forward, sv_attention_forward

from . import tiny

IDS = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(0))


def _logits(m, impl, **kw):
    if impl in ("eager", "sdpa"):
        m.set_attn_implementation(impl)
    else:
        sv_attention.enable(m, impl, **kw)
    with torch.no_grad():
        return m(IDS).logits


def test_deepseek_v32_selection_is_applied_like_eager_and_sdpa():
    m = tiny.deepseek_v32(index_topk=4)
    sdpa, eager = _logits(m, "sdpa"), _logits(m, "eager")
    dense = tiny.deepseek_v32(index_topk=64)  # same weights, no key dropped: the selection matters
    assert (_logits(dense, "sdpa") - sdpa).abs().max() > 1e-3
    assert torch.equal(_logits(m, "ceq", path_weight=0.0), sdpa)  # alpha = 0: bitwise sdpa, selection included
    assert (_logits(m, "sv_attention", gated=False) - eager).abs().max() <= 1e-5
    assert (_logits(m, "ceq", path_weight=0.2) - sdpa).abs().max() > 1e-4  # the hops run on the selected keys


class _Fake(torch.nn.Module):
    is_causal = True

    def __init__(self):
        super().__init__()
        self.config = type("Cfg", (), {"model_type": "minimax_m3_vl"})()


@pytest.mark.parametrize("fn", [sv_attention_forward, ceq_attention_forward])
def test_block_indices_refused_naming_argument_and_model(fn):
    q = torch.randn(1, 2, 4, 8)
    k = v = torch.randn(1, 2, 4, 8)
    with pytest.raises(UnsupportedFeatureError, match=r"minimax_m3_vl.*'block_indices'"):
        fn(_Fake(), q, k, v, None, block_indices=torch.zeros(1, 4, 1, dtype=torch.long))


def test_indices_of_the_wrong_shape_raise():
    from sv_attention.errors import InvalidInputError

    q = torch.randn(1, 2, 4, 8)
    k = v = torch.randn(1, 2, 4, 8)
    with pytest.raises(InvalidInputError, match="indices"):
        sv_attention_forward(_Fake(), q, k, v, None, indices=torch.zeros(4, 2, dtype=torch.long))
