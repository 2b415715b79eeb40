"""Structured output: a grammar decides which tokens may come next (constrained decoding).

A request's `Constraint` (a JSON schema, a regular expression, a list of choices or a Lark grammar)
becomes one llguidance matcher per sequence. Each step, the engine asks every constrained sequence's
matcher for its allowed-token bitmask (all of them in one call, in parallel, in Rust), unpacks the
masks into one boolean [batch, vocab] tensor and sets the other logits to -inf before the batched
greedy / sampled choice; the chosen token is then fed back to the matcher. When the grammar is
complete the sequence stops, without waiting for the model to choose an end token.

Why llguidance (not xgrammar): it has no dependencies (xgrammar pulls torch, transformers and a
C++ toolchain at run time), it compiles grammars lazily, so a new per-request JSON schema costs
microseconds instead of a compile step before the first token, and it takes JSON schema, regex and
Lark (with inline JSON schemas, which tool calls need) through one interface. vLLM and SGLang ship
it as one of their two backends.
"""

from __future__ import annotations

import json
import re
import threading
import urllib.parse
from dataclasses import dataclass

import torch

from irminsul.errors import RequestError

# JSON is generated as json.dumps writes it: ", " and ": " between items, no other whitespace.
# (Flexible whitespace lets a small model loop on newlines inside an object until max_tokens.)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_SHIFTS = torch.arange(32, dtype=torch.int32)

# Bounds on what reaches llguidance (1.9.1). Its compiler recurses once per link of a chain of
# $refs or Lark rules and, past its stack, kills the whole process (SIGSEGV, not an error). The
# last chain lengths that compiled on an 8 MB thread stack (Linux's default, main or worker
# thread): 2,468 `{"$ref": next}` links, 919 objects whose property refers to the next, 2,656 Lark
# rules `r: "a" next`; the stack use is linear, so a 64 MB stack takes 8x that (measured). Grammars
# are compiled on a thread with that stack, and these bounds keep even the worst case (a JSON
# level costs ~1 KB, a rule ~3 KB) 20x below the 8 MB crash.
MAX_SCHEMA_DEPTH = 128  # levels of JSON objects and arrays, counting into what each $ref points to
MAX_SCHEMA_NODES = 8192  # JSON objects and arrays in one schema (5,000 properties compile in ~3 s)
MAX_RULES = 1024  # rule and terminal definitions in one Lark or GBNF grammar (a tool-call grammar has tools + 2)
# Choices compile in time quadratic in their number (1,024: 20 ms, 16,384: 0.9 s, 100,000: minutes).
MAX_OPTIONS, MAX_OPTION_BYTES = 1024, 65536
# The text a regular expression spells out, each bounded repetition {n} counted n times:
# `((a{1000}){1000}){1000}` holds a thread for 3-6 s before llguidance gives up; a{100000}: 0.3 s.
MAX_REGEX_SIZE = 100_000
_COMPILE_STACK = 64 << 20


@dataclass(frozen=True)
class Constraint:
    """What the output must match. `kind`: json_schema | regex | choice | lark; `spec` its text
    (the schema as JSON text, the pattern, the choices as a JSON list, the grammar)."""

    kind: str
    spec: str

    KINDS = ("json_schema", "regex", "choice", "lark")

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise RequestError(f"constraint kind {self.kind!r} must be one of {', '.join(self.KINDS)}")
        if not isinstance(self.spec, str):
            raise RequestError(f"a {self.kind} constraint is given as text")
        if self.kind == "json_schema":
            check_schema(parse_json(self.spec, "the schema"))
        elif self.kind == "choice":
            _check_options(parse_json(self.spec, "the choices"))
        elif self.kind == "regex":
            _check_regex(self.spec, "the regex")
        else:
            _check_lark(self.spec)

    @classmethod
    def json_schema(cls, schema: dict | bool | None = None) -> Constraint:
        """Output valid against `schema` (generated `closed`); None: any JSON object (OpenAI's json_object)."""
        if schema is None:
            schema = {"type": "object"}
        if not isinstance(schema, (dict, bool)):
            raise RequestError("a JSON schema must be an object")
        check_schema(schema)  # (before closed(), which recurses as deep as the schema nests)
        return cls("json_schema", json.dumps(closed(schema)))

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: list[str]) -> Constraint:
        if not options or not all(isinstance(o, str) for o in options):
            raise RequestError("choices must be a non-empty list of strings")
        _check_options(options)
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def lark(cls, grammar: str) -> Constraint:
        """A Lark grammar (llguidance's dialect, with `%json {...}` for inline schemas) or a GBNF one."""
        return cls("lark", grammar)

    def grammar(self) -> str:
        """llguidance's grammar text for this constraint."""
        import llguidance

        try:
            if self.kind == "json_schema":
                return llguidance.LLMatcher.grammar_from_json_schema(self.spec, defaults=JSON_LAYOUT)
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.spec)
            if self.kind == "choice":
                return llguidance.grammar_from("choice", self.spec)
            return llguidance.grammar_from("grammar", self.spec)  # Lark, or GBNF converted to Lark
        except (ValueError, RuntimeError, TypeError) as e:
            raise RequestError(f"the {self.kind.replace('_', ' ')} could not be compiled: {e}") from None


