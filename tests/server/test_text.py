"""Log-probs and echo agree with the output text, for multi-byte characters (a character split
across tokens) and special tokens, so that a client can rebuild the text from them. The bundled
model's byte-level tokenizer splits 中 into the tokens 168, 124, 263 (one byte each)."""

import httpx
import pytest

from irminsul import bundled_model
from tests.server.server_helpers import start

ZHONG = {"168": 100, "124": 100, "263": 100}  # the three bytes of 中, forced


@pytest.fixture(scope="module")
def url():
    s = start(bundled_model("mla"))
    yield s.url
    s.stop()


def test_chat_logprob_bytes_are_the_tokens_own(url):
    """Each token's bytes are its own, not those of U+FFFD (the lossy decoding of a piece), so a
    client can rebuild 中 from them."""
    r = httpx.post(
        url + "/v1/chat/completions",
        timeout=60,
        json={
            "messages": [{"role": "user", "content": "中文"}],
            "logit_bias": ZHONG,
            "logprobs": True,
            "max_tokens": 6,
            "temperature": 0,
        },
    ).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 6 and all(entry["bytes"] in ([0xE4], [0xB8], [0xAD]) for entry in content), content


def test_completion_tokens_join_to_the_text_and_offsets_index_it(url):
    """Echo: the tokens join to the text (not to a U+FFFD per byte), and text_offset rises and
    indexes each token in the text, never past its end."""
    r = httpx.post(
        url + "/v1/completions",
        timeout=60,
        json={
            "prompt": "中文中文",
            "echo": True,
            "logprobs": 2,
            "max_tokens": 6,
            "temperature": 0,
            "logit_bias": ZHONG,
        },
    ).json()
    choice = r["choices"][0]
    lp, text = choice["logprobs"], choice["text"]
    assert text.startswith("中文中文") and "".join(lp["tokens"]) == text
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets)
    assert all(text[o : o + len(t)] == t for o, t in zip(offsets, lp["tokens"]))


def test_echo_gives_back_the_prompt_as_sent_and_special_tokens_as_asked(url):
    """A string prompt's special-token text is echoed as sent; with skip_special_tokens false, the
    log-probs' tokens show the special tokens the text shows, so the tokens still join to the text."""
    prompt = "<|user|>Hi<|end|><|assistant|>"
    r = httpx.post(
        url + "/v1/completions", timeout=60, json={"prompt": prompt, "echo": True, "max_tokens": 2, "temperature": 0}
    ).json()
    assert r["choices"][0]["text"].startswith(prompt)
    r = httpx.post(
        url + "/v1/completions",
        timeout=60,
        json={
            "prompt": "Hi",
            "max_tokens": 3,
            "temperature": 0,
            "logprobs": 0,
            "skip_special_tokens": False,
            "logit_bias": {"5": 100},
        },
    ).json()
    choice = r["choices"][0]
    assert choice["text"] and "".join(choice["logprobs"]["tokens"]) == choice["text"]
