"""The fleet simulator on a small trace whose documents recur behind headers of changing length:
routing by content keeps reuse near one replica holding the whole fleet's pool, routing by load alone
does not, and the shares and counts add up."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from irminsul.cli import main
from irminsul.research.fleet import POLICIES, FleetConfig, SimReplica, reference, run_fleet, simulate
from irminsul.research.workloads.render import Rendered


def moved_documents(seed: int = 0, requests: int = 120, docs: int = 8) -> list[tuple[str, Rendered]]:
    """Each request: a new header of 20-120 tokens, one of `docs` documents of 400-800 tokens, a question."""
    rng = np.random.default_rng(seed)
    documents = [rng.integers(1000, 30_000, rng.integers(400, 800)) for _ in range(docs)]
    trace = []
    for i in range(requests):
        header = rng.integers(5, 1000, rng.integers(20, 120))
        doc = documents[int(rng.zipf(1.5)) % docs]
        question = rng.integers(5, 1000, 30)
        tokens = np.concatenate([header, doc, question]).astype(np.int32)
        trace.append((f"s{i}", Rendered(tokens, (0, len(header), len(header) + len(doc)))))
    return trace


TRACE = moved_documents()
REF = reference(TRACE, FleetConfig(pool_tokens=1))
CONFIG = FleetConfig(pool_tokens=REF.distinct_tokens // 2)


@pytest.fixture(scope="module")
def results():
    return {(r.replicas, r.policy): r for r in run_fleet(TRACE, [1, 2, 3, 4], POLICIES, CONFIG, REF)}


def test_content_routing_reuses_near_the_ceiling_and_above_load_balancing(results):
    for n in (2, 3, 4):
        perfect, content, p2c = (results[n, p].reuse for p in ("perfect", "content", "p2c"))
        assert perfect >= content >= p2c, (n, perfect, content, p2c)
        assert perfect - content < 0.05
    assert results[4, "content"].reuse > results[4, "p2c"].reuse + 0.05


def test_one_replica_is_one_replica_whatever_the_policy(results):
    assert len({results[1, p].computed_tokens for p in POLICIES}) == 1


def test_reuse_and_shares_add_up(results):
    for (n, policy), r in results.items():
        assert 0 <= r.reuse <= 1 and r.prompt_tokens == sum(len(t.token_ids) for _, t in TRACE)
        assert sum(r.requests_per_replica) == r.requests == len(TRACE)
        assert len(r.requests_per_replica) == (1 if policy == "perfect" else n)
        assert 1 / len(r.requests_per_replica) <= r.max_share <= 1


def test_the_reference_is_the_ceiling(results):
    assert results[4, "perfect"].computed_tokens >= REF.computed_tokens
    assert results[1, "perfect"].computed_tokens == results[1, "content"].computed_tokens


@settings(max_examples=10, deadline=None, derandomize=True)
@given(seed=st.integers(0, 1000), n=st.integers(1, 5), policy=st.sampled_from(POLICIES))
def test_any_trace_keeps_reuse_in_range(seed, n, policy):
    trace = moved_documents(seed, requests=25, docs=3)
    r = simulate(trace, policy, n, CONFIG, interval_s=0.01)
    assert 0 <= r.reuse <= 1 and sum(r.requests_per_replica) == 25


def test_an_unknown_policy_is_named():
    with pytest.raises(ValueError, match="unknown policy 'random'"):
        simulate(TRACE, "random", 2, CONFIG, interval_s=0.01)


def test_the_cli_prints_the_table_and_json(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    with path.open("w") as f:
        for session, r in TRACE[:40]:
            f.write(
                json.dumps({"session": session, "token_ids": r.token_ids.tolist(), "segments": list(r.segment_starts)})
                + "\n"
            )
    assert main(["bench", "fleet", str(path), "--replicas", "1,2", "--policies", "content", "p2c"]) == 0
    out = capsys.readouterr().out
    assert "| replicas" in out and "content" in out and "p2c" in out
    assert main(["bench", "fleet", str(path), "--replicas", "2", "--json", "--pool-tokens", "500"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["pool_tokens"] == 500 and {r["policy"] for r in j["results"]} == set(POLICIES)
    with pytest.raises(SystemExit):
        main(["bench", "fleet", str(path), "--replicas", "0,2"])


def test_ttft_is_the_queue_wait_plus_the_own_prefill():
    """Requests arriving all at once wait for every computed token before theirs; requests far apart
    wait for none, so each TTFT is its own prefill, at the replica's rate."""
    config = FleetConfig(pool_tokens=REF.distinct_tokens, tokens_per_s=10_000.0)
    for interval in (0.0, 1e6):
        replica = SimReplica("r0", config.pool_tokens, config)
        computed = [
            replica.serve(i * interval, t.token_ids.astype(np.int64), t.segment_starts)
            for i, (_, t) in enumerate(TRACE[:20])
        ]
        want = np.cumsum(computed) if interval == 0 else np.array(computed, float)
        assert np.allclose(replica.ttfts, want / config.tokens_per_s), interval
    r = simulate(TRACE[:20], "p2c", 1, config, interval_s=0.0)
    assert np.isclose(r.ttft_p95_s, np.percentile(np.cumsum(computed) / 1e4, 95))


def test_perfect_computes_at_the_fleets_rate(results):
    """perfect is one queue with N replicas' rate: it waits no longer than a fleet of N queues."""
    for n in (2, 4):
        assert results[n, "perfect"].ttft_p50_s <= results[n, "p2c"].ttft_p50_s


def test_the_skewed_trace_keeps_the_busiest_replica_within_the_share_bound():
    """The skewed pattern over shipped MuSiQue: at N = 2 the content router gives no replica more
    than 1.25 x 1/N of the work (prompt tokens computed + decoded), and the work adds up."""
    from irminsul.research.workloads.builders import build_source
    from irminsul.research.workloads.patterns import apply_pattern
    from irminsul.research.workloads.render import render_trace

    requests = apply_pattern("skewed", build_source("musique", n=40))
    assert len({r.session for r in requests}) < 40  # (a heavy tail: some sessions never come back)
    trace = list(render_trace(requests, "deepseek"))
    ref = reference(trace, FleetConfig(pool_tokens=1))
    config = FleetConfig(pool_tokens=ref.distinct_tokens // 2)
    r = simulate(trace, "content", 2, config, ref.interval_s(len(trace), 2, config))
    assert r.max_share <= 0.625, r
    assert sum(r.work_per_replica) == r.computed_tokens + r.requests * config.decode_tokens
