"""The public API: generation, sampling, stop conditions, scoring and clear errors."""

import json

import pytest
import torch

from irminsul import LLM, CheckpointError, ConfigError, RequestError, Segments
from irminsul.model.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir)


def test_generate_greedy_is_deterministic_and_reports_stats(llm):
    a = llm.generate("hello world", max_tokens=8, ignore_eos=True)
    b = llm.generate([256] + list(b"hello world"), max_tokens=8, ignore_eos=True)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 8
    assert a.finish_reason == "length"
    s = a.stats
    assert s.prompt_tokens == 12 and s.computed_tokens == 12 and s.prefix_tokens == s.reused_tokens == 0
    assert s.prompt_tokens == s.prefix_tokens + s.reused_tokens + s.computed_tokens


def test_greedy_equals_argmax_of_score(llm):
    prompt = [256] + list(b"the quick brown fox")
    out = llm.generate(prompt, max_tokens=6, ignore_eos=True)
    logprobs = llm.score(prompt, out.token_ids)
    assert logprobs.shape == (6, llm.model.config.vocab_size)
    assert logprobs.argmax(-1).tolist() == out.token_ids


def test_seeded_sampling_reproduces_and_varies(llm):
    kw = dict(max_tokens=12, temperature=1.5, top_p=0.95, top_k=50, ignore_eos=True)
    a = llm.generate("abc", seed=7, **kw).token_ids
    assert a == llm.generate("abc", seed=7, **kw).token_ids
    others = {tuple(llm.generate("abc", seed=s, **kw).token_ids) for s in range(8, 12)}
    assert len(others | {tuple(a)}) > 1


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate("xyz", max_tokens=5, ignore_eos=True).token_ids
    assert llm.generate("xyz", max_tokens=5, temperature=1.0, top_k=1, seed=3, ignore_eos=True).token_ids == greedy


def test_stop_token_ids_and_strings(llm):
    base = llm.generate("stop test", max_tokens=10, ignore_eos=True)
    first = base.token_ids[2]
    cut = llm.generate("stop test", max_tokens=10, stop_token_ids=[first], ignore_eos=True)
    assert cut.finish_reason == "stop" and first not in cut.token_ids[: base.token_ids.index(first) + 1]
    text = llm.tokenizer.decode(base.token_ids)
    assert len(text) >= 3, text
    needle = text[1:3]
    r = llm.generate("stop test", max_tokens=10, stop=[needle], ignore_eos=True)
    assert r.finish_reason == "stop" and needle not in r.text


def test_segments_prompt_concatenates(llm):
    a = llm.generate(Segments([[256, 104, 105], [32, 116, 104, 101, 114, 101]]), max_tokens=4, ignore_eos=True)
    b = llm.generate([256, 104, 105, 32, 116, 104, 101, 114, 101], max_tokens=4, ignore_eos=True)
    assert a.token_ids == b.token_ids


def test_a_list_of_prompts_is_a_batch_with_the_same_answers(llm):
    """vLLM's convention: a list of prompts gives a list of results, in order, each the one the
    prompt gets alone (greedy decoding is batch-invariant here), generated together."""
    prompts = ["hello world", [256, 104, 105], Segments([[256, 120], [121, 122]]), "a longer prompt " * 5]
    alone = [llm.generate(p, max_tokens=6, ignore_eos=True) for p in prompts]
    together = llm.generate(prompts, max_tokens=6, ignore_eos=True)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [r.text for r in together] == [r.text for r in alone]
    pair = llm.generate([[256, 1, 2], [256, 3, 4]], max_tokens=2, ignore_eos=True)  # two token-id prompts
    assert [r.prompt_token_ids for r in pair] == [[256, 1, 2], [256, 3, 4]]


def test_stats_report_the_pool(llm):
    s = llm.stats()
    assert s["kv_pool_bytes_capacity"] > 0 and 0 <= s["kv_pool_bytes_used"] <= s["kv_pool_bytes_capacity"]
    assert s["running_sequences"] == 0 and s["cached_bytes"] == 0  # reuse off: nothing is kept


