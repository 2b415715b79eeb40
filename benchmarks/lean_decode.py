"""How fast one sequence can decode in eager torch on this CPU: the engine's eager decode step
(`compile_decode=False`) against the same model written as one plain function (no engine, no
modules, no planning), and that function under torch.compile (inductor). The bundled MLA model (V2
layout, greedy MoE), fp32, one thread. (The engine's own compiled step is `model/compiled.py`;
`benchmarks/bench_compiled.py` measures it.)

    python benchmarks/lean_decode.py [--depth 100] [--compile]

The lean function is a measuring stick, not a second engine: it serves one sequence whose rows sit in
consecutive slots and checks it produces the engine's greedy tokens. What separates the engine from it
is the engine's own cost (scheduling, planning, module calls); what separates it from llama.cpp is
eager torch's per-operation cost (issue 11).
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from irminsul import LLM, bundled_model
from irminsul.cli import run_for_people
from irminsul.machine import describe
from irminsul.model.mla import SequenceRows


def lean_step(m):
    """A decode step of model m (packed, V2 layout: no query LoRA, softmax greedy routing) as one function:
    (token [1], position [1], pool [L, S, W], keys t) -> next token; the token's rows go to slot pos + 1."""
    cfg = m.config
    h, r, rope, nope, vd = (cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                            cfg.qk_nope_head_dim, cfg.v_head_dim)
    layers = []
    for i, layer in enumerate(m.model.layers):
        a = layer.self_attn
        w = a.kv_b_proj.weight.view(h, nope + vd, r)
        d = dict(n1=layer.input_layernorm.weight, inp=a.in_proj[0], kvn=a.kv_a_layernorm.weight,
                 wuk=w[:, :nope].contiguous(), wuv=w[:, nope:].transpose(1, 2).contiguous(),
                 o=a.o_proj.weight.t().contiguous(), n2=layer.post_attention_layernorm.weight)
        if cfg.is_moe_layer(i):
            gate_up, down = layer.mlp.stacked()
            d.update(router=layer.mlp.gate.weight.t().contiguous(), gu=gate_up, dn=down,
                     sgu=layer.mlp.shared_experts.gate_up, sdn=layer.mlp.shared_experts.down_proj.weight.t().contiguous())
        else:
            d.update(gu=layer.mlp.gate_up, dn=layer.mlp.down_proj.weight.t().contiguous())
        layers.append(d)
    emb, final, head = m.model.embed_tokens.weight, m.model.norm.weight, m.lm_head.weight.t()
    inv = m.rotary.inv_freq.double()
    eps, k, scale, rs = cfg.rms_norm_eps, cfg.num_experts_per_tok, cfg.softmax_scale, cfg.routed_scaling_factor

    def rms(x, w, e=1e-6):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + e))

    def rot(x, cos, sin):  # interleaved pairs
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * cos - b * sin, b * cos + a * sin), -1).flatten(-2)

    def step(token, pos, pool, t):
        x = emb[token]
        ang = pos.double()[:, None] * inv
        qc, qs = torch.cos(ang).float(), torch.sin(ang).float()
        kang = torch.arange(t).double()[:, None] * inv
        kc, ks = torch.cos(kang).float(), torch.sin(kang).float()
        for i, d in enumerate(layers):
            y = rms(x, d["n1"], eps) @ d["inp"]
            q, kv = y.split([h * (nope + rope), r + rope], -1)
            q = q.view(1, h, nope + rope)
            qn, qp = q[..., :nope], rot(q[..., nope:], qc[:, None], qs[:, None])
            pool[i, pos + 1] = torch.cat([rms(kv[:, :r], d["kvn"]), kv[:, r:]], -1)
            rows = pool[i, 1 : t + 1]
            q_lat = torch.einsum("nhd,hdr->nhr", qn, d["wuk"])[0]
            probs = ((q_lat @ rows[:, :r].t() + qp[0] @ rot(rows[:, r:], kc, ks).t()) * scale).softmax(-1)
            x = x + torch.einsum("hr,hrv->hv", probs @ rows[:, :r], d["wuv"]).reshape(1, h * vd) @ d["o"]
            z = rms(x, d["n2"], eps)
            if "router" in d:
                weights, ids = (z @ d["router"]).softmax(-1).topk(k, -1)
                g, u = torch.bmm(z.expand(k, 1, -1), d["gu"][ids[0]]).chunk(2, -1)
                out = (torch.bmm(F.silu(g) * u, d["dn"][ids[0]])[:, 0] * (weights[0, :, None] * rs)).sum(0, keepdim=True)
                g, u = (z @ d["sgu"]).chunk(2, -1)
                x = x + out + (F.silu(g) * u) @ d["sdn"]
            else:
                g, u = (z @ d["gu"]).chunk(2, -1)
                x = x + (F.silu(g) * u) @ d["dn"]
        return (rms(x, final, eps) @ head).argmax(-1)

    return step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=100)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--compile", action="store_true", help="also time the function under torch.compile")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {describe()}")
    llm = LLM(bundled_model("mla"), compile_decode=False)  # the engine's eager step
    m, cfg = llm.model, llm.model.config
    ids = [300 + (i * 7) % 5000 for i in range(args.depth)]
    llm.generate(ids, max_tokens=4, ignore_eos=True)
    t = time.perf_counter()
    llm.generate(ids, max_tokens=8, ignore_eos=True)
    short = time.perf_counter() - t
    t = time.perf_counter()
    want = llm.generate(ids, max_tokens=8 + args.new, ignore_eos=True).token_ids
    engine = (time.perf_counter() - t - short) / args.new

    def lean(fn) -> float:
        rows = SequenceRows(cfg, torch.float32, "cpu", args.depth + args.new + 16)
        with torch.inference_mode():
            m.prefill(rows, torch.tensor(ids[:-1]), torch.arange(args.depth - 1))
            token, got = fn(torch.tensor(ids[-1:]), torch.tensor([args.depth - 1]), rows.pool, args.depth), []
            got.append(int(token))
            t0 = time.perf_counter()
            for n in range(8 + args.new - 1):
                p = args.depth + n
                token = fn(token, torch.tensor([p]), rows.pool, p + 1)
                got.append(int(token))
            per = (time.perf_counter() - t0) / (8 + args.new - 1)
        assert got == list(want), "the lean step does not reproduce the engine's greedy tokens"
        return per

    step = lean_step(m)
    eager = lean(step)
    print(f"one sequence, {args.depth}-token prompt, {args.new} new tokens, ms a token:")
    print(f"  engine {engine * 1e3:.2f}, one eager function {eager * 1e3:.2f} "
          f"(the engine's own share: {1 - eager / engine:.0%})")
    if args.compile:
        compiled = torch.compile(step, dynamic=True)
        lean(compiled)  # compiles (about a minute here)
        print(f"  the function under torch.compile (inductor, dynamic shapes): {lean(compiled) * 1e3:.2f} "
              f"({eager / lean(compiled):.2f}x eager's speed)")
    return 0


if __name__ == "__main__":
    sys.exit(run_for_people(main, Path(__file__).name))
