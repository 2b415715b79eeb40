"""A checkpoint's tokenizer: HF `tokenizer.json` plus `tokenizer_config.json` (specials, chat template)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from irminsul.errors import CheckpointError


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<|bos|>", ...}
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, path: str | Path):
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.exists():
            raise CheckpointError(f"{path} has no tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(file))
        except Exception as e:  # the Rust side raises a bare Exception on a corrupt file
            raise CheckpointError(f"{file} could not be read ({e})") from None
        config_file = path / "tokenizer_config.json"
        self.config = json.loads(config_file.read_text()) if config_file.exists() else {}
        self.chat_template: str | None = self.config.get("chat_template")
        self.bos_token_id = self._id(self.config.get("bos_token"))
        self.eos_token_id = self._id(self.config.get("eos_token"))
        self.add_bos = bool(self.config.get("add_bos_token", False)) and self.bos_token_id is not None

    def _id(self, token) -> int | None:
        text = _token_text(token)
        return None if text is None else self._tok.token_to_id(text)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def encode_text(self, text: str) -> list[int]:
        """Encode text that comes from a client: a special token's string in it (`<|end|>`) is
        encoded as the text it is, never as the control token, so nobody can forge a role boundary."""
        plain = getattr(self, "_plain", None)
        if plain is None:  # a second instance: the flag is per instance, and encode runs on many threads
            plain = HFTokenizer.from_str(self._tok.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return plain.encode(text, add_special_tokens=False).ids

    @property
    def special_strings(self) -> tuple[str, ...]:
        return tuple(t.content for t in self._tok.get_added_tokens_decoder().values() if t.special)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True):
        """An incremental decoder: call it with each new token id, get the text that token completes
        ("" while a multi-byte character is still incomplete). Constant work per token, where
        decoding the whole output again at every token is quadratic."""
        stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        return lambda token: stream.step(self._tok, token) or ""

    def added_token_id(self, text: str) -> int | None:
        """The id of the added token (special or not) whose text this is; None for ordinary text."""
        for token_id, token in self._tok.get_added_tokens_decoder().items():
            if token.content == text:
                return token_id
        return None

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what llguidance's grammar matcher reads)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)
