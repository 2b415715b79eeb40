"""The triton attention backend against the torch backend, under Triton's CPU interpreter
(TRITON_INTERPRET=1, set in tests/conftest.py when there is no GPU): full prefill, ragged decode
batches over several key splits, `pic` reuse of shifted content on a one-layer model, the stale-`k_r`
`naive` baseline, fp32 and bf16, YaRN on and off, both RoPE layouts. Shapes are small: the
interpreter runs each program in NumPy."""

import numpy as np
import pytest
import torch

from irminsul import LLM, Segments
from irminsul.model.attention.triton import TritonAttention
from irminsul.model.tiny import make_tiny_checkpoint

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (benchmarks/gpu_check.sh runs these on a GPU)


def _rand(n, seed, lo=3, hi=250):
    return np.random.default_rng(seed).integers(lo, hi, n).tolist()


def _pair(path, dtype="float32"):
    return LLM(path, dtype=dtype, device=DEVICE), LLM(path, dtype=dtype, device=DEVICE, attention_backend="triton")


@pytest.mark.parametrize(
    "variant, yarn, dtype",
    [
        ("v2", False, "float32"),
        ("v2", True, "float32"),
        ("v3", True, "float32"),
        ("v3", False, "bfloat16"),
        ("glm", True, "float32"),
        ("longcat", True, "float32"),
        ("v32", True, "float32"),
    ],
)
def test_prefill_scores_equal_the_torch_backend(tmp_path, variant, yarn, dtype):
    path = make_tiny_checkpoint(tmp_path / "c", variant=variant, yarn=yarn)
    ref, tri = _pair(path, dtype)
    ids = _rand(48, 1)
    a, b = ref.score(ids[:40], ids[40:]), tri.score(ids[:40], ids[40:])
    err = (a.float() - b.float()).abs().max().item()
    assert err < (1e-4 if dtype == "float32" else 0.1), err  # bf16: rounding of the attention output


def test_ragged_decode_over_several_splits_equals_the_torch_backend(tiny_dir, monkeypatch):
    """Three prompts of different lengths, prefilled in chunks of 24 positions (so steps mix one
    prompt's chunk with the others' decode rows), then decoded over several key splits."""
    monkeypatch.setattr(TritonAttention, "SPLIT", 32)  # keys per split: 70 keys take three splits
    ref = LLM(tiny_dir, max_prefill_tokens=24, device=DEVICE)
    tri = LLM(tiny_dir, max_prefill_tokens=24, device=DEVICE, attention_backend="triton")
    prompts = [_rand(70, 2), _rand(9, 3), _rand(33, 4)]
    kw = dict(max_tokens=6, ignore_eos=True, logprobs=0)
    want, got = ref.generate(prompts, **kw), tri.generate(prompts, **kw)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    err = max(abs(x.logprob - y.logprob) for w, g in zip(want, got) for x, y in zip(w.logprobs, g.logprobs))
    assert err < 1e-4, err


@pytest.mark.parametrize("variant", ["v2", "v32"])
def test_pic_on_one_layer_equals_full_prefill_and_naive_does_not(tmp_path, variant):
    """A body cached at offset 20 and read at offset 47: the kernel encodes the shared rows' k_r at
    the reading positions, so pic equals full prefill; naive encodes them where they were computed.
    V3.2: the indexer scores the shared rows at their new positions too, and its top-16 selection
    (of about 210 keys) is the same as full prefill's."""
    path = make_tiny_checkpoint(
        tmp_path / "l1", variant, num_hidden_layers=1, first_k_dense_replace=1, yarn=True, std=0.3
    )
    body = _rand(160, 5)
    first = Segments([_rand(20, 6), body])  # segments: the body is chunked from its own start
    second, tail = Segments([_rand(47, 7), body, _rand(1, 8)]), _rand(3, 9)
    ref = LLM(path, reuse="off", device=DEVICE).score(second, tail)
    for mode, exact in (("pic", True), ("naive", False)):
        llm = LLM(path, reuse=mode, device=DEVICE, attention_backend="triton")
        llm.generate(first, max_tokens=1)
        got = llm.score(second, tail)
        assert llm.last_stats.reused_tokens >= 100, llm.last_stats
        err = (got - ref).abs().max().item()
        assert err < 1e-4 if exact else err > 1e-2, (mode, err)


