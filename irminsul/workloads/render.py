"""Segment-aligned chat rendering: a request's messages and tools become token ids.

Each message, each tool schema and each text part of a message is tokenised on its own and the
results are concatenated, so the same content always tokenises the same way wherever it sits
(tokenised together, the same passage can come out at 468 or 550 tokens depending on its
neighbours) and every segment start is recorded for S2 chunking (design §3).
The templates follow DeepSeek-V3.1's and Qwen2.5's chat templates closely, not byte for byte.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from irminsul.workloads.tokenizers import NamedTokenizer, load_tokenizer
from irminsul.workloads.trace import Request


@dataclass(frozen=True)
class Rendered:
    token_ids: np.ndarray  # [n] int32
    segment_starts: tuple[int, ...]  # strictly increasing, the first is 0


def _json(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)


def _calls(m: dict) -> list[tuple[str, str]]:
    """(name, arguments) of an assistant message's tool_calls or legacy function_call."""
    calls = [c.get("function", c) for c in m.get("tool_calls") or []]
    if m.get("function_call"):
        calls.append(m["function_call"])
    out = []
    for c in calls:
        args = c.get("arguments", "")
        out.append((str(c.get("name", "")), args if isinstance(args, str) else _json(args)))
    return out


def _deepseek_calls(calls) -> str:
    inner = "\n".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"
        for name, args in calls
    )
    return f"<｜tool▁calls▁begin｜>{inner}<｜tool▁calls▁end｜>"


def _deepseek_tool(t: dict) -> str:
    f = t.get("function", t)
    return (f"\n### {f.get('name', '')}\nDescription: {f.get('description', '')}\n\n"
            f"Parameters: {_json(f.get('parameters', {}))}\n")


def _qwen2_calls(calls) -> str:
    return "".join(
        f'\n<tool_call>\n{{"name": "{name}", "arguments": {args or "{}"}}}\n</tool_call>' for name, args in calls
    )


@dataclass(frozen=True)
class ChatTemplate:
    bos: str
    opener: dict  # role -> text before the content
    closer: dict  # role -> text after the content
    generation: str  # the assistant prompt at the end of every request
    tools_header: str
    tools_footer: str
    tool_text: Callable[[dict], str]
    calls_text: Callable[[list], str]


DEEPSEEK = ChatTemplate(
    bos="<｜begin▁of▁sentence｜>",
    opener={"system": "", "user": "<｜User｜>", "assistant": "<｜Assistant｜>",
            "tool": "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>"},
    closer={"system": "\n\n", "user": "", "assistant": "<｜end▁of▁sentence｜>",
            "tool": "<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"},
    generation="<｜Assistant｜>",
    tools_header="## Tools\nYou have access to the following tools:\n",
    tools_footer=("\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n<｜tool▁calls▁begin｜>"
                  "<｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜>"
                  "<｜tool▁calls▁end｜>\n"),
    tool_text=_deepseek_tool,
    calls_text=_deepseek_calls,
)

QWEN2 = ChatTemplate(
    bos="",
    opener={r: f"<|im_start|>{r}\n" for r in ("system", "user", "assistant")}
    | {"tool": "<|im_start|>user\n<tool_response>\n"},
    closer={"system": "<|im_end|>\n", "user": "<|im_end|>\n", "assistant": "<|im_end|>\n",
            "tool": "\n</tool_response><|im_end|>\n"},
    generation="<|im_start|>assistant\n",
    tools_header=("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                  "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"),
    tools_footer=("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                  'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
                  '"arguments": <args-json-object>}\n</tool_call>'),
    tool_text=lambda t: "\n" + _json(t),
    calls_text=_qwen2_calls,
)

TEMPLATES = {"deepseek": DEEPSEEK, "qwen2": QWEN2}


def _message_texts(tpl: ChatTemplate, m: dict, closer: bool = True) -> list[str]:
    role = "tool" if m["role"] == "function" else m["role"]
    content = m.get("content")
    calls = tpl.calls_text(_calls(m)) if role == "assistant" and _calls(m) else ""
    end = tpl.closer[role] if closer else ""
    if isinstance(content, list):  # text parts: each its own segment
        parts = [p["text"] + "\n\n" for p in content]
        return [tpl.opener[role], *parts, calls + end]
    return [tpl.opener[role] + (content or "") + calls + end]


def segment_texts(request: Request, tpl: ChatTemplate) -> list[str]:
    """The text of each segment, in order (empty strings are dropped later)."""
    msgs = list(request.messages)
    n_sys = next((i for i, m in enumerate(msgs) if m["role"] != "system"), len(msgs))
    out = [tpl.bos]
    for i, m in enumerate(msgs[:n_sys]):  # the system closer of the last one waits for the tools
        out += _message_texts(tpl, m, closer=not request.tools or i < n_sys - 1)
    if request.tools:
        out.append(("" if n_sys else tpl.opener["system"]) + tpl.tools_header)
        out += [tpl.tool_text(t) for t in request.tools]
        out.append(tpl.tools_footer + tpl.closer["system"])
    for m in msgs[n_sys:]:
        out += _message_texts(tpl, m)
    out.append(tpl.generation)
    return out


class Renderer:
    """Renders requests with one tokenizer; memoises segment tokenisation (agent turns repeat)."""

    def __init__(self, tokenizer: str | NamedTokenizer = "deepseek", cache_size: int = 200_000):
        self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.template = TEMPLATES[self.tokenizer.family]
        self._cache: dict[str, np.ndarray] = {}
        self._cache_size = cache_size

    def _encode(self, text: str) -> np.ndarray:
        ids = self._cache.get(text)
        if ids is None:
            ids = np.asarray(self.tokenizer.encode(text), dtype=np.int32)
            if len(self._cache) >= self._cache_size:
                self._cache.clear()
            self._cache[text] = ids
        return ids

    def __call__(self, request: Request) -> Rendered:
        if request.pretokenized:
            ids = np.asarray(request.token_ids, dtype=np.int32)
            return Rendered(ids, request.segments if request.segments else (0,))
        pieces = [p for p in (self._encode(t) for t in segment_texts(request, self.template) if t) if len(p)]
        starts = np.cumsum([0] + [len(p) for p in pieces[:-1]])
        return Rendered(np.concatenate(pieces), tuple(int(s) for s in starts))


def render_trace(requests, tokenizer: str | NamedTokenizer = "deepseek", progress: bool | None = None,
                 desc: str = "render") -> Iterator[tuple[str, Rendered]]:
    """Yield (session, Rendered) per request, in order; a progress bar on long traces."""
    from tqdm import tqdm

    renderer = Renderer(tokenizer)
    show = len(requests) >= 200 if progress is None else progress
    for r in tqdm(requests, desc=desc, disable=not show, leave=False):
        yield r.session, renderer(r)
