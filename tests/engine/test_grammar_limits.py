"""Grammars too big or too deep for llguidance to compile safely are a RequestError, before any
native code sees them; those within the bounds still compile."""

import json
import subprocess
import sys
import threading

import pytest

from irminsul.engine.grammar import Constraint, Grammars, on_large_stack
from irminsul.engine.grammar_limits import (
    MAX_GRAMMAR_SIZE,
    MAX_OPTIONS,
    MAX_RULES,
    MAX_SCHEMA_DEPTH,
    grammar_size,
    spelled_out,
)
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
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 8},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
                "required": ["name"],
            }
        },
        "$ref": "#/$defs/node",
    }  # recursive: a cycle, not a chain
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


@pytest.mark.parametrize(
    "pattern", ["a{1000000}", "((a{1000}){1000}){1000}", "(ab|c){99999}", "x{9" + "9" * 5000 + "}"]
)
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


def alternatives_one_per_line(n: int) -> str:
    return 'start: "opt0"\n' + "".join(f'    | "opt{i}"\n' for i in range(1, n))


@pytest.mark.parametrize(
    "grammar",
    [
        alternatives_one_per_line(100_000),
        # across rules, each within MAX_RULES and each line short
        "start: "
        + " | ".join(f"r{i}" for i in range(100))
        + "\n"
        + "".join(f"r{i}: " + "".join(f'\n  | "w{i}_{j}"' for j in range(400)) + "\n" for i in range(100)),
        # GBNF, with a quote in a class that would hide what follows from a parser of literals
        "root ::= a\n" + '  | [^"] a a a a a a a a a\n' * 5000 + 'a ::= "x"\n',
    ],
)
def test_alternatives_count_toward_the_grammar_size_however_they_are_laid_out(grammar):
    """A grammar's symbols and alternatives are bounded in all, not per line or per rule: refused
    when the Constraint is built, before llguidance compiles anything."""
    assert grammar_size(grammar) > MAX_GRAMMAR_SIZE
    with pytest.raises(RequestError, match=f"more than {MAX_GRAMMAR_SIZE} symbols and alternatives"):
        Constraint.lark(grammar)


def test_grammars_within_the_size_compile_and_inline_schemas_do_not_count(grammars):
    just_within = alternatives_one_per_line(MAX_GRAMMAR_SIZE // 4)  # | "optN": a bar, two quotes, a word
    assert grammar_size(just_within) <= MAX_GRAMMAR_SIZE
    grammars.matcher(Constraint.lark(just_within))
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(MAX_GRAMMAR_SIZE // 4)}}
    assert grammar_size(json.dumps(big)) > MAX_GRAMMAR_SIZE
    Constraint.lark(f"start: %json {json.dumps(big)}")  # (a schema is bounded as a schema)
    tools = "\n".join(f'call_{i}: "<call>" %json {{"type": "object"}} "</call>"' for i in range(MAX_RULES - 2))
    Constraint.lark("start: call+\ncall: " + " | ".join(f"call_{i}" for i in range(MAX_RULES - 2)) + "\n" + tools)
    with pytest.raises(RequestError, match="symbols and alternatives"):
        Constraint.lark("start: " + " | ".join(["%json {}"] * MAX_GRAMMAR_SIZE))


def test_a_constraint_is_compiled_once_for_all_its_matchers(grammars, monkeypatch):
    """n choices of a request (or requests with the same constraint) share one compiled grammar;
    each matcher is a state of its own. A constraint that fails to compile is not kept."""
    compiled = []
    grammar = Constraint.grammar
    monkeypatch.setattr(Constraint, "grammar", lambda self: compiled.append(self) or grammar(self))
    c = Constraint.choice(["yes", "no"])
    matchers = [grammars.matcher(c) for _ in range(4)]
    threads = [threading.Thread(target=lambda: matchers.append(grammars.matcher(c))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(compiled) == 1 and len(matchers) == 8
    first, other = matchers[0], matchers[1]
    yes = grammars.allowed([first])[0].nonzero().flatten().tolist()
    assert first.consume_token(yes[0]) and not first.is_error()
    assert grammars.allowed([other])[0].nonzero().flatten().tolist() == yes  # untouched by the other's token
    bad = Constraint.lark("start: undefined_rule")
    for _ in range(2):
        with pytest.raises(RequestError, match="could not be compiled"):
            grammars.matcher(bad)
    assert len(compiled) == 3


def test_tenants_never_share_a_compiled_constraint(grammars, monkeypatch):
    """A compile one tenant's request saved would tell another, by how long its own took, that the
    same schema had been sent: the compiled constraints are kept per tenant."""
    compiled = []
    grammar = Constraint.grammar
    monkeypatch.setattr(Constraint, "grammar", lambda self: compiled.append(self) or grammar(self))
    c = Constraint.choice(["left", "right"])
    for tenant in ("key:a", "key:a", "key:b", "key:a|salt:x", None, None):
        grammars.matcher(c, tenant)
    assert len(compiled) == 4  # a, b, a's salt, the default tenant: once each
