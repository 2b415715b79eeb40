"""The OpenAI Agents SDK against the server, on the bundled model, with both of its models (chat
completions and Responses): an agent with an `output_type` and a forced `tool_choice`, which sends
`response_format` / `text.format` on every turn beside the tools. The model is small and
random-ish, so the tests check structure: the tool ran with arguments that validate, and the run
ends with an output of the output type or with the SDK's own MaxTurnsExceeded."""

import asyncio

import pytest
from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

from irminsul.bundled import bundled_model
from irminsul.model.tokenizer import Tokenizer
from tests.server.server_helpers import start

MODELS = {"chat": OpenAIChatCompletionsModel, "responses": OpenAIResponsesModel}


class Answer(BaseModel):
    answer: str = Field(max_length=20)  # (bounded: a small model left free in a string may not close it)


@pytest.fixture(scope="module")
def url():
    set_tracing_disabled(True)  # (the SDK would export traces to OpenAI)
    s = start(bundled_model("mla"))
    yield s.url
    s.stop()


def _run(url, api: str, choice: str, settings: dict, max_turns: int):
    calls = []

    @function_tool
    def get_weather(city: str = Field(max_length=12)) -> str:
        """Current weather in a city."""
        calls.append(city)
        return "sunny, 21 C"

    async def go():
        client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        agent = Agent(
            name="weather",
            instructions="Answer briefly.",
            tools=[get_weather],
            output_type=Answer,
            model=MODELS[api](model="tiny", openai_client=client),
            model_settings=ModelSettings(tool_choice=choice, temperature=0, max_tokens=80, **settings),
        )
        try:
            return (await Runner.run(agent, "What is the weather in Paris?", max_turns=max_turns)).final_output
        except MaxTurnsExceeded as e:
            return e
        finally:
            await client.close()

    return asyncio.run(go()), calls


@pytest.mark.parametrize("api", MODELS)
@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_a_forced_tool_choice_with_an_output_type_calls_the_tool(url, api, choice):
    """The first turn is the forced call (its arguments parsed by the SDK into the tool's own
    arguments); then the SDK resets tool_choice to auto, where the bundled model, greedy, keeps
    calling until max_turns: the SDK reports that as MaxTurnsExceeded, or an Answer if it answers."""
    out, calls = _run(url, api, choice, {}, max_turns=2)
    assert calls and all(isinstance(c, str) and len(c) <= 12 for c in calls)
    assert isinstance(out, (Answer, MaxTurnsExceeded)), out


@pytest.mark.parametrize("api", MODELS)
def test_after_the_forced_call_the_agent_answers_in_its_output_type(url, api):
    """With the answer's first token biased up, the turn after the call (tool_choice auto + the
    output type's format) is text, and the SDK parses it into the output type."""
    token = Tokenizer(bundled_model("mla")).encode('{"answer', add_bos=False)[1]
    out, calls = _run(url, api, "required", {"extra_body": {"logit_bias": {str(token): 100}}}, max_turns=3)
    assert len(calls) == 1
    assert isinstance(out, Answer) and len(out.answer) <= 20
