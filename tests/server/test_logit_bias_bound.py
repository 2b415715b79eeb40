"""logit_bias takes at most MAX_LOGIT_BIAS entries (OpenAI's bound): more is a 400 that names the
field, decided by the count before any entry is read."""

import httpx

from irminsul.engine.sampling import MAX_LOGIT_BIAS


def _post(server, logit_bias: dict) -> httpx.Response:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0, "logit_bias": logit_bias}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60)


def test_more_logit_bias_entries_than_the_bound_is_a_400_naming_the_field(server):
    assert _post(server, {str(i): 1 for i in range(MAX_LOGIT_BIAS)}).status_code == 200
    for bias in (
        {str(i): -100 for i in range(MAX_LOGIT_BIAS + 1)},
        {"x": 1, **{str(i): 1 for i in range(MAX_LOGIT_BIAS)}},
    ):  # (the count, not the bad key)
        r = _post(server, bias)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "logit_bias" and f"at most {MAX_LOGIT_BIAS}" in error["message"], error