def parse_json(spec: str, what: str):
    """JSON text a client sent, or a RequestError that says what was wrong with it."""
    try:
        return json.loads(spec)
    except json.JSONDecodeError as e:
        raise RequestError(f"{what} is not valid JSON ({e})") from None
    except RecursionError:
        raise RequestError(f"{what} nests more than {MAX_SCHEMA_DEPTH} levels deep") from None


def check_schema(schema) -> None:
    """Refuse a JSON schema too big or too deep for llguidance to compile safely (MAX_SCHEMA_*):
    depth counts into what each $ref points to, so a chain of definitions is as deep as it is long.
    Iterative: a schema deep enough to matter would overflow Python's stack as well."""
    if isinstance(schema, bool):  # true: anything; false: nothing (llguidance says so)
        return
    nodes, anchors, todo = [], {}, [(schema, 1)]
    embedded = False  # a nested $id makes its own refs resolve against it: not followed here
    while todo:
        node, depth = todo.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise RequestError(f"the schema nests more than {MAX_SCHEMA_DEPTH} levels of objects and arrays")
        nodes.append(node)
        if len(nodes) > MAX_SCHEMA_NODES:
            raise RequestError(f"the schema has more than {MAX_SCHEMA_NODES} objects and arrays; this server "
                               f"compiles at most that many")
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                _check_regex(node["pattern"], "a pattern in the schema")
            if isinstance(node.get("patternProperties"), dict):
                for pattern in node["patternProperties"]:
                    _check_regex(pattern, "a patternProperties pattern in the schema")
            if isinstance(node.get("$anchor"), str):
                anchors[node["$anchor"]] = node
            embedded |= node is not schema and isinstance(node.get("$id"), str)
            values = node.values()
        else:
            values = node
        todo.extend((v, depth + 1) for v in values if isinstance(v, (dict, list)))
    refs = [n["$ref"] for n in nodes if isinstance(n, dict) and isinstance(n.get("$ref"), str)]
    if not refs:
        return  # (the walk above measured the depth)
    targets = {}
    for ref in refs:
        target = _UNRESOLVED if embedded else _pointed_to(ref, schema, anchors)
        if target is _UNRESOLVED:
            if len(nodes) > MAX_SCHEMA_DEPTH:  # it may point anywhere: each node may be one more level
                raise RequestError(f"$ref {ref[:80]!r} is not one this server follows ('#', '#/json/pointer' or "
                                   f"'#anchor', in a schema without nested $id), and a schema with such a "
                                   f"reference may have at most {MAX_SCHEMA_DEPTH} objects and arrays "
                                   f"(this one has {len(nodes)})")
        else:
            targets[ref] = target
    if _deepest(schema, targets) > MAX_SCHEMA_DEPTH:
        raise RequestError(f"the schema nests more than {MAX_SCHEMA_DEPTH} levels of objects and arrays, "
                           f"counting into what its $refs point to (a chain of definitions each referring to "
                           f"the next is as deep as it is long)")


_UNRESOLVED = object()


