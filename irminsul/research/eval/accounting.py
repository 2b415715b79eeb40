"""FLOPs and bytes of one forward pass, counted by walking a model's config.

`Arch.from_config` reads an HF `config.json` dict (DeepSeek-V2/V3 -> MLA, Llama/Qwen/Mistral ->
GQA). `forward_flops` counts every matmul of the forward (2 FLOPs per multiply-add), layer by
layer, as the code runs it: MLA in the absorbed form of `irminsul/model/attention.py` (DeepSeek-V3
`inference/model.py`), GQA as transformers' Llama. Elementwise work (norms, RoPE, softmax, SiLU)
is left out, as torch's FlopCounterMode does; tests/research/eval check the count against it.

`forward_bytes` is a traffic model, with its assumptions in the names:
  weights   every weight read once per pass; MoE experts touched by >= 1 token, routing uniform;
  kv_write  computed tokens' cache rows written once;
  kv_read   attention reads the visible rows once per tile of `q_tile` queries (flash-style);
  act       every matmul reads its input and writes its output once.
The rows a hit copies (read + write) and rotates (read + write of the RoPE'd part) are added by
the cost study, which knows the hit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from irminsul.errors import ConfigError
from irminsul.model.config import SUPPORTED_MODEL_TYPES, ModelConfig

# every MLA family the engine loads but LongCat-Flash, whose blocks (two MLA sublayers, two MLPs and a
# shortcut MoE with identity experts) this accounting does not model yet, and DeepSeek-V3.2, whose
# indexer it does not count
MLA_TYPES = tuple(t for t in SUPPORTED_MODEL_TYPES if t not in ("longcat_flash", "deepseek_v32"))
GQA_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass(frozen=True)
class FFN:
    inter: int  # dense SwiGLU width, or one expert's width
    experts: int = 0  # routed experts (0: dense)
    top_k: int = 0
    shared_inter: int = 0  # width of the always-on shared experts together


@dataclass(frozen=True)
class Arch:
    name: str
    kind: str  # "mla" | "gqa"
    layers: int
    hidden: int
    heads: int
    vocab: int
    ffn: tuple[FFN, ...]
    # MLA
    kv_lora_rank: int = 0
    rope: int = 0
    nope: int = 0
    v_head: int = 0
    q_lora: int | None = None
    # GQA
    kv_heads: int = 0
    head_dim: int = 0
    config: ModelConfig | None = None  # MLA: the engine's config, for its attention-form rule

    @classmethod
    def from_config(cls, raw: dict, name: str = "") -> Arch:
        t = raw.get("model_type")
        name = name or t
        if t in MLA_TYPES:
            c = ModelConfig.from_dict(raw)
            ffn = tuple(
                FFN(
                    c.moe_intermediate_size,
                    c.n_routed_experts,
                    c.num_experts_per_tok,
                    c.moe_intermediate_size * c.n_shared_experts,
                )
                if c.is_moe_layer(i)
                else FFN(c.intermediate_size)
                for i in range(c.num_hidden_layers)
            )
            return cls(
                name,
                "mla",
                c.num_hidden_layers,
                c.hidden_size,
                c.num_attention_heads,
                c.vocab_size,
                ffn,
                kv_lora_rank=c.kv_lora_rank,
                rope=c.qk_rope_head_dim,
                nope=c.qk_nope_head_dim,
                v_head=c.v_head_dim,
                q_lora=c.q_lora_rank,
                config=c,
            )
        if t in GQA_TYPES:
            heads = raw["num_attention_heads"]
            head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
            return cls(
                name,
                "gqa",
                raw["num_hidden_layers"],
                raw["hidden_size"],
                heads,
                raw["vocab_size"],
                (FFN(raw["intermediate_size"]),) * raw["num_hidden_layers"],
                kv_heads=raw.get("num_key_value_heads") or heads,
                head_dim=head_dim,
            )
        raise ConfigError(
            f"model_type={t!r}: cost accounting knows MLA ({', '.join(MLA_TYPES)}) and GQA "
            f"({', '.join(GQA_TYPES)}) models"
        )

    @property
    def row_values(self) -> int:
        """Cached values per token per layer: MLA [c_KV | k_r]; GQA K and V of every KV head."""
        return self.kv_lora_rank + self.rope if self.kind == "mla" else 2 * self.kv_heads * self.head_dim

    @property
    def rotated_values(self) -> int:
        """Values a reused row needs corrected: MLA only k_r; GQA its whole K (docs/design.md §2)."""
        return self.rope if self.kind == "mla" else self.kv_heads * self.head_dim

    def linears(self, layer: int) -> list[tuple[int, int, int, int]]:
        """(in, out, used per token, copies) of every weight matmul of a layer: a routed expert
        matrix exists `experts` times and each token uses `top_k` of them; others 1 and 1."""
        h, H = self.hidden, self.heads
        if self.kind == "mla":
            qk = self.nope + self.rope
            q = [(h, H * qk)] if self.q_lora is None else [(h, self.q_lora), (self.q_lora, H * qk)]
            attn = q + [(h, self.kv_lora_rank + self.rope), (H * self.v_head, h)]
        else:
            d = self.head_dim
            attn = [(h, H * d), (h, self.kv_heads * d), (h, self.kv_heads * d), (H * d, h)]
        out = [(i, o, 1, 1) for i, o in attn]
        f = self.ffn[layer]
        if not f.experts:
            return out + [(h, f.inter, 1, 1)] * 2 + [(f.inter, h, 1, 1)]
        out += [(h, f.experts, 1, 1)]  # router
        out += [(h, f.inter, f.top_k, f.experts)] * 2 + [(f.inter, h, f.top_k, f.experts)]
        if f.shared_inter:
            out += [(h, f.shared_inter, 1, 1)] * 2 + [(f.shared_inter, h, 1, 1)]
        return out

    def absorbed(self) -> list[tuple[int, int]]:
        """MLA's per-head kv_b_proj halves (W_UK: nope x r, W_UV: r x v), as (in, out) per head."""
        return [(self.nope, self.kv_lora_rank), (self.kv_lora_rank, self.v_head)] if self.kind == "mla" else []

    def attention_form(self, queries: int, length: int) -> str:
        """MLA: "absorbed" or "expanded", by the engine's own rule (irminsul/model/attention.py)."""
        from irminsul.model.attention import expand_is_cheaper

        if self.kind != "mla":
            return "gqa"
        return "expanded" if queries > 1 and expand_is_cheaper(self.config, queries, length) else "absorbed"

    def attention_flops(self, queries: int, length: int, pairs: float) -> float:
        """One layer's attention over `pairs` (query, visible key) pairs, `length` rows read."""
        H = self.heads
        if self.kind == "gqa":
            return 4.0 * H * self.head_dim * pairs  # q·k and p·v for every query head
        r, qk = self.kv_lora_rank, self.nope + self.rope
        if self.attention_form(queries, length) == "absorbed":  # q_nope·W_UK, q_lat·c_KV + q_pe·k_r, p·c_KV, ·W_UV
            return 2.0 * H * (queries * (self.nope * r + r * self.v_head) + pairs * (2 * r + self.rope))
        # kv_b_proj over every row, then multi-head attention with head dims qk and v
        return 2.0 * H * (length * r * (self.nope + self.v_head) + pairs * (qk + self.v_head))

    def weight_params(self, tokens: int | None = None) -> int:
        """Weights a pass over `tokens` tokens reads (None: all of them). Routed experts are read
        when at least one token picks them; with uniform routing that is 1 - (1 - k/E)^tokens."""
        total = 2 * self.vocab * self.hidden  # embeddings + LM head
        for layer in range(self.layers):
            for i, o, used, copies in self.linears(layer):
                share = 1.0 if tokens is None or copies == 1 else 1 - (1 - used / copies) ** tokens
                total += int(i * o * copies * share)
            total += self.heads * sum(i * o for i, o in self.absorbed())
        return total


