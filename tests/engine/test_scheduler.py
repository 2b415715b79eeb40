"""The engine's scheduler: streamed text, preemption under a small pool, in-flight reuse of a shared
document, and the pool holding that document once."""

import numpy as np

from irminsul import LLM
from irminsul.engine.sampling import SamplingParams


def _rand(n, seed, lo=0, hi=250):
    return np.random.default_rng(seed).integers(lo, hi, n).tolist()


def _run(engine, seqs) -> dict:
    """Step until every sequence is done; the streamed text of each."""
    for seq in seqs:
        engine.add_request(seq)
    streamed = {seq.id: "" for seq in seqs}
    while engine.has_work:
        for out in engine.step():
            streamed[out.seq.id] += out.text
    return streamed


def test_streamed_text_is_the_output_and_never_shows_a_stop_string(tiny_dir):
    llm = LLM(tiny_dir)
    base = llm.generate("stop test", max_tokens=24, ignore_eos=True)
    stop = base.text[5:8]
    assert len(stop) == 3 and stop in base.text
    seq = llm.engine.new_sequence(
        llm.tokenizer.encode("stop test"), SamplingParams(max_tokens=24, stop=(stop,), ignore_eos=True)
    )
    streamed = _run(llm.engine, [seq])[seq.id]
    assert seq.finish_reason == "stop" and streamed == seq.text == base.text[: base.text.index(stop)]


def test_a_small_pool_preempts_and_every_answer_stays_the_same(tiny_dir):
    """Four requests whose outputs outgrow the pool: some are preempted and recomputed, none fails,
    and each answer equals the one it gets alone (greedy)."""
    prompts = [_rand(150, 200 + i) for i in range(4)]
    alone = [LLM(tiny_dir).generate(p, max_tokens=120, ignore_eos=True).token_ids for p in prompts]
    per_row = LLM(tiny_dir).engine.pool.bytes_per_slot
    llm = LLM(tiny_dir, kv_cache_gib=900 * per_row / 2**30)  # 4 x (150 + 120) rows do not fit in 900
    seqs = [llm.engine.new_sequence(p, SamplingParams(max_tokens=120, ignore_eos=True)) for p in prompts]
    _run(llm.engine, seqs)
    assert [s.output_ids for s in seqs] == alone
    assert sum(s.stats.preempted for s in seqs) >= 1
    pool = llm.engine.pool
    assert pool.used == 0 and pool.free == pool.n_slots - 1  # reuse off: every row went back


def _burst(tiny_dir, segmented: bool):
    llm = LLM(tiny_dir, reuse="pic", max_prefill_tokens=512)
    doc, tail = _rand(1500, 300), [1, 2, 3]
    headers = [_rand(10 + 7 * i, 400 + i) for i in range(16)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    seqs = [
        llm.engine.new_sequence(h + doc + tail, params, [0, len(h), len(h) + len(doc)] if segmented else None)
        for h in headers
    ]
    for seq in seqs:
        llm.engine.add_request(seq)
    peak = 0
    while llm.engine.has_work:
        llm.engine.step()
        peak = max(peak, llm.engine.pool.used)
    own = sum(len(h) + len(tail) for h in headers)  # every request's header and question
    # one copy of every distinct token's rows: the document, each header, question and output, and
    # the document rows the sink rule recomputes in each context (sources at positions < 32)
    distinct = len(doc) + own + 16 * params.max_tokens + sum(s.stats.carve_out_tokens for s in seqs)
    return seqs, sum(s.stats.computed_tokens for s in seqs), own, peak, distinct


def test_a_burst_sharing_a_new_document_computes_it_once_and_holds_it_once(tiny_dir):
    """The multi-agent fan-out: 16 chat requests arrive together (segmented: header, document,
    question), the same new 1,500-token document behind 16 different headers. The first computes
    it; the others wait for its rows and reuse them, every row read at its own position (the
    δ-rotation). The pool holds the document once."""
    seqs, computed, own, peak, distinct = _burst(tiny_dir, segmented=True)
    assert computed <= 1500 + own + 16 * 32, [s.stats for s in seqs]  # + at most the sink carve-out each
    assert all(s.stats.reused_tokens >= 1500 - 32 for s in seqs[1:])
    assert peak <= 1.1 * distinct, (peak, distinct)


def test_a_flat_burst_recomputes_only_where_chunk_boundaries_resynchronise(tiny_dir):
    """The same burst as flat token ids (CDC alone): each later request computes the chunk its header
    shares with the document, about one expected chunk (128 tokens), and nothing else of it."""
    seqs, computed, own, peak, distinct = _burst(tiny_dir, segmented=False)
    assert computed <= 1500 + own + 15 * 2 * 128, [s.stats for s in seqs]
    assert peak <= 1.1 * (distinct + 15 * 2 * 128)


def test_degenerate_sampling_values_sample_and_never_fail_the_step(tiny_dir):
    """top_p=1e-50 is 0 in float32 and temperature=1e-40 overflows the logits; neither may fail the
    whole batch ("invalid multinomial distribution"). Every value that passes validation samples,
    degenerate ones greedily, and the greedy neighbours in the same steps are untouched."""
    import pytest
    import torch

    from irminsul.engine.sampling import sample

    logits = torch.randn(300, generator=torch.Generator().manual_seed(0))
    for p in (
        SamplingParams(temperature=1.0, top_p=1e-50),
        SamplingParams(temperature=1e-40),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=100.0, top_k=3),
    ):
        token = sample(logits, p, None)
        assert 0 <= token < 300 and (not p.greedy or token == int(logits.argmax()))
    llm = LLM(tiny_dir)
    prompt = llm.tokenizer.encode("degenerate sampling")
    greedy = llm.generate(prompt, max_tokens=8, ignore_eos=True).token_ids
    odd = [
        SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-50, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=1e-40, ignore_eos=True),
    ]
    seqs = [llm.engine.new_sequence(prompt, p) for p in [SamplingParams(max_tokens=8, ignore_eos=True), *odd]]
    _run(llm.engine, seqs)
    assert all(s.finish_reason == "length" and s.error is None for s in seqs)
    assert all(s.output_ids == greedy for s in seqs)  # degenerate sampling is greedy
    with pytest.raises(Exception, match="temperature"):
        SamplingParams(temperature=float("nan"))


