"""The tool-call parser: each syntax, fed whole or in random pieces, gives the same content and calls."""

import json
import random

import pytest

from irminsul.server.tools import (
    DEEPSEEK,
    HERMES,
    IRMINSUL,
    CallArguments,
    CallStart,
    Content,
    ToolCallParser,
    parse_all,
)

CASES = [
    (
        IRMINSUL,
        'Sure.{"name": "get_weather", "arguments": {"city": "Paris \\"x\\" }", "n": [1, {"a": 2}]}}'
        '{"name": "f2", "arguments": "{\\"a\\": 1}"}',
        "Sure.",
        [("get_weather", '{"city": "Paris \\"x\\" }", "n": [1, {"a": 2}]}'), ("f2", '{"a": 1}')],
    ),
    (IRMINSUL, 'The answer is {"value": 3}', 'The answer is {"value": 3}', []),
    (IRMINSUL, '{"name": "get_time", "arguments": {}}', '{"name": "get_time", "arguments": {}}', []),  # undeclared
    (HERMES, '<tool_call>\n{"name": "f2", "arguments": {}}\n</tool_call>', None, [("f2", "{}")]),
    (HERMES, "no calls < tool_call> <tool_ and text", "no calls < tool_call> <tool_ and text", []),
    (HERMES, '<tool_call>{"arguments": {"x": 1}, "name": "f2"}</tool_call> after', "after", [("f2", '{"x": 1}')]),
    (HERMES, "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    (
        DEEPSEEK,
        "ok<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>f2\n```json\n'
        "{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "ok",
        [("get_weather", '{"city": "Paris"}'), ("f2", "{}")],
    ),
    (
        DEEPSEEK,
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'  # V3.1
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        None,
        [("get_weather", '{"city": "Paris"}')],
    ),
    (IRMINSUL, '{"name": "f2", "arguments": {"a": "cut off', None, [("f2", '{"a": "cut off')]),
]
NAMES = frozenset({"get_weather", "f2"})


def _feed(fmt, text, pieces):
    parser = ToolCallParser(fmt, NAMES)
    events, i = [], 0
    for n in pieces:
        events += parser.feed(text[i : i + n])
        i += n
    events += parser.feed(text[i:]) + parser.finish()
    return events, [(c.name, c.arguments) for c in parser.calls]


@pytest.mark.parametrize("fmt, text, content, calls", CASES, ids=[f"{c[0].name}-{i}" for i, c in enumerate(CASES)])
def test_whole_and_streamed_parses_agree(fmt, text, content, calls):
    got_content, got_calls = parse_all(fmt, text, NAMES)
    assert got_content == content and [(c.name, c.arguments) for c in got_calls] == calls
    rng = random.Random(0)
    for _ in range(100):
        pieces = [rng.randint(1, 6) for _ in range(len(text))]
        events, streamed_calls = _feed(fmt, text, pieces)
        assert streamed_calls == calls
        assert (
            "".join(e.text for e in events if isinstance(e, Content)) or None
            if calls
            else "".join(e.text for e in events if isinstance(e, Content))
        ) == content
        # a call's name comes before its arguments, which arrive in order
        for i, (name, args) in enumerate(calls):
            mine = [e for e in events if not isinstance(e, Content) and e.index == i]
            assert mine[0] == CallStart(i, name) and all(isinstance(e, CallArguments) for e in mine[1:])
            assert "".join(e.text for e in mine[1:]) == args


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
}
FUNCTIONS = [{"name": "get_weather", "parameters": WEATHER}, {"name": "f2", "parameters": {"type": "object"}}]


def _tokenizer(name):
    import tempfile
    from pathlib import Path

    from irminsul.model.tokenizer import Tokenizer
    from irminsul.research.workloads.tokenizers import load_tokenizer

    d = Path(tempfile.mkdtemp())
    (d / "tokenizer.json").write_text(load_tokenizer(name).tokenizer.to_str())
    return Tokenizer(d)


