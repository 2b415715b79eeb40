"""The content router without a model: where a prompt goes, given what each replica's journal says
it holds, what the router sent it lately, and its load. Replicas here are real KV managers (no
model: their rows are never computed) or bare journals."""

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from irminsul.engine.sampling import SamplingParams
from irminsul.engine.sequence import Sequence
from irminsul.fleet import fingerprints
from irminsul.fleet.fingerprints import FingerprintSet
from irminsul.fleet.router import ContentRouter, LoadBound, NoReplicas, ReplicaLoad, ReplicaView, RouterWeights
from irminsul.kvcache.journal import ChunkJournal
from irminsul.kvcache.manager import KVCacheManager
from irminsul.kvcache.pool import LatentPool
from irminsul.model.config import ModelConfig
from irminsul.model.tiny import tiny_config

CFG = ModelConfig.from_dict(tiny_config("v2"))
MODEL = "tiny-v2"


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(5, 30_000, n).tolist()


DOC = tokens(1, 900)


def manager(tenant: str = "", rows: int = 4000) -> KVCacheManager:
    return KVCacheManager(
        "pic", LatentPool(CFG, rows + 1, torch.float32), CFG.num_hidden_layers, tenant=tenant, model_id=MODEL
    )


def serve(kv: KVCacheManager, prompt, segment_starts=None, tenant=None) -> None:
    """Admit a prompt, 'compute' its rows, finish it: its chunks go to the registry (and journal)."""
    seq = Sequence(
        tokens=list(prompt),
        prompt_len=len(prompt),
        params=SamplingParams(max_tokens=1),
        segment_starts=segment_starts,
        tenant=tenant,
    )
    # as the scheduler admits one: the admission, then fresh rows for the positions it computes
    seq.admit(kv.admission(seq))
    if len(seq.pending):
        slots = kv.fresh_rows(seq.pending, [seq.tenant])
        assert slots is not None  # (the pool holds every prompt these tests serve)
        seq.place(seq.pending, slots)
    seq.take_pending(len(prompt))
    kv.computed(seq)
    seq.finish_reason = "length"
    kv.free(seq)


def follow(view: ReplicaView, kv: KVCacheManager) -> None:
    view.apply(kv.journal.since(view.seq))


def fleet(n: int) -> dict[str, ReplicaView]:
    return {f"r{i}": ReplicaView(f"r{i}") for i in range(n)}


def test_the_routers_fingerprints_are_what_a_replicas_journal_holds():
    kv, router = manager(tenant="acme"), ContentRouter(MODEL)
    header = tokens(2, 70)
    serve(kv, header + DOC, segment_starts=[len(header)])
    journal = {int(f) for f in kv.journal.since(None).added}
    mine = {int(f) for f in router.chunks(header + DOC, segment_starts=[len(header)], tenant="acme").fingerprints}
    assert journal == mine and len(mine) > 5
    # another tenant's fingerprints of the same prompt name nothing this replica holds
    assert not journal & {int(f) for f in router.chunks(header + DOC, [len(header)], tenant="other").fingerprints}


def test_a_document_behind_a_new_header_goes_to_the_replica_that_holds_it():
    replicas, kvs = fleet(3), {r: manager() for r in ("r0", "r1", "r2")}
    serve(kvs["r0"], tokens(3, 600))
    serve(kvs["r1"], tokens(4, 50) + DOC, segment_starts=[50])
    serve(kvs["r2"], tokens(5, 700))
    for rid, view in replicas.items():
        follow(view, kvs[rid])
    prompt = tokens(6, 83) + DOC  # a header of another length: no prefix in common with anything
    decision = ContentRouter(MODEL).choose(prompt, replicas, segment_starts=[83])
    assert decision.replica == "r1"
    assert decision.cached_tokens["r1"] == len(DOC) - 1 and decision.cached_tokens["r0"] == 0
    # without the segment start, content chunking finds its way back into the document after a chunk or two
    assert ContentRouter(MODEL).choose(prompt, replicas).cached_tokens["r1"] > 0.6 * len(DOC)
    assert decision.costs["r1"] < decision.costs["r0"] == decision.costs["r2"] == len(prompt)


