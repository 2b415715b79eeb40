"""The engine-agnostic half of the vLLM integration (no vLLM needed): plans of a moved document,
the chunks to save, and the δ-rotation in vLLM's pair layout."""

import numpy as np
import torch

from irminsul.integrations.vllm.spans import SpanIndex, rotate_interleaved
from irminsul.kvcache.namespaces import SHARED


def test_a_moved_document_is_loaded_and_its_header_computed():
    rng = np.random.default_rng(0)
    doc, ha, hb, q = (rng.integers(0, 256, n).tolist() for n in (600, 40, 75, 8))
    index = SpanIndex("m", bytes_per_token=1, budget_bytes=10**6)
    first = index.plan(ha + doc + q)
    assert first.loads == []
    saved = index.to_save(first, len(first.plan.tokens))
    assert saved and index.to_save(first, len(first.plan.tokens)) == []  # each chunk handed out once
    moved = index.plan(hb + doc + q)
    loaded = sum(len(x) for x in moved.loads)
    assert loaded >= 500 and moved.loads[0].start >= 75 - 32  # most of the document; not the header
    assert all(x.delta == 75 - 40 for x in moved.loads)
    assert moved.loads[-1].end < len(moved.plan.tokens)  # the last token is computed
    assert moved.next_load_start(0) == moved.loads[0].start
    assert moved.load_at(moved.loads[0].start)[0] == moved.loads[0]
    index.release(moved)


def test_rotation_by_delta_is_encoding_at_the_new_position():
    torch.manual_seed(0)
    dim = 64
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    k = torch.randn(5, dim, dtype=torch.float64)

    def encode(x, p):  # GPT-J pairs at position p
        return rotate_interleaved(x, p, inv_freq)

    assert torch.allclose(rotate_interleaved(encode(k, 100).float(), 37, inv_freq), encode(k, 137).float(), atol=1e-5)


def test_a_chunk_stored_again_gets_a_new_key():
    """The engine keeps rows under the key of each registration: a chunk evicted and registered again
    gets a new key, so the drop of its old rows, whenever it reaches the worker, frees nothing new."""
    rng = np.random.default_rng(1)
    doc, other = rng.integers(0, 256, 400).tolist(), rng.integers(0, 256, 400).tolist()
    index = SpanIndex("m", bytes_per_token=1, budget_bytes=450)
    first = index.plan(doc)
    old = {s.key for s in index.to_save(first, len(doc))}
    index.release(first)
    second = index.plan(other)
    index.to_save(second, len(other))  # evicts some of the document's chunks
    index.release(second)
    dropped = set(index.evicted())
    assert old & dropped
    third = index.plan(doc)
    new = {s.key for s in index.to_save(third, len(doc))}
    index.release(third)
    assert new and not new & dropped and not new & old


def test_tenants_see_their_own_chunks_and_the_shared_ones():
    """A tenant's plan loads its own chunks and the shared namespace's, never another tenant's."""
    rng = np.random.default_rng(2)
    doc, public, ha, hb = (rng.integers(0, 256, n).tolist() for n in (600, 600, 40, 75))
    index = SpanIndex("m", bytes_per_token=1, budget_bytes=10**6)

    def loaded(tokens, tenant):
        spans = index.plan(tokens, tenant)
        index.to_save(spans, len(tokens))
        index.release(spans)
        return sum(len(x) for x in spans.loads)

    assert loaded(ha + doc, "|salt:a") == 0
    assert loaded(hb + doc, "|salt:b") == 0 and loaded(hb + doc, None) == 0
    assert loaded(hb + doc, "|salt:a") > 400
    assert loaded(ha + public, SHARED) == 0
    assert all(loaded(hb + public, t) > 400 for t in ("|salt:a", "|salt:b", None))


def test_the_routers_fingerprints_are_what_the_connectors_journal_holds(tmp_path):
    """A fleet router cuts and fingerprints a prompt as the connector's index stores it, for the connector's
    tenant, a cache_salt's namespace (the server's "|salt:" naming, as the fleet's ingress names it) and the
    shared one; the journal reaches the router's view through the socket the connector serves."""
    from irminsul.fleet.feed import JournalFeed, RoutingStats, follow
    from irminsul.fleet.router import ContentRouter, ReplicaLoad, ReplicaView
    from irminsul.integrations.vllm.journal import JournalServer, RemoteJournal

    rng = np.random.default_rng(1)
    index = SpanIndex("ck-path", bytes_per_token=1, budget_bytes=10**6, tenant="team")
    server = JournalServer(index.journal, str(tmp_path / "journal"), index.naming)
    remote = RemoteJournal(str(tmp_path / "journal"))
    feed, view = JournalFeed(remote), ReplicaView("r0")
    naming = remote.naming()
    router = ContentRouter(naming["model_id"], sink=naming["sink"])
    assert naming["model_id"] == "ck-path" and naming["default_tenant"] == "team"
    assert follow(view, RoutingStats(1, ReplicaLoad(), *feed.cut()))  # (an empty registry: nothing to fetch)
    seen: set[int] = set()
    for tenant, asked in ((None, "team"), ("team|salt:s1", "team|salt:s1"), (SHARED, SHARED)):
        prompt = rng.integers(0, 256, 700).tolist()
        spans = index.plan(prompt, tenant)
        index.to_save(spans, len(prompt))
        index.release(spans)
        mine = {int(f) for f in router.chunks(prompt, tenant=asked).fingerprints}
        assert len(mine) > 3 and mine <= {int(f) for f in index.journal.since(None).added}
        # (another tenant's fingerprints of the same prompt name nothing the index holds)
        assert not {int(f) for f in router.chunks(prompt, tenant="other").fingerprints} & mine
        seen |= mine
    assert seen == {int(f) for f in index.journal.since(None).added}
    assert follow(view, RoutingStats(2, ReplicaLoad(), *feed.cut()))
    assert {int(f) for f in view.chunks.to_array()} == seen
    remote.close()
    server.close()
