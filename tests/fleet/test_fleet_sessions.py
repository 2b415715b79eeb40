"""The fleet simulator's own-session reference and the content router's work shares on the skewed
pattern: what a session's own history saves, and the share bound at N = 2, 4 and 8."""

import numpy as np
import pytest

from irminsul.research.fleet import FleetConfig, own_sessions, reference, simulate
from irminsul.research.workloads.render import Rendered


def sessions(n_sessions: int, seed: int = 0, requests: int = 60) -> list[tuple[str, Rendered]]:
    """Each request: a turn of a session (its growing history), then a passage of a shared few."""
    rng = np.random.default_rng(seed)
    passages = [rng.integers(1000, 30_000, 300) for _ in range(6)]
    history: dict[str, list[np.ndarray]] = {}
    trace = []
    for _ in range(requests):
        s = f"s{int(rng.integers(n_sessions))}"
        turns = history.setdefault(s, [rng.integers(1000, 30_000, 200)])
        turns.append(np.concatenate([passages[int(rng.integers(len(passages)))], rng.integers(5, 1000, 30)]))
        tokens = np.concatenate(turns[-3:]).astype(np.int32)
        starts = tuple(int(x) for x in np.cumsum([0] + [len(t) for t in turns[-3:-1]]))
        trace.append((s, Rendered(tokens, starts)))
    return trace


def test_one_session_is_the_reference():
    trace = sessions(1)
    config = FleetConfig(pool_tokens=1)
    assert own_sessions(trace, config) == reference(trace, config).computed_tokens


def test_sessions_apart_compute_at_least_one_replica_holding_all():
    trace = sessions(8)
    config = FleetConfig(pool_tokens=1)
    prompt = sum(len(r.token_ids) for _, r in trace)
    own = own_sessions(trace, config)
    # the passages the sessions share are reused across them only by the replica holding every session
    assert reference(trace, config).computed_tokens < own < prompt


@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_skewed_trace_keeps_the_busiest_replica_within_the_share_bound(n):
    """The skewed pattern over shipped MuSiQue: the content router gives no replica more than
    1.25 x 1/N of the work (prompt tokens computed + decoded) at N = 2, 4 and 8."""
    from irminsul.research.workloads.builders import build_source
    from irminsul.research.workloads.patterns import apply_pattern
    from irminsul.research.workloads.render import render_trace

    trace = list(render_trace(apply_pattern("skewed", build_source("musique", n=40)), "deepseek"))
    ref = reference(trace, FleetConfig(pool_tokens=1))
    config = FleetConfig(pool_tokens=ref.distinct_tokens // 2)
    r = simulate(trace, "content", n, config, ref.interval_s(len(trace), n, config))
    assert r.max_share <= 1.25 / n, r


def test_the_cli_takes_the_routers_slack_and_bound_and_prints_the_own_session_reuse(tmp_path, capsys):
    import json

    from irminsul.cli import main

    trace = sessions(4)
    path = tmp_path / "t.jsonl"
    path.write_text(
        "".join(
            json.dumps({"session": s, "token_ids": r.token_ids.tolist(), "segments": list(r.segment_starts)}) + "\n"
            for s, r in trace
        )
    )
    args = ["bench", "fleet", str(path), "--replicas", "2", "--policies", "content", "--json"]
    assert main([*args, "--queue-slack-tokens", "0", "--no-load-bound"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["weights"]["queue_slack_tokens"] == 0 and j["load_bound"] is None
    prompt = sum(len(r.token_ids) for _, r in trace)
    assert j["own_session_reuse"] == pytest.approx(1 - own_sessions(trace, FleetConfig(pool_tokens=1)) / prompt)
    assert main(args) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["weights"]["queue_slack_tokens"] > 0 and j["load_bound"]["epsilon"] > 0
    with pytest.raises(SystemExit):
        main([*args, "--queue-slack-tokens", "-1"])
