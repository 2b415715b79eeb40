"""Chat requests -> token ids + segment starts.

Each segment the chat format makes (`irminsul/model/chat_format.py`: each message, each text part
and each tool schema) is tokenised on its own, and every segment start is handed to the engine:
CDC chunking restarts there (S2 without model-visible markers, docs/design.md section 3).
The template is the checkpoint's own Jinja `chat_template` (`template.py`); a checkpoint without one
gets the hand-written chat format its special tokens match.
"""

from __future__ import annotations

import bisect
import json
import re
import secrets
from dataclasses import dataclass

from irminsul.model.chat_format import DEEPSEEK, IRMINSUL, QWEN2, TEMPLATES, ChatTemplate, parse_chat, segment_texts
from irminsul.model.tokenizer import Tokenizer
from irminsul.server import tools
from irminsul.server.template import REASONING_FIELDS, RESERVED, JinjaTemplate, Marks, Piece, SpecialText, boundaries

# Checked in order: the first template whose special tokens the tokenizer knows wins.
_BY_TOKENS = ((IRMINSUL, tools.IRMINSUL), (DEEPSEEK, tools.DEEPSEEK), (QWEN2, tools.HERMES))


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
    for template, tool_format in _BY_TOKENS:
        if all(tokenizer.token_to_id(t) is not None for t in template.markers):
            return template, tool_format
    return None, None


@dataclass(frozen=True)
class RenderedChat:
    token_ids: list[int]
    segment_starts: list[int]  # strictly increasing, the first is 0


