"""The official openai client against a real server: chat (streaming and not), completions, models."""

import openai
import pytest

from tests.server.server_helpers import text


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_chat_non_streaming_and_streaming_agree(client):
    messages = [{"role": "system", "content": text(40, 1)}, {"role": "user", "content": "Which bags are free?"}]
    first = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    choice = first.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    u = first.usage
    assert u.completion_tokens == 6 and u.total_tokens == u.prompt_tokens + 6
    assert u.prompt_tokens_details.cached_tokens == 0
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    # The same prompt again: everything but the last prompt token comes from the exact prefix.
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    split = usage.model_extra["irminsul"]
    assert split["prefix_tokens"] == usage.prompt_tokens - 1 and split["reused_tokens"] == 0


def test_completions_and_stop_strings(client):
    out = client.completions.create(model="tiny", prompt="hello world", max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop") and out.usage.prompt_tokens == len("hello world") + 1
    full = out.choices[0].text
    if len(full) >= 2:  # a stop string cuts the text and ends the request
        cut = client.completions.create(
            model="tiny", prompt="hello world", max_tokens=5, temperature=0, stop=[full[1:2]]
        )
        assert cut.choices[0].text == full[: full.index(full[1:2])] and cut.choices[0].finish_reason == "stop"


def test_errors_raise_the_clients_exceptions(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="n=0"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=0)


def test_logprobs_through_the_client_equal_score(client, tiny_dir):
    """Chat and completion log-probs, streamed or not, equal LLM.score on the same tokens (1e-4)."""
    from irminsul import LLM

    llm = LLM(tiny_dir)
    prompt = "score these words"
    out = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=5, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = out.choices[0].logprobs
    ids = llm.generate(prompt, max_tokens=5, ignore_eos=True).token_ids
    ref = llm.score(llm.tokenizer.encode(prompt), ids)
    assert len(lp.token_logprobs) == 5 and all(len(t) <= 2 for t in lp.top_logprobs)
    assert max(abs(a - float(ref[i, t])) for i, (a, t) in enumerate(zip(lp.token_logprobs, ids))) < 1e-4
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == out.choices[0].text
    messages = [{"role": "user", "content": "hi there"}]
    full = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = full.choices[0].logprobs.content
    assert len(content) == 4 and all(
        len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content
    )
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    streamed = [
        c for chunk in stream if chunk.choices and chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content
    ]
    assert [(c.token, round(c.logprob, 5)) for c in streamed] == [(c.token, round(c.logprob, 5)) for c in content]


def test_echo_returns_the_prompts_logprobs_as_lm_eval_reads_them(client, tiny_dir):
    """lm-evaluation-harness's loglikelihood: echo=True, logprobs=1, max_tokens=1; it reads
    token_logprobs over the continuation's span. They equal LLM.score of the same tokens."""
    from irminsul import LLM

    llm = LLM(tiny_dir)
    context, continuation = "The capital of France is", " Paris"
    out = client.completions.create(
        model="tiny", prompt=context + continuation, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    lp = out.choices[0].logprobs
    ids = llm.tokenizer.encode(context + continuation)
    assert out.choices[0].text.startswith(context + continuation)
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids) + 1
    ref = llm.score(ids[:1], ids[1:])
    got = lp.token_logprobs[1 : len(ids)]
    assert max(abs(a - float(ref[i, t])) for i, (a, t) in enumerate(zip(got, ids[1:]))) < 1e-4
    assert lp.text_offset[: len(ids)] == sorted(lp.text_offset[: len(ids)])


def test_echo_does_not_count_its_own_scoring_as_a_cache_hit(tiny_dir):
    """Scoring an echoed prompt's log-probs is no cache hit: a prompt nobody has sent before reports
    0 cached tokens and every prompt token computed, even when its job queues first (scoring it
    while queued would make it look almost all cached, cached_tokens = prompt - 1). Here the job
    queues behind a long request (one runs at a time)."""
    import threading

    from tests.server.server_helpers import start

    s = start(tiny_dir, max_running_requests=1)
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        busy = threading.Thread(
            target=lambda: c.completions.create(
                model="tiny", prompt=[7] * 20, max_tokens=300, temperature=0, extra_body={"ignore_eos": True}
            )
        )
        busy.start()
        ids = list(range(40, 140))
        out = c.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True)
        busy.join()
        u = out.usage.model_extra["irminsul"]
        assert out.usage.prompt_tokens_details.cached_tokens == 0 and u["computed_tokens"] == len(ids), out.usage
        assert len(out.choices[0].logprobs.token_logprobs) == len(ids) + 1
    finally:
        s.stop()


