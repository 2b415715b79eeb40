"""The compiled one-sequence decode step (model/compiled.py) against the engine's own path."""

import threading

import numpy as np
import pytest
from torch._dynamo.utils import counters

from irminsul import LLM, RequestError
from irminsul.engine.sampling import SamplingParams
from irminsul.model.attention import consecutive
from irminsul.model.tiny import make_tiny_checkpoint


@pytest.fixture(autouse=True)
def _no_native_step(monkeypatch):
    """These test the compiled step: the native step, which the runner tries first, off (read when a
    model is loaded; tests/model/test_native_step.py tests that one)."""
    monkeypatch.setenv("IRMINSUL_NATIVE_STEP", "0")


def _rand(n, seed):
    return np.random.default_rng(seed).integers(3, 250, n).tolist()


@pytest.mark.parametrize("variant, extra", [("v2", {}), ("v3", {"q_lora_rank": 24})])
def test_compiled_decode_gives_the_engines_tokens_and_logprobs(tmp_path, variant, extra):
    """V2 (interleaved RoPE, softmax routing) and V3 with query LoRA, YaRN and the halves layout."""
    path = make_tiny_checkpoint(tmp_path / variant, variant, yarn=variant == "v3", **extra)
    eager, compiled = LLM(path), LLM(path, compile_decode=True)
    graphs = counters["stats"]["unique_graphs"]  # compiled at warm-up, on scratch rows
    step = compiled.engine.runner.compiled
    calls = {"one": 0, "batch": 0}

    def counted(name, fn):
        def call(*a):
            calls[name] += 1
            return fn(*a)

        return call

    step._fn, step._batch_fn = counted("one", step._fn), counted("batch", step._batch_fn)
    ids = _rand(60, 0)
    a = eager.generate(ids, max_tokens=12, ignore_eos=True, logprobs=2)
    b = compiled.generate(ids, max_tokens=12, ignore_eos=True, logprobs=2)
    assert calls == {"one": 11, "batch": 0}  # every decode step after the prefill's first token
    assert a.token_ids == b.token_ids
    assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    # three sequences of different lengths decode together through the batched step (padded, masked)
    prompts = [ids, _rand(45, 1), _rand(50, 2)]
    many = compiled.generate(prompts, max_tokens=6, ignore_eos=True, logprobs=2)
    assert calls["batch"] == 5
    ref = eager.generate(prompts, max_tokens=6, ignore_eos=True, logprobs=2)
    assert [r.token_ids for r in many] == [r.token_ids for r in ref]
    assert max(abs(x.logprob - y.logprob) for r, q in zip(many, ref) for x, y in zip(r.logprobs, q.logprobs)) < 1e-4
    # with the native kernels inside the graph (attention read from the pool, the routed experts), the
    # batched step takes more than the dense-expert graph's 8 sequences
    from irminsul.model import native_ops

    assert step.native == native_ops.available()
    if step.native:
        twelve = [_rand(20 + 3 * i, 20 + i) for i in range(12)]
        before = calls["batch"]
        many = compiled.generate(twelve, max_tokens=4, ignore_eos=True, logprobs=2)
        ref = eager.generate(twelve, max_tokens=4, ignore_eos=True, logprobs=2)
        assert calls["batch"] == before + 3 and step.max_batch >= 12
        assert [r.token_ids for r in many] == [r.token_ids for r in ref]
        assert max(abs(x.logprob - y.logprob) for r, q in zip(many, ref) for x, y in zip(r.logprobs, q.logprobs)) < 1e-4
    # more sequences than one compiled step takes decode eagerly (prompts that fit one prefill step:
    # all of them decode together)
    before = dict(calls)
    n = step.max_batch + 1
    compiled.generate([_rand(1000 // n, 10 + i) for i in range(n)], max_tokens=3, ignore_eos=True)
    assert calls == before
    # the real pool, other lengths and batch sizes, a grown RoPE table: nothing is compiled again
    compiled.generate([_rand(300, 3)] + prompts, max_tokens=3, ignore_eos=True)
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_content_hit_decodes_through_the_gathered_step(tiny_dir):
    """pic: a body cached behind one header and reused behind another leaves the sequence's rows in
    several runs of slots; alone, it decodes through the gathered step (B = 1), as the engine would."""
    body, first, second = _rand(600, 5), _rand(20, 6), _rand(57, 7)
    runs = {}
    for name, compile_decode in (("eager", False), ("compiled", True)):
        llm = LLM(tiny_dir, reuse="pic", compile_decode=compile_decode)
        llm.generate(first + body, max_tokens=1)
        if compile_decode:
            seq = llm.engine.new_sequence(second + body, SamplingParams())
            assert llm.engine.scheduler.admit(seq) and not consecutive(
                seq.slots
            )  # the hit's rows: another run of slots
            llm.engine.finish(seq)
            step, calls = llm.engine.runner.compiled, []
            real = step._batch_fn
            step._batch_fn = lambda *a: calls.append(1) or real(*a)
        runs[name] = llm.generate(second + body, max_tokens=8, ignore_eos=True, logprobs=1)
        assert runs[name].stats.reused_tokens >= 400, runs[name].stats
    assert len(calls) == 7  # every decode step after the prefill's token
    assert runs["eager"].token_ids == runs["compiled"].token_ids
    assert max(abs(x.logprob - y.logprob) for x, y in zip(runs["eager"].logprobs, runs["compiled"].logprobs)) < 1e-4


def test_what_the_compiled_step_does_not_cover_is_refused_clearly(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "v32", "v32")
    with pytest.raises(RequestError, match="compile_decode"):
        LLM(path, compile_decode=True)


def test_serve_flag_reaches_the_engine():
    """`irminsul serve --no-compile-decode` / `--compile-decode` reach the server's engine; by default
    it is on where available (here the suite's IRMINSUL_COMPILE_DECODE=0 turns the default off)."""
    from irminsul.cli import build_parser
    from irminsul.server.app import ServerState
    from irminsul.server.cli import config_from_args

    def config(*flags):
        return config_from_args(build_parser().parse_args(["serve", "--reuse", "off", *flags]))

    assert config().compile_decode is None
    assert config("--compile-decode").compile_decode is True
    assert config("--no-compile-decode").compile_decode is False
    assert ServerState(config("--compile-decode")).client.engine.runner.compiled is not None
    assert ServerState(config()).client.engine.runner.compiled is None


def test_compiled_by_default_in_the_background_once_per_model(tmp_path, monkeypatch):
    """By default the step compiles on a thread of its own: the engine serves at once, eagerly, and
    takes the step at its first decode step after it is ready; later engines share it."""
    monkeypatch.delenv("IRMINSUL_COMPILE_DECODE")
    from irminsul.engine.build import build_engine
    from irminsul.engine.config import EngineConfig
    from irminsul.model import compiled

    path = make_tiny_checkpoint(tmp_path / "v2", "v2")
    release, real = threading.Event(), compiled.CompiledDecode.warmed

    def held(self, progress=True):  # the build waits until the test lets it finish
        release.wait(120)
        return real(self, progress)

    monkeypatch.setattr(compiled.CompiledDecode, "warmed", held)
    monkeypatch.setenv("IRMINSUL_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    monkeypatch.setattr(compiled.CompiledDecode, "measure", lambda self: {"one": True, "batch": True})
    llm = LLM(path)
    assert llm.engine.runner.compiled is None  # still compiling: the eager path decodes
    eager = llm.generate(_rand(40, 1), max_tokens=6, ignore_eos=True)
    assert llm.engine.runner.compiled is None
    release.set()
    assert llm.wait_compiled(300)
    step = llm.engine.runner.compiled
    calls = []
    real_fn = step._fn
    step._fn = lambda *a: calls.append(1) or real_fn(*a)
    again = llm.generate(_rand(40, 1), max_tokens=6, ignore_eos=True)
    assert calls and again.token_ids == eager.token_ids  # the compiled step took over, the same tokens

    other = build_engine(EngineConfig.of(reuse="pic"), llm.model, llm.tokenizer, pool=llm.engine.pool)
    assert other.runner.compiled is step  # one per model, shared by its engines
    assert build_engine(EngineConfig.of(compile_decode=False), llm.model, llm.tokenizer).runner.compiled is None
    assert LLM(make_tiny_checkpoint(tmp_path / "v32", "v32")).engine.runner.compiled is None  # not covered: eager


def test_a_background_build_that_fails_leaves_the_eager_path_serving(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("IRMINSUL_COMPILE_DECODE")
    from irminsul.model import compiled

    def broken(self, progress=True):
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(compiled.CompiledDecode, "warmed", broken)
    llm = LLM(make_tiny_checkpoint(tmp_path / "v2", "v2"))
    assert not llm.wait_compiled(60)
    assert "no compiler today" in caplog.text
    assert len(llm.generate(_rand(20, 2), max_tokens=3, ignore_eos=True).token_ids) == 3


def test_a_step_class_measured_no_faster_decodes_eagerly(tmp_path, monkeypatch):
    """By default the built step is judged on the machine (`CompiledDecode.measure`, cached with the
    kernel choices): a class measured no faster than eager is not taken, the other is; a later start
    that finds neither pays does not compile at all."""
    monkeypatch.delenv("IRMINSUL_COMPILE_DECODE")
    monkeypatch.setenv("IRMINSUL_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    from irminsul.model import compiled, kernel_choice

    monkeypatch.setattr(kernel_choice, "_memory", {})
    path = make_tiny_checkpoint(tmp_path / "v2", "v2")
    measured = []
    monkeypatch.setattr(
        compiled.CompiledDecode, "measure", lambda self: measured.append(1) or {"one": False, "batch": True}
    )
    llm = LLM(path)
    assert llm.wait_compiled(300) and measured == [1]
    step = llm.engine.runner.compiled
    assert step.pays == {"one": False, "batch": True}
    calls, batch_calls = [], []
    real_fn, real_batch = step._fn, step._batch_fn
    step._fn = lambda *a: calls.append(1) or real_fn(*a)
    step._batch_fn = lambda *a: batch_calls.append(1) or real_batch(*a)
    llm.generate(_rand(30, 3), max_tokens=4, ignore_eos=True)
    assert not calls  # one sequence: eager
    llm.generate([_rand(30, 4), _rand(33, 5)], max_tokens=4, ignore_eos=True)
    assert batch_calls and not calls  # a batch: compiled

    monkeypatch.setattr(kernel_choice, "_memory", {})  # a new process: the verdict from the cache file
    kernel_choice._write_cache(
        kernel_choice.cache_path(llm.model.settings),
        {compiled.verdict_key(llm.model): {"one": False, "batch": False}},
    )
    again = LLM(path)
    assert again.engine.runner.compiled is None and getattr(again.model, "_compiled_decode", None) is None
    assert measured == [1]  # (not measured again, not compiled)
    # required (--compile-decode): taken whatever was measured
    assert LLM(path, compile_decode=True).engine.runner.compiled.pays == {"one": True, "batch": True}


def test_the_measurement_times_the_compiled_step_against_the_eager_forward(tiny_dir):
    """`measure` runs both paths on scratch rows (the eager one through the model's own forward pass)
    and applies PAYS to their times."""
    from irminsul.model import compiled

    llm = LLM(tiny_dir, compile_decode=True)
    step = llm.engine.runner.compiled
    got = step.measure(keys=24, batch=2)
    assert set(got["times"]) == ({"one", "batch"} if step.max_batch >= 2 else {"one"})
    for what, t in got["times"].items():
        assert t["compiled"] > 0 and t["eager"] > 0
        assert got[what] == (t["compiled"] <= compiled.PAYS * t["eager"])


def test_models_of_many_shapes_in_one_process_each_compile_their_own_steps(tmp_path, monkeypatch):
    """Dynamo keeps graphs per code object and stops at its recompile limit, which fails a fullgraph
    compile: the steps of every model loaded in a process must not share one code object (a ninth
    shape would fail to compile; with the limit at 2 here, a second model's batch step)."""
    import torch

    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)  # (the batch step's two graphs)
    for i, variant in enumerate(("v2", "v3")):
        llm = LLM(make_tiny_checkpoint(tmp_path / variant, variant), compile_decode=True)
        prompts = [_rand(9, i), _rand(14, i + 10)]
        got = llm.generate(prompts, max_tokens=4, ignore_eos=True)
        ref = LLM(tmp_path / variant, compile_decode=False).generate(prompts, max_tokens=4, ignore_eos=True)
        assert [r.token_ids for r in got] == [r.token_ids for r in ref]
