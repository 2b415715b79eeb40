import pytest
import torch

from irminsul.research.train.arch import build_model, hf_config
from irminsul.research.train.checkpoint import max_reload_error, save_checkpoint
from irminsul.research.train.train import Batches, TrainConfig, losses


@pytest.fixture()
def batches(tok, pool, tiny_shape):
    cfg = TrainConfig(phases=((64, 4, 0.5), (128, 2, 0.5)), shape=tiny_shape, retrieval_share=0.5)
    docs = {"musique": [tok.decode(d.tolist()) for d in pool.docs["musique"]]}
    return cfg, Batches(cfg, tok, pool, docs)


def test_batches_are_deterministic_and_masks_cover_answers_only(tok, batches):
    cfg, b = batches
    x, y, lm, ans, src = b.get(3, 128, 8)
    x2, *_ = b.get(3, 128, 8)
    assert torch.equal(x, x2) and x.shape == y.shape == lm.shape == src.shape == (8, 128)
    assert not (lm & ans).any() and ans.any() and lm.any()
    # every recorded source is an earlier position holding the very token the answer needs
    has = src >= 0
    assert has.any() and (ans | ~has).all()
    rows, t = has.nonzero(as_tuple=True)
    assert (src[has] <= t).all() and torch.equal(x[rows, src[has]], y[has])
    end = tok.token_to_id("<|end|>")
    for row in range(8):
        if ans[row].any():
            assert y[row][ans[row]][-1] == end  # the answer span ends with <|end|>
            assert torch.equal(x[row, 1:], y[row, :-1])


def test_schedule(tiny_shape):
    cfg = TrainConfig(phases=((256, 16, 0.5), (512, 2, 0.5)), warmup=10, shape=tiny_shape)
    assert cfg.phase(0, 100) == (256, 16) and cfg.phase(99, 100) == (512, 2)
    assert cfg.lr_at(0, 100) == pytest.approx(cfg.lr / 10)
    assert cfg.lr_at(10, 100) == pytest.approx(cfg.lr)
    assert cfg.lr_at(100, 100) == pytest.approx(cfg.lr * cfg.min_lr_frac)


@pytest.mark.parametrize("arch", ["mla", "gqa"])
def test_a_training_step_learns_and_the_checkpoint_reloads(tok, batches, tiny_shape, tmp_path, arch):
    cfg, b = batches
    torch.manual_seed(0)
    model = build_model(hf_config(arch, tok, tiny_shape)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y, lm, ans, _ = b.get(0, 64, 4)
    first = None
    for _ in range(5):
        lm_loss, ans_loss = losses(model, x, y, lm, ans)
        first = first if first is not None else float((lm_loss + ans_loss).detach())
        (lm_loss + ans_loss).backward()
        opt.step()
        opt.zero_grad()
    assert float((lm_loss + ans_loss).detach()) < first
    path = save_checkpoint(model, tok, tmp_path / arch)
    assert (path / "model.safetensors").exists() and (path / "tokenizer_config.json").exists()
    assert max_reload_error(model, path, x[0].tolist()) < 1e-4


def test_a_second_stage_resumes_the_schedule_and_carries_the_state(tmp_path):
    """--init + --start-step finish a schedule: the steps run are the remaining ones, and tokens,
    wall time and the first stage's record carry into train_state.json."""
    import dataclasses
    import json

    from irminsul.research.train.arch import ReferenceShape
    from irminsul.research.train.train import train

    shape = dataclasses.replace(
        ReferenceShape(),
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
    )
    common = dict(
        arch="mla",
        steps=4,
        threads=1,
        phases=((64, 2, 1.0),),
        eval_every=1000,
        shape=shape,
        warmup=1,
        minutes=10,
        attn_heads=2,
    )
    first = train(TrainConfig(out=str(tmp_path / "a"), stop_after=2, **common))
    second = train(TrainConfig(out=str(tmp_path / "b"), init=str(first), start_step=2, **common))
    a = json.loads((first / "train_state.json").read_text())
    b = json.loads((second / "train_state.json").read_text())
    assert (a["step"], a["tokens"]) == (2, 2 * 2 * 64)
    assert (b["step"], b["tokens"]) == (4, 4 * 2 * 64)
    assert b["wall_s"] >= a["wall_s"] and [s["step"] for s in b["previous_stages"]] == [2]
    steps = [json.loads(line)["step"] for line in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert sorted(set(steps)) == [2, 3]


def test_a_start_step_past_the_schedule_is_a_clear_error(tmp_path):
    """A start step past the schedule is refused before training, not met by a NameError in the final save."""
    import dataclasses

    from irminsul.errors import UserFacingError
    from irminsul.research.train.arch import ReferenceShape
    from irminsul.research.train.train import train

    shape = dataclasses.replace(
        ReferenceShape(),
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
    )
    cfg = TrainConfig(
        out=str(tmp_path / "a"),
        steps=4,
        start_step=4,
        threads=1,
        phases=((64, 2, 1.0),),
        shape=shape,
        warmup=1,
        minutes=10,
        attn_heads=2,
    )
    with pytest.raises(UserFacingError, match="nothing is left to train"):
        train(cfg)


def test_a_v4_reference_model_trains_and_serves(tmp_path):
    """--arch v4: a DeepSeek-V4 of the reference shape (scaled down here) trains through transformers'
    own modelling code, and its checkpoint loads in the engine and scores as our V4 forward does."""
    import dataclasses

    from irminsul import LLM
    from irminsul.model.deepseek_v4 import load_deepseek_v4
    from irminsul.research.train.arch import ReferenceShape
    from irminsul.research.train.train import train

    shape = dataclasses.replace(
        ReferenceShape(),
        hidden=32,
        layers=2,
        heads=2,
        kv_lora_rank=16,
        qk_rope_head_dim=2,
        moe_intermediate=16,
        routed_experts=4,
    )
    out = train(
        TrainConfig(
            arch="v4",
            out=str(tmp_path / "v4"),
            steps=2,
            threads=1,
            phases=((64, 2, 1.0),),
            eval_every=1000,
            shape=shape,
            warmup=1,
            minutes=10,
            attn_weight=0.0,
        )
    )
    ids = list(range(5, 45))
    want = load_deepseek_v4(out).forward(torch.tensor(ids))[29:39].log_softmax(-1)
    assert (LLM(out).score(ids[:30], ids[30:]) - want).abs().max().item() < 1e-4
    with pytest.raises(Exception, match="attn-weight 0"):
        TrainConfig(arch="v4", out=str(tmp_path / "x"))
