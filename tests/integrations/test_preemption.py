"""Preemption and aborts of requests with loaded rows, without a model: the connector's two sides driven
as vLLM drives them (test_connector.MiniEngine), every row checked against the true rows. The same in
vLLM for real, on the exact one-layer model: test_vllm_preemption.py."""

from types import SimpleNamespace

import numpy as np
import torch

from tests.integrations import require_vllm

require_vllm()

from vllm.v1.metrics.stats import PrefillStats  # noqa: E402

from tests.integrations.test_connector import BLOCK, MiniEngine, _ids  # noqa: E402


def _admit(engine: MiniEngine, tokens: list[int]):
    engine.n += 1
    r = SimpleNamespace(
        request_id=f"r{engine.n}",
        prompt_token_ids=tokens,
        num_computed_tokens=0,
        cache_salt=None,
        prefill_stats=PrefillStats(),
        num_preemptions=0,
    )
    engine.blocks[r.request_id] = [engine.free.pop(0) for _ in range(len(tokens) // BLOCK + 1)]
    engine.sched.get_num_new_matched_tokens(r, 0)
    r.prefill_stats.set(len(tokens), 0, 0)
    return r


def _preempt(engine: MiniEngine, r) -> None:
    """vLLM's _preempt_request: blocks freed, back to 0 computed tokens, then admitted again (other blocks)."""
    engine.free += engine.blocks.pop(r.request_id)
    r.num_computed_tokens = 0
    r.num_preemptions += 1
    engine.blocks[r.request_id] = [engine.free.pop() for _ in range(len(r.prompt_token_ids) // BLOCK + 1)]
    engine.sched.get_num_new_matched_tokens(r, 0)


def _check_rows(engine: MiniEngine, r) -> None:
    rows = engine.slots(r.request_id, 0, len(r.prompt_token_ids))
    for layer, cache in enumerate(engine.caches):
        torch.testing.assert_close(
            cache.view(-1, engine.width)[rows], engine.true_rows(r.prompt_token_ids, layer), atol=1e-4, rtol=1e-4
        )


def _finish(engine: MiniEngine, r) -> None:
    engine.sched.request_finished(r, None)
    engine.free += engine.blocks.pop(r.request_id)


def _idle(engine: MiniEngine) -> dict:
    return {k: v for k, v in engine.sched.in_flight().items() if v}


def test_a_request_preempted_after_its_loads_loads_them_again(tmp_path):
    """Preempted after its rows were loaded (its blocks freed and given to another request), a request is
    planned again at readmission, loads the same rows into its new blocks, and ends with the true rows;
    preempted between the scheduler's hooks and the step's metadata, no load of it reaches the worker."""
    engine = MiniEngine(tmp_path)
    rng = np.random.default_rng(4)
    doc = _ids(rng, 600)
    engine.run(_ids(rng, 40) + doc)
    r = _admit(engine, _ids(rng, 75) + doc + _ids(rng, 8))
    loaded_before = engine.worker.loaded_rows
    while engine.worker.loaded_rows == loaded_before:  # up to the step that loads the document's rows
        engine.step([r])
    first = engine.worker.loaded_rows - loaded_before
    assert first > 400
    _preempt(engine, r)
    other = _admit(engine, _ids(rng, 200))  # (takes blocks the preempted request held)
    while engine.left(other):
        engine.step([other])
    _finish(engine, other)
    while engine.left(r):
        engine.step([r])
    assert engine.worker.loaded_rows - loaded_before >= 2 * first and engine.recomputed == 0
    _check_rows(engine, r)
    _finish(engine, r)
    # the scheduler planned a request's loads, then preempted it in the same step (a later request's
    # allocation took its blocks): the step's metadata must carry none of them
    r = _admit(engine, _ids(rng, 75) + doc + _ids(rng, 8))
    while not engine.sched.get_num_new_matched_tokens_running(r, r.num_computed_tokens):
        engine.step([r])
    assert engine.chunk(r) > 0 and engine.sched.pending  # loads planned into blocks...
    _preempt(engine, r)  # ...that are freed in the same step
    meta = engine.sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}, preempted_req_ids={r.request_id}))
    assert not meta.loads and not engine.sched.pending
    while engine.left(r):
        engine.step([r])
    _check_rows(engine, r)
    _finish(engine, r)
    assert _idle(engine) == {} and engine.keys_agree()


def test_an_aborted_request_leaves_nothing_in_flight(tmp_path):
    """Aborted with loads planned and not yet written, or mid-prefill after them: the connector forgets the
    request (plans, pending loads, pinned registry entries) and the next request loads the document."""
    engine = MiniEngine(tmp_path)
    rng = np.random.default_rng(5)
    doc = _ids(rng, 600)
    engine.run(_ids(rng, 40) + doc)
    for stop_after_loads in (False, True):
        r = _admit(engine, _ids(rng, 75) + doc + _ids(rng, 8))
        while not engine.sched.get_num_new_matched_tokens_running(r, r.num_computed_tokens):
            engine.step([r])
        if stop_after_loads:
            engine.step([r])  # the loads are written; the prefill goes on
            assert engine.sched.stats[r.request_id].loaded_tokens > 400
        else:
            engine.chunk(r)  # planned, not yet in any step's metadata
        assert engine.sched.in_flight()["pinned_entries"] > 0
        _finish(engine, r)  # vLLM's abort: request_finished, its blocks freed
        assert _idle(engine) == {}, engine.sched.in_flight()
    assert engine.run(_ids(rng, 75) + doc).loaded_tokens > 400
    assert _idle(engine) == {} and engine.keys_agree()
