"""Hostile requests against a live keyed server while another tenant streams: oversized and
deeply nested schemas and grammars, numbers at and past every integer and float limit in every
numeric field, special tokens and lone surrogates in every string the template renders, malformed
tools and tool choices, echo and log-prob combinations. Whatever arrives gets an answer below 500,
the server stays up, and the other tenant's stream completes as if nothing happened.

The server runs in its own process (`irminsul serve`), so an input that crashes it is reported
as the input after which it died, not as a test runner that died with it. Every failure is
collected, so one run lists them all.
"""

import json
import math
import subprocess
import threading
import time

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from irminsul.model.tokenizer import Tokenizer
from tests.server.server_helpers import health_status
from tests.support.services import ServerProcess

ALICE, BOB = "alice-key", "bob-key"  # two tenants: alice sends the hostile corpus, bob streams
CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
REQUEST_TIMEOUT = 20.0  # seconds one answer may take; longer is a stall, reported as a failure
CORPUS_BUDGET = 150.0  # seconds for the whole corpus; the run stops there and says how far it got


class Raw(str):
    """JSON text written as it is: NaN, Infinity, 5,000-digit integers (json.dumps cannot write them)."""


def dump(value) -> str:
    """JSON text of `value`, Raw pieces verbatim, strings escaped as json.dumps does (lone
    surrogates become \\ud800 escapes)."""
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, float):
        return (
            "NaN"
            if math.isnan(value)
            else ("Infinity" if value > 0 else "-Infinity")
            if math.isinf(value)
            else repr(value)
        )
    if isinstance(value, int):
        return str(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{dump(str(k))}: {dump(v)}" for k, v in value.items()) + "}"
    return "[" + ", ".join(dump(v) for v in value) + "]"


TWO63, TWO64 = 2**63, 2**64
NUMBERS = [
    Raw(str(TWO63)),
    Raw(str(TWO64)),
    Raw(str(-TWO63 - 1)),
    Raw(str(TWO63 - 1)),
    Raw("1e308"),
    Raw("-1e308"),
    Raw("1e309"),
    Raw("-0.0"),
    Raw("5e-324"),
    Raw("NaN"),
    Raw("Infinity"),
    Raw("-Infinity"),
    Raw("1" + "0" * 4999),
    Raw("-" + "9" * 5000),
    Raw("2147483648"),
    Raw("-1"),
    Raw("0"),
    Raw("0.5"),
    Raw("1.0"),
    Raw('"7"'),
    Raw("true"),
    Raw("[1]"),
]
NUMERIC_FIELDS = [
    "max_tokens",
    "max_completion_tokens",
    "n",
    "top_k",
    "top_p",
    "temperature",
    "seed",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
    "best_of",
]
USER = [{"role": "user", "content": "Which bags are free?"}]


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": USER, "max_tokens": 4, "temperature": 1, **fields}


def completion(**fields) -> dict:
    return {"model": "tiny", "prompt": "Which bags are free?", "max_tokens": 4, "temperature": 1, **fields}


def weather(parameters) -> list:
    return [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "Weather in a city", "parameters": parameters},
        }
    ]


# -- the hand-written corpus ---------------------------------------------------------------


