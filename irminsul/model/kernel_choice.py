"""Which layout and kernel each of a model's linear products runs: measured on the machine it runs on.

A product x [rows, in] times W [out, in] can run three ways on a CPU, and which is fastest depends on
the processor, the dtype, the shape and the row count, not on a rule: torch's own product over W
stored out-major ([out, in], nn.Linear's layout: `F.linear`), the same over W stored input-major
([in, out]: `x @ W`), or oneDNN's over a copy of W blocked for a given number of rows
(`layers.dnn_weight`). On one CPU input-major and oneDNN stream fastest for float32; on another
bfloat16's input-major reads the LM head at less than half out-major's rate and oneDNN loses to
plain `F.linear` on most products (`python benchmarks/bench_gemv_layout.py` shows a machine's).

So `DeepseekModel.pack` asks `choose()` for each distinct product shape the model has: both dense
layouts are timed at 1, 8, 32 and 256 rows, and oneDNN at 8, 32 and 256 where it applies; each
candidate's first calls are left out (oneDNN builds its kernel then), the candidates are
interleaved and the median of the faster half of several samples is kept (these machines are
shared: a neighbour's burst hits every candidate alike, and only ever adds time). One-row and eight-row products, which stream their weight, are timed over
enough copies that the weights come from as far as the model's own would (its decode bytes, at most
a few times the last-level cache), and a weight larger than `SLICE_BYTES` is timed on a slice of its
output rows (the same per byte, a fraction of the time). The times are cached in a JSON file per
CPU model and torch version (`cache_path`), so a second load measures nothing.

From the times, per shape:
- one dense layout, the one with the least total time over the row counts relative to the best
  (`Choice.layout`); the weight is held once, in it, and its nn.Linear parameters are views of it;
- at most one oneDNN blocked copy, for the block of rows that saves the most time per row, kept only
  where it beats the dense product by `MIN_GAIN` at its own block, and only while all copies together
  stay within `COPY_BUDGET` of the model's weight bytes (the shapes that save the most time per byte
  held first; a routed expert counts for the share of tokens it sees). So weights are held about once.

Products of one and of eight rows (a decode step of one sequence, of a few) have a third
candidate where the weight is out-major: `gemv.product`, a C loop over the weight's rows
(model/native/gemv.c, built for the CPU at first use; faster than F.linear on some shapes of some
CPUs and slower on others, docs/benchmarks.md) (model/gemv.py; a candidate only where `gemv.available()`: the kernel built,
IRMINSUL_GEMV not 0, a float32 or bfloat16 weight). A shape takes it for one row (`Choice.gemv`
1) where it beats the dense product of its layout by `GEMV_GAIN` at one row, and for up to eight
(`Choice.gemv` 8) where it also beats both the dense product and oneDNN's at eight; the dense
layout is chosen with its times counted as the out-major layout's.

`IRMINSUL_KERNEL_CHOICE=fixed` (or `DeepseekModel.pack(kernels="fixed")`) keeps the earlier fixed rule
instead (input-major everywhere; oneDNN copies for 256, 32 and 8 rows of every float32 weight large
enough, `DNN_MIN_MACS`), for comparing. `IRMINSUL_KERNEL_CACHE` names the cache file;
`IRMINSUL_KERNEL_COPIES` the copy budget (a fraction of the weight bytes; 0: no copies). A model reads
them, and IRMINSUL_GEMV, once, when it is loaded (`DeepseekModel.settings`, model/settings.py), and
`choose` and the measurements after it take those settings.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from irminsul.model.settings import Settings

log = logging.getLogger("irminsul.model")

# the fixed rule's threshold: a block of `rows` is copied for a weight where rows x its size reaches
# this many multiply-adds (below, oneDNN's fixed cost per call loses to MKL:
# `python benchmarks/bench_gemv_layout.py`)
DNN_MIN_MACS = 1_500_000
ROWS = (1, 8, 32, 256)  # the row counts timed: a decode step, small and larger batches, a prefill
BLOCKS = (256, 32, 8)  # the row blocks oneDNN copies are made for (layers.DNN_BLOCKS)
MIN_GAIN = 1.15  # a blocked copy must be this much faster than the dense product at its own block
# the one-row kernel must be this much faster than the dense one-row product: a larger margin kept
# F.linear for an LM head on which the engine's decode ran faster with gemv
GEMV_GAIN = 1.05
WIDEN_GAIN = 1.1  # the widened product must be this much faster than its rivals at each count it takes
COPY_BUDGET = 1 / 3  # blocked copies may add at most this fraction of the model's weight bytes
SLICE_BYTES = 32 * 2**20  # larger weights are timed on a slice of their output rows this large...
COMPUTE_SLICE_BYTES = 8 * 2**20  # ... and this large for products of more than STREAM_ROWS rows
SAMPLES = 7  # interleaved samples per candidate (`_typical` of them is kept)
SAMPLE_SECONDS = 0.0005  # a sample runs at least this long (several calls of a small product)
# a candidate whose second call takes this many times the fastest one timed before it is not sampled:
# it cannot be chosen, and on some CPUs it is very slow (torch's bf16 `x @ W` on a CPU without bf16
# instructions multiplies more than an order of magnitude below F.linear's rate: sampling it made a
# realistic model's first load measure for many minutes)
HOPELESS = 8.0
MAX_COPIES = 64  # at most this many copies (smaller weights are then read a little warmer than the model's)
STREAM_ROWS = 8  # products of at most these many rows are timed over rotating copies (they stream)
PROGRESS_AFTER = 1.0  # seconds of measuring expected before a progress bar is shown
GUESSED_FLOPS = 30e9  # a CPU's rate assumed for that estimate only (nothing is chosen by it)
CACHE_VERSION = 7  # 7: bfloat16's widened candidate (6: the gemv candidate is timed at eight rows too)


@dataclass(frozen=True)
class Choice:
    """How one product shape runs: its dense layout ("out": [out, in] as nn.Linear stores it, F.linear;
    "in": [in, out], x @ W), the row blocks it keeps oneDNN copies for (none, one, or for the fixed
    rule all three), and how many rows at most its products take `gemv.product` for (out-major
    only; 0: none, 1: one-row products, STREAM_ROWS: up to that many), and from how many rows on a
    bfloat16 weight's products are widened to float32 (0: never)."""

    layout: str
    blocks: tuple[int, ...] = ()
    gemv: int = 0
    widen: int = 0  # from how many rows on its products run `widen.widened` (bfloat16 only; 0: never)


