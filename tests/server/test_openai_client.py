"""The official openai client against a real server: chat (streaming and not), completions, models."""

import openai
import pytest

from tests.server.server_helpers import text


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_chat_non_streaming_and_streaming_agree(client):
    messages = [{"role": "system", "content": text(40, 1)}, {"role": "user", "content": "Which bags are free?"}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})
    choice = first.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    u = first.usage
    assert u.completion_tokens == 6 and u.total_tokens == u.prompt_tokens + 6
    assert u.prompt_tokens_details.cached_tokens == 0
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    # The same prompt again: everything but the last prompt token comes from the exact prefix.
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    split = usage.model_extra["irminsul"]
    assert split["prefix_tokens"] == usage.prompt_tokens - 1 and split["reused_tokens"] == 0


def test_completions_and_stop_strings(client):
    out = client.completions.create(model="tiny", prompt="hello world", max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop") and out.usage.prompt_tokens == len("hello world") + 1
    full = out.choices[0].text
    if len(full) >= 2:  # a stop string cuts the text and ends the request
        cut = client.completions.create(model="tiny", prompt="hello world", max_tokens=5, temperature=0,
                                        stop=[full[1:2]])
        assert cut.choices[0].text == full[: full.index(full[1:2])] and cut.choices[0].finish_reason == "stop"


def test_errors_raise_the_clients_exceptions(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="n=2"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2)

