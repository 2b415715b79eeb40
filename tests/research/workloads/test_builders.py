from irminsul.data import DATA_DIR
from irminsul.research.workloads.builders import SOURCES, build_source


def test_tau_bench_one_request_per_assistant_turn():
    reqs = build_source("tau_bench")
    assert len(reqs) == 1808 and len({r.session for r in reqs}) == 150
    assert all(r.messages[0]["role"] == "system" and r.messages[-1]["role"] != "assistant" for r in reqs)
    assert all(len(r.tools) == 14 for r in reqs)
    policy = (DATA_DIR / "tau_bench" / "airline_wiki.md").read_text()
    assert reqs[0].messages[0]["content"] == policy


def test_bfcl_multi_turn_and_live_multiple():
    reqs = build_source("bfcl")
    multi = [r for r in reqs if r.session.startswith("multi_turn")]
    live = [r for r in reqs if r.session.startswith("live_multiple")]
    assert len(multi) == 734 and len(live) == 1053
    first = multi[0]  # GorillaFileSystem + TwitterAPI, without the excluded `cp`
    names = {t["function"]["name"] for t in first.tools}
    assert "mv" in names and "post_tweet" in names and "cp" not in names


def test_toolbench_and_musique():
    tb = build_source("toolbench")
    assert len(tb) == 52 and all(r.messages[0]["role"] == "system" and len(r.messages) >= 2 for r in tb)
    mq = build_source("musique")
    assert len(mq) == 120 and all(len(r.messages[1]["content"]) == 11 for r in mq)


def test_first_n_sessions():
    reqs = build_source("tau_bench", n=3)
    assert len({r.session for r in reqs}) == 3
    assert set(SOURCES) == {"tau_bench", "bfcl", "toolbench", "musique"}
