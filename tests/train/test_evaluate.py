import pytest

from irminsul.train.card import write_card
from irminsul.train.checkpoint import save_checkpoint
from irminsul.train.data import default_data_dir
from irminsul.train.evaluate import evaluate

try:
    default_data_dir()
    HAVE_DATA = True
except FileNotFoundError:
    HAVE_DATA = False


@pytest.mark.skipif(not HAVE_DATA, reason="needs shared/data/")
def test_evaluate_and_card_on_a_tiny_checkpoint(tok, tiny_mla, tmp_path):
    path = save_checkpoint(tiny_mla, tok, tmp_path / "m", state={
        "arch": "mla", "step": 1, "steps": 1, "tokens": 10, "params": 1, "wall_s": 1, "config": {"seed": 0, "threads": 1,
                                                                             "phases": [[256, 8, 0.5], [2048, 1, 0.5]],
                                                                             "attn_weight": 1.0, "attn_heads": 4}})
    res = evaluate(path, n_needles=1, qa_items=2, doc_qa_n=1, loss_windows=1, log=lambda *a: None)
    assert set(res["held_out_loss"]) == {"tau_bench", "bfcl", "toolbench", "musique"}
    assert set(res["needle/transformers"]["recall"]) == {512, 1024, 2048}
    card = write_card(path, res, "irminsul train-reference", "irminsul eval-reference --model m").read_text()
    assert "| 1024 |" in card and "held-out" in card.lower()
    assert "256 -> 2048" in card and "heads 0..3 of the last layer" in card


def test_the_card_quotes_only_the_arguments_that_measure():
    from irminsul.train.cli import _measuring_args

    argv = ["eval-reference", "--model", "m", "--card", "--train-cmd", "git checkout x && train", "--notes", "/tmp/n.md",
            "--needles", "4", "--notes=/tmp/o.md"]
    assert _measuring_args(argv) == ["eval-reference", "--model", "m", "--needles", "4"]
