"""A checkpoint's tokenizer: HF `tokenizer.json` plus `tokenizer_config.json` (specials, chat template)."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from irminsul.errors import CheckpointError


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a byte-level BPE token writes for each byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<|bos|>", ...}
        return value.get("content")
    return value


class Tokenizer:
    """A checkpoint's tokenizer as serving uses it: BOS from its config, client text encoded so it cannot
    forge control tokens, streaming decode, token bytes. (Traces are tokenised by family, without a
    checkpoint: `irminsul.research.workloads.tokenizers`; training builds its own BPE:
    `irminsul.research.train.tokenizer`.)"""

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
        try:
            self.config = json.loads(config_file.read_text()) if config_file.exists() else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{config_file} is not valid JSON ({e})") from None
        if not isinstance(self.config, dict):
            raise CheckpointError(f"{config_file} must hold a JSON object, not a {type(self.config).__name__}")
        self.chat_template: str | None = self.config.get("chat_template")
        self.bos_token_id = self._id(self.config.get("bos_token"))
        self.eos_token_id = self._id(self.config.get("eos_token"))
        self.add_bos = bool(self.config.get("add_bos_token", False)) and self.bos_token_id is not None
        self._bytes: dict[tuple[int, bool], bytes] = {}  # token_bytes, memoised
        self._byte_level: bool | None = None  # whether the decoder is byte-level BPE (found on first use)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """bos_token, eos_token, ... as a chat template sees them (transformers passes these)."""
        names = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
        return {n: _token_text(self.config[n]) for n in names if _token_text(self.config.get(n)) is not None}

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
        """Encode text that comes from a client: an added token's string in it (`<|end|>`, or
        DeepSeek's role markers, which its tokenizer adds without the special flag) is encoded as
        the text it is, never as the control token, so nobody can forge a role boundary."""
        plain = getattr(self, "_plain", None)
        if plain is None:  # a second instance: the flag is per instance, and encode runs on many threads
            spec = json.loads(self._tok.to_str())
            for added in spec.get("added_tokens", []):  # NOTE: encode_special_tokens covers special ones only
                added["special"] = True
            plain = HFTokenizer.from_str(json.dumps(spec))
            plain.encode_special_tokens = True
            self._plain = plain
        return plain.encode(text, add_special_tokens=False).ids

    @property
    def added_strings(self) -> tuple[str, ...]:
        """Every added token's text, special or not (each always tokenizes as itself)."""
        return tuple(t.content for t in self._tok.get_added_tokens_decoder().values())

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

    def token_bytes(self, token: int, skip_special_tokens: bool = True) -> bytes:
        """The bytes a token stands for (a piece of a multi-byte character is a byte or two, where its
        decoding alone is U+FFFD): byte-level BPE (GPT-2's byte alphabet), byte fallback `<0xNN>`
        pieces, or the token's text. An added (special) token: its text, or nothing when skipped."""
        cache = self._bytes
        key = (token, skip_special_tokens)
        if key not in cache:
            added = self._tok.get_added_tokens_decoder().get(token)
            piece = self._tok.id_to_token(token)
            if added is not None:
                out = b"" if skip_special_tokens and added.special else added.content.encode("utf-8")
            elif piece is None:
                out = b""
            elif (m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)) is not None:
                out = bytes([int(m.group(1), 16)])
            elif self._is_byte_level():
                table = _unicode_to_byte()
                out = bytes(table[c] for c in piece) if all(c in table for c in piece) else piece.encode("utf-8")
            else:  # (SentencePiece's word marker)
                out = piece.replace("\u2581", " ").encode("utf-8")
            cache[key] = out
        return cache[key]

    def _is_byte_level(self) -> bool:
        if self._byte_level is None:
            decoder = json.loads(self._tok.to_str()).get("decoder") or {}
            kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders") or []]
            self._byte_level = "ByteLevel" in kinds
        return self._byte_level

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
