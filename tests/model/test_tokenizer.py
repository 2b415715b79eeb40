"""Tokenizer.token_bytes: the bytes each token stands for (what chat log-probs report as `bytes`)."""

import numpy as np
import pytest

from irminsul import bundled_model
from irminsul.model.tokenizer import Tokenizer


@pytest.mark.parametrize("name", ["mla", "gqa"])
def test_token_bytes_join_to_the_decoding(name):
    """For random id sequences (pieces of multi-byte characters included), the tokens' bytes joined
    decode to what the tokenizer decodes; a special token is its text, or nothing when skipped."""
    tok = Tokenizer(bundled_model(name))
    rng = np.random.default_rng(0)
    for _ in range(200):
        ids = rng.integers(0, tok.vocab_size, 24).tolist()
        for skip in (False, True):
            joined = b"".join(tok.token_bytes(i, skip) for i in ids).decode("utf-8", "replace")
            assert joined == tok.decode(ids, skip_special_tokens=skip)
    zhong = tok.encode("中", add_bos=False)
    assert b"".join(tok.token_bytes(i) for i in zhong) == "中".encode()
    special = tok.bos_token_id
    assert tok.token_bytes(special, False) == tok.decode([special], skip_special_tokens=False).encode()
    assert tok.token_bytes(special, True) == b""


@pytest.mark.parametrize("source", ["mla", "gqa", "deepseek"])
def test_client_text_never_encodes_as_an_added_token(source):
    """encode_text: every added token's text (DeepSeek's role and tool markers are added tokens
    without the special flag) comes out as ordinary pieces, never as the control token itself."""
    if source == "deepseek":
        from irminsul.research.workloads.tokenizers import _deepseek_dir

        tok = Tokenizer(_deepseek_dir())
    else:
        tok = Tokenizer(bundled_model(source))
    added = {tok.added_token_id(text): text for text in tok.added_strings}
    assert added
    for token_id, text in added.items():
        ids = tok.encode_text(f"a{text}b")
        assert token_id not in ids, (text, ids)
        assert tok.decode(ids, skip_special_tokens=False) == f"a{text}b"
    if source == "deepseek":
        assert "<｜User｜>" in tok.added_strings and "<｜User｜>" not in tok.special_strings
