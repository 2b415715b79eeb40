"""Decode steps as CUDA graphs, for the triton backend on a GPU.

A decode step of B sequences is a few hundred kernel launches (per layer: norms, projections, the
attention kernel and its combine, the MoE's routing and grouped kernels); on a GPU their launch cost,
not their work, bounds a small batch. As vLLM and SGLang do, the step is captured once per batch
size into a CUDA graph and replayed: one launch per step. A graph replays fixed kernels on fixed
addresses, so the step is written over static buffers:

- every input lives in a buffer made here: tokens, positions, the slots the new rows go to, each
  sequence's slot table (`max_len` keys wide) and its attention tile (`TritonPlan` with one
  decode tile per sequence, `splits` fixed: the attention kernel cuts each tile's keys into that
  many runs itself, so the launch grid does not follow the lengths);
- the batch is padded up to the next captured size (1, 2, 4, 8, then multiples of 8, up to
  `max_batch`); a padding row computes token 0 at position 0 with no keys (its tile has no rows,
  its attention output is 0), writes its rows into slot 0 (which every reader masks) and is
  dropped from the logits;
- nothing in the step reads a device value on the host (no `.item()`, no `nonzero`, no bincount):
  a capture would fail on it. tests/model/test_graphs.py checks that on a CPU too.

The graph itself needs CUDA: on a CPU (Triton's interpreter, tests and `gpu_check.py --tiny`) the
same static step runs uncaptured, so everything but the capture is tested here. Sequences longer
than `max_len`, more than `max_batch` of them and `naive` reuse (keys at the positions they were
computed at) take the engine's eager path; so do DeepSeek-V3.2 (its indexer's top-k in torch) and
LongCat-Flash (its zero-computation experts loop on the host) for now.
"""

from __future__ import annotations

import numpy as np
import torch
from tqdm import tqdm

from irminsul.model.attention import EMPTY_SLOT
from irminsul.model.attention.triton import Tiles, TritonAttention, TritonPlan
from irminsul.model.compiled import built, wanted
from irminsul.model.layers import LongcatMoE
from irminsul.model.mla import ForwardBatch