class ChatRenderer:
    """Renders OpenAI chat messages (+ tools) for one tokenizer: with the checkpoint's own Jinja
    chat template when it has one (`template.py`), else with the hand-written template its special
    tokens match.

    NOTE: no memo of tokenised text across requests: one shared by every tenant made a request's
    timing tell whether some tenant had sent the same text before (a membership oracle), and one
    bounded by entries, not bytes, grew by the size of every distinct large body.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.template, self.tool_format = template_for(tokenizer)
        self.jinja = (
            JinjaTemplate(tokenizer.chat_template, tokenizer.special_tokens_map) if tokenizer.chat_template else None
        )
        if self.jinja is not None and self.template is None:  # its tool syntax, from its tokens or its text
            if tokenizer.added_token_id("<｜tool▁calls▁begin｜>") is not None:
                self.tool_format = tools.DEEPSEEK
            elif "<tool_call>" in self.jinja.source:
                self.tool_format = tools.HERMES
        # every added token's text is hidden in client strings (DeepSeek's role markers are added but not
        # flagged special), but for unflagged ones the template looks for in content (R1's '</think>')
        self._looked_for = _inspected(self.jinja.source) if self.jinja is not None else set()
        special = set(tokenizer.special_strings)
        self._specials = tuple(t for t in tokenizer.added_strings if t in special or t not in self._looked_for)
        self._special_re = _alternatives(self._specials)  # client text holding one is encoded as text
        self._added_re = _alternatives(tokenizer.added_strings)  # segments may start at any added token

    def _has_special(self, text: str) -> bool:
        return self._special_re is not None and self._special_re.search(text) is not None

    def _touches_client(self, text: str, client: list[tuple[int, int]]) -> bool:
        """Whether some special token's text in `text` has a character of a client span (sorted,
        disjoint) in it: held by one, or made by a client string ending or starting it."""
        if self._special_re is None or not client:
            return False
        starts = [a for a, _ in client]
        for m in self._special_re.finditer(text):
            k = bisect.bisect_left(starts, m.end()) - 1  # the last span starting before the match ends
            if k >= 0 and client[k][1] > m.start():
                return True
        return False

    def _encode(self, text: str, client: list[tuple[int, int]], hidden: SpecialText) -> list[int]:
        """One segment's text, its special tokens' text hidden (`SpecialText`); `client` the spans
        in it that the client sent. Where no special token's text touches a client span, the
        segment is encoded whole; where one does, the template's pieces are encoded with their
        control tokens and the client's as text."""
        text, client = hidden.restore(text, client)
        if not self._touches_client(text, client):
            return self.tokenizer.encode(text, add_bos=False)
        ids, at = [], 0
        for a, b in client:
            if a > at:
                ids += self.tokenizer.encode(text[at:a], add_bos=False)
            ids += self.tokenizer.encode_text(text[a:b])
            at = b
        if at < len(text):
            ids += self.tokenizer.encode(text[at:], add_bos=False)
        return ids

    def render(
        self,
        messages: list,
        tools: list | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict | None = None,
    ) -> RenderedChat:
        """Raises ValueError with a message for people when the request cannot be rendered."""
        # OpenAI's newer "developer" role is a system message to every template here.
        messages = [
            {**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m for m in messages
        ]
        parse_chat(messages, tools or [])  # validates, says what is wrong
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message=true needs add_generation_prompt=false: the final message "
                "is continued, not answered"
            )
        if continue_final_message and messages[-1].get("role") != "assistant":
            raise ValueError("continue_final_message=true needs an assistant message last")
        if self.jinja is None:
            return self._render_builtin(messages, tools, add_generation_prompt, continue_final_message, template_kwargs)
        return self._render_jinja(
            self.jinja, messages, tools, add_generation_prompt, continue_final_message, template_kwargs or {}
        )

    # -- the checkpoint's Jinja template ---------------------------------------------------

    @staticmethod
    def _prepare(jinja: JinjaTemplate, messages: list) -> list[dict]:
        """Messages as templates expect them (as transformers gives them): no None-valued keys (OpenAI
        sends `content: null` beside tool calls; templates handle a missing key), reasoning under
        every name templates read, and tool-call arguments as objects where the template writes
        them with tojson."""
        out = []
        for m in messages:
            m = {k: v for k, v in m.items() if v is not None}
            reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
            if reasoning is not None:
                m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
            if jinja.decodes_arguments and m.get("tool_calls"):
                m["tool_calls"] = [_decoded_arguments(c) for c in m["tool_calls"]]
            out.append(m)
        return out

    @staticmethod
    def _with_parts(jinja: JinjaTemplate, messages: list[dict], wrap) -> list[dict]:
        """Text parts as the template reads them: a list of parts, or (most templates) one string,
        joined by newlines as vLLM joins them. `wrap(text, unit)` marks each client string."""
        out = []
        for i, m in enumerate(messages):
            content = m.get("content")
            rest = wrap({k: v for k, v in m.items() if k != "content"}, ("message", i))
            if isinstance(content, list):
                parts = [wrap(p["text"], ("part", i, j)) for j, p in enumerate(content)]
                content = (
                    [{**p, "text": t} for p, t in zip(content, parts)] if jinja.parts_as_list else "\n".join(parts)
                )
            elif isinstance(content, str):
                content = wrap(content, ("message", i))
            out.append({**rest, "content": content} if "content" in m else rest)
        return out

    def _render_jinja(
        self, jinja: JinjaTemplate, messages, tools, add_generation_prompt, continue_final_message, kwargs
    ) -> RenderedChat:
        if bad := sorted(set(kwargs) & RESERVED):
            raise ValueError(f"chat_template_kwargs may not set {', '.join(bad)}")
        if self._has_special(json.dumps(kwargs, ensure_ascii=False)):
            raise ValueError("chat_template_kwargs holds a special token's text")
        hidden = SpecialText(self._specials, self._special_re)
        prepared, tools = hidden.hide(self._prepare(jinja, messages)), hidden.hide(tools)
        marks = Marks()
        marked = jinja.render(
            self._with_parts(jinja, prepared, marks.wrap),
            [marks.wrap(t, ("tool", k)) for k, t in enumerate(tools or [])],
            add_generation_prompt,
            kwargs,
        )
        plain = jinja.render(self._with_parts(jinja, prepared, lambda v, unit: v), tools, add_generation_prompt, kwargs)
        split = marks.split(marked)
        if split is not None and split[0] == plain:
            text, pieces = split
        else:  # the template rewrote some client text: find each message's content instead
            text, pieces = plain, self._find_contents(plain, prepared)
        if continue_final_message:  # the text ends where the final message's content does
            last = len(messages) - 1
            ends = [p.end for p in pieces if p.unit is not None and p.unit[1] == last and p.unit[0] != "tool"]
            if not ends:
                raise ValueError("continue_final_message: the chat template does not show the final message")
            text = text[: max(ends)]
            pieces = [Piece(p.start, min(p.end, len(text)), p.unit) for p in pieces if p.start < len(text)]
        tokens: list[int] = []
        starts: list[int] = []
        cuts = boundaries(text, pieces, self._added_re) + [len(text)]
        # each segment's client pieces, in one sweep over pieces in order (not a scan of every piece per
        # segment: a request of many text parts would take time quadratic in their number)
        client_pieces = sorted((p for p in pieces if p.unit is not None), key=lambda p: p.start)
        first = 0
        for a, b in zip(cuts, cuts[1:]):
            while first < len(client_pieces) and client_pieces[first].end <= a:
                first += 1
            client, j = [], first
            while j < len(client_pieces) and (p := client_pieces[j]).start < b:
                if p.end > a:
                    client.append((max(p.start, a) - a, min(p.end, b) - a))
                j += 1
            ids = self._encode(text[a:b], client, hidden)
            if ids:
                starts.append(len(tokens))
                tokens.extend(ids)
        return RenderedChat(tokens, starts)

    def _find_contents(self, text: str, messages) -> list[Piece]:
        """Pieces for a rendering without marks: each message's content where it is found, in order.
        (Special tokens' text in client strings is hidden, so it stays text even here.)"""
        pieces, at = [], 0
        for i, m in enumerate(messages):
            content = m.get("content")
            if isinstance(content, list):
                content = "\n".join(p["text"] for p in content)
            if not content:
                continue
            # as sent, or what a template that splits content on a literal keeps (R1: after '</think>')
            for shown in [content.strip()] + [content.split(t)[-1].strip() for t in self._looked_for if t in content]:
                found = text.find(shown, at) if shown else -1
                if found >= 0:
                    pieces.append(Piece(found, found + len(shown), ("message", i)))
                    at = found + len(shown)
                    break
        return pieces

    # -- the hand-written templates (checkpoints without a chat_template) -------------------

    def _render_builtin(
        self, messages, tools, add_generation_prompt, continue_final_message, template_kwargs
    ) -> RenderedChat:
        if self.template is None:
            raise ValueError(
                "this model has no chat_template and its tokenizer matches no chat template Irminsul "
                f"knows ({', '.join(TEMPLATES)}); use /v1/completions with a rendered prompt"
            )
        if not add_generation_prompt or continue_final_message or template_kwargs:
            raise ValueError(
                "add_generation_prompt=false, continue_final_message and chat_template_kwargs need "
                "the checkpoint's own chat_template, which this model's tokenizer_config.json lacks"
            )
        # Every string the client sent is wrapped in a mark no client can guess, so the template's
        # text and the client's can be told apart after rendering (control tokens: see _encode);
        # special tokens' text is hidden everywhere, keys and `type` values included.
        mark = f"\ue000{secrets.token_hex(8)}\ue001"
        hidden = SpecialText(self._specials, self._special_re)
        chat = parse_chat(_wrapped(hidden.hide(messages), mark), _wrapped(hidden.hide(tools or []), mark))
        tokens: list[int] = []
        starts: list[int] = []
        for marked in segment_texts(chat, self.template):
            pieces = marked.split(mark)  # template, client, template, client, ..., template
            text, client = "", []
            for k, piece in enumerate(pieces):
                if k % 2:
                    client.append((len(text), len(text) + len(piece)))
                text += piece
            ids = self._encode(text, client, hidden) if text else []
            if ids:
                starts.append(len(tokens))
                tokens.extend(ids)
        return RenderedChat(tokens, starts)


_INSPECTED = re.compile(
    r"""(['"])((?:(?!\1).)+)\1\s+(?:not\s+)?in\b"""
    r"""|\.(?:r?split|r?partition|startswith|endswith|replace|find|index|count)\(\s*(['"])((?:(?!\3).)+)\3"""
)


def _inspected(source: str) -> set[str]:
    """The string literals a template tests content against (`'</think>' in content`,
    `content.split('</think>')`): a client's text there must reach the template as it is."""
    return {m.group(2) or m.group(4) for m in _INSPECTED.finditer(source)}


def _alternatives(strings) -> re.Pattern | None:
    return re.compile("|".join(re.escape(t) for t in sorted(strings, key=len, reverse=True))) if strings else None


def _decoded_arguments(call):
    """A tool call whose arguments (OpenAI's JSON text) decode to an object carries the object."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    args = call["function"].get("arguments")
    if isinstance(args, str):
        try:
            value = json.loads(args)
        except json.JSONDecodeError:
            return call
        if isinstance(value, dict):
            return {**call, "function": {**call["function"], "arguments": value}}
    return call
