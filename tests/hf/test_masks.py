"""Paired mask functions: transformers' own boolean masks, padding never lost, any keyword accepted."""

from __future__ import annotations

import torch
from transformers import LlamaConfig
from transformers.masking_utils import create_causal_mask, sdpa_mask, sliding_window_causal_mask_function

import sv_attention  # noqa: F401  (registers)
from sv_attention.hf.masks import ceq_mask, sv_attention_mask


def test_sv_mask_always_materialises_causal():
    m = sv_attention_mask(batch_size=2, q_length=4, kv_length=4, allow_is_causal_skip=True)
    assert m is not None and m.dtype == torch.bool and m.shape == (2, 1, 4, 4)
    assert torch.equal(m[0, 0], torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_ceq_mask_is_sdpa_mask_including_shortcuts():
    assert ceq_mask(batch_size=1, q_length=4, kv_length=4) is None
    pad = torch.tensor([[0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(ceq_mask(batch_size=1, q_length=4, kv_length=4, attention_mask=pad),
                       sdpa_mask(batch_size=1, q_length=4, kv_length=4, attention_mask=pad))


def test_padding_and_windows_kept_and_unknown_kwargs_accepted():
    pad = torch.tensor([[0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    m = sv_attention_mask(batch_size=1, q_length=1, kv_length=6, q_offset=5, attention_mask=pad,
                          cache_position=torch.arange(5, 6), local_size=None, something_new=1)
    assert m[0, 0, 0].tolist() == [False, False, True, True, True, True]
    w = sv_attention_mask(batch_size=1, q_length=6, kv_length=6, mask_function=sliding_window_causal_mask_function(2),
                          local_size=2)
    assert w[0, 0, 5].tolist() == [False, False, False, False, True, True]


def test_create_causal_mask_pairs_by_name():
    cfg = LlamaConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=1, intermediate_size=16)
    emb = torch.zeros(2, 5, 16)
    pad = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    for name in ("sv_attention", "ceq"):
        cfg._attn_implementation = name
        m = create_causal_mask(config=cfg, inputs_embeds=emb, attention_mask=pad, cache=None)
        assert m is not None, name  # an unpaired name would get None here and lose the padding
        assert not m[1, 0, 4, :2].any() and m[1, 0, 4, 2:].all()
