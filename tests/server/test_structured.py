"""Structured outputs and tool calls through the official openai client, on the bundled model.

The bundled model is small: left free it rarely writes a tool call or valid JSON. Constrained
decoding must make it do both anyway, and the answers must validate against the schemas.
"""

import json
import re

import jsonschema
import openai
import pytest

from irminsul.bundled import bundled_model
from tests.server.server_helpers import start

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
FLIGHT = {
    "type": "object",
    "properties": {
        "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["origin", "passengers"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "book_flight", "description": "Book a flight", "parameters": FLIGHT}},
]
SCHEMAS = {"get_weather": WEATHER, "book_flight": FLIGHT}
ASK = [{"role": "user", "content": "Book a flight from JFK for two people, then tell me the weather in Paris."}]


@pytest.fixture(scope="module")
def bundled():
    s = start(bundled_model("mla"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(bundled):
    return openai.OpenAI(base_url=bundled.url + "/v1", api_key="unused", max_retries=0)


def _model(client) -> str:
    return client.models.list().data[0].id


def _check_calls(calls, names=None):
    assert calls, "no tool call was returned"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "book_flight"}}])
def test_forced_tool_calls_are_parsed_and_valid_streamed_or_not(client, choice):
    kw = dict(model=_model(client), messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=120, temperature=0)
    out = client.chat.completions.create(**kw)
    c = out.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    _check_calls(c.message.tool_calls, ["book_flight"] if isinstance(choice, dict) else None)
    # streamed: the name first, then the arguments in pieces that add up to the same call
    chunks = list(client.chat.completions.create(**kw, stream=True))
    calls: dict[int, dict] = {}
    pieces = 0
    for chunk in chunks:
        for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            call = calls.setdefault(d.index, {"name": None, "arguments": ""})
            if d.function.name:
                assert call["name"] is None and d.id.startswith("call_")
                call["name"] = d.function.name
            call["arguments"] += d.function.arguments or ""
            pieces += 1
    assert [(v["name"], v["arguments"]) for _, v in sorted(calls.items())] == [
        (t.function.name, t.function.arguments) for t in c.message.tool_calls
    ]
    assert pieces > 2 * len(calls)  # incremental, not one delta per call
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"


def test_a_tool_schema_is_reused_at_another_position(client):
    """The tool schemas are their own segments: behind a different system prompt they are reused."""
    model = _model(client)
    for system in ("You are a travel agent for a small airline.", "Answer briefly. " * 30):
        out = client.chat.completions.create(
            model=model,
            messages=[{"role": "system", "content": system}, *ASK],
            tools=TOOLS,
            tool_choice="required",
            max_tokens=80,
            temperature=0,
        )
    split = out.usage.model_extra["irminsul"]
    assert split["reused_tokens"] > 60, split  # the two tool schemas, found at a shifted position


def test_json_schema_response_format_validates(client):
    schema = {
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "bags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
        },
        "required": ["answer", "confidence", "bags"],
    }
    out = client.chat.completions.create(
        model=_model(client),
        messages=[{"role": "user", "content": "Are two checked bags free?"}],
        max_tokens=80,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    c = out.choices[0]
    assert c.finish_reason == "stop"
    value = json.loads(c.message.content)
    jsonschema.validate(value, schema)
    assert set(value) == {"answer", "confidence", "bags"}  # closed: no keys the schema does not list


def test_guided_choice_regex_and_json_object_on_completions(client):
    model = _model(client)
    out = client.completions.create(
        model=model,
        prompt="The sky is",
        max_tokens=10,
        n=4,
        temperature=1.0,
        seed=3,
        extra_body={"guided_choice": ["blue", "green", "grey"]},
    )
    assert all(c.text in ("blue", "green", "grey") and c.finish_reason == "stop" for c in out.choices)
    out = client.completions.create(
        model=model,
        prompt="Flight number:",
        max_tokens=10,
        temperature=0,
        extra_body={"guided_regex": "[A-Z]{2}[0-9]{3,4}"},
    )
    assert re.fullmatch("[A-Z]{2}[0-9]{3,4}", out.choices[0].text)
    out = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=60, temperature=0, response_format={"type": "json_object"}
    )
    c = out.choices[0]
    if c.finish_reason == "stop":  # (a free-form object may run to max_tokens; when it ends, it parses)
        assert isinstance(json.loads(c.message.content), dict)
    else:
        assert c.message.content.startswith("{")


