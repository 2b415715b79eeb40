"""Every bad input gets its 4xx with an OpenAI-style body naming the problem; the server keeps serving."""

import httpx
import pytest

from tests.server.server_helpers import chat

HI = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CASES = [
    ("chat", b"{not json", 400, "not valid JSON"),
    ("chat", b"[1, 2]", 400, "JSON object"),
    ("chat", {"model": "gpt-4o", "messages": HI}, 404, "does not exist"),
    ("chat", {"messages": [{"role": "user", "content": "x" * 5000}]}, 400, "maximum context length is 4096"),
    ("completions", {"prompt": "x" * 4096}, 400, "maximum context length is 4096"),
    ("chat", {"messages": HI, "max_tokens": 0}, 400, "at least 1"),
    ("chat", {"messages": HI, "max_tokens": 10_000}, 400, "maximum context length is 4096"),
    ("chat", {"messages": HI, "max_tokens": "many"}, 400, "max_tokens"),
    ("chat", {"messages": HI, "n": 0}, 400, "n=0 must be"),
    ("chat", {"messages": HI, "top_logprobs": 2}, 400, "top_logprobs needs logprobs"),
    ("chat", {"messages": HI, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs=50"),
    ("completions", {"prompt": "hi", "stop_token_ids": [10**12]}, 400, "stop_token_ids: token id"),
    ("completions", {"prompt": "hi", "echo": True, "logprobs": 1, "stream": True}, 400, "echo"),
    ("chat", {"messages": HI, "tool_choice": "required"}, 400, "needs tools"),
    (
        "chat",
        {"messages": HI, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}},
        400,
        "not among the tools",
    ),
    ("chat", {"messages": HI, "tools": TOOLS, "tool_choice": "always"}, 400, "tool_choice must be"),
    (
        "chat",
        {"messages": HI, "tools": TOOLS, "tool_choice": "required", "guided_json": {"type": "object"}},
        400,
        "set only one",
    ),
    ("chat", {"messages": HI, "response_format": {"type": "xml"}}, 400, "response_format type 'xml'"),
    ("chat", {"messages": HI, "response_format": {"type": "json_schema"}}, 400, "json_schema.schema"),
    (
        "chat",
        {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}},
        400,
        "could not be compiled",
    ),
    ("completions", {"prompt": "hi", "guided_regex": "(("}, 400, "guided_regex: the regex could not be compiled"),
    ("completions", {"prompt": "hi", "guided_choice": []}, 400, "guided_choice"),
    ("completions", {"prompt": "hi", "guided_json": "{not json"}, 400, "not valid JSON"),
    ("completions", {"prompt": "hi", "guided_regex": "a", "guided_choice": ["a"]}, 400, "set only one"),
    ("chat", {"messages": HI, "stream_options": {"include_usage": True}}, 400, "stream=true"),
    ("chat", {"messages": HI, "temperature": -1}, 400, "temperature"),
    ("chat", {"messages": HI, "cache_salt": ""}, 400, "cache_salt"),
    ("chat", {"messages": []}, 400, "non-empty"),
    ("chat", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "role 'robot'"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "takes text only"),
    ("chat", {}, 400, "messages"),
    ("completions", {"prompt": ["a"] * 40, "n": 2}, 400, "more than 64 choices"),
    ("completions", {"prompt": [1, 2, 99999]}, 400, "outside the vocabulary"),
    # once silently ignored: the output did not change
    ("completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("completions", {"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens"),
    ("completions", {"prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    ("completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("completions", {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"99999": 1}}, 400, "outside the vocabulary"),
    ("completions", {"prompt": "hi", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    ("chat", {"messages": HI, "chat_template_kwargs": {"messages": []}}, 400, "may not set messages"),
    (
        "chat",
        {"messages": [*HI, {"role": "assistant", "content": "The"}], "continue_final_message": True},
        400,
        "needs add_generation_prompt=false",
    ),
    (
        "chat",
        {"messages": HI, "continue_final_message": True, "add_generation_prompt": False},
        400,
        "needs an assistant message last",
    ),
    ("chunks", {"text": ""}, 403, "--admin-key"),  # publishing is the operator's: no admin key, no publishing
    # once 500s (and the first stopped the engine thread for everyone)
    ("completions", {"prompt": "hi", "seed": 2**70, "max_tokens": 2}, 400, "seed"),
    ("chat", {"messages": [{"role": "assistant", "content": "a", "tool_calls": ["x"]}, *HI]}, 400, "tool_calls[0]"),
    ("chat", {"messages": [{"role": "assistant", "content": "a", "tool_calls": 5}, *HI]}, 400, "tool_calls must"),
    ("chat", {"messages": [{"role": "assistant", "tool_calls": [{"function": "f"}]}, *HI]}, 400, "tool_calls[0]"),
    ("chat", {"messages": [{"role": "assistant", "content": "a", "function_call": "f"}, *HI]}, 400, "function_call"),
    ("completions", {"prompt": "hi", "max_tokens": True}, 400, "not a boolean"),
    ("completions", {"prompt": "hi", "max_tokens": 2, "temperature": True}, 400, "not a boolean"),
    ("completions", {"prompt": [1, True, 3], "max_tokens": 2}, 400, "prompt"),
    ("completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', 400, "surrogate"),
    ("chat", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', 400, "surrogate"),
    ("completions", ('{"prompt": "hi", "x": ' + "[" * 5000 + "]" * 5000 + "}").encode(), 400, "nests deeper"),
    # refused up front: rendering is quadratic in the parts, so this would take ~100 s and stall everyone
    (
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 16385}]},
        400,
        "content parts",
    ),
    # constraints that nothing can satisfy: a 400 that says so, not a 500 carrying llguidance's parser state
    (
        "chat",
        {
            "messages": HI,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"$ref": "#"}}},
        },
        400,
        "matches no output",
    ),
    ("completions", {"prompt": "hi", "guided_regex": "[^\\x00-\\x{10FFFF}]"}, 400, "matches no output"),
    # a forced call whose arguments must nest themselves forever: a 400, not a 200 that is no tool call
    (
        "chat",
        {
            "messages": HI,
            "max_tokens": 16,
            "tool_choice": "required",
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
                    },
                }
            ],
        },
        400,
        "the output constraint failed",
    ),
]
ADMIN_CASES = [
    ({"text": ""}, 400, "non-empty"),
    ({"text": "a", "token_ids": [1]}, 400, "exactly one"),
    ({"token_ids": [1, True]}, 400, "list of integers"),
    (b'{"text": "a\\ud800b"}', 400, "surrogate"),  # once a 500 from the tokenizer
]
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "chunks": "/v1/cache/chunks"}


