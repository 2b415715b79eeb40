import numpy as np

from irminsul.research.workloads.recovery import STRATEGIES, RecoveryConfig, replay_fixed_blocks, run_recovery
from irminsul.research.workloads.render import Rendered


def _rand(n, seed):
    return np.random.default_rng(seed).integers(0, 50_000, n).astype(np.int32)


def _trace(*seqs):
    return [
        (
            f"s{i}",
            Rendered(np.concatenate(s).astype(np.int32), tuple(np.cumsum([0] + [len(x) for x in s[:-1]]).tolist())),
        )
        for i, s in enumerate(seqs)
    ]


def test_fixed_blocks_hit_only_at_aligned_offsets_with_carve_out():
    a, b, c, d = _rand(128, 1), _rand(256, 2), _rand(256, 3), _rand(128, 4)
    trace = _trace([a, b], [c, b], [d, b[:128], _rand(1, 5)])
    r = replay_fixed_blocks(trace)
    # request 2: b's blocks at 256 (first seen at 128) and 384 (first seen at 256): 128 + 127
    #            (the last prompt token is always computed);
    # request 3: b[:128] at 128, first seen at 128: all 128 (it ends at 256, before the last token)
    assert r.recovered_tokens == 128 + 127 + 128
    assert r.prefix_tokens == 0 and r.prompt_tokens == 384 + 512 + 257
    shifted = replay_fixed_blocks(_trace([a, b], [_rand(27, 6), b, _rand(1, 7)]))
    assert shifted.recovered_tokens == 0  # a 27-token shift hides every aligned block


def test_fixed_blocks_sink_carve_out_on_source_rows():
    b, d = _rand(256, 2), _rand(128, 4)
    r = replay_fixed_blocks(_trace([b], [d, b, _rand(1, 9)]))
    # b[0:128] was stored at 0: its first 32 rows sit under the sink at the source
    assert r.recovered_tokens == (128 - 32) + 128 and r.carve_out_tokens == 32


def test_strategies_on_a_shifted_body():
    body = [_rand(300, 10 + k) for k in range(4)]  # four "documents"
    seqs = [
        [_rand(5 + 17 * i, 100 + i), *np.random.default_rng(i).permutation(np.array(body, dtype=object))]
        for i in range(6)
    ]
    trace = _trace(*[[np.asarray(x, dtype=np.int32) for x in s] for s in seqs])
    res = run_recovery(trace)
    j = res.to_json()
    assert set(j["strategies"]) == set(STRATEGIES)
    for key in ("prompt_tokens", "prefix_tokens", "oracle_tokens"):
        assert key in j
    st = {k: v["recovered_tokens"] for k, v in j["strategies"].items()}
    assert st["prefix"] == 0 and j["prefix_tokens"] == 0
    assert st["cdc+s2"] >= st["cdc+s1"] >= st["cdc"] > st["fixed128"]
    # with segments every document chunks the same way: all of it is found after the first two
    assert res.of_oracle(res.strategies["cdc+s2"]) > 0.95
    for s in res.strategies.values():
        assert s.prefix_tokens + s.recovered_tokens + s.computed_tokens == s.prompt_tokens


def test_exact_repeat_is_prefix():
    x = _rand(400, 1)
    res = run_recovery(_trace([x], [x]), strategies=("prefix", "cdc+s1"))
    assert res.prefix_tokens == 399  # the last prompt token is always computed
    assert res.strategies["cdc+s1"].recovered_tokens == 0


def test_budget_is_respected():
    body = _rand(2000, 3)
    trace = _trace([_rand(3, 1), body], [_rand(4, 2), body])
    small = run_recovery(trace, strategies=("cdc+s1",), config=RecoveryConfig(budget_bytes=0))
    assert small.strategies["cdc+s1"].recovered_tokens == 0


def test_fixed_blocks_lru_budget_and_stored_tokens():
    a, b, c = _rand(128, 1), _rand(128, 2), _rand(128, 3)
    trace = _trace([a, b], [c, a, b, _rand(1, 4)])
    unbounded = replay_fixed_blocks(trace)
    # a was stored at 0: its first 32 rows fall under the sink at the source
    assert unbounded.stored_tokens == 3 * 128 and unbounded.recovered_tokens == (128 - 32) + 128
    one_block = replay_fixed_blocks(trace, RecoveryConfig(budget_bytes=128 * RecoveryConfig().bytes_per_token))
    assert one_block.stored_tokens == 128 and one_block.recovered_tokens == 128  # only b survived
