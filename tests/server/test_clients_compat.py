"""What older and stricter clients expect on the bundled model: scoring a prompt with echo and
max_tokens=0, alternatives in top_logprobs that are special tokens named by their own text, and
/metrics counting the finish reason the client was sent (tool_calls)."""

import json

import httpx
import pytest

from irminsul import bundled_model
from tests.server.server_helpers import metric, start

SPECIAL_NAMES = {"<|bos|>", "<|eos|>", "<|end|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]


@pytest.fixture(scope="module")
def url():
    s = start(bundled_model("mla"))
    yield s.url
    s.stop()


def _complete(url, **body):
    return httpx.post(url + "/v1/completions", timeout=60, json={"temperature": 0, **body})


def test_echo_with_max_tokens_0_scores_the_prompt_and_generates_nothing(url):
    """Scoring harnesses (the legacy lm-eval loglikelihood path) send exactly this, as OpenAI's
    legacy API and vLLM take it."""
    prompt = "the cabin upgrade policy"
    r = _complete(url, prompt=prompt, echo=True, max_tokens=0, logprobs=2)
    assert r.status_code == 200, r.text
    body = r.json()
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert "".join(lp["tokens"]) == prompt and len(lp["tokens"]) == body["usage"]["prompt_tokens"]
    assert lp["token_logprobs"][0] is None and all(v <= 0 for v in lp["token_logprobs"][1:])
    assert lp["top_logprobs"][0] is None and all(len(top) >= 1 for top in lp["top_logprobs"][1:])
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"]
    # the same scores as echo with one generated token, whose entry comes last there
    one = _complete(url, prompt=prompt, echo=True, max_tokens=1, logprobs=2).json()["choices"][0]["logprobs"]
    assert one["token_logprobs"][:-1] == lp["token_logprobs"]
    # without log-probs, and for a batch of token-id prompts
    r = _complete(url, prompt=[[10, 11, 12], [13, 14]], echo=True, max_tokens=0).json()
    assert [c["finish_reason"] for c in r["choices"]] == ["length", "length"]
    assert [c["logprobs"] for c in r["choices"]] == [None, None] and r["usage"]["completion_tokens"] == 0


def test_max_tokens_0_without_echo_is_a_400_that_says_why(url):
    r = _complete(url, prompt="hi", max_tokens=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "echo" in r.json()["error"]["message"]
    r = httpx.post(
        url + "/v1/chat/completions",
        timeout=60,
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
    )
    assert r.status_code == 400 and "at least 1" in r.json()["error"]["message"]


def test_special_tokens_among_the_alternatives_name_themselves(url):
    """An alternative's text is its own even when skip_special_tokens hides special tokens in the
    output (as vLLM gives it). On this model the first steps after "hi" rank special tokens among
    the top 20."""
    r = httpx.post(
        url + "/v1/chat/completions",
        timeout=60,
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "top_logprobs": 20,
            "max_tokens": 3,
            "temperature": 0,
        },
    ).json()
    tops = [t for entry in r["choices"][0]["logprobs"]["content"] for t in entry["top_logprobs"]]
    assert all(t["token"] for t in tops)
    assert all(t["bytes"] == list(t["token"].encode()) for t in tops if t["token"] in SPECIAL_NAMES)
    assert {t["token"] for t in tops} & SPECIAL_NAMES
    r = _complete(url, prompt="<|user|>hi<|end|><|assistant|>", logprobs=20, max_tokens=3).json()
    top_lists = r["choices"][0]["logprobs"]["top_logprobs"]
    assert all(len(top) == 20 and "" not in top for top in top_lists)  # none folded into one key ""
    assert set().union(*top_lists) & SPECIAL_NAMES


def test_metrics_count_the_tool_calls_finish_reason(url):
    def before():
        try:
            return metric(url, "irminsul_requests_total", finish_reason="tool_calls")
        except AssertionError:  # no such sample yet
            return 0.0

    start_count = before()
    body = {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 60,
        "temperature": 0,
    }
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json=body).json()
    assert r["choices"][0]["finish_reason"] == "tool_calls"
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={**body, "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["tool_calls"]
    assert metric(url, "irminsul_requests_total", finish_reason="tool_calls") == start_count + 2
