"""A whole decode step in one native call (model/native/step.c), for float32 MLA models on a CPU.

A decode step of a small model is a few hundred tensor operations, each a few microseconds of
dispatch from Python, and the compiled step (model/compiled.py) still pays its wrappers and guards
per call; llama.cpp pays neither. `NativeDecode` describes the loaded model to the C step once (the
weights it reads where they lie when their rows are contiguous, else a copy laid out so; W_UK per
head as [r, nope]) and then runs B <= `max_batch` decoding sequences per call: their embedding rows
to the final norm, every layer's new pool row written, through the same kernels as the eager path
(gemv.c, mla_decode.c, moe.c, elementwise.c). Any slot table works (content hits included): the
decode kernel reads each sequence's rows where its slot table says.

It computes what `DeepseekModel.forward` computes for the batch, the products' sums in the kernels'
order (tests/model/test_native_step.py checks it against the eager forward pass and greedy tokens).
`resolve` builds it where `unavailable` says nothing against it, and `measure` times it against the
model's eager forward pass of the same tokens (one sequence, and a batch): the engine takes it for a
step class only where it takes at most PAYS of the eager time there (kept with the kernel choices,
per CPU, model shape and thread count), or always with IRMINSUL_NATIVE_STEP=1 (never with 0).
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np
import torch

from irminsul.model import kernel_choice, native
from irminsul.model.attention import CPUAttention
from irminsul.model.compiled import eager_decode
from irminsul.model.deepseek import DecoderLayer, DeepseekModel
from irminsul.model.layers import MLP, MoE

log = logging.getLogger("irminsul.model")
PAYS = 0.95  # the step is taken where it takes at most this share of the eager step's time
# the most sequences one call takes (step.c's batched products keep three outputs' sums of each row on
# the stack; beyond, the compiled step or the eager step's batched products take the batch)
MAX_BATCH = 64

_F = ctypes.POINTER(ctypes.c_float)
_L, _I = ctypes.c_long, ctypes.c_int


class _Layer(ctypes.Structure):
    """step.c's irm_step_layer (field for field; `_check_abi` compares the sizes)."""

    _fields_ = [
        ("in_norm", _F),
        ("in_w", _F),
        ("in_b", _F),
        ("q_norm", _F),
        ("q_b", _F),
        ("kv_norm", _F),
        ("w_uk", _F),
        ("w_uv", _F),
        ("uv_head", _L),
        ("o_w", _F),
        ("o_b", _F),
        ("post_norm", _F),
        ("mlp_gu", _F),
        ("mlp_dn", _F),
        ("mlp_inner", _L),
        ("router", _F),
        ("router_bias", _F),
        ("ex_gu", _F),
        ("ex_dn", _F),
        ("gu0", _L),
        ("gu1", _L),
        ("gu2", _L),
        ("dn0", _L),
        ("dn1", _L),
        ("dn2", _L),
        ("ex_inner", _L),
    ]


class _Model(ctypes.Structure):
    """step.c's irm_step_model."""

    _fields_ = [
        *[(n, _L) for n in ("layers", "hidden", "heads", "nope", "rope", "v", "r", "q_lora")],
        *[(n, _L) for n in ("experts", "topk", "n_group", "topk_group")],
        *[(n, _I) for n in ("sigmoid", "group_limited", "norm_topk", "in_interleaved", "out_interleaved")],
        *[(n, ctypes.c_float) for n in ("routed_scale", "eps", "scale")],
        ("embed", _F),
        ("embed_s0", _L),
        ("embed_s1", _L),
        ("final_norm", _F),
        ("lm_head", _F),
        ("vocab", _L),
        ("layer", ctypes.POINTER(_Layer)),
    ]


def _declare(lib: ctypes.CDLL) -> None:
    if getattr(lib, "_irm_step_declared", False):
        return
    lib.irm_step_sizes.argtypes, lib.irm_step_sizes.restype = [_I], _L
    lib.irm_step_work.argtypes, lib.irm_step_work.restype = [ctypes.POINTER(_Model), _L], _L
    v = ctypes.c_void_p
    lib.irm_decode_step.argtypes = [ctypes.POINTER(_Model), _L, v, v, v, _L, _L, v, _L, v, v, v, v, v, _I]
    lib.irm_decode_step.restype = _I
    # the C structs and these must agree, field for field: a changed struct on one side only is caught here
    if (lib.irm_step_sizes(0), lib.irm_step_sizes(1)) != (ctypes.sizeof(_Model), ctypes.sizeof(_Layer)):
        raise RuntimeError("model/native/step.c's structs and model/native_step.py's disagree")
    lib._irm_step_declared = True


