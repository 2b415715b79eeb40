"""The trace format: JSON Lines, one request per line, in arrival order.

Either a chat request, rendered later through a named tokenizer:
    {"session": "...", "messages": [OpenAI chat messages], "tools": [OpenAI tool schemas]?}
or a pre-tokenised one:
    {"session": "...", "token_ids": [...], "segments": [start offsets]?}

A message's `content` is a string or a list of text parts (`{"type": "text", "text": ...}`);
each part is its own segment when rendered (a retrieved passage, say).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from irminsul.errors import UserFacingError
from irminsul.model.chat_format import parse_chat


class TraceError(UserFacingError, ValueError):
    """A trace line is malformed; the message names the file, the line and the problem."""


@dataclass(frozen=True)
class TraceRequest:
    """One line of a trace: a session's chat request, or its prompt already tokenised."""

    session: str
    messages: tuple = ()  # OpenAI chat messages (dicts)
    tools: tuple = ()  # OpenAI tool schemas (dicts)
    token_ids: tuple[int, ...] | None = None
    segments: tuple[int, ...] | None = None  # segment start offsets into token_ids

    @property
    def pretokenized(self) -> bool:
        return self.token_ids is not None

    def to_json(self) -> dict:
        if self.pretokenized:
            out = {"session": self.session, "token_ids": list(self.token_ids)}
            if self.segments is not None:
                out["segments"] = list(self.segments)
            return out
        out = {"session": self.session, "messages": list(self.messages)}
        if self.tools:
            out["tools"] = list(self.tools)
        return out


def parse_request(obj) -> TraceRequest:
    """Validate one decoded JSON line; raises ValueError saying what is wrong."""
    if not isinstance(obj, dict):
        raise ValueError("a request must be a JSON object")
    session = obj.get("session", "")
    if not isinstance(session, (str, int)):
        raise ValueError("'session' must be a string")
    if ("messages" in obj) == ("token_ids" in obj):
        raise ValueError("a request needs exactly one of 'messages' or 'token_ids'")
    if "token_ids" in obj:
        ids = obj["token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ValueError("'token_ids' must be a list of non-negative integers")
        segs = obj.get("segments")
        if segs is not None:
            if not isinstance(segs, list) or not all(isinstance(s, int) for s in segs):
                raise ValueError("'segments' must be a list of integer start offsets")
            if segs != sorted(set(segs)) or (segs and (segs[0] < 0 or segs[-1] >= max(len(ids), 1))):
                raise ValueError(f"'segments' must be strictly increasing offsets in [0, {len(ids)})")
            segs = tuple(segs)
        return TraceRequest(str(session), token_ids=tuple(ids), segments=segs)
    chat = parse_chat(obj["messages"], obj.get("tools") or [])
    return TraceRequest(str(session), messages=chat.messages, tools=chat.tools)


def iter_trace(path: str | Path) -> Iterator[TraceRequest]:
    path = Path(path)
    if not path.exists():
        raise TraceError(f"{path}: no such trace file")
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield parse_request(json.loads(line))
            except json.JSONDecodeError as e:
                raise TraceError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            except ValueError as e:
                raise TraceError(f"{path}:{lineno}: {e}") from None


def read_trace(path: str | Path) -> list[TraceRequest]:
    requests = list(iter_trace(path))
    if not requests:
        raise TraceError(f"{path}: the trace holds no requests")
    return requests


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> int:
    n = 0
    with Path(path).open("w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps(r.to_json(), ensure_ascii=False) + "\n")
            n += 1
    return n
