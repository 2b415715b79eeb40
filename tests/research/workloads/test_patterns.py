import pytest

from irminsul.errors import UserFacingError
from irminsul.research.workloads.patterns import PATTERNS, apply_pattern
from irminsul.research.workloads.trace import TraceRequest

SYSTEM = {"role": "system", "content": "\n\n".join(f"Rule {i}: be helpful in way {i}." for i in range(6))}
TOOLS = tuple({"type": "function", "function": {"name": f"t{i}"}} for i in range(10))


def _session(name, turns):
    out, history = [], []
    for k in range(turns):
        history = history + [
            {"role": "user", "content": f"{name} question {k}"},
            {"role": "assistant", "content": f"{name} answer {k}"},
        ]
        out.append(TraceRequest(name, (SYSTEM, *history[:-1]), TOOLS))
    return out


def _rag(n):
    parts = [{"type": "text", "text": f"passage {i}"} for i in range(10)]
    return [
        TraceRequest(f"q{k}", (SYSTEM, {"role": "user", "content": parts + [{"type": "text", "text": f"Q{k}?"}]}))
        for k in range(n)
    ]


AGENT = _session("a", 12) + _session("b", 9)


@pytest.mark.parametrize("name", ["agent_meta", "sysvar", "compact", "tool_variants"])
def test_seeded(name):
    assert apply_pattern(name, AGENT, seed=3) == apply_pattern(name, AGENT, seed=3)
    assert apply_pattern(name, AGENT, seed=3) != apply_pattern(name, AGENT, seed=4)


def test_raw_is_identity():
    assert apply_pattern("raw", AGENT) == AGENT


def test_agent_meta_header_first_and_varying():
    out = apply_pattern("agent_meta", AGENT, profile_lines=(0, 30))
    assert all(r.messages[1:] == a.messages and r.tools == a.tools for r, a in zip(out, AGENT))
    headers = [r.messages[0]["content"] for r in out]
    assert all(h.startswith("<agent-metadata>\nrequest_id: req-") for h in headers)
    assert len(set(headers)) == len(out) and len({len(h) for h in headers}) > 5


def test_sysvar_differs_in_the_middle():
    """sysvar inserts a "## Deployment notes" section midway through the system prompt and changes
    nothing else: the prompt's head and tail, the other messages, the tools and the session stay as
    they were, so the content after the section recurs at a shifted position."""
    out = apply_pattern("sysvar", AGENT, n_variants=4)
    old = SYSTEM["content"]
    head, tail = old[: old.index("Rule 3")], old[old.index("Rule 3") :]
    assert len(out) == len(AGENT)
    for r, a in zip(out, AGENT):
        new = r.messages[0]["content"]
        section = new[len(head) : len(new) - len(tail)]
        assert new == head + section + tail and r.messages[0]["role"] == "system"
        assert section.startswith("## Deployment notes\n") and section.strip() != "## Deployment notes"
        assert r.messages[1:] == a.messages[1:] and r.tools == a.tools and r.session == a.session
    assert len({r.messages[0]["content"] for r in out}) > 1
    per_session = apply_pattern("sysvar", AGENT, per="session")
    assert len({r.messages[0]["content"] for r in per_session if r.session == "a"}) == 1


def test_compact_keeps_recent_turns_and_summarises_the_rest():
    out = apply_pattern("compact", AGENT, every=(3, 3), keep_last=2)
    assert out[0] == AGENT[0]
    last = out[11]  # session a, 23 body messages
    assert last.messages[0] == SYSTEM
    assert last.messages[1]["content"].startswith("Summary of the earlier conversation:")
    assert list(last.messages[-2:]) == list(AGENT[11].messages[-2:])
    assert len(last.messages) < len(AGENT[11].messages)
    with pytest.raises(UserFacingError, match="multi-turn"):
        apply_pattern("compact", _rag(3))


def test_rerank_reuses_passages_in_other_orders():
    base = _rag(3)
    out = apply_pattern("rerank", base, repeats=4, keep=(0.5, 1.0))
    assert len(out) == 15 and out[0] == base[0]
    passages = set(p["text"] for p in base[0].messages[1]["content"][:-1])
    for r in out[1:5]:
        parts = r.messages[1]["content"]
        assert parts[-1]["text"] == "Q0?" and 5 <= len(parts) - 1 <= 10
        assert {p["text"] for p in parts[:-1]} <= passages and r.session == "q0"
    with pytest.raises(UserFacingError, match="passages"):
        apply_pattern("rerank", AGENT)


def test_tool_variants_subsets_and_orders():
    out = apply_pattern("tool_variants", AGENT, keep=(0.5, 0.8))
    for r in out:
        names = [t["function"]["name"] for t in r.tools]
        assert 5 <= len(names) <= 8 and len(set(names)) == len(names)
    assert len({tuple(t["function"]["name"] for t in r.tools) for r in out}) > 10
    with pytest.raises(UserFacingError, match="tools"):
        apply_pattern("tool_variants", _rag(2))


def test_unknown_pattern():
    with pytest.raises(UserFacingError, match="unknown pattern"):
        apply_pattern("nope", AGENT)
    assert set(PATTERNS) >= {"agent_meta", "sysvar", "compact", "rerank", "tool_variants"}
