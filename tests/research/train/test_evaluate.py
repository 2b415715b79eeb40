from irminsul.research.train.card import write_card
from irminsul.research.train.checkpoint import save_checkpoint
from irminsul.research.train.evaluate import evaluate


def test_evaluate_and_card_on_a_tiny_checkpoint(tok, tiny_mla, tmp_path):
    import dataclasses

    from irminsul.research.train.train import TrainConfig, _jsonable

    config = _jsonable(dataclasses.asdict(TrainConfig(steps=2, threads=1, phases=((256, 8, 0.5), (2048, 1, 0.5)))))
    first = {"step": 1, "steps": 2, "config": config | {"minutes": 48.0}}
    path = save_checkpoint(
        tiny_mla,
        tok,
        tmp_path / "m",
        state={
            "arch": "mla",
            "step": 2,
            "steps": 2,
            "tokens": 10,
            "params": 1,
            "wall_s": 1,
            "previous_stages": [first],
            "config": config | {"init": "runs/mla/final", "start_step": 1},
        },
    )
    res = evaluate(path, n_needles=1, qa_items=2, doc_qa_n=1, loss_windows=1, log=lambda *a: None)
    assert set(res["held_out_loss"]) == {"tau_bench", "bfcl", "toolbench", "musique"}
    assert set(res["needle/transformers"]["recall"]) == {512, 1024, 2048}
    card = write_card(path, res, "irminsul eval-reference --model m").read_text()
    assert "| 1024 |" in card and "held-out" in card.lower()
    assert "256 -> 2048" in card and "heads 0..3 of the last layer" in card
    # the training commands are the recorded stages, first the one that stopped early
    first_cmd, second_cmd = [line.strip() for line in card.splitlines() if "irminsul train-reference" in line]
    assert "--minutes 48 " in first_cmd and "--stop-after 1" in first_cmd and "--init" not in first_cmd
    assert "--init runs/mla/final --start-step 1" in second_cmd and "--stop-after" not in second_cmd
    assert "--phases 256x8:0.5,2048x1:0.5" in second_cmd


def test_the_card_quotes_only_the_arguments_that_measure():
    from irminsul.research.train.cli import _measuring_args

    argv = [
        "eval-reference",
        "--model",
        "m",
        "--card",
        "--out",
        "x.json",
        "--notes",
        "/tmp/n.md",
        "--needles",
        "4",
        "--notes=/tmp/o.md",
    ]
    assert _measuring_args(argv) == ["eval-reference", "--model", "m", "--needles", "4"]


def test_eval_reference_writes_only_where_asked(tok, tiny_mla, tmp_path, capsys):
    import json

    from irminsul.cli import main

    path = save_checkpoint(tiny_mla, tok, tmp_path / "m", state={"arch": "mla", "step": 1, "steps": 1})
    argv = [
        "eval-reference",
        "--model",
        str(path),
        "--needles",
        "1",
        "--qa-items",
        "1",
        "--synthetic",
        "1",
        "--threads",
        "1",
    ]
    assert main(argv) == 0
    assert "held_out_loss" in json.loads(capsys.readouterr().out) and not (path / "metrics.json").exists()
    assert main([*argv, "--out", str(tmp_path / "x.json")]) == 0
    assert f"wrote {tmp_path / 'x.json'}" in capsys.readouterr().err and not (path / "metrics.json").exists()
    assert "held_out_loss" in json.loads((tmp_path / "x.json").read_text())
