"""Position invariance of cached vectors: the paper's ROC test (paper §ROC).

Content blocks are placed at the positions {0, 512, 1024, 2048, 3584} (scaled to the model's
context), each time after different text. For every token of a block and every layer, the
cosine similarity of its vector at two positions is a positive score; the similarity of that
vector with the vector of the same slot of another block is a negative score. The AUC
(ties = 1/2) says how well "same content" is told from "different content" without a threshold:
1.0 means position never disguises content, 0.5 means it hides it entirely.

Vectors: MLA `c_KV` (latent after kv_a_layernorm), MLA `k_r` (RoPE'd), MLA V (c_KV · W_UV, all
heads) from the engine's own prefill; for a GQA (Llama) model the whole post-RoPE K and V of
every KV head, read from transformers' cache. Paper: c_KV 0.77-0.78, k_r 0.43, GQA K 0.453, V 0.71-0.76.

Layout (n blocks, 5 positions): sequence j holds block (j + i) mod n at position i, other text in
between, so each block is seen at all five positions after different content, in n sequences.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from irminsul.research.eval.metrics import auc, cosine_rows, roc_curve

PAPER_POSITIONS = (0, 512, 1024, 2048, 3584)  # for a 4k context
Sampler = Callable[[np.random.Generator, int], list[int]]


def positions_for(context: int, block: int, head: int = 0) -> tuple[int, ...]:
    """The paper's positions, scaled down when the model's context is shorter than 3584 + block."""
    f = min(1.0, (context - block - head) / PAPER_POSITIONS[-1])
    return tuple(head + int(p * f) for p in PAPER_POSITIONS)


def layout(n: int, positions: tuple[int, ...], blocks: list[list[int]], sample: Sampler, rng, head=()):
    """Yield (sequence ids, [(block index, slot index, start position)]) for the n sequences."""
    for j in range(n):
        ids, placed = list(head), []
        for i, p in enumerate(positions):
            if len(ids) < p:
                ids += sample(rng, p - len(ids))
            b = (j + i) % n
            placed.append((b, i, len(ids)))
            ids += blocks[b]
        yield ids, placed


@torch.no_grad()
def mla_vectors(model, ids: list[int]) -> dict[str, torch.Tensor]:
    """Engine prefill -> {c_kv, k_r, v}: [layers, n, dim] float32."""
    cfg = model.config
    rows = model.new_rows(capacity=len(ids))
    model.prefill(rows, ids, torch.arange(len(ids)))
    r = cfg.kv_lora_rank
    block = rows.rows(model.rotary, len(ids)).float()  # k_r encoded at its position, as the paper reads it
    c = block[..., :r]
    vs = []
    for layer, (attn, _) in enumerate(model.sublayers()):
        w = attn.kv_b_proj.weight.float().view(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, r)
        vs.append(torch.einsum("nr,hvr->nhv", c[layer], w[:, cfg.qk_nope_head_dim :]).flatten(1))
    return {"c_kv": c, "k_r": block[..., r : cfg.latent_width], "v": torch.stack(vs)}


@torch.no_grad()
def gqa_vectors(model, ids: list[int]) -> dict[str, torch.Tensor]:
    """A transformers causal LM's cache -> {k, v}: [layers, n, kv_heads * head_dim] (K post-RoPE)."""
    out = model(input_ids=torch.tensor([ids]), use_cache=True)
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    k = torch.stack([layer.keys[0].transpose(0, 1).flatten(1) for layer in cache.layers]).float()
    v = torch.stack([layer.values[0].transpose(0, 1).flatten(1) for layer in cache.layers]).float()
    return {"k": k, "v": v}