def _schemas() -> dict:
    chain = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(3000)}
    chain["d3000"] = {"type": "string"}
    nested = {"type": "string"}
    for _ in range(30):  # (within the request's nesting limit: each level is two JSON levels)
        nested = {"type": "array", "items": nested}
    deep = Raw('{"type": "array", "items": ' * 1000 + '{"type": "string"}' + "}" * 1000)
    return {
        "3,000 chained $refs": {"$defs": chain, "$ref": "#/$defs/d0"},
        "a $ref to itself": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        "a $ref to the root": {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
        "a $ref to nothing": {"$ref": "#/$defs/missing"},
        "a $ref elsewhere": {"$ref": "http://127.0.0.1:9/schema.json"},
        "arrays 30 deep": nested,
        "arrays 1,000 deep": deep,
        "5,000 properties": {
            "type": "object",
            "properties": {f"p{i}": {"type": "integer"} for i in range(5000)},
            "required": [f"p{i}" for i in range(5000)],
        },
        "an enum of 10,000": {"enum": [f"v{i}" for i in range(10000)]},
        "3,000 anyOf branches": {"anyOf": [{"const": f"c{i}"} for i in range(3000)]},
        "an unsatisfiable string": {"type": "string", "minLength": 5, "maxLength": 2},
        "not anything": {"not": {}},
        "lengths past 2^63": {
            "type": "array",
            "items": {"type": "string", "minLength": Raw(str(TWO63))},
            "minItems": Raw(str(TWO64)),
            "maxItems": Raw("1e308"),
        },
        "bounds past every float": {
            "type": "number",
            "minimum": Raw("-1e309"),
            "maximum": Raw("1e309"),
            "multipleOf": Raw("5e-324"),
        },
        "a NaN bound": {"type": "integer", "minimum": Raw("NaN"), "exclusiveMaximum": Raw("Infinity")},
        "a 5,000-digit const": {"const": Raw("1" + "0" * 4999)},
        "a catastrophic pattern": {"type": "string", "pattern": "^(a+)+$"},
        "an invalid pattern": {"type": "string", "pattern": "(["},
        "a type that is no type": {"type": "<|end|><|system|>"},
        "types of every kind": {"type": ["string", "number", "integer", "boolean", "null", "array", "object"]},
        "a schema that is a number": Raw("5"),
        "a schema that is a list": [1, 2],
        "an empty schema": {},
    }


def _grammars() -> dict:
    chain = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(3000)) + 'r3000: "a"\n'
    gbnf = "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(3000)) + 'r3000 ::= "a"\n'
    return {
        "3,000 chained rules": chain,
        "3,000 chained GBNF rules": gbnf,
        "parentheses 1,000 deep": "start: " + "(" * 1000 + '"a"' + ")" * 1000 + "\n",
        "GBNF parentheses 1,000 deep": "root ::= " + "(" * 1000 + '"a"' + ")" * 1000 + "\n",
        "5,000 alternatives": "start: " + " | ".join(f'"w{i}"' for i in range(5000)) + "\n",
        "left recursion": 'start: start "a" | "a"\n',
        "mutual recursion without a base": "start: a\na: b\nb: a\n",
        "an undefined rule": "start: nowhere\n",
        "a catastrophic regex": "start: /(a+)+b/\n",
        "a regex matching nothing": r"start: /[^\s\S]/" + "\n",
        "a repeat of 2^63": 'start: "a"~' + str(TWO63) + "\n",
        "a repeat range past 2^64": 'start: "a"~0..' + str(TWO64) + "\n",
        "an import": "%import common.WS\nstart: WS\n",
        "an empty grammar": "",
        "not a grammar": "<|end|><|system|>\n))))",
        "a lone surrogate": Raw('"start: \\"\\ud800\\"\\n"'),
    }


def _regexes() -> dict:
    return {
        "parentheses 1,000 deep": "(" * 1000 + "a" + ")" * 1000,
        "a{1000000}": "a{1000000}",
        "a{2^63}": "a{" + str(TWO63) + "}",
        "unclosed": "(",
        "a lone backslash": "\\",
        "catastrophic": "(a+)+$",
        "lookahead": "(?=a)a",
        "backreference": r"(a)\1",
        "empty": "",
    }


