import numpy as np
import pytest

from irminsul.research.train.arch import ReferenceShape
from irminsul.research.train.tasks import TokenPool
from irminsul.research.train.tokenizer import train_tokenizer

TINY = ReferenceShape(
    hidden=32,
    layers=2,
    heads=2,
    kv_heads=1,
    kv_lora_rank=16,
    qk_rope_head_dim=2,
    qk_nope_head_dim=6,
    v_head_dim=8,
    dense_intermediate=64,
    moe_intermediate=16,
    routed_experts=4,
    max_positions=512,
)
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]


def _texts(seed: int, n: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, 80)) + "." for _ in range(n)]


@pytest.fixture(scope="session")
def tok():
    return train_tokenizer(
        _texts(0, 50) + ["What is the passkey? The code for Document [1]: Which words follow"], vocab_size=400
    )


@pytest.fixture(scope="session")
def pool(tok):
    tools = [{"name": f"tool_{i}", "parameters": {"properties": {f"p{i}": {}, "shared": {}}}} for i in range(6)]
    return TokenPool(tok, {"musique": _texts(1, 20), "bfcl": _texts(2, 5)}, tools, WORDS)


@pytest.fixture(scope="session")
def tiny_mla(tok):
    import torch

    from irminsul.research.train.arch import build_model, hf_config

    torch.manual_seed(0)
    return build_model(hf_config("mla", tok, TINY)).eval()


@pytest.fixture(scope="session")
def tiny_shape():
    return TINY
