"""The API's errors: an answer other than 200, with OpenAI's error body (protocol.ErrorResponse)."""

from __future__ import annotations

from irminsul.server.protocol import ErrorInfo, ErrorResponse


class APIError(Exception):
    """An answer other than 200, with OpenAI's error body. `retry_after`: seconds, sent as Retry-After
    (a 429 or 503 a retry may turn into a 200)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after
        self.type = type or {
            400: "invalid_request_error",
            401: "authentication_error",
            403: "permission_error",
            404: "not_found_error",
            413: "invalid_request_error",
            429: "rate_limit_error",
            503: "service_unavailable",
        }.get(status, "server_error")

    def body(self) -> dict:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        ).model_dump()

    @property
    def headers(self) -> dict | None:
        return None if self.retry_after is None else {"Retry-After": str(self.retry_after)}


def context_exceeded(context: int, detail: str, param: str | None, what: str = "messages") -> APIError:
    """A request longer than the context, in OpenAI's words and code: clients key on them (litellm's
    ContextWindowExceededError, LangChain's context-overflow error) to shorten instead of retrying."""
    return APIError(
        400,
        f"This model's maximum context length is {context} tokens. However, {detail}. "
        f"Please reduce the length of the {what}.",
        param=param,
        code="context_length_exceeded",
    )
