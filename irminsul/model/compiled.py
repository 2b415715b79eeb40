"""Decode steps as compiled functions (torch.compile, inductor), for a CPU.

A decode step of a small model is hundreds of tiny tensor operations; in eager torch each costs
microseconds of dispatch, which is what separated the engine from llama.cpp on one request
(`benchmarks/profile_decode.py` counts them; `benchmarks/bench_compiled.py` measures the gain).
Here the model's own forward (`DeepseekModel.hidden`: its decoder layers, MLA and MoE modules) is
compiled once, with dynamic shapes (the key count grows each step, the batch varies), over a
`DecodeBatch`: a batch that hands each layer's new rows back instead of writing them into the pool
and has the torch backend attend over the earlier rows with each token's own row beside them
(`ReferenceAttention.beside`). Inside a graph the MoE takes its decode forms (`MoE.one_token`,
`MoE.dense`). Three graphs:

- one sequence decoding alone whose rows sit in consecutive slots: its rows are read in place
  (`__call__`; with the native kernels, by the native decode attention, as the torch ops' product
  of the probabilities with the strided c_KV rows is slow: `benchmarks/bench_engine.py`'s decode
  shows it), its k experts through their stacked weights;
- one sequence whose rows do not (a content hit shares another run of slots): its rows are gathered
  through its slot table (`batch`, B = 1);
- B >= 2 sequences (`batch`): gathered and masked to each one's length; every expert runs on every
  token, weighted by its routing weight (0 where not chosen), so that no shape depends on routing:
  E / k times the routed products, used where that is at most DENSE_EXPERTS and for at most
  MAX_BATCH sequences (`max_batch`) (beyond, those products cost more than the graph saves).

It computes what the engine's step computes (the same layers, the absorbed attention over
`[c_KV | k_r]` with RoPE at read from the model's own cos/sin tables), and is tested against that
path (tests/engine/test_compiled.py); the engine takes its own path for anything else (prefill,
`naive`, batches whose padding would exceed PADDING_SLACK), and `unavailable` says when none of it
applies. It is on by default where it is available (as vLLM compiles unless told `enforce_eager`),
and by default it is compiled **in the background** (`Compiling`): compiling takes a minute or more
on a small CPU the first time (torch.compile's on-disk caches make a restart quicker), so the eager
path serves from the start and each engine takes the compiled step at its first decode step after
it is ready. Once built, each step class (one sequence, batches) is timed against the model's own
eager forward pass on scratch rows (`CompiledDecode.measure`) and taken only where it pays; the
verdict is cached with the kernel choices (per CPU, model shape, thread count and torch version), so
a later start where neither pays does not compile at all. `LLM(compile_decode=True)` /
`irminsul serve --compile-decode` compiles before the engine serves (and fails if it cannot) and
takes the steps whatever was measured; `LLM(compile_decode=False)` / `--no-compile-decode`, or the
environment variable IRMINSUL_COMPILE_DECODE=0 (the test suite sets it), turn it off. One compiled
step is kept per model and shared by its engines.
"""

from __future__ import annotations

import logging
import threading
import time
import types

import numpy as np
import torch
from tqdm import tqdm

from irminsul.model import kernel_choice, native_ops
from irminsul.model.attention import CPUAttention
from irminsul.model.attention.base import SeqAttention
from irminsul.model.deepseek import DecoderLayer, DeepseekModel
from irminsul.model.layers import MoE
from irminsul.model.mla import ForwardBatch
from irminsul.model.settings import Settings

log = logging.getLogger("irminsul.model")
DENSE_EXPERTS = 4  # the batched step runs every expert when that is at most this many times the routed work
# ... for at most this many sequences: beyond it, running every expert costs more than the graph
# saves (`python benchmarks/bench_compiled.py` measures the step against eager per batch size)
MAX_BATCH = 8
# ... and with the native kernels inside the graph (`CompiledDecode.native`), up to this many: the
# batches of a decode step's size, where the native experts pay (`MoE.native_tokens`)
NATIVE_MAX_BATCH = 64


