"""The connector's protocol without a model: its scheduler and worker sides, driven step by step the
way vLLM 0.32 and IrminsulScheduler drive them, over a KV cache that a fake forward fills with the
rows a model would write (each token's c_KV, its k_pe rotated to its position). Every request's rows
are checked against those, whether computed or loaded. Milliseconds; needs vLLM installed (its
connector base class), not a model.
"""

import json
from types import SimpleNamespace

import numpy as np
import torch

from tests.integrations import require_vllm

require_vllm()

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.metrics.stats import PrefillStats  # noqa: E402

from irminsul.integrations.vllm.connector import IrminsulConnector  # noqa: E402
from irminsul.model.tiny import tiny_config  # noqa: E402

BLOCK = 16
VOCAB = 256
COUNTERS = ("loaded_rows", "saved_rows", "missed_rows", "evicted_rows")  # the worker's, reported after each step


class MiniEngine:
    """vLLM's half of the protocol: up to `max_running` requests at once, admitted as others finish, each
    with its own blocks (freed blocks go to later requests); IrminsulScheduler's two moves (over the
    loads that start where a request stands, a compute chunk cut at the next load); the forward; and
    vLLM's "recompute" load-failure policy (a request goes back to the first block a load left
    unwritten); vLLM's per-request PrefillStats (set at admission) and its collection of the worker's
    stats after each step. Every request's vLLM-side count of cached tokens must equal the rows it
    loaded, and the stats collected must add up to the worker's counters."""

    def __init__(self, tmp_path, **extra):
        raw = tiny_config("v2")
        (tmp_path / "config.json").write_text(json.dumps(raw))

        def config(chunked_prefill: bool):
            return SimpleNamespace(
                kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
                model_config=SimpleNamespace(model=str(tmp_path)),
                cache_config=SimpleNamespace(block_size=BLOCK),
                scheduler_config=SimpleNamespace(enable_chunked_prefill=chunked_prefill),
            )

        # the scheduler side as on vLLM's CPU backend (compute after a load in steps of after_load_chunk
        # tokens), the worker side without cpu_mla's builder (no attention runs here)
        self.sched = IrminsulConnector(config(False), KVConnectorRole.SCHEDULER)
        self.worker = IrminsulConnector(config(True), KVConnectorRole.WORKER)
        self.rank, self.width = raw["kv_lora_rank"], raw["kv_lora_rank"] + raw["qk_rope_head_dim"]
        self.caches = [torch.zeros(256, BLOCK, self.width) for _ in range(raw["num_hidden_layers"])]
        self.worker.register_kv_caches({f"model.layers.{i}.self_attn.attn": c for i, c in enumerate(self.caches)})
        self.free = list(range(256))
        self.blocks: dict[str, list[int]] = {}
        manager = SimpleNamespace(get_block_ids=lambda rid: (self.blocks[rid],), block_pool=None)
        self.sched.bind_kv_cache_manager(manager)
        g = torch.Generator().manual_seed(0)
        self.c_kv = torch.randn(VOCAB, self.rank, generator=g)
        self.pe = torch.randn(VOCAB, self.width - self.rank, generator=g)
        self.recomputed = 0
        self.n = 0
        self.reported = IrminsulConnector.build_kv_connector_stats()  # what vLLM's loggers would sum

    def true_rows(self, tokens: list[int], layer: int) -> torch.Tensor:
        """[len, width] what a model writes for tokens at positions 0..len-1 (GPT-J pairs rotated)."""
        ids = torch.tensor(tokens)
        angles = torch.arange(len(tokens), dtype=torch.float64)[:, None] * self.worker.inv_freq.double()[None]
        cos, sin = torch.cos(angles).float(), torch.sin(angles).float()
        pe = self.pe[ids] + layer
        a, b = pe[:, 0::2], pe[:, 1::2]
        k_pe = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
        return torch.cat([self.c_kv[ids] + layer, k_pe], dim=-1)

    def slots(self, rid: str, start: int, end: int) -> torch.Tensor:
        pos = np.arange(start, end)
        return torch.from_numpy(np.asarray(self.blocks[rid])[pos // BLOCK] * BLOCK + pos % BLOCK)

    @staticmethod
    def left(request) -> int:
        return len(request.prompt_token_ids) - request.num_computed_tokens

    def chunk(self, r) -> int:
        """The scheduler's two connector hooks (vLLM with the upstream change, or IrminsulScheduler):
        move a request over the loads where it stands, then size its chunk up to the next load."""
        left = len(r.prompt_token_ids) - 1 - r.num_computed_tokens
        n = min(self.sched.get_num_new_matched_tokens_running(r, r.num_computed_tokens), left) if left > 0 else 0
        if n > 0:  # (its blocks are allocated: the request holds the whole prompt's)
            self.sched.update_state_after_alloc(r, None, n)
            r.num_computed_tokens += n
        limit = self.sched.get_max_num_new_tokens(r, r.num_computed_tokens)
        return self.left(r) if limit is None else min(self.left(r), limit)

    def step(self, running: list, preempted: set | None = None) -> None:
        scheduled = {r.request_id: self.chunk(r) for r in running}
        meta = self.sched.build_connector_meta(
            SimpleNamespace(num_scheduled_tokens=scheduled, preempted_req_ids=preempted or set())
        )
        starts = {r.request_id: r.num_computed_tokens for r in running}
        for r in running:
            r.num_computed_tokens += scheduled[r.request_id]  # (vLLM's _update_after_schedule)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        for r in running:  # the forward: this step's rows
            start, end = starts[r.request_id], r.num_computed_tokens
            for layer, cache in enumerate(self.caches):
                cache.view(-1, self.width)[self.slots(r.request_id, start, end)] = self.true_rows(
                    r.prompt_token_ids, layer
                )[start:end]
        self.worker.wait_for_save()
        invalid = self.worker.get_block_ids_with_load_errors()
        step_stats = self.worker.get_kv_connector_stats()
        if step_stats is not None:
            self.reported = self.reported.aggregate(IrminsulConnector.build_kv_connector_stats(step_stats.to_dict()))
        report = self.worker.build_connector_worker_meta()
        self.worker.clear_connector_metadata()
        for r in running:  # vLLM: back to the first invalid block, the step's output dropped
            bad = [i for i, b in enumerate(self.blocks[r.request_id]) if b in invalid]
            if bad:
                r.num_computed_tokens = min(starts[r.request_id], bad[0] * BLOCK)
                self.recomputed += 1
        self.sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=report))

    def serve(self, prompts: list, max_running: int = 3) -> list:
        """Prefill every (tokens, cache_salt); their stats. Each request's rows must be the true ones."""
        waiting, running, stats = list(prompts), [], []
        while waiting or running:
            while waiting and len(running) < max_running:
                tokens, salt = waiting.pop(0)
                self.n += 1
                request = SimpleNamespace(
                    request_id=f"r{self.n}",
                    prompt_token_ids=tokens,
                    num_computed_tokens=0,
                    cache_salt=salt,
                    prefill_stats=PrefillStats(),
                    num_preemptions=0,
                )
                self.blocks[request.request_id] = [self.free.pop(0) for _ in range(len(tokens) // BLOCK + 1)]
                self.sched.get_num_new_matched_tokens(request, 0)
                request.prefill_stats.set(len(tokens), 0, 0)  # (vLLM: the connector answered 0)
                running.append(request)
            self.step(running)
            for r in [r for r in running if self.left(r) == 0]:
                rows = self.slots(r.request_id, 0, len(r.prompt_token_ids))
                for layer, cache in enumerate(self.caches):
                    want = self.true_rows(r.prompt_token_ids, layer)
                    torch.testing.assert_close(cache.view(-1, self.width)[rows], want, atol=1e-4, rtol=1e-4)
                stats.append(self.sched.stats[r.request_id])
                prefill = r.prefill_stats  # (the OpenAI answer's cached_tokens)
                assert prefill.num_cached_tokens == prefill.num_external_cached_tokens == stats[-1].loaded_tokens
                assert prefill.num_computed_tokens == len(r.prompt_token_ids) - stats[-1].loaded_tokens
                self.sched.request_finished(r, None)
                self.free += self.blocks.pop(r.request_id)
                running.remove(r)
        assert self.reported.to_dict() == {name: getattr(self.worker, name) for name in COUNTERS}
        return stats

    def run(self, tokens: list[int], salt: str | None = None):
        return self.serve([(tokens, salt)])[0]

    def keys_agree(self) -> bool:
        """The worker holds rows for exactly the entries the registry holds."""
        return {e.payload for e in self.sched.index.registry.entries()} == set(self.worker.rows)


def _ids(rng, n):
    return rng.integers(0, VOCAB, n).tolist()


def _registry_gib(tokens: int) -> float:
    """A registry budget of `tokens` rows (the connector charges layers x row width x 2 bytes a row)."""
    raw = tiny_config("v2")
    return tokens * raw["num_hidden_layers"] * (raw["kv_lora_rank"] + raw["qk_rope_head_dim"]) * 2 / 2**30


def test_a_registry_smaller_than_a_document_serves_every_request(tmp_path):
    """100 requests, three at a time: documents of 600 tokens, each behind four new headers in turn,
    through a registry of 400 tokens. Chunks are evicted in one step and stored again in the next, by
    the same request or another; the worker's rows follow the registry exactly (a drop that arrives
    late frees nothing a later save wrote), every load lands the true rows, nothing is recomputed."""
    engine = MiniEngine(tmp_path, registry_gib=_registry_gib(400))
    rng = np.random.default_rng(0)
    docs = [_ids(rng, 600) for _ in range(3)]
    stats = engine.serve([(_ids(rng, 40 + i % 7) + docs[i // 4 % 3] + _ids(rng, 8), None) for i in range(100)])
    assert len(stats) == 100 and sum(x.loaded_tokens for x in stats) > 3000
    assert engine.recomputed == 0 and engine.keys_agree()
    # the evicted rows counted (vLLM's /metrics) are exactly the saved rows the worker no longer holds
    held = sum(rows.shape[1] for rows in engine.worker.rows.values())
    assert engine.worker.evicted_rows > 0 and engine.worker.saved_rows - engine.worker.evicted_rows == held


def test_rows_the_worker_lacks_are_a_miss_and_recomputed(tmp_path):
    """Stored chunks whose rows the worker no longer has: the request recomputes those tokens (the right
    rows, no exception), the entries leave the registry once no plan holds them, and the next request
    to compute the document stores it again."""
    engine = MiniEngine(tmp_path)
    rng = np.random.default_rng(2)
    doc = _ids(rng, 600)
    engine.run(_ids(rng, 40) + doc)
    cleared = set(engine.worker.rows)
    engine.worker.rows.clear()  # (the header's chunks too: a request that loads them misses as well)
    stats = engine.run(_ids(rng, 75) + doc)
    assert engine.recomputed >= 1 and stats.loaded_tokens == 0
    assert stats.computed_prompt_tokens >= stats.prompt_tokens  # (some twice)
    engine.recomputed = 0
    assert engine.run(_ids(rng, 60) + doc).loaded_tokens == 0  # never planned again: computed, stored
    assert engine.run(_ids(rng, 60) + doc).loaded_tokens > 400
    held = {e.payload for e in engine.sched.index.registry.entries()}
    assert set(engine.worker.rows) <= held and held - set(engine.worker.rows) <= cleared


def test_cache_salts_are_namespaces(tmp_path):
    """A document cached under one cache_salt is never loaded under another (0 rows), is under the same
    salt; without a salt a request is the connector's own tenant; a document published under the
    operator's publish_salt (the shared namespace) is loaded by every tenant."""
    engine = MiniEngine(tmp_path, publish_salt="operator-secret")
    rng = np.random.default_rng(3)
    doc, public = _ids(rng, 600), _ids(rng, 600)
    engine.run(_ids(rng, 40) + doc, salt="a")
    assert engine.run(_ids(rng, 75) + doc, salt="b").loaded_tokens == 0
    assert engine.run(_ids(rng, 75) + doc).loaded_tokens == 0
    assert engine.run(_ids(rng, 75) + doc, salt="a").loaded_tokens > 400
    engine.run(_ids(rng, 40) + public, salt="operator-secret")
    for salt in ("a", "b", None):
        assert engine.run(_ids(rng, 75) + public, salt=salt).loaded_tokens > 400
    assert engine.keys_agree()
