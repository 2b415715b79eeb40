"""The scheduler against a scripted engine: streamed text, stop strings, the token budget, aborts."""

import queue
from types import SimpleNamespace

from irminsul.engine.sampling import SamplingParams
from irminsul.server.scheduler import Delta, Failed, Finished, Job, Scheduler


class ScriptedEngine:
    """Emits one character per step from a script; text cut at stop strings like the real engine."""

    def __init__(self, script: str):
        self.script, self.finished = script, []

    def add(self, tokens, params, segment_starts=None, tenant=None):
        stats = SimpleNamespace(prompt_tokens=len(tokens))
        return SimpleNamespace(tokens=list(tokens), params=params, out="", finish_reason=None, stats=stats,
                               output_ids=[], finished=False)

    def step(self, seqs):
        for seq in seqs:
            seq.out += self.script[len(seq.out)]
            seq.output_ids.append(0)
            if any(s in seq.out for s in seq.params.stop):
                seq.finish_reason = "stop"
            elif len(seq.out) >= seq.params.max_tokens:
                seq.finish_reason = "length"
            seq.finished = seq.finish_reason is not None
        return [0] * len(seqs)

    def output_text(self, seq):
        cut = min((seq.out.find(s) for s in seq.params.stop if s in seq.out), default=-1)
        return seq.out if cut < 0 else seq.out[:cut]

    def finish(self, seq):
        self.finished.append(seq)


def run(engine, jobs, budget=1000):
    sched = Scheduler(engine, max_running_tokens=budget, max_running_requests=8, max_queued_requests=8)
    sched.start()
    try:
        for job in jobs:
            sched.submit(job)
        events = {job.id: [] for job in jobs}
        for job in jobs:
            while not events[job.id] or not isinstance(events[job.id][-1], (Finished, Failed)):
                events[job.id].append(job.events.get(timeout=10))
        return sched, events
    finally:
        sched.stop()


def job(prompt_len=4, **params):
    events = queue.Queue()
    j = Job(tokens=[1] * prompt_len, params=SamplingParams(**params), emit=events.put)
    j.events = events  # what the scheduler emitted, in order
    return j


def test_stop_strings_are_never_streamed():
    engine = ScriptedEngine("hello wor" + "ld" * 20)
    j = job(max_tokens=30, stop=("wor",))
    _, events = run(engine, [j])
    deltas = "".join(e.text for e in events[j.id] if isinstance(e, Delta))
    final = events[j.id][-1]
    assert deltas == final.text == "hello " and final.finish_reason == "stop"
    assert engine.finished  # finish() called exactly once


def test_budget_admits_in_order_and_holds():
    engine = ScriptedEngine("x" * 50)
    jobs = [job(prompt_len=40, max_tokens=10) for _ in range(5)]  # 50 rows each, 120 allowed: 2 at a time
    sched, events = run(engine, jobs, budget=120)
    assert all(events[j.id][-1].finish_reason == "length" for j in jobs)
    assert sched.peak_running_tokens == 100 and sched.running_tokens == 0 and not sched.running
