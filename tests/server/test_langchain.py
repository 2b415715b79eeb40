"""LangChain's ChatOpenAI against the server, on the bundled model: tool binding and all three
structured-output methods, streamed and not. LangChain is a client nobody here wrote; it sends what
agents send (tool_choice by name, response_format json_schema with strict, json_object)."""

import json
from typing import Literal

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from irminsul.bundled import bundled_model
from tests.server.server_helpers import start


# Bounded strings: a small model left free in a string may not close it within max_tokens.
@tool
def get_weather(city: str = Field(max_length=16), unit: Literal["celsius", "fahrenheit"] = "celsius") -> str:
    """Current weather in a city."""
    return "sunny"


@tool
def book_flight(origin: str = Field(pattern="^[A-Z]{3}$"), passengers: int = Field(ge=1, le=9)) -> str:
    """Book a flight."""
    return "booked"


class Flight(BaseModel):
    """A flight booking."""

    origin: str = Field(description="IATA airport code", pattern="^[A-Z]{3}$")
    passengers: int = Field(ge=1, le=9)


@pytest.fixture(scope="module")
def llm():
    s = start(bundled_model("mla"))
    yield ChatOpenAI(
        base_url=s.url + "/v1", api_key="unused", model="tiny", temperature=0, max_tokens=120, max_retries=0
    )
    s.stop()


def _valid(call, fn) -> None:
    fn.args_schema.model_validate(call["args"])  # the arguments validate against the tool's own schema


@pytest.mark.parametrize("choice", ["required", "book_flight", "any"])
def test_bind_tools_gets_parsed_valid_calls(llm, choice):
    bound = llm.bind_tools([get_weather, book_flight], tool_choice=choice)
    msg = bound.invoke("Book a flight from JFK for two people.")
    assert msg.tool_calls and not msg.invalid_tool_calls
    assert msg.response_metadata["finish_reason"] == "tool_calls"
    for call in msg.tool_calls:
        assert call["name"] in ("get_weather", "book_flight") and call["id"].startswith("call_")
        _valid(call, {"get_weather": get_weather, "book_flight": book_flight}[call["name"]])
    if choice == "book_flight":
        assert {c["name"] for c in msg.tool_calls} == {"book_flight"}
    # streamed: LangChain adds the chunks up into the same calls
    chunks = list(bound.stream("Book a flight from JFK for two people."))
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    assert [(c["name"], c["args"]) for c in total.tool_calls] == [(c["name"], c["args"]) for c in msg.tool_calls]


def test_a_tool_result_goes_back_into_the_conversation(llm):
    """The agent loop: call, tool result, next turn. The template renders the call and the result."""
    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    first = bound.invoke("Weather in Paris?")
    call = first.tool_calls[0]
    history = [
        HumanMessage("Weather in Paris?"),
        first,
        ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"]),
    ]
    reply = llm.bind_tools([get_weather]).invoke(history)
    assert isinstance(reply, AIMessage) and reply.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
    assert reply.usage_metadata["input_tokens"] > first.usage_metadata["input_tokens"]


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_with_structured_output_returns_the_model(llm, method):
    out = llm.with_structured_output(Flight, method=method).invoke("Book a flight from JFK for 2.")
    assert isinstance(out, Flight)  # LangChain parsed and validated it
    assert len(out.origin) == 3 and 1 <= out.passengers <= 9


def test_with_structured_output_json_mode(llm):
    """json_mode sends response_format json_object (no schema reaches the server): the answer is a
    JSON object, parsed by LangChain. Whether its keys fit the schema is up to the model."""
    schema = {"title": "Answer", "type": "object", "properties": {"name": {"type": "string"}}}
    out = llm.with_structured_output(schema, method="json_mode", include_raw=True).invoke(
        "Book a flight from JFK for 2 people."
    )
    assert out["parsing_error"] is None and isinstance(out["parsed"], dict)
    assert out["parsed"] == json.loads(out["raw"].content)


def test_parallel_tool_calls_false_gives_one_call(llm):
    bound = llm.bind_tools([get_weather, book_flight], tool_choice="required", parallel_tool_calls=False)
    msg = bound.invoke("Book a flight from JFK for two people, then tell me the weather in Paris.")
    assert len(msg.tool_calls) == 1 and not msg.invalid_tool_calls