def hand_written(tokenizer: Tokenizer) -> list[tuple[str, str, object]]:
    """(what, path, body) for every hostile input written out by hand."""
    cases = []
    add = lambda what, path, body: cases.append((what, path, body))  # noqa: E731
    for field in NUMERIC_FIELDS:
        for value in NUMBERS:
            extra = {"logprobs": True} if field == "top_logprobs" else {}
            add(f"chat {field}={value[:24]}", CHAT, chat(**{**extra, field: value}))
    for field in ("max_tokens", "logprobs", "n", "seed", "top_k", "temperature"):
        for value in NUMBERS:
            add(f"completions {field}={value[:24]}", COMPLETIONS, completion(**{field: value}))
    for value in NUMBERS:
        add(f"logit_bias value {value[:24]}", CHAT, chat(logit_bias={"5": value}))
        add(f"stop_token_ids [{value[:24]}]", CHAT, chat(stop_token_ids=[value]))
        add(
            f"Responses max_output_tokens={value[:24]}",
            RESPONSES,
            {"model": "tiny", "input": "hi", "max_output_tokens": value},
        )
        add(
            f"Responses temperature={value[:24]}",
            RESPONSES,
            {"model": "tiny", "input": "hi", "max_output_tokens": 4, "temperature": value},
        )
        add(f"detokenize [{value[:24]}]", "/detokenize", {"model": "tiny", "tokens": [value]})
    for key in (
        str(TWO63),
        str(TWO64),
        str(-TWO63 - 1),
        "1" + "0" * 4999,
        "-1",
        "320",
        "1e3",
        "NaN",
        " 5",
        "0x5",
        "٥",
        "",
    ):
        add(f"logit_bias key {key[:24]!r}", CHAT, chat(logit_bias={key: 100}))
    add("huge top_k, temperature 1", CHAT, chat(top_k=Raw(str(TWO63)), temperature=1, max_tokens=8))
    add("huge top_k, n=4, a seed", CHAT, chat(top_k=Raw(str(TWO63 - 1)), n=4, seed=Raw(str(TWO64 - 1))))
    add("huge top_k, tiny top_p, min_p 1", CHAT, chat(top_k=Raw(str(TWO63)), top_p=Raw("5e-324"), min_p=1))
    add(
        "every penalty at its extreme",
        CHAT,
        chat(
            presence_penalty=Raw("1e308"),
            frequency_penalty=Raw("-1e308"),
            repetition_penalty=Raw("1e308"),
            max_tokens=8,
        ),
    )
    every = range(tokenizer.vocab_size)
    add("logit_bias on every token", CHAT, chat(logit_bias={str(i): Raw("-1e308") for i in every}))
    add("logit_bias on every token, +inf", CHAT, chat(logit_bias={str(i): Raw("1e309") for i in every}))

    for what, schema in _schemas().items():
        add(
            f"response_format json_schema: {what}",
            CHAT,
            chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}),
        )
        add(f"tool_choice required, parameters: {what}", CHAT, chat(tools=weather(schema), tool_choice="required"))
    for what in (
        "3,000 chained $refs",
        "a $ref to itself",
        "arrays 30 deep",
        "5,000 properties",
        "lengths past 2^63",
        "a NaN bound",
        "a 5,000-digit const",
    ):
        schema = _schemas()[what]
        add(f"guided_json: {what}", CHAT, chat(guided_json=schema))
        add(f"structured_outputs json: {what}", COMPLETIONS, completion(structured_outputs={"json": schema}))
        add(
            f"Responses text.format: {what}",
            RESPONSES,
            {
                "model": "tiny",
                "input": "hi",
                "max_output_tokens": 4,
                "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}},
            },
        )
        add(
            f"tool_choice named, parameters: {what}",
            CHAT,
            chat(tools=weather(schema), tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        )
    for what, grammar in _grammars().items():
        add(f"guided_grammar: {what}", CHAT, chat(guided_grammar=grammar))
        add(f"structured_outputs grammar: {what}", COMPLETIONS, completion(structured_outputs={"grammar": grammar}))
    for what, regex in _regexes().items():
        add(f"guided_regex: {what}", CHAT, chat(guided_regex=regex))
    for what, choice in {
        "5,000 choices": [f"c{i}" for i in range(5000)],
        "none": [],
        "an empty one": [""],
        "special tokens": ["<|end|><|system|>"],
        "not strings": [5, None, {"a": 1}],
    }.items():
        add(f"guided_choice: {what}", CHAT, chat(guided_choice=choice))
    for what, rf in {
        "no schema": {"type": "json_schema"},
        "a schema of 5": {"type": "json_schema", "json_schema": 5},
        "an unknown type": {"type": "grammar", "grammar": "start: x"},
        "a type of 5": {"type": 5},
        "json_object and a schema": {"type": "json_object", "schema": {"type": "string"}},
    }.items():
        add(f"response_format: {what}", CHAT, chat(response_format=rf))
    add("two constraints", CHAT, chat(guided_regex="a+", guided_choice=["a"]))

    # tools and tool_choice of every wrong shape
    for what, tools in {
        "a string": "get_weather",
        "numbers": [1, 2],
        "no function": [{"type": "function"}],
        "a function of 5": [{"type": "function", "function": 5}],
        "a name of 5": [{"type": "function", "function": {"name": 5}}],
        "parameters of 5": [{"type": "function", "function": {"name": "f", "parameters": 5}}],
        "a null name": [{"type": "function", "function": {"name": None}}],
        "an empty name": [{"type": "function", "function": {"name": ""}}],
        "the same name twice": weather({}) * 2,
        "513 tools": weather({}) * 513,
        "a web_search tool": [{"type": "web_search"}],
        "a name of special tokens": [{"type": "function", "function": {"name": "<|end|><|system|>", "parameters": {}}}],
    }.items():
        for choice in (None, "auto", "required"):
            add(
                f"tools {what}, tool_choice {choice}",
                CHAT,
                chat(tools=tools, **({"tool_choice": choice} if choice else {})),
            )
    for what, choice in {
        "bogus": "bogus",
        "a function without a name": {"type": "function"},
        "a function not declared": {"type": "function", "function": {"name": "missing"}},
        "a function of 5": {"type": "function", "function": 5},
        "a list": Raw('["auto"]'),
        "a number": Raw("5"),
        "a name of special tokens": {"type": "function", "function": {"name": "<|end|><|system|>"}},
    }.items():
        add(f"tool_choice {what}", CHAT, chat(tools=weather({"type": "object"}), tool_choice=choice))
        add(f"tool_choice {what}, no tools", CHAT, chat(tool_choice=choice))
    add(
        "required, parallel off, n=3",
        CHAT,
        chat(tools=weather({"type": "object"}), tool_choice="required", parallel_tool_calls=False, n=3),
    )

    # special tokens and lone surrogates in every string that reaches the template
    evil = "<|end|><|system|>" + "".join(tokenizer.special_strings)
    add("special tokens everywhere", CHAT, chat(**_everywhere(evil)))
    add("special tokens everywhere, streamed with tools", CHAT, chat(stream=True, **_everywhere(evil)))
    add("special tokens everywhere, /tokenize", "/tokenize", {"model": "tiny", **_everywhere(evil)})
    surrogate = Raw('"\\ud800"')
    for what, body in {
        "content": chat(messages=[{"role": "user", "content": surrogate}]),
        "a text part": chat(messages=[{"role": "user", "content": [{"type": "text", "text": surrogate}]}]),
        "a name": chat(messages=[{"role": "user", "name": surrogate, "content": "hi"}]),
        "a schema key": chat(tools=weather({"type": "object", "properties": {"\ud800": {"type": "string"}}})),
        "a tool call's arguments": chat(
            messages=USER
            + [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": surrogate}}
                    ],
                }
            ]
        ),
        "stop": chat(stop=[surrogate]),
        "cache_salt": chat(cache_salt=surrogate),
        "model": chat(model=surrogate),
        "a logit_bias key": chat(logit_bias={"\udfff": 1}),
        "a prompt": completion(prompt=surrogate),
        "Responses input": {"model": "tiny", "input": surrogate, "max_output_tokens": 4},
        "Responses instructions": {"model": "tiny", "input": "hi", "instructions": surrogate, "max_output_tokens": 4},
        "a grammar": chat(guided_grammar=surrogate),
        "a regex": chat(guided_regex=surrogate),
        "chat_template_kwargs": chat(chat_template_kwargs={"x": surrogate}),
        "tokenize": {"model": "tiny", "prompt": surrogate},
    }.items():
        add(
            f"a lone surrogate in {what}",
            RESPONSES
            if what.startswith("Responses")
            else "/tokenize"
            if what == "tokenize"
            else COMPLETIONS
            if what == "a prompt"
            else CHAT,
            body,
        )
    add("special tokens as chat_template_kwargs", CHAT, chat(chat_template_kwargs={"<|end|>": "<|system|>"}))
    add(
        "special tokens in Responses items",
        RESPONSES,
        {
            "model": "tiny",
            "max_output_tokens": 4,
            "instructions": evil,
            "tools": [
                {
                    "type": "function",
                    "name": evil,
                    "description": evil,
                    "parameters": {"type": "object", "properties": {evil: {"type": "string", "description": evil}}},
                }
            ],
            "input": [
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": evil}]},
                {"type": "function_call", "call_id": evil, "name": evil, "arguments": json.dumps({evil: evil})},
                {"type": "function_call_output", "call_id": evil, "output": evil},
            ],
        },
    )

    # messages of every wrong shape
    for what, messages in {
        "none": [],
        "a string": "hi",
        "numbers": [1],
        "no role": [{"content": "hi"}],
        "a role of special tokens": [{"role": "<|system|>", "content": "hi"}],
        "content of an object": [{"role": "user", "content": {"a": 1}}],
        "parts without text": [{"role": "user", "content": [{"type": "text"}]}],
        "an image part": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
        "tool_calls of a string": [{"role": "assistant", "content": "", "tool_calls": "x"}],
        "4,097 messages": USER * 4097,
        "16,385 parts": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 16385}],
        "a tool answer first": [{"role": "tool", "tool_call_id": "x", "content": "hi"}],
        "nested 1,000 deep": Raw("[" * 1000 + "]" * 1000),
    }.items():
        add(f"messages {what}", CHAT, chat(messages=messages))
    add("continue_final_message after a user", CHAT, chat(continue_final_message=True, add_generation_prompt=False))
    add(
        "continue_final_message with add_generation_prompt",
        CHAT,
        chat(messages=USER + [{"role": "assistant", "content": "x"}], continue_final_message=True),
    )
    add("chat_template_kwargs 1,000 deep", CHAT, chat(chat_template_kwargs={"x": Raw("[" * 1000 + "]" * 1000)}))
    add("stop strings: 17", CHAT, chat(stop=["a"] * 17))
    add("a stop string of 100,000", CHAT, chat(stop=["a" * 100000]))
    add("a body of 1,000-deep objects", CHAT, Raw('{"messages": ' + '{"a": ' * 1000 + "1" + "}" * 1000 + "}"))
    add("not JSON", CHAT, Raw("{"))
    add("a JSON string body", CHAT, Raw('"hi"'))
    add("NaN body", CHAT, Raw("NaN"))

    # echo and log-probs
    for logprobs in (0, 1, 5, 20, 21, Raw(str(TWO63)), -1, Raw("NaN"), True):
        add(f"echo, logprobs={logprobs}", COMPLETIONS, completion(echo=True, logprobs=logprobs))
        add(
            f"echo, logprobs={logprobs}, max_tokens 1, token prompt",
            COMPLETIONS,
            completion(echo=True, logprobs=logprobs, max_tokens=1, prompt=[1, 2, 3]),
        )
    for what, fields in {
        "stream": {"stream": True},
        "n=3": {"n": 3},
        "best_of 2": {"best_of": 2},
        "max_tokens 0": {"max_tokens": 0},
        "a stop at once": {"stop": ["W"]},
        "a batch of 64 and n=2": {"prompt": ["a"] * 64, "n": 2},
        "special tokens skipped": {"prompt": evil, "skip_special_tokens": True},
        "special tokens kept": {"prompt": evil, "skip_special_tokens": False},
        "an empty prompt": {"prompt": ""},
        "no prompt tokens": {"prompt": []},
        "an empty batch": {"prompt": [[]]},
        "out-of-vocabulary ids": {"prompt": [tokenizer.vocab_size, 10**6]},
        "ids past 2^63": {"prompt": [Raw(str(TWO63)), Raw(str(TWO64))]},
        "negative ids": {"prompt": [-1]},
        "a suffix": {"suffix": "x"},
        "logit_bias": {"logit_bias": {"5": 100}},
        "top_logprobs": {"top_logprobs": 5},
    }.items():
        add(f"echo with logprobs 5, {what}", COMPLETIONS, completion(echo=True, logprobs=5, **fields))
    add("chat logprobs 5 (an integer)", CHAT, chat(logprobs=5))
    add("chat top_logprobs 2^63", CHAT, chat(logprobs=True, top_logprobs=Raw(str(TWO63))))
    add("chat top_logprobs without logprobs", CHAT, chat(top_logprobs=2))
    add("chat logprobs, n=8, top_logprobs 20, streamed", CHAT, chat(logprobs=True, top_logprobs=20, n=8, stream=True))
    add(
        "Responses top_logprobs 2^63",
        RESPONSES,
        {
            "model": "tiny",
            "input": "hi",
            "max_output_tokens": 4,
            "top_logprobs": Raw(str(TWO63)),
            "include": ["message.output_text.logprobs"],
        },
    )
    return cases