def supported(model) -> str | None:
    """None if `NativeDecode` covers this model, else why not."""
    if not isinstance(model, DeepseekModel):
        return "only the MLA models (DeepseekModel)"
    cfg = model.config
    if cfg.model_type == "longcat_flash" or cfg.index_n_heads or cfg.mla_lora_scale:
        return f"{cfg.model_type} is not covered (LongCat blocks, V3.2's indexer)"
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return "a float32 model on a CPU"
    if not isinstance(model.attention, CPUAttention):
        return "the CPU attention backend"
    if not all(isinstance(layer, DecoderLayer) for layer in model.model.layers):
        return "plain decoder layers"
    if cfg.n_group > 256 or cfg.num_experts_per_tok > 64 or cfg.qk_rope_head_dim % 2:
        return "at most 256 expert groups, 64 experts a token and an even RoPE width"
    return None


def unavailable(model) -> str | None:
    """None if the native step can run here for this model, else why not."""
    why = supported(model)
    if why is None and (model.settings.native_step == "0" or native.library() is None):
        why = "the native kernels (built, and not switched off)"
    return why


def resolve(model) -> NativeDecode | None:
    """The model's native step, where it can run (built once per model, shared by its engines), its
    `pays` measured (or cached) now; None where `unavailable` says why not."""
    if unavailable(model) is not None:
        return None
    step = getattr(model, "_native_step", None)
    if step is None:
        step = model._native_step = NativeDecode(model).judged()
    return step


def _lm_rows(model: DeepseekModel) -> torch.Tensor | None:
    """The LM head's weight [vocab, hidden] with its rows contiguous, where the model holds one."""
    head = model.lm_head.weight
    if head.is_contiguous():
        return head
    if model.config.tie_word_embeddings and model.embed_rows is not None:
        return model.embed_rows
    return None


def _p(t: torch.Tensor | None):
    return ctypes.cast(t.data_ptr(), _F) if t is not None else None


