"""The numbers behind docs/models.md: per MLA family, on random tiny checkpoints, in fp32.

    python benchmarks/families_report.py

1. parity with transformers' own modelling code: max |Δ log-prob| over 96 tokens, and the max
   difference of the cached rows (c_KV, k_r, V3.2's indexer keys) from transformers' cache;
2. `pic` on a one-layer model: content cached at offset 40 and read at offset 157, max |Δ log-prob|
   against full prefill (LongCat: its second sublayer's kv_a projection zeroed, as the test does);
3. the triton backend (under Triton's interpreter when there is no GPU) against the torch backend:
   max |Δ log-prob| on a 40 + 8 token prompt.

The tests (tests/model/test_parity.py, tests/engine/test_reuse.py, tests/model/test_triton_attention.py)
assert bounds on the same quantities; this prints the values.
"""

import os
import sys
import tempfile
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import numpy as np  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from irminsul import LLM  # noqa: E402
from irminsul.cli import run_for_people  # noqa: E402
from irminsul.machine import describe  # noqa: E402
from irminsul.model.loader import load_model  # noqa: E402
from irminsul.model.tiny import make_tiny_checkpoint  # noqa: E402

CASES = [
    ("v2", True, {}),
    ("v3", True, {}),
    ("v32", False, {}),
    ("v32", True, {"index_topk": 8}),
    ("glm", False, {}),
    ("glm", True, {"mlp_layer_types": ["dense", "sparse", "dense"]}),
    ("glm", True, {"rope_interleave": False, "q_lora_rank": None}),
    ("longcat", False, {}),
    ("longcat", True, {"zero_expert_num": 4, "moe_topk": 3}),
]


def _rand(n, seed):
    return np.random.default_rng(seed).integers(3, 250, n).tolist()


def parity(path) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM

    ours = load_model(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, 300, (1, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = hf(ids, use_cache=True)
    seq = ours.new_rows()
    got = ours.logits(ours.prefill(seq, ids[0], torch.arange(96))).log_softmax(-1)
    lp = (got - out.logits[0].log_softmax(-1)).abs().max().item()
    cfg, rows = ours.config, seq.rows(ours.rotary)
    r, latent = cfg.kv_lora_rank, cfg.latent_width
    worst = 0.0
    for layer, c in enumerate(out.past_key_values.layers):
        parts = [(rows[layer, :96, :r], c.keys[0, 0]), (rows[layer, :96, r:latent], c.values[0, 0])]
        if cfg.index_head_dim:
            parts.append((rows[layer, :96, latent:], c.indexer_keys[0]))
        worst = max(worst, *((a - b).abs().max().item() for a, b in parts))
    return lp, worst


def pic_exactness(variant: str, folder: Path) -> float:
    layers = {"num_layers": 1} if variant == "longcat" else {"num_hidden_layers": 1, "first_k_dense_replace": 0}
    path = make_tiny_checkpoint(folder / f"{variant}-l1", variant, yarn=True, std=0.3, **layers)
    if variant == "longcat":
        state = load_file(str(path / "model.safetensors"))
        state["model.layers.0.self_attn.1.kv_a_proj_with_mqa.weight"].zero_()
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    body = _rand(600, 2)
    first, second = _rand(40, 3) + body, _rand(157, 4) + body + _rand(5, 5)
    ref = LLM(path, reuse="off").score(second[:-3], second[-3:])
    llm = LLM(path, reuse="pic")
    llm.generate(first, max_tokens=1)
    return (llm.score(second[:-3], second[-3:]) - ref).abs().max().item()


def triton_vs_torch(path) -> float:
    ids = _rand(48, 1)
    a = LLM(path).score(ids[:40], ids[40:])
    b = LLM(path, attention_backend="triton").score(ids[:40], ids[40:])
    return (a - b).abs().max().item()


def main() -> int:
    torch.set_num_threads(1)
    print(f"machine: {describe()}\n")
    folder = Path(tempfile.mkdtemp(prefix="irminsul-families-"))
    print(f"{'family':8s} {'yarn':5s} {'overrides':52s} {'Δ log-prob':>11s} {'Δ cache':>9s} {'triton Δ':>9s}")
    for k, (variant, yarn, extra) in enumerate(CASES):
        path = make_tiny_checkpoint(folder / f"c{k}", variant, yarn, seed=3, **extra)
        lp, rows = parity(path)
        print(
            f"{variant:8s} {str(yarn):5s} {str(extra):52s} {lp:11.1e} {rows:9.1e} {triton_vs_torch(path):9.1e}",
            flush=True,
        )
    print("\npic on one layer, max |Δ log-prob| against full prefill:")
    for variant in ("v2", "v3", "v32", "glm", "longcat"):
        print(f"  {variant:8s} {pic_exactness(variant, folder):.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_for_people(main, Path(__file__).name))