@dataclass
class Collected:
    """Per kind: vectors [n_blocks, n_positions, tokens, layers, dim] of the sampled block tokens."""

    vectors: dict[str, torch.Tensor]

    def scores(self, kind: str, layer: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        x = self.vectors[kind][:, :, :, layer]  # [B, P, T, d]
        n_blocks, n_pos = x.shape[:2]
        pos, neg = [], []
        for i in range(n_pos):
            for j in range(i + 1, n_pos):
                pos.append(cosine_rows(x[:, i].flatten(0, 1), x[:, j].flatten(0, 1)))
                other = torch.as_tensor((np.arange(n_blocks) + rng.integers(1, n_blocks, n_blocks)) % n_blocks)
                neg.append(cosine_rows(x[:, i].flatten(0, 1), x[other, j].flatten(0, 1)))
        return torch.cat(pos).numpy(), torch.cat(neg).numpy()


def collect(
    extract: Callable[[list[int]], dict[str, torch.Tensor]],
    n: int,
    positions,
    blocks,
    sample: Sampler,
    seed: int,
    token_idx: np.ndarray,
    head=(),
    desc: str = "roc",
    progress: bool = True,
) -> Collected:
    rng = np.random.default_rng([seed, 1])
    out: dict[str, torch.Tensor] = {}
    for ids, placed in tqdm(layout(n, positions, blocks, sample, rng, head), total=n, desc=desc, disable=not progress):
        vecs = extract(ids)
        for kind, v in vecs.items():
            if kind not in out:
                out[kind] = torch.zeros(n, len(positions), len(token_idx), v.shape[0], v.shape[-1])
            for b, i, start in placed:
                out[kind][b, i] = v[:, start + token_idx].transpose(0, 1)
    return Collected(out)


def aucs(col: Collected, seed: int) -> tuple[dict, dict]:
    """Per kind: layer-averaged AUC, {per_layer: [...]}, and pooled ROC curves for the plot."""
    summary, curves = {}, {}
    for kind, v in col.vectors.items():
        per_layer, all_pos, all_neg = [], [], []
        for layer in range(v.shape[3]):
            pos, neg = col.scores(kind, layer, np.random.default_rng([seed, layer]))
            per_layer.append(auc(pos, neg))
            all_pos.append(pos)
            all_neg.append(neg)
        summary[kind] = float(np.mean(per_layer))
        summary.setdefault("per_layer", {})[kind] = per_layer
        curves[kind] = roc_curve(np.concatenate(all_pos), np.concatenate(all_neg))
    return summary, curves


@dataclass
class RocResult:
    mla: dict
    gqa: dict
    setup: dict
    curves: dict

    def to_json(self) -> dict:
        return {"mla": self.mla, "gqa": self.gqa, "setup": self.setup}

    def table(self) -> str:
        from irminsul.table import table

        rows = []
        for arch, res in (("mla", self.mla), ("gqa", self.gqa)):
            for kind, per in (res.get("per_layer") or {}).items():
                rows.append([f"{arch} {kind}", f"{res[kind]:.3f}"] + [f"{a:.3f}" for a in per])
            if res.get("missing"):
                rows.append([f"{arch}", "n/a", res["missing"]])
        width = max(len(r) for r in rows)
        rows = [r + [""] * (width - len(r)) for r in rows]
        return table(["vector", "AUC (mean)"] + [f"L{i}" for i in range(width - 2)], rows)

    def plot(self, path: Path) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4.2))
        for name, (fpr, tpr) in self.curves.items():
            arch, kind = name.split(" ")
            ax0.plot(fpr, tpr, label=f"{name} (AUC {(self.mla if arch == 'mla' else self.gqa)[kind]:.3f})")
        ax0.plot([0, 1], [0, 1], color="gray", ls=":")
        ax0.set(xlabel="false positive rate", ylabel="true positive rate", title="same content at another position?")
        ax0.legend(fontsize=7)
        for arch, res in (("mla", self.mla), ("gqa", self.gqa)):
            for kind, per in (res.get("per_layer") or {}).items():
                ax1.plot(range(len(per)), per, marker="o", label=f"{arch} {kind}")
        ax1.axhline(0.5, color="gray", ls=":")
        ax1.set_xticks(range(max(len(p) for r in (self.mla, self.gqa) for p in (r.get("per_layer") or {}).values())))
        ax1.set(xlabel="layer", ylabel="AUC", title="position invariance per layer", ylim=(0, 1.02))
        ax1.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


def run_roc(
    mla_dir: str | Path,
    sample: Sampler,
    gqa_dir: str | Path | None = None,
    n: int = 500,
    block_tokens: int = 64,
    tokens_per_block: int = 16,
    seed: int = 0,
    head=(),
    progress: bool = True,
) -> RocResult:
    from irminsul.model.loader import load_model

    mla = load_model(Path(mla_dir))
    context = mla.config.max_position_embeddings
    positions = positions_for(context, block_tokens, len(head))
    rng = np.random.default_rng([seed, 0])
    blocks = [sample(rng, block_tokens) for _ in range(n)]
    token_idx = np.linspace(0, block_tokens - 1, min(tokens_per_block, block_tokens)).round().astype(int)
    setup = {
        "blocks": n,
        "block_tokens": block_tokens,
        "tokens_per_block": len(token_idx),
        "positions": positions,
        "mla_model": str(mla_dir),
        "gqa_model": str(gqa_dir) if gqa_dir else None,
    }
    col = collect(
        lambda ids: mla_vectors(mla, ids), n, positions, blocks, sample, seed, token_idx, head, "roc mla", progress
    )
    mla_res, curves = aucs(col, seed)
    curves = {f"mla {k}": c for k, c in curves.items()}
    gqa_res: dict = {"k": None, "v": None, "missing": "no GQA model (pass --gqa PATH)"}
    if gqa_dir is not None:
        from transformers import AutoModelForCausalLM

        gqa = AutoModelForCausalLM.from_pretrained(str(gqa_dir), dtype=torch.float32).eval()
        gcol = collect(
            lambda ids: gqa_vectors(gqa, ids), n, positions, blocks, sample, seed, token_idx, head, "roc gqa", progress
        )
        gqa_res, gcurves = aucs(gcol, seed)
        curves |= {f"gqa {k}": c for k, c in gcurves.items()}
    return RocResult(mla_res, gqa_res, setup, curves)