def test_a_stop_token_is_scored_though_not_output(client, tiny_dir):
    """When the one generated token is EOS, its entry is still there (as vLLM's is): lm-eval reads
    token_logprobs[ctxlen:-1], so a missing entry would cut the continuation's last token."""
    from irminsul import LLM

    llm = LLM(tiny_dir)
    eos = sorted(llm.engine.eos_ids)[0]
    prompt = "The capital of France is Paris"
    out = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True, logit_bias={str(eos): 100}
    )  # biased: the log-probs are the model's
    c = out.choices[0]
    ids = llm.tokenizer.encode(prompt)
    assert c.finish_reason == "stop" and c.text == prompt and out.usage.completion_tokens == 0
    assert len(c.logprobs.token_logprobs) == len(ids) + 1 and c.logprobs.tokens[-1] == ""
    assert abs(c.logprobs.token_logprobs[-1] - float(llm.score(ids, [eos])[0, eos])) < 1e-4
    assert "".join(c.logprobs.tokens) == c.text


def test_batched_prompts_and_n_choices(client):
    """A list of prompts returns one choice per prompt, each what the prompt gets alone; n choices
    of one prompt sample with seed, seed + 1, ... ; usage counts each prompt once."""
    prompts = ["first prompt", "the second one", [256, 104, 105]]
    alone = [
        client.completions.create(model="tiny", prompt=p, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
        for p in prompts
    ]
    batch = client.completions.create(
        model="tiny", prompt=prompts[:2], max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone[:2]]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone[:2])
    assert batch.usage.completion_tokens == 8
    many = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=5,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in many.choices] == [0, 1, 2] and many.usage.completion_tokens == 18
    one = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=1.0,
        seed=5,
        extra_body={"ignore_eos": True},
    )
    assert many.choices[0].message.content == one.choices[0].message.content  # choice 0 uses the seed itself
    assert many.usage.prompt_tokens == one.usage.prompt_tokens


@pytest.mark.parametrize("reuse", ["off", "prefix", "pic"])
def test_n_choices_share_one_prefill(tiny_dir, reuse):
    """n choices of one prompt compute it once, in every reuse mode (off too): the other choices
    share the first one's rows and compute only the prompt's last position. Sharing changes no
    output: each choice is what its seed gets alone."""
    from tests.server.server_helpers import metric, start

    s = start(tiny_dir, reuse=reuse)
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        prompt = text(300, 11)
        before = metric(s.url, "irminsul_computed_tokens_total", model="tiny")
        many = client.completions.create(
            model="tiny", prompt=prompt, n=4, max_tokens=3, temperature=1.0, seed=9, extra_body={"ignore_eos": True}
        )
        computed = metric(s.url, "irminsul_computed_tokens_total", model="tiny") - before
        p = many.usage.prompt_tokens
        assert computed == p + 3  # once, plus the last position for each other choice
        assert many.usage.prompt_tokens_details.cached_tokens == 0  # what the request found, not its siblings
        for i, c in enumerate(many.choices):
            alone = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=3, temperature=1.0, seed=9 + i, extra_body={"ignore_eos": True}
            )
            assert c.text == alone.choices[0].text
    finally:
        s.stop()


def test_several_choices_stream_and_agree_with_the_response(client):
    """n > 1 and a batch of prompts, streamed: chunks name their choice; each choice's text and
    finish reason equal the non-streamed response's; one usage chunk at the end counts each prompt once."""
    for kw in (
        {"prompt": "several streamed choices", "n": 3, "temperature": 1.0, "seed": 4},
        {"prompt": ["first of two", "and the second"], "temperature": 0},
    ):
        whole = client.completions.create(model="tiny", max_tokens=5, extra_body={"ignore_eos": True}, **kw)
        chunks = list(
            client.completions.create(
                model="tiny",
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
                **kw,
            )
        )
        texts, reasons = {}, {}
        for c in chunks[:-1]:
            (choice,) = c.choices
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
        assert [texts[c.index] for c in whole.choices] == [c.text for c in whole.choices]
        assert [reasons[c.index] for c in whole.choices] == [c.finish_reason for c in whole.choices]
        assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    many = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        n=2,
        max_tokens=4,
        temperature=1.0,
        seed=2,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    roles = [c.choices[0].index for c in many if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