def supported(model) -> str | None:
    """None if `CompiledDecode` covers this model, else why not."""
    cfg = getattr(model, "config", None)
    if not isinstance(model, DeepseekModel):
        return "only the MLA models (DeepseekModel)"
    if cfg.model_type == "longcat_flash" or cfg.index_n_heads or cfg.mla_lora_scale:
        return f"{cfg.model_type} is not covered (LongCat blocks, V3.2's indexer)"
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return "a float32 model on a CPU"
    if not all(isinstance(layer, DecoderLayer) for layer in model.model.layers):
        return "plain decoder layers"
    mlps = [layer.mlp.shared_experts if isinstance(layer.mlp, MoE) else layer.mlp for layer in model.model.layers]
    if any(getattr(layer.self_attn, "in_proj", None) is None for layer in model.model.layers) or not all(
        mlp is None or mlp.packed for mlp in mlps
    ):
        return "a packed model (DeepseekModel.pack)"
    return None


def unavailable(model) -> str | None:
    """None if the compiled step can run here for this model, else why not."""
    why = supported(model)
    if why is not None:
        return why
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception:  # inductor's InvalidCxxCompiler, or anything else that says "no compiler"
        return "a C++ compiler (g++, or one named by CXX), which torch.compile's CPU backend builds with"
    return None


def wanted(compile_decode: bool | None, why_not: str | None, what: str, settings: Settings) -> bool:
    """Whether to build compiled decode steps (here, or model/graphs.py's). compile_decode: True
    (required: a clear error when `why_not` says they cannot be), False, or None (auto: where they
    can be, unless the model's settings say compile_decode off: IRMINSUL_COMPILE_DECODE=0 when it
    was loaded)."""
    if compile_decode is False or (compile_decode is None and not settings.compile_decode):
        return False
    if why_not is not None:
        if compile_decode:
            raise ValueError(f"{what} needs {why_not}")
        return False
    return True


def built(compile_decode: bool | None, build, failed: str):
    """build()'s result; when it raises (a compiler or a capture that fails), an error if the steps
    were required, else None with a warning: the eager path serves."""
    try:
        return build()
    except Exception as e:
        if compile_decode:
            raise ValueError(f"{failed}: {e}") from e
        log.warning("%s; decoding eagerly: %s", failed, e)
        return None


def resolve(model, compile_decode: bool | None) -> CompiledDecode | Compiling | None:
    """The model's compiled step (`wanted` says when there is one): with compile_decode=True built
    and warmed now; with None (auto) a `Compiling`, built on a thread of its own while the eager
    path serves (or the step itself, when an earlier engine's build has finished)."""
    if not wanted(compile_decode, unavailable(model), "the compiled decode step", model.settings):
        return None
    step = getattr(model, "_compiled_decode", None)
    if isinstance(step, Compiling) and compile_decode:  # required now: wait for the background build
        step = step.wait()
        if step is None:
            raise ValueError("the compiled decode step failed to compile (see the log)")
    if step is None:
        if compile_decode:
            log.info(
                "compiling the decode steps before serving (irminsul serve --no-compile-decode, or "
                "LLM(compile_decode=False), never compiles them)"
            )
            step = built(True, lambda: CompiledDecode(model).warmed(), "the compiled decode step failed to compile")
        else:
            verdict = kernel_choice.known(verdict_key(model), "one", model.settings)
            if verdict is not None and not (verdict["one"] or verdict["batch"]):
                log.info(
                    "the compiled decode steps were measured no faster than eager ones on this CPU for this "
                    "model: not compiled (irminsul serve --compile-decode compiles them anyway)"
                )
                return None
            step = Compiling(model, verdict)
        model._compiled_decode = step
    if compile_decode and isinstance(step, CompiledDecode):  # (required: taken whatever was measured)
        step.pays = {"one": True, "batch": True}
    return step


PAYS = 0.95  # a compiled step is taken where it takes at most this share of the eager step's time


