"""Chat formats: how OpenAI chat messages (+ tool schemas) become a checkpoint's prompt text.

One format per tokenizer family, each the text of every segment in order: each message, each text
part of one and each tool schema is a segment of its own, so the same content tokenises the same
way wherever it sits (tokenised together, one passage came out at 468 or 550 tokens depending on
its neighbours) and every segment start can be handed to S2 chunking (docs/design.md section 3).

- the bundled format (the reference models and tiny checkpoints): its special tokens, the Jinja
  `chat_template` written into their tokenizer_config.json, and `IRMINSUL`, the same text written
  by hand for a checkpoint whose config lacks the template;
- `DEEPSEEK` and `QWEN2`, hand-written after DeepSeek-V3.1's and Qwen2.5's chat templates (closely,
  not byte for byte), for checkpoints without a `chat_template` and for rendering traces;
- the validation of OpenAI messages that every reader of them uses (the server, the trace format).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

BOS, EOS, END, PAD = "<|bos|>", "<|eos|>", "<|end|>", "<|pad|>"
ROLES = ("system", "user", "assistant", "tool")
LEGACY_ROLES = ("function",)  # OpenAI's older tool-result role: accepted, rendered as "tool"
ROLE_TOKENS = {r: f"<|{r}|>" for r in ROLES}
SPECIAL_TOKENS = [BOS, EOS, END, PAD, *ROLE_TOKENS.values()]  # the bundled tokenizer's, in id order

# The bundled format as a Jinja chat template (tokenizer_config.json): `<|bos|>`, then
# `<|role|>content<|end|>` per message, tool schemas as JSON lines in the system turn, an
# assistant's tool calls as {"name", "arguments"} objects after its content (the training data's
# form), text parts each followed by a blank line. `IRMINSUL` below writes the same text.
IRMINSUL_CHAT_TEMPLATE = (
    "{%- set ns = namespace(sys=0) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'system' and loop.index0 == ns.sys -%}{%- set ns.sys = ns.sys + 1 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- macro calls(m) -%}"
    "{%- for c in (m.get('tool_calls') or []) + ([m['function_call']] if m.get('function_call') else []) -%}"
    "{%- set f = c['function'] if 'function' in c else c -%}{%- set a = f.get('arguments', '') -%}"
    "{{- {'name': f.get('name', '') | string, 'arguments': a if a is string else a | tojson} | tojson -}}"
    "{%- endfor -%}"
    "{%- endmacro -%}"
    "{%- macro message(m, close) -%}"
    "{%- set role = 'tool' if m['role'] == 'function' else m['role'] -%}"
    "{{- '<|' + role + '|>' -}}"
    "{%- if m['content'] is string -%}{{- m['content'] -}}"
    "{%- elif m['content'] is not none -%}{%- for p in m['content'] -%}{{- p['text'] + '\\n\\n' -}}{%- endfor -%}{%- endif -%}"
    "{%- if role == 'assistant' -%}{{- calls(m) -}}{%- endif -%}"
    "{%- if close -%}{{- '<|end|>' -}}{%- endif -%}"
    "{%- endmacro -%}"
    "{{- bos_token -}}"
    "{%- for m in messages[:ns.sys] -%}{{- message(m, not tools or loop.index0 < ns.sys - 1) -}}{%- endfor -%}"
    "{%- if tools -%}"
    "{{- ('' if ns.sys else '<|system|>') + '# Tools\\nYou may call these functions:' -}}"
    "{%- for t in tools -%}{{- '\\n' + t | tojson -}}{%- endfor -%}"
    "{{- '\\n<|end|>' -}}"
    "{%- endif -%}"
    "{%- for m in messages[ns.sys:] -%}{{- message(m, true) -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class ChatTemplate:
    bos: str
    opener: dict  # role -> text before the content
    closer: dict  # role -> text after the content
    generation: str  # the assistant prompt at the end of every request
    tools_header: str
    tools_footer: str
    tool_text: Callable[[dict], str]
    calls_text: Callable[[list], str]
    markers: tuple[str, ...]  # special tokens a tokenizer must know for this format to be its own


def _json(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)


def _calls(m: dict) -> list[tuple[str, str]]:
    """(name, arguments) of an assistant message's tool_calls or legacy function_call."""
    calls = [c.get("function", c) for c in m.get("tool_calls") or []]
    if m.get("function_call"):
        calls.append(m["function_call"])
    out = []
    for c in calls:
        args = c.get("arguments", "")
        out.append((str(c.get("name", "")), args if isinstance(args, str) else _json(args)))
    return out


def _deepseek_calls(calls) -> str:
    inner = "\n".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"
        for name, args in calls
    )
    return f"<｜tool▁calls▁begin｜>{inner}<｜tool▁calls▁end｜>"


def _deepseek_tool(t: dict) -> str:
    f = t.get("function", t)
    return (
        f"\n### {f.get('name', '')}\nDescription: {f.get('description', '')}\n\n"
        f"Parameters: {_json(f.get('parameters', {}))}\n"
    )


def _qwen2_calls(calls) -> str:
    return "".join(
        f'\n<tool_call>\n{{"name": "{name}", "arguments": {args or "{}"}}}\n</tool_call>' for name, args in calls
    )


def _irminsul_calls(calls) -> str:
    # the arguments as OpenAI sends them (JSON text), as the training data wrote each call
    return "".join(_json({"name": name, "arguments": args}) for name, args in calls)


