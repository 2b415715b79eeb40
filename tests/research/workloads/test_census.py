import numpy as np
import pytest

from irminsul.research.workloads.census import Census, CensusConfig, covered, run_census
from irminsul.research.workloads.prefix import PrefixIndex


def _census(trace, window=4, sink=2):
    return run_census([(s, np.array(t, dtype=np.int32)) for s, t in trace], CensusConfig(window=window, sink=sink))


# window 4, sink 2; every count below is worked out by hand in the comments
TRACE = [
    ("s1", list(range(1, 13))),  # all 12 novel
    ("s1", list(range(1, 15))),  # prefix 12 (R1), 13 14 novel
    ("s2", [50, 51, 52, 5, 6, 7, 8, 9, 60]),  # 5..9 shifted, seen only in s1: cross 5; novel 4
    ("s2", [70, 5, 6, 7, 8, 50, 51, 52, 5]),  # 5..8 and 50 51 52 5 seen in s2 before: within 8; novel 1
    ("s3", [1, 2, 3, 100, 5, 6, 7, 8]),  # prefix 3; 5..8 cross 4; 100 novel
    ("s3", [1, 2, 3, 100, 5]),  # an exact prefix of R5: prefix 5
]


def test_hand_built_trace_per_request():
    rows = _census(TRACE).per_request
    got = [(r.prefix_tokens, r.within_tokens, r.cross_tokens, r.novel_tokens, r.oracle_tokens) for r in rows]
    assert got == [
        (0, 0, 0, 12, 0),
        (12, 0, 0, 2, 12),
        (0, 0, 5, 4, 5),  # shifted at positions 3..7, all past the sink
        (0, 8, 0, 1, 7),  # position 1 is under the sink (2): not in the oracle
        (3, 0, 4, 1, 7),
        (5, 0, 0, 0, 5),
    ]


def test_hand_built_trace_totals_and_json():
    result = _census(TRACE)
    j = result.to_json()
    assert (j["prompt_tokens"], j["prefix_tokens"], j["shifted_tokens"], j["novel_tokens"], j["oracle_tokens"]) == (
        57,
        20,
        17,
        20,
        36,
    )
    assert j["within_session"]["shifted_tokens"] == 8 and j["cross_session"]["shifted_tokens"] == 9
    assert j["requests"] == 6 and j["sessions"] == 3


def test_repeats_inside_one_request_and_short_requests_are_novel():
    result = _census([("a", [200] * 6), ("a", [201, 200, 200, 200, 200]), ("b", [5, 6, 7])])
    got = [(r.prefix_tokens, r.within_tokens, r.cross_tokens, r.novel_tokens) for r in result.per_request]
    assert got == [(0, 0, 0, 6), (0, 4, 0, 1), (0, 0, 0, 3)]


def test_shifted_needs_a_full_window():
    # the shared run 1 2 3 is shorter than the window: not found
    result = _census([("a", [1, 2, 3, 9, 9, 9]), ("b", [7, 1, 2, 3, 8])])
    assert result.per_request[1].novel_tokens == 5


def test_covered():
    flags = np.array([0, 0, 1, 0, 0], dtype=bool)  # n = 8, window 4: window 2 covers 2..5
    assert covered(flags, 8, 4).tolist() == [False, False, True, True, True, True, False, False]
    assert covered(np.zeros(0, bool), 3, 4).tolist() == [False] * 3


def _reference(trace, w, sink):
    """Brute force: LCP against every earlier request, windows against every earlier request."""
    out = []
    for i, (session, t) in enumerate(trace):
        prefix = 0
        for _, u in trace[:i]:
            k = 0
            while k < min(len(t), len(u)) and t[k] == u[k]:
                k += 1
            prefix = max(prefix, k)

        def wins(seq, w=w):
            return {tuple(seq[j : j + w]) for j in range(len(seq) - w + 1)}

        any_seen = set().union(*[wins(u) for _, u in trace[:i]]) if i else set()
        own_seen = set().union(*[wins(u) for s, u in trace[:i] if s == session] or [set()])
        within = cross = oracle_extra = 0
        for p in range(prefix, len(t)):
            cov = [tuple(t[j : j + w]) for j in range(max(0, p - w + 1), min(p, len(t) - w) + 1)]
            if any(c in own_seen for c in cov):
                within += 1
            elif any(c in any_seen for c in cov):
                cross += 1
            else:
                continue
            oracle_extra += p >= sink
        out.append((prefix, within, cross, len(t) - prefix - within - cross, prefix + oracle_extra))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_matches_brute_force_on_random_agent_like_traces(seed):
    rng = np.random.default_rng(seed)
    pool = [list(rng.integers(0, 6, rng.integers(3, 30))) for _ in range(6)]  # shared snippets
    trace, history = [], {}
    for _ in range(40):
        session = f"s{rng.integers(0, 4)}"
        base = history.get(session, []) if rng.random() < 0.7 else []
        head = list(rng.integers(0, 6, rng.integers(0, 5)))  # a varying header, sometimes empty
        body = base + pool[rng.integers(0, len(pool))] + list(rng.integers(0, 6, rng.integers(0, 6)))
        history[session] = body
        trace.append((session, head + body if rng.random() < 0.5 else body))
    result = _census(trace, window=3, sink=2)
    got = [
        (r.prefix_tokens, r.within_tokens, r.cross_tokens, r.novel_tokens, r.oracle_tokens) for r in result.per_request
    ]
    assert got == _reference(trace, 3, 2)


@pytest.mark.parametrize("block", [1, 3, 64])
def test_prefix_index_matches_brute_force(block):
    rng = np.random.default_rng(block)
    index, seqs = PrefixIndex(block), []
    for _ in range(200):
        if seqs and rng.random() < 0.7:
            base = seqs[rng.integers(0, len(seqs))]
            s = base[: rng.integers(0, len(base) + 1)] + list(rng.choice([0, 1, 256, 65536], rng.integers(0, 20)))
        else:
            s = list(rng.choice([0, 1, 256, 65536], rng.integers(0, 40)))
        ref = max(
            (next((k for k in range(min(len(o), len(s))) if o[k] != s[k]), min(len(o), len(s))) for o in seqs),
            default=0,
        )
        arr = np.array(s, dtype=np.int32)
        assert index.match(arr) == ref
        assert index.add(arr) == ref
        seqs.append(s)


def test_streaming_add_returns_rows():
    c = Census(CensusConfig(window=2, sink=0))
    assert c.add("x", np.array([1, 2, 3])).novel_tokens == 3
    assert c.add("y", np.array([9, 2, 3])).cross_tokens == 2