def verdict_key(model) -> str:
    """The cache key of whether compiling pays for this model's shape here (kernel_choice's cache is per
    CPU): the shapes a step's cost follows, the thread count, torch's version and the kernels inside."""
    cfg = model.config
    shape = (
        f"{cfg.model_type}|h{cfg.hidden_size}|l{cfg.num_hidden_layers}|heads{cfg.num_attention_heads}"
        f"|kv{cfg.kv_lora_rank}+{cfg.qk_rope_head_dim}|q{cfg.q_lora_rank}|v{cfg.v_head_dim}|i{cfg.intermediate_size}"
        f"|e{cfg.n_routed_experts}x{cfg.moe_intermediate_size}k{cfg.num_experts_per_tok}|vocab{cfg.vocab_size}"
    )
    native = native_ops.available() and model.settings.native_decode and model.settings.native_moe
    return (
        f"compiled-decode|{shape}|{str(model.dtype).removeprefix('torch.')}|threads{torch.get_num_threads()}"
        f"|torch{torch.__version__}|native{native}|cpp{model.settings.compile_cpp_wrapper}"
    )


def eager_decode(model, pool: torch.Tensor, keys: int, n: int):
    """The model's own eager decode step, as the engine runs it without a compiled or native step (its
    `ForwardBatch`, the attention backend's plan, the native kernels where they run): n sequences at
    position `keys` over the scratch rows in slots 1..keys of `pool`, sequence i's new row to slot
    keys + 1 + i -> a function that runs it (what `CompiledDecode.measure` and model/native_step.py's
    measurement time against)."""
    dev = model.device
    earlier = np.arange(1, keys + 1)
    specs = [SeqAttention(np.array([keys]), np.append(earlier, keys + 1 + i)) for i in range(n)]
    step = ForwardBatch(
        torch.arange(5, 5 + n, device=dev),
        torch.full((n,), keys, device=dev),
        pool,
        torch.arange(keys + 1, keys + 1 + n, device=dev),
        model.attention.plan(specs, list(range(n + 1)), dev),
    )
    return lambda: model(step)


class Compiling:
    """The compiled decode step being built on a thread of its own (`resolve` with compile_decode=None):
    `ready()` is None until it is built (and stays None if the build fails: the eager path serves,
    with a warning), then the step. Engines ask at each decode step, so a build that finishes mid-run
    takes over at the next one."""

    def __init__(self, model: DeepseekModel, verdict: dict | None = None):
        self._model = model
        self._verdict = verdict  # (kernel_choice's cached `CompiledDecode.measure`, or None: measure it)
        self._step: CompiledDecode | None = None
        self._done = threading.Event()
        log.info(
            "compiling the decode steps in the background; decoding eagerly until they are ready "
            "(irminsul serve --compile-decode waits for them before serving, --no-compile-decode never "
            "compiles them)"
        )
        threading.Thread(target=self._build, name="irminsul-compile-decode", daemon=True).start()

    def _build(self) -> None:
        start = time.perf_counter()
        try:
            self._step = built(
                None,
                lambda: CompiledDecode(self._model).warmed(progress=False).judged(self._verdict),
                "the compiled decode step failed to compile",
            )
        finally:
            self._done.set()
        if self._step is not None:
            taken = [what for what, pays in self._step.pays.items() if pays]
            log.info(
                "the compiled decode steps are ready (%.0f s); engines use them from their next decode step for %s",
                time.perf_counter() - start,
                " and ".join({"one": "one sequence", "batch": "batches"}[t] for t in taken)
                or "nothing (measured no faster than eager here)",
            )
            self._model._compiled_decode = self._step  # (later engines take the step itself)

    def ready(self) -> CompiledDecode | None:
        return self._step

    def wait(self, timeout: float | None = None) -> CompiledDecode | None:
        """The step once built (None if the build failed, or `timeout` seconds passed first)."""
        self._done.wait(timeout)
        return self._step


def _own(method):
    """`method` with a code object of its own. Dynamo keeps compiled graphs per code object, guarded
    by the shapes they were built for: with one code object for every CompiledDecode, a process that
    loads models of a ninth shape would hit its recompile limit (8), which fails a fullgraph
    compile, and each step would check its guards against every other model's graphs first. Its own
    code object keeps an instance's graphs its own, and they go with it."""
    f = method.__func__
    code = f.__code__.replace()  # (a new object, equal to the class's)
    return types.MethodType(
        types.FunctionType(code, f.__globals__, f.__name__, f.__defaults__, f.__closure__), method.__self__
    )