def test_auto_tool_choice_parses_what_the_model_writes(client):
    """tool_choice=auto: text stays content; a call in the bundled model's syntax (put in its output
    here by a regex constraint) becomes tool_calls; a call to an undeclared function stays text."""
    model = _model(client)
    call = '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"unit\\": \\"celsius\\"}"}'
    out = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        max_tokens=60,
        temperature=0,
        extra_body={"guided_regex": "Sure\\. " + re.escape(call)},
    )
    c = out.choices[0]
    assert c.message.content == "Sure." and c.finish_reason == "tool_calls"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})
    ]
    for choice, text in (("none", call), ("auto", call.replace("get_weather", "get_time"))):
        out = client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=60,
            temperature=0,
            extra_body={"guided_regex": re.escape(text)},
        )
        assert out.choices[0].message.content == text and not out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "stop"


def _ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    return {"$ref": "#/$defs/d0", "$defs": {**defs, f"d{n}": {"type": "string"}}}


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("response_format", {"type": "json_schema", "json_schema": {"name": "a", "schema": _ref_chain(3000)}}, "$refs"),
        (
            "guided_grammar",
            "start: r0\n" + "\n".join(f'r{i}: "a" r{i + 1}' for i in range(3000)) + '\nr3000: "b"',
            "rules",
        ),
        ("guided_json", '{"items": ' * 1000 + "{}" + "}" * 1000, "levels"),
        ("guided_json", "[" * 100_000 + "]" * 100_000, "levels"),
        (
            "response_format",
            {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": {"type": "string", "pattern": "((a{1000}){1000}){1000}"}},
            },
            "spells out",
        ),
        ("guided_choice", [f"option {i}" for i in range(100_000)], "at most 1024"),
        ("guided_regex", "((a{1000}){1000}){1000}", "spells out"),
        # (a chain short enough to fit the context as text: a longer one is refused as too long first)
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": _ref_chain(300)}}], "$ref"),
    ],
)
def test_grammars_too_big_to_compile_safely_are_a_400_and_the_server_lives_on(bundled, field, value, says):
    import httpx

    body = {"messages": ASK, "max_tokens": 4, field: value}
    if field == "tools":
        body["tool_choice"] = "required"
    r = httpx.post(bundled.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]
    ok = httpx.post(bundled.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200, ok.text


ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}}, "required": ["answer"]}
ANSWER_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}


def _answer_token(bundled) -> int:
    """The token the text branch's JSON starts its key with (`{"` then `ans`): biased up, the
    model leaves the calls it prefers for the response format."""
    from irminsul.model.tokenizer import Tokenizer

    return Tokenizer(bundled_model("mla")).encode('{"answer', add_bos=False)[1]


def _call_or_answer(choice) -> str:
    """'call' or 'text'; either way what it carries validates."""
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        _check_calls(choice.message.tool_calls)
        return "call"
    jsonschema.validate(json.loads(choice.message.content), ANSWER)
    return "text"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "book_flight"}}])
def test_a_forced_call_with_a_response_format_is_the_call(client, choice):
    """A forced call is the output; the response format applies to text turns (OpenAI accepts the
    pair, as the Agents SDK sends it for an agent with an output type)."""
    out = client.chat.completions.create(
        model=_model(client),
        messages=ASK,
        tools=TOOLS,
        tool_choice=choice,
        response_format=ANSWER_FORMAT,
        max_tokens=120,
        temperature=0,
    )
    c = out.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    _check_calls(c.message.tool_calls, None if choice == "required" else {"book_flight"})


def test_auto_with_a_response_format_is_a_call_or_text_in_the_format(client, bundled):
    """tool_choice=auto + response_format: one grammar of both, so the output is calls or the
    format's JSON. Greedy, the bundled model calls; with its answer's first token biased up it
    answers; sampled, both happen, and each parses."""
    kw = dict(model=_model(client), messages=ASK, tools=TOOLS, response_format=ANSWER_FORMAT, max_tokens=120)
    assert _call_or_answer(client.chat.completions.create(**kw, temperature=0).choices[0]) == "call"
    token = str(_answer_token(bundled))
    answered = client.chat.completions.create(**kw, temperature=0, logit_bias={token: 100}).choices[0]
    assert _call_or_answer(answered) == "text" and answered.finish_reason == "stop"
    sampled = client.chat.completions.create(**kw, temperature=1.0, seed=1, n=16, logit_bias={token: 12})
    kinds = [_call_or_answer(c) for c in sampled.choices if c.finish_reason != "length"]
    assert set(kinds) == {"call", "text"}, kinds


def test_a_forced_call_with_a_guided_field_is_still_refused(client):
    """vLLM's guided_* fields constrain the whole output, as a forced call does: the pair is a 400."""
    with pytest.raises(openai.BadRequestError, match="set only one"):
        client.chat.completions.create(
            model=_model(client),
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=8,
            extra_body={"guided_regex": "a+"},
        )
