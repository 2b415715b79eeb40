"""Grammars too big or too deep for llguidance to compile safely are a RequestError, before any
native code sees them; those within the bounds still compile."""

import json
import subprocess
import sys
import threading

import pytest

from irminsul.engine.grammar import Constraint, Grammars, on_large_stack
from irminsul.engine.grammar_limits import MAX_OPTIONS, MAX_RULES, MAX_SCHEMA_DEPTH, spelled_out
from irminsul.errors import RequestError


def ref_chain(n: int) -> dict:
    """d0 -> d1 -> ... -> dn, each definition only a reference to the next."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    return {"$ref": "#/$defs/d0", "$defs": {**defs, f"d{n}": {"type": "string"}}}


def property_chain(n: int) -> dict:
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    return {"$ref": "#/$defs/d0", "$defs": {**defs, f"d{n}": {"type": "string"}}}


def rule_chain(n: int) -> str:
    return "start: r0\n" + "\n".join(f'r{i}: "a" r{i + 1}' for i in range(n)) + f'\nr{n}: "b"\n'


@pytest.fixture(scope="module")
def grammars():
    from irminsul.bundled import bundled_model
    from irminsul.model.tokenizer import Tokenizer

    tok = Tokenizer(bundled_model("mla"))
    return Grammars(tok.to_json(), tok.vocab_size, {0})


_HOSTILE = """
import sys, threading
from irminsul.bundled import bundled_model
from irminsul.engine.grammar import Constraint, Grammars
from irminsul.errors import RequestError
from irminsul.model.tokenizer import Tokenizer
from tests.engine.test_grammar_limits import ref_chain, rule_chain

tok = Tokenizer(bundled_model("mla"))
grammars = Grammars(tok.to_json(), tok.vocab_size, {0})

def compile_all():  # on a worker thread, as the server compiles
    for make in (lambda: Constraint.json_schema(ref_chain(3000)), lambda: Constraint.lark(rule_chain(3000))):
        try:
            grammars.matcher(make())
            print("compiled")
        except RequestError as e:
            print("refused:", e)

thread = threading.Thread(target=compile_all)
thread.start()
thread.join()
"""


def test_chains_that_would_overflow_the_native_stack_are_refused_in_a_live_process():
    """3,000 chained $refs or Lark rules crash llguidance's compiler (SIGSEGV) on a default stack;
    in a subprocess, so a crash fails this test instead of killing pytest."""
    out = subprocess.run([sys.executable, "-c", _HOSTILE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"the compile died with {out.returncode}: {out.stderr[-2000:]}"
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("refused:") for line in lines), out.stdout
    assert f"more than {MAX_SCHEMA_DEPTH} levels" in lines[0] and "$refs" in lines[0]
    assert "3002 rules" in lines[1] and str(MAX_RULES) in lines[1]


@pytest.mark.parametrize("schema", [ref_chain(MAX_SCHEMA_DEPTH + 1), property_chain(MAX_SCHEMA_DEPTH // 3 + 1)])
def test_a_chain_of_definitions_counts_as_deep_as_it_is_long(schema):
    with pytest.raises(RequestError, match="counting into what its \\$refs point to"):
        Constraint.json_schema(schema)


def test_deep_inline_nesting_is_refused_without_python_recursion():
    schema = {"type": "string"}
    for _ in range(5000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(RequestError, match=f"more than {MAX_SCHEMA_DEPTH} levels"):
        Constraint.json_schema(schema)
    with pytest.raises(RequestError, match=f"more than {MAX_SCHEMA_DEPTH} levels"):
        Constraint("json_schema", "[" * 5000 + "]" * 5000)


def test_schemas_within_the_bounds_compile(grammars):
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}, "required": ["name"]}},
        "$ref": "#/$defs/node"}  # recursive: a cycle, not a chain
    anchored = {"$ref": "#leaf", "$defs": {"x": {"$anchor": "leaf", "type": "integer"}}}
    for schema in (ref_chain(40), property_chain(20), tree, anchored):
        grammars.matcher(Constraint.json_schema(schema))


def test_a_reference_this_server_cannot_follow_bounds_the_whole_schema():
    big = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(MAX_SCHEMA_DEPTH + 1)}}
    with pytest.raises(RequestError, match="is not one this server follows"):
        Constraint.json_schema({**big, "$defs": {"b": {"$id": "b.json", "$ref": "#/$defs/c"}}})
    Constraint.json_schema({"properties": {"a": {"$ref": "other.json"}}})  # small: llguidance says what is wrong


def test_inline_json_in_a_lark_grammar_is_bounded_too():
    with pytest.raises(RequestError, match="\\$refs"):
        Constraint.lark(f"start: %json {json.dumps(ref_chain(3000))}")


def test_choices_are_bounded_in_number_and_bytes():
    Constraint.choice([f"option {i}" for i in range(MAX_OPTIONS)])
    with pytest.raises(RequestError, match=f"at most {MAX_OPTIONS} choices"):
        Constraint.choice([f"option {i}" for i in range(100_000)])
    with pytest.raises(RequestError, match="bytes in all"):
        Constraint.choice(["x" * 40_000, "y" * 40_000])


@pytest.mark.parametrize("pattern", ["a{1000000}", "((a{1000}){1000}){1000}", "(ab|c){99999}", "x{9" + "9" * 5000 + "}"])
def test_regexes_that_spell_out_too_much_text_are_refused(pattern):
    with pytest.raises(RequestError, match="spells out"):
        Constraint.regex(pattern)
    with pytest.raises(RequestError, match="spells out"):
        Constraint.lark(f"start: /{pattern}/")


def test_spelled_out_counts_repetitions_not_loops():
    assert spelled_out("[A-Z]{2}[0-9]{3,4}") == 6
    assert spelled_out("(ab){3}c*") == 7
    assert spelled_out("a+|b{10}") == 11
    assert spelled_out(r"\{1000000\}[{]{2}") == 11  # escaped braces and a class are characters
    assert spelled_out('start: "a{1000}" x{3}', strings=True) < 50  # a literal's braces are text


def test_on_large_stack_returns_and_raises_on_the_callers_behalf():
    assert on_large_stack(lambda: threading.current_thread().name) == "grammar-compile"
    with pytest.raises(RequestError, match="boom"):
        on_large_stack(lambda: (_ for _ in ()).throw(RequestError("boom")))


def test_bounds_reach_patterns_regex_literals_and_not_inline_schemas():
    """A schema's `pattern` and `patternProperties` are regular expressions and are bounded as
    such; a quote inside a Lark /regex/ does not hide its repetitions; a large %json schema in a
    grammar (a forced call to a tool with a big schema) is checked as a schema, not as one line;
    boolean schemas are valid."""
    nested = "((a{1000}){1000}){1000}"
    with pytest.raises(RequestError, match="spells out"):
        Constraint.json_schema({"type": "string", "pattern": nested})
    with pytest.raises(RequestError, match="spells out"):
        Constraint.json_schema({"type": "object", "patternProperties": {nested: {"type": "string"}}})
    with pytest.raises(RequestError, match="spells out"):
        Constraint.lark(f'start: /"{nested}"/')
    big = {"type": "object", "properties": {"kind": {"enum": [f"option number {i:06d}" for i in range(6000)]}}}
    Constraint.lark(f"start: %json {json.dumps(big)}")  # 140 kB on one line, and fine
    Constraint.json_schema(True)
    Constraint.json_schema(False)
