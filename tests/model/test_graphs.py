"""The captured decode step (model/graphs.py) against the triton backend's eager path.

On a CPU the static step runs uncaptured under Triton's interpreter; on a GPU
(benchmarks/gpu_check.sh) the same tests capture and replay CUDA graphs. Either way they check what
the graph replays: padded batches, fixed key splits, slot tables read from the static buffers, content
hits, the fallbacks, and that the step reads nothing back on the host (a capture would fail on it)."""

import dataclasses

import numpy as np
import pytest
import torch

from irminsul import LLM, RequestError, Segments
from irminsul.model.graphs import DecodeGraphs, capture_sizes
from irminsul.model.layers import MoE
from irminsul.model.tiny import make_tiny_checkpoint
from tests.host_syncs import HostReads

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KW = dict(max_tokens=5, ignore_eos=True, logprobs=0)


def _rand(n, seed):
    return np.random.default_rng(seed).integers(3, 250, n).tolist()


def _llm(path, compile_decode, **kw):
    return LLM(path, device=DEVICE, attention_backend="triton", compile_decode=compile_decode, **kw)


def _counted(llm, splits=3):
    """Count the engine's captured-step calls; on a CPU, cut every size's keys into `splits` runs
    (the SM-based count is 1 at most sizes here; a GPU captured its own counts already)."""
    graphs = llm.engine.runner.graphs
    if not graphs.capture:
        graphs.splits = {s: splits for s in graphs.sizes}
    calls = []
    call = graphs.__call__

    class Counted(type(graphs)):
        def __call__(self, tokens, lengths, slots):
            calls.append(len(tokens))
            return call(tokens, lengths, slots)

    graphs.__class__ = Counted
    return calls


def _same(want, got):
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    err = max(abs(x.logprob - y.logprob) for w, g in zip(want, got) for x, y in zip(w.logprobs, g.logprobs))
    assert err < 1e-4, err


def test_capture_sizes():
    assert capture_sizes(128)[:6] == [1, 2, 4, 8, 16, 24] and capture_sizes(128)[-1] == 128
    assert capture_sizes(12) == [1, 2, 4, 8, 12] and capture_sizes(1) == [1]


@pytest.mark.parametrize("variant", ["v2", "v3"])
def test_a_padded_batch_decodes_as_the_eager_step(tmp_path, variant):
    """Three prompts of different lengths (a batch of 3 pads to 4), then one alone (size 1); V3:
    YaRN, the halves layout and query LoRA. Tokens equal, log-probs within 1e-4."""
    path = make_tiny_checkpoint(
        tmp_path / variant, variant, yarn=variant == "v3", **({"q_lora_rank": 24} if variant == "v3" else {})
    )
    eager, graph = _llm(path, False), _llm(path, True)
    assert eager.engine.runner.graphs is None and graph.engine.runner.graphs.capture == (DEVICE == "cuda")
    calls = _counted(graph)
    prompts = [_rand(70, 2), _rand(9, 3), _rand(33, 4)]
    _same(eager.generate(prompts, **KW), graph.generate(prompts, **KW))
    assert calls == [3] * 4  # every decode step after the prefill's first tokens
    _same([eager.generate(prompts[0], **KW)], [graph.generate(prompts[0], **KW)])
    assert calls[4:] == [1] * 4