def test_a_burst_for_a_new_document_converges_on_one_replica():
    router, replicas = ContentRouter(MODEL), fleet(4)
    doc = tokens(7, 1500)
    chosen = []
    for i in range(8):  # no poll between them: only what the router recorded knows where doc went
        prompt = tokens(100 + i, 40 + 7 * i) + doc
        decision = router.choose(prompt, replicas)
        router.record(decision, prompt)
        chosen.append(decision.replica)
    assert len(set(chosen)) == 1
    assert router.assigned(chosen[0]) > 0


def test_an_unrelated_burst_spreads_between_load_reports():
    router, replicas = ContentRouter(MODEL), fleet(4)
    chosen = []
    for i in range(8):
        prompt = tokens(200 + i, 500)
        decision = router.choose(prompt, replicas)
        router.record(decision, prompt)
        chosen.append(decision.replica)
    assert sorted(chosen) == sorted(["r0", "r1", "r2", "r3"] * 2)
    # a load report shows the replica's own state: what the router sent before it no longer counts
    replicas["r0"].load = ReplicaLoad()
    assert router.choose(tokens(300, 500), replicas).replica == "r0"


def test_assignments_expire():
    now = [0.0]
    router, replicas = ContentRouter(MODEL, assignment_ttl_s=5.0, clock=lambda: now[0]), fleet(2)
    prompt = tokens(8, 800)
    router.record(router.choose(prompt, replicas), prompt)
    assert router.choose(prompt, replicas).cached_tokens["r0"] > 0
    now[0] = 5.0
    assert router.assigned("r0") == 0
    assert router.choose(prompt, replicas).cached_tokens["r0"] == 0