MAX_BATCH = 128  # the largest captured batch (vLLM's default capture sizes reach 512)
MAX_LEN = 16384  # keys per sequence a captured step covers (longer sequences decode eagerly)


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to max_batch (vLLM's pattern): a batch pads to the next one."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch + 1, 8))
    return sizes if sizes and sizes[-1] == max_batch else sizes + [max_batch]


def supported(model) -> str | None:
    """None if `DecodeGraphs` covers this model, else why not."""
    if not isinstance(getattr(model, "attention", None), TritonAttention):
        return "the triton attention backend (attention_backend='triton')"
    if model.config.index_n_heads:
        return "a model without DeepSeek-V3.2's indexer"
    if any(isinstance(m, LongcatMoE) for m in model.modules()):
        return "MoE layers with the grouped kernel (LongCat-Flash's zero-computation experts loop on the host)"
    return None


def resolve(model, pool: torch.Tensor, compile_decode: bool | None) -> DecodeGraphs | None:
    """The engine's captured decode steps over `pool`, or None (`compiled.wanted` says when; auto
    captures on a GPU only, and True on a CPU runs the uncaptured static step, a test mode)."""
    if not wanted(compile_decode, supported(model), "capturing decode steps as CUDA graphs", model.settings):
        return None
    if compile_decode is None and pool.device.type != "cuda":
        return None  # the interpreter gains nothing from the static step
    return built(
        compile_decode, lambda: DecodeGraphs(model, pool).captured(), "capturing the decode steps as CUDA graphs failed"
    )


class DecodeGraphs:
    def __init__(
        self, model, pool: torch.Tensor, max_batch: int = MAX_BATCH, max_len: int = MAX_LEN, capture: bool | None = None
    ):
        """pool: the engine's rows [layers, slots, width] (its address is captured: one set of graphs
        per pool). capture: None = where CUDA is (else the static step runs as it is)."""
        why = supported(model)
        if why is not None:
            raise ValueError(f"CUDA graphs need {why}")
        self.model, self.pool = model, pool
        dev = pool.device
        self.capture = dev.type == "cuda" if capture is None else capture
        self.sizes = capture_sizes(max_batch)
        self.max_len = min(max_len, model.config.max_position_embeddings)
        b = self.sizes[-1]
        long = dict(dtype=torch.int64, device=dev)
        self.tokens = torch.zeros(b, **long)
        self.positions = torch.zeros(b, **long)
        self.write = torch.zeros(b, **long)  # EMPTY_SLOT for padding rows
        self.key_slots = torch.zeros(b, self.max_len, **long)  # [B, T]; only each row's first `end` are read
        self.end = torch.zeros(b, **long)  # keys per row (its length; 0: padding)
        self.live = torch.zeros(b, **long)  # query rows per tile (1; 0: padding)
        self.index = torch.arange(b, dtype=torch.int32, device=dev)  # tile i = query row i = slot table row i
        # where a replay leaves its logits (one buffer for every size, outside the graphs' memory pool,
        # which a larger graph uses as scratch)
        self.out = torch.zeros(b, model.config.vocab_size, dtype=torch.float32, device=dev)
        # the inputs staged on the host (pinned on a GPU: copied without blocking)
        pinned = dev.type == "cuda"
        self._host_small = torch.zeros(5, b, dtype=torch.int64, pin_memory=pinned)
        self._host_slots = torch.zeros(b * self.max_len, dtype=torch.int64, pin_memory=pinned)
        self._copied = None  # a CUDA event after the last step's copies: the staging is reused after it
        self.table = None  # the RoPE table the graphs read (capture_all)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 2
        # key splits per size: about two programs per SM over the batch (FlashMLA's aim), at most
        # one per SPLIT keys of the longest sequence covered
        cap = max(1, -(-self.max_len // TritonAttention.SPLIT))
        self.splits = {s: min(cap, max(1, -(-2 * sms // s))) for s in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def fits(self, n: int, longest: int) -> bool:
        """Whether n sequences, the longest `longest` keys with the new token's, take a captured step."""
        return n <= self.sizes[-1] and longest <= self.max_len

    def size(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def step(self, size: int) -> torch.Tensor:
        """The static step over the first `size` rows of the buffers -> logits [size, vocab] float32
        (what a graph captures and replays)."""
        i = self.index[:size]
        tiles = Tiles(i, i, self.live[:size].int(), self.end[:size].int(), 1, self.max_len)
        plan = TritonPlan(
            self.positions[:size].int(),
            i.long(),
            self.key_slots[:size],
            None,
            self.max_len - 1,
            [tiles],
            self.splits[size],
        )
        batch = ForwardBatch(self.tokens[:size], self.positions[:size], self.pool, self.write[:size], plan)
        return self.model.logits(self.model(batch))

    def capture_all(self) -> None:
        """Capture one graph per size (largest first, so smaller ones reuse its memory pool, as vLLM
        does); each size is run once first, outside the capture (Triton compiles its kernels on
        first launch). Without CUDA: nothing to capture."""
        dev = self.pool.device
        # NOTE: the table the attention reads, fetched now and held: a graph keeps its address, not the
        # tensor, and the rotary class drops its table when it grows one
        self.table = self.model.rotary.table(self.max_len, dev)
        self._load(np.zeros(0, np.int64), np.zeros(0, np.int64), [])  # every row padding
        if not self.capture:
            return
        with torch.cuda.device(dev):
            mempool = torch.cuda.graph_pool_handle()
            stream = torch.cuda.Stream(dev)
            for size in tqdm(
                sorted(self.sizes, reverse=True), desc="capturing decode graphs", unit="graph", leave=False
            ):
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self.step(size)  # warm-up: kernels compiled, allocator primed
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=mempool):
                    self.out[:size].copy_(self.step(size))
                self.graphs[size] = graph
            torch.cuda.synchronize(dev)
            assert self.model.rotary.table(self.max_len, dev)[0] is self.table[0]

    def captured(self) -> DecodeGraphs:
        self.capture_all()
        return self

    def __call__(self, tokens: np.ndarray, lengths: np.ndarray, slots: list[np.ndarray]) -> torch.Tensor:
        """Decode one token of each of n sequences (`fits`): tokens [n] at positions lengths - 1;
        slots[i]: sequence i's slot table for positions 0..lengths[i]-1 (the last, its new row's)
        -> logits [n, vocab] float32; replayed, a view of the output buffer (valid until the next call)."""
        n = len(tokens)
        size = self.size(n)
        self._load(tokens, lengths, slots)
        if size not in self.graphs:
            return self.step(size)[:n]
        with torch.cuda.device(self.pool.device):
            self.graphs[size].replay()
        return self.out[:n]

    def _load(self, tokens: np.ndarray, lengths: np.ndarray, slots: list[np.ndarray]) -> None:
        """Write a step's inputs into the buffers through the host staging; rows past n become padding."""
        n = len(tokens)
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies have left the staging
        small = self._host_small.numpy()  # tokens, positions, write slots, ends, live
        small[:] = 0  # padding: token 0 at position 0, no keys, no query row ...
        small[0, :n] = tokens
        small[1, :n] = lengths - 1
        small[2, :n] = [s[-1] for s in slots]
        small[2, n:] = EMPTY_SLOT  # ... its rows written where every reader masks them
        small[3, :n] = lengths
        small[4, :n] = 1
        for buf, row in zip((self.tokens, self.positions, self.write, self.end, self.live), self._host_small):
            buf.copy_(row, non_blocking=True)
        if n:  # each row's slots 0..len-1 (the kernel reads no further)
            t = int(lengths.max())
            staged = self._host_slots[: n * t].view(n, t)
            table = staged.numpy()
            for i, s in enumerate(slots):
                table[i, : len(s)] = s
            self.key_slots[:n, :t].copy_(staged, non_blocking=True)
        if self.pool.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
