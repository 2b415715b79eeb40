"""The engine: one latent pool, admission against the cache, batched forward steps, sampling.

A step takes any mix of sequences: those still in prefill contribute their next pending positions
(the ones the cache plan left to compute, in increasing order, at most `max_prefill_tokens` in
all), those decoding contribute their last token. One forward pass computes all of them, with one
attention call per layer and group (`irminsul/model/attention.py`); each sequence attends only to
the rows its slot table names.

Memory is the pool: a sequence holds one reference on each slot of its table, and so do the
cache's radix tree and registry. Admission and decoding take fresh slots, evicting cached content
nobody is using when the pool is short (`CacheReuse.make_room`); when even that is not enough the
scheduler preempts a running sequence (`preempt`), which is recomputed later.
"""

from __future__ import annotations

import logging
import math
import os

import numpy as np
import torch

from irminsul.engine.grammar import Grammars, reason
from irminsul.engine.pool import LatentPool
from irminsul.engine.reuse import make_reuse
from irminsul.engine.sampling import SamplingParams, adjust_logits, request_seed, sample_batch
from irminsul.engine.sequence import Sequence, TokenLogprob
from irminsul.errors import RequestError
from irminsul.model.attention import EMPTY_SLOT, PADDING_SLACK, SeqAttention, consecutive
from irminsul.model.compiled import resolve
from irminsul.model.deepseek import DeepseekModel
from irminsul.model.mla import ForwardBatch
from irminsul.model.tokenizer import Tokenizer

log = logging.getLogger("irminsul.engine")

DEFAULT_KV_CACHE_GIB = 1.0  # on the CPU (committed lazily, as rows are written)
GPU_MEMORY_SHARE = 0.85  # on a GPU: this share of the memory free once the weights are loaded


def default_kv_cache_gib(device) -> float:
    """The pool's default size: 1 GiB on the CPU; on a CUDA device, most of its free memory (as
    vLLM's gpu_memory_utilization; the rest is left to activations)."""
    device = torch.device(device)
    if device.type != "cuda":
        return DEFAULT_KV_CACHE_GIB
    free, _ = torch.cuda.mem_get_info(device)
    return GPU_MEMORY_SHARE * free / 2**30


