"""Decode steps run on one thread or all, whichever measured faster per batch-size class (engine/threads.py)."""

import torch

from irminsul import LLM
from irminsul.engine import threads as threads_module
from irminsul.engine.threads import TRIALS, StepThreads


def test_each_class_alternates_then_keeps_the_faster_and_measures_again(monkeypatch):
    st = StepThreads(most=4)
    cost = {1: 0.002, 4: 0.005}  # one thread is faster for one sequence
    for _ in range(2 * TRIALS):
        n = st.choose(1)
        st.observe(1, n, cost[n])
    assert st.chosen() == {1: 1}
    assert st.choose(1) == 1
    for _ in range(2 * TRIALS):  # a batch of 8 (class 8) is measured on its own, and there 4 threads win
        n = st.choose(7)
        st.observe(7, n, {1: 0.02, 4: 0.008}[n])
    assert st.chosen() == {1: 1, 8: 4}
    monkeypatch.setattr(threads_module, "RECHECK", 3)
    for _ in range(3):
        st.observe(1, 1, 0.002)
    assert 1 not in st.chosen()  # measured again
    assert StepThreads(most=1).choose(5) == 1  # one thread given: nothing to choose


def test_the_engine_decodes_on_the_chosen_threads_and_gives_prefill_all_of_them(tiny_dir):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(tiny_dir, compile_decode=False)
        seen = []
        runner = llm.engine.runner
        real = runner._execute

        def spy(batch, stale_keys):
            seen.append((batch.decode_only, torch.get_num_threads()))
            return real(batch, stale_keys)

        runner._execute = spy
        llm.generate([5, 6, 7, 8] * 10, max_tokens=2 * TRIALS + 4, ignore_eos=True)
        assert torch.get_num_threads() == 2  # restored after every step
        assert all(n == 2 for decode, n in seen if not decode)  # prefill: every thread
        decode = [n for d, n in seen if d]
        assert set(decode[: 2 * TRIALS]) == {1, 2}  # both measured
        assert runner.threads.chosen()[1] in (1, 2)
        assert set(decode[2 * TRIALS:]) == {runner.threads.chosen()[1]}  # then the faster kept
    finally:
        torch.set_num_threads(before)
