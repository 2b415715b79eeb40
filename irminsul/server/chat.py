"""Chat requests -> token ids + segment starts, on render.py's segment-aligned templates.

Each message (and each text part of one) and each tool schema is tokenised on its own, so the
same content always tokenises the same way wherever it sits, and every segment start is handed to
the engine: CDC chunking restarts there (S2 without model-visible markers, docs/design.md section 3).
The template is chosen from the checkpoint's special tokens.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from irminsul.model.tokenizer import Tokenizer
from irminsul.server import tools
from irminsul.workloads.render import DEEPSEEK, QWEN2, ChatTemplate, segment_texts
from irminsul.workloads.trace import parse_request

ROLES = ("system", "user", "assistant", "tool")


def _tool_call_text(calls) -> str:
    # the bundled model's training data wrote each call as this object right after the content
    # (irminsul/train/data.py), with the arguments as OpenAI sends them: JSON text
    return "".join(json.dumps({"name": n, "arguments": a}, ensure_ascii=False) for n, a in calls)


# The bundled model's (and tiny checkpoints') template: {{bos}} + <|role|>content<|end|> ... <|assistant|>
IRMINSUL = ChatTemplate(
    bos="<|bos|>",
    opener={r: f"<|{r}|>" for r in ROLES},
    closer={r: "<|end|>" for r in ROLES},
    generation="<|assistant|>",
    tools_header="# Tools\nYou may call these functions:",
    tools_footer="\n",
    tool_text=lambda t: "\n" + json.dumps(t, ensure_ascii=False),
    calls_text=_tool_call_text,
)

# Checked in order: the first template whose special tokens the tokenizer knows wins.
_BY_TOKENS = (
    (IRMINSUL, tools.IRMINSUL, ("<|bos|>", "<|user|>", "<|assistant|>", "<|end|>")),
    (DEEPSEEK, tools.DEEPSEEK, ("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>")),
    (QWEN2, tools.HERMES, ("<|im_start|>", "<|im_end|>")),
)


def _wrapped(value, mark: str):
    """Every string value in a JSON value between two marks (roles and types stay as they are: the
    template reads them; keys too: it looks fields up by name)."""
    if isinstance(value, str):
        return f"{mark}{value}{mark}"
    if isinstance(value, list):
        return [_wrapped(v, mark) for v in value]
    if isinstance(value, dict):
        return {k: v if k in ("role", "type") else _wrapped(v, mark) for k, v in value.items()}
    return value


def template_for(tokenizer: Tokenizer) -> tuple[ChatTemplate | None, tools.ToolFormat | None]:
    """The chat template and the tool-call syntax that go with the tokenizer's special tokens."""
    for template, tool_format, tokens in _BY_TOKENS:
        if all(tokenizer.token_to_id(t) is not None for t in tokens):
            return template, tool_format
    return None, None


@dataclass(frozen=True)
class RenderedChat:
    token_ids: list[int]
    segment_starts: list[int]  # strictly increasing, the first is 0


class ChatRenderer:
    """Renders OpenAI chat messages (+ tools) for one tokenizer.

    NOTE: no memo of tokenised text across requests: one shared by every tenant made a request's
    timing tell whether some tenant had sent the same text before (a membership oracle), and one
    bounded by entries, not bytes, grew by the size of every distinct large body.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.template, self.tool_format = template_for(tokenizer)
        self._specials = tokenizer.special_strings

    def _encode(self, text: str, mark: str) -> list[int]:
        """One segment's text, in which every client string is wrapped in `mark`s. Where no client
        string holds a special token's text, the segment is encoded whole, as it always was; where
        one does, the template's pieces are encoded with their control tokens and the client's
        pieces as text."""
        pieces = text.split(mark)  # template, client, template, client, ..., template
        client = pieces[1::2]
        if not any(s in c for c in client for s in self._specials):
            return self.tokenizer.encode("".join(pieces), add_bos=False)
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if piece:
                ids += self.tokenizer.encode_text(piece) if i % 2 else self.tokenizer.encode(piece, add_bos=False)
        return ids

    def render(self, messages: list, tools: list | None = None) -> RenderedChat:
        """Raises ValueError with a message for people when the request cannot be rendered."""
        if self.template is None:
            raise ValueError("this model's tokenizer matches no chat template Irminsul knows "
                             "(irminsul, deepseek, qwen2); use /v1/completions with a rendered prompt")
        # OpenAI's newer "developer" role is a system message to every template here.
        messages = [{**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m
                    for m in messages]
        parse_request({"messages": messages, "tools": tools or []})  # validates, says what is wrong
        # Every string the client sent is wrapped in a mark no client can guess, so the template's
        # text and the client's can be told apart after rendering (control tokens: see _encode).
        mark = f"\ue000{secrets.token_hex(8)}\ue001"
        request = parse_request({"messages": _wrapped(messages, mark), "tools": _wrapped(tools or [], mark)})
        tokens: list[int] = []
        starts: list[int] = []
        for text in segment_texts(request, self.template):
            ids = self._encode(text, mark) if text else []
            if ids:
                starts.append(len(tokens))
                tokens.extend(ids)
        return RenderedChat(tokens, starts)
