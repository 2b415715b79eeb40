"""The output processor: logits in, tokens, text and log-probs out.

For each sequence that produced logits this step: the request's logit adjustments (penalties,
bias, min_tokens), the grammar's token mask, greedy choice or one batched sample, then the token
appended with its incremental detokenization, stop tokens, stop strings, the grammar's end, the
length limit, and the log-probs asked for. An error in one row ends that sequence alone.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from irminsul.engine.grammar import Grammars, reason
from irminsul.engine.sampling import adjust_logits, sample_batch
from irminsul.engine.sequence import Sequence, TokenLogprob

if TYPE_CHECKING:
    from llguidance import LLMatcher

log = logging.getLogger("irminsul.engine")


class OutputProcessor:
    def __init__(self, tokenizer, vocab_size: int, eos_ids: frozenset[int], max_positions: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_ids, self.max_positions = eos_ids, max_positions
        self._grammars: Grammars | None = None
        self._shown: dict[int, int] = {}  # characters of output text already reported, per sequence

    @property
    def grammars(self) -> Grammars:
        """Structured output's matcher factory, built on first use."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer.to_json(), self.vocab_size, self.eos_ids)
        return self._grammars

    def process(self, seqs: list[Sequence], logits: list[torch.Tensor | None]) -> list[int | None]:
        """Choose and append each sequence's next token; the token per sequence (None: no logits)."""
        rows = [i for i, x in enumerate(logits) if x is not None]
        new: list[int | None] = [None] * len(seqs)
        if not rows:
            return new
        stacked = torch.stack([x for x in logits if x is not None])  # (the rows', in order)
        wants = [row for row, i in enumerate(rows) if seqs[i].params.logprobs is not None]
        logprobs = dict(zip(wants, stacked[wants].log_softmax(-1))) if wants else {}  # the model's, unadjusted
        failed: dict[int, str] = {}  # row -> why: an error in one row ends that sequence alone
        for row, i in enumerate(rows):
            p = seqs[i].params
            if p.adjusts_logits:
                ends = [*p.stop_token_ids, *([] if p.ignore_eos else self.eos_ids)]
                try:
                    stacked[row] = adjust_logits(
                        stacked[row], p, seqs[i].tokens[: seqs[i].prompt_len], seqs[i].output_ids, ends
                    )
                except Exception as e:
                    failed[row] = self._internal_error("adjusting the logits", seqs[i], e)
        constrained = [row for row, i in enumerate(rows) if seqs[i].matcher is not None and row not in failed]
        if constrained:
            self._mask(stacked, constrained, [seqs[rows[row]] for row in constrained], failed)
        tokens = self._choose([seqs[i] for i in rows], stacked, failed)
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
            n_top = seq.params.logprobs  # (not None for a row in logprobs: `wants`)
            if row in logprobs and n_top is not None and (appended or seq.finish_reason == "stop"):
                seq.logprobs.append(TokenLogprob.of(logprobs[row], token, n_top, stop=not appended))
            new[i] = token
        return new

    def _mask(
        self, stacked: torch.Tensor, constrained: list[int], seqs: list[Sequence], failed: dict[int, str]
    ) -> None:
        """-inf on the tokens each constrained row's grammar rules out: one mask call for all of
        them; should it fail, one call per row, so a failing matcher ends only its own sequence."""
        matchers: list[LLMatcher] = []
        for seq in seqs:
            assert seq.matcher is not None, "the constrained rows are those of sequences with a matcher"
            matchers.append(seq.matcher)
        try:
            allowed = self.grammars.allowed(matchers)
            stacked[constrained] = stacked[constrained].masked_fill(~allowed, float("-inf"))
            return
        except Exception:
            pass
        for row, seq, matcher in zip(constrained, seqs, matchers):
            try:
                stacked[row] = stacked[row].masked_fill(~self.grammars.allowed([matcher])[0], float("-inf"))
            except Exception as e:
                failed[row] = self._internal_error("computing the grammar's token mask", seq, e)

    def _choose(self, batch: list[Sequence], stacked: torch.Tensor, failed: dict[int, str]) -> list[int]:
        """The next token of each row: greedy, or sampled in one batched call (its one host copy is
        here). Should that call fail, the rows are sampled one by one (the same tokens: the
        randomness is per row), so the error ends only the sequence whose row raised it."""
        if all(seq.params.greedy for seq in batch):
            return stacked.max(-1).indices.tolist()  # (argmax's tokens; on a CPU 3x faster, sampling.py)
        try:
            return sample_batch(
                stacked,
                [seq.params for seq in batch],
                [seq.seed for seq in batch],
                [len(seq.output_ids) for seq in batch],
            ).tolist()
        except Exception:
            pass
        tokens = []
        for row, seq in enumerate(batch):
            try:
                tokens.append(
                    int(sample_batch(stacked[row : row + 1], [seq.params], [seq.seed], [len(seq.output_ids)])[0])
                )
            except Exception as e:
                failed[row] = self._internal_error("sampling", seq, e)
                tokens.append(-1)
        return tokens

    @staticmethod
    def _internal_error(doing: str, seq: Sequence, e: Exception) -> str:
        log.error(
            "request %s: internal error while %s (%s: %s); ending this request only", seq.id, doing, type(e).__name__, e
        )
        return f"internal error while {doing}: {type(e).__name__}"

    def _append(self, seq: Sequence, token: int) -> None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids):
            seq.finish_reason = "stop"
            return
        seq.tokens.append(token)
        seq.stats.generated_tokens += 1
        before = len(seq.text)
        assert seq.detok is not None, "Engine.new_sequence gives every sequence its detokenizer"
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
        elif len(seq.output_ids) >= p.max_tokens or len(seq.tokens) >= self.max_positions:
            seq.finish_reason = "length"

    @staticmethod
    def _constraint_failed(seq: Sequence) -> None:
        """The grammar reached a dead end (a schema that allows no finite output, say): the request's
        fault (400), not the server's."""
        assert seq.matcher is not None, "only a constrained sequence's grammar fails"
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

    @staticmethod
    def streamable(seq: Sequence) -> str:
        """The output text that is safe to show now: never the start of what may become a stop string."""
        if seq.finished or not seq.params.stop:
            return seq.text
        return seq.text[: max(0, len(seq.text) - max(len(s) for s in seq.params.stop) + 1)]

    def delta(self, seq: Sequence) -> str:
        """The text that became safe to show since the last call for this sequence (its record goes
        once the sequence is finished)."""
        text, shown = self.streamable(seq), self._shown.get(seq.id, 0)
        if seq.finished:
            self._shown.pop(seq.id, None)
        else:
            self._shown[seq.id] = max(shown, len(text))
        return text[shown:]

    def forget(self, seq: Sequence) -> None:
        self._shown.pop(seq.id, None)
