"""The Responses API's wire format (POST /v1/responses): its request, the response object, and the
events of its stream, as OpenAI's API sends them (serving_responses.py builds them)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from irminsul.server.protocol import (
    ChatTokenLogprob,
    Float,
    Int,
    IrminsulUsage,
    PromptTokensDetails,
    UsageInfo,
    WireModel,
)


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_logprobs: Int | None = None
    include: list[str] | None = None
    text: dict | None = None
    stream: bool = False
    metadata: dict | None = None
    store: bool | None = None  # accepted; nothing is stored (the response says store: false)
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    reasoning: dict | None = None
    truncation: str | None = None


class OutputText(WireModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list[ChatTokenLogprob] = Field(default_factory=list)


class ResponseMessage(WireModel):
    type: Literal["message"] = "message"
    id: str
    status: str
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class ResponseFunctionCall(WireModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


OutputItem = Annotated[ResponseMessage | ResponseFunctionCall, Field(discriminator="type")]


class OutputTokensDetails(WireModel):
    reasoning_tokens: int = 0


class ResponseUsage(WireModel):
    input_tokens: int
    input_tokens_details: PromptTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int
    irminsul: IrminsulUsage

    @classmethod
    def of(cls, u: UsageInfo) -> ResponseUsage:
        return cls(
            input_tokens=u.prompt_tokens,
            input_tokens_details=u.prompt_tokens_details,
            output_tokens=u.completion_tokens,
            total_tokens=u.total_tokens,
            irminsul=u.irminsul,
        )


class IncompleteDetails(WireModel):
    reason: str


class ResponseObject(WireModel):
    """A response as the stateless server gives it (store false, no previous response)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: str  # in_progress, completed, incomplete
    model: str
    output: list[OutputItem]
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    tools: list
    tool_choice: str | dict
    text: dict
    store: bool = False
    previous_response_id: None = None
    reasoning: None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None


class ResponseEvent(WireModel):
    type: str
    sequence_number: int


class ResponseLifecycleEvent(ResponseEvent):  # response.created, .in_progress, .completed, .incomplete
    response: ResponseObject


class OutputItemEvent(ResponseEvent):  # response.output_item.added, .done
    output_index: int
    item: OutputItem


class ContentPartEvent(ResponseEvent):  # response.content_part.added, .done
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDeltaEvent(ResponseEvent):  # response.output_text.delta
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[ChatTokenLogprob]


class OutputTextDoneEvent(ResponseEvent):  # response.output_text.done
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[ChatTokenLogprob]


class ArgumentsDeltaEvent(ResponseEvent):  # response.function_call_arguments.delta
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(ResponseEvent):  # response.function_call_arguments.done
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(ResponseEvent):  # error
    code: str | None = None
    message: str
    param: str | None = None
