import json

import pytest

from irminsul.research.workloads.trace import TraceError, TraceRequest, read_trace, write_trace


def test_round_trip(tmp_path):
    reqs = [
        TraceRequest("a", ({"role": "user", "content": "hi"},), ({"type": "function", "function": {"name": "f"}},)),
        TraceRequest("b", token_ids=(1, 2, 3), segments=(0, 2)),
        TraceRequest("c", token_ids=(4,)),
    ]
    path = tmp_path / "t.jsonl"
    assert write_trace(path, reqs) == 3
    assert read_trace(path) == reqs


@pytest.mark.parametrize(
    "line, problem",
    [
        ("{not json", "not valid JSON"),
        ('{"session": "a"}', "exactly one of 'messages' or 'token_ids'"),
        ('{"session": "a", "messages": []}', "non-empty list"),
        ('{"session": "a", "messages": [{"role": "robot", "content": "x"}]}', "messages[0] has role 'robot'"),
        ('{"session": "a", "messages": [{"role": "user", "content": 3}]}', "messages[0].content"),
        (
            '{"session": "a", "messages": [{"role": "user", "content": [{"type": "image"}]}]}',
            "content[0] is not a text part",
        ),
        ('{"session": "a", "messages": [{"role": "user", "content": "x"}], "tools": "all"}', "'tools'"),
        ('{"session": "a", "token_ids": [1, -2]}', "non-negative"),
        ('{"session": "a", "token_ids": [1, 2], "segments": [1, 0]}', "strictly increasing"),
        ('{"session": "a", "token_ids": [1, 2], "segments": [0, 5]}', "strictly increasing"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_malformed_line_names_line_and_problem(tmp_path, line, problem):
    good = json.dumps({"session": "a", "token_ids": [1, 2]})
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{good}\n\n{line}\n{good}\n")
    with pytest.raises(TraceError) as e:
        read_trace(path)
    assert "bad.jsonl:3: " in str(e.value) and problem in str(e.value)


def test_missing_and_empty(tmp_path):
    with pytest.raises(TraceError, match="no such trace file"):
        read_trace(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(tmp_path / "empty.jsonl")