@pytest.mark.parametrize("fmt, tokenizer", [(HERMES, "qwen2"), (DEEPSEEK, "deepseek"), (IRMINSUL, "qwen2")])
def test_tool_grammar_takes_the_formats_own_calls_and_nothing_else(fmt, tokenizer):
    from irminsul.engine.grammar import Constraint, Grammars
    from irminsul.server.tools import tool_constraint

    tok = _tokenizer(tokenizer)
    grammars = Grammars(tok.to_json(), tok.vocab_size, {0})

    def call(name, args):
        if fmt is DEEPSEEK:
            return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"
        return f'{fmt.wrap[0]}{{"name": "{name}", "arguments": {args}}}{fmt.wrap[1]}'

    def wrap(calls):
        text = fmt.sep.join(calls)
        return f"{fmt.drop[0]}{text}{fmt.drop[1]}" if fmt.drop else text

    def accepts(choice, text, parallel=True, response_format=None):
        m = grammars.matcher(
            tool_constraint(fmt, FUNCTIONS, choice, tok.added_token_id, parallel=parallel, text=response_format)
        )
        ok = all(m.consume_token(t) for t in tok.encode(text, add_bos=False))
        return ok and m.is_accepting()

    good = call("get_weather", '{"city": "Paris", "unit": "C"}')
    two = wrap([good, call("f2", "{}")])
    assert accepts("required", wrap([good])) and accepts("required", two)
    assert accepts("required", wrap([good]), parallel=False) and not accepts("required", two, parallel=False)
    assert parse_all(fmt, two, NAMES)[1][1].name == "f2"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert accepts(named, wrap([good])) and not accepts(named, two)
    assert not accepts("required", wrap([call("get_weather", '{"city": "Paris", "unit": "K"}')]))  # not in the enum
    assert not accepts("required", wrap([call("get_weather", '{"city": "Paris"}')]))  # a required key missing
    assert not accepts("required", wrap([call("get_weather", '{"city": "Paris", "unit": "C", "x": 1}')]))  # closed
    assert not accepts("required", wrap([call("get_time", "{}")]))  # undeclared
    assert not accepts("required", "I will not call anything.")
    # with a response format: a forced call is still the call alone; auto takes calls or the format's JSON
    answer = Constraint.json_schema(
        {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    )
    assert accepts("required", two, response_format=answer) and not accepts(
        "required", '{"answer": "x"}', response_format=answer
    )
    assert accepts(named, wrap([good]), response_format=answer)
    for choice in ("auto", None):
        assert accepts(choice, wrap([good]), response_format=answer) and accepts(choice, two, response_format=answer)
        assert accepts(choice, '{"answer": "x"}', response_format=answer)
        assert not accepts(choice, '{"answer": 3}', response_format=answer)
        assert not accepts(choice, "I will not call anything.", response_format=answer)
    assert (
        tool_constraint(fmt, FUNCTIONS, "auto") is None
        and tool_constraint(fmt, FUNCTIONS, "none", text=answer) is answer
    )


def test_parallel_tool_calls_false_keeps_the_first_call():
    """parallel_tool_calls=false: a second call is read but not reported, whole or streamed (the
    forcing grammar's side is in the test above)."""
    two = '{"name": "a", "arguments": {"x": 1}}{"name": "b", "arguments": {"y": 2}}'
    content, calls = parse_all(IRMINSUL, two, frozenset({"a", "b"}), max_calls=1)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1})]
    parser = ToolCallParser(IRMINSUL, frozenset({"a", "b"}), max_calls=1)
    events = [e for k in range(0, len(two), 5) for e in parser.feed(two[k : k + 5])] + parser.finish()
    assert {e.index for e in events if not isinstance(e, Content)} == {0} and len(parser.calls) == 2


@pytest.mark.parametrize(
    "tool, says",
    [
        ({"type": "function", "function": "f"}, "tools[0].function must be an object"),
        ({"type": "function", "function": ["f"]}, "tools[0].function must be an object"),
        ({"type": "function", "function": 3}, "tools[0].function must be an object"),
        ({"type": "function", "function": {"parameters": {}}}, "tools[0].function.name"),
        ({"type": "function", "function": {"name": "f", "parameters": "{}"}}, "parameters must be a JSON schema"),
        ("f", "tools[0] must be an object"),
        ({"type": "retrieval"}, "only 'function' tools"),
    ],
)
@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "f"}}])
def test_a_malformed_tool_is_a_400_that_names_it(tool, says, choice):
    from irminsul.server.errors import APIError
    from irminsul.server.protocol import ChatCompletionRequest
    from irminsul.server.translate import tool_functions

    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[tool], tool_choice=choice)
    with pytest.raises(APIError) as e:
        tool_functions(req)
    assert e.value.status == 400 and says in e.value.message
