"""A checkpoint's own chat template: `tokenizer_config.json`'s Jinja `chat_template`, rendered the
way transformers' `apply_chat_template` renders it (the same sandbox, globals and filters), then cut
into segments for S2.

Every string the client sent is rendered between two marks no client can guess, which name the
message, text part or tool schema it came from. After rendering, the marks say where each piece of
client text landed; they are removed and the text is cut into segments: each message, each text
part and each tool schema starts one, at the template text that introduces it (its last special
token, else its last line). Cutting there keeps the tokens what tokenizing the whole text gives, and
the same content tokenizes and chunks the same way wherever it sits. A template that changes a
client string (`| trim`, `.split(...)`) leaves marks that no longer match the plain rendering: the
text is then cut where each message's content is found instead.

Marks cannot sit on dictionary keys or on the values the template branches on (`role`, `type`),
and a template may change what they wrap, so special tokens' text is kept out of the template
another way (`SpecialText`): before rendering, every occurrence in every client string, keys
included, is replaced by a stand-in; after it, each stand-in is put back as a span of client text.
"""

from __future__ import annotations

import bisect
import json
import re
import secrets
from dataclasses import dataclass
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from irminsul.errors import CheckpointError


class _Generation(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (it marks assistant text for training
    masks): the body is rendered as it is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` without underscore-prefixed attributes (no way to CPython internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")


class _Dict:
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; transformers' does not, and takes these options
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        dict=_Dict(),
        namespace=_Namespace,
    )
    return env


def _iterates_content(env, source: str) -> bool:
    """Whether the template loops over a message's content (OpenAI's list of parts), as vLLM
    detects it; otherwise text parts are joined into one string first."""
    for loop in env.parse(source).find_all(jinja2.nodes.For):
        it = loop.iter
        if isinstance(it, jinja2.nodes.Filter):  # `for p in message.content | selectattr(...)`
            it = it.node
        if isinstance(it, jinja2.nodes.Getattr) and it.attr == "content":
            return True
        if (
            isinstance(it, jinja2.nodes.Getitem)
            and isinstance(it.arg, jinja2.nodes.Const)
            and it.arg.value == "content"
        ):
            return True
        if isinstance(it, jinja2.nodes.Name) and it.name == "content":
            return True
    return False


# Names a message's reasoning comes under; templates read the first (transformers aliases them too).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


class JinjaTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]):
        self.source = source
        env = _environment()
        try:
            self._template = env.from_string(source)
            self.parts_as_list = _iterates_content(env, source)
        except jinja2.TemplateError as e:
            raise CheckpointError(f"the checkpoint's chat_template does not compile: {e}") from None
        self.special_tokens = special_tokens  # bos_token, eos_token, ... as the template sees them
        # Templates that write `arguments | tojson` expect an object, not OpenAI's JSON text (vLLM
        # decodes it for every template; templates that concatenate strings then fail).
        self.decodes_arguments = re.search(r"arguments['\"\]]*\s*\|\s*tojson", source) is not None

    def render(self, messages: list, tools: list | None, add_generation_prompt: bool, extra: dict) -> str:
        try:
            return self._template.render(
                messages=messages,
                tools=tools or None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **extra},
            )
        except jinja2.TemplateError as e:  # raise_exception(...) in the template, or a sandbox refusal
            raise ValueError(f"the chat template refused the request: {e}") from None
        except (TypeError, AttributeError, KeyError, IndexError) as e:
            raise ValueError(f"the chat template could not render these messages ({type(e).__name__}: {e})") from None


@dataclass(frozen=True)
class Piece:
    """A span of the rendered text; `unit` names the client string's origin (None: template text)."""

    start: int
    end: int
    unit: tuple | None


class Marks:
    """Per-request marks: `wrap(value, unit)` marks every client string in a JSON value (not roles,
    types or keys: the template reads them); `split(text)` finds them again."""

    def __init__(self):
        nonce = secrets.token_hex(8)
        self._open, self._close = f"\ue000{nonce}:", f"\ue001{nonce}\ue002"
        self._units: list[tuple] = []
        self._pattern = re.compile(re.escape(self._open) + r"(\d+)\ue003(.*?)" + re.escape(self._close), re.S)

    def wrap(self, value, unit: tuple):
        if isinstance(value, str) and value:  # (an empty string stays empty: templates test its truth)
            self._units.append(unit)
            return f"{self._open}{len(self._units) - 1}\ue003{value}{self._close}"
        if isinstance(value, list):
            return [self.wrap(v, unit) for v in value]
        if isinstance(value, dict):
            return {k: v if k in ("role", "type") else self.wrap(v, unit) for k, v in value.items()}
        return value

    def split(self, marked: str) -> tuple[str, list[Piece]] | None:
        """(the text without marks, its pieces), or None when the marks did not survive as pairs."""
        out, pieces, at, pos = [], [], 0, 0
        for m in self._pattern.finditer(marked):
            if m.start() > at:
                out.append(marked[at : m.start()])
                pieces.append(Piece(pos, pos + m.start() - at, None))
                pos += m.start() - at
            body = m.group(2)
            out.append(body)
            pieces.append(Piece(pos, pos + len(body), self._units[int(m.group(1))]))
            pos += len(body)
            at = m.end()
        out.append(marked[at:])
        pieces.append(Piece(pos, pos + len(marked) - at, None))
        text = "".join(out)
        if self._open in text or self._close in text:
            return None
        return text, [p for p in pieces if p.end > p.start]


class SpecialText:
    """Per-request stand-ins for special tokens' text in client strings.

    `hide(value)` replaces each special token's text, in every string of a JSON value (dictionary
    keys too, at any depth), by a stand-in of private-use characters and digits: no tokenizer reads
    it as a control token and no template filter (`upper`, `trim`, `tojson`) changes it. `restore`
    puts the text back after rendering and returns where it went, so it is encoded as text.
    """

    def __init__(self, specials: tuple[str, ...], pattern: re.Pattern | None):
        nonce = "".join(secrets.choice("0123456789") for _ in range(16))
        self._open, self._close = f"\ue004{nonce}:", "\ue005"
        self._specials, self._pattern = specials, pattern
        self._index = {s: k for k, s in enumerate(specials)}
        self._stand_in = re.compile(re.escape(self._open) + r"(\d+)" + re.escape(self._close))

    def _hide_str(self, s: str) -> str:
        assert self._pattern is not None  # (hide returns before calling this without a pattern)
        return self._pattern.sub(lambda m: f"{self._open}{self._index[m.group()]}{self._close}", s)

    def hide(self, value):
        if self._pattern is None:
            return value
        if isinstance(value, str):
            return self._hide_str(value)
        if isinstance(value, list):
            return [self.hide(v) for v in value]
        if isinstance(value, dict):
            return {self.hide(k): self.hide(v) for k, v in value.items()}
        return value

    def restore(self, text: str, spans: list[tuple[int, int]]) -> tuple[str, list[tuple[int, int]]]:
        """`text` with every stand-in replaced by the special token's text, and the client spans
        in it: `spans` (offsets into `text`, none inside a stand-in) moved to match, with one span
        per restored text, overlapping ones merged, in order."""
        out: list[str] = []
        ends: list[int] = []  # where each stand-in ended in `text`
        deltas: list[int] = []  # the shift of `text`'s offsets after each stand-in
        restored: list[tuple[int, int]] = []
        at = 0
        for m in self._stand_in.finditer(text):
            out.append(text[at : m.start()])
            start = m.start() + (deltas[-1] if deltas else 0)
            special = self._specials[int(m.group(1))]
            out.append(special)
            restored.append((start, start + len(special)))
            at = m.end()
            ends.append(m.end())
            deltas.append(start + len(special) - m.end())
        if not restored:
            return text, spans
        out.append(text[at:])

        def moved(x: int) -> int:
            k = bisect.bisect_right(ends, x) - 1
            return x + (deltas[k] if k >= 0 else 0)

        merged: list[tuple[int, int]] = []
        for a, b in sorted([(moved(a), moved(b)) for a, b in spans] + restored):
            if merged and a < merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        return "".join(out), merged


def boundaries(text: str, pieces: list[Piece], specials: re.Pattern | None) -> list[int]:
    """Segment starts: where each unit (message, text part, tool) first appears, moved back to the
    template text that introduces it (its last added token, else after its last newline); also
    at the unit's own start when an added token ends just before it (nothing merges across one)."""
    starts, seen, prev_end = {0}, set(), 0
    for p in pieces:
        if p.unit is None:
            continue
        if p.unit not in seen:
            seen.add(p.unit)
            gap = text[prev_end : p.start]
            hits = list(specials.finditer(gap)) if specials is not None and gap else []
            if hits:
                starts.add(prev_end + hits[-1].start())
                if hits[-1].end() == len(gap):
                    starts.add(p.start)
            elif "\n" in gap:
                starts.add(prev_end + gap.rfind("\n") + 1)
            else:
                starts.add(p.start)
        prev_end = p.end
    return sorted(s for s in starts if s < len(text))