@dataclass
class Product:
    """A distinct product shape of a model: `count` weights of it, `uses` calls per token of them all
    (a routed expert's share: experts_per_token / experts)."""

    out: int
    inp: int
    dtype: torch.dtype
    count: int = 0
    uses: float = 0.0
    layout: str | None = None  # "out": the weight keeps nn.Linear's layout (others read it as [out, in])
    # False: a shape timed for its choice of kernel only, with no weight of its own to lay out or copy
    # (attention's per-head absorbed products): it takes no oneDNN copy and none of the copy budget
    held: bool = True

    @property
    def key(self) -> tuple[int, int, torch.dtype, str | None]:
        return (self.out, self.inp, self.dtype, self.layout)

    def weight_bytes(self) -> int:
        return self.out * self.inp * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def mode(kernels: str | None, settings: Settings) -> str:
    """ "measured" or "fixed": the argument when given, else the settings' kernel_choice
    (IRMINSUL_KERNEL_CHOICE; default measured)."""
    value = (kernels or settings.kernel_choice or "measured").strip().lower()
    if value in ("fixed", "0", "off", "false", "no"):
        return "fixed"
    if value in ("measured", "1", "on", "true", "yes", "auto"):
        return "measured"
    raise ValueError(f"kernel choice {value!r}: expected 'measured' or 'fixed'")