def _everywhere(evil: str) -> dict:
    """A chat request with `evil` in every string and key that reaches the template."""
    schema = {
        "type": "object",
        "properties": {
            evil: {"type": evil, "description": evil, "enum": [evil]},
            "nested": {"type": "object", "properties": {evil: {"type": "string"}}},
        },
        "required": [evil],
    }
    return {
        "messages": [
            {"role": "system", "content": evil, "name": evil},
            {"role": "user", "content": [{"type": "text", "text": evil}, {"type": "text", "text": evil}], "name": evil},
            {
                "role": "assistant",
                "content": evil,
                "reasoning_content": evil,
                "tool_calls": [
                    {"id": evil, "type": "function", "function": {"name": evil, "arguments": {evil: {evil: [evil]}}}},
                    {"id": evil + "2", "type": evil, "function": {"name": evil, "arguments": json.dumps({evil: evil})}},
                ],
            },
            {"role": "tool", "tool_call_id": evil, "name": evil, "content": evil},
            {"role": "user", "content": evil},
        ],
        "tools": [{"type": "function", "function": {"name": evil, "description": evil, "parameters": schema}}],
        "stop": [evil[:1000]],
    }


# -- the generated corpus ------------------------------------------------------------------


def _hostile_values(tokenizer: Tokenizer):
    pieces = [
        "a",
        " ",
        "\n",
        "{",
        '"',
        "<|end|>",
        "<|system|>",
        "\ud800",
        "\udfff",
        "\x00",
        "\u202e",
        *tokenizer.special_strings,
    ]
    strings = st.lists(st.sampled_from(pieces), max_size=6).map("".join)
    numbers = st.sampled_from(NUMBERS) | st.integers() | st.floats(allow_nan=True, allow_infinity=True)
    return st.recursive(
        numbers | strings | st.booleans() | st.none(),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(strings, inner, max_size=4),
        max_leaves=12,
    )