def test_load_breaks_ties_and_outweighs_a_small_reuse():
    router, replicas = ContentRouter(MODEL), fleet(2)
    replicas["r0"].load = ReplicaLoad(running=2)
    assert router.choose(tokens(9, 400), replicas).replica == "r1"  # a tie in reuse: the idle one
    small = router.chunks(DOC)
    replicas["r0"].chunks.add(small.fingerprints[1:2])  # one chunk of the prompt, not the first
    saved = int(small.useful[1])
    replicas["r0"].load = ReplicaLoad(running=saved // 32 + 2)
    decision = router.choose(DOC, replicas)
    assert decision.cached_tokens["r0"] == saved and decision.replica == "r1"
    replicas["r0"].chunks.add(small.fingerprints)  # the whole document: reuse outweighs that load
    assert router.choose(DOC, replicas).replica == "r0"
    # queued prefill counts token for token
    replicas["r0"].load = ReplicaLoad(queued_prefill_tokens=10 * len(DOC))
    assert router.choose(DOC, replicas).replica == "r1"


def test_a_chunk_only_in_the_shared_store_earns_a_smaller_credit():
    router, replicas = ContentRouter(MODEL, weights=RouterWeights(store_credit=0.5)), fleet(2)
    prompt = router.chunks(DOC)
    store = {int(f) for f in prompt.fingerprints}
    replicas["r1"].chunks.add(prompt.fingerprints[:3])
    decision = router.choose(DOC, replicas, store=store)
    full = int(prompt.useful.sum())
    assert decision.cached_tokens == {"r0": full, "r1": full}  # neither computes it: pool or store
    assert decision.costs["r0"] == pytest.approx(len(DOC) - 0.5 * full)
    assert decision.replica == "r1"  # its own pool holds part of it: less to load


def test_forget_drops_what_was_sent_to_a_replica_that_left():
    router, replicas = ContentRouter(MODEL), fleet(2)
    router.record(router.choose(DOC, replicas), DOC)
    assert router.choose(DOC, replicas).replica == "r0"
    router.forget("r0")
    assert router.assigned("r0") == 0
    del replicas["r0"]
    assert router.choose(DOC, replicas).replica == "r1"
    replicas["r0"] = ReplicaView("r0")  # it came back empty: nothing of the document there
    assert router.choose(DOC, replicas).cached_tokens["r0"] == 0
    with pytest.raises(NoReplicas, match="no replica"):
        router.choose(DOC, {})


def test_the_explanation_names_the_numbers():
    router, replicas = ContentRouter(MODEL), fleet(5)
    replicas["r3"].chunks.add(router.chunks(DOC).fingerprints)
    replicas["r1"].load = ReplicaLoad(running=3, queued_prefill_tokens=120)
    decision = router.choose(DOC, replicas)
    cached = decision.cached_tokens["r3"]
    assert decision.explanation.startswith(
        f"r3: cost {decision.costs['r3']:.0f} (reuse {cached}/{len(DOC)}, running 0)"
    )
    assert " < r0: cost 900 (reuse 0/900, running 0)" in decision.explanation
    assert decision.explanation.endswith("< 2 more") and "\n" not in decision.explanation
    only_r1 = router.choose(DOC, {"r1": replicas["r1"]})
    assert only_r1.explanation == f"r1: cost {900 + 120 + 3 * 32} (reuse 0/900, queued 120, running 3)"


def test_the_sink_and_the_last_token_are_never_counted_as_reused():
    router, replicas = ContentRouter(MODEL), fleet(1)
    replicas["r0"].chunks.add(router.chunks(DOC).fingerprints)
    assert router.choose(DOC, replicas).cached_tokens["r0"] == len(DOC) - 32 - 1


def test_weights_are_checked():
    with pytest.raises(ValueError, match="store_credit"):
        RouterWeights(store_credit=2.0)
    with pytest.raises(ValueError, match="running"):
        RouterWeights(running=-1)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "remove", "replace"]), st.lists(st.integers(0, 40), max_size=12)), max_size=40
    )
)
def test_the_compact_set_is_a_set(ops):
    fingerprints.MERGE_MIN, saved = 3, fingerprints.MERGE_MIN  # merge often, so merges are exercised
    try:
        s, truth = FingerprintSet(), set()
        for op, members in ops:
            arr = np.array([m * 0x9E3779B97F4A7C15 % 2**64 for m in members], np.uint64)
            if op == "add":
                s.add(arr)
                truth |= {int(f) for f in arr}
            elif op == "remove":
                s.remove(arr)
                truth -= {int(f) for f in arr}
            else:
                s.replace(arr)
                truth = {int(f) for f in arr}
            assert len(s) == len(truth) and set(s) == truth
            probe = np.array([m * 0x9E3779B97F4A7C15 % 2**64 for m in range(41)], np.uint64)
            assert s.contains(probe).tolist() == [int(f) in truth for f in probe]
    finally:
        fingerprints.MERGE_MIN = saved


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    ops=st.lists(st.tuples(st.sampled_from(["add", "remove", "poll"]), st.integers(0, 20)), max_size=80),
    keep=st.sampled_from([3, 1 << 20]),
)
def test_a_view_following_a_journal_holds_what_is_resident(ops, keep):
    journal, view, truth = ChunkJournal(keep=keep), ReplicaView("r"), set()
    for op, fp in ops:
        fp = fp * 0x9E3779B97F4A7C15 % 2**64
        if op == "add" and fp not in truth:
            journal.added(fp)
            truth.add(fp)
        elif op == "remove" and fp in truth:
            journal.removed(fp)
            truth.discard(fp)
        elif op == "poll":
            view.apply(journal.since(view.seq))
            assert set(view.chunks) == truth and view.seq == journal.seq
    view.apply(journal.since(view.seq))
    assert set(view.chunks) == truth


@settings(max_examples=60, deadline=None, derandomize=True)
@given(n=st.integers(1, 700), held=st.sets(st.integers(0, 30)), running=st.integers(0, 50))
def test_costs_and_reuse_stay_in_range(n, held, running):
    router, replicas = ContentRouter(MODEL), fleet(2)
    prompt = tokens(n, n)
    fps = router.chunks(prompt).fingerprints
    replicas["r1"].chunks.add(fps[[i for i in held if i < len(fps)]])
    replicas["r1"].load = ReplicaLoad(running=running)
    d = router.choose(prompt, replicas)
    assert all(0 <= d.cached_tokens[r] <= max(0, n - 1 - 32) for r in replicas)
    assert d.costs[d.replica] == min(d.costs.values())
    assert d.costs["r0"] == n