@pytest.mark.parametrize(
    "prompt,match",
    [
        ([], "empty"),
        ("", "empty"),
        ([1, 2, 100000], "outside the vocabulary"),
        ([1, -3], "outside the vocabulary"),
        ([5] * 4200, "context"),
        ([1.5, 2], "prompt must be"),
    ],
)
def test_bad_prompts_raise_clear_errors(llm, prompt, match):
    with pytest.raises(RequestError, match=match):
        llm.generate(prompt, max_tokens=2)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=-2), "top_k"),
        # refused when the request is made, by name, not deep inside a step or with a TypeError
        (dict(logit_bias=((5.5, 1.0),)), "logit_bias token ids"),
        (dict(logit_bias=5), "logit_bias must be"),
        (dict(stop=5), "stop must be"),
        (dict(stop_token_ids=[1.5]), "stop_token_ids must be"),
        (dict(stop_token_ids=[10**9]), "outside the vocabulary"),
        (dict(n=2), "no option n"),
    ],
)
def test_bad_sampling_params(llm, kw, match):
    with pytest.raises(RequestError, match=match):
        llm.generate("hi", **kw)


def test_unknown_reuse_mode(tiny_dir):
    with pytest.raises(RequestError, match="reuse"):
        LLM(tiny_dir, reuse="bogus")


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(max_running_requests=0), "max_running_requests"),  # once: generate() waited forever
        (dict(device="tpu"), "not a device"),
        (dict(kv_cache_gib=float("inf")), "kv_cache_gib"),
        (dict(kv_cache_gib=1e7), "more than the"),  # once: torch tried to allocate 10 PB
        (dict(kv_cache_gib="1"), "kv_cache_gib"),
        (dict(attention_backend="foo"), "attention_backend"),
        (dict(bogus_option=3), "unknown cache option bogus_option"),  # once: silently ignored
    ],
)
def test_bad_constructor_arguments_are_clear_errors(tiny_dir, kw, match):
    with pytest.raises(RequestError, match=match):
        LLM(tiny_dir, **kw)


def test_the_logit_controls_take_their_documented_forms(llm):
    """logit_bias as pairs or OpenAI's dict, one stop token id or several, ids as arrays / tensors."""
    import numpy as np

    a = llm.generate([3, 4, 5], max_tokens=3, logit_bias=((7, 100.0),), stop_token_ids=[9])
    b = llm.generate(np.array([3, 4, 5]), max_tokens=3, logit_bias={7: 100.0}, stop_token_ids=9)
    c = llm.generate(torch.tensor([3, 4, 5]), max_tokens=3, logit_bias={7: 100.0}, stop_token_ids=(9,))
    assert a.token_ids == b.token_ids == c.token_ids == [7, 7, 7]


def test_score_reads_the_whole_context(llm):
    """Scoring reads every token but the continuation's last: a full context of them is fine."""
    n = llm.engine.config.max_position_embeddings
    assert llm.score([5] * (n - 8), [6] * 9).shape[0] == 9
    with pytest.raises(RequestError, match="context"):
        llm.score([5] * (n - 8), [6] * 10)


def test_missing_and_corrupt_checkpoints(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        LLM(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="not a model hub id: download it first"):
        LLM("deepseek-ai/DeepSeek-V2-Lite")  # (a Hub id: only local directories are read)
    ckpt = make_tiny_checkpoint(tmp_path / "c")
    (ckpt / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="safetensors"):
        LLM(ckpt)
    ckpt2 = make_tiny_checkpoint(tmp_path / "d")
    (ckpt2 / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        LLM(ckpt2)
    # a malformed config file is a CheckpointError that names it, not a JSONDecodeError / AttributeError
    for name, text, match in (
        ("tokenizer_config.json", "{not json", "not valid JSON"),
        ("tokenizer_config.json", "[1]", "must hold a JSON object"),
        ("config.json", "[1, 2]", "must hold a JSON object"),
    ):
        ckpt3 = make_tiny_checkpoint(tmp_path / f"e{len(text)}{name[0]}")
        (ckpt3 / name).write_text(text)
        with pytest.raises(CheckpointError, match=match):
            LLM(ckpt3)


def test_sharded_checkpoint_loads_identically(tmp_path, tiny_dir):
    sharded = make_tiny_checkpoint(tmp_path / "s", shards=3)
    one, three = LLM(tiny_dir), LLM(sharded)
    want, got = one.model.state_dict(), three.model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    # Equal weights; the scores may still differ in the last bits, because a CPU's matmul kernels
    # take other paths for other memory alignments (9.5e-7 seen on an AMD EPYC).
    assert (one.score([1, 2, 3], [4, 5]) - three.score([1, 2, 3], [4, 5])).abs().max() < 1e-5
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    (sharded / sorted(set(index["weight_map"].values()))[1]).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        LLM(sharded)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("model_type", "llama", "model_type"),
        ("num_key_value_heads", 2, "num_key_value_heads"),
        ("num_experts_per_tok", 9, "num_experts_per_tok"),
        ("kv_lora_rank", None, "kv_lora_rank"),
        ("qk_rope_head_dim", 7, "qk_rope_head_dim"),
        ("hidden_act", "gelu", "hidden_act"),
    ],
)
def test_inconsistent_config_names_the_field(tmp_path, field, value, match):
    ckpt = make_tiny_checkpoint(tmp_path / "c")
    raw = json.loads((ckpt / "config.json").read_text())
    raw[field] = value
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=match):
        LLM(ckpt)


