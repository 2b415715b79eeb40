"""Continuous batching (in the spirit of nano-vllm's and mini-sglang's schedulers). The scheduler owns
the KV manager: admission, the reservation of rows, preemption and the prefill budget are here.

Every step (`schedule`):

1. admit waiting sequences in arrival order while the running cap allows and the KV manager can
   give them rows (the cache plan, shared slots for reused rows, fresh ones for the rest, evicting
   cached rows nobody uses). A sequence whose content a running sequence is computing right now
   waits for it (in-flight reuse), and so does everything behind it;
2. give every decoding sequence a slot for its newest token; when the pool cannot, preempt the
   most recently admitted sequence (its rows are freed, it goes back to the front of the queue
   and is recomputed, or partly reused, when admitted again) and try again;
3. hand the engine ONE batch of every running sequence: prefill chunks together with one decode
   token for each sequence already past its prompt. The prefill chunk is at most
   `max_prefill_tokens`, and while sequences are decoding it is sized so that the step takes at
   most `decode_slowdown` times a decode-only step, so arriving prompts never stall the streams.
   The size is found by feedback (`observe`), not a cost model (a prompt's late tokens attend to
   more rows, and a step that carries prefill has a fixed cost of its own): it shrinks by 30% after
   a step over 80% of the limit and grows by 10% after one under it (never below MIN_CHUNK); the
   decode-only step time is a moving average, refreshed by one decode-only step in 16 while
   prompts are waiting.

After the step the engine hands back the finished sequences (`finish`), whose rows go to the cache.
Nothing here is thread-safe: one thread drives a scheduler (the server runs it on a worker thread).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

import numpy as np

from irminsul.engine.model_runner import ScheduledBatch
from irminsul.engine.sequence import Sequence
from irminsul.kvcache.manager import KVCacheManager
from irminsul.kvcache.recompute import Recompute
from irminsul.model.attention import EMPTY_SLOT

log = logging.getLogger("irminsul.engine")
# a step beside decoding carries at least this many prompt positions: such a step runs the engine's
# eager pass while decode-only steps may run the compiled one, so its fixed cost alone can reach the
# limit, and a smaller chunk would buy the streams almost nothing while the prompts starve
# (`python benchmarks/bench_admission.py`: at least 1 position, a burst's TTFT p50 13 s; 32, 5.6 s)
MIN_CHUNK = 32.0


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_prefill_tokens: int = 2048,
        max_running_requests: int = 256,
        decode_slowdown: float | None = 2.0,
        recompute: Recompute | None = None,
    ):
        """`recompute`: pic+r's choice of the reused rows each admitted sequence recomputes (None: none)."""
        if decode_slowdown is not None and not decode_slowdown > 1:
            raise ValueError(f"decode_slowdown={decode_slowdown} must be > 1 (or None: no limit)")
        self.kv = kv
        self.max_prefill_tokens = max_prefill_tokens
        self.max_running_requests = max_running_requests
        self.decode_slowdown = decode_slowdown
        self.recompute = recompute
        self.on_admit: list[Callable[[Sequence], None]] = []  # told of every admission (again after preemption)
        self._decode_s: float | None = None  # moving average of a decode-only step's seconds
        self._chunk = 64.0  # prompt positions a step beside decoding carries (adapted, see step 3)
        self._steps = 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

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
            self._free(seq)

    # -- one sequence's rows ----------------------------------------------------------------

    def admit(self, seq: Sequence) -> bool:
        """Plan the sequence against the cache and give it rows: shared slots for what it reuses,
        fresh ones for what it computes. False (holding nothing) when it must wait: a running
        sequence is computing some of its chunks right now, its leader is still computing their
        shared prompt, or the pool cannot hold it yet."""
        lead = seq.leader
        if lead is not None and lead.admitted and not lead.finished and lead.prompt_len == seq.prompt_len:
            if lead.in_prefill:
                return False
            seq.admit(self.kv.shared_admission(seq, lead))
        else:
            if self.kv.waits_for(seq):
                return False
            seq.admit(self.kv.admission(seq))
        try:
            if self.recompute is not None and seq.reuse_plan is not None:
                chosen = self.recompute.choose(seq)
                if chosen is None:
                    self._unadmit(seq)
                    return False
                if len(chosen):
                    self.kv.release_rows(seq.slots[chosen])
                    seq.recompute(chosen)
            if not self.allocate(seq, seq.pending):
                self._unadmit(seq)
                return False
        except BaseException:
            self._unadmit(seq)
            raise
        seq.leader = None  # admitted: it holds its own references now
        return True

    def allocate(self, seq: Sequence, positions: np.ndarray) -> bool:
        """Fresh rows for positions of an admitted sequence (rows it computes), evicting cached rows if
        needed; False (nothing taken) if the pool cannot give them."""
        if not len(positions):
            return True
        slots = self.kv.fresh_rows(positions, [seq.tenant])
        if slots is None:
            return False
        seq.place(positions, slots)
        return True

    def computed(self, seq: Sequence) -> None:
        """In-flight reuse: the chunks whose rows now exist go to the cache."""
        seq.registered = self.kv.computed(seq)

    def _free(self, seq: Sequence, cache: bool = True) -> None:
        """Every row the sequence holds goes back (its chunks to the cache first, with `cache`)."""
        try:
            self.kv.free(seq, cache)
        finally:
            seq.release()

    def _unadmit(self, seq: Sequence) -> None:
        """Undo admission: its plan's claims and every row it holds go back; nothing is cached."""
        self._free(seq, cache=False)

    def preempt(self, seq: Sequence) -> None:
        """Take every row from a running sequence; it keeps its tokens and is admitted again later,
        recomputing (or reusing) what it had. Chunks it already offered the cache stay there."""
        self._unadmit(seq)
        seq.stats.preempted += 1

    def finish(self, seq: Sequence) -> None:
        """A finished sequence's rows go to the cache (registry and tree) and its own references go."""
        if seq.finish_reason is None:
            seq.finish_reason = "abort"
        if seq in self.running:
            self.running.remove(seq)
        self._free(seq)

    # -- one step ---------------------------------------------------------------------------

    def schedule(self) -> tuple[ScheduledBatch | None, list[Sequence]]:
        """This step's batch (None: nothing runs), and the sequences that ended without running:
        ones the pool can never hold, and the last one left when even it cannot decode."""
        failed = self._admit()
        if self.running:
            failed += self._reserve()
        if not self.running:
            return None, failed
        pending = sum(len(s.pending) for s in self.running)
        return self.batch(self.running, self._prefill_budget(pending)), failed

    def batch(self, seqs: list[Sequence], prefill_budget: int | None = None) -> ScheduledBatch:
        """The positions each sequence computes in one step: the next pending prompt positions of those
        in prefill (at most `prefill_budget` in all, default max_prefill_tokens), the last token of
        those decoding. Decoding sequences need their slot first (`reserve`)."""
        budget = self.max_prefill_tokens if prefill_budget is None else min(prefill_budget, self.max_prefill_tokens)
        decode_only = not any(s.in_prefill for s in seqs)
        takes, prefill = [], 0
        for seq in seqs:
            if seq.in_prefill:
                take = seq.take_pending(budget) if budget > 0 else None
                if take is not None:
                    budget -= len(take)
                    prefill += len(take)
            else:  # decode: only the last token, whose row is not computed yet
                take = np.array([len(seq.tokens) - 1])
            takes.append(take)
        return ScheduledBatch(list(seqs), takes, prefill, decode_only)

    def reserve(self, seqs: list[Sequence]) -> bool:
        """A slot for each decoding sequence's newest token; False (nothing taken) if the pool cannot
        give them all."""
        need = []
        for seq in seqs:
            if not seq.in_prefill:
                seq.grow()
                if seq.slots[-1] == EMPTY_SLOT:
                    need.append(seq)
        if not need:
            return True
        positions = np.array([len(seq.tokens) - 1 for seq in need], np.int64)
        slots = self.kv.fresh_rows(positions, [seq.tenant for seq in need])
        if slots is None:
            return False
        for seq, position, slot in zip(need, positions, slots):
            seq.place(position[None], slot[None])
        return True

    def _prefill_budget(self, pending: int) -> int:
        """Prompt positions this step may compute (see the module docstring, step 3)."""
        decoding = any(not s.in_prefill for s in self.running)
        if not pending or not decoding or self.decode_slowdown is None or self._decode_s is None:
            return self.max_prefill_tokens
        self._steps += 1
        if self._steps % 16 == 0:
            return 0  # a decode-only step now and then: decoding slows as contexts grow, re-measure it
        return int(min(self.max_prefill_tokens, self._chunk))

    def observe(self, seconds: float, batch: ScheduledBatch, decoded: bool) -> None:
        """How long the step over `batch` took; `decoded`: some sequence decoded a token in it."""
        if not batch.prefill_tokens:
            if decoded:
                self._decode_s = seconds if self._decode_s is None else 0.8 * self._decode_s + 0.2 * seconds
        elif decoded and self._decode_s is not None and self.decode_slowdown is not None:
            # aim 20% under the limit: the step times scatter around the aim, and the limit is for most
            over = seconds > 0.8 * self.decode_slowdown * self._decode_s
            self._chunk = min(self.max_prefill_tokens, max(MIN_CHUNK, self._chunk * (0.7 if over else 1.1)))

    def _admit(self) -> list[Sequence]:
        failed: list[Sequence] = []
        while self.waiting and len(self.running) < self.max_running_requests:
            seq = self.waiting[0]
            if self.admit(seq):
                self.waiting.popleft()
                self.running.append(seq)
                for callback in self.on_admit:
                    callback(seq)
                continue
            if self.running:
                break  # NOTE: strict arrival order, so a large request is never starved by small ones
            # Nothing runs, so nothing holds rows but unused cache, which admission may evict: it
            # can never fit.
            self.waiting.popleft()
            seq.finish_reason = "abort"
            seq.error = (
                f"the request needs more rows than the KV pool holds ({self.kv.pool.describe()}); raise kv_cache_gib"
            )
            failed.append(seq)
        return failed

    def _reserve(self) -> list[Sequence]:
        """Slots for every decoding sequence, preempting the newest admitted until they fit."""
        failed: list[Sequence] = []
        while self.running and not self.reserve(self.running):
            victim = self.running.pop()  # the most recently admitted
            if not self.running:  # alone and still no room: the pool is too small for it
                victim.finish_reason = "length"
                self._free(victim)
                failed.append(victim)
                log.warning("request %d stopped early: the KV pool is full", victim.id)
                break
            self.preempt(victim)
            self.waiting.appendleft(victim)
            log.info("preempted request %d to make room (%d running)", victim.id, len(self.running))
        return failed

    def stats(self) -> dict:
        """The pool and the queue now: bytes the pool holds and can hold, bytes the cache holds
        (counted once however many sequences and entries share them), sequences running and waiting."""
        pool = self.kv.pool
        return {
            "kv_pool_bytes_used": pool.used_bytes,
            "kv_pool_bytes_capacity": pool.capacity_bytes,
            "cached_bytes": len(self.kv.cached_slots) * pool.bytes_per_slot,
            "running_sequences": len(self.running),
            "waiting_sequences": len(self.waiting),
        }
