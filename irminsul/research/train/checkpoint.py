"""Saving a trained model as a standard HF checkpoint, and checking that it reloads unchanged."""

import copy
import json
from pathlib import Path

import torch

from irminsul.model.chat_format import EOS
from irminsul.research.train.tokenizer import save_tokenizer

SAVE_DTYPE = torch.bfloat16  # 8.7 M params: ~17 MB in bf16; fp32 would exceed the 30 MB budget


def save_checkpoint(model, tok, out: Path, state: dict | None = None) -> Path:
    """config.json + model.safetensors (bf16) + tokenizer files + generation_config.json."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    m = copy.deepcopy(model).to(SAVE_DTYPE)
    m.config.use_cache = True
    m.generation_config.bos_token_id = model.config.bos_token_id
    m.generation_config.eos_token_id = [model.config.eos_token_id, tok.token_to_id(EOS)]
    m.generation_config.pad_token_id = model.config.pad_token_id
    m.save_pretrained(out, safe_serialization=True)
    save_tokenizer(tok, out, model.config.max_position_embeddings)
    if state is not None:
        (out / "train_state.json").write_text(json.dumps(state, indent=2) + "\n")
    return out


def load_checkpoint(path: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


@torch.no_grad()
def max_reload_error(model, path: Path, ids: list[int]) -> float:
    """Max |Δ log-prob| between `model` rounded to the saved dtype and its reloaded checkpoint (fp32)."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():  # round the weights only: buffers (RoPE inv_freq) are recomputed on load
        p.data = p.data.to(SAVE_DTYPE).float()
    x = torch.tensor([ids])
    a = torch.log_softmax(ref(input_ids=x).logits.float(), -1)
    b = torch.log_softmax(load_checkpoint(path)(input_ids=x).logits.float(), -1)
    return float((a - b).abs().max())