@pytest.mark.parametrize("kind, body, status, message", CASES, ids=[f"{i}-{c[3]}" for i, c in enumerate(CASES)])
def test_bad_input_gets_a_clear_4xx(server, kind, body, status, message):
    data = body if isinstance(body, bytes) else None
    r = httpx.post(server.url + PATHS[kind], content=data, json=None if data else body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["type"], error


@pytest.fixture(scope="module")
def admin_server(tiny_dir):
    from tests.server.server_helpers import start

    s = start(tiny_dir, admin_key="root")
    yield s
    s.stop()


@pytest.mark.parametrize("body, status, message", ADMIN_CASES, ids=[c[2] for c in ADMIN_CASES])
def test_bad_publish_gets_a_clear_4xx(admin_server, body, status, message):
    data = body if isinstance(body, bytes) else None
    r = httpx.post(
        admin_server.url + PATHS["chunks"],
        content=data,
        json=None if data else body,
        headers={"Authorization": "Bearer root", "Content-Type": "application/json"},
    )
    assert r.status_code == status and message in r.json()["error"]["message"], r.text


def test_server_keeps_serving_after_errors(server):
    assert httpx.get(server.url + "/v1/nope").status_code == 404
    out = chat(server.url, HI, max_tokens=2)
    assert out["choices"][0]["finish_reason"] in ("length", "stop")
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_degenerate_sampling_fails_nobody(server):
    """top_p=1e-50 and temperature=1e-40 once answered 500 and failed every stream running with them."""
    import asyncio

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            bodies = [
                {"prompt": "hello there", "max_tokens": 8, "temperature": 1, "top_p": 1e-50},
                {"prompt": "hello there", "max_tokens": 8, "temperature": 1e-40},
                {"prompt": "hello there", "max_tokens": 8, "temperature": 0.8, "seed": 1},
            ]
            return await asyncio.gather(*(client.post(server.url + "/v1/completions", json=b) for b in bodies))

    for r in asyncio.run(run()):
        assert r.status_code == 200, r.text


def test_a_large_body_is_refused_before_it_is_parsed_and_nobody_waits(server):
    """A body over --max-request-bytes gets its 413 within seconds, before it is parsed, and /health
    answers meanwhile: one oversized request must not stall the server for everyone."""
    import threading
    import time

    from tests.server.server_helpers import metric

    big = b'{"prompt": "' + b"word " * (2 * 2**20) + b'", "max_tokens": 2}'  # 10 MiB > the 8 MiB default

    def errors_413():
        text = httpx.get(server.url + "/metrics").text
        return metric(server.url, "irminsul_request_errors_total", status="413") if 'status="413"' in text else 0

    before = errors_413()
    health = []
    poller = threading.Thread(target=lambda: health.append(httpx.get(server.url + "/health", timeout=5).status_code))
    t = time.perf_counter()
    poller.start()
    r = httpx.post(
        server.url + "/v1/completions", content=big, headers={"content-type": "application/json"}, timeout=30
    )
    poller.join()
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]
    assert time.perf_counter() - t < 5 and health == [200]
    assert errors_413() == before + 1
    # a request that fits but asks for absurd work is refused by name
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "stop": [str(i) for i in range(10_000)]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"


