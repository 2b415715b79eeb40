"""Scoring (an echoed prompt's log-probs) runs max_prefill_tokens positions a pass and stops between
passes once its request has gone: the engine's thread is free again, the rows are back."""

import numpy as np
import pytest
import torch

from irminsul import LLM
from irminsul.engine.engine import ScoringCancelled


@pytest.fixture(scope="module")
def llm(tiny_dir):
    llm = LLM(tiny_dir)
    llm.engine.scheduler.max_prefill_tokens = 64
    return llm


def test_a_cancelled_scoring_stops_between_passes_and_gives_its_rows_back(llm, monkeypatch):
    engine = llm.engine
    prompt = np.random.default_rng(0).integers(0, 250, 1500).tolist()  # 24 passes of 64
    passes = []
    forward = engine.runner.forward
    monkeypatch.setattr(engine.runner, "forward", lambda *a, **k: passes.append(1) or forward(*a, **k))
    used = engine.stats()["kv_pool_bytes_used"]
    gone = False  # the client's state, as the thread that aborts the request would set it

    def cancelled() -> bool:
        nonlocal gone
        gone = gone or len(passes) == 2  # the client leaves during the second pass
        return gone

    with pytest.raises(ScoringCancelled):
        engine.score(prompt[:1], prompt[1:], cancelled=cancelled)
    assert len(passes) == 2
    assert engine.stats()["kv_pool_bytes_used"] == used and not engine.has_work
    with pytest.raises(ScoringCancelled):  # gone before it started: nothing is computed
        engine.score(prompt[:1], prompt[1:], cancelled=lambda: True)
    assert len(passes) == 2

    whole = engine.score(prompt[:1], prompt[1:300], cancelled=lambda: False)[0]  # the engine serves on
    assert len(passes) == 2 + 5 and torch.allclose(whole, llm.score(prompt[:1], prompt[1:300]))