def generated(tokenizer: Tokenizer, n: int) -> list[tuple[str, str, object]]:
    """`n` hypothesis-generated bodies: a chat, completion or Responses request with random fields
    (every numeric and structured field, and the strings that reach the template) set to hostile
    values of every JSON type."""
    values = _hostile_values(tokenizer)
    fields = NUMERIC_FIELDS + [
        "logit_bias",
        "stop",
        "stop_token_ids",
        "tools",
        "tool_choice",
        "response_format",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
        "chat_template_kwargs",
        "cache_salt",
        "stream",
        "echo",
        "parallel_tool_calls",
    ]
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"])},
        optional={"content": values, "name": values, "tool_calls": values, "tool_call_id": values},
    )
    bodies = st.one_of(
        st.tuples(
            st.just(CHAT),
            st.fixed_dictionaries(
                {"messages": st.lists(message, min_size=1, max_size=3)}, optional={f: values for f in fields}
            ),
        ),
        st.tuples(
            st.just(COMPLETIONS), st.fixed_dictionaries({"prompt": values}, optional={f: values for f in fields})
        ),
        st.tuples(
            st.just(RESPONSES),
            st.fixed_dictionaries(
                {"input": values},
                optional={
                    f: values
                    for f in (
                        "instructions",
                        "tools",
                        "tool_choice",
                        "text",
                        "max_output_tokens",
                        "temperature",
                        "top_p",
                        "top_logprobs",
                        "include",
                        "metadata",
                    )
                },
            ),
        ),
    )
    out = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(bodies)
    def collect(case):
        path, body = case
        for key in ("max_tokens", "max_output_tokens"):  # bound the run, not the input space
            if isinstance(body.get(key), int) and not isinstance(body.get(key), bool) and body[key] > 8:
                body[key] = 8
        body.setdefault("max_tokens" if path != RESPONSES else "max_output_tokens", 4)
        out.append((f"generated {len(out)}", path, {"model": "tiny", **body}))

    collect()
    return out[:n]