def test_a_wrong_method_says_which_are_allowed_and_every_error_is_counted(server):
    from tests.server.server_helpers import metric

    before = metric(server.url, "irminsul_request_errors_total")
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert httpx.get(server.url + "/v1/nope").status_code == 404
    assert metric(server.url, "irminsul_request_errors_total") == before + 2


def test_tokenize_detokenize_and_the_model_card(server):
    chat_ids = httpx.post(server.url + "/tokenize", json={"messages": HI}).json()
    assert chat_ids["count"] == len(chat_ids["tokens"]) and chat_ids["max_model_len"] == 4096
    chat_ids_ref = chat(server.url, HI, max_tokens=1)["usage"]["prompt_tokens"]
    assert chat_ids["count"] == chat_ids_ref  # the same rendering the chat endpoint uses
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "hello world", "add_special_tokens": False}).json()
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert text == "hello world"
    r = httpx.post(server.url + "/detokenize", json={"tokens": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert httpx.post(server.url + "/tokenize", json={}).status_code == 400
    assert httpx.get(server.url + "/v1/models/tiny").json()["id"] == "tiny"
    assert httpx.get(server.url + "/v1/models/gpt-4o").status_code == 404


def test_chat_template_controls_change_the_prompt(server):
    """add_generation_prompt=false drops the assistant opener; continue_final_message ends the
    prompt inside the final assistant message, so the reply continues it."""

    def tokens(**body):
        return httpx.post(server.url + "/tokenize", json=body).json()["tokens"]

    opened = tokens(messages=HI)
    closed = tokens(messages=HI, add_generation_prompt=False)
    assert opened[: len(closed)] == closed and len(opened) == len(closed) + 1  # <|assistant|>
    partial = [*HI, {"role": "assistant", "content": "The answer is"}]
    cont = tokens(messages=partial, add_generation_prompt=False, continue_final_message=True)
    text = httpx.post(server.url + "/detokenize", json={"tokens": cont}).json()["prompt"]
    assert text.endswith("The answer is") and cont[: len(closed)] == closed
    out = chat(server.url, partial, max_tokens=2, add_generation_prompt=False, continue_final_message=True)
    assert out["usage"]["prompt_tokens"] == len(cont)


def test_more_choices_than_the_queue_holds_is_a_400_not_a_503(tiny_dir):
    """n above --max-queued-requests is a 400 that names the limit, not a 503 "overloaded, retry
    later" from an idle server, which no retry could ever turn into a 200."""
    from tests.server.server_helpers import start

    s = start(tiny_dir, max_queued_requests=3)
    try:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "n": 4, "max_tokens": 2}, timeout=30)
        assert r.status_code == 400 and "--max-queued-requests 3" in r.json()["error"]["message"], r.text
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "n": 3, "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and len(r.json()["choices"]) == 3, r.text
    finally:
        s.stop()


