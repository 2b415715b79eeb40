"""Tool calls: the model's tool-call syntax -> OpenAI's `tool_calls`, and the grammar that forces one.

Three syntaxes, chosen by the chat template (`chat.py`):

- `irminsul` (the bundled model): `<tool_call>{"name": "f", "arguments": {...}}</tool_call>`
- `hermes` (Qwen2/2.5, Hermes): the same with a newline inside each tag
- `deepseek` (DeepSeek-V3; V3.1's shorter form is read too):
  `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{...}\\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>`

`ToolCallParser` reads the output text incrementally, as it streams, and turns it into events:
content text, a call's name, pieces of a call's arguments. The non-streamed response is the same
parser fed the whole text, so streamed and non-streamed answers agree by construction. Arguments
are the model's own JSON text of the value (a string value is decoded: some models write the
arguments JSON-encoded). A call that does not parse stays in the content.

`tool_constraint` builds the Lark grammar (llguidance, with inline JSON schemas) of a turn with
tools: for `tool_choice="required"` or a named function the output is one or more calls (one for
a named function) whose arguments validate against the function's `parameters` schema; for
`"auto"` with a response format, a call or text in that format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import regex

from irminsul.engine.grammar import JSON_LAYOUT, Constraint, closed
from irminsul.errors import RequestError
from irminsul.server.errors import APIError


@dataclass(frozen=True)
class ToolFormat:
    name: str
    opener: str  # starts one call in the output
    closer: str  # ends it, after the arguments
    header: str  # regex from after the opener to where the arguments' JSON value starts; names the function
    drop: tuple[str, ...] = ()  # markers around a group of calls: neither content nor calls
    json_call: bool = False  # a call is one JSON object {"name": ..., "arguments": ...}
    wrap: tuple[str, str] = ("", "")  # the text around that object, when generating one
    sep: str = "\n"  # between two calls, when generating
    raw_json: bool = False  # a call whose header does not match may still be one JSON object (keys in any order)

    def grammar(
        self,
        tools: list[dict],
        named: str | None,
        added_token_id=lambda text: None,
        single: bool = False,
        text: str | None = None,
    ) -> str:
        """Lark for one call (to `named`, or to any of `tools` if `single`) or one or more (to any
        of `tools`); `text`, a Lark expression: or else output that matches it. `added_token_id`: a
        marker that is one added token is written as that token (llguidance does not match added
        tokens by their text)."""
        markers = [m for m in (self.opener, self.closer, *self.drop, "<｜tool▁sep｜>") if added_token_id(m) is not None]

        def lit(text: str) -> str:
            parts = regex.split("(" + "|".join(map(regex.escape, markers)) + ")", text) if markers else [text]
            return " ".join(
                f"<[{added_token_id(p)}]>" if p in markers else json.dumps(p, ensure_ascii=False) for p in parts if p
            )

        rules, names = [], []
        for i, fn in enumerate(tools):
            if named is not None and fn["name"] != named:
                continue
            params = closed(fn.get("parameters") or {"type": "object"})
            if self.json_call:
                schema = {
                    "type": "object",
                    "properties": {"name": {"const": fn["name"]}, "arguments": params},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                    "x-guidance": JSON_LAYOUT,
                }
                body = f"{lit(self.wrap[0])} %json {json.dumps(schema)} {lit(self.wrap[1])}"
            else:  # deepseek: the name in the header, the arguments in a code block
                schema = {**params, "x-guidance": JSON_LAYOUT} if isinstance(params, dict) else params
                body = (
                    f"{lit(self.opener + 'function<｜tool▁sep｜>' + fn['name'] + chr(10) + '```json' + chr(10))}"
                    f" %json {json.dumps(schema)} {lit(chr(10) + '```' + self.closer)}"
                )
            rules.append(f"call_{i}: {body.strip()}")
            names.append(f"call_{i}")
        calls = "call" if named is not None or single else f"call ({lit(self.sep)} call)*" if self.sep else "call+"
        start = f"{lit(self.drop[0])} {calls} {lit(self.drop[1])}" if self.drop else calls
        if text is not None:
            start = f"{start} | {text}"
        return "\n".join([f"start: {start}", f"call: {' | '.join(names)}", *rules])


_NAME_THEN_ARGUMENTS = r'\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=[{\["])'
# The bundled model writes a call as the JSON object itself (its training data's form)
IRMINSUL = ToolFormat("irminsul", '{"name"', "}", _NAME_THEN_ARGUMENTS, json_call=True, sep="")
HERMES = ToolFormat(
    "hermes",
    "<tool_call>",
    "</tool_call>",
    r'\s*\{\s*"name"' + _NAME_THEN_ARGUMENTS,
    json_call=True,
    wrap=("<tool_call>\n", "\n</tool_call>"),
    raw_json=True,
)
DEEPSEEK = ToolFormat(
    "deepseek",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    r"(?:function<｜tool▁sep｜>(?P<name>[^\n<]+)\n```(?:json)?\s*(?=[{\[])"
    r"|(?!function<)(?P<name2>[^<\n]+?)<｜tool▁sep｜>\s*(?=[{\[]))",
    drop=("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
)
FORMATS = {f.name: f for f in (IRMINSUL, HERMES, DEEPSEEK)}


def tool_constraint(
    fmt: ToolFormat,
    tools: list[dict],
    tool_choice,
    added_token_id=lambda text: None,
    parallel: bool = True,
    text: Constraint | None = None,
) -> Constraint | None:
    """The output constraint of a turn with tools. `tools` are the functions ({"name",
    "parameters", ...}); `parallel` False: at most one call; `text`: the JSON schema constraint of
    the request's response format, which applies to text turns.

    - tool_choice "required" or {"type": "function", "function": {"name": ...}}: the call is the
      output, so the grammar is the call's and `text` does not apply (OpenAI accepts the pair;
      vLLM decodes the forced tool's schema).
    - "auto" (or unset) with `text`: one or more calls, or text that matches `text`, as one
      grammar, so an agent with an output type can still call its tools.
    - otherwise `text` (None: nothing constrains the output)."""
    if tool_choice == "none":
        return text
    named = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    alternative = None
    if tool_choice in (None, "auto"):
        alternative = _inline_json(text) if text is not None else None
        if alternative is None:
            return text
    try:
        return Constraint.lark(fmt.grammar(tools, named, added_token_id, single=not parallel, text=alternative))
    except RequestError as e:  # (a function's parameters too big or too deep to compile)
        raise APIError(400, f"tools: {e}", param="tools") from None


def _inline_json(constraint: Constraint) -> str | None:
    """A JSON schema constraint as a Lark expression (None: not one, or the schema `false`)."""
    schema = json.loads(constraint.spec) if constraint.kind == "json_schema" else None
    if schema is True:
        schema = {}
    return f"%json {json.dumps({**schema, 'x-guidance': JSON_LAYOUT})}" if isinstance(schema, dict) else None


@dataclass
class Call:
    name: str
    arguments: str = ""


# (frozen dataclasses, not NamedTuples: a tuple's field may not be called `index`, its method's name)
@dataclass(frozen=True, slots=True)
class Content:
    """Output text that is not a tool call."""

    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    """Call number `index` begins: the function's name is known."""

    index: int
    name: str


