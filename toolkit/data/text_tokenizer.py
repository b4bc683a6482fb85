"""Tokenizers for data preparation: bytes (no download) or a Hugging Face tokenizer on disk.

Both expose what Megatron-Core's GPT dataset reads (`eod`, `pad`, `vocab_size`) plus
`encode`. The spec string is recorded beside a prepared dataset so that training can
check the model's vocabulary against it before starting.
"""
from __future__ import annotations

from pathlib import Path


class ByteTokenizer:
    """UTF-8 bytes 0-255, plus 256 as end-of-document: vocabulary 257."""

    spec = "byte"
    vocab_size = 257
    eod = 256
    pad = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class HuggingFaceTokenizer:
    """A tokenizer saved with `save_pretrained` in a local folder (no hub access)."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        if not Path(path, "tokenizer_config.json").exists() and not Path(path, "tokenizer.json").exists():
            raise FileNotFoundError(f"no Hugging Face tokenizer in {path} (tokenizer.json / tokenizer_config.json)")
        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if self._tok.eos_token_id is None:
            raise ValueError(f"the tokenizer in {path} has no end-of-sequence token to separate documents")
        self.spec = str(Path(path).resolve())
        self.vocab_size = len(self._tok)
        self.eod = self._tok.eos_token_id
        self.pad = self._tok.pad_token_id if self._tok.pad_token_id is not None else self.eod

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)


def load_tokenizer(spec: str):
    return ByteTokenizer() if spec == "byte" else HuggingFaceTokenizer(spec)