def test_a_client_that_goes_away_mid_body_is_no_server_error(server, caplog):
    """A body the client cuts short logs no error (no "unhandled error" traceback: the server did
    nothing wrong) and the server keeps answering."""
    import logging
    import socket
    import time
    from urllib.parse import urlparse

    url = urlparse(server.url)
    with socket.create_connection((url.hostname, url.port)) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"prompt": '
        )
    time.sleep(1.0)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert (
        httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30).status_code
        == 200
    )


LONG = [{"role": "user", "content": "x" * 5000}]
CONTEXT_CASES = [  # every way a request can be longer than the context
    ("/v1/chat/completions", {"messages": LONG}, "messages"),  # tokenized
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 200_000}]}, "messages"),  # by length
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 10_000}, "max_tokens"),
    ("/v1/completions", {"prompt": "x" * 4096}, "prompt"),
    ("/v1/responses", {"input": "x" * 5000}, "input"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 10_000}, "max_output_tokens"),
]


@pytest.mark.parametrize("path, body, param", CONTEXT_CASES, ids=[f"{c[0]}-{c[2]}" for c in CONTEXT_CASES])
def test_context_overflow_is_openais_error_that_clients_act_on(server, path, body, param):
    """A request longer than the context is OpenAI's 400: code context_length_exceeded and "This
    model's maximum context length is N tokens" (what litellm turns into ContextWindowExceededError
    and LangChain into its context-overflow error: the agent shortens instead of retrying), the
    field named."""
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == param, error
    assert error["message"].startswith("This model's maximum context length is 4096 tokens. However, "), error


def test_the_openai_client_sees_context_overflow_by_its_code(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=LONG, max_tokens=2)
    assert e.value.code == "context_length_exceeded"


TEXT_ONLY_CASES = [  # what a text-only model cannot take: refused, the field named, never ignored
    (
        "/v1/chat/completions",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    ],
                }
            ]
        },
        "messages[0].content[1].type",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}
            ]
        },
        "messages[0].content[0].type",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "f"}}]}]},
        "messages[0].content[0].type",
    ),
    (
        "/v1/chat/completions",
        {"messages": [*HI, {"role": "assistant", "audio": {"id": "a"}}, *HI]},
        "messages[1].audio",
    ),
    ("/v1/chat/completions", {"messages": HI, "modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"messages": HI, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    (
        "/v1/responses",
        {
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "what is this?"},
                        {"type": "input_image", "image_url": "data:,"},
                    ],
                }
            ]
        },
        "input[0].content[1].type",
    ),
]


@pytest.mark.parametrize("path, body, param", TEXT_ONLY_CASES, ids=[c[2] for c in TEXT_ONLY_CASES])
def test_input_or_output_other_than_text_is_refused_by_name(server, path, body, param):
    r = httpx.post(server.url + path, json={**body, "max_tokens": 2} if "messages" in body else body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "text only" in error["message"], error


def test_a_full_queue_is_a_429_with_retry_after(tiny_dir):
    """Queue limits answer as OpenAI's rate limits do: 429, Retry-After, code rate_limit_exceeded
    (clients back off and retry); the queued requests still finish."""
    import concurrent.futures

    from tests.server.server_helpers import start

    s = start(tiny_dir, max_queued_requests=2, max_running_requests=1)
    try:
        body = {"prompt": "hi", "max_tokens": 200, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: httpx.post(s.url + "/v1/completions", json=body, timeout=120), range(8)))
        refused = [r for r in answers if r.status_code != 200]
        assert refused and len(refused) <= 6, [r.status_code for r in answers]
        for r in refused:
            assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
    finally:
        s.stop()