class CompiledDecode:
    def __init__(self, model: DeepseekModel):
        why = supported(model)
        if why is not None:
            raise ValueError(f"compiled decode needs {why}")
        self.model = model
        for layer in model.model.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.stacked()  # built now: the compiled step reads `_stacked` as it is
        # fullgraph: a graph break (a call the tracer cannot follow, as a native kernel's) would leave
        # the step in pieces with eager code between them, slower and silently so; it fails instead
        # cpp_wrapper: the graph's calls between its kernels made from C++ instead of Python (inductor's
        # wrapper), ~80 calls a batched step
        # (IRMINSUL_COMPILE_CPP_WRAPPER=0 when the model was loaded: Python's; the model's settings, as
        # the other switches)
        options = {"cpp_wrapper": model.settings.compile_cpp_wrapper}
        self._fn = torch.compile(_own(self._step), dynamic=True, fullgraph=True, options=options)
        self._batch_fn = torch.compile(_own(self._step_batch), dynamic=True, fullgraph=True, options=options)
        cfg = model.config
        # the batched step's attention and routed experts through the native kernels, as torch
        # operators (model/native_ops.py), where they run; else the torch ops and every expert
        self.native = (
            isinstance(model.attention, CPUAttention)
            and native_ops.available()
            and model.settings.native_decode
            and model.settings.native_moe
        )
        for layer in model.model.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.native_graph = self.native
        # the most sequences one compiled step takes: with the native kernels NATIVE_MAX_BATCH; else
        # MAX_BATCH where running every expert costs at most DENSE_EXPERTS times the routed work (small
        # expert counts, as the bundled models'), else 1
        dense_ok = not cfg.n_routed_experts or cfg.n_routed_experts <= DENSE_EXPERTS * cfg.num_experts_per_tok
        self.max_batch = NATIVE_MAX_BATCH if self.native else MAX_BATCH if dense_ok else 1
        # which steps the engine takes compiled: one sequence (`__call__`) and batches (`batch`); all
        # until `judged` by a measurement (compile_decode=None), all when compiling was required
        self.pays = {"one": True, "batch": True}

    def judged(self, verdict: dict | None = None) -> CompiledDecode:
        """Sets `pays` from `verdict` (a cached `measure`), else from measuring now (and caching it
        with the kernel choices, per CPU: a later start that finds neither pays does not compile)."""
        if verdict is None:
            verdict = kernel_choice._measured(verdict_key(self.model), "one", self.measure, self.model.settings)
        self.pays = {"one": bool(verdict["one"]), "batch": bool(verdict["batch"])}
        return self

    def measure(self, keys: int = 256, batch: int = 4) -> dict:
        """Whether each compiled step pays here: the compiled function against the model's own eager
        forward pass of the same tokens (what the engine runs without it: its `ForwardBatch`, the
        attention backend's plan, the native kernels where they run), on scratch rows of `keys`
        earlier keys, one sequence and (where batches are compiled) `batch` sequences (at most
        `max_batch`), interleaved
        (`kernel_choice._time`); a class pays where compiled takes at most PAYS of the eager time.
        Neither includes the LM head, which both paths compute alike."""
        cfg, dev, dtype = self.model.config, self.model.device, self.model.dtype
        g = torch.Generator().manual_seed(5)
        pool = (torch.randn(cfg.num_hidden_layers, keys + batch + 2, cfg.row_width, generator=g) * 0.1).to(dtype)
        cos, sin = self.model.rotary.table(keys + 1, dev)
        token, pos = torch.tensor([5], device=dev), torch.tensor([keys], device=dev)
        rows = pool[:, 0 if self.native else 1 : keys + 1]  # (`__call__`'s view: base 1, keys + 1 keys)
        times = {}
        with torch.inference_mode():
            times["one"] = kernel_choice._time(
                {
                    "compiled": lambda: self._fn(token, pos, rows, cos[: keys + 1], sin[: keys + 1]),
                    "eager": eager_decode(self.model, pool, keys, 1),
                }
            )
            batch = min(batch, self.max_batch)
            if batch >= 2:
                tokens = torch.arange(5, 5 + batch, device=dev)
                at = torch.full((batch,), keys, device=dev)
                slots = torch.arange(1, keys + 1, device=dev)[None].expand(batch, keys).contiguous()
                torch._dynamo.mark_dynamic(pool, 1)
                times["batch"] = kernel_choice._time(
                    {
                        "compiled": lambda: self._batch_fn(tokens, at, slots, pool, cos[: keys + 1], sin[: keys + 1]),
                        "eager": eager_decode(self.model, pool, keys, batch),
                    }
                )
        verdict = {what: t["compiled"] <= PAYS * t["eager"] for what, t in times.items()}
        verdict.setdefault("batch", False)
        log.info(
            "compiled decode steps against eager ones, %d keys: %s",
            keys,
            "; ".join(f"{what} {t['compiled'] * 1e3:.2f} / {t['eager'] * 1e3:.2f} ms" for what, t in times.items()),
        )
        return {**verdict, "times": times}

    def warm_up(self, progress: bool = True) -> None:
        """Compile now, on scratch rows laid out as the pool's (sizes 0 and 1 would be specialised:
        2 and up share the dynamic graphs). Without duck sizing: sizes that happen to be equal here
        (scratch slots and a layer count, say) must not become one size, or a real step recompiles."""
        with (
            torch.fx.experimental._config.patch(use_duck_shape=False),
            torch._dynamo.config.patch(capture_scalar_outputs=True),
        ):  # (`MoE.one_token`'s expert ids)
            self._warm_up(progress)

    def warmed(self, progress: bool = True) -> CompiledDecode:
        self.warm_up(progress)
        return self

    def _warm_up(self, progress: bool) -> None:
        cfg = self.model.config
        dev = self.model.device
        pool = torch.zeros(cfg.num_hidden_layers, 11, cfg.row_width, dtype=self.model.dtype, device=dev)
        steps = [
            lambda: self(torch.tensor([0], device=dev), torch.tensor([2], device=dev), pool, 1, 3),
            # the gathered step: one sequence (its own graph: a size of 1 is specialised)
            lambda: self.batch(
                torch.tensor([0], device=dev),
                torch.tensor([3], device=dev),
                torch.tensor([[1, 2, 3]], device=dev),
                pool,
                torch.tensor([6], device=dev),
            ),
        ]
        if self.max_batch > 1:  # and 2 x 3 keys (distinct sizes, or the graph would assume B == T)
            steps.append(
                lambda: self.batch(
                    torch.tensor([0, 1], device=dev),
                    torch.tensor([3, 2], device=dev),
                    torch.tensor([[1, 2, 3], [4, 5, 0]], device=dev),
                    pool,
                    torch.tensor([6, 7], device=dev),
                )
            )
        # (a minute the first time on a small CPU: people who wait for it see it move)
        for step in tqdm(steps, desc="compiling decode steps", unit="graph", leave=False, disable=not progress):
            step()

    def __call__(
        self, token: torch.Tensor, pos: torch.Tensor, pool: torch.Tensor, base: int, n_keys: int
    ) -> torch.Tensor:
        """token [1] at position pos [1] (= n_keys - 1); the sequence's rows are pool[:, base : base + n_keys],
        the new token's at base + pos -> final hidden [1, hidden]; the token's rows are written."""
        cos, sin = self.model.rotary.table(n_keys, pool.device)
        # NOTE: the compiled function only reads the earlier rows and returns the new ones: a graph that
        # writes into an input (even one row of it) copies that input whole at every step
        # with the native attention the row before the first (base >= 1: slot 0 holds no row) comes too,
        # so that the kernel's slots 1..T of this view are the sequence's keys (its slot 0: "no row")
        first = base - 1 if self.native else base
        with torch.inference_mode():
            hidden, rows = self._fn(token, pos, pool[:, first : base + n_keys - 1], cos[:n_keys], sin[:n_keys])
            pool[:, base + n_keys - 1] = rows[:, 0]
        return hidden

    def batch(
        self, tokens: torch.Tensor, pos: torch.Tensor, key_slots: torch.Tensor, pool: torch.Tensor, write: torch.Tensor
    ) -> torch.Tensor:
        """B <= `max_batch` sequences decoding together: tokens [B] at positions
        pos [B]; key_slots [B, T] the slots of each one's earlier rows (positions 0..pos-1; padding
        masked), write [B] the slots their new rows go to -> final hidden [B, hidden]; rows written."""
        n = max(key_slots.shape[1], int(pos.max())) + 1
        cos, sin = self.model.rotary.table(n, pool.device)
        # NOTE: the pool's slot count is marked dynamic: compiled at warm-up on scratch rows, the graph
        # would otherwise take it for a constant (and recompile, for seconds, on the first real step)
        torch._dynamo.mark_dynamic(pool, 1)
        with torch.inference_mode():
            hidden, rows = self._batch_fn(tokens, pos, key_slots, pool, cos[:n], sin[:n])
            pool[:, write] = rows
        return hidden

    def _step(self, token, pos, old_rows, cos_tab, sin_tab):
        """One sequence; old_rows [layers, T, width]: its rows before the token, read where they lie
        (with the native attention [layers, 1 + T, width]: a row in front, `__call__`)."""
        t = old_rows.shape[1] - (1 if self.native else 0)
        batch = DecodeBatch(token, pos, cos_tab, sin_tab, t, rows=old_rows, native=self.native)
        return self.model.hidden(batch), torch.stack(batch.new_rows)

    def _step_batch(self, tokens, pos, key_slots, pool, cos_tab, sin_tab):
        """B sequences; their earlier rows gathered from the pool through key_slots [B, T]. One sequence
        (rows not in one run of slots, as a content hit leaves them) takes its k experts alone."""
        t = key_slots.shape[1]
        visible = torch.arange(t, device=pos.device)[None, :] < pos[:, None]  # [B, T]
        batch = DecodeBatch(
            tokens, pos, cos_tab, sin_tab, t, pool=pool, key_slots=key_slots, visible=visible, native=self.native
        )
        return self.model.hidden(batch), torch.stack(batch.new_rows)