# -- the run -------------------------------------------------------------------------------


class Streamer(threading.Thread):
    """The other tenant: sampled streams of 64 tokens, one after another, until told to stop."""

    def __init__(self, url: str, max_streams: int = 400):
        super().__init__(name="bob-streams", daemon=True)
        self.url, self.max_streams = url, max_streams
        self.done = threading.Event()
        self.results: list[str | None] = []  # the finish_reason of each stream, or what went wrong

    def run(self):
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Tell me about baggage."}],
            "max_tokens": 64,
            "temperature": 1,
            "stream": True,
        }
        with httpx.Client(timeout=httpx.Timeout(REQUEST_TIMEOUT, connect=5)) as client:
            while not self.done.is_set() and len(self.results) < self.max_streams:
                self.results.append(self._one(client, body))
                time.sleep(0.05)

    def _one(self, client, body) -> str:
        finish = None
        try:
            with client.stream("POST", self.url + CHAT, json=body, headers={"Authorization": f"Bearer {BOB}"}) as r:
                if r.status_code != 200:
                    return f"status {r.status_code}: {r.read()[:300]!r}"
                for line in _sse_lines(r):
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        return f"error event {event['error']}"
                    for choice in event.get("choices") or ():
                        finish = choice.get("finish_reason") or finish
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            return f"{type(e).__name__}: {e}"
        return finish or "no finish_reason"


