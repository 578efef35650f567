"""Byte-level tokenizer of the sv-attention language model (remote code, no vocabulary file).

Token id ``i`` (0..255) is the byte ``i`` of the UTF-8 encoding; there are no merges and no extra ids, so
the vocabulary is exactly 256. Decoding joins the bytes and decodes UTF-8 with ``errors="replace"``
(a generation cut inside a multi-byte character shows U+FFFD instead of raising). Padding is on the
left by default (batched generation with a causal LM).

Special tokens: none by default except ``pad_token = "\\x00"`` (byte 0, which ordinary text never
contains) so that batched calls with ``padding=True`` work; it is the only token
``skip_special_tokens=True`` drops.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizer


class SVByteTokenizer(PreTrainedTokenizer):
    """UTF-8 bytes as token ids 0..255.

    Examples
    --------
    >>> tok = SVByteTokenizer()
    >>> tok("hé")["input_ids"]
    [104, 195, 169]
    >>> tok.decode([104, 195, 169])
    'hé'
    """

    model_input_names = ["input_ids", "attention_mask"]
    vocab_files_names: dict[str, str] = {}

    def __init__(self, pad_token: str | None = "\x00", **kwargs: Any) -> None:
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        kwargs.setdefault("padding_side", "left")  # causal LM: batched generation pads on the left
        super().__init__(pad_token=pad_token, **kwargs)

    @property
    def vocab_size(self) -> int:
        return 256

    def get_vocab(self) -> dict[str, int]:
        return {chr(i): i for i in range(256)}

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        # one "token" per byte, carried as the code point of the same value (chr(b), b < 256)
        return [chr(b) for b in text.encode("utf-8")]

    def _convert_token_to_id(self, token: str) -> int:
        if len(token) != 1 or ord(token) > 255:
            raise ValueError(f"not a byte token: {token!r}")
        return ord(token)

    def _convert_id_to_token(self, index: int) -> str:
        if not 0 <= int(index) < 256:
            raise ValueError(f"byte ids lie in [0, 256), got {index}")
        return chr(int(index))

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return bytes(ord(t) for t in tokens if len(t) == 1 and ord(t) < 256).decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        # the vocabulary is the 256 bytes: nothing to write
        return ()
