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

import collections
import concurrent.futures
import json
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from irminsul.engine.grammar_limits import check_lark, check_options, check_regex, check_schema, parse_json
from irminsul.errors import RequestError

if TYPE_CHECKING:
    from llguidance import LLMatcher
    from llguidance._lib import JsonCompileOptions

# JSON is generated as json.dumps writes it: ", " and ": " between items, no other whitespace.
# (Flexible whitespace lets a small model loop on newlines inside an object until max_tokens.)
JSON_LAYOUT: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_SHIFTS = torch.arange(32, dtype=torch.int32)

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
            check_options(parse_json(self.spec, "the choices"))
        elif self.kind == "regex":
            check_regex(self.spec, "the regex")
        else:
            check_lark(self.spec)

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
        check_options(options)
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


def reason(matcher: LLMatcher) -> str:
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
    """The tokenizer view llguidance needs (built once per engine), the compiled constraints and
    the batched mask.

    A constraint is compiled once while it is among the last KEEP_COMPILED asked for in its scope:
    the n choices of a request, and the requests of an agent that sends the same tools each turn,
    each get a copy of one compiled matcher (a fresh state: llguidance's deep_copy shares the
    grammar). NOTE: the scope is the tenant: a compile another tenant's request saved would tell,
    by the time it took, what that tenant sent."""

    KEEP_COMPILED = 16

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids):
        import llguidance

        self.vocab_size = vocab_size
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_ids))
        self._executor = llguidance.LLExecutor()
        self._compiled: collections.OrderedDict[tuple, concurrent.futures.Future[LLMatcher]] = collections.OrderedDict()
        self._lock = threading.Lock()  # (matchers are made on the server's worker threads)

    def matcher(self, constraint: Constraint, scope: str | None = None) -> LLMatcher:
        """A fresh matcher for one sequence; a grammar that does not compile is the request's error.
        (Compiling may take up to a second for a huge grammar: call it off the engine thread. A
        thread that asks for a constraint another is compiling in the same `scope` waits for that one.)"""
        key = (scope, constraint)
        with self._lock:
            kept = self._compiled.pop(key, None)
            mine = kept is None
            compiled: concurrent.futures.Future[LLMatcher] = concurrent.futures.Future() if kept is None else kept
            self._compiled[key] = compiled  # (the most recently asked for last)
            while len(self._compiled) > self.KEEP_COMPILED:
                self._compiled.popitem(last=False)
        if mine:
            try:
                compiled.set_result(on_large_stack(lambda: self._compile(constraint)))
            except BaseException as e:  # not kept: the next request compiles again, as before
                with self._lock:
                    if self._compiled.get(key) is compiled:
                        del self._compiled[key]
                compiled.set_exception(e)
        return compiled.result().deep_copy()

    def _compile(self, constraint: Constraint) -> LLMatcher:
        import llguidance

        what = constraint.kind.replace("_", " ")
        matcher = llguidance.LLMatcher(self._tokenizer, constraint.grammar(), log_level=0)
        if matcher.is_error():
            raise RequestError(f"the {what} could not be compiled: {reason(matcher)}")
        matcher.compute_bitmask()  # the first step's mask: a grammar no output can match fails here
        if matcher.is_error():
            raise RequestError(
                f"the {what} matches no output at all (it cannot be satisfied: a reference "
                f"to itself with no way to end, a character class of nothing, ...): "
                f"{reason(matcher)}"
            )
        return matcher

    def allowed(self, matchers: list[LLMatcher]) -> torch.Tensor:
        """bool [len(matchers), vocab]: the tokens each matcher accepts next."""
        words = (self.vocab_size + 31) // 32
        bits = torch.full((len(matchers), words), -1, dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], bits.data_ptr(), words * 4, len(matchers)
        )
        return ((bits.unsqueeze(-1) >> _SHIFTS) & 1).view(len(matchers), -1)[:, : self.vocab_size].bool()
