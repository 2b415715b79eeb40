"""Ray's prefix-affinity router reads the prompt text out of the fleet's forwarded request."""

import asyncio
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")

from irminsul.fleet.asgi import Forwarded  # noqa: E402
from irminsul.fleet.prefix_router import PowerOfTwoRequestRouter, PrefixAffinityRequestRouter  # noqa: E402


def pending(body: bytes, **kwargs) -> SimpleNamespace:
    return SimpleNamespace(args=(Forwarded("POST", "/v1/chat/completions", b"", (), body),), kwargs=kwargs)


def test_the_text_is_rays_normalisation_of_the_bodys_messages_or_prompt():
    router = object.__new__(PrefixAffinityRequestRouter)  # (only the text extraction, no Serve)
    messages = [
        {"role": "system", "content": "Header. "},
        {"role": "user", "content": [{"type": "text", "text": "Doc one. "}, {"type": "text", "text": "Two."}]},
    ]
    assert (
        router._extract_text_from_request(pending(json.dumps({"messages": messages}).encode()))
        == "Header. Doc one. Two."
    )
    assert router._extract_text_from_request(pending(json.dumps({"prompt": "Once upon"}).encode())) == "Once upon"
    for body in (b"", b"not json", json.dumps({"messages": []}).encode(), b"[1, 2]"):
        assert router._extract_text_from_request(pending(body)) is None  # (Ray divides by its length)


def test_a_targeted_call_goes_to_the_replica_it_names_or_nowhere():
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=u)) for u in ("a", "b")]
    for cls in (PrefixAffinityRequestRouter, PowerOfTwoRequestRouter):
        router = object.__new__(cls)
        assert asyncio.run(router.choose_replicas(replicas, pending(b"", target="b"))) == [[replicas[1]]]
        assert asyncio.run(router.choose_replicas(replicas, pending(b"", target="gone"))) == []