def _sse_lines(response):
    """Server-sent event lines, split where SSE splits them (CR, LF), not where str.splitlines
    would (U+2028, U+0085 and the like are text inside an event)."""
    buffer = b""
    for chunk in response.iter_bytes():
        *lines, buffer = (buffer + chunk).replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        yield from lines
    if buffer:
        yield buffer


def send(client: httpx.Client, url: str, path: str, body) -> tuple[int | None, str]:
    """(status, the answer's start), or (None, what went wrong). A connection the server closed
    after an earlier answer is retried once on a fresh one, so the failure is the input's own."""
    content = dump(body).encode("utf-8", "surrogatepass")
    headers = {"Authorization": f"Bearer {ALICE}", "Content-Type": "application/json"}
    for _ in range(2):
        try:
            r = client.post(url + path, content=content, headers=headers)
            return r.status_code, r.text[:300]
        except httpx.TimeoutException as e:
            return None, f"no answer in {REQUEST_TIMEOUT:.0f} s ({type(e).__name__})"
        except httpx.TransportError as e:
            error = f"{type(e).__name__}: {e}"
    return None, error


def test_hostile_requests_get_no_5xx_and_disturb_no_other_tenant(tiny_dir, monkeypatch):
    monkeypatch.setenv("PYTHONFAULTHANDLER", "1")  # a crash on a Python thread writes its stack to the server log
    tokenizer = Tokenizer(tiny_dir)
    corpus = hand_written(tokenizer) + generated(tokenizer, 80)
    server = ServerProcess(
        "--model",
        str(tiny_dir),
        "--served-model-name",
        "tiny",
        "--api-key",
        f"{ALICE}=alice",
        "--api-key",
        f"{BOB}=bob",
        "--default-max-tokens",
        "4",
        "--no-compile-decode",
        "--log-level",
        "warning",
    )
    streamer = Streamer(server.url)
    failures, statuses, sent, alive = [], {}, 0, True
    try:
        streamer.start()
        end = time.monotonic() + CORPUS_BUDGET
        with httpx.Client(timeout=httpx.Timeout(REQUEST_TIMEOUT, connect=5)) as client:
            for what, path, body in corpus:
                if time.monotonic() > end:
                    failures.append(f"the corpus took over {CORPUS_BUDGET:.0f} s: {sent} of {len(corpus)} inputs sent")
                    break
                status, text = send(client, server.url, path, body)
                sent += 1
                statuses[status] = statuses.get(status, 0) + 1
                if status is None or status >= 500:
                    failures.append(f"{what} ({path}): {status or 'no answer'}: {text}")
                if status is None:  # (a dying process may take a moment to exit)
                    try:
                        server.proc.wait(2)
                    except subprocess.TimeoutExpired:
                        pass
                if server.proc.poll() is not None:
                    failures.append(f"the server died (exit status {server.proc.returncode}) after: {what}")
                    break
        streamer.done.set()
        streamer.join(REQUEST_TIMEOUT + 5)
        alive = server.proc.poll() is None
        if alive:
            health = health_status(server.url)
            if health != 200:
                failures.append(f"/health answers {health} after the corpus")
        bad_streams = [r for r in streamer.results if r not in ("length", "stop")]
        if streamer.is_alive() or not streamer.results or bad_streams:
            failures.append(
                f"the other tenant's streams: {len(streamer.results)} ran, "
                f"{'still running, ' if streamer.is_alive() else ''}not ended by length or stop: "
                f"{bad_streams[:5]}"
            )
    finally:
        streamer.done.set()
        server.stop()
    log = server.log.read_text(errors="replace")
    tracebacks = log.count("Traceback (most recent call last)")
    died = f"\nthe end of its log:\n{log[-2000:]}" if not alive else ""
    assert not failures, (
        f"{len(failures)} failures in {sent} hostile requests (statuses {statuses}); "
        f"{tracebacks} tracebacks in the server log {server.log}:\n" + "\n".join(failures) + died
    )
    assert statuses.get(200, 0) > 20 and statuses.get(400, 0) > 100, statuses  # the corpus reached both paths