def _pointed_to(ref: str, root, anchors: dict):
    """What a reference inside the schema points to; _UNRESOLVED for one to elsewhere."""
    if not ref.startswith("#"):
        return _UNRESOLVED
    fragment = urllib.parse.unquote(ref[1:])
    if not fragment.startswith("/"):
        return root if not fragment else anchors.get(fragment, _UNRESOLVED)
    node = root
    for part in fragment[1:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _UNRESOLVED
    return node


def _deepest(root, targets: dict) -> int:
    """The depth of the schema's objects and arrays, entering each $ref's target where it stands
    (a target already being entered is a recursive schema: llguidance refers back to it lazily)."""

    def children(node):
        values = node.values() if isinstance(node, dict) else node
        out = [v for v in values if isinstance(v, (dict, list))]
        if isinstance(node, dict) and isinstance(targets.get(node.get("$ref")), (dict, list)):
            out.append(targets[node["$ref"]])
        return iter(out)

    depth: dict[int, int] = {}
    entered = {id(root)}
    stack = [[root, children(root), 0]]  # [node, its children still to visit, its deepest child so far]
    while stack:
        frame = stack[-1]
        for child in frame[1]:
            if id(child) in depth:
                frame[2] = max(frame[2], depth[id(child)])
            elif id(child) not in entered:
                if len(stack) >= MAX_SCHEMA_DEPTH:
                    return len(stack) + 1
                entered.add(id(child))
                stack.append([child, children(child), 0])
                break
        else:
            stack.pop()
            depth[id(frame[0])] = frame[2] + 1
            if stack:
                stack[-1][2] = max(stack[-1][2], frame[2] + 1)
    return depth[id(root)]


def _check_options(options) -> None:
    if not isinstance(options, list) or not options or not all(isinstance(o, str) for o in options):
        raise RequestError("choices must be a non-empty list of strings")
    size = sum(len(o.encode("utf-8", "surrogatepass")) for o in options)
    if len(options) > MAX_OPTIONS or size > MAX_OPTION_BYTES:
        raise RequestError(f"{len(options)} choices of {size} bytes in all: this server takes at most "
                           f"{MAX_OPTIONS} choices of at most {MAX_OPTION_BYTES} bytes in all")


_REPEAT = re.compile(r"\{(\d*)(?:,(\d*))?\}")
_LARK_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"')


def spelled_out(pattern: str, strings: bool = False) -> int:
    """How long the text `pattern` (a regular expression, or a Lark line with `strings`: its "..."
    literals) spells out, each bounded repetition {n,m} counted m times, nested ones multiplied;
    `*`, `+` and `?` count once (they compile to a loop, not to copies)."""
    frames = [[0, 0]]  # per open group: [size so far, size of its last item]
    i = 0
    while i < len(pattern):
        c, item = pattern[i], 1
        if c == "\\":
            i += 2
        elif c == "[":  # a class is one character (its `]` may come first, as in []] or [^]])
            j = i + 1 + (pattern[i + 1: i + 2] == "^")
            j += pattern[j: j + 1] == "]"
            while j < len(pattern) and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i = j + 1
        elif c == '"' and strings and (m := _LARK_STRING.match(pattern, i)):
            item, i = max(1, m.end() - i - 2), m.end()
        elif c == "(":
            frames.append([0, 0])
            i += 1
            continue
        elif c == ")" and len(frames) > 1:
            item, i = frames.pop()[0], i + 1
        elif c == "|":
            frames[-1][1] = 0
            i += 1
            continue
        elif c == "{" and (m := _REPEAT.match(pattern, i)) and (m.group(1) or m.group(2)):
            # (a count of more than 9 digits is over every bound; int() of thousands of digits raises)
            n = max(int(g) if len(g) <= 9 else 10 ** 9 for g in m.groups("") if g)
            frames[-1][0] += frames[-1][1] * (n - 1)
            frames[-1][1] *= n
            i = m.end()
            continue
        elif c in "*+?":
            i += 1
            continue
        else:
            i += 1
        frames[-1][0] += item
        frames[-1][1] = item
    while len(frames) > 1:  # an unclosed group (llguidance refuses the pattern itself)
        frames[-2][0] += frames.pop()[0]
    return frames[0][0]


def _check_regex(pattern: str, what: str, strings: bool = False) -> None:
    if (size := spelled_out(pattern, strings)) > MAX_REGEX_SIZE:
        raise RequestError(f"{what} spells out {size} characters, counting each bounded repetition {{n}} n "
                           f"times; this server takes at most {MAX_REGEX_SIZE} (use * or + for long runs)")


_DEFINITION = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w-]*(?:\.-?\d+)?[ \t]*(?::(?!:)|::=)", re.M)
_INLINE_JSON = re.compile(r"%json\s*")


