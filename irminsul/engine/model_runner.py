"""The model runner: a scheduled batch in, next-token logits out.

It builds the model's `ForwardBatch` from each sequence's slot table (the rows attention reads,
the slots the new rows are written to), runs one forward pass with one attention call per layer
and group (`irminsul/model/attention/`), and returns the logits of the sequences whose prompt is
done. Decode-only steps go through the native step (`model/native_step.py`: a whole step in one C
call, for a few sequences of a float32 model on a CPU), the compiled CPU step (`model/compiled.py`)
or the captured CUDA graphs (`model/graphs.py`), the first that covers the batch and was measured
to pay here. Nothing here decides what runs: the
scheduler did; nothing here samples: the output processor will.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, cast

import numpy as np
import torch

from irminsul.engine.sequence import Sequence
from irminsul.errors import RequestError
from irminsul.kvcache.pool import LatentPool
from irminsul.model import compiled, native_step
from irminsul.model.attention import EMPTY_SLOT, PADDING_SLACK, SeqAttention, consecutive
from irminsul.model.base import CapturedStep, CompiledStep, Model
from irminsul.model.compiled import Compiling
from irminsul.model.mla import ForwardBatch


class _AttentionBackend(Protocol):
    """What `Model.attention` is (model/base.py declares it `object` and describes it in words)."""

    def plan(self, seqs: list[SeqAttention], offsets: list[int], device: torch.device) -> object: ...


class _LatentConfig(Protocol):
    kv_lora_rank: int  # the latent's width (an MLA family's config)


class _FreshRowsModel(Protocol):
    """A `Model` whose capabilities say `fresh_rows` (model/base.py: only such a family has the method)."""

    @property
    def config(self) -> _LatentConfig: ...

    def fresh_rows(self, batch: ForwardBatch, layer: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class ScheduledBatch:
    """One step's work: every running sequence, and the positions each computes (None: nothing this
    step, a prompt the prefill budget did not reach). A decoding sequence computes its last token."""

    seqs: list[Sequence]
    takes: list[np.ndarray | None]
    prefill_tokens: int  # prompt positions among the takes
    decode_only: bool  # every sequence was past its prompt: the compiled or captured step may run it


class ModelRunner:
    def __init__(self, model: Model, pool: LatentPool, compile_decode: bool | None = None):
        """`compile_decode`: decode steps run compiled: with the torch backend on a CPU, one sequence and
        small batches through torch.compile (model/compiled.py, once per model); with the triton
        backend on a GPU, batches up to 128 as CUDA graphs (model/graphs.py, once per runner: they
        hold its pool). None: where available (on a CPU compiled in the background, the eager path
        serving until it is ready), True: required and built before this returns, False: never
        (vLLM's enforce_eager)."""
        self.model, self.pool = model, pool
        self.device = model.device
        self.capabilities = model.capabilities
        # the triton backend's steps are captured CUDA graphs (GPU), the torch backend's compiled (CPU)
        captured = self.capabilities.backend == "triton"
        self._compiled: CompiledStep | Compiling | None = None
        self.graphs: CapturedStep | None = None
        # (a kernel path, not a compiled one: it serves from the first step, compile_decode or not)
        self.native = native_step.resolve(model) if not captured else None
        try:
            if captured:
                from irminsul.model import graphs  # (triton's modules: loaded where that backend runs)

                self.graphs = graphs.resolve(model, pool.rows, compile_decode)
            else:
                self._compiled = compiled.resolve(model, compile_decode)
        except ValueError as e:
            raise RequestError(f"compile_decode: {e}") from None

    @property
    def compiled(self) -> CompiledStep | None:
        """The compiled CPU step, once built (None before: the eager path decodes)."""
        step = self._compiled
        if not isinstance(step, Compiling):
            return step
        ready = step.ready()
        if ready is not None:
            self._compiled = ready
        return ready

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for a compiled step being built in the background; whether one runs now."""
        if isinstance(self._compiled, Compiling):
            self._compiled.wait(timeout)
        return self.compiled is not None

    @property
    def supports_recompute(self) -> bool:
        return self.capabilities.fresh_rows

    def execute(self, batch: ScheduledBatch, stale_keys: bool = False) -> list[torch.Tensor | None]:
        """The next-token logits [vocab] of each sequence whose prompt is done after this step (None
        for the others). `stale_keys`: keys read at the position they were computed at (`naive`).
        The logits may be views of a captured step's output buffer: valid until the next step."""
        if not stale_keys and batch.decode_only and self.native is not None:
            logits = self._native_decode(self.native, batch.seqs)
            if logits is not None:
                return list(logits)
        if not stale_keys and batch.decode_only and (self.compiled is not None or self.graphs is not None):
            logits = self.decode(batch.seqs)
            if logits is not None:
                return list(logits)
        ran = [(seq, take) for seq, take in zip(batch.seqs, batch.takes) if take is not None]
        out: dict[int, torch.Tensor] = {}
        if ran:
            hidden, offsets = self.forward([s for s, _ in ran], [t for _, t in ran], stale_keys)
            wanted = [i for i, (s, _) in enumerate(ran) if not s.in_prefill]
            if wanted:
                logits = self.model.logits(hidden[[offsets[i + 1] - 1 for i in wanted]])
                out = {ran[i][0].id: logits[row] for row, i in enumerate(wanted)}
        return [out.get(seq.id) for seq in batch.seqs]

    def forward(
        self, seqs: list[Sequence], takes: list[np.ndarray], stale_keys: bool = False
    ) -> tuple[torch.Tensor, list[int]]:
        """Compute positions takes[i] of seqs[i] (their slots already allocated); the final hidden
        states [N, H] and each sequence's offset into them."""
        specs, ids, offsets = [], [], [0]
        for seq, take in zip(seqs, takes):
            keys = seq.slots[: int(take[-1]) + 1]
            specs.append(SeqAttention(take, keys, self.pool.computed_at[keys] if stale_keys else None))
            ids.append(
                [seq.tokens[-1]] if len(take) == 1 and take[0] == len(seq.tokens) - 1 else np.asarray(seq.tokens)[take]
            )
            offsets.append(offsets[-1] + len(take))
        write = np.concatenate([seq.slots[take] for seq, take in zip(seqs, takes)])
        return self.model(self._batch(np.concatenate(ids), np.concatenate(takes), write, specs, offsets)), offsets

    def prefill(self, tokens: list[int], slots: np.ndarray, max_tokens: int, stale_keys: bool = False) -> None:
        """Compute the rows of `tokens` alone, from position 0, into `slots` (fresh, one per token), at
        most `max_tokens` positions a pass (a published document)."""
        ids = np.asarray(tokens, np.int64)
        for start in range(0, len(ids), max_tokens):
            take = np.arange(start, min(len(ids), start + max_tokens))
            keys = slots[: int(take[-1]) + 1]
            spec = SeqAttention(take, keys, self.pool.computed_at[keys] if stale_keys else None)
            self.model(self._batch(ids[take], take, slots[take], [spec], [0, len(take)]))

    def _batch(
        self,
        token_ids: np.ndarray,
        positions: np.ndarray,
        write: np.ndarray,
        specs: list[SeqAttention],
        offsets: list[int],
    ) -> ForwardBatch:
        """The model's batch on its device: tokens at positions, rows written to `write`, attention
        over the slots each spec names."""
        dev = self.device
        # (cast: Model declares its attention backend `object`; model/base.py says it has this `plan`)
        attention = cast(_AttentionBackend, self.model.attention)
        return ForwardBatch(
            torch.as_tensor(token_ids, device=dev),
            torch.as_tensor(positions, device=dev),
            self.pool.rows,
            torch.as_tensor(write, device=dev),
            attention.plan(specs, offsets, dev),
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)

    def decode(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """The next-token logits [B, vocab] of decoding sequences through the compiled or captured
        step, or None when it does not cover them (the eager path runs them)."""
        step = self.compiled
        if step is not None:
            return self._compiled_decode(step, seqs)
        assert self.graphs is not None, "decode runs only where a compiled or a captured step exists"
        return self._graph_decode(self.graphs, seqs)

    def _native_decode(self, step: native_step.NativeDecode, seqs: list[Sequence]) -> torch.Tensor | None:
        """The native step's logits, for the step classes measured to pay (`NativeDecode.pays`) and at
        most its `max_batch` sequences; else None. Each sequence's slot table is read as it is (a
        shorter one padded with EMPTY_SLOT, which the decode kernel skips)."""
        if len(seqs) > step.max_batch or not step.pays["one" if len(seqs) == 1 else "batch"]:
            return None
        lens = np.fromiter((len(s.tokens) for s in seqs), np.int64, len(seqs))
        if len(seqs) == 1:
            table = seqs[0].slots[None, : lens[0]]
        else:
            table = np.full((len(seqs), int(lens.max())), EMPTY_SLOT, np.int64)
            for i, s in enumerate(seqs):
                table[i, : lens[i]] = s.slots[: lens[i]]
        return step.logits(
            np.fromiter((s.tokens[-1] for s in seqs), np.int64, len(seqs)), lens - 1, table, self.pool.rows
        )

    def _compiled_decode(self, step: CompiledStep, seqs: list[Sequence]) -> torch.Tensor | None:
        """Only the step classes measured to pay here (`CompiledDecode.pays`; else None: eager). A
        sequence alone whose rows sit in consecutive slots is read in place; otherwise (where the
        compiled step covers batches, up to its `max_batch` sequences) their rows are gathered through
        their slot tables, when padding them to one length costs at most PADDING_SLACK times the real
        work."""
        dev = self.device
        lens = np.fromiter((len(s.tokens) for s in seqs), np.int64, len(seqs))
        if not step.pays["one" if len(seqs) == 1 else "batch"]:  # (measured no faster than eager here)
            return None
        if len(seqs) == 1 and consecutive(slots := seqs[0].slots[: lens[0]]):
            hidden = step(
                torch.tensor([seqs[0].tokens[-1]], device=dev),
                torch.tensor(lens - 1, device=dev),
                self.pool.rows,
                int(slots[0]),
                int(lens[0]),
            )
        else:
            t = int(lens.max()) - 1
            if len(seqs) > step.max_batch or len(seqs) * t > PADDING_SLACK * (lens.sum() - len(seqs)):
                return None
            key_slots = np.full((len(seqs), t), EMPTY_SLOT, np.int64)
            for i, s in enumerate(seqs):
                key_slots[i, : lens[i] - 1] = s.slots[: lens[i] - 1]
            write = np.fromiter((s.slots[n - 1] for s, n in zip(seqs, lens)), np.int64, len(seqs))
            hidden = step.batch(
                torch.tensor([s.tokens[-1] for s in seqs], device=dev),
                torch.from_numpy(lens - 1).to(dev),
                torch.from_numpy(key_slots).to(dev),
                self.pool.rows,
                torch.from_numpy(write).to(dev),
            )
        return self.model.logits(hidden)

    def _graph_decode(self, graphs: CapturedStep, seqs: list[Sequence]) -> torch.Tensor | None:
        lens = np.fromiter((len(s.tokens) for s in seqs), np.int64, len(seqs))
        if not graphs.fits(len(seqs), int(lens.max())):
            return None
        return graphs(
            np.fromiter((s.tokens[-1] for s in seqs), np.int64, len(seqs)),
            lens,
            [s.slots[:n] for s, n in zip(seqs, lens)],
        )

    def latents(
        self, tokens: np.ndarray, run: np.ndarray, table: np.ndarray, write: np.ndarray, layer: int
    ) -> torch.Tensor:
        """pic+r's check: layers [0, layer) over positions `run` of `tokens`, their rows written to
        the scratch slots `write`, each attending to the rows `table` names; the latent c_KV
        [len(run), kv_lora_rank] the context gives them at `layer`."""
        batch = self._batch(tokens[run], run, write, [SeqAttention(run, table[: int(run[-1]) + 1])], [0, len(run)])
        # (cast: Model declares neither fresh_rows nor its config's fields; the engine builds pic+r's
        # check, the one caller, only where `supports_recompute`: an MLA family, with kv_lora_rank)
        model = cast(_FreshRowsModel, self.model)
        return model.fresh_rows(batch, layer)[:, : model.config.kv_lora_rank]
