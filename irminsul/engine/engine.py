"""The engine: the step loop over a scheduler, a model runner and an output processor.

    Engine.step():  Scheduler.schedule()      admission, rows, preemption, the prefill budget
                                              (it owns the KV manager: irminsul/kvcache/)
                 -> ModelRunner.execute()     one forward pass over the batch -> logits
                 -> OutputProcessor.process() sampling, stops, detokenization, log-probs, grammars
                 -> Scheduler.finish()        finished sequences' rows go to the cache

A step takes any mix of sequences: those still in prefill contribute their next pending positions
(the ones the cache plan left to compute, in increasing order, at most `max_prefill_tokens` in
all), those decoding contribute their last token; each attends only to the rows its slot table
names. Besides the loop, whole-request helpers for offline use: `add` + `run` (one request
alone), `score` (teacher-forced log-probs) and `publish` (a document's rows into the shared
namespace). Engines are built by `build_engine` (build.py) from an `EngineConfig` (config.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from irminsul.engine.config import EngineConfig
from irminsul.engine.model_runner import ModelRunner, ScheduledBatch
from irminsul.engine.output import OutputProcessor
from irminsul.engine.sampling import SamplingParams, request_seed
from irminsul.engine.scheduler import Scheduler
from irminsul.engine.sequence import Sequence
from irminsul.errors import RequestError
from irminsul.kvcache.caches import ChunkNaming
from irminsul.kvcache.journal import ChunkJournal
from irminsul.kvcache.manager import KVCacheManager, PoolBusy, PoolFull  # noqa: F401 (PoolBusy: for callers)
from irminsul.kvcache.pool import LatentPool
from irminsul.kvcache.radix import RadixStats
from irminsul.kvcache.recompute import Recompute
from irminsul.kvcache.registry import ChunkStore
from irminsul.model.tokenizer import Tokenizer


class ScoringCancelled(Exception):
    """`Engine.score` stopped between two passes: its `cancelled` said the request went away."""


class QueuedLoad(NamedTuple):
    running: int  # sequences admitted and running
    tokens: int  # prompt tokens to compute before a new request's


@dataclass(frozen=True)
class StepOutput:
    seq: Sequence
    token: int | None  # the token sampled this step (None: still in prefill, or finished without one)
    text: str  # output text that became safe to show with this step
    finished: bool


class Engine:
    def __init__(
        self, model, tokenizer: Tokenizer, config: EngineConfig, pool: LatentPool, registry: ChunkStore | None = None
    ):
        """Build engines with `build_engine` (it sizes the pool). `pool`: the latent pool, perhaps
        another engine's. `registry`: the content registry the cache runs over (see `KVCacheManager`)."""
        self.model, self.tokenizer, self.engine_config = model, tokenizer, config
        self.config = cfg = model.config
        self.pool = pool
        self.kv = KVCacheManager(config.cache, pool, cfg.num_hidden_layers, registry)
        self.runner = ModelRunner(model, pool, config.compile_decode)
        recompute = None
        if self.kv.recompute_ratio:
            if not self.runner.supports_recompute:
                raise RequestError(f"recompute_ratio (pic+r) is not available for {cfg.model_type} yet")
            recompute = Recompute(self.kv, self.runner.latents, cfg.kv_lora_rank)
        self.eos_ids: frozenset[int] = frozenset(
            t for t in (*cfg.eos_token_ids, tokenizer.eos_token_id) if t is not None
        )
        self.output = OutputProcessor(tokenizer, cfg.vocab_size, self.eos_ids, cfg.max_position_embeddings)
        self.scheduler = Scheduler(
            self.kv, config.max_prefill_tokens, config.max_running_requests, config.decode_slowdown, recompute
        )

    @property
    def reuse(self) -> str:
        return self.kv.mode

    @property
    def stale_keys(self) -> bool:
        """`naive` reads each key at the position it was computed at (the paper's stale-`k_r` baseline)."""
        return self.kv.mode == "naive"

    @property
    def max_prefill_tokens(self) -> int:
        return self.scheduler.max_prefill_tokens

    @property
    def grammars(self):
        return self.output.grammars

    # -- requests ---------------------------------------------------------------------------

    def validate_prompt(self, tokens: list[int], room: int = 1) -> None:
        """Token ids in the vocabulary, and `room` positions left after them in the context (a prompt
        needs one for its first output token; scoring's inputs need none)."""
        if not tokens:
            raise RequestError("the prompt is empty; send at least one token")
        vocab = self.config.vocab_size
        arr = np.asarray(tokens)
        if arr.dtype.kind not in "iu":
            raise RequestError("token ids must be integers")
        bad = np.flatnonzero((arr < 0) | (arr >= vocab))
        if len(bad):
            i = int(bad[0])
            raise RequestError(f"token id {tokens[i]} at index {i} is outside the vocabulary [0, {vocab})")
        limit = self.config.max_position_embeddings
        if len(tokens) + room > limit:
            raise RequestError(
                f"the prompt has {len(tokens)} tokens but the model's context is {limit}; "
                f"shorten it to at most {limit - room} tokens"
            )

    def new_sequence(
        self,
        tokens: list[int],
        params: SamplingParams,
        segment_starts: list[int] | None = None,
        tenant: str | None = None,
        matcher=None,
        leader: Sequence | None = None,
    ) -> Sequence:
        """A validated request, not yet admitted (it holds no rows). `matcher`: the constraint's
        grammar state, compiled beforehand (`grammars.matcher`) so the caller's thread pays for it;
        compiled here when not given. `leader`: another choice of the same prompt, queued before
        this one; this one shares the leader's prompt rows (n > 1 costs one prefill)."""
        tokens = [int(t) for t in tokens]
        self.validate_prompt(tokens)
        vocab = self.config.vocab_size
        if bad := [t for t, _ in params.logit_bias if not 0 <= t < vocab]:
            raise RequestError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if bad := [t for t in params.stop_token_ids if not 0 <= t < vocab]:  # (it could never stop the output)
            raise RequestError(f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if params.constraint is not None and matcher is None:
            matcher = self.grammars.matcher(params.constraint, tenant)
        if leader is not None and (leader.tokens[: leader.prompt_len] != tokens or leader.tenant != tenant):
            raise ValueError("a leader must be a choice of the same prompt, for the same tenant")
        return Sequence(
            tokens=tokens,
            prompt_len=len(tokens),
            params=params,
            segment_starts=segment_starts,
            tenant=tenant,
            seed=request_seed(params.seed),
            matcher=matcher,
            detok=self.tokenizer.decode_stream(params.skip_special_tokens),
            leader=leader,
        )

    def add_request(self, seq: Sequence) -> None:
        """Queue a sequence; `step` admits it when the pool has room."""
        self.scheduler.add(seq)

    def abort(self, seq: Sequence) -> None:
        self.scheduler.abort(seq)
        self.output.forget(seq)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def stats(self) -> dict:
        return self.scheduler.stats()

    # -- what a server or a fleet replica reads of the engine -------------------------------

    def on_admit(self, callback: Callable[[Sequence], None]) -> None:
        """Tell `callback` of every admission (again after a preemption)."""
        self.scheduler.on_admit.append(callback)

    @property
    def kv_rows(self) -> int:
        """The most rows one request can hold (prompt + output; slot 0 is reserved)."""
        return self.kv.max_rows

    def is_waiting(self, seq: Sequence) -> bool:
        """Queued and not admitted (it holds no rows)."""
        return seq in self.scheduler.waiting

    @property
    def running_count(self) -> int:
        return len(self.scheduler.running)

    def abort_running(self) -> list[Sequence]:
        """Abort every running sequence (their rows go back, none is cached); the ones aborted."""
        running = list(self.scheduler.running)
        for seq in running:
            self.abort(seq)
        return running

    def queued_load(self) -> QueuedLoad:
        """Requests running, and the prompt tokens the engine will compute before a new request's:
        the running ones' pending positions and the queued ones' (a chunk several share, once)."""
        s = self.scheduler
        pending = sum(len(q.pending) for q in s.running)
        return QueuedLoad(len(s.running), self.kv.queued_tokens(list(s.waiting)) + pending)

    def prefetch(self, tokens: list[int], segment_starts: list[int] | None, tenant: str | None) -> int:
        """Read a prompt's chunks from the store's lower tiers ahead of its admission (any thread)."""
        return self.kv.prefetch(tokens, segment_starts, tenant)

    @property
    def journal(self) -> ChunkJournal | None:
        """The chunks the pool holds, for a fleet router to follow (None: nothing is cached)."""
        return self.kv.journal

    @property
    def chunk_naming(self) -> ChunkNaming | None:
        """How the cache fingerprints chunks, for a fleet router (None: nothing is cached)."""
        return self.kv.naming

    @property
    def prefix_cache_stats(self) -> RadixStats | None:
        """The radix tree's (None: nothing is cached)."""
        return self.kv.prefix_stats

    # -- the step loop ----------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """One scheduled step: every running sequence's new token and the text that became safe to
        show; finished sequences' rows go to the cache."""
        batch, failed = self.scheduler.schedule()
        out = [StepOutput(seq, None, self.output.delta(seq), True) for seq in failed]
        if batch is None:
            return out
        t = time.perf_counter()
        new = self._execute(batch)
        self.scheduler.observe(time.perf_counter() - t, batch, decoded=any(x is not None for x in new))
        for seq, token in zip(batch.seqs, new):
            text = self.output.delta(seq)
            if seq.finished:
                self.scheduler.finish(seq)
            if token is not None or seq.finished:
                out.append(StepOutput(seq, token, text, seq.finished))
        return out

    def _execute(self, batch: ScheduledBatch) -> list[int | None]:
        """Forward + sample over a batch; appends the new token to each sequence that produced one."""
        logits = self.runner.execute(batch, stale_keys=self.stale_keys)
        for seq, take in zip(batch.seqs, batch.takes):
            if take is not None:
                self.scheduler.computed(seq)  # in-flight reuse: chunks whose rows now exist
        return self.output.process(batch.seqs, logits)

    # -- whole-request helpers (offline; the scheduler batches many) ------------------------

    def add(
        self,
        tokens: list[int],
        params: SamplingParams,
        segment_starts: list[int] | None = None,
        tenant: str | None = None,
    ) -> Sequence:
        """Validate and admit now (single-request use; `add_request` queues instead)."""
        seq = self.new_sequence(tokens, params, segment_starts, tenant)
        if self.scheduler.admit(seq):
            return seq
        if self.kv.waits_for(seq):
            raise PoolFull("a running request is computing this prompt's content; admit it through the scheduler")
        raise PoolFull(
            f"the KV pool ({self.pool.describe()}) cannot hold this request even "
            f"after evicting every cached row; raise kv_cache_gib or shorten the prompt"
        )

    def prefill(self, seq: Sequence) -> None:
        """Compute an admitted sequence's pending prompt rows, sampling nothing."""
        for _ in self._pending_pieces(seq):
            pass

    def _pending_pieces(self, seq: Sequence):
        """Compute a sequence's pending rows alone, at most max_prefill_tokens a pass; yields each
        pass's positions and final hidden states [len(positions), H]."""
        while seq.in_prefill:
            take = seq.take_pending(self.max_prefill_tokens)
            hidden, _ = self.runner.forward([seq], [take], stale_keys=self.stale_keys)
            self.scheduler.computed(seq)  # in-flight reuse: chunks whose rows now exist
            yield take, hidden

    def reserve(self, seqs: list[Sequence]) -> bool:
        """A slot for each decoding sequence's newest token (before `execute`); False if the pool
        cannot give them all."""
        return self.scheduler.reserve(seqs)

    def execute(self, seqs: list[Sequence], prefill_budget: int | None = None) -> list[int | None]:
        """One forward + sample over admitted sequences, outside the scheduler's loop (benchmarks,
        one request alone); the token each produced (None: still in prefill)."""
        return self._execute(self.scheduler.batch(seqs, prefill_budget))

    def run(self, seq: Sequence) -> Sequence:
        """Generate until an admitted sequence is done, alone; its rows then go to the cache."""
        while not seq.finished:
            if not self.reserve([seq]):
                self.finish(seq)
                raise PoolFull(f"the KV pool ({self.pool.describe()}) is full; raise kv_cache_gib")
            self.execute([seq])
        self.finish(seq)
        return seq

    def finish(self, seq: Sequence) -> None:
        """Hand the sequence's rows to the cache (registry and tree) and drop its own references."""
        self.scheduler.finish(seq)
        self.output.forget(seq)

    def close(self) -> None:
        """Drop everything the cache holds (its rows go back to the pool, which may be shared)."""
        self.kv.clear()

    @torch.inference_mode()
    def score(
        self,
        prompt: list[int],
        continuation: list[int],
        segment_starts: list[int] | None = None,
        tenant: str | None = None,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> tuple[torch.Tensor, Sequence]:
        """Teacher-forced log-probs [len(continuation), vocab] of continuation after prompt, computed
        at most max_prefill_tokens positions a pass. `cancelled` is asked before each pass (another
        thread may set what it reads): once it says so, the rows go back and ScoringCancelled is
        raised, so a scoring whose request went away stops holding the engine's thread."""
        if not continuation:
            raise RequestError("the continuation is empty; score needs at least one token")
        tokens = [int(t) for t in prompt] + [int(t) for t in continuation]
        try:  # (the positions read: every token but the continuation's last)
            self.validate_prompt(tokens[:-1], room=0)
        except RequestError as e:
            raise RequestError(f"scoring reads prompt + continuation but its last token: {e}") from None
        self.validate_prompt(list(continuation), room=0)
        if cancelled():
            raise ScoringCancelled("the scoring was cancelled before it started")
        seq = self.add(list(prompt), SamplingParams(max_tokens=1), segment_starts, tenant)
        n = len(prompt)
        try:
            # The plan covers the prompt; the continuation (all but its last token) is computed too.
            seq.tokens = tokens[:-1]
            seq.grow()
            extra = np.arange(n, len(tokens) - 1)
            if not self.scheduler.allocate(seq, extra):
                raise PoolFull("the KV pool cannot hold the continuation; raise kv_cache_gib")
            seq.extend_pending(extra)
            pieces = []
            for take, hidden in self._pending_pieces(seq):
                pieces.append(self.runner.logits(hidden[torch.as_tensor(take >= n - 1)]))
                if seq.in_prefill and cancelled():
                    raise ScoringCancelled("the scoring was cancelled between two passes")
        except BaseException:
            seq.finish_reason = "abort"  # (its rows go back; none is cached)
            self.finish(seq)
            raise
        seq.tokens = tokens
        seq.finish_reason = "stop"
        self.finish(seq)  # registers the rows that exist: every token but the last
        return torch.cat(pieces).log_softmax(-1), seq

    def publish(self, tokens: list[int], segment_starts: list[int] | None = None):
        """Precompute a document's rows in a fixed, trusted context (the document alone, from
        position 0) and register its chunks in the shared namespace, which every tenant searches
        after its own. Shared rows never depend on a stranger's prefix (HijackKV, docs/design.md §6)."""
        ids = [int(t) for t in tokens]
        self.validate_prompt(ids, room=0)  # (nothing is generated after it)
        if len(ids) > self.pool.n_slots - 1:
            raise RequestError(
                f"the document has {len(ids)} tokens but the KV pool holds {self.pool.describe()}; "
                f"raise kv_cache_gib or publish it in parts"
            )
        return self.kv.publish(
            np.asarray(ids, np.int64),
            segment_starts,
            lambda slots: self.runner.prefill(ids, slots, self.max_prefill_tokens, self.stale_keys),
        )
