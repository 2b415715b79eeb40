"""Reuse is visible to clients (usage, /metrics) and never crosses tenants; published chunks are shared."""

import httpx

from tests.server.server_helpers import chat, metric, start, text


def agent_turn(header: str, tool_output: str, question: str) -> list:
    return [
        {"role": "system", "content": header},
        {"role": "system", "content": "You are an airline agent. Follow the policy."},
        {"role": "user", "content": question},
        {"role": "tool", "content": tool_output},
    ]


def test_agent_session_reuses_moved_content(server):
    doc = text(150, 10)  # ~1,000 tokens: several CDC chunks
    first = chat(server.url, agent_turn("request 1 ts=09:00", doc, "Can I change my flight?"))
    assert first["usage"]["irminsul"]["reused_tokens"] == 0
    before = metric(server.url, "irminsul_reused_tokens_total")
    # next turn: a longer metadata header shifts everything after it (no exact prefix beyond a few tokens)
    second = chat(server.url, agent_turn("request 22 ts=09:01 agent=support tier=gold", doc, "And my bags?"))
    u = second["usage"]
    split = u["irminsul"]
    assert split["reused_tokens"] > 0.7 * len(doc), u
    assert u["prompt_tokens_details"]["cached_tokens"] == split["prefix_tokens"] + split["reused_tokens"]
    assert split["prefix_tokens"] + split["reused_tokens"] + split["computed_tokens"] == u["prompt_tokens"]
    assert metric(server.url, "irminsul_reused_tokens_total") - before == split["reused_tokens"]


def test_tenants_are_isolated_and_nobody_publishes_without_the_admin_key(server):
    private = text(120, 20)
    chat(server.url, agent_turn("hdr x1", private, "q"), cache_salt="tenant-x")
    other = chat(server.url, agent_turn("hdr y12345", private, "q"), cache_salt="tenant-y")
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # not even the template prefix
    again = chat(server.url, agent_turn("hdr x1234567", private, "q"), cache_salt="tenant-x")
    assert again["usage"]["irminsul"]["reused_tokens"] > 0.7 * len(private)
    # A salt cannot name the operator's shared namespace: what it computes stays private to it.
    chat(server.url, agent_turn("h", private, "q"), cache_salt="\x00shared")
    assert (
        chat(server.url, agent_turn("hdr z", private, "q"), cache_salt="tenant-z")["usage"]["irminsul"]["reused_tokens"]
        == 0
    )

    # Without an admin key nobody may publish: the shared namespace is every tenant's to read.
    r = httpx.post(server.url + "/v1/cache/chunks", json={"text": text(120, 21)})
    assert r.status_code == 403 and "--admin-key" in r.json()["error"]["message"]


def test_published_chunks_are_shared_by_every_tenant(tiny_dir):
    s = start(tiny_dir, admin_key="root")
    try:
        shared = text(120, 21)
        r = httpx.post(s.url + "/v1/cache/chunks", json={"text": shared}, headers={"Authorization": "Bearer root"})
        assert r.status_code == 200 and r.json()["entries"] >= 2, r.text
        for salt, header in (("tenant-x", "h1"), ("tenant-y", "header 2 is longer")):
            msgs = [
                {"role": "system", "content": header},
                {"role": "user", "content": [{"type": "text", "text": shared}]},
            ]  # the document as its own part
            got = chat(s.url, msgs, cache_salt=salt)["usage"]["irminsul"]
            assert got["reused_tokens"] > 0.6 * len(shared), (salt, got)
    finally:
        s.stop()


def test_api_keys_name_tenants_and_guard_publishing(tiny_dir):
    s = start(tiny_dir, api_keys=(("ka", "alice"), ("kb", "bob")), admin_key="root")
    try:
        doc = text(120, 30)
        alice, bob = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):  # the key before the body
            r = httpx.post(s.url + path, content=b"{not json")
            assert r.status_code == 401, (path, r.text)
        chat(s.url, agent_turn("a", doc, "q"), headers=alice)
        assert chat(s.url, agent_turn("bbbbbb", doc, "q"), headers=bob)["usage"]["irminsul"]["reused_tokens"] == 0
        assert chat(s.url, agent_turn("aaaaaa", doc, "q"), headers=alice)["usage"]["irminsul"]["reused_tokens"] > 0
        r = httpx.post(s.url + "/v1/cache/chunks", json={"text": doc}, headers=alice)
        assert r.status_code == 403 and "admin" in r.json()["error"]["message"]
        r = httpx.post(s.url + "/v1/cache/chunks", json={"text": doc}, headers={"Authorization": "Bearer root"})
        assert r.status_code == 200
        assert chat(s.url, agent_turn("bb", doc, "q"), headers=bob)["usage"]["irminsul"]["reused_tokens"] > 0
    finally:
        s.stop()


def test_reuse_off_serves_without_a_store(tiny_dir):
    s = start(tiny_dir, reuse="off", admin_key="root")
    try:
        u = chat(s.url, agent_turn("h", text(30, 90), "q"))["usage"]
        assert u["irminsul"]["computed_tokens"] == u["prompt_tokens"]
        assert "irminsul_store_bytes" not in httpx.get(s.url + "/metrics").text
        r = httpx.post(s.url + "/v1/cache/chunks", json={"text": "doc"}, headers={"Authorization": "Bearer root"})
        assert r.status_code == 400 and "--reuse" in r.json()["error"]["message"]
    finally:
        s.stop()
