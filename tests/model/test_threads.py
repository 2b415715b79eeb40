"""`fastest_threads`: one request timed at one thread and at torch's count, the faster kept per checkpoint."""

import torch

from irminsul.model import kernel_choice, threads
from irminsul.model.loader import load_model


def test_the_faster_count_is_measured_once_and_kept(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("IRMINSUL_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    monkeypatch.setattr(kernel_choice, "_memory", {})
    model = load_model(tiny_dir)
    start = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        probes = []
        real = threads._probe
        monkeypatch.setattr(threads, "_probe", lambda m, n: probes.append(n) or real(m, n))
        first = threads.fastest_threads(model, "tiny|float32")
        assert first in (1, 2) and probes == [2] and torch.get_num_threads() == 2  # (left as it was)
        assert threads.fastest_threads(model, "tiny|float32") == first and probes == [2]
        entry = next(
            v for k, v in kernel_choice._read_cache(tmp_path / "kernels.json").items() if k.startswith("threads|")
        )
        assert entry["threads"] == (1 if entry["one_s"] < entry["all_s"] else 2)
        torch.set_num_threads(1)  # (one thread to start with: nothing to choose)
        assert threads.fastest_threads(model, "tiny|float32") == 1 and probes == [2]
    finally:
        torch.set_num_threads(start)


def test_the_probe_picks_the_faster(tiny_dir, monkeypatch):
    """With requests that take 1 s at one thread and 3 s at two, one is chosen; the other way, two; and
    the thread count is back where it was after either."""
    model = load_model(tiny_dir)
    start = torch.get_num_threads()
    try:
        for one, two, want in ((1.0, 3.0, 1), (3.0, 1.0, 2)):
            torch.set_num_threads(2)
            monkeypatch.setattr(
                threads, "_request", lambda m, ids, one=one, two=two: one if torch.get_num_threads() == 1 else two
            )
            out = threads._probe(model, 2)
            assert out["threads"] == want and (out["one_s"], out["all_s"]) == (one, two)
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(start)


def test_the_server_runs_on_the_measured_count_unless_told(tiny_dir, tmp_path, monkeypatch):
    from irminsul.server.config import ServerConfig
    from irminsul.server.state import load_checkpoint

    monkeypatch.setenv("IRMINSUL_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    monkeypatch.setattr(kernel_choice, "_memory", {})
    monkeypatch.setattr(threads, "_probe", lambda m, n: {"threads": 1, "one_s": 1.0, "all_s": 2.0})
    start = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        load_checkpoint(ServerConfig(model=str(tiny_dir)))
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        load_checkpoint(ServerConfig(model=str(tiny_dir), threads=2))  # (told: no probe, no change)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(start)
