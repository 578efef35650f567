"""The architectures of the compatibility table (issue 16), each built tiny from its config (2 layers where the
config allows, hidden 64), and the real pretrained MiniLM encoder. ``ARCHS[name] = (kind, build)``; kinds:
``causal`` (decoder-only LM), ``encoder`` (bidirectional text encoder), ``seq2seq``, ``speech`` (Whisper),
``vision`` (ViT), ``clip`` (text + vision towers)."""

from __future__ import annotations

import transformers as T

from . import tiny

V = tiny.VOCAB
DEC = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           max_position_embeddings=256)


def _causal(cfg_cls, **kw):
    return lambda: tiny._tiny(cfg_cls(**{**DEC, **kw}))


ARCHS = {
    "Llama": ("causal", _causal(T.LlamaConfig, num_key_value_heads=2)),
    "Qwen2": ("causal", _causal(T.Qwen2Config, num_key_value_heads=2)),
    "Qwen3": ("causal", _causal(T.Qwen3Config, num_key_value_heads=2, head_dim=16)),
    "Mistral (default window 4096)": ("causal", tiny.mistral_default),
    "Gemma": ("causal", _causal(T.GemmaConfig, num_key_value_heads=2, head_dim=16)),
    "Gemma2": ("causal", tiny.gemma2),
    "Gemma3 (window 5)": ("causal", lambda: tiny.gemma3(window=5)),
    "Phi3": ("causal", _causal(T.Phi3Config, num_key_value_heads=2, sliding_window=5, pad_token_id=0)),
    "GPT-2": ("causal", tiny.gpt2),
    "GPT-NeoX": ("causal", lambda: tiny._tiny(T.GPTNeoXConfig(vocab_size=V, hidden_size=64, intermediate_size=128,
                                                                num_hidden_layers=2, num_attention_heads=4,
                                                                max_position_embeddings=256))),
    "OPT": ("causal", lambda: tiny._tiny(T.OPTConfig(vocab_size=V, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                                      num_attention_heads=4, word_embed_proj_dim=64,
                                                      max_position_embeddings=256, pad_token_id=1))),
    "Falcon": ("causal", tiny.falcon),
    "Starcoder2 (window 5)": ("causal", lambda: tiny.starcoder2(window=5)),
    "Olmo": ("causal", _causal(T.OlmoConfig, num_key_value_heads=2)),
    "Mixtral (window 5)": ("causal", _causal(T.MixtralConfig, num_key_value_heads=2, num_local_experts=2,
                                             num_experts_per_tok=1, sliding_window=5)),
    "BERT": ("encoder", lambda: tiny._tiny(T.BertConfig(vocab_size=V, hidden_size=64, intermediate_size=128,
                                                         num_hidden_layers=2, num_attention_heads=4), "AutoModel")),
    "RoBERTa": ("encoder", lambda: tiny._tiny(T.RobertaConfig(vocab_size=V, hidden_size=64, intermediate_size=128,
                                                               num_hidden_layers=2, num_attention_heads=4,
                                                               pad_token_id=1), "AutoModel")),
    "DistilBERT": ("encoder", lambda: tiny._tiny(T.DistilBertConfig(vocab_size=V, dim=64, hidden_dim=128, n_layers=2,
                                                                     n_heads=4), "AutoModel")),
    "MiniLM (pretrained)": ("encoder", lambda: tiny.minilm("sdpa")),
    "T5": ("seq2seq", tiny.t5),
    "BART": ("seq2seq", lambda: tiny.bart(layers=2)),
    "Whisper": ("speech", tiny.whisper),
    "ViT": ("vision", tiny.vit),
    "CLIP": ("clip", lambda: tiny._tiny(T.CLIPConfig(
        text_config=dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=32),
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           image_size=16, patch_size=4), projection_dim=32), "CLIPModel")),
}
