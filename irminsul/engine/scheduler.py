"""Continuous batching inside the engine, for the offline `LLM` and the server alike (in the spirit of
nano-vllm's and mini-sglang's schedulers).

Every `step()`:

1. admit waiting sequences in arrival order while the running cap allows and the engine can give
   them rows (`Engine.admit`: the cache plan, shared slots for reused rows, fresh ones for the rest,
   evicting cached rows nobody uses). A sequence whose content a running sequence is computing
   right now waits for it (in-flight reuse), and so does everything behind it;
2. give every decoding sequence a slot for its newest token; when the pool cannot, preempt the
   most recently admitted sequence (its rows are freed, it goes back to the front of the queue
   and is recomputed, or partly reused, when admitted again) and try again;
3. run ONE `Engine.step` over every running sequence: prefill chunks together with one decode
   token for each sequence already past its prompt. The prefill chunk is at most
   `max_prefill_tokens`, and while sequences are decoding it is sized so that the step takes at
   most `decode_slowdown` times a decode-only step, so arriving prompts never stall the streams.
   The size is found by feedback, not a cost model (a prompt's late tokens attend to more rows, and
   a step that carries prefill has a fixed cost of its own): it shrinks by 30% after a step over
   80% of the limit and grows by 10% after one under it (never below MIN_CHUNK); the decode-only
   step time is a moving average, refreshed by one decode-only step in 16 while prompts are waiting;
4. report each sequence's new text and finish those that are done.

Nothing here is thread-safe: one thread drives a scheduler (the server runs it on a worker thread).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from irminsul.engine.engine import Engine
from irminsul.engine.sequence import Sequence

log = logging.getLogger("irminsul.engine")
# a step beside decoding carries at least this many prompt positions: such a step runs the engine's
# eager pass while decode-only steps may run the compiled one, so its fixed cost alone can reach the
# limit, and a smaller chunk would buy the streams almost nothing while the prompts starve
# (`python benchmarks/bench_admission.py`: at least 1 position, a burst's TTFT p50 13 s; 32, 5.6 s)
MIN_CHUNK = 32.0


@dataclass(frozen=True)
class StepOutput:
    seq: Sequence
    token: int | None  # the token sampled this step (None: still in prefill, or finished without one)
    text: str  # output text that became safe to show with this step
    finished: bool


class Scheduler:
    def __init__(self, engine: Engine, max_running_requests: int = 256,
                 on_admit: Callable[[Sequence], None] | None = None, decode_slowdown: float | None = 2.0):
        if decode_slowdown is not None and not decode_slowdown > 1:
            raise ValueError(f"decode_slowdown={decode_slowdown} must be > 1 (or None: no limit)")
        self.engine = engine
        self.max_running_requests = max_running_requests
        self.on_admit = on_admit  # told of every admission (a preempted sequence is admitted again)
        self.decode_slowdown = decode_slowdown
        self._decode_s: float | None = None  # moving average of a decode-only step's seconds
        self._chunk = 64.0  # prompt positions a step beside decoding carries (adapted, see step 3)
        self._steps = 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._shown: dict[int, int] = {}  # characters of output text already reported, per sequence

    def stats(self) -> dict:
        """The pool and the queue now: bytes the pool holds and can hold, bytes the cache holds
        (counted once however many sequences and entries share them), sequences running and waiting."""
        pool = self.engine.pool
        return {"kv_pool_bytes_used": pool.used_bytes, "kv_pool_bytes_capacity": pool.capacity_bytes,
                "cached_bytes": len(self.engine.cache.cached_slots) * pool.bytes_per_slot,
                "running_sequences": len(self.running), "waiting_sequences": len(self.waiting)}

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is; a running one gives its rows back."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            seq.finish_reason = seq.finish_reason or "abort"  # it holds no rows yet; it is done all the same
        elif seq in self.running:
            self.running.remove(seq)
            seq.finish_reason = "abort"
            self.engine.finish(seq)
        self._shown.pop(seq.id, None)

    def step(self) -> list[StepOutput]:
        out = self._admit()
        if not self.running:
            return out
        out += self._reserve()
        if not self.running:
            return out
        prefill = sum(len(s.pending) for s in self.running)
        budget = self._prefill_budget(prefill)
        t = time.perf_counter()
        new = self.engine.step(self.running, budget)
        self._observe(time.perf_counter() - t, min(prefill, budget), decoding=any(x is not None for x in new))
        for seq, token in zip(list(self.running), new):
            text = self.engine.streamable(seq)
            shown = self._shown.get(seq.id, 0)
            delta, self._shown[seq.id] = text[shown:], max(shown, len(text))
            if seq.finished:
                self.running.remove(seq)
                self.engine.finish(seq)
                self._shown.pop(seq.id, None)
            if token is not None or seq.finished:
                out.append(StepOutput(seq, token, delta, seq.finished))
        return out

    def _prefill_budget(self, pending: int) -> int:
        """Prompt positions this step may compute (see the module docstring, step 3)."""
        decoding = any(not s.in_prefill for s in self.running)
        if not pending or not decoding or self.decode_slowdown is None or self._decode_s is None:
            return self.engine.max_prefill_tokens
        self._steps += 1
        if self._steps % 16 == 0:
            return 0  # a decode-only step now and then: decoding slows as contexts grow, re-measure it
        return int(min(self.engine.max_prefill_tokens, self._chunk))

    def _observe(self, seconds: float, prefill_tokens: int, decoding: bool) -> None:
        if not prefill_tokens:
            if decoding:
                self._decode_s = seconds if self._decode_s is None else 0.8 * self._decode_s + 0.2 * seconds
        elif decoding and self._decode_s is not None and self.decode_slowdown is not None:
            # aim 20% under the limit: the step times scatter around the aim, and the limit is for most
            over = seconds > 0.8 * self.decode_slowdown * self._decode_s
            self._chunk = min(self.engine.max_prefill_tokens, max(MIN_CHUNK, self._chunk * (0.7 if over else 1.1)))

    def _admit(self) -> list[StepOutput]:
        failed: list[StepOutput] = []
        while self.waiting and len(self.running) < self.max_running_requests:
            seq = self.waiting[0]
            if self.engine.admit(seq):
                self.waiting.popleft()
                self.running.append(seq)
                if self.on_admit is not None:
                    self.on_admit(seq)
                continue
            if self.running:
                break  # NOTE: strict arrival order, so a large request is never starved by small ones
            # Nothing runs, so nothing holds rows but unused cache, which admission may evict: it
            # can never fit.
            self.waiting.popleft()
            seq.finish_reason = "abort"
            seq.error = (f"the request needs more rows than the KV pool holds "
                         f"({self.engine.pool.describe()}); raise kv_cache_gib")
            failed.append(StepOutput(seq, None, "", True))
        return failed

    def _reserve(self) -> list[StepOutput]:
        """Slots for every decoding sequence, preempting the newest admitted until they fit."""
        failed: list[StepOutput] = []
        while self.running and not self.engine.reserve(self.running):
            victim = self.running.pop()  # the most recently admitted
            if not self.running:  # alone and still no room: the pool is too small for it
                victim.finish_reason = "length"
                self.engine.finish(victim)
                failed.append(StepOutput(victim, None, self.engine.streamable(victim)[self._shown.pop(victim.id, 0):],
                                         True))
                log.warning("request %d stopped early: the KV pool is full", victim.id)
                break
            self.engine.preempt(victim)
            self.waiting.appendleft(victim)
            log.info("preempted request %d to make room (%d running)", victim.id, len(self.running))
        return failed
