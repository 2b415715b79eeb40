"""The OpenAI wire format: the request and response models, as vLLM's protocol.py holds them.

Unknown request fields are kept and ignored (agent frameworks send many); what a known field may
hold beyond its type, and whether the engine can honour it, is checked when the request is
translated for the engine (translate.py). A body is read, decoded and bounded before it becomes
one of these models (body.py).

Responses are built from the models below and sent as ``model_dump()`` gives them: a field is
null when OpenAI's API sends null, and absent when it leaves the field out (a model's
``absent_if_none`` names those: a delta's unset parts, a message without tool calls). Errors use
OpenAI's body, ErrorResponse: ``{"error": {"message", "type", "param", "code"}}`` (errors.py). The
Responses API's models are protocol_responses.py's.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, model_serializer

# -- requests ----------------------------------------------------------------------------------


def _no_bool(value):
    # NOTE: JSON true is not the number 1: pydantic's lax mode would take it as one
    if isinstance(value, bool):
        raise ValueError("must be a number, not a boolean")
    return value


def _no_bools(value):
    if isinstance(value, list) and any(isinstance(v, bool) for v in value):
        raise ValueError("must hold integers, not booleans")
    return value


Int = Annotated[int, BeforeValidator(_no_bool)]
Float = Annotated[float, BeforeValidator(_no_bool)]
IntList = Annotated[list[int], BeforeValidator(_no_bools)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """The fields chat and completion requests share: what to generate and how to sample it."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int | None = None  # vLLM/SGLang extension
    seed: Int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: IntList | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    n: Int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None  # vLLM: the request's cache namespace
    best_of: int | None = None  # only 1 (refused otherwise)
    logprobs: bool | Int | None = None  # chat: true/false; completions: the number of alternatives
    top_logprobs: Int | None = None
    logit_bias: dict | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    # vLLM extensions
    repetition_penalty: Float | None = None
    min_tokens: Int | None = None
    min_p: Float | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool = True
    # structured output: at most one of these (OpenAI's response_format, vLLM's older guided_* and
    # newer structured_outputs)
    response_format: dict | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[Any] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict | None = None


class ChatCompletionRequest(GenerationRequest):
    messages: list[Any]
    tools: list[Any] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call (forced: exactly one)
    max_completion_tokens: Int | None = None
    add_generation_prompt: bool = True  # vLLM's chat-template controls
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None


class CompletionRequest(GenerationRequest):
    prompt: str | IntList | list[str] | list[IntList]
    echo: bool = False
    suffix: str | None = None


class PublishRequest(BaseModel):
    """POST /v1/cache/chunks: exactly one of text or token_ids."""

    # NOTE: "exactly one" is checked before the model is built (serving_publish.parse_publish)

    model: str | None = None
    text: str | None = None
    token_ids: list[int] | None = None


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    tools: list[Any] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: IntList


# -- responses ---------------------------------------------------------------------------------


class WireModel(BaseModel):
    """A response model: sent as model_dump() gives it, `absent_if_none` fields left out when None."""

    absent_if_none: ClassVar[tuple[str, ...]] = ()  # fields left out of the body when None (not null)

    @model_serializer(mode="wrap")
    def _leave_out(self, handler):
        out = handler(self)
        for name in self.absent_if_none:
            if out.get(name, 0) is None:
                del out[name]
        return out


class ErrorInfo(WireModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(WireModel):
    error: ErrorInfo


class PromptTokensDetails(WireModel):
    cached_tokens: int


class IrminsulUsage(WireModel):
    """Where the prompt's rows came from: a prefix hit, reused chunks (their carve-out and S1
    tokens recomputed), or computed."""

    prefix_tokens: int
    reused_tokens: int
    carve_out_tokens: int
    computed_tokens: int
    s1_tokens: int


class UsageInfo(WireModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    irminsul: IrminsulUsage


class TopLogprob(WireModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(WireModel):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(WireModel):
    """The legacy completions' parallel lists (an echoed prompt's first token has no log-prob)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class FunctionCall(WireModel):
    name: str
    arguments: str


class ToolCall(WireModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(WireModel):
    absent_if_none = ("tool_calls",)
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionChoice(WireModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(WireModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaFunctionCall(WireModel):
    absent_if_none = ("name",)
    name: str | None = None
    arguments: str


class DeltaToolCall(WireModel):
    """A call's first delta names it (id, type, name); the ones after carry its arguments."""

    absent_if_none = ("id", "type")
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(WireModel):
    absent_if_none = ("role", "content", "tool_calls")
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(WireModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(WireModel):
    """`usage` is null on every chunk but the last when the client asked for it (stream_options),
    absent when it did not: the serving code leaves it out then."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class CompletionChoice(WireModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(WireModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionChunk(WireModel):
    """As ChatCompletionChunk: `usage` is left out unless the client asked for it."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TokenizeResponse(WireModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(WireModel):
    prompt: str


class PublishResponse(WireModel):
    object: Literal["cache.chunks"] = "cache.chunks"
    tokens: int  # of the document
    entries: int  # chunk entries stored
    stored_tokens: int
    skipped: int
    rejected: int


class ModelCard(WireModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "irminsul"
    max_model_len: int
    irminsul: dict  # {"reuse": mode, "store": [tier specs]}


class ModelList(WireModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
