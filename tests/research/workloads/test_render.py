import numpy as np
import pytest

from irminsul.model.chat_format import segment_texts
from irminsul.research.workloads.render import Renderer
from irminsul.research.workloads.trace import TraceRequest

TOOLS = tuple(
    {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": f"Does thing {i} well.",
            "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
        },
    }
    for i in range(3)
)
MESSAGES = (
    {"role": "system", "content": "You are a careful agent."},
    {"role": "user", "content": "Book me a flight to Seattle."},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"function": {"name": "tool_1", "arguments": '{"x": "SEA"}'}, "id": "c1", "type": "function"}],
    },
    {"role": "tool", "content": '{"ok": true}'},
)


@pytest.fixture(scope="module", params=["deepseek", "qwen2"])
def renderer(request):
    return Renderer(request.param)


def test_segments_are_tokenised_on_their_own(renderer):
    req = TraceRequest("s", MESSAGES, TOOLS)
    out = renderer(req)
    texts = [t for t in segment_texts(req, renderer.template) if t]
    pieces = [renderer.tokenizer.encode(t) for t in texts]
    assert out.token_ids.tolist() == [i for p in pieces for i in p]
    assert list(out.segment_starts) == list(np.cumsum([0] + [len(p) for p in pieces[:-1]]))
    # [bos] system, tools header, 3 tools, tools footer, user, assistant, tool, generation prompt
    assert len(out.segment_starts) == (renderer.template.bos != "") + 10


def test_same_tool_tokenises_the_same_in_any_order(renderer):
    a = renderer(TraceRequest("s", MESSAGES, TOOLS))
    b = renderer(TraceRequest("s", MESSAGES, TOOLS[::-1]))

    def seg(out, k):
        s = out.segment_starts
        return out.token_ids[s[k] : s[k + 1]].tolist()

    first_tool = 1 + (renderer.template.bos != "") + 1  # [bos] system, tools header, tools...
    tools_a = [seg(a, first_tool + i) for i in range(3)]
    tools_b = [seg(b, first_tool + i) for i in range(3)]
    assert tools_a == tools_b[::-1]
    assert (
        a.token_ids[a.segment_starts[first_tool + 3] :].tolist()
        == b.token_ids[b.segment_starts[first_tool + 3] :].tolist()
    )


def test_text_parts_are_segments(renderer):
    parts = [{"type": "text", "text": f"Passage {i}: " + "word " * (5 + i)} for i in range(3)]
    a = renderer(TraceRequest("s", ({"role": "user", "content": parts},)))
    b = renderer(TraceRequest("s", ({"role": "user", "content": parts[::-1]},)))
    assert len(a.segment_starts) == len(b.segment_starts)
    assert sorted(a.token_ids.tolist()) == sorted(b.token_ids.tolist())
    assert a.token_ids.tolist() != b.token_ids.tolist()


def test_generation_prompt_ends_every_request(renderer):
    out = renderer(TraceRequest("s", MESSAGES[:2]))
    tail = renderer.tokenizer.decode(out.token_ids[out.segment_starts[-1] :])
    assert tail == renderer.template.generation


def test_known_ids():
    q = Renderer("qwen2").tokenizer
    assert q.encode("Hello world") == [9707, 1879]  # Qwen2's own ids
    assert q.encode("<|im_start|>") == [151644] and q.vocab_size == 151646
    d = Renderer("deepseek").tokenizer
    assert d.vocab_size == 129280 and d.encode("<｜User｜>") == [128803]


def test_pretokenized_passes_through():
    out = Renderer("deepseek")(TraceRequest("s", token_ids=(5, 6, 7), segments=(0, 2)))
    assert out.token_ids.tolist() == [5, 6, 7] and out.segment_starts == (0, 2)
    assert Renderer("deepseek")(TraceRequest("s", token_ids=(5,))).segment_starts == (0,)