def test_the_kernel_alone_against_a_dense_reference():
    """mla_attention on a hand-made pool: shuffled slots, empty slots (masked), keys encoded at
    explicit RoPE positions, queries that see different prefixes."""
    from irminsul.model.attention.triton import Tiles, TritonPlan, mla_attention
    from irminsul.model.config import RopeConfig
    from irminsul.model.rope import Rotary

    g = torch.Generator().manual_seed(0)
    h, r, rope, t = 3, 24, 8, 45
    rotary = Rotary(RopeConfig(dim=rope, theta=10000.0, style="v3_half"))
    pool = torch.randn(64, r + rope, generator=g)
    slots = torch.randperm(63, generator=g)[:t] + 1
    slots[[4, 17]] = 0  # holes: no row there
    pos = torch.randint(0, 90, (t,), generator=g)
    q_lat, q_pe = torch.randn(2, h, r, generator=g), torch.randn(2, h, rope, generator=g)
    last = torch.tensor([44, 20])
    cos, sin = rotary.table(91)
    one = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    tiles = [
        Tiles(one(0, 0), one(0, 1), one(1, 1), one(45, 21), 1, 45),  # as two decode rows ...
        Tiles(one(0), one(0), one(2), one(45), 4, 45),
    ]  # ... and as one prefill tile of both
    on = lambda *xs: [x.to(DEVICE) for x in xs]  # noqa: E731
    for tile, (block_t, warps) in ((t, c) for t in tiles for c in ((16, None), (64, 8))):  # (other tile sizes
        # alike: benchmarks/gpu_tiles.py picks among such on a GPU)
        plan = TritonPlan(
            *on(last.int(), torch.zeros(2, dtype=torch.long), slots[None], pos[None].int()),
            90,
            [Tiles(*on(tile.seq, tile.row0, tile.rows, tile.end), tile.block_m, tile.max_end)],
        )
        got = mla_attention(
            *on(q_lat, q_pe, pool),
            plan,
            *on(cos, sin),
            0.3,
            interleaved=False,
            block_t=block_t,
            split=16,
            num_warps=warps,
        )
        _check(got.cpu(), q_lat, q_pe, pool, slots, pos, last, cos, sin, rotary, r, t)


def _check(got, q_lat, q_pe, pool, slots, pos, last, cos, sin, rotary, r, t):
    keys = pool[slots].clone()
    keys[:, r:] = rotary.encode_cached(keys[:, r:], cos[pos], sin[pos])
    for i in range(2):
        ok = (torch.arange(t) <= last[i]) & (slots != 0)
        s = (torch.cat([q_lat[i], q_pe[i]], -1) @ keys.T) * 0.3
        p = s.masked_fill(~ok, float("-inf")).softmax(-1)
        assert torch.allclose(got[i], p @ keys[:, :r], atol=1e-5)


def test_a_prefill_pass_reads_nothing_back_on_the_host(tiny_dir):
    """The triton backend's forward pass (its plan built before, as the engine builds it) reads no
    device value on the host: no sync inside a step (tests/host_syncs.py says what counts)."""
    from tests.host_syncs import HostReads

    model = LLM(tiny_dir, device=DEVICE, attention_backend="triton", compile_decode=False).engine.model
    rows = model.new_rows(64)
    batch = rows.batch(model.attention, torch.tensor(_rand(40, 1), device=DEVICE), torch.arange(40, device=DEVICE))
    with HostReads() as reads:
        model(batch)
    assert reads.found == []
