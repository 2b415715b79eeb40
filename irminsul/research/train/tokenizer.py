"""A byte-level BPE of ~8k tokens trained on the training text, with chat special tokens.

Numbers are *not* split into single digits: a 5-digit passkey becomes 2-3 BPE pieces drawn from
thousands, which an induction head can match on one token, whereas ten digit tokens recur all
over the filler and need multi-token matching (a first 300-step run stayed at chance with split
digits). A number tokenises differently with and without a leading space, so retrieval tasks
encode " <value>" once and use the same ids in the needle and in the answer.
"""

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from irminsul.model.chat_format import BOS, END, IRMINSUL_CHAT_TEMPLATE, PAD, SPECIAL_TOKENS

VOCAB_SIZE = 8192


def train_tokenizer(texts, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, out: Path, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json (HF layout)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": END,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": IRMINSUL_CHAT_TEMPLATE,
        "added_tokens_decoder": added,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    specials = {
        "bos_token": BOS,
        "eos_token": END,
        "pad_token": PAD,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (BOS, END, PAD)],
    }
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")


def load_tokenizer(path: Path) -> Tokenizer:
    """The trained tokenizer as the `tokenizers` library's own object, not the serving
    `irminsul.model.tokenizer.Tokenizer`: training and its evals use that library's API (encode_batch,
    get_vocab, Encoding.ids) on a file that may not sit in a checkpoint yet."""
    path = Path(path)
    return Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
