"""The recovery benchmark's replay agrees with the engine's own stats on the same trace."""

import numpy as np
import pytest

from irminsul.research.workloads.recovery import RecoveryConfig, replay_planner
from irminsul.research.workloads.render import Rendered

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from irminsul.model.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("agree") / "v2", num_hidden_layers=1, first_k_dense_replace=1)


def _trace():
    """agent_meta-like: a varying header, then shared documents in shifting orders, then a question."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 250, int(rng.integers(150, 400))).tolist() for _ in range(4)]
    out = []
    for i in range(6):
        header = rng.integers(0, 250, int(rng.integers(5, 60))).tolist()
        order = rng.permutation(4)
        segs = [header] + [docs[k] for k in order[: 2 + i % 3]] + [rng.integers(0, 250, 20).tolist()]
        out.append(segs)
    return out


@pytest.mark.parametrize("mode, strategy", [("prefix", "prefix"), ("pic", "cdc+s1"), ("pic", "cdc+s2")])
def test_replay_equals_engine_stats(tiny, mode, strategy):
    from irminsul import LLM, Segments
    from irminsul.model.identity import checkpoint_id

    trace = _trace()
    llm = LLM(tiny, reuse=mode)
    engine = []
    for segs in trace:
        prompt = Segments(segs) if strategy == "cdc+s2" else [t for s in segs for t in s]
        st = llm.generate(prompt, max_tokens=1).stats
        engine.append((st.prompt_tokens, st.prefix_tokens, st.reused_tokens, st.s1_tokens, st.carve_out_tokens))
    rendered = [
        (
            "s",
            Rendered(
                np.array([t for s in segs for t in s], dtype=np.int32),
                tuple(np.cumsum([0] + [len(s) for s in segs[:-1]]).tolist()),
            ),
        )
        for segs in trace
    ]
    config = RecoveryConfig(model_id=checkpoint_id(tiny))
    replay = []
    for i in range(1, len(rendered) + 1):  # cumulative replays give per-request numbers
        r = replay_planner(rendered[:i], strategy, config)
        cur = (r.prompt_tokens, r.prefix_tokens, r.recovered_tokens, r.s1_tokens, r.carve_out_tokens)
        replay.append(cur)
        engine_cum = tuple(sum(e[k] for e in engine[:i]) for k in range(5))
        assert cur == engine_cum, (i, cur, engine_cum)
    assert replay[-1][2] > 0 or strategy == "prefix"
