"""POST /v1/responses through the official openai client (`client.responses`), on the bundled model:
text, function calls (forced and round-tripped with their output), structured text, streaming
events that add up to the whole response, and the stateless refusals."""

import json

import jsonschema
import openai
import pytest

from irminsul.bundled import bundled_model
from tests.server.server_helpers import start

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city", "parameters": CITY}]


@pytest.fixture(scope="module")
def client():
    s = start(bundled_model("mla"))
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
    s.stop()


def _streamed(client, **kw):
    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    return events


def test_text_streamed_or_not(client):
    kw = dict(
        model="tiny", input="Which bags are free?", instructions="Answer briefly.", max_output_tokens=12, temperature=0
    )
    r = client.responses.create(**kw)
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output_text
    assert r.usage.output_tokens <= 12 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    events = _streamed(client, **kw)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r.output_text
    last = events[-1]
    assert last.type == f"response.{r.status}" and last.response.output_text == r.output_text
    # the same request again finds its prompt in the prefix cache
    again = client.responses.create(**kw)
    assert again.usage.input_tokens_details.cached_tokens == again.usage.input_tokens - 1


def test_forced_function_call_and_its_output_round_trip(client):
    kw = dict(
        model="tiny",
        input="What is the weather in Paris?",
        tools=TOOLS,
        tool_choice="required",
        max_output_tokens=60,
        temperature=0,
    )
    r = client.responses.create(**kw)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), CITY)
    events = _streamed(client, **kw)
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["function_call"] and added[0].name == "get_weather"
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and "".join(pieces) == call.arguments
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments
    # the agent loop: the call and its output go back as input items
    follow = client.responses.create(
        model="tiny",
        tools=TOOLS,
        max_output_tokens=8,
        temperature=0,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
        ],
    )
    assert follow.status in ("completed", "incomplete")
    assert follow.usage.input_tokens > r.usage.input_tokens + 5  # the call and its output were rendered


def test_named_tool_choice_and_structured_text(client):
    r = client.responses.create(
        model="tiny",
        input="Weather?",
        tools=TOOLS,
        max_output_tokens=60,
        temperature=0,
        tool_choice={"type": "function", "name": "get_weather"},
    )
    assert [o.name for o in r.output if o.type == "function_call"] == ["get_weather"]
    schema = {
        "type": "object",
        "properties": {
            "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "seats": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["origin", "seats"],
    }
    r = client.responses.create(
        model="tiny",
        input="Book a flight from JFK for two.",
        max_output_tokens=40,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "booking", "schema": schema}},
    )
    jsonschema.validate(json.loads(r.output_text), schema)


ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}}, "required": ["answer"]}
ANSWER_FORMAT = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_a_forced_call_with_text_format_is_the_call(client, choice):
    """text.format applies to text turns: with a forced call the output is the call."""
    r = client.responses.create(
        model="tiny",
        input="What is the weather in Paris?",
        tools=TOOLS,
        tool_choice=choice,
        text=ANSWER_FORMAT,
        max_output_tokens=60,
        temperature=0,
    )
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), CITY)


def test_auto_with_text_format_is_a_call_or_text_in_the_format(client):
    """tool_choice=auto + text.format: calls or the format's JSON (greedy, the bundled model calls;
    with its answer's first token biased up, it answers in the format)."""
    from irminsul.model.tokenizer import Tokenizer

    token = Tokenizer(bundled_model("mla")).encode('{"answer', add_bos=False)[1]
    kw = dict(
        model="tiny",
        input="What is the weather in Paris?",
        tools=TOOLS,
        text=ANSWER_FORMAT,
        max_output_tokens=60,
        temperature=0,
    )
    r = client.responses.create(**kw)
    assert [o.type for o in r.output] == ["function_call"]
    jsonschema.validate(json.loads(r.output[0].arguments), CITY)
    r = client.responses.create(**kw, extra_body={"logit_bias": {str(token): 100}})
    assert [o.type for o in r.output] == ["message"] and r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), ANSWER)


def test_logprobs_on_request(client):
    r = client.responses.create(
        model="tiny",
        input="Hello",
        max_output_tokens=4,
        temperature=0,
        top_logprobs=2,
        include=["message.output_text.logprobs"],
        extra_body={"ignore_eos": True},
    )
    lps = r.output[0].content[0].logprobs
    assert len(lps) == 4 and all(len(lp.top_logprobs) == 2 for lp in lps)
    assert "".join(lp.token for lp in lps) == r.output_text


def test_streamed_logprobs_survive_text_the_tool_parser_held_back(client):
    """With tools, text the parser holds back (it might open a call) keeps its log-probs when it is
    streamed, the same as in the non-streamed answer: a client that streams must not lose them. Here
    the model writes a call to a tool it was not given, which ends up as text."""
    kw = dict(
        model="tiny",
        input="Tell me about cats.",
        tools=[{"type": "function", "name": "w", "parameters": {"type": "object", "properties": {}}}],
        max_output_tokens=12,
        temperature=0,
        include=["message.output_text.logprobs"],
    )
    whole = client.responses.create(**kw)
    events = _streamed(client, **kw)
    done = next(e for e in events if e.type == "response.completed" or e.type == "response.incomplete").response
    want = [lp.token for lp in whole.output[0].content[0].logprobs]
    assert whole.output_text.startswith('{"name"') and len(want) == 12  # (held back while it might be a call)
    streamed = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert streamed == want and [lp.token for lp in done.output[0].content[0].logprobs] == want
    # cut off by max_output_tokens: the response and the item being written are "incomplete" (the item
    # once said "completed")
    item_done = [e.item for e in events if e.type == "response.output_item.done"]
    assert whole.status == done.status == "incomplete"
    assert whole.output[-1].status == done.output[-1].status == item_done[-1].status == "incomplete"


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),  # (no name: once "runs function tools only")
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),  # nothing left to answer
        ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input[0]"),  # no such call
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"input": []}, "input"),  # the chat path's errors, in the Responses API's names
        ({"max_output_tokens": 100_000}, "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format"),
        ({"top_k": "many"}, "top_k"),  # a chat sampling field passed through, with a bad value
    ],
)
def test_what_a_stateless_server_cannot_do_is_a_clear_400(client, kw, param):
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2, **kw}  # (kw may override them)
    extra = {k: body.pop(k) for k in ("top_k",) if k in body}  # vLLM's extensions go in the body
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**body, extra_body=extra)
    assert e.value.body["param"] == param
