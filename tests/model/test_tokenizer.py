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