class NativeDecode:
    """Decode steps of B <= `max_batch` sequences in one call to model/native/step.c."""

    def __init__(self, model: DeepseekModel):
        why = supported(model)
        if why is not None:
            raise ValueError(f"the native decode step needs {why}")
        lib = native.library()
        if lib is None:
            raise ValueError("the native decode step needs the native kernels")
        _declare(lib)
        self.lib, self.model = lib, model
        self.max_batch = MAX_BATCH
        self.pays = {"one": True, "batch": True}
        cfg = model.config
        keep: list[torch.Tensor] = []  # every tensor the structs point into

        def held(t: torch.Tensor | None):
            if t is None:
                return None
            t = t.detach()
            keep.append(t)
            return _p(t)

        layers = (_Layer * cfg.num_hidden_layers)()
        heads, nope, v, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        with torch.no_grad():
            for i, block in enumerate(model.model.layers):
                attn, lay = block.self_attn, layers[i]
                q_in = attn._q_in()
                lay.in_norm = held(block.input_layernorm.weight)
                lay.in_w = held(torch.cat([q_in.weight, attn.kv_a_proj_with_mqa.weight]).contiguous())
                if q_in.bias is not None or attn.kv_a_proj_with_mqa.bias is not None:
                    biases = [
                        b if b is not None else torch.zeros(lin.out_features)
                        for lin, b in ((q_in, q_in.bias), (attn.kv_a_proj_with_mqa, attn.kv_a_proj_with_mqa.bias))
                    ]
                    lay.in_b = held(torch.cat(biases).contiguous())
                if cfg.q_lora_rank:
                    lay.q_norm, lay.q_b = held(attn.q_a_layernorm.weight), held(attn.q_b_proj.weight.contiguous())
                lay.kv_norm = held(attn.kv_a_layernorm.weight)
                kv_b = attn.kv_b_proj.weight.contiguous().view(heads, nope + v, r)
                lay.w_uk = held(kv_b[:, :nope].transpose(1, 2).contiguous())  # [heads, r, nope]
                lay.w_uv, lay.uv_head = held(kv_b[:, nope:]), (nope + v) * r  # (views of kv_b: head h's [v, r])
                keep.append(kv_b)
                lay.o_w = held(attn.o_proj.weight.contiguous())
                lay.o_b = held(attn.o_proj.bias)
                lay.post_norm = held(block.post_attention_layernorm.weight)
                mlp = block.mlp
                dense = mlp.shared_experts if isinstance(mlp, MoE) else mlp
                if isinstance(dense, MLP):
                    lay.mlp_gu = held(torch.cat([dense.gate_proj.weight, dense.up_proj.weight]).contiguous())
                    lay.mlp_dn = held(dense.down_proj.weight.contiguous())
                    lay.mlp_inner = dense.gate_proj.weight.shape[0]
                if isinstance(mlp, MoE):
                    gu, dn = mlp.stacked()
                    lay.router = held(mlp.gate.weight.float().contiguous())
                    lay.router_bias = held(mlp.gate.e_score_correction_bias)
                    lay.ex_gu, lay.ex_dn = held(gu), held(dn)
                    lay.gu0, lay.gu1, lay.gu2 = gu.stride()
                    lay.dn0, lay.dn1, lay.dn2 = dn.stride()
                    lay.ex_inner = dn.shape[1]
            embed = model.embed_rows if model.embed_rows is not None else model.model.embed_tokens.weight
            m = _Model(
                layers=cfg.num_hidden_layers,
                hidden=cfg.hidden_size,
                heads=heads,
                nope=nope,
                rope=cfg.qk_rope_head_dim,
                v=v,
                r=r,
                q_lora=cfg.q_lora_rank or 0,
                experts=cfg.n_routed_experts,
                topk=cfg.num_experts_per_tok if cfg.n_routed_experts else 0,
                n_group=cfg.n_group,
                topk_group=cfg.topk_group or 0,
                sigmoid=int(cfg.scoring_func == "sigmoid"),
                group_limited=int(cfg.topk_method != "greedy"),
                norm_topk=int(bool(cfg.norm_topk_prob)),
                in_interleaved=int(model.rotary.in_layout == "interleaved"),
                out_interleaved=int(model.rotary.out_layout == "interleaved"),
                routed_scale=cfg.routed_scaling_factor,
                eps=cfg.rms_norm_eps,
                scale=cfg.softmax_scale,
                embed=held(embed),
                embed_s0=embed.stride(0),
                embed_s1=embed.stride(1),
                final_norm=held(model.model.norm.weight),
                # (the LM head where its rows lie contiguous, or the row-major copy of a tied table: else
                # `logits` leaves it to the model's own)
                lm_head=held(_lm_rows(model)),
                vocab=cfg.vocab_size,
                layer=layers,
            )
        self._keep, self._layers, self._m = keep, layers, m
        self._work = [0] + [int(lib.irm_step_work(ctypes.byref(m), b)) for b in range(1, self.max_batch + 1)]

    def __call__(
        self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, pool: torch.Tensor
    ) -> torch.Tensor:
        """tokens [B] at positions [B]; slots [B, T] each sequence's pool slots by position (0: none; T >
        every position), the new rows written at slots[b, positions[b]] -> final hidden [B, hidden]."""
        return self._run(tokens, positions, slots, pool, False)[0]

    def logits(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, pool: torch.Tensor) -> torch.Tensor:
        """`__call__`'s step, the next-token logits [B, vocab] (float32) instead: the LM head in the same
        call where its weight's rows are contiguous and the model's LM head takes B rows through the
        same product (`Linear.gemv_rows`, measured at load: gemv.c's), else the model's `logits`."""
        in_call = bool(self._m.lm_head) and len(tokens) <= self.model.lm_head.gemv_rows
        hidden, logits = self._run(tokens, positions, slots, pool, in_call)
        return logits if logits is not None else self.model.logits(hidden)

    def _run(self, tokens, positions, slots, pool, with_logits: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, t = slots.shape
        if not (1 <= b <= MAX_BATCH and pool.dtype == torch.float32 and pool.stride(2) == 1):
            raise ValueError(f"the native step takes 1..{MAX_BATCH} sequences over a float32 pool")
        tokens = np.ascontiguousarray(tokens, np.int64)
        positions = np.ascontiguousarray(positions, np.int64)
        slots = np.ascontiguousarray(slots, np.int64)
        cos, sin = self.model.rotary.table(t)
        work = torch.empty(self._work[b])
        hidden = torch.empty(b, self.model.config.hidden_size)
        logits = torch.empty(b, self.model.config.vocab_size) if with_logits else None
        rc = self.lib.irm_decode_step(
            ctypes.byref(self._m),
            b,
            tokens.ctypes.data,
            positions.ctypes.data,
            pool.data_ptr(),
            pool.stride(0),
            pool.stride(1),
            slots.ctypes.data,
            t,
            cos.data_ptr(),
            sin.data_ptr(),
            work.data_ptr(),
            hidden.data_ptr(),
            None if logits is None else logits.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError("the native decode step found no memory for its buffers")
        return hidden, logits

    def judged(self) -> NativeDecode:
        """Sets `pays` and `max_batch` (IRMINSUL_NATIVE_STEP=1: every class up to MAX_BATCH; else
        measured, or cached with the kernel choices)."""
        if self.model.settings.native_step == "1":
            return self
        verdict = kernel_choice._measured(self.key(), "batch_max", self.measure, self.model.settings)
        self.max_batch = max(1, int(verdict["batch_max"]))
        self.pays = {"one": bool(verdict["one"]), "batch": self.max_batch >= 2}
        return self

    def key(self) -> str:
        cfg = self.model.config
        shape = (
            f"{cfg.model_type}|h{cfg.hidden_size}|l{cfg.num_hidden_layers}|heads{cfg.num_attention_heads}"
            f"|kv{cfg.kv_lora_rank}+{cfg.qk_rope_head_dim}|q{cfg.q_lora_rank}|v{cfg.v_head_dim}|i{cfg.intermediate_size}"
            f"|e{cfg.n_routed_experts}x{cfg.moe_intermediate_size}k{cfg.num_experts_per_tok}"
        )
        return f"native-step|{shape}|threads{torch.get_num_threads()}|{native.fingerprint()}"

    def measure(self, keys: int = 256, sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)) -> dict:
        """Where the native step pays here: against the model's eager forward pass of the same tokens
        (its `ForwardBatch`, the attention backend's plan, the native kernels where they run), B
        sequences over scratch rows of `keys` earlier keys each, for each B of `sizes` (interleaved,
        `kernel_choice._time`), a size paying where the step takes at most PAYS of the eager time.
        "one": whether one sequence pays; "batch_max": the largest B >= 2 below which every size
        measured pays (0: none; at large batches the eager step's batched products can be the faster).
        Neither includes the LM head."""
        cfg, model = self.model.config, self.model
        sizes = tuple(n for n in sizes if n <= MAX_BATCH)
        most = max(sizes)
        g = torch.Generator().manual_seed(5)
        pool = torch.randn(cfg.num_hidden_layers, keys + most + 2, cfg.row_width, generator=g) * 0.1
        earlier = np.arange(1, keys + 1)

        def ours(n: int):
            slots = np.stack([np.append(earlier, keys + 1 + i) for i in range(n)])
            return lambda: self(np.arange(5, 5 + n), np.full(n, keys), slots, pool)

        times = {}
        with torch.inference_mode():
            for n in sizes:
                times[n] = kernel_choice._time({"native": ours(n), "eager": eager_decode(model, pool, keys, n)})
        pays = {n: t["native"] <= PAYS * t["eager"] for n, t in times.items()}
        batch_max = 0
        for n in sorted(n for n in sizes if n >= 2):
            if not pays[n]:
                break
            batch_max = n
        log.info(
            "the native decode step against eager ones, %d keys: %s",
            keys,
            "; ".join(f"{n} x {t['native'] * 1e3:.2f} / {t['eager'] * 1e3:.2f} ms" for n, t in times.items()),
        )
        return {"one": pays.get(1, False), "batch_max": batch_max, "times": {str(n): t for n, t in times.items()}}
