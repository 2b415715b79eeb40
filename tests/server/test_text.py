"""Log-probs and echo against the output text, for multi-byte characters and special tokens (each
of these once came out wrong; found by probing). The bundled model's byte-level tokenizer splits
中 into the tokens 168, 124, 263 (one byte each)."""

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
    """They were the bytes of U+FFFD (the lossy decoding of a piece), so no client could rebuild 中."""
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "中文"}], "logit_bias": ZHONG, "logprobs": True,
        "max_tokens": 6, "temperature": 0}).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 6 and all(entry["bytes"] in ([0xE4], [0xB8], [0xAD]) for entry in content), content


def test_completion_tokens_join_to_the_text_and_offsets_index_it(url):
    """Echo: the tokens were 18 x U+FFFD for 4 characters, and text_offset ran past the text's end,
    then back."""
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": "中文中文", "echo": True, "logprobs": 2, "max_tokens": 6, "temperature": 0,
        "logit_bias": ZHONG}).json()
    choice = r["choices"][0]
    lp, text = choice["logprobs"], choice["text"]
    assert text.startswith("中文中文") and "".join(lp["tokens"]) == text
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets)
    assert all(text[o:o + len(t)] == t for o, t in zip(offsets, lp["tokens"]))


def test_echo_gives_back_the_prompt_as_sent_and_special_tokens_as_asked(url):
    """A string prompt's special-token text was dropped from the echo; with skip_special_tokens
    false, the log-probs' tokens were still empty where the text showed the special tokens."""
    prompt = "<|user|>Hi<|end|><|assistant|>"
    r = httpx.post(url + "/v1/completions", timeout=60,
                   json={"prompt": prompt, "echo": True, "max_tokens": 2, "temperature": 0}).json()
    assert r["choices"][0]["text"].startswith(prompt)
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": "Hi", "max_tokens": 3, "temperature": 0, "logprobs": 0, "skip_special_tokens": False,
        "logit_bias": {"5": 100}}).json()
    choice = r["choices"][0]
    assert choice["text"] and "".join(choice["logprobs"]["tokens"]) == choice["text"]