class DecodeBatch:
    """What the model's layers read of a batch (`ForwardBatch`'s token_ids, positions, memo and attend),
    for B tokens decoding: each layer's new rows [B, width] are kept (`new_rows`, in layer order), and
    attention reads the earlier rows, key j at position j: `rows` [layers, T, width] of one sequence in
    place, or the pool gathered through key_slots [B, T] (`visible` [B, T]: which are real)."""

    def __init__(
        self,
        token_ids,
        positions,
        cos_tab,
        sin_tab,
        t: int,
        rows=None,
        pool=None,
        key_slots=None,
        visible=None,
        native: bool = False,
    ):
        self.token_ids, self.positions = token_ids, positions
        self.native = native  # attention through the native kernel (`CPUAttention.beside_native`)
        self.rows, self.pool, self.key_slots, self.visible = rows, pool, key_slots, visible
        if native and rows is not None:  # one sequence in place: keys 1..T of each layer's [1 + T, width] view
            self.key_slots = torch.arange(1, t + 1, device=token_ids.device)[None]
        self.q_cos_sin = (cos_tab[positions], sin_tab[positions])  # [B, rope/2]
        self.k_cos, self.k_sin = cos_tab[:t], sin_tab[:t]  # [T, rope/2]
        self.new_rows: list[torch.Tensor] = []

    def memo(self, key, compute):
        return self.q_cos_sin if key == "rope" else compute()

    def attend(self, attn, q_nope, q_pe, rows, index=None):
        self.new_rows.append(rows)
        layer = attn.layer
        if self.native:  # (the native kernel reads the pool, or one sequence's run of it, in place)
            pool = self.pool[layer] if self.rows is None else self.rows[layer]
            return attn.backend.beside_native(
                attn, q_nope, q_pe, pool, self.key_slots, rows, self.k_cos, self.k_sin, self.q_cos_sin
            )
        old = self.rows[layer][None] if self.key_slots is None else self.pool[layer][self.key_slots]  # [B, T, width]
        return attn.backend.beside(attn, q_nope, q_pe, old, rows, self.k_cos, self.k_sin, self.q_cos_sin, self.visible)
