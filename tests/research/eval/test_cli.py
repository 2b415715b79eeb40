"""`irminsul eval ...` end to end on tiny models: the JSON names other checks parse, and the files."""

import json

import pytest

from irminsul.cli import main
from irminsul.model.config import ModelConfig
from irminsul.model.tiny import make_tiny_checkpoint
from irminsul.research.eval.quality import STRATEGIES

ISSUE_STRATEGIES = ("off", "prefix", "naive", "pic", "pic-nocarve", "pic+r0.05", "pic+r0.15")
STRATEGY_KEYS = ("kl_mean", "kl_p95", "argmax_agreement", "first_divergence", "accuracy", "reused_fraction")


@pytest.fixture(scope="module", params=["v2", "v32", "glm", "longcat"])
def tiny(tmp_path_factory, request):
    """DeepSeek-V2, V3.2, GLM-4.7-Flash (glm4_moe_lite) and LongCat-Flash checkpoints: every study
    takes them (cost accounting refuses V3.2's indexer and LongCat's blocks with a message, below)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("cli") / "m", request.param, max_position_embeddings=1024)


def _run(capsys, tmp_path, *argv):
    out = tmp_path / "out"
    assert main(["eval", *argv, "--json", "--out", str(out)]) == 0
    data = json.loads(capsys.readouterr().out)
    name = argv[0]
    for ext in ("json", "md", "png"):
        assert (out / f"{name}.{ext}").stat().st_size > 0
    assert data["run"]["seed"] == 0 and data["run"]["command"] and data["run"]["model"]
    return data


def test_strategy_names_are_the_issue_names():
    assert tuple(s.name for s in STRATEGIES) == ISSUE_STRATEGIES


def test_eval_quality_json(tiny, capsys, tmp_path):
    data = _run(
        capsys, tmp_path, "quality", "--model", str(tiny), "--n", "1", "--context", "512", "--greedy-tokens", "2"
    )
    assert set(data["tasks"]) == {"niah", "musique", "agent_meta"}
    for task, per in data["tasks"].items():
        assert tuple(per) == ISSUE_STRATEGIES, task
        for s in per.values():
            assert all(k in s for k in STRATEGY_KEYS)


def test_eval_rotation_json(tiny, capsys, tmp_path):
    data = _run(capsys, tmp_path, "rotation", "--model", str(tiny), "--n", "1")
    assert set(data["layer0"]) >= {"fp32_rel_l2", "bf16_rel_l2"}
    assert data["layer0"]["fp32_rel_l2"] < 1e-5 < data["layer0"]["bf16_rel_l2"] < 1e-2
    assert len(data["per_layer"]) == ModelConfig.from_file(tiny / "config.json").num_hidden_layers  # MLA sublayers


def test_eval_roc_json(tiny, capsys, tmp_path):
    data = _run(capsys, tmp_path, "roc", "--model", str(tiny), "--n", "6", "--block-tokens", "16")
    assert set(data["mla"]) >= {"c_kv", "k_r", "v"} and set(data["gqa"]) >= {"k", "v"}


def test_eval_cost_json(tiny, capsys, tmp_path):
    argv = ["cost", "--model", str(tiny), "--n", "1", "--prompt-tokens", "512", "--gqa", "random-twin"]
    if json.loads((tiny / "config.json").read_text())["model_type"] in ("longcat_flash", "deepseek_v32"):
        assert main(["eval", *argv, "--out", str(tmp_path)]) == 2
        assert "cost accounting knows MLA" in capsys.readouterr().err
        return
    data = _run(capsys, tmp_path, *argv)
    assert data["gqa"]["weights"].startswith("twin architecture")
    for name in ("mla", "gqa", "deepseek-v2-lite", "qwen3-32b-like"):
        assert {"flops_saved_fraction", "bytes_moved_per_hit", "energy_saved_fraction"} <= set(data[name])
    assert data["mla"]["wall_time"]["reused_tokens"] > 0


def test_bad_task_is_a_user_error(tiny, capsys, tmp_path):
    assert main(["eval", "quality", "--model", str(tiny), "--tasks", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown task" in capsys.readouterr().err


@pytest.mark.parametrize("study", ["quality", "rotation", "roc"])
def test_a_missing_data_folder_is_one_line(tiny, capsys, tmp_path, study):
    assert main(["eval", study, "--model", str(tiny), "--data", str(tmp_path / "nowhere"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "nowhere does not exist" in err and "Traceback" not in err
