"""Decode steps as compiled functions (torch.compile, inductor), for a CPU.

A decode step of a small model is hundreds of tiny tensor operations; in eager torch each costs
microseconds of dispatch, which is what separated the engine from llama.cpp on one request
(`benchmarks/profile_decode.py` counts them; `benchmarks/bench_compiled.py` measures the gain).
Here the decode step is written as one plain function of the model's packed weights and compiled
once, with dynamic shapes (the key count grows each step, the batch varies), in three graphs:

- one sequence decoding alone whose rows sit in consecutive slots: its rows are read in place
  (`__call__`), its k experts through their stacked weights;
- one sequence whose rows do not (a content hit shares another run of slots): its rows are gathered
  through its slot table (`batch`, B = 1);
- B >= 2 sequences (`batch`): gathered and masked to each one's length; every expert runs on every
  token, weighted by its routing weight (0 where not chosen), so that no shape depends on routing:
  E / k times the routed products, used where that is at most DENSE_EXPERTS and for at most
  MAX_BATCH sequences (`max_batch`) (beyond, those products cost more than the graph saves).

It computes what the engine's step computes (the same absorbed attention over `[c_KV | k_r]`, RoPE
at read from the model's own cos/sin tables, the model's router), so it is tested against that
path (tests/engine/test_compiled.py); the engine takes its own path for anything else (prefill,
`naive`, batches whose padding would exceed PADDING_SLACK), and `unavailable` says when none of it
applies. It is on by default where it is available (as vLLM compiles unless told `enforce_eager`):
`LLM(compile_decode=False)` / `irminsul serve --no-compile-decode`, or the environment variable
IRMINSUL_COMPILE_DECODE=0 (the test suite sets it), turn it off. The engine compiles it when it is
built (here 55 s cold, 10 s with torch.compile's on-disk caches warm), so no request waits for it;
one compiled step is kept per model and shared by its engines.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from tqdm import tqdm

from irminsul.model.deepseek import DecoderLayer, DeepseekModel
from irminsul.model.layers import MoE
from irminsul.model.rope import encode_pairwise

log = logging.getLogger("irminsul.model")
DENSE_EXPERTS = 4  # the batched step runs every expert when that is at most this many times the routed work
# ... for at most this many sequences (`python benchmarks/bench_compiled.py`, the bundled model, when
# this was set: compiled 1.1-1.2x eager's speed at 2-8 sequences, 0.95-0.98x at 16, 0.91-1.0x at 32)
MAX_BATCH = 8


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
    if (any(getattr(layer.self_attn, "in_proj", None) is None for layer in model.model.layers)
            or not all(mlp is None or mlp.packed for mlp in mlps)):
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


def wanted(compile_decode: bool | None, why_not: str | None, what: str) -> bool:
    """Whether to build compiled decode steps (here, or model/graphs.py's). compile_decode: True
    (required: a clear error when `why_not` says they cannot be), False, or None (auto: where they
    can be, unless IRMINSUL_COMPILE_DECODE=0)."""
    if compile_decode is False or (compile_decode is None and os.environ.get("IRMINSUL_COMPILE_DECODE") == "0"):
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


def resolve(model, compile_decode: bool | None) -> "CompiledDecode | None":
    """The model's compiled step, built and warmed, or None (`wanted` says when)."""
    if not wanted(compile_decode, unavailable(model), "the compiled decode step"):
        return None
    step = getattr(model, "_compiled_decode", None)
    if step is None:
        log.info("compiling the decode steps (once per model; compile_decode=False skips it)")
        step = built(compile_decode, lambda: CompiledDecode(model).warmed(), "the compiled decode step failed to compile")
        model._compiled_decode = step
    return step


class CompiledDecode:
    def __init__(self, model: DeepseekModel):
        why = supported(model)
        if why is not None:
            raise ValueError(f"compiled decode needs {why}")
        self.model = model
        for layer in model.model.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.stacked()  # built now: the compiled step reads `_stacked` as it is
        self._fn = torch.compile(self._step, dynamic=True)
        self._batch_fn = torch.compile(self._step_batch, dynamic=True)
        cfg = model.config
        # the most sequences one compiled step takes: MAX_BATCH where running every expert costs at
        # most DENSE_EXPERTS times the routed work (small expert counts, as the bundled models'), else 1
        dense_ok = not cfg.n_routed_experts or cfg.n_routed_experts <= DENSE_EXPERTS * cfg.num_experts_per_tok
        self.max_batch = MAX_BATCH if dense_ok else 1

    def warm_up(self) -> None:
        """Compile now, on scratch rows laid out as the pool's (sizes 0 and 1 would be specialised:
        2 and up share the dynamic graphs). Without duck sizing: sizes that happen to be equal here
        (scratch slots and a layer count, say) must not become one size, or a real step recompiles."""
        with torch.fx.experimental._config.patch(use_duck_shape=False), \
                torch._dynamo.config.patch(capture_scalar_outputs=True):  # (`_moe`'s expert ids)
            self._warm_up()

    def warmed(self) -> "CompiledDecode":
        self.warm_up()
        return self

    def _warm_up(self) -> None:
        cfg = self.model.config
        dev = self.model.device
        pool = torch.zeros(cfg.num_hidden_layers, 11, cfg.row_width, dtype=self.model.dtype, device=dev)
        steps = [lambda: self(torch.tensor([0], device=dev), torch.tensor([2], device=dev), pool, 1, 3),
                 # the gathered step: one sequence (its own graph: a size of 1 is specialised)
                 lambda: self.batch(torch.tensor([0], device=dev), torch.tensor([3], device=dev),
                                    torch.tensor([[1, 2, 3]], device=dev), pool, torch.tensor([6], device=dev))]
        if self.max_batch > 1:  # and 2 x 3 keys (distinct sizes, or the graph would assume B == T)
            steps.append(lambda: self.batch(torch.tensor([0, 1], device=dev), torch.tensor([3, 2], device=dev),
                                            torch.tensor([[1, 2, 3], [4, 5, 0]], device=dev), pool,
                                            torch.tensor([6, 7], device=dev)))
        # (a minute the first time on a small CPU: people see it move)
        for step in tqdm(steps, desc="compiling decode steps", unit="graph", leave=False):
            step()

    def __call__(self, token: torch.Tensor, pos: torch.Tensor, pool: torch.Tensor, base: int,
                 n_keys: int) -> torch.Tensor:
        """token [1] at position pos [1] (= n_keys - 1); the sequence's rows are pool[:, base : base + n_keys],
        the new token's at base + pos -> final hidden [1, hidden]; the token's rows are written."""
        cos, sin = self.model.rotary.table(n_keys, pool.device)
        # NOTE: the compiled function only reads the earlier rows and returns the new ones: a graph that
        # writes into an input (even one row of it) copies that input whole at every step
        with torch.inference_mode():
            hidden, rows = self._fn(token, pos, pool[:, base : base + n_keys - 1], cos[:n_keys], sin[:n_keys])
            pool[:, base + n_keys - 1] = rows[:, 0]
        return hidden

    def batch(self, tokens: torch.Tensor, pos: torch.Tensor, key_slots: torch.Tensor, pool: torch.Tensor,
              write: torch.Tensor) -> torch.Tensor:
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
        """One sequence; old_rows [layers, T, width]: its rows before the token, read where they lie."""
        return self._layers(token, pos, lambda i: old_rows[i][None], old_rows.shape[1], cos_tab, sin_tab, None, _moe)

    def _step_batch(self, tokens, pos, key_slots, pool, cos_tab, sin_tab):
        """B sequences; their earlier rows gathered from the pool through key_slots [B, T]. One sequence
        (rows not in one run of slots, as a content hit leaves them) takes its k experts alone."""
        t = key_slots.shape[1]
        visible = torch.arange(t, device=pos.device)[None, :] < pos[:, None]  # [B, T]
        moe = _moe if tokens.shape[0] == 1 else _moe_dense
        return self._layers(tokens, pos, lambda i: pool[i][key_slots], t, cos_tab, sin_tab, visible, moe)

    def _layers(self, token, pos, rows_of, t, cos_tab, sin_tab, visible, moe):
        """The decoder over B new tokens [B] at positions pos [B] -> (final hidden [B, hidden], their
        rows [layers, B, width]). rows_of(layer): their earlier rows [B, T, width], key j at position
        j; `visible` [B, T]: which are real (None: all). The absorbed attention of the engine's step,
        with each token's own key added beside the earlier ones (it is not in the pool yet)."""
        m = self.model
        cfg = m.config
        h, r, nope, rope = (cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim)
        layout = m.rotary.out_layout
        b = token.shape[0]
        x = m.model.embed_tokens.weight[token]  # [B, hidden]
        q_cos, q_sin = cos_tab[pos][:, None], sin_tab[pos][:, None]  # [B, 1, rope/2]: over the heads
        k_cos, k_sin = cos_tab[:t], sin_tab[:t]  # [T, rope/2]
        new_rows = []
        for i, layer in enumerate(m.model.layers):
            attn = layer.self_attn
            y = layer.input_layernorm(x)
            w_in, b_in = attn.in_proj
            y = y @ w_in if b_in is None else torch.addmm(b_in, y, w_in)
            q_in, kv = y.split([y.shape[-1] - cfg.latent_width, cfg.latent_width], dim=-1)
            q = q_in if cfg.q_lora_rank is None else attn.q_b_proj(attn.q_a_layernorm(q_in))
            q = q.view(b, h, nope + rope)
            q_pe = encode_pairwise(m.rotary.to_cache(q[..., nope:]), q_cos, q_sin, layout)  # [B, H, rope]
            c_kv, k_new = attn.kv_a_layernorm(kv[:, :r]), m.rotary.to_cache(kv[:, r:])  # [B, r], [B, rope]
            new_rows.append(torch.cat([c_kv, k_new], dim=-1))
            rows = rows_of(i)  # [B, T, width]
            w = attn.kv_b_proj.weight.view(h, nope + cfg.v_head_dim, r)
            q_lat = torch.bmm(q[..., :nope].transpose(0, 1), w[:, :nope]).transpose(0, 1)  # [B, H, r]: W_UK absorbed
            k_r = encode_pairwise(rows[..., r : r + rope], k_cos, k_sin, layout)  # [B, T, rope]
            k_self = encode_pairwise(k_new, q_cos[:, 0], q_sin[:, 0], layout)  # each token's own key
            scores = torch.bmm(q_lat, rows[..., :r].transpose(1, 2)) + torch.bmm(q_pe, k_r.transpose(1, 2))
            if visible is not None:
                scores = scores.masked_fill(~visible[:, None], float("-inf"))
            own = (q_lat * c_kv[:, None]).sum(-1, keepdim=True) + (q_pe * k_self[:, None]).sum(-1, keepdim=True)
            p = (torch.cat([scores, own], dim=-1) * cfg.softmax_scale).softmax(dim=-1)  # [B, H, T + 1]
            o_lat = torch.bmm(p[..., :-1], rows[..., :r]) + p[..., -1:] * c_kv[:, None]  # [B, H, r]
            o = torch.bmm(o_lat.transpose(0, 1), w[:, nope:].transpose(1, 2)).transpose(0, 1)  # W_UV absorbed
            x = x + attn.o_proj(o.reshape(b, -1))
            z = layer.post_attention_layernorm(x)
            x = x + (moe(layer.mlp, z) if isinstance(layer.mlp, MoE) else layer.mlp.packed_forward(z))
        return m.model.norm(x), torch.stack(new_rows)


def _moe(moe: MoE, x):
    """One token's k experts, each as two products over its own weights in the stack, plus the shared one.
    NOTE: each expert id is read as a number (an unbacked size in the graph, `capture_scalar_outputs`),
    so its weights are views of the stack: indexing the stack by the id tensor would copy the k experts'
    weights at every step (on the bundled model that copy was ~7% of a one-sequence decode)."""
    weights, ids = moe.gate(x)  # [1, k]
    gate_up, down = moe._stacked
    out = None
    for j in range(ids.shape[1]):
        e = ids[0, j].item()
        torch._check(e >= 0)
        torch._check(e < gate_up.shape[0])
        g, u = torch.mm(x, gate_up[e]).chunk(2, dim=-1)
        y = torch.mm(F.silu(g) * u, down[e]) * weights[0, j].to(x.dtype)
        out = y if out is None else out + y
    return out if moe.shared_experts is None else out + moe.shared_experts.packed_forward(x)


def _moe_dense(moe: MoE, x):
    """B tokens through every expert, each weighted by its routing weight (0 where not chosen): static
    shapes, one graph, E / k times the routed products (`max_batch` bounds that)."""
    weights, ids = moe.gate(x)  # [B, k]
    gate_up, down = moe._stacked  # [E, H, 2I], [E, I, H]
    mix = torch.zeros(x.shape[0], gate_up.shape[0], dtype=x.dtype, device=x.device)
    mix = mix.scatter(1, ids, weights.to(x.dtype))  # [B, E] (a token picks an expert at most once)
    g, u = torch.matmul(x[None], gate_up).chunk(2, dim=-1)  # [E, B, I] each
    out = torch.bmm(F.silu(g) * u * mix.t()[..., None], down).sum(0)
    return out if moe.shared_experts is None else out + moe.shared_experts.packed_forward(x)