def test_a_queue_computing_the_prompts_own_document_does_not_push_the_burst_away():
    # the first request of a burst went to r0, whose next report shows it computing the document:
    # the rest of the burst still goes there (it waits for those rows, then reuses them)
    router, replicas = ContentRouter(MODEL), fleet(2)
    burst = [tokens(50 + i, 20) + DOC for i in range(4)]
    first = router.choose(burst[0], replicas)
    router.record(first, burst[0])
    replicas[first.replica].load = ReplicaLoad(running=1, queued_prefill_tokens=len(burst[0]))
    for prompt in burst[1:]:
        decision = router.choose(prompt, replicas)
        assert decision.replica == first.replica, decision.explanation
        router.record(decision, prompt)
    # once the journal shows the document there, the queue's count stands as the replica gave it
    replicas[first.replica].chunks.add(router.chunks(burst[1]).fingerprints)
    decision = router.choose(burst[1], replicas)
    assert f"queued {len(burst[0])}" in decision.explanation


def test_a_hot_session_spills_once_its_home_is_over_the_load_bound():
    """Within the bound reuse wins: every turn of a hot document goes home; with no slack, the home is
    over (1 + epsilon) x the mean of the work sent as soon as it holds it all, and the next turn
    computes the document on the other replica, which then shares the session."""
    question = [tokens(50 + i, 40) for i in range(6)]
    for slack, want in ((1 << 20, ["r0"] * 6), (0, ["r0", "r1"])):
        router = ContentRouter(MODEL, bound=LoadBound(epsilon=0.2, slack_tokens=slack))
        replicas, chosen = fleet(2), []
        for q in question:
            decision = router.choose(DOC + q, replicas)
            router.record(decision, DOC + q)
            chosen.append(decision.replica)
        assert chosen[: len(want)] == want, (slack, chosen)
    # once both hold it, each turn goes where less work was sent: the session is split in two
    assert set(chosen) == {"r0", "r1"} and abs(router.sent_work("r0") - router.sent_work("r1")) < len(DOC)


def test_the_load_bound_lifts_the_cost_above_every_replica_within_it():
    router, replicas = ContentRouter(MODEL, bound=LoadBound(epsilon=0.0, slack_tokens=0)), fleet(3)
    replicas["r0"].chunks.add(router.chunks(DOC).fingerprints)
    first = router.choose(DOC, replicas)
    assert first.replica == "r0" and first.work["r0"] < first.work["r1"]
    for i in range(3):  # unrelated prompts r0 took: it is busiest
        other = tokens(400 + i, 900)
        router.record(dataclasses.replace(router.choose(other, replicas), replica="r0"), other)
    decision = router.choose(DOC, replicas)  # r0 now above the mean: ranked last, whatever its reuse
    assert decision.replica != "r0" and max(decision.costs, key=decision.costs.get) == "r0"
    assert "over the load bound" in decision.explanation
    # no bound: reuse wins however much was sent
    router = ContentRouter(MODEL, bound=None)
    router.record(router.choose(DOC, replicas), DOC)
    assert router.choose(DOC, replicas).replica == "r0"


def test_sent_work_expires_with_the_assignments():
    now = [0.0]
    router, replicas = ContentRouter(MODEL, assignment_ttl_s=5.0, clock=lambda: now[0]), fleet(2)
    router.record(router.choose(DOC, replicas), DOC)
    assert router.sent_work("r0") == len(DOC) + 16  # nothing held: every prompt token is computed
    now[0] = 5.0
    assert router.sent_work("r0") == 0
    with pytest.raises(ValueError):
        LoadBound(epsilon=-1)


def test_a_session_stays_home_while_its_queue_is_within_its_reuse_of_the_shortest():
    """The home (r0) holds the session's history (DOC); its queue is longer than the history, so counting
    every queued token (slack 0) sends the turn to the idle replica, to compute the history again.
    With the slack the queue counts only beyond the shortest queue plus the reuse at home."""
    turn = DOC + tokens(60, 40)

    def choose(queued: int, slack: int = 1024, others: int = 0):
        router, replicas = ContentRouter(MODEL, weights=RouterWeights(queue_slack_tokens=slack)), fleet(2)
        replicas["r0"].chunks.add(router.chunks(DOC).fingerprints)
        replicas["r0"].load = ReplicaLoad(running=1, queued_prefill_tokens=queued)
        replicas["r1"].load = ReplicaLoad(running=1, queued_prefill_tokens=others)
        return router.choose(turn, replicas)

    reuse = choose(0).cached_tokens["r0"]
    assert 0 < reuse < 1024
    queue = reuse + 100  # longer than the history it would reuse at home
    assert choose(queue, slack=0).replica == "r1"
    assert choose(queue).replica == "r0"
    # beyond the slack the queue counts token for token again: twice the reuse and more moves it
    assert choose(2 * queue).replica == "r1"
    # the queue is measured from the shortest: a fleet that is all busy keeps the session home
    assert choose(2 * queue, others=queue).replica == "r0"