IRMINSUL = ChatTemplate(
    bos=BOS,
    opener=dict(ROLE_TOKENS),
    closer={r: END for r in ROLES},
    generation=ROLE_TOKENS["assistant"],
    tools_header="# Tools\nYou may call these functions:",
    tools_footer="\n",
    tool_text=lambda t: "\n" + _json(t),
    calls_text=_irminsul_calls,
    markers=(BOS, ROLE_TOKENS["user"], ROLE_TOKENS["assistant"], END),
)

DEEPSEEK = ChatTemplate(
    bos="<｜begin▁of▁sentence｜>",
    opener={
        "system": "",
        "user": "<｜User｜>",
        "assistant": "<｜Assistant｜>",
        "tool": "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>",
    },
    closer={
        "system": "\n\n",
        "user": "",
        "assistant": "<｜end▁of▁sentence｜>",
        "tool": "<｜tool▁output▁end｜><｜tool▁outputs▁end｜>",
    },
    generation="<｜Assistant｜>",
    tools_header="## Tools\nYou have access to the following tools:\n",
    tools_footer=(
        "\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n<｜tool▁calls▁begin｜>"
        "<｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜>\n"
    ),
    tool_text=_deepseek_tool,
    calls_text=_deepseek_calls,
    markers=("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"),
)

QWEN2 = ChatTemplate(
    bos="",
    opener={r: f"<|im_start|>{r}\n" for r in ("system", "user", "assistant")}
    | {"tool": "<|im_start|>user\n<tool_response>\n"},
    closer={
        "system": "<|im_end|>\n",
        "user": "<|im_end|>\n",
        "assistant": "<|im_end|>\n",
        "tool": "\n</tool_response><|im_end|>\n",
    },
    generation="<|im_start|>assistant\n",
    tools_header=(
        "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    ),
    tools_footer=(
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
        'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
        '"arguments": <args-json-object>}\n</tool_call>'
    ),
    tool_text=lambda t: "\n" + _json(t),
    calls_text=_qwen2_calls,
    markers=("<|im_start|>", "<|im_end|>"),
)

TEMPLATES = {"irminsul": IRMINSUL, "deepseek": DEEPSEEK, "qwen2": QWEN2}


@dataclass(frozen=True)
class Chat:
    """Validated OpenAI chat messages and tool schemas (dicts, as sent)."""

    messages: tuple
    tools: tuple = ()


def _check_message(i: int, m) -> None:
    if not isinstance(m, dict):
        raise ValueError(f"messages[{i}] is not an object")
    if m.get("role") not in ROLES + LEGACY_ROLES:
        expected = ", ".join(ROLES + LEGACY_ROLES)
        raise ValueError(f"messages[{i}] has role {m.get('role')!r}; expected one of {expected}")
    content = m.get("content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and isinstance(part.get("text"), str)):
                raise ValueError(f"messages[{i}].content[{j}] is not a text part {{'type': 'text', 'text': ...}}")
    elif content is not None and not isinstance(content, str):
        raise ValueError(f"messages[{i}].content must be a string, a list of text parts or null")
    calls = m.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise ValueError(f"messages[{i}].tool_calls must be a list of tool calls")
    for j, call in enumerate(calls or []):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
            raise ValueError(
                f"messages[{i}].tool_calls[{j}] must be {{'type': 'function', 'function': "
                f"{{'name': ..., 'arguments': ...}}}}"
            )
    legacy = m.get("function_call")
    if legacy is not None and not (isinstance(legacy, dict) and isinstance(legacy.get("name"), str)):
        raise ValueError(f"messages[{i}].function_call must be {{'name': ..., 'arguments': ...}}")


def parse_chat(messages, tools) -> Chat:
    """Validate OpenAI messages and tool schemas; raises ValueError saying what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        _check_message(i, m)
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError("'tools' must be a list of tool schema objects")
    return Chat(tuple(messages), tuple(tools))


def _message_texts(tpl: ChatTemplate, m: dict, closer: bool = True) -> list[str]:
    role = "tool" if m["role"] in LEGACY_ROLES else m["role"]
    content = m.get("content")
    calls = tpl.calls_text(_calls(m)) if role == "assistant" and _calls(m) else ""
    end = tpl.closer[role] if closer else ""
    if isinstance(content, list):  # text parts: each its own segment
        parts = [p["text"] + "\n\n" for p in content]
        return [tpl.opener[role], *parts, calls + end]
    return [tpl.opener[role] + (content or "") + calls + end]


def segment_texts(chat: Chat, tpl: ChatTemplate) -> list[str]:
    """The text of each segment, in order (empty strings are dropped later)."""
    msgs = list(chat.messages)
    n_sys = next((i for i, m in enumerate(msgs) if m["role"] != "system"), len(msgs))
    out = [tpl.bos]
    for i, m in enumerate(msgs[:n_sys]):  # the system closer of the last one waits for the tools
        out += _message_texts(tpl, m, closer=not chat.tools or i < n_sys - 1)
    if chat.tools:
        out.append(("" if n_sys else tpl.opener["system"]) + tpl.tools_header)
        out += [tpl.tool_text(t) for t in chat.tools]
        out.append(tpl.tools_footer + tpl.closer["system"])
    for m in msgs[n_sys:]:
        out += _message_texts(tpl, m)
    out.append(tpl.generation)
    return out
