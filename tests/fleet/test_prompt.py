"""The fleet's prompt reader sees a request as its replica will: the same rendering, token ids and
namespace as the server's own functions give, and no key for what the replica will refuse."""

import json
from types import SimpleNamespace

import pytest

from irminsul.bundled import bundled_model
from irminsul.fleet.prompt import PromptReader
from irminsul.kvcache.namespaces import SHARED
from irminsul.model.tokenizer import Tokenizer
from irminsul.server.chat import ChatRenderer
from irminsul.server.config import ServerConfig
from irminsul.server.errors import APIError
from irminsul.server.tenancy import Tenancy


@pytest.fixture(scope="module")
def reader():
    tokenizer = Tokenizer(bundled_model("mla"))
    config = ServerConfig(api_keys=(("key-a", "a"),))
    return PromptReader(config, tokenizer, ChatRenderer(tokenizer))


def request(key: str | None = "key-a"):
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return SimpleNamespace(headers=headers, client=SimpleNamespace(host="10.0.0.1"))


def body(obj) -> bytes:
    return json.dumps(obj).encode()


def test_a_chat_routes_by_the_prompt_its_replica_renders(reader):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    key = reader.route_key("/v1/chat/completions", request(), body({"messages": messages, "cache_salt": "s"}))
    rendered = reader.renderer.render(messages)
    assert key.token_ids.tolist() == rendered.token_ids
    assert key.segment_starts == tuple(rendered.segment_starts)
    assert key.tenant == "key:a|salt:s"
    # the Responses API's input is the same chat
    same = reader.route_key("/v1/responses", request(), body({"input": "hello there", "instructions": "be brief"}))
    assert same.token_ids.tolist() == rendered.token_ids and same.tenant == "key:a"


def test_a_completion_batch_routes_as_one_prompt_with_each_prompt_a_segment(reader):
    key = reader.route_key("/v1/completions", request(), body({"prompt": ["one two", "three"]}))
    first, second = reader.tokenizer.encode("one two"), reader.tokenizer.encode("three")
    assert key.token_ids.tolist() == first + second
    assert key.segment_starts == (0, len(first))
    ids = reader.route_key("/v1/completions", request(), body({"prompt": [[5, 6, 7], [8, 9]]}))
    assert ids.token_ids.tolist() == [5, 6, 7, 8, 9] and ids.segment_starts == (0, 3)


def test_a_published_document_routes_in_the_shared_namespace(reader):
    key = reader.route_key("/v1/cache/chunks", request(None), body({"text": "a document"}))
    assert key.tenant == SHARED and key.token_ids.tolist() == reader.tokenizer.encode("a document", add_bos=False)


@pytest.mark.parametrize(
    "path, sent",
    [
        ("/v1/chat/completions", b"{not json"),
        ("/v1/chat/completions", body({"messages": "not a list"})),
        ("/v1/cache/chunks", body({"text": "x", "token_ids": [1]})),  # (exactly one document)
        ("/v1/completions", body({"prompt": "x" * 10, "n": 1}).replace(b"x" * 10, b"x" * (8 * 2**20 + 1))),
        ("/tokenize", body({"prompt": "hi"})),  # (not routed by content)
    ],
)
def test_what_the_replica_will_refuse_routes_without_a_key(reader, path, sent):
    assert reader.route_key(path, request(), sent) is None


def test_the_fleet_and_the_server_decide_tenants_by_one_policy(reader):
    assert isinstance(reader.tenancy, Tenancy)
    with pytest.raises(APIError) as e:
        reader.key_tenant(request("wrong"))
    assert e.value.status == 401
    assert reader.key_tenant(request()) == "key:a"