def test_an_error_in_one_sequence_ends_that_sequence_alone(tiny_dir, monkeypatch):
    """Sampled, greedy and constrained neighbours in the same steps finish as they would alone when
    one sequence's sampling, logit adjustment or grammar mask raises; only that one is aborted."""
    import irminsul.engine.output as engine_module
    from irminsul.engine.grammar import Constraint

    llm = LLM(tiny_dir, compile_decode=False)
    prompt = _rand(40, 7)
    cases = {
        "sampled": SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True),
        "top_k": SamplingParams(max_tokens=12, temperature=1.0, top_k=2**63, seed=4, ignore_eos=True),
        "greedy": SamplingParams(max_tokens=12, ignore_eos=True),
        "biased": SamplingParams(max_tokens=12, temperature=0.7, seed=5, logit_bias=((3, 2.0),), ignore_eos=True),
        "regex": SamplingParams(max_tokens=12, temperature=1.0, seed=6, constraint=Constraint.regex("[a-z ]{1,40}")),
    }
    alone = {}
    for name, params in cases.items():
        seq = llm.engine.new_sequence(prompt, params)
        _run(llm.engine, [seq])
        assert seq.error is None, (name, seq.error)
        alone[name] = seq.output_ids

    def faulty(seq_params_marker, original):
        def wrapped(*args, **kwargs):
            params = args[1] if len(args) > 1 else kwargs.get("params")
            if isinstance(params, list) and any(p.seed == seq_params_marker for p in params):
                raise OverflowError("injected")
            if isinstance(params, SamplingParams) and params.seed == seq_params_marker:
                raise OverflowError("injected")
            return original(*args, **kwargs)

        return wrapped

    bad = {
        "sample": SamplingParams(max_tokens=12, temperature=1.0, seed=666, ignore_eos=True),
        "adjust": SamplingParams(max_tokens=12, temperature=1.0, seed=666, presence_penalty=0.5, ignore_eos=True),
    }
    for where, target in (("sample", "sample_batch"), ("adjust", "adjust_logits")):
        monkeypatch.setattr(engine_module, target, faulty(666, getattr(engine_module, target)))
        seqs = {name: llm.engine.new_sequence(prompt, params) for name, params in cases.items()}
        victim = llm.engine.new_sequence(prompt, bad[where])
        _run(llm.engine, [*seqs.values(), victim])
        monkeypatch.undo()
        assert victim.finish_reason == "abort" and "internal error" in victim.error, (where, victim.error)
        for name, seq in seqs.items():
            assert seq.error is None and seq.output_ids == alone[name], (where, name, seq.error)

    # a grammar whose mask computation fails takes down its own sequence only
    original_allowed = llm.engine.grammars.allowed
    victim = llm.engine.new_sequence(
        prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=9, constraint=Constraint.regex("[0-9]{1,40}"))
    )

    def allowed(matchers):
        if any(m is victim.matcher for m in matchers):
            raise RuntimeError("injected")
        return original_allowed(matchers)

    monkeypatch.setattr(llm.engine.grammars, "allowed", allowed)
    seqs = {name: llm.engine.new_sequence(prompt, params) for name, params in cases.items()}
    _run(llm.engine, [*seqs.values(), victim])
    assert victim.finish_reason == "abort" and "grammar" in victim.error
    for name, seq in seqs.items():
        assert seq.error is None and seq.output_ids == alone[name], (name, seq.error)