def test_a_content_hit_and_the_fallbacks(tiny_dir):
    """pic: a body cached behind one header and reused behind another (its slots in several runs)
    decodes through the graph as eagerly. More sequences than the largest size, or a sequence longer
    than max_len, take the eager step."""
    body = _rand(150, 5)
    first, second = Segments([_rand(20, 6), body]), Segments([_rand(47, 7), body, _rand(2, 8)])
    eager, graph = _llm(tiny_dir, False, reuse="pic"), _llm(tiny_dir, True, reuse="pic")
    calls = _counted(graph)
    for llm in (eager, graph):
        llm.generate(first, max_tokens=1)
    want, got = eager.generate(second, **KW), graph.generate(second, **KW)
    assert got.stats.reused_tokens >= 100
    _same([want], [got])
    assert calls == [1] * 4
    small = DecodeGraphs(graph.engine.model, graph.engine.pool.rows, max_batch=2, max_len=40)
    small.capture_all()
    graph.engine.runner.graphs = small
    calls = _counted(graph)
    prompts = [_rand(12, 9), _rand(14, 10), _rand(30, 11)]
    _same(eager.generate(prompts, **KW), graph.generate(prompts, **KW))
    assert calls == []  # three sequences: more than max_batch
    _same(eager.generate(prompts[1:], **KW), graph.generate(prompts[1:], **KW))
    assert calls == [2] * 4  # two sequences, at most 34 keys
    long = _rand(38, 12)
    _same([eager.generate(long, **KW)], [graph.generate(long, **KW)])
    assert calls[4:] == [1, 1]  # 39 and 40 keys fit; 41 and 42 decode eagerly


def test_the_static_step_reads_nothing_back_on_the_host(tiny_dir, monkeypatch):
    """The step a graph captures, run on a loaded batch under HostReads: no read. The check can fail:
    the torch backend's MoE reads its busiest expert's count on the host, and HostReads finds it."""
    llm = _llm(tiny_dir, True)
    graphs = llm.engine.runner.graphs
    llm.generate([_rand(30, 13), _rand(20, 14)], max_tokens=2, ignore_eos=True)
    lengths = np.array([5, 3])
    graphs._load(np.array([7, 8]), lengths, [np.arange(1, 6), np.arange(6, 9)])
    with HostReads() as reads:
        want = graphs.step(graphs.size(2))
    assert reads.found == []
    if graphs.capture:  # on a GPU: CUDA's own check, and a replay gives the step's logits exactly
        torch.cuda.set_sync_debug_mode("error")
        try:
            graphs.step(graphs.size(2))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(graphs(np.array([7, 8]), lengths, [np.arange(1, 6), np.arange(6, 9)]), want[:2])
    for read, name in (
        (lambda: torch.bincount(torch.tensor([1, 2])), "aten::bincount"),
        (lambda: torch.ones(2)[torch.tensor([True, False])], "aten::index.Tensor (boolean mask)"),
        (lambda: int(torch.ones(1)), "aten::_local_scalar_dense"),
        (lambda: torch.ones(2).tolist(), "Tensor.tolist"),
    ):
        with HostReads() as reads:
            read()
        assert reads.found == [name]
    moes = [m for m in llm.engine.model.modules() if isinstance(m, MoE)]
    kernel = moes[0].kernel
    # the same step with the torch MoE, which sizes its grouped batch on the host (its ops, not the
    # native kernel a CPU's few tokens would take)
    try:
        for m in moes:
            m.kernel = None
            monkeypatch.setattr(m, "settings", dataclasses.replace(m.settings, native_moe=False))
        with HostReads() as reads:
            graphs.step(graphs.size(2))
    finally:
        for m in moes:
            m.kernel = kernel
    assert reads.found


def test_resolve_where_and_when(tmp_path, tiny_dir, monkeypatch):
    """Auto (None) captures on a GPU only; True on a CPU runs the static step; False never;
    IRMINSUL_COMPILE_DECODE=0 turns auto off; a model the graphs do not cover is an error when
    required (DeepSeek-V3.2's indexer, LongCat-Flash's host-side expert loop)."""
    monkeypatch.delenv("IRMINSUL_COMPILE_DECODE", raising=False)
    assert (_llm(tiny_dir, None).engine.runner.graphs is not None) == (DEVICE == "cuda")
    monkeypatch.setenv("IRMINSUL_COMPILE_DECODE", "0")
    assert _llm(tiny_dir, None).engine.runner.graphs is None
    for variant, why in (("v32", "indexer"), ("longcat", "LongCat")):
        with pytest.raises(RequestError, match=why):
            _llm(make_tiny_checkpoint(tmp_path / variant, variant), True)
