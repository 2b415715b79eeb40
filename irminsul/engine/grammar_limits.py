"""What a constraint may be: bounds checked before llguidance compiles it.

llguidance's native compiler recurses once per level of a schema or grammar, and past its
thread's stack it kills the whole process (SIGSEGV, not an error), so every `Constraint` is
checked here when it is built: a schema's depth (followed through its `$ref`s) and size, a
grammar's rule count and inline schemas, the choices, and how much text a regular expression
spells out. What exceeds a bound is a RequestError that names it.
"""

from __future__ import annotations

import json
import re
import urllib.parse

from irminsul.errors import RequestError

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
# The symbols and alternatives of one Lark or GBNF grammar, as `grammar_size` counts them: its
# compile time grows faster than linearly with them, however they are laid out (alternatives one
# per line escape both MAX_RULES and the per-line MAX_REGEX_SIZE).
MAX_GRAMMAR_SIZE = 16384
# Choices compile in time quadratic in their number (16 times as many take hundreds of times as long).
MAX_OPTIONS, MAX_OPTION_BYTES = 1024, 65536
# The text a regular expression spells out, each bounded repetition {n} counted n times:
# `((a{1000}){1000}){1000}` holds a thread for 3-6 s before llguidance gives up; a{100000}: 0.3 s.
MAX_REGEX_SIZE = 100_000


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
            raise RequestError(
                f"the schema has more than {MAX_SCHEMA_NODES} objects and arrays; this server "
                f"compiles at most that many"
            )
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                check_regex(node["pattern"], "a pattern in the schema")
            if isinstance(node.get("patternProperties"), dict):
                for pattern in node["patternProperties"]:
                    check_regex(pattern, "a patternProperties pattern in the schema")
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
                raise RequestError(
                    f"$ref {ref[:80]!r} is not one this server follows ('#', '#/json/pointer' or "
                    f"'#anchor', in a schema without nested $id), and a schema with such a "
                    f"reference may have at most {MAX_SCHEMA_DEPTH} objects and arrays "
                    f"(this one has {len(nodes)})"
                )
        else:
            targets[ref] = target
    if _deepest(schema, targets) > MAX_SCHEMA_DEPTH:
        raise RequestError(
            f"the schema nests more than {MAX_SCHEMA_DEPTH} levels of objects and arrays, "
            f"counting into what its $refs point to (a chain of definitions each referring to "
            f"the next is as deep as it is long)"
        )


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


def check_options(options) -> None:
    if not isinstance(options, list) or not options or not all(isinstance(o, str) for o in options):
        raise RequestError("choices must be a non-empty list of strings")
    size = sum(len(o.encode("utf-8", "surrogatepass")) for o in options)
    if len(options) > MAX_OPTIONS or size > MAX_OPTION_BYTES:
        raise RequestError(
            f"{len(options)} choices of {size} bytes in all: this server takes at most "
            f"{MAX_OPTIONS} choices of at most {MAX_OPTION_BYTES} bytes in all"
        )


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
            j = i + 1 + (pattern[i + 1 : i + 2] == "^")
            j += pattern[j : j + 1] == "]"
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
            n = max(int(g) if len(g) <= 9 else 10**9 for g in m.groups("") if g)
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


def check_regex(pattern: str, what: str, strings: bool = False) -> None:
    if (size := spelled_out(pattern, strings)) > MAX_REGEX_SIZE:
        raise RequestError(
            f"{what} spells out {size} characters, counting each bounded repetition {{n}} n "
            f"times; this server takes at most {MAX_REGEX_SIZE} (use * or + for long runs)"
        )


# What a rule's symbols are spelled with: a name, a "literal", a /regex/, a GBNF [class] or `.`,
# and `|` between alternatives. Counted as characters, not parsed, so no quote or bracket can hide
# what follows it: an overcount (a literal counts its two quotes and its words).
_WORD = re.compile(r"[^\W\d][\w-]*")


def grammar_size(grammar: str) -> int:
    """An upper bound on the symbols and alternatives of a Lark or GBNF grammar's text, counted at
    C speed (the grammar may be megabytes): its names and words, and its characters `"/[.|`."""
    return len(_WORD.findall(grammar)) + sum(map(grammar.count, '"/[.|'))


_DEFINITION = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w-]*(?:\.-?\d+)?[ \t]*(?::(?!:)|::=)", re.M)
_INLINE_JSON = re.compile(r"%json\s*")


def check_lark(grammar: str) -> None:
    """A Lark (or GBNF) grammar's rule count, its size, its inline %json schemas and its repetitions."""
    if (rules := len(_DEFINITION.findall(grammar))) > MAX_RULES:
        raise RequestError(f"the grammar defines {rules} rules and terminals; this server compiles at most {MAX_RULES}")
    decoder = json.JSONDecoder()
    rest, at, size = [], 0, 0  # the grammar without its %json schemas (checked as schemas, not as lines)

    def keep(text: str) -> None:  # (the size checked as it grows: a grammar may hold thousands of %json)
        nonlocal size
        rest.append(text)
        if (size := size + grammar_size(text)) > MAX_GRAMMAR_SIZE:
            raise RequestError(
                f"the grammar has more than {MAX_GRAMMAR_SIZE} symbols and alternatives (names, "
                f"literals, regexes, classes and |s, counted outside its %json schemas); this "
                f"server compiles at most that many"
            )

    for m in _INLINE_JSON.finditer(grammar):
        if m.start() < at:
            continue
        try:
            schema, end = decoder.raw_decode(grammar, m.end())
        except json.JSONDecodeError:
            continue  # not a schema: llguidance says what is wrong with it
        except RecursionError:
            raise RequestError(
                f"a %json schema in the grammar nests more than {MAX_SCHEMA_DEPTH} levels deep"
            ) from None
        keep(grammar[at : m.end()])  # (each %json counts: its name is a word)
        check_schema(schema)
        at = end
    keep(grammar[at:])
    for n, line in enumerate("".join(rest).splitlines(), 1):
        if len(line) <= MAX_REGEX_SIZE and "{" not in line:
            continue  # (no repetition: it spells out at most its own length)
        # counted both with "..." as literals and as plain text: a quote inside a /regex/ is no literal
        check_regex(line, f"line {n} of the grammar", strings=True)
        check_regex(line, f"line {n} of the grammar")