def test_the_slack_is_capped_however_much_a_replica_holds():
    big = tokens(61, 4000)
    router, replicas = ContentRouter(MODEL), fleet(2)
    replicas["r0"].chunks.add(router.chunks(big).fingerprints)
    prompt = big + tokens(62, 40)
    reuse = router.choose(prompt, replicas).cached_tokens["r0"]
    assert reuse > 2 * RouterWeights().queue_slack_tokens
    # a queue of the reuse plus the cap, and a little more: the wait outweighs the reuse
    replicas["r0"].load = ReplicaLoad(queued_prefill_tokens=reuse + RouterWeights().queue_slack_tokens + 200)
    assert router.choose(prompt, replicas).replica == "r1"
    # with the whole reuse as slack it would have stayed
    uncapped = ContentRouter(MODEL, weights=RouterWeights(queue_slack_tokens=10 * reuse))
    assert uncapped.choose(prompt, replicas).replica == "r0"


def test_a_replica_over_the_work_bound_is_not_chosen_however_short_its_queue():
    router, replicas = ContentRouter(MODEL, bound=LoadBound(epsilon=0.2, slack_tokens=0)), fleet(2)
    replicas["r0"].chunks.add(router.chunks(DOC).fingerprints)
    replicas["r1"].load = ReplicaLoad(queued_prefill_tokens=5000)  # the other has a long queue
    for i in range(4):  # unrelated work sent to r0: it is over (1 + epsilon) x the mean
        other = tokens(500 + i, 900)
        router.record(dataclasses.replace(router.choose(other, replicas), replica="r0"), other)
    decision = router.choose(DOC, replicas)
    assert decision.replica == "r1" and "over the load bound" in decision.explanation
    assert decision.cached_tokens["r0"] > 0 and decision.cached_tokens["r1"] == 0


@settings(max_examples=80, deadline=None, derandomize=True)
@given(
    n=st.integers(2, 5),
    epsilon=st.sampled_from([0.0, 0.2, 0.5]),
    requests=st.lists(
        st.tuples(
            st.integers(0, 3),  # which document (3: none)
            st.integers(1, 300),  # the question's length
            st.integers(0, 4),  # a replica that holds the document (beyond n: none)
            st.integers(0, 6000),  # that replica's queue
            st.integers(0, 8),  # its running sequences
        ),
        min_size=1,
        max_size=25,
    ),
)
def test_no_replica_is_sent_more_work_than_the_bound(n, epsilon, requests):
    """Whatever the requests, the replicas' holdings and their loads: after every choice, no replica
    was sent more than (1 + epsilon) x the mean work plus the slack (requests here are smaller than
    the slack, so some replica is always within the bound)."""
    bound = LoadBound(epsilon=epsilon, slack_tokens=2048)
    router, replicas = ContentRouter(MODEL, bound=bound), fleet(n)
    docs = [DOC, tokens(70, 1200), tokens(71, 600)]
    for i, (doc, question, holder, queued, running) in enumerate(requests):
        prompt = (docs[doc] if doc < len(docs) else []) + tokens(1000 + i, question)
        if doc < len(docs) and holder < n:
            replicas[f"r{holder}"].chunks.add(router.chunks(docs[doc]).fingerprints)
            replicas[f"r{holder}"].load = ReplicaLoad(running=running, queued_prefill_tokens=queued)
        decision = router.choose(prompt, replicas)
        assert decision.costs[decision.replica] == min(decision.costs.values())
        router.record(decision, prompt)
        sent = [router.sent_work(r) for r in replicas]
        assert max(sent) <= (1 + epsilon) * sum(sent) / n + bound.slack_tokens, (sent, decision.explanation)
