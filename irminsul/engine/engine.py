"""The engine: admits requests, runs batched forward steps (prefill chunks + decodes), samples.

A step takes any mix of sequences: those still in prefill contribute their next pending positions
(the ones the cache plan left to compute, in increasing order), those decoding contribute their
last token. One forward pass computes all of them; each sequence attends only to its own rows.
"""

from __future__ import annotations

import numpy as np
import torch

from irminsul.engine.reuse import make_reuse
from irminsul.engine.sampling import SamplingParams, make_generator, sample
from irminsul.engine.sequence import Sequence
from irminsul.errors import RequestError
from irminsul.model.deepseek import DeepseekModel
from irminsul.model.mla import ForwardBatch
from irminsul.model.tokenizer import Tokenizer


class Engine:
    def __init__(self, model: DeepseekModel, tokenizer: Tokenizer, reuse: str = "off",
                 max_prefill_tokens: int = 2048, **cache_options):
        self.model, self.tokenizer = model, tokenizer
        self.config = model.config
        self.max_prefill_tokens = max_prefill_tokens
        self.cache = make_reuse(reuse, model, **cache_options)
        eos = set(self.config.eos_token_ids) | {tokenizer.eos_token_id}
        self.eos_ids = frozenset(eos - {None})

    @property
    def reuse(self) -> str:
        return self.cache.mode

    # -- admission -------------------------------------------------------------------------

    def validate_prompt(self, tokens: list[int]) -> None:
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
        if len(tokens) >= limit:
            raise RequestError(
                f"the prompt has {len(tokens)} tokens but the model's context is {limit}; "
                f"shorten it to at most {limit - 1} tokens"
            )

    def add(self, tokens: list[int], params: SamplingParams, segment_starts: list[int] | None = None,
            tenant: str | None = None) -> Sequence:
        """Validate, plan against the cache, and copy reused rows in. Returns a sequence in prefill."""
        tokens = [int(t) for t in tokens]
        self.validate_prompt(tokens)
        rows = self.model.new_rows(capacity=len(tokens) + params.max_tokens)
        seq = Sequence(tokens=tokens, prompt_len=len(tokens), params=params, rows=rows,
                       segment_starts=segment_starts, tenant=tenant, generator=make_generator(params.seed))
        try:
            self.cache.prepare(seq)  # fills seq.pending, seq.stats and copies prefix / reused rows
        except BaseException:
            seq.finish_reason = "abort"
            self.cache.finish(seq)  # releases whatever the plan pinned; registers nothing
            raise
        return seq

    # -- stepping ------------------------------------------------------------------------

    def _batch(self, seqs: list[Sequence]) -> tuple[ForwardBatch, list[int]]:
        ids, pos, offsets, budget = [], [], [0], self.max_prefill_tokens
        for seq in seqs:
            if seq.in_prefill:
                take = seq.pending[: max(1, budget)]
                budget -= len(take)
                seq.pending = seq.pending[len(take) :]
                ids.append(np.asarray(seq.tokens)[take])
            else:  # decode: only the last token, whose row is not computed yet
                take = np.array([len(seq.tokens) - 1])
                ids.append(np.array(seq.tokens[-1:]))
            pos.append(take)
            offsets.append(offsets[-1] + len(take))
        dev = self.model.device
        batch = ForwardBatch(torch.as_tensor(np.concatenate(ids), device=dev),
                             torch.as_tensor(np.concatenate(pos), device=dev), [s.rows for s in seqs], offsets)
        return batch, offsets

    def forward(self, seqs: list[Sequence]) -> list[torch.Tensor | None]:
        """One forward pass; returns the next-token logits [vocab] of each sequence whose prompt is done."""
        batch, offsets = self._batch(seqs)
        hidden = self.model(batch)
        wanted = [i for i, s in enumerate(seqs) if not s.in_prefill]
        if not wanted:
            return [None] * len(seqs)
        logits = self.model.logits(hidden[[offsets[i + 1] - 1 for i in wanted]])
        out: list[torch.Tensor | None] = [None] * len(seqs)
        for row, i in enumerate(wanted):
            out[i] = logits[row]
        return out

    def step(self, seqs: list[Sequence]) -> list[int | None]:
        """Forward + sample; appends the new token to each sequence that produced one."""
        new: list[int | None] = []
        for seq, logits in zip(seqs, self.forward(seqs)):
            if logits is None:
                new.append(None)
                continue
            token = sample(logits, seq.params, seq.generator)
            self._append(seq, token)
            new.append(token)
        return new

    def _append(self, seq: Sequence, token: int) -> None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids):
            seq.finish_reason = "stop"
            return
        seq.tokens.append(token)
        seq.stats.generated_tokens += 1
        if p.stop and self._hit_stop_string(seq):
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= p.max_tokens or len(seq.tokens) >= self.config.max_position_embeddings:
            seq.finish_reason = "length"

    def _hit_stop_string(self, seq: Sequence) -> bool:
        text = self.tokenizer.decode(seq.output_ids)
        longest = max(len(s) for s in seq.params.stop)
        start = max(0, seq.text_offset - longest)
        seq.text_offset = len(text)
        return any(s in text[start:] for s in seq.params.stop)

    def output_text(self, seq: Sequence) -> str:
        text = self.tokenizer.decode(seq.output_ids)
        cut = min((text.find(s) for s in seq.params.stop if s in text), default=-1)
        return text if cut < 0 else text[:cut]

    def finish(self, seq: Sequence) -> None:
        """Register the finished sequence's rows with the cache and release its pins."""
        if seq.finish_reason is None:
            seq.finish_reason = "abort"
        self.cache.finish(seq)

    # -- whole-request helpers -----------------------------------------------------------

    def run(self, seq: Sequence) -> Sequence:
        while not seq.finished:
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
        self.validate_prompt(tokens[:-1])
        self.validate_prompt(list(continuation))
        params = SamplingParams(max_tokens=1)
        seq = self.add(list(prompt), params, segment_starts, tenant)
        n = len(prompt)
        # The plan covers the prompt; the continuation (all but its last token) is computed too.
        seq.tokens = tokens
        seq.pending = np.concatenate([seq.pending, np.arange(n, len(tokens) - 1)])
        pieces = []
        while seq.in_prefill:
            batch, _ = self._batch([seq])
            hidden = self.model(batch)
            keep = (batch.positions >= n - 1).nonzero().squeeze(-1)
            pieces.append(self.model.logits(hidden[keep]))
        seq.finish_reason = "stop"
        self.cache.finish(seq)  # registers the rows that exist: every token but the last
        return torch.cat(pieces).log_softmax(-1), seq
