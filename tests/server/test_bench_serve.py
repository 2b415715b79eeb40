"""`irminsul bench serve` against a real server: the report, and a refused request counted, not fatal."""

import json

from irminsul.cli import main


def test_a_refused_request_is_counted_and_the_replay_goes_on(server, tmp_path, capsys):
    """A request the server refuses (a 400: a trace prompt longer than the model's context) is
    counted as failed and the replay goes on to its report, instead of ending in a traceback that
    throws away every measurement made so far."""
    trace = tmp_path / "t.jsonl"
    rows = [
        {"session": "a", "messages": [{"role": "user", "content": "hello there"}]},
        {"session": "b", "messages": [{"role": "user", "content": "word " * 5000}]},  # past the context
        {"session": "a", "messages": [{"role": "user", "content": "hello there, again"}]},
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["bench", "serve", str(trace), "--url", server.url, "--max-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 requests" in out and "failed   1 requests" in out and "context" in out, out
    assert main(["bench", "serve", str(trace), "--url", server.url, "--max-tokens", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["requests"] == 2 and result["failed"] == 1 and result["prompt_tokens"] > 0