@dataclass(frozen=True)
class Pass:
    """One forward pass: queries at `positions`, each seeing `keys[i]` rows (itself included)."""

    positions: np.ndarray
    keys: np.ndarray
    logits: int = 1  # tokens whose LM-head logits are computed

    @classmethod
    def causal(cls, positions, logits: int = 1) -> Pass:
        positions = np.asarray(positions, dtype=np.int64)
        return cls(positions, positions + 1, logits)

    @classmethod
    def dense(cls, positions, logits: int = 1) -> Pass:
        """As the engine's CPU attention runs: every query scores all rows up to the last position."""
        positions = np.asarray(positions, dtype=np.int64)
        return cls(positions, np.full(len(positions), positions.max() + 1), logits)


def forward_flops(a: Arch, p: Pass) -> dict[str, float]:
    m, pairs, length = len(p.positions), float(p.keys.sum()), int(p.keys.max())
    out = {"linear": 0.0, "attention": 0.0, "lm_head": 2.0 * p.logits * a.hidden * a.vocab}
    for layer in range(a.layers):
        out["linear"] += sum(2.0 * m * used * i * o for i, o, used, _ in a.linears(layer))
        out["attention"] += a.attention_flops(m, length, pairs)
    out["total"] = out["linear"] + out["attention"] + out["lm_head"]
    return out


def forward_bytes(a: Arch, p: Pass, dtype_bytes: int = 2, q_tile: int = 128) -> dict[str, float]:
    m = len(p.positions)
    order = np.argsort(p.positions)
    tiles = [order[i : i + q_tile] for i in range(0, m, q_tile)]
    visible = float(sum(p.keys[t].max() for t in tiles))
    act = sum(m * used * (i + o) for layer in range(a.layers) for i, o, used, _ in a.linears(layer))
    length = int(p.keys.max())
    if a.attention_form(m, length) == "expanded":  # per-head K and V written, then read per tile
        expanded = a.heads * (a.nope + a.v_head)
        kv_read = (length * (a.row_values + expanded) + visible * expanded) * a.layers
    else:
        kv_read = visible * a.layers * a.row_values
    out = {
        "weights": float(a.weight_params(m)) * dtype_bytes,
        "kv_write": float(m * a.layers * a.row_values * dtype_bytes),
        "kv_read": float(kv_read) * dtype_bytes,
        "act": float(act) * dtype_bytes,
    }
    out["total"] = sum(out.values())
    return out
