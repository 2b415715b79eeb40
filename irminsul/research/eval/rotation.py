"""How exact is the δ-rotation of a cached `k_r`? (docs/design.md §2)

RoPE composes, so `R(δ)·k_r(p)` equals `k_r(p + δ)` up to rounding (paper: relative L2 error
4.7e-3 in bf16). Two questions, measured on the engine's own code path (`Rotary.apply` to cache,
`Rotary.rotate` to move):

- layer 0, where a token's pre-rotation key depends only on the token (its input is the
  embedding), so the rotated row can be compared with the row computed at the target position:
  pure rounding, for δ up to 1e5, in fp32 and bf16; on the bundled model's real embeddings and on
  random DeepSeek-V2-Lite-shaped layers (576-wide rows, YaRN factor 40);
- every layer, where the cached copy was computed after other content: the error against the row
  computed in the new context splits into rotation (rotated row vs. the same hidden state encoded
  at the target) and context drift (same position, hidden state from the old vs. the new context).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from irminsul.model.config import ModelConfig
from irminsul.model.loader import load_model
from irminsul.model.rope import Rotary
from irminsul.research.eval.metrics import rel_l2
from irminsul.research.eval.shapes import DEEPSEEK_V2_LITE

DELTAS = (1, 10, 100, 1_000, 10_000, 100_000)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def rotation_error(rotary: Rotary, k_raw: torch.Tensor, p_src: torch.Tensor, delta: int, dtype: torch.dtype) -> float:
    """Cache k_raw [n, rope] at p_src in `dtype`, rotate by δ; relative L2 against encoding at p_src + δ."""
    k = k_raw.to(dtype)
    moved = rotary.rotate(rotary.apply(k, p_src), delta)
    return rel_l2(moved, rotary.apply(k, p_src + delta))


def layer0_keys(model, ids: torch.Tensor) -> torch.Tensor:
    """Pre-rotation k_r [n, rope] of layer 0 for tokens `ids` (a function of the token alone)."""
    attn, norm = model.sublayers()[0]
    with torch.inference_mode():
        x = norm(model.model.embed_tokens(ids))
        return attn.kv_a_proj_with_mqa(x)[:, model.config.kv_lora_rank :].float()


def random_v2_lite_keys(n: int, seed: int) -> tuple[Rotary, torch.Tensor]:
    """A random DeepSeek-V2-Lite-shaped kv_a projection (2048 -> 512 + 64) applied to random states."""
    cfg = ModelConfig.from_dict(DEEPSEEK_V2_LITE)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cfg.hidden_size, generator=g)
    w = torch.randn(cfg.hidden_size, cfg.row_width, generator=g) / cfg.hidden_size**0.5
    return Rotary(cfg.rope), (x @ w)[:, cfg.kv_lora_rank :]


def by_delta(rotary: Rotary, k_raw: torch.Tensor, max_position: int, seed: int, deltas=DELTAS) -> dict:
    """{δ: {fp32, bf16}} with source positions drawn below max_position - δ (at least [0, 1024))."""
    rng = np.random.default_rng(seed)
    out = {}
    for d in deltas:
        hi = max(1024, max_position - d)
        p = torch.as_tensor(rng.integers(0, hi, len(k_raw)))
        out[d] = {name: rotation_error(rotary, k_raw, p, d, dt) for name, dt in DTYPES.items()}
    return out


def _pooled(table: dict) -> dict:
    return {f"{name}_rel_l2": float(np.mean([v[name] for v in table.values()])) for name in DTYPES} | {
        f"{name}_max_rel_l2": float(max(v[name] for v in table.values())) for name in DTYPES
    }


class KeyRecorder:
    """Forward hooks that keep each layer's pre-rotation kv_a projection output [n, r + rope]."""

    def __init__(self, model):
        self.out: dict[int, torch.Tensor] = {}
        self.handles = [
            attn.kv_a_proj_with_mqa.register_forward_hook(self._hook(i))
            for i, (attn, _) in enumerate(model.sublayers())
        ]

    def _hook(self, i):
        def hook(module, args, output):
            self.out[i] = output.detach().float()

        return hook

    def close(self):
        for h in self.handles:
            h.remove()