def _check_lark(grammar: str) -> None:
    """A Lark (or GBNF) grammar's rule count, its inline %json schemas and its repetitions."""
    if (rules := len(_DEFINITION.findall(grammar))) > MAX_RULES:
        raise RequestError(f"the grammar defines {rules} rules and terminals; this server compiles at most "
                           f"{MAX_RULES}")
    decoder = json.JSONDecoder()
    rest, at = [], 0  # the grammar without its %json schemas (checked as schemas, not as lines)
    for m in _INLINE_JSON.finditer(grammar):
        if m.start() < at:
            continue
        try:
            schema, end = decoder.raw_decode(grammar, m.end())
        except json.JSONDecodeError:
            continue  # not a schema: llguidance says what is wrong with it
        except RecursionError:
            raise RequestError(f"a %json schema in the grammar nests more than {MAX_SCHEMA_DEPTH} levels deep") from None
        check_schema(schema)
        rest.append(grammar[at : m.end()])
        at = end
    rest.append(grammar[at:])
    for n, line in enumerate("".join(rest).splitlines(), 1):
        # counted both with "..." as literals and as plain text: a quote inside a /regex/ is no literal
        _check_regex(line, f"line {n} of the grammar", strings=True)
        _check_regex(line, f"line {n} of the grammar")


def reason(matcher) -> str:
    """A failed matcher's error for people: its first line (llguidance adds its parser state)."""
    return matcher.get_error().split("\n", 1)[0].strip()


def closed(schema):
    """The schema with every object that lists its properties, and says nothing of others, closed
    to them (additionalProperties: false), as OpenAI's strict mode requires. What it generates
    still validates against the original; left open, a small model adds keys until max_tokens."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k in _SUBSCHEMAS else v for k, v in schema.items()}
    for k in _SCHEMA_MAPS:
        if isinstance(schema.get(k), dict):
            out[k] = {name: closed(s) for name, s in schema[k].items()}
    if "properties" in schema and "additionalProperties" not in schema and "patternProperties" not in schema:
        out["additionalProperties"] = False
    return out


_SUBSCHEMAS = ("items", "prefixItems", "anyOf", "oneOf", "allOf", "not", "additionalProperties", "contains")
_SCHEMA_MAPS = ("properties", "$defs", "definitions")


def on_large_stack(fn):
    """fn() on a thread of its own with a _COMPILE_STACK stack: llguidance's compiler recurses as
    deep as a grammar's chains go, and the calling thread's stack may be small (glibc's default is
    8 MB; other platforms give a thread 512 KB to 1 MB)."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # re-raised on the caller's thread
            out["error"] = e

    with _STACK_SIZE_LOCK:  # (the size applies to every thread started while it is set)
        previous = threading.stack_size(_COMPILE_STACK)
        try:
            thread = threading.Thread(target=run, name="grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


_STACK_SIZE_LOCK = threading.Lock()


class Grammars:
    """The tokenizer view llguidance needs (built once per engine) and the batched mask."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids):
        import llguidance

        self.vocab_size = vocab_size
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_ids))
        self._executor = llguidance.LLExecutor()

    def matcher(self, constraint: Constraint):
        """A fresh matcher for one sequence; a grammar that does not compile is the request's error.
        (Compiling may take up to a second for a huge grammar: call it off the engine thread.)"""
        import llguidance

        what = constraint.kind.replace("_", " ")

        def compile():
            matcher = llguidance.LLMatcher(self._tokenizer, constraint.grammar(), log_level=0)
            if matcher.is_error():
                raise RequestError(f"the {what} could not be compiled: {reason(matcher)}")
            matcher.compute_bitmask()  # the first step's mask: a grammar no output can match fails here
            if matcher.is_error():
                raise RequestError(f"the {what} matches no output at all (it cannot be satisfied: a reference "
                                   f"to itself with no way to end, a character class of nothing, ...): "
                                   f"{reason(matcher)}")
            return matcher

        return on_large_stack(compile)

    def allowed(self, matchers: list) -> torch.Tensor:
        """bool [len(matchers), vocab]: the tokens each matcher accepts next."""
        words = (self.vocab_size + 31) // 32
        bits = torch.full((len(matchers), words), -1, dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bits.data_ptr(),
                                               words * 4, len(matchers))
        return ((bits.unsqueeze(-1) >> _SHIFTS) & 1).view(len(matchers), -1)[:, : self.vocab_size].bool()