def memory_bytes(device) -> float:
    """The memory a pool on this device could at most take: the GPU's, or the machine's RAM."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # (no sysconf: not checked)
        return math.inf


class PoolFull(RequestError):
    """The request cannot get rows now, even after evicting every cached row nobody is using."""


class PoolBusy(PoolFull):
    """... but it could once running requests give theirs back: a retry may succeed (a 503)."""


class Engine:
    def __init__(self, model: DeepseekModel, tokenizer: Tokenizer, reuse: str = "off",
                 max_prefill_tokens: int = 2048, kv_cache_gib: float | None = None, pool: LatentPool | None = None,
                 compile_decode: bool | None = None, **cache_options):
        """`pool`: share another engine's pool (engines over the same weights, each with its own
        cache, as the evaluations compare strategies); otherwise one of `kv_cache_gib` GiB.
        `compile_decode`: decode steps run compiled: with the torch backend on a CPU, one sequence and
        small batches through torch.compile (model/compiled.py, once per model); with the triton
        backend on a GPU, batches up to 128 as CUDA graphs (model/graphs.py, once per engine: they
        hold its pool). None: where available, True: required, False: never (vLLM's enforce_eager)."""
        self.model, self.tokenizer = model, tokenizer
        self.config = cfg = model.config
        self.max_prefill_tokens = max_prefill_tokens
        if pool is None:
            gib = default_kv_cache_gib(model.device) if kv_cache_gib is None else kv_cache_gib
            if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not 0 < gib < math.inf:
                raise RequestError(f"kv_cache_gib={kv_cache_gib!r} must be a number > 0")
            if gib * 2**30 > (total := memory_bytes(model.device)):
                raise RequestError(f"kv_cache_gib={kv_cache_gib!r} is more than the {total / 2**30:.0f} GiB of memory "
                                   f"{'this GPU' if torch.device(model.device).type == 'cuda' else 'this machine'} has")
            pool = LatentPool.sized(cfg, int(gib * 2**30), model.dtype, model.device)
        self.pool = pool
        self.cache = make_reuse(reuse, self.pool, cfg.num_hidden_layers, **cache_options)
        if self.cache.recompute_ratio and not hasattr(model, "fresh_rows"):
            raise RequestError(f"recompute_ratio (pic+r) is not available for {cfg.model_type} yet")
        try:
            if getattr(model.attention, "name", None) == "triton":  # CUDA graphs (model/graphs.py)
                from irminsul.model import graphs

                self._compiled, self._graphs = None, graphs.resolve(model, self.pool.rows, compile_decode)
            else:  # the torch backend: compiled on a CPU (model/compiled.py)
                self._compiled, self._graphs = resolve(model, compile_decode), None
        except ValueError as e:
            raise RequestError(f"compile_decode: {e}") from None
        eos = set(cfg.eos_token_ids) | {tokenizer.eos_token_id}
        self.eos_ids = frozenset(eos - {None})
        self._grammars: Grammars | None = None

    @property
    def grammars(self) -> Grammars:
        """Structured output's matcher factory, built on first use."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer.to_json(), self.config.vocab_size, self.eos_ids)
        return self._grammars

    @property
    def reuse(self) -> str:
        return self.cache.mode

    # -- admission -------------------------------------------------------------------------

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

    def new_sequence(self, tokens: list[int], params: SamplingParams, segment_starts: list[int] | None = None,
                     tenant: str | None = None, matcher=None, leader: Sequence | None = None) -> Sequence:
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
            matcher = self.grammars.matcher(params.constraint)
        if leader is not None and (leader.tokens[: leader.prompt_len] != tokens or leader.tenant != tenant):
            raise ValueError("a leader must be a choice of the same prompt, for the same tenant")
        return Sequence(tokens=tokens, prompt_len=len(tokens), params=params, segment_starts=segment_starts,
                        tenant=tenant, seed=request_seed(params.seed), matcher=matcher,
                        detok=self.tokenizer.decode_stream(params.skip_special_tokens), leader=leader)

    def admit(self, seq: Sequence) -> bool:
        """Plan the sequence against the cache and give it rows: shared slots for what it reuses,
        fresh ones for what it computes. False (holding nothing) when it must wait: a running
        sequence is computing some of its chunks right now, its leader is still computing their
        shared prompt, or the pool cannot hold it yet."""
        lead = seq.leader
        if lead is not None and lead.admitted and not lead.finished and lead.prompt_len == seq.prompt_len:
            return False if lead.in_prefill else self._admit_sibling(seq, lead)
        if self.cache.waits_for(seq.tokens, seq.segment_starts, seq.tenant):
            return False
        self.cache.prepare(seq)  # the plan, the slot table of reused rows, the stats
        try:
            if self.cache.recompute_ratio and not self._select_recompute(seq):
                self._unadmit(seq)
                return False
            if not self._alloc(seq, seq.pending):
                self._unadmit(seq)
                return False
        except BaseException:
            self._unadmit(seq)
            raise
        return True

    def _admit_sibling(self, seq: Sequence, lead: Sequence) -> bool:
        """Share the leader's prompt rows (one more reference each) and compute only the last prompt
        position, whose logits start this choice. Counted as prefix tokens: rows found, not computed."""
        n = seq.prompt_len - 1
        seq.slots = np.zeros(seq.prompt_len, np.int64)
        seq.slots[:n] = lead.slots[:n]
        self.pool.retain(seq.slots[:n])
        seq.pending = np.array([n], np.int64)
        seq.plan, seq.registered = None, seq.prompt_len
        st = seq.stats
        st.prompt_tokens, st.prefix_tokens, st.reused_tokens, st.computed_tokens = seq.prompt_len, n, 0, 1
        st.carve_out_tokens = st.s1_tokens = 0
        if not self._alloc(seq, seq.pending):
            self._unadmit(seq)
            return False
        seq.leader = None  # admitted: it holds its own references now
        return True

    def add(self, tokens: list[int], params: SamplingParams, segment_starts: list[int] | None = None,
            tenant: str | None = None) -> Sequence:
        """Validate and admit now (single-request use; the scheduler admits when there is room)."""
        seq = self.new_sequence(tokens, params, segment_starts, tenant)
        if self.admit(seq):
            return seq
        if self.cache.waits_for(seq.tokens, seq.segment_starts, seq.tenant):
            raise PoolFull("a running request is computing this prompt's content; admit it through the scheduler")
        raise PoolFull(f"the KV pool ({self.pool.describe()}) cannot hold this request even "
                       f"after evicting every cached row; raise kv_cache_gib or shorten the prompt")

    def _alloc(self, seq: Sequence, positions: np.ndarray) -> bool:
        """Fresh slots for positions of seq (rows to compute), evicting cached content if needed."""
        if not len(positions):
            return True
        if not self.cache.make_room(len(positions), [seq.tenant]):
            return False
        slots = self.pool.alloc(len(positions))
        seq.slots[positions] = slots
        self.pool.computed_at[slots] = positions
        return True

    def _unadmit(self, seq: Sequence) -> None:
        """Undo admission: release the plan, its in-flight claims and every row the sequence holds."""
        reason, seq.finish_reason = seq.finish_reason, "abort"
        try:
            self.cache.finish(seq)
        finally:
            seq.finish_reason = reason
            self.pool.release(seq.slots)
            seq.slots = np.zeros(0, np.int64)
            seq._buf = None
            seq.pending = np.zeros(0, np.int64)

    def reserve(self, seqs: list[Sequence]) -> bool:
        """A slot for each decoding sequence's newest token; False if the pool cannot give them all."""
        need = []
        for seq in seqs:
            if not seq.in_prefill:
                seq.grow()
                if seq.slots[-1] == EMPTY_SLOT:
                    need.append(seq)
        if not need:
            return True
        if not self.cache.make_room(len(need), [seq.tenant for seq in need]):
            return False
        slots = self.pool.alloc(len(need))
        for seq, slot in zip(need, slots):
            seq.slots[-1] = slot
            self.pool.computed_at[slot] = len(seq.tokens) - 1
        return True

    def preempt(self, seq: Sequence) -> None:
        """Take every row from a running sequence; it keeps its tokens and is admitted again later,
        recomputing (or reusing) what it had. Chunks it already offered the cache stay there."""
        self._unadmit(seq)
        seq.stats.preempted += 1

    # -- stepping ------------------------------------------------------------------------

    def _forward(self, seqs: list[Sequence], takes: list[np.ndarray]) -> tuple[torch.Tensor, list[int]]:
        """Compute positions takes[i] of seqs[i] (their slots already allocated); final hidden [N, H]."""
        naive = self.cache.mode == "naive"  # stale k_r: keys read at the position they were computed at
        specs, ids, offsets = [], [], [0]
        for seq, take in zip(seqs, takes):
            keys = seq.slots[: int(take[-1]) + 1]
            specs.append(SeqAttention(take, keys, self.pool.computed_at[keys] if naive else None))
            ids.append([seq.tokens[-1]] if len(take) == 1 and take[0] == len(seq.tokens) - 1
                       else np.asarray(seq.tokens)[take])
            offsets.append(offsets[-1] + len(take))
        takes_all = np.concatenate(takes)
        write = np.concatenate([seq.slots[take] for seq, take in zip(seqs, takes)])
        dev = self.model.device
        batch = ForwardBatch(torch.as_tensor(np.concatenate(ids), device=dev), torch.as_tensor(takes_all, device=dev),
                             self.pool.rows, torch.as_tensor(write, device=dev),
                             self.model.attention.plan(specs, offsets, dev))
        return self.model(batch), offsets

    def forward(self, seqs: list[Sequence], prefill_budget: int | None = None) -> list[torch.Tensor | None]:
        """One forward pass; the next-token logits [vocab] of each sequence whose prompt is done
        (None for one still in prefill, or one that got no prefill tokens this step). At most
        `prefill_budget` (default max_prefill_tokens) prompt positions are computed in all. The
        logits may be views of a captured step's output buffer: valid until the next step."""
        # compiled decode steps read each key at its own position: not `naive` (stale k_r)
        if ((self._compiled is not None or self._graphs is not None) and self.cache.mode != "naive"
                and not any(s.in_prefill for s in seqs)):
            logits = self._compiled_decode(seqs) if self._compiled is not None else self._graph_decode(seqs)
            if logits is not None:
                for seq in seqs:
                    self.cache.computed(seq)
                return list(logits)
        takes, ran = [], []
        budget = self.max_prefill_tokens if prefill_budget is None else min(prefill_budget, self.max_prefill_tokens)
        for seq in seqs:
            if seq.in_prefill:
                if budget <= 0:
                    continue
                take = seq.pending[:budget]
                budget -= len(take)
                seq.pending = seq.pending[len(take) :]
            else:  # decode: only the last token, whose row is not computed yet
                take = np.array([len(seq.tokens) - 1])
            takes.append(take)
            ran.append(seq)
        out: dict[int, torch.Tensor] = {}
        if ran:
            hidden, offsets = self._forward(ran, takes)
            for seq in ran:
                self.cache.computed(seq)  # in-flight reuse: chunks whose rows now exist
            wanted = [i for i, s in enumerate(ran) if not s.in_prefill]
            if wanted:
                logits = self.model.logits(hidden[[offsets[i + 1] - 1 for i in wanted]])
                out = {ran[i].id: logits[row] for row, i in enumerate(wanted)}
        return [out.get(seq.id) for seq in seqs]

    def _compiled_decode(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """The next-token logits [B, vocab] of decoding sequences through the compiled step, or None (the
        engine's path). A sequence alone whose rows sit in consecutive slots is read in place; otherwise
        (where the compiled step covers batches, up to its `max_batch` sequences) their rows are gathered
        through their slot tables, when padding them to one length costs at most PADDING_SLACK times the
        real work."""
        dev = self.model.device
        lens = np.fromiter((len(s.tokens) for s in seqs), np.int64, len(seqs))
        if len(seqs) == 1 and consecutive(slots := seqs[0].slots[: lens[0]]):
            hidden = self._compiled(torch.tensor([seqs[0].tokens[-1]], device=dev), torch.tensor(lens - 1, device=dev),
                                    self.pool.rows, int(slots[0]), int(lens[0]))
        else:
            t = int(lens.max()) - 1
            if len(seqs) > self._compiled.max_batch or len(seqs) * t > PADDING_SLACK * (lens.sum() - len(seqs)):
                return None
            key_slots = np.full((len(seqs), t), EMPTY_SLOT, np.int64)
            for i, s in enumerate(seqs):
                key_slots[i, : lens[i] - 1] = s.slots[: lens[i] - 1]
            write = np.fromiter((s.slots[n - 1] for s, n in zip(seqs, lens)), np.int64, len(seqs))
            hidden = self._compiled.batch(torch.tensor([s.tokens[-1] for s in seqs], device=dev),
                                          torch.from_numpy(lens - 1).to(dev), torch.from_numpy(key_slots).to(dev),
                                          self.pool.rows, torch.from_numpy(write).to(dev))
        return self.model.logits(hidden)

    def _graph_decode(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """The next-token logits [B, vocab] of decoding sequences through a captured step when it
        covers them (`DecodeGraphs.fits`); else None."""
        lens = np.fromiter((len(s.tokens) for s in seqs), np.int64, len(seqs))
        if not self._graphs.fits(len(seqs), int(lens.max())):
            return None
        return self._graphs(np.fromiter((s.tokens[-1] for s in seqs), np.int64, len(seqs)), lens,
                            [s.slots[:n] for s, n in zip(seqs, lens)])

    def step(self, seqs: list[Sequence], prefill_budget: int | None = None) -> list[int | None]:
        """Forward + sample; appends the new token to each sequence that produced one. Decoding
        sequences need their slot first (`reserve`)."""
        logits = self.forward(seqs, prefill_budget)
        rows = [i for i, x in enumerate(logits) if x is not None]
        new: list[int | None] = [None] * len(seqs)
        if not rows:
            return new
        stacked = torch.stack([logits[i] for i in rows])
        wants = [row for row, i in enumerate(rows) if seqs[i].params.logprobs is not None]
        logprobs = dict(zip(wants, stacked[wants].log_softmax(-1))) if wants else {}  # the model's, unadjusted
        failed: dict[int, str] = {}  # row -> why: an error in one row ends that sequence alone
        for row, i in enumerate(rows):
            p = seqs[i].params
            if p.adjusts_logits:
                ends = [*p.stop_token_ids, *([] if p.ignore_eos else self.eos_ids)]
                try:
                    stacked[row] = adjust_logits(stacked[row], p, seqs[i].tokens[: seqs[i].prompt_len],
                                                 seqs[i].output_ids, ends)
                except Exception as e:
                    failed[row] = self._internal_error("adjusting the logits", seqs[i], e)
        constrained = [row for row, i in enumerate(rows) if seqs[i].matcher is not None and row not in failed]
        if constrained:
            self._mask(stacked, constrained, [seqs[rows[row]] for row in constrained], failed)
        batch = [seqs[i] for i in rows]
        tokens = self._choose(batch, stacked, failed)
        for row, i in enumerate(rows):
            seq, token = seqs[i], tokens[row]
            if row in failed:
                seq.finish_reason, seq.error = "abort", failed[row]
                continue
            if seq.matcher is not None and seq.matcher.is_error():
                self._constraint_failed(seq)
                continue
            before = len(seq.tokens)
            self._append(seq, token)
            appended = len(seq.tokens) > before
            # a stop token (EOS or stop_token_ids) is not output, but its log-prob is, as vLLM's are:
            # lm-evaluation-harness drops the last entry of an echoed prompt + one generated token
            if row in logprobs and (appended or seq.finish_reason == "stop"):
                seq.logprobs.append(TokenLogprob.of(logprobs[row], token, seq.params.logprobs, stop=not appended))
            new[i] = token
        return new

    def _mask(self, stacked: torch.Tensor, constrained: list[int], seqs: list[Sequence],
              failed: dict[int, str]) -> None:
        """-inf on the tokens each constrained row's grammar rules out: one mask call for all of
        them; should it fail, one call per row, so a failing matcher ends only its own sequence."""
        try:
            allowed = self.grammars.allowed([seq.matcher for seq in seqs])
            stacked[constrained] = stacked[constrained].masked_fill(~allowed, float("-inf"))
            return
        except Exception:
            pass
        for row, seq in zip(constrained, seqs):
            try:
                stacked[row] = stacked[row].masked_fill(~self.grammars.allowed([seq.matcher])[0], float("-inf"))
            except Exception as e:
                failed[row] = self._internal_error("computing the grammar's token mask", seq, e)

    def _choose(self, batch: list[Sequence], stacked: torch.Tensor, failed: dict[int, str]) -> list[int]:
        """The next token of each row: greedy, or sampled in one batched call (its one host copy is
        here). Should that call fail, the rows are sampled one by one (the same tokens: the
        randomness is per row), so the error ends only the sequence whose row raised it."""
        if all(seq.params.greedy for seq in batch):
            return stacked.argmax(-1).tolist()
        try:
            return sample_batch(stacked, [seq.params for seq in batch], [seq.seed for seq in batch],
                                [len(seq.output_ids) for seq in batch]).tolist()
        except Exception:
            pass
        tokens = []
        for row, seq in enumerate(batch):
            try:
                tokens.append(int(sample_batch(stacked[row : row + 1], [seq.params], [seq.seed],
                                               [len(seq.output_ids)])[0]))
            except Exception as e:
                failed[row] = self._internal_error("sampling", seq, e)
                tokens.append(-1)
        return tokens

    @staticmethod
    def _internal_error(doing: str, seq: Sequence, e: Exception) -> str:
        log.error("request %s: internal error while %s (%s: %s); ending this request only",
                  seq.id, doing, type(e).__name__, e)
        return f"internal error while {doing}: {type(e).__name__}"

    def _append(self, seq: Sequence, token: int) -> None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids):
            seq.finish_reason = "stop"
            return
        seq.tokens.append(token)
        seq.stats.generated_tokens += 1
        before = len(seq.text)
        seq.text += seq.detok(token)
        if seq.matcher is not None:
            seq.matcher.consume_token(token)  # the mask allowed it; the matcher only moves on ...
            if seq.matcher.is_error():  # ... unless nothing can follow (it says "stopped" then too)
                self._constraint_failed(seq)
                return
        if p.stop and len(seq.output_ids) >= p.min_tokens and self._cut_at_stop(seq, before):
            seq.finish_reason = "stop"
        elif seq.matcher is not None and seq.matcher.is_stopped():  # the grammar is complete
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= p.max_tokens or len(seq.tokens) >= self.config.max_position_embeddings:
            seq.finish_reason = "length"

    @staticmethod
    def _constraint_failed(seq: Sequence) -> None:
        """The grammar reached a dead end (a schema that allows no finite output, say): the request's
        fault (400), not the server's."""
        seq.finish_reason, seq.error = "abort", f"the output constraint failed: {reason(seq.matcher)}"
        seq.error_status = 400

    @staticmethod
    def _cut_at_stop(seq: Sequence, before: int) -> bool:
        """Look for a stop string in the text the new token completed; cut the output before it."""
        start = max(0, before - max(len(s) for s in seq.params.stop) + 1)
        hits = [(i, i + len(s)) for i, s in ((seq.text.find(s, start), s) for s in seq.params.stop) if i >= 0]
        if hits:
            at, end = min(hits)
            seq.text = seq.text[: end if seq.params.include_stop_str_in_output else at]
        return bool(hits)

    def streamable(self, seq: Sequence) -> str:
        """The output text that is safe to show now: never the start of what may become a stop string."""
        if seq.finished or not seq.params.stop:
            return seq.text
        return seq.text[: max(0, len(seq.text) - max(len(s) for s in seq.params.stop) + 1)]

    def finish(self, seq: Sequence) -> None:
        """Hand the sequence's rows to the cache (registry and tree) and drop its own references."""
        if seq.finish_reason is None:
            seq.finish_reason = "abort"
        try:
            self.cache.finish(seq)
        finally:
            self.pool.release(seq.slots)
            seq.slots = np.zeros(0, np.int64)
            seq._buf = None

    def close(self) -> None:
        """Drop everything the cache holds (its rows go back to the pool, which may be shared)."""
        self.cache.clear()

    # -- whole-request helpers -----------------------------------------------------------

    def run(self, seq: Sequence) -> Sequence:
        """Generate until the sequence is done (it runs alone; the scheduler batches many)."""
        while not seq.finished:
            if not self.reserve([seq]):
                self.finish(seq)
                raise PoolFull(f"the KV pool ({self.pool.describe()}) is full; "
                               f"raise kv_cache_gib")
            self.step([seq])
        self.finish(seq)
        return seq

    @torch.inference_mode()
    def score(self, prompt: list[int], continuation: list[int], segment_starts: list[int] | None = None,
              tenant: str | None = None) -> tuple[torch.Tensor, Sequence]:
        """Teacher-forced log-probs [len(continuation), vocab] of continuation after prompt."""
        if not continuation:
            raise RequestError("the continuation is empty; score needs at least one token")
        tokens = [int(t) for t in prompt] + [int(t) for t in continuation]
        try:  # (the positions read: every token but the continuation's last)
            self.validate_prompt(tokens[:-1], room=0)
        except RequestError as e:
            raise RequestError(f"scoring reads prompt + continuation but its last token: {e}") from None
        self.validate_prompt(list(continuation), room=0)
        seq = self.add(list(prompt), SamplingParams(max_tokens=1), segment_starts, tenant)
        n = len(prompt)
        # The plan covers the prompt; the continuation (all but its last token) is computed too.
        seq.tokens = tokens[:-1]
        seq.grow()
        extra = np.arange(n, len(tokens) - 1)
        if not self._alloc(seq, extra):
            self.finish(seq)
            raise PoolFull("the KV pool cannot hold the continuation; raise kv_cache_gib")
        seq.pending = np.concatenate([seq.pending, extra])
        pieces = []
        while seq.in_prefill:
            take = seq.pending[: self.max_prefill_tokens]
            seq.pending = seq.pending[len(take) :]
            hidden, _ = self._forward([seq], [take])
            self.cache.computed(seq)
            pieces.append(self.model.logits(hidden[torch.as_tensor(take >= n - 1)]))
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
            raise RequestError(f"the document has {len(ids)} tokens but the KV pool holds {self.pool.describe()}; "
                               f"raise kv_cache_gib or publish it in parts")
        seq = Sequence(tokens=ids, prompt_len=len(ids), params=SamplingParams(max_tokens=1))
        seq.slots = np.zeros(len(ids), np.int64)
        if not self._alloc(seq, np.arange(len(ids))):
            raise PoolBusy(f"the KV pool ({self.pool.describe()}) has no room for this document's {len(ids)} rows "
                           f"while the running requests hold theirs; retry later")
        try:
            for start in range(0, len(ids), self.max_prefill_tokens):
                take = np.arange(start, min(len(ids), start + self.max_prefill_tokens))
                self._forward([seq], [take])
            return self.cache.register_published(np.asarray(ids, np.int64), seq.slots, segment_starts)
        finally:
            self.pool.release(seq.slots)

    # -- pic+r ---------------------------------------------------------------------------

    def _select_recompute(self, seq: Sequence) -> bool:
        """pic+r (CacheBlend, Yao et al. 2025): recompute the fraction r of reused rows whose c_KV at
        the check layer deviates most from what the current context gives. Layers [0, check_layer)
        run over every non-prefix position into scratch slots; only their latent at check_layer is
        compared. False if the pool has no room for the scratch rows now."""
        cache = self.cache
        reused = np.concatenate([np.arange(s.start, s.end) for s in seq.plan.spans if s.kind == "reuse"] or
                                [np.zeros(0, np.int64)])
        k = int(math.ceil(cache.recompute_ratio * len(reused)))
        if k == 0:
            return True
        run = np.union1d(reused, seq.pending)
        if not cache.make_room(len(run)):
            return False
        scratch = self.pool.alloc(len(run))
        try:
            table = seq.slots.copy()
            table[run] = scratch
            self.pool.computed_at[scratch] = run
            dev = self.model.device
            spec = SeqAttention(run, table[: int(run[-1]) + 1])
            batch = ForwardBatch(torch.as_tensor(np.asarray(seq.tokens)[run], device=dev),
                                 torch.as_tensor(run, device=dev), self.pool.rows, torch.as_tensor(scratch, device=dev),
                                 self.model.attention.plan([spec], [0, len(run)], dev))
            r = self.config.kv_lora_rank
            fresh = self.model.fresh_rows(batch, cache.check_layer)[:, :r]
            at = torch.as_tensor(np.searchsorted(run, reused), device=dev)
            cached = self.pool.rows[cache.check_layer, torch.as_tensor(seq.slots[reused], device=dev), :r].float()
            deviation = (fresh[at].float() - cached).norm(dim=-1) / cached.norm(dim=-1).clamp_min(1e-12)
            chosen = np.sort(reused[deviation.topk(k).indices.cpu().numpy()])
        finally:
            self.pool.release(scratch)
        cache.recompute(seq, chosen)
        return True