def context_rows(model, ids: list[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Full prefill of ids: (cached rows [L, n, r + rope], pre-rotation projections per layer)."""
    rec = KeyRecorder(model)
    try:
        rows = model.new_rows(capacity=len(ids))
        model.prefill(rows, ids, torch.arange(len(ids)))
    finally:
        rec.close()
    return rows.rows(model.rotary, len(ids)), rec.out


def drift_pair(model, content: list[int], before_a: list[int], before_b: list[int]) -> list[dict]:
    """Content cached after `before_a`, requested after `before_b`: per-layer error parts."""
    cfg, rot = model.config, model.rotary
    r, a, b, n = cfg.kv_lora_rank, len(before_a), len(before_b), len(content)
    rows_a, raw_a = context_rows(model, before_a + content)
    rows_b, _ = context_rows(model, before_b + content)
    delta = b - a
    p_tgt = torch.arange(b, b + n)
    out = []
    for layer in range(cfg.num_hidden_layers):
        k_a = rows_a[layer, a:, r : cfg.latent_width]  # [n, rope] as cached (model dtype)
        k_b = rows_b[layer, b:, r : cfg.latent_width]
        moved = rot.rotate(k_a, delta)
        k_a_at_tgt = rot.apply(raw_a[layer][a:, r:].to(k_a.dtype), p_tgt)  # old context, new position
        out.append(
            {
                "rotation": rel_l2(moved, k_a_at_tgt),
                "drift": rel_l2(k_a_at_tgt, k_b),
                "total": rel_l2(moved, k_b),
                "c_kv_drift": rel_l2(rows_a[layer, a:, :r], rows_b[layer, b:, :r]),
            }
        )
    return out


@dataclass
class RotationResult:
    layer0: dict
    per_layer: list
    v2_lite: dict
    model: str

    def to_json(self) -> dict:
        return {"layer0": self.layer0, "per_layer": self.per_layer, "v2_lite": self.v2_lite}

    def table(self) -> str:
        from irminsul.table import table

        rows = [
            [
                f"{d:,}",
                f"{self.layer0['by_delta'][d]['fp32']:.2e}",
                f"{self.layer0['by_delta'][d]['bf16']:.2e}",
                f"{self.v2_lite['by_delta'][d]['fp32']:.2e}",
                f"{self.v2_lite['by_delta'][d]['bf16']:.2e}",
            ]
            for d in self.layer0["by_delta"]
        ]
        t1 = table(["δ", "model L0 fp32", "model L0 bf16", "V2-Lite fp32", "V2-Lite bf16"], rows)
        rows = [
            [r["layer"]]
            + [f"{r[f'{k}_{dt}']:.2e}" for dt in DTYPES for k in ("rotation", "drift", "total")]
            + [f"{r['c_kv_drift_fp32']:.2e}"]
            for r in self.per_layer
        ]
        t2 = table(
            ["layer"] + [f"{k} {dt}" for dt in DTYPES for k in ("rotation", "drift", "total")] + ["c_KV drift fp32"],
            rows,
        )
        return (
            f"layer 0 (exact comparison), relative L2 of R(δ)·k_r vs k_r at p+δ:\n\n{t1}\n\n"
            f"every layer, content re-requested after different text (model {self.model}):\n\n{t2}"
        )

    def plot(self, path: Path) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.2))
        for label, res in (("model L0", self.layer0), ("V2-Lite", self.v2_lite)):
            ds = list(res["by_delta"])
            for dt, ls in (("fp32", "-"), ("bf16", "--")):
                ax0.plot(ds, [res["by_delta"][d][dt] for d in ds], ls, marker="o", label=f"{label} {dt}")
        ax0.axhline(4.7e-3, color="gray", ls=":", label="paper bf16 (4.7e-3)")
        ax0.set(xscale="log", yscale="log", xlabel="shift δ", ylabel="relative L2", title="layer 0: rotation alone")
        ax0.legend(fontsize=7)
        layers = [r["layer"] for r in self.per_layer]
        x = np.arange(len(layers))
        for k, (key, label) in enumerate(
            (
                ("rotation_fp32", "rotation fp32"),
                ("rotation_bf16", "rotation bf16"),
                ("drift_fp32", "context drift fp32"),
                ("total_bf16", "total bf16"),
            )
        ):
            ax1.bar(x - 0.4 + 0.2 * (k + 0.5), [max(r[key], 1e-12) for r in self.per_layer], 0.2, label=label)
        ax1.set_xticks(x, layers)
        ax1.set(yscale="log", xlabel="layer", ylabel="relative L2 of k_r", title="per layer: rotation vs context drift")
        ax1.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


def run_rotation(
    model_dir: str | Path,
    sample,
    n: int = 8,
    seed: int = 0,
    content_tokens: int = 256,
    head: tuple[int, ...] = (),
    progress: bool = True,
) -> RotationResult:
    """`sample(rng, k) -> k token ids` draws text; n (content, two contexts) pairs for the layer
    study, each context starting with `head` (e.g. BOS)."""
    rng = np.random.default_rng(seed)
    # unpacked: KeyRecorder hooks kv_a_proj_with_mqa, which a packed layer computes fused with q
    models = {name: load_model(Path(model_dir), dtype=dt, pack=False) for name, dt in DTYPES.items()}
    m32 = models["fp32"]
    ctx = m32.config.max_position_embeddings
    ids = torch.as_tensor(sample(rng, 2048))
    layer0 = by_delta(m32.rotary, layer0_keys(m32, ids), 2 * DELTAS[-1], seed)
    rot, k = random_v2_lite_keys(2048, seed)
    v2 = by_delta(rot, k, ModelConfig.from_dict(DEEPSEEK_V2_LITE).max_position_embeddings, seed)
    content_tokens = min(content_tokens, ctx // 4)
    parts: dict[str, list[list[dict]]] = {name: [] for name in DTYPES}
    for _ in tqdm(range(n), desc="eval rotation", disable=not progress):
        a, b = (int(x) for x in rng.integers(0, ctx - content_tokens - len(head) - 1, 2))
        content = sample(rng, content_tokens)
        before_a, before_b = list(head) + sample(rng, a), list(head) + sample(rng, b)
        for name, model in models.items():
            parts[name].append(drift_pair(model, content, before_a, before_b))
    per_layer = []
    for layer in range(m32.config.num_hidden_layers):
        row = {"layer": layer}
        for name in DTYPES:
            for key in ("rotation", "drift", "total", "c_kv_drift"):
                row[f"{key}_{name}"] = float(np.mean([p[layer][key] for p in parts[name]]))
        per_layer.append(row)
    return RotationResult(
        {"by_delta": layer0} | _pooled(layer0), per_layer, {"by_delta": v2} | _pooled(v2), str(model_dir)
    )