@dataclass(frozen=True, slots=True)
class CallArguments:
    """More of call number `index`'s arguments (JSON text, in order)."""

    index: int
    text: str


ToolEvent = Content | CallStart | CallArguments


@dataclass
class ToolCallParser:
    """Output text in, events out (`ToolEvent`: Content, CallStart, CallArguments).
    `names`: the functions the request declared; a call to another one stays content. `max_calls`:
    calls after that many are read but not reported (parallel_tool_calls=false keeps the first, as
    vLLM does)."""

    fmt: ToolFormat
    names: frozenset[str] | None = None
    max_calls: int | None = None
    calls: list[Call] = field(default_factory=list)
    _buf: str = ""
    _mode: str = "text"  # text | header | arguments | raw | tail
    _ws: str = ""  # whitespace held back: shown only if more content follows
    _after_call: bool = False
    _depth: int = 0
    _in_string: bool = False
    _escape: bool = False
    _string_value: bool = False  # the arguments are a JSON string (decoded when complete)
    _value: str = ""

    def feed(self, text: str) -> list[ToolEvent]:
        self._buf += text
        out: list[ToolEvent] = []
        while self._step(out, final=False):
            pass
        return self._kept(out)

    def _kept(self, events: list[ToolEvent]) -> list[ToolEvent]:
        if self.max_calls is None:
            return events
        return [e for e in events if isinstance(e, Content) or e.index < self.max_calls]

    def finish(self) -> list[ToolEvent]:
        """The events the end of the output releases (held-back text, an unfinished call's text)."""
        out: list[ToolEvent] = []
        while self._step(out, final=True):
            pass
        if self._mode in ("header", "raw"):  # a call that never took shape: it was text after all
            self._content(out, self.fmt.opener + self._buf)
        elif self._mode == "text":
            self._content(out, self._buf)
        elif self._mode == "arguments" and self._string_value and self._value:
            self._emit_args(out, self._value)  # cut off: the raw text so far
        self._buf, self._mode = "", "text"
        if self._ws and not self.calls:
            out.append(Content(self._ws))
        self._ws = ""
        return self._kept(out)

    # -- the state machine ---------------------------------------------------------------

    def _content(self, out: list, text: str) -> None:
        """Content text out; whitespace at its end waits for more content (after a call, or at the
        end of an output that has calls, it is layout, not content)."""
        text = self._ws + text
        if self._after_call:
            text = text.lstrip()
        stripped = text.rstrip()
        self._ws = text[len(stripped) :]
        if stripped:
            out.append(Content(stripped))
            self._after_call = False

    def _step(self, out: list, final: bool) -> bool:
        fmt, buf = self.fmt, self._buf
        if self._mode == "text":
            markers = (fmt.opener, *fmt.drop)
            hits = [(buf.find(m), m) for m in markers if m in buf]
            if hits:
                at, marker = min(hits)
                self._content(out, buf[:at])
                self._buf = buf[at + len(marker) :]
                if marker == fmt.opener:
                    self._mode = "header"
                return True
            keep = 0 if final else _partial_suffix(buf, markers)
            self._content(out, buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep :]
            return False
        if self._mode == "header":
            m = regex.match(fmt.header, buf, partial=True)
            if m is None:
                self._mode = "raw"
                return True
            if m.partial:  # (the header's lookahead needs the value's first character)
                return False
            name = m.group("name") or (m.groupdict().get("name2") or "")
            if fmt.json_call:
                try:
                    name = json.loads(f'"{name}"')
                except json.JSONDecodeError:
                    pass
            name = name.strip()
            if self.names is not None and name not in self.names:  # not a function it may call: text
                self._content(out, fmt.opener + buf[: m.end()])
                self._buf, self._mode = buf[m.end() :], "text"
                return True
            self.calls.append(Call(name))
            out.append(CallStart(len(self.calls) - 1, self.calls[-1].name))
            self._buf = buf[m.end() :]
            self._mode, self._depth, self._in_string, self._escape, self._value = "arguments", 0, False, False, ""
            self._string_value = False
            return True
        if self._mode == "arguments":
            return self._scan_arguments(out)
        if self._mode == "raw":  # no header: the whole body, if it is one JSON object with a name
            at = buf.find(fmt.closer)
            if at < 0:
                return False
            body, self._buf, self._mode = buf[:at], buf[at + len(fmt.closer) :], "text"
            call = _whole_call(body) if fmt.raw_json else None
            if call is not None and self.names is not None and call[0] not in self.names:
                call = None
            if call is None:
                self._content(out, fmt.opener + body + fmt.closer)
            else:
                self.calls.append(Call(call[0]))
                out.append(CallStart(len(self.calls) - 1, call[0]))
                self._emit_args(out, call[1])
                self._after_call, self._ws = True, ""
            return True
        # tail: whatever follows the arguments up to the closer (`}`, a code fence) is syntax
        at = buf.find(fmt.closer)
        if at < 0:
            keep = len(fmt.closer) - 1
            self._buf = buf[-keep:] if len(buf) > keep else buf
            return False
        self._buf, self._mode, self._after_call, self._ws = buf[at + len(fmt.closer) :], "text", True, ""
        return True

    def _scan_arguments(self, out: list) -> bool:
        buf = self._buf
        i = 0
        if self._depth == 0 and not self._in_string:  # the value has not started yet
            stripped = buf.lstrip()
            if not stripped:
                self._buf = ""
                return False
            i = len(buf) - len(stripped)
            self._string_value = stripped[0] == '"'  # the header ends where `{`, `[` or `"` starts
        start = i
        while i < len(buf):
            c = buf[i]
            i += 1
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
                    if self._depth == 0:  # a string value is complete
                        break
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    break
        piece = buf[start:i]
        done = self._depth == 0 and not self._in_string and piece.strip() != ""
        if self._string_value:
            self._value += piece
            if done:
                try:
                    decoded = json.loads(self._value)
                except json.JSONDecodeError:
                    decoded = self._value
                self._emit_args(out, decoded if isinstance(decoded, str) else self._value)
        else:
            self._emit_args(out, piece)
        self._buf = buf[i:]
        if done:
            self._mode = "tail"
            return True
        return False

    def _emit_args(self, out: list, text: str) -> None:
        if text:
            self.calls[-1].arguments += text
            out.append(CallArguments(len(self.calls) - 1, text))


def _partial_suffix(text: str, markers) -> int:
    """The length of the longest end of `text` that begins one of `markers` (held back: it may be one)."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if m.startswith(text[-n:]):
                best = n
                break
    return best


def _whole_call(body: str) -> tuple[str, str] | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def parse_all(fmt: ToolFormat, text: str, names=None, max_calls: int | None = None) -> tuple[str | None, list[Call]]:
    """The whole output -> (content or None, calls): what a non-streamed response carries."""
    parser = ToolCallParser(fmt, names, max_calls)
    events = parser.feed(text) + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    return (content or None) if parser.calls else content, parser.calls[:max_calls]