@pytest.mark.parametrize(
    "variant,field,value,match",
    [
        ("v32", "q_lora_rank", None, "q_lora_rank"),  # its indexer reads the query LoRA
        ("v32", "index_head_dim", 4, "index_head_dim"),  # narrower than the rotary part
        ("glm", "mlp_layer_types", ["dense", "moe", "sparse"], "mlp_layer_types"),
        ("longcat", "head_dim", 4, "head_dim"),  # transformers sizes its RoPE by head_dim
        ("longcat", "router_bias", True, "router_bias"),
    ],
)
def test_the_other_families_refuse_what_they_cannot_serve(tmp_path, variant, field, value, match):
    ckpt = make_tiny_checkpoint(tmp_path / "c", variant)
    raw = json.loads((ckpt / "config.json").read_text())
    raw[field] = value
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=match):
        LLM(ckpt)


def test_weights_that_do_not_match_the_config(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "c")
    raw = json.loads((ckpt / "config.json").read_text())
    raw["hidden_size"] = 96
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="shape"):
        LLM(ckpt)


@pytest.mark.parametrize("gib", [0, -1.0])
def test_a_zero_or_negative_pool_is_refused(tiny_dir, gib):
    """A zero budget once became 512 MiB silently (`x or default`)."""
    with pytest.raises(RequestError, match="kv_cache_gib"):
        LLM(tiny_dir, kv_cache_gib=gib)


def test_generated_logprobs_equal_score(llm):
    prompt = [256] + list(b"log probabilities")
    out = llm.generate(prompt, max_tokens=6, ignore_eos=True, logprobs=3)
    ref = llm.score(prompt, out.token_ids)
    assert [lp.token for lp in out.logprobs] == out.token_ids
    for i, lp in enumerate(out.logprobs):
        assert abs(lp.logprob - float(ref[i, lp.token])) < 1e-4
        best = ref[i].topk(3)
        assert [t for t, _ in lp.top] == best.indices.tolist()
        assert max(abs(v - w) for (_, v), w in zip(lp.top, best.values.tolist())) < 1e-4
    assert llm.generate(prompt, max_tokens=2).logprobs is None
    with pytest.raises(RequestError, match="logprobs"):
        llm.generate(prompt, max_tokens=2, logprobs=21)


def test_logit_controls_change_the_output_as_defined(llm):
    """logit_bias, presence / frequency / repetition penalties, min_tokens, min_p and
    include_stop_str_in_output, each checked against its definition on the greedy output."""
    prompt = [256] + list(b"the the the the")
    base = llm.generate(prompt, max_tokens=8, ignore_eos=True)
    forced = llm.generate(prompt, max_tokens=4, ignore_eos=True, logit_bias=((65, 100.0),))
    assert forced.token_ids == [65] * 4  # a +100 bias wins every argmax
    for kw in (dict(presence_penalty=2.0), dict(frequency_penalty=2.0), dict(repetition_penalty=3.0)):
        out = llm.generate(prompt, max_tokens=8, ignore_eos=True, **kw)
        assert len(set(out.token_ids)) >= len(set(base.token_ids)), kw  # penalised repeats: no fewer distinct
    first = base.token_ids[0]
    stopped = llm.generate(prompt, max_tokens=8, ignore_eos=True, stop_token_ids=[first])
    assert stopped.token_ids == [] and stopped.finish_reason == "stop"
    held = llm.generate(prompt, max_tokens=8, ignore_eos=True, stop_token_ids=[first], min_tokens=3)
    assert len(held.token_ids) >= 3 and first not in held.token_ids[:3]
    assert (
        llm.generate(prompt, max_tokens=8, temperature=1.0, seed=3, min_p=1.0, ignore_eos=True).token_ids
        == base.token_ids
    )  # min_p = 1 keeps only the most likely token: greedy
    text = base.text
    if len(text) >= 3:
        stop = text[1:3]
        kept = llm.generate(prompt, max_tokens=8, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
        assert kept.text == text[: text.index(stop) + len(stop)]