def dnn_applies(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether oneDNN's blocked products are a candidate: a CPU, oneDNN in this torch, float32, or
    bfloat16 where the CPU has bf16 instructions."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def fixed_choice(out: int, inp: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> Choice:
    """The earlier fixed rule: input-major; oneDNN copies for each block whose rows x weight size reach
    DNN_MIN_MACS, float32 on a CPU only."""
    numel = out * inp
    if (
        torch.device(device).type != "cpu"
        or dtype != torch.float32
        or not torch.backends.mkldnn.is_available()
        or BLOCKS[0] * numel < DNN_MIN_MACS
    ):
        return Choice("in")
    return Choice("in", tuple(b for b in BLOCKS if b * numel >= DNN_MIN_MACS))


# --- the cache ------------------------------------------------------------------------------------


def cpu_key() -> str:
    """What the cache is per: the CPU model and torch's version (its kernels change with it)."""
    from irminsul.machine import cpu_model

    return f"{cpu_model()} | torch {torch.__version__} | mkldnn {torch.backends.mkldnn.is_available()}"


def cache_path(settings: Settings) -> Path:
    """The settings' kernel_cache (IRMINSUL_KERNEL_CACHE), else kernels-<hash of the CPU model>.json in
    the user's cache directory ($XDG_CACHE_HOME or ~/.cache, then irminsul/)."""
    if settings.kernel_cache is not None:
        return settings.kernel_cache
    base = settings.cache_home
    digest = hashlib.sha1(cpu_key().encode()).hexdigest()[:12]
    return base / "irminsul" / f"kernels-{digest}.json"


_memory: dict[str, dict[str, dict[str, float]]] = {}  # this process's measurements, by entry key


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or data.get("cpu") != cpu_key():
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def _write_cache(path: Path, new: dict) -> bool:
    """Merge `new` into the cache file (atomically: a temporary file renamed over it); False, with a
    debug note, where the directory cannot be written (loading goes on, measuring next time too)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = _read_cache(path)
        entries.update(new)
        body = json.dumps({"version": CACHE_VERSION, "cpu": cpu_key(), "entries": entries}, indent=1, sort_keys=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(body)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        return True
    except OSError as e:
        log.debug("kernel choice: cache %s not written (%s); measured again next time", path, e)
        return False


# --- measuring --------------------------------------------------------------------------------------


def stream_bytes(model_bytes: int) -> int:
    """How many weight bytes lie between two uses of one weight when the model decodes: its own decode
    bytes, at most twice the last-level cache (or 64 MiB where unknown): beyond, a weight is cold."""
    llc = 0
    try:
        for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
            size = (index / "size").read_text().strip()
            llc = max(
                llc, int(size[:-1]) * {"K": 2**10, "M": 2**20, "G": 2**30}[size[-1]] if size[-1] in "KMG" else int(size)
            )
    except (OSError, ValueError, KeyError):
        llc = 0
    cap = max(64 * 2**20, 2 * llc)
    return max(1, min(int(model_bytes), cap))


def _bucket(n: int) -> int:
    """A power of two at or above n (cache entries are shared across nearby model sizes)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def measured_rows(out: int, inp: int, dtype: torch.dtype, limit: int = None) -> int:
    """The output rows a weight is timed with: all of them, or a slice of `limit` bytes (SLICE_BYTES),
    of at least 4,096 rows (an input-major slice's rows are as far apart as its width: much narrower
    than the weight, it is not the same product)."""
    limit = SLICE_BYTES if limit is None else limit
    per_row = inp * _itemsize(dtype)
    if out * per_row <= limit:
        return out
    return min(out, max(4096, limit // per_row // 64 * 64))


def entry_key(out: int, inp: int, dtype: torch.dtype, streamed: int, with_gemv: bool = False) -> str:
    return (
        f"{str(dtype).removeprefix('torch.')}|{out}x{inp}|threads{torch.get_num_threads()}|stream{_bucket(streamed)}"
        + (f"|gemv{_gemv_fingerprint()}" if with_gemv else "")
    )


def _gemv_fingerprint() -> str:
    from irminsul.model import native

    return native.fingerprint("gemv.c")  # (another build of that kernel: its times are measured again)


def _candidates(
    w: torch.Tensor, rows: int, copies: int, with_dnn: bool, with_gemv: bool = False
) -> dict[str, Callable[[], object]]:
    """name -> one call of that candidate on `rows` rows, each call on the next of `copies` copies."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, w.shape[1], generator=g).to(w.dtype)
    outs = [w.clone() for _ in range(copies)]  # [out, in]
    ins = [o.t().contiguous() for o in outs]  # [in, out]
    made = {"out": lambda o: F.linear(x, o), "in": lambda i: torch.matmul(x, i)}
    pools = {"out": outs, "in": ins}
    if with_dnn and rows in BLOCKS:
        pools["dnn"] = [torch.ops.mkldnn._reorder_linear_weight(o, rows) for o in outs]
        made["dnn"] = lambda b: torch.ops.mkldnn._linear_pointwise(x, b, None, "none", [], "")
    if with_gemv and rows in (1, STREAM_ROWS):
        from irminsul.model import gemv

        pools["gemv"] = outs
        made["gemv"] = lambda o: gemv.product(x, o)
    if w.dtype == torch.bfloat16 and rows >= STREAM_ROWS:
        from irminsul.model.widen import widened

        pools["widen"] = outs
        made["widen"] = lambda o: widened(x, o)

    def cycle(fn, pool):
        state = {"i": 0}

        def call():
            i = state["i"]
            state["i"] = (i + 1) % len(pool)
            return fn(pool[i])

        return call

    return {name: cycle(made[name], pools[name]) for name in made}


def _time(cands: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Seconds per call of each candidate (`_typical` of its samples): two calls left out (oneDNN builds its kernel on the
    first), then SAMPLES interleaved samples (a different order each round), each of enough calls to
    last SAMPLE_SECONDS; a candidate whose second call is HOPELESS times slower than the fastest before
    it gets that call's time and no samples. (Calls rotate through a candidate's copies across samples, so between two
    uses of one copy all the others are read: a sample need not visit them all.)"""
    calls = {}
    longest = 0.0
    fastest = float("inf")
    hopeless: dict[str, float] = {}
    for name, fn in cands.items():
        fn()
        t = time.perf_counter()
        fn()
        once = max(time.perf_counter() - t, 1e-7)
        if once > HOPELESS * fastest:  # (its second call: the first may build oneDNN's kernel)
            hopeless[name] = once
            continue
        longest, fastest = max(longest, once), min(fastest, once)
        calls[name] = max(1, math.ceil(SAMPLE_SECONDS / once))
    got: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    samples = SAMPLES if longest < 0.002 else max(3, SAMPLES - 2)  # (long calls: less noise each)
    for s in range(samples):
        for name in names[s % len(names) :] + names[: s % len(names)]:
            fn, n = cands[name], calls[name]
            t = time.perf_counter()
            for _ in range(n):
                fn()
            got[name].append((time.perf_counter() - t) / n)
    return {name: _typical(got[name]) if name in got else hopeless[name] for name in cands}


def _typical(samples: list[float]) -> float:
    """The median of the faster half of the samples: a neighbour's work only ever adds time, and on a
    busy machine more than half of them can be hit."""
    fast = sorted(samples)[: (len(samples) + 1) // 2]
    return statistics.median(fast)


def measure(
    out: int, inp: int, dtype: torch.dtype, streamed: int, with_dnn: bool, with_gemv: bool = False
) -> dict[str, dict[str, float]]:
    """{rows: {candidate: seconds per call}} for a product [out, in] of `dtype`, scaled to all of its
    output rows when timed on a slice: products that stream their weight (at most STREAM_ROWS rows) on
    up to SLICE_BYTES of it, over copies that add up to `streamed` bytes; the others, bound by
    arithmetic, on up to COMPUTE_SLICE_BYTES, hot."""
    g = torch.Generator().manual_seed(out * 31 + inp)
    full = measured_rows(out, inp, dtype)
    w_full = (torch.randn(full, inp, generator=g) / inp**0.5).to(dtype)
    result = {}
    with torch.inference_mode():
        for rows in ROWS:
            streams = rows <= STREAM_ROWS
            sub = full if streams else measured_rows(out, inp, dtype, COMPUTE_SLICE_BYTES)
            w = w_full[:sub]
            size = sub * inp * _itemsize(dtype)
            copies = max(1, min(MAX_COPIES, math.ceil(streamed / size))) if streams else 1
            cands = _candidates(w, rows, copies, with_dnn, with_gemv)
            result[str(rows)] = {k: v * out / sub for k, v in _time(cands).items()}
            del cands
    return result


def estimate_seconds(products: list[Product]) -> float:
    """A rough guess of how long measuring these takes (to decide on a progress bar): the 256-row
    products dominate, at GUESSED_FLOPS, each candidate (SAMPLES + 2) times."""
    flops = sum(2 * 256 * measured_rows(p.out, p.inp, p.dtype, COMPUTE_SLICE_BYTES) * p.inp for p in products)
    return flops * 3 * (SAMPLES + 2) / GUESSED_FLOPS + len(products) * 0.1


# --- choosing ---------------------------------------------------------------------------------------


def _dense_layout(times: dict[str, dict[str, float]]) -> str:
    """The dense layout with the least total time over the row counts, each relative to the better one
    (ties: out-major, nn.Linear's own); out-major's one- and eight-row times are the gemv kernel's
    where that was measured and pays (`_gemv_rows`)."""
    gemv_rows = _gemv_rows(times)

    def t_of(rows: str, layout: str) -> float:
        t = times[rows]
        return t["gemv"] if layout == "out" and 0 < int(rows) <= gemv_rows else t[layout]

    score = {
        layout: sum(t_of(r, layout) / min(t_of(r, "out"), t_of(r, "in")) for r in times) for layout in ("out", "in")
    }
    return "in" if score["in"] < score["out"] * 0.98 else "out"


def _gemv_rows(times: dict[str, dict[str, float]]) -> int:
    """How many rows at most `gemv.product` takes: 0 unless it was measured and beats out-major's
    dense one-row product by GEMV_GAIN; STREAM_ROWS where it also beats, at that many rows, the
    dense product and oneDNN's (where measured) by GEMV_GAIN; else 1."""
    one = times.get("1", {})
    if "gemv" not in one or one["gemv"] * GEMV_GAIN >= one["out"]:
        return 0
    few = times.get(str(STREAM_ROWS), {})
    rivals = [few[k] for k in ("out", "dnn") if k in few]
    return STREAM_ROWS if "gemv" in few and rivals and few["gemv"] * GEMV_GAIN < min(rivals) else 1


def _widen_rows(times: dict[str, dict[str, float]], layout: str, blocks: tuple[int, ...] = ()) -> int:
    """From how many rows on `widen.widened` runs: the fewest timed row count (from STREAM_ROWS on)
    from which it beats, at every larger timed count too, the dense product of `layout` and the
    oneDNN copy kept (`blocks`) by WIDEN_GAIN; 0 where it was not measured or never does. (Products of
    at most `Choice.gemv` rows take gemv.product before it.)"""
    counts = [r for r in ROWS if r >= STREAM_ROWS and "widen" in times.get(str(r), {})]
    wins = []
    for r in counts:
        t = times[str(r)]
        rivals = [t[layout]] + [t["dnn"] for b in blocks if b == r and "dnn" in t]
        wins.append(t["widen"] * WIDEN_GAIN < min(rivals))
    for i, r in enumerate(counts):
        if all(wins[i:]):
            return r
    return 0


def _block_saving(times: dict[str, dict[str, float]], layout: str, block: int) -> float:
    """Seconds saved per row (summed over the timed row counts of 8 and more) with one oneDNN copy for
    `block` rows, as layers.dnn_linear runs it alone: blocks of it (a multiple of 256 in one call), a
    rest of at least half a block padded, the rest dense. Negative where it loses."""
    t_block = times[str(block)].get("dnn")
    if t_block is None:
        return float("-inf")
    saved = 0.0
    for rows in (r for r in ROWS if r >= min(BLOCKS)):
        dense = times[str(rows)][layout]
        if rows >= block:
            blocked = rows / block * t_block
        elif 2 * rows >= block:
            blocked = t_block
        else:
            continue
        saved += (dense - blocked) / rows
    return saved


@dataclass
class KernelChoices:
    """The choice for each product shape of a model (`choice`); shapes it was not made for get the
    dense layout measured then and no copy (the copy budget was spent on the known ones)."""

    kernels: str
    choices: dict[tuple[int, int, torch.dtype, str | None], Choice]
    streamed: int = 64 * 2**20
    seconds: float = 0.0  # time spent measuring (0 when every shape was cached)
    forced: Choice | None = None  # every shape's choice (`KernelChoices.every`), for tests and benchmarks
    # the switches they are chosen by (`choose` sets them): where the times of a shape not chosen yet
    # are cached, whether gemv is a candidate
    settings: Settings | None = None

    @classmethod
    def every(cls, layout: str, blocks: tuple[int, ...] = (), gemv: int = 0, widen: int = 0) -> KernelChoices:
        """Choices that give every shape this layout (where the weight's own may change), blocks, gemv
        rows (for the out-major ones) and widened rows."""
        return cls("forced", {}, forced=Choice(layout, blocks, gemv, widen))

    def choice(
        self, out: int, inp: int, dtype: torch.dtype, device: torch.device | str = "cpu", layout: str | None = None
    ) -> Choice:
        """layout="out": a weight that keeps nn.Linear's layout (only its copies are chosen)."""
        key = (out, inp, dtype, layout)
        if key in self.choices:
            return self.choices[key]
        if self.forced is not None:
            layout = layout or self.forced.layout
            c = Choice(layout, self.forced.blocks, self.forced.gemv if layout == "out" else 0, self.forced.widen)
        elif self.kernels == "fixed" or torch.device(device).type != "cpu":
            c = fixed_choice(out, inp, dtype, device)
        else:
            settings = self.settings if self.settings is not None else Settings.from_env()
            times = _times([Product(out, inp, dtype)], self.streamed, False, settings)[key[:3] + (None,)]
            layout = layout or _dense_layout(times)
            c = Choice(layout, gemv=_gemv_rows(times) if layout == "out" else 0, widen=_widen_rows(times, layout))
        self.choices[key] = c
        return c


def _times(
    products: list[Product], streamed: int, progress: bool, settings: Settings
) -> dict[tuple, dict[str, dict[str, float]]]:
    """Each product's measured times: from this process's memory, the settings' cache file, or measured
    now (and written to the cache; a cache that cannot be read or written only means measuring again)."""
    from irminsul.model import gemv

    path = cache_path(settings)
    stored = None
    out: dict[tuple, dict[str, dict[str, float]]] = {}
    todo = []
    for p in products:
        with_gemv = settings.gemv and gemv.available(dtype=p.dtype)
        key = entry_key(p.out, p.inp, p.dtype, streamed, with_gemv)
        if key not in _memory:
            if stored is None:
                stored = _read_cache(path)
            if key in stored:
                _memory[key] = stored[key]
        if key in _memory:
            out[p.key] = _memory[key]
        else:
            todo.append((p, key, with_gemv))
    if todo:
        bar = None
        if progress and estimate_seconds([p for p, _, _ in todo]) > PROGRESS_AFTER:
            from tqdm import tqdm

            bar = tqdm(total=len(todo), desc="measuring linear kernels (once per CPU)", unit="shape", leave=False)
        new = {}
        for p, key, with_gemv in todo:
            times = measure(p.out, p.inp, p.dtype, streamed, dnn_applies(p.dtype), with_gemv)
            _memory[key] = new[key] = out[p.key] = times
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        _write_cache(path, new)
    return out


def _merged(products: list[Product]) -> list[Product]:
    """One Product per key, the counts and uses of its held weights summed (one held weight makes it held)."""
    merged: dict[tuple, Product] = {}
    for p in products:
        count, uses = (p.count, p.uses) if p.held else (0, 0.0)
        if p.key in merged:
            merged[p.key].count += count
            merged[p.key].uses += uses
            merged[p.key].held |= p.held
        else:
            merged[p.key] = Product(p.out, p.inp, p.dtype, count, uses, p.layout, p.held)
    return list(merged.values())


def choose(
    products: list[Product],
    model_bytes: int,
    decode_bytes: int | None = None,
    device: torch.device | str = "cpu",
    kernels: str | KernelChoices | None = None,
    budget: float | None = None,
    progress: bool = True,
    settings: Settings | None = None,
) -> KernelChoices:
    """The choice for each product (`Product`s: the model's distinct shapes with their counts and uses);
    kernels: "measured" / "fixed" (default the settings' kernel_choice, else measured) or KernelChoices
    to use. model_bytes: all the model's weight bytes (the copy budget is a fraction of them);
    decode_bytes: those one decode token reads (how far a weight is streamed from; default model_bytes).
    settings: the switches to choose by (a model's, `DeepseekModel.settings`; default the environment's,
    read now); the choices keep them."""
    if settings is None:
        settings = Settings.from_env()
    if isinstance(kernels, KernelChoices):
        return kernels if kernels.settings is not None else dataclasses.replace(kernels, settings=settings)
    how = mode(kernels, settings)
    if how == "fixed":
        fixed = {p.key: fixed_choice(p.out, p.inp, p.dtype, device) for p in products}
        return KernelChoices("fixed", fixed, settings=settings)
    products = _merged(products)
    if torch.device(device).type != "cpu":  # (a GPU: not measured here; the layout its kernels were written for)
        fixed = {p.key: fixed_choice(p.out, p.inp, p.dtype, device) for p in products}
        return KernelChoices("fixed", fixed, settings=settings)
    streamed = stream_bytes(decode_bytes if decode_bytes is not None else model_bytes)
    if budget is None:
        budget = settings.kernel_copies if settings.kernel_copies is not None else COPY_BUDGET
    start = time.perf_counter()
    times = _times(products, streamed, progress, settings)
    seconds = time.perf_counter() - start
    choices = {}
    offers = []  # (time saved per token per byte held, product, block)
    for p in products:
        t = times[p.key]
        layout = p.layout or _dense_layout(t)
        choices[p.key] = Choice(layout, gemv=_gemv_rows(t) if layout == "out" else 0)
        paying = [
            b
            for b in BLOCKS
            if t[str(b)].get("dnn") is not None
            and t[str(b)][layout] >= MIN_GAIN * t[str(b)]["dnn"]
            and _block_saving(t, layout, b) > 0
        ]
        if paying and p.held:
            best = max(paying, key=lambda b: _block_saving(t, layout, b))
            offers.append((_block_saving(t, layout, best) * p.uses / (p.weight_bytes() * p.count), p, best))
    room = budget * model_bytes
    for _, p, block in sorted(offers, key=lambda o: -o[0]):
        extra = p.weight_bytes() * p.count
        if extra <= room:
            room -= extra
            choices[p.key] = Choice(choices[p.key].layout, (block,), choices[p.key].gemv)
    for p in products:
        c = choices[p.key]
        choices[p.key] = Choice(c.layout, c.blocks, c.gemv, _widen_rows(times[p.key], c.layout, c.blocks))
    return KernelChoices(how, choices, streamed, seconds, settings=settings)


# --- the routed experts: at which token counts the native kernel runs, what the loop costs ------------

EXPERT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # the token counts the native experts are timed at
EXPERT_CALL_LIMIT_S = 0.5  # counts past the first whose faster path takes longer are not timed (torch's)


def expert_bucket(tokens: int) -> int | None:
    """The EXPERT_TOKENS count a call of `tokens` tokens is judged by (the next one up; None past them)."""
    return next((n for n in EXPERT_TOKENS if n >= tokens), None)


def native_experts_counts(moe, dtype: torch.dtype, kernels: str | None = None) -> tuple[int, ...]:
    """The EXPERT_TOKENS counts at which an MoE layer's routed experts run faster through its native
    kernel (`MoE._native`) than through its own torch path (`MoE.torch_experts`): measured on this
    machine, at torch's thread count, on the layer's own weights with random routing. Every count is
    timed (which wins need not be monotone in the count: on a CPU without bf16 instructions the bf16
    kernel loses at one token, where torch's product streams the same weights, and wins at eight),
    until both paths' calls take EXPERT_CALL_LIMIT_S (larger counts are then left to torch). Empty where the
    kernel does not run here. Cached per CPU (`cache_path`), keyed by the layer's shape, the thread
    count and the kernel's build (the cache named by the layer's settings). The fixed rule
    (kernels="fixed" / the layer's settings' kernel_choice) and forced choices take every count up to
    `MoE.NATIVE_TOKENS`, unmeasured."""
    kernel = moe.native_kernel(dtype)
    if kernel is None:
        return ()
    if (
        kernels == "forced" or mode(kernels, moe.settings) == "fixed"
    ):  # (forced: `KernelChoices.every`, for comparisons)
        return tuple(n for n in EXPERT_TOKENS if n <= moe.NATIVE_TOKENS)
    from irminsul.model import native

    gate_up, down = moe.stacked()
    experts, hidden, inner2 = gate_up.shape
    k = moe.gate.cfg.num_experts_per_tok
    key = (
        f"experts|{str(dtype).removeprefix('torch.')}|{experts}x{hidden}x{inner2 // 2}|k{k}"
        f"|layout{gate_up.stride(2) == 1}{down.stride(2) == 1}|threads{torch.get_num_threads()}"
        f"|moe{native.fingerprint('moe.c')}|limit{EXPERT_CALL_LIMIT_S}"
    )

    def measure() -> dict:
        g = torch.Generator().manual_seed(experts * 131 + hidden)
        wins, times = [], {}
        with torch.inference_mode():
            for n in EXPERT_TOKENS:
                x = torch.randn(n, hidden, generator=g).to(dtype)
                ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)])
                weights = torch.rand(n, k, generator=g).softmax(-1)
                t = _time(
                    {
                        "native": lambda x=x, w=weights, i=ids: kernel(x, w, i, gate_up, down),
                        "torch": lambda x=x, w=weights, i=ids: moe.torch_experts(x, w, i),
                    }
                )
                times[str(n)] = t
                if t["native"] <= t["torch"]:
                    wins.append(n)
                if min(t.values()) > EXPERT_CALL_LIMIT_S:
                    break
        log.info("native experts %s: at %s tokens (measured)", key.split("|threads")[0], wins or "no count")
        return {"wins": wins, "times": times}

    return tuple(_measured(key, "wins", measure, moe.settings)["wins"])


def expert_costs(moe, dtype: torch.dtype) -> tuple[float, float]:
    """(seconds of one call of the expert loop on one row, multiply-adds per second of the grouped
    batched product) for an MoE layer on this machine, at torch's thread count: what `MoE._padding_pays`
    weighs (the loop's calls against the grouped product's padding rows). Timed on the layer's own
    weights, cached per CPU as the other times are."""
    gate_up, down = moe.stacked()
    experts, hidden, inner2 = gate_up.shape
    key = (
        f"expert-costs|{str(dtype).removeprefix('torch.')}|{experts}x{hidden}x{inner2 // 2}"
        f"|layout{gate_up.stride(2) == 1}{down.stride(2) == 1}|threads{torch.get_num_threads()}"
    )

    def measure() -> dict:
        g = torch.Generator().manual_seed(experts * 7 + hidden)
        rows = 32  # a grouped batch's rows per expert
        with torch.inference_mode():
            one = torch.randn(1, hidden, generator=g).to(dtype)
            ids, weights = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1)
            batch = torch.randn(experts, rows, hidden, generator=g).to(dtype)
            t = _time(
                {
                    "loop": lambda: moe.loop_experts(one, weights, ids),
                    "grouped": lambda: torch.bmm(torch.bmm(batch, gate_up)[..., : inner2 // 2], down),
                }
            )
        return {"loop_call_s": t["loop"], "macs_per_s": experts * rows * 3 * hidden * (inner2 // 2) / t["grouped"]}

    entry = _measured(key, "loop_call_s", measure, moe.settings)
    return float(entry["loop_call_s"]), float(entry["macs_per_s"])


def known(key: str, field: str, settings: Settings) -> dict | None:
    """The cache entry `key` (this process's, else the settings' cache file's) when it holds `field`,
    else None: what `_measured` would return without measuring."""
    cached = _memory.get(key) or _read_cache(cache_path(settings)).get(key)
    return cached if cached is not None and field in cached else None


def _measured(key: str, field: str, measure, settings: Settings) -> dict:
    """The cache entry `key` (this process's, else the settings' cache file's) when it holds `field`,
    else `measure()`'s, kept in both."""
    cached = _memory.get(key) or _read_cache(cache_path(settings)).get(key)
    if cached is not None and field in cached:
        return cached
    entry = measure()
    _memory[key] = entry
    _write_cache(cache_path(settings), {key: entry})
    return entry


# --- the choices, described ----------------------------------------------------------------------------


def describe(p: KernelChoices) -> list[str]:
    """One line per shape: its choice (for logs and benchmarks)."""
    lines = []
    for (out, inp, dtype, _), c in sorted(p.choices.items(), key=lambda kv: (str(kv[0][2]), -kv[0][0] * kv[0][1])):
        blocks = ", ".join(f"oneDNN x{b}" for b in c.blocks) or "no copy"
        lines.append(
            f"[{out}, {inp}] {str(dtype).removeprefix('torch.')}: {c.layout}-major, {blocks}"
            + ("" if not c.gemv else ", gemv for one row" if c.gemv == 1 else f", gemv for up to {c.gemv} rows")
            + (f", widened to float32 from {c.widen} rows" if c.widen else "")
        )
    return lines
