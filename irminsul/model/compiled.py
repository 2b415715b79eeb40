"""One sequence's decode step as one compiled function (torch.compile, inductor), for a CPU.

A decode step of a small model is hundreds of tiny tensor operations; in eager torch each costs
microseconds of dispatch, which is what separates the engine from llama.cpp on one request
(`benchmarks/lean_decode.py`). Here the step of the common case (one sequence decoding alone, its
rows in consecutive slots, keys at their own positions) is written as one plain function of the
model's packed weights and compiled once, with dynamic shapes (the key count grows each step).

It computes what the engine's step computes (the same absorbed attention over `[c_KV | k_r]`, RoPE
at read from the model's own cos/sin tables, the model's router), so it is tested against that
path (tests/engine/test_compiled.py); anything it does not cover takes the engine's path:
`unavailable` says why. It is on by default where it is available (as vLLM compiles unless told
`enforce_eager`): `LLM(compile_decode=False)` / `irminsul serve --no-compile-decode`, or the
environment variable IRMINSUL_COMPILE_DECODE=0 (the test suite sets it), turn it off. The engine
compiles it when it is built (seconds with torch.compile's on-disk caches warm, 10-20 s cold), so
no request waits for it; one compiled step is kept per model and shared by its engines.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from irminsul.model.deepseek import DecoderLayer, DeepseekModel
from irminsul.model.layers import MoE
from irminsul.model.rope import encode_pairwise

log = logging.getLogger("irminsul.model")


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


def resolve(model, compile_decode: bool | None) -> "CompiledDecode | None":
    """The model's compiled step, built and warmed, or None. compile_decode: True (required: a clear
    error when unavailable), False, or None (auto: on where available, unless IRMINSUL_COMPILE_DECODE=0)."""
    if compile_decode is False or (compile_decode is None and os.environ.get("IRMINSUL_COMPILE_DECODE") == "0"):
        return None
    why = unavailable(model)
    if why is not None:
        if compile_decode:
            raise ValueError(f"the compiled decode step needs {why}")
        return None
    step = getattr(model, "_compiled_decode", None)
    if step is None:
        log.info("compiling the one-sequence decode step (once per model; compile_decode=False skips it)")
        step = CompiledDecode(model)
        try:
            step.warm_up()
        except Exception as e:  # a compiler that fails: the eager path serves, and says so
            if compile_decode:
                raise ValueError(f"the compiled decode step failed to compile: {e}") from e
            log.warning("the compiled decode step failed to compile; decoding eagerly: %s", e)
            return None
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

    def warm_up(self) -> None:
        """Compile now, on scratch rows laid out as the pool's (three keys: sizes 0 and 1 would be
        specialised, 2 and up share the dynamic graph)."""
        cfg = self.model.config
        dev = self.model.device
        pool = torch.zeros(cfg.num_hidden_layers, 8, cfg.row_width, dtype=self.model.dtype, device=dev)
        self(torch.tensor([0], device=dev), torch.tensor([2], device=dev), pool, 1, 3)

    def __call__(self, token: torch.Tensor, pos: torch.Tensor, pool: torch.Tensor, base: int,
                 n_keys: int) -> torch.Tensor:
        """token [1] at position pos [1] (= n_keys - 1); the sequence's rows are pool[:, base : base + n_keys],
        the new token's at base + pos -> final hidden [1, hidden]; the token's rows are written."""
        cos, sin = self.model.rotary.table(n_keys, pool.device)
        # NOTE: the compiled function only reads the earlier rows and returns the new ones: a graph that
        # writes into an input (even one row of it) copies that input whole at every step
        with torch.inference_mode():
            hidden, rows = self._fn(token, pos, pool[:, base : base + n_keys - 1], cos[:n_keys], sin[:n_keys])
            pool[:, base + n_keys - 1] = rows
        return hidden

    def _step(self, token, pos, old_rows, cos_tab, sin_tab):
        """-> (final hidden [1, hidden], the token's rows [layers, width]); old_rows: the rows before it."""
        m = self.model
        cfg = m.config
        h, r, nope, rope = (cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim)
        layout = m.rotary.out_layout
        x = m.model.embed_tokens.weight[token]  # [1, hidden]
        q_cos, q_sin = cos_tab[pos], sin_tab[pos]  # [1, rope/2]
        k_cos, k_sin = cos_tab[:-1], sin_tab[:-1]
        new_rows = []
        for i, layer in enumerate(m.model.layers):
            attn = layer.self_attn
            y = layer.input_layernorm(x)
            w_in, b_in = attn.in_proj
            y = y @ w_in if b_in is None else torch.addmm(b_in, y, w_in)
            q_in, kv = y.split([y.shape[-1] - cfg.latent_width, cfg.latent_width], dim=-1)
            q = q_in if cfg.q_lora_rank is None else attn.q_b_proj(attn.q_a_layernorm(q_in))
            q = q.view(h, nope + rope)
            q_pe = encode_pairwise(m.rotary.to_cache(q[:, nope:]), q_cos, q_sin, layout)  # [H, rope]
            c_kv, k_new = attn.kv_a_layernorm(kv[:, :r]), m.rotary.to_cache(kv[:, r:])  # [1, r], [1, rope]
            new_rows.append(torch.cat([c_kv, k_new], dim=-1)[0])
            rows = old_rows[i]
            w = attn.kv_b_proj.weight.view(h, nope + cfg.v_head_dim, r)
            q_lat = torch.bmm(q[:, None, :nope], w[:, :nope])[:, 0]  # [H, r]: W_UK absorbed
            k_r = encode_pairwise(rows[:, r:], k_cos, k_sin, layout)
            k_self = encode_pairwise(k_new, q_cos, q_sin, layout)  # the token's own key, at its position
            scores = torch.cat([q_lat @ rows[:, :r].t() + q_pe @ k_r.t(), q_lat @ c_kv.t() + q_pe @ k_self.t()],
                               dim=-1) * cfg.softmax_scale
            p = scores.softmax(dim=-1)
            o_lat = p[:, :-1] @ rows[:, :r] + p[:, -1:] * c_kv  # [H, r]
            o = torch.bmm(o_lat[:, None], w[:, nope:].transpose(1, 2))[:, 0]  # W_UV absorbed
            x = x + attn.o_proj(o.reshape(1, -1))
            z = layer.post_attention_layernorm(x)
            x = x + (_moe(layer.mlp, z) if isinstance(layer.mlp, MoE) else layer.mlp.packed_forward(z))
        return m.model.norm(x), torch.stack(new_rows)


def _moe(moe: MoE, x):
    """One token's k experts as two batched products over their stacked weights, plus the shared one."""
    weights, ids = moe.gate(x)  # [1, k]
    gate_up, down = moe._stacked
    k = ids.shape[1]
    g, u = torch.bmm(x.expand(k, 1, -1), gate_up[ids[0]]).chunk(2, dim=-1)
    out = (torch.bmm(F.silu(g) * u, down[ids[0]])[:, 0] * weights[0, :, None].to(x.dtype)).sum(0, keepdim=True)
    return out if moe.shared_experts is None else out + moe.shared_experts.packed_forward(x)
