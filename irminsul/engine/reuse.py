"""Executes the cache's plans on a sequence's latent rows (docs/design.md, sections 3 and 4).

  off     every prompt token is computed (the quality reference);
  prefix  exact-prefix rows from the radix tree, copied as they are;
  naive   prefix + content-addressed chunks, c_KV and k_r copied verbatim (stale k_r: the
          paper's baseline), no sink carve-out;
  pic     prefix + content-addressed chunks with the sink carve-out; c_KV copied verbatim and
          k_r rotated by δ = p_tgt - p_src with the model's own rotary class.

The planner is pure bookkeeping; this module is where rows move.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from irminsul.cache.chunker import ChunkerConfig, namespace_seed
from irminsul.cache.planner import Planner, PlannerConfig
from irminsul.cache.radix import PrefixMatch, PrefixPiece, RadixCache
from irminsul.cache.registry import MemoryRegistry
from irminsul.cache.windows import WindowIndex
from irminsul.engine.sequence import Sequence
from irminsul.errors import RequestError
from irminsul.model.deepseek import DeepseekModel
from irminsul.model.mla import ForwardBatch

MODES = ("off", "prefix", "naive", "pic")
SHARED = "\x00shared"  # the operator's published namespace; no request can name it as its tenant
DEFAULT_CACHE_BYTES = 512 * 2**20


def make_reuse(mode: str, model: DeepseekModel, **options):
    if mode not in MODES:
        raise RequestError(f"reuse={mode!r} is not a reuse mode; choose one of {', '.join(MODES)}")
    if mode == "off":
        return NoReuse()  # cache options are accepted and ignored: nothing is cached
    return CacheReuse(mode, model, **options)


class NoReuse:
    mode = "off"

    def prepare(self, seq: Sequence) -> None:
        n = len(seq.tokens)
        seq.pending = np.arange(n, dtype=np.int64)
        seq.stats.prompt_tokens = seq.stats.computed_tokens = n

    def finish(self, seq: Sequence) -> None:
        pass


def _split_rows(value: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    # NOTE: clones, so a stored node never keeps a larger tensor alive than the bytes it accounts.
    return value[:, :k].clone(), value[:, k:].clone()


class SaltedRadix:
    """One tenant's view of the shared radix tree: every key starts with the tenant's salt token.

    The salt is a negative id, so it never equals a real token: tenants share one byte budget but
    can never match (or time) each other's prefixes. The salt's own row is a zero row.
    """

    def __init__(self, radix, salt: int):
        self.radix, self.salt = radix, salt

    def match(self, tokens):
        m = self.radix.match(np.concatenate([[self.salt], np.asarray(tokens, dtype=np.int64)]))
        if m.length == 0:
            return PrefixMatch(0, m.node, [])
        first = PrefixPiece(m.values[0].value[:, 1:], m.values[0].length - 1)
        return PrefixMatch(m.length - 1, m.node, [first, *m.values[1:]])

    def insert(self, tokens, rows: torch.Tensor) -> int:
        salted = np.concatenate([[self.salt], np.asarray(tokens, dtype=np.int64)])
        return self.radix.insert(salted, torch.cat([rows.new_zeros(rows.shape[0], 1, rows.shape[2]), rows], 1))

    def lock(self, node) -> None:
        self.radix.lock(node)

    def unlock(self, node) -> None:
        self.radix.unlock(node)


class CacheReuse:
    """The cache of one engine: a registry and a radix tree shared by all tenants, and per tenant a
    namespace (fingerprint seed, radix salt, S1 window index), so nothing crosses tenants."""

    def __init__(self, mode: str, model: DeepseekModel, cache_bytes: int | None = None,
                 prefix_bytes: int | None = None, tenant: str = "", model_id: str = "",
                 carve_out: bool | None = None, s1: bool = True, registry=None,
                 recompute_ratio: float = 0.0, check_layer: int = 1, max_namespaces: int = 1024,
                 marker: tuple[int, ...] | None = None):
        self.mode, self.model, self.model_id, self.default_tenant = mode, model, model_id, tenant
        cfg = model.config
        self.bytes_per_token = cfg.num_hidden_layers * cfg.row_width * torch.finfo(model.dtype).bits // 8
        # NOTE: "is None", not "or": an empty registry has len 0 and is falsy.
        self.registry = registry if registry is not None else MemoryRegistry(cache_bytes or DEFAULT_CACHE_BYTES)
        self.radix = RadixCache(prefix_bytes or DEFAULT_CACHE_BYTES, self.bytes_per_token,
                                split_value=_split_rows)
        if carve_out is None:
            carve_out = mode == "pic"  # the paper's naive baseline has no carve-out
        # marker: the paper's S2 variant, a model-visible boundary sequence that restarts chunking.
        chunker = ChunkerConfig(marker=tuple(marker) if marker else None)
        self.planner_config = PlannerConfig(chunker=chunker, content_reuse=mode != "prefix",
                                            s1=s1, carve_out=carve_out)
        self.namespaces: OrderedDict[str, object] = OrderedDict()  # LRU: untrusted salts can't grow it
        self.max_namespaces = max_namespaces
        if not 0.0 <= recompute_ratio <= 1.0:
            raise RequestError(f"recompute_ratio={recompute_ratio} must be in [0, 1]")
        if recompute_ratio and not 0 < check_layer < cfg.num_hidden_layers:
            raise RequestError(f"check_layer={check_layer} must be in [1, {cfg.num_hidden_layers - 1}]")
        self.recompute_ratio, self.check_layer = recompute_ratio, check_layer

    def namespace(self, tenant: str | None = None):
        """The planner of a tenant's namespace (created on first use)."""
        tenant = self.default_tenant if tenant is None else tenant
        if tenant not in self.namespaces:
            seed = namespace_seed(self.model_id, tenant)
            salt = -1 - (seed >> 2)  # a negative id: never a real token
            fallbacks = [] if tenant == SHARED else [self.namespace(SHARED)]
            self.namespaces[tenant] = Planner(self.planner_config, self.registry, SaltedRadix(self.radix, salt),
                                              WindowIndex(self.planner_config.window), seed=seed,
                                              fallbacks=fallbacks)
            self._drop_idle_namespaces()
        self.namespaces.move_to_end(tenant)
        return self.namespaces[tenant]

    def _drop_idle_namespaces(self) -> None:
        """Forget the least recently used namespaces beyond max_namespaces. Their registry entries
        and radix nodes stay and age out under the budgets; only the S1 window index is lost."""
        for tenant in list(self.namespaces):
            if len(self.namespaces) <= self.max_namespaces:
                break
            if tenant != SHARED:
                self.namespaces.pop(tenant).close()

    def publish(self, tokens: list[int], segment_starts: list[int] | None = None):
        """Precompute a document's rows in a fixed, trusted context (the document alone, from
        position 0) and register its chunks in the shared namespace, which every tenant searches
        after its own. Shared rows never depend on a stranger's prefix (HijackKV, docs/design.md §6)."""
        ids = np.asarray(tokens, dtype=np.int64)
        rows = self.model.new_rows(capacity=len(ids))
        self.model.prefill(rows, torch.as_tensor(ids), torch.arange(len(ids)))
        block = rows.rows[:, : len(ids)]
        return self._register(self.namespace(SHARED), ids, block, segment_starts)

    def prepare(self, seq: Sequence) -> None:
        plan = self.namespace(seq.tenant).plan(np.asarray(seq.tokens, dtype=np.int64), seq.segment_starts)
        seq.plan = plan
        rows, r = seq.rows, self.model.config.kv_lora_rank
        for span in plan.spans:
            if span.kind == "prefix":
                rows.write(span.start, self._prefix_rows(plan, span.start, span.end))
            elif span.kind == "reuse":
                src = span.entry.payload[:, span.src_offset : span.src_offset + span.end - span.start]
                if self.mode != "naive" and span.delta:
                    src = src.clone()
                    # [n_layers, n, rope]: only k_r moves; c_KV is position-free and copied verbatim.
                    src[..., r:] = self.model.rotary.rotate(src[..., r:].transpose(0, 1), span.delta).transpose(0, 1)
                rows.write(span.start, src)
        seq.pending = np.asarray(plan.compute_positions(), dtype=np.int64)
        recomputed = self._select_recompute(seq, plan) if self.recompute_ratio else np.zeros(0, np.int64)
        seq.pending = np.union1d(seq.pending, recomputed)
        seq.stats.recomputed_tokens = len(recomputed)
        st = plan.stats
        seq.stats.prompt_tokens, seq.stats.prefix_tokens = st.prompt_tokens, st.prefix_tokens
        seq.stats.reused_tokens = st.reused_tokens - len(recomputed)
        seq.stats.computed_tokens = st.computed_tokens + len(recomputed)
        seq.stats.carve_out_tokens, seq.stats.s1_tokens = st.carve_out_tokens, st.s1_tokens

    def _select_recompute(self, seq: Sequence, plan) -> np.ndarray:
        """pic+r (CacheBlend, Yao et al. 2025): the fraction r of reused rows whose c_KV at the check
        layer deviates most from what the current context gives. Layers [0, check_layer) run over
        every non-prefix token in a scratch copy; only their latent at check_layer is compared."""
        reused = np.concatenate([np.arange(s.start, s.end) for s in plan.spans if s.kind == "reuse"] or
                                [np.zeros(0, np.int64)])
        k = int(np.ceil(self.recompute_ratio * len(reused)))
        if k == 0:
            return np.zeros(0, np.int64)
        run = np.union1d(reused, seq.pending)
        scratch = seq.rows.clone()
        dev = self.model.device
        pos = torch.as_tensor(run, device=dev)
        batch = ForwardBatch(torch.as_tensor(np.asarray(seq.tokens)[run], device=dev), pos, [scratch], [0, len(run)])
        fresh = self.model.fresh_rows(batch, self.check_layer)[:, : self.model.config.kv_lora_rank]
        at = torch.as_tensor(np.searchsorted(run, reused), device=dev)
        cached = seq.rows.rows[self.check_layer, torch.as_tensor(reused, device=dev), : fresh.shape[1]].float()
        deviation = (fresh[at].float() - cached).norm(dim=-1) / cached.norm(dim=-1).clamp_min(1e-12)
        return np.sort(reused[deviation.topk(k).indices.cpu().numpy()])

    @staticmethod
    def _prefix_rows(plan, start: int, end: int) -> torch.Tensor:
        parts, have = [], 0
        for value, length in plan.prefix.values:
            parts.append(value[:, :length])
            have += length
            if have >= end:
                break
        return torch.cat(parts, dim=1)[:, start:end]

    def _register(self, planner: Planner, tokens: np.ndarray, block: torch.Tensor, segment_starts):
        """Store the chunks of tokens whose rows are block [n_layers, len(tokens), width]."""
        return planner.register(tokens, rows_of=lambda a, b: block[:, a:b].clone(),
                                nbytes_of=lambda k: k * self.bytes_per_token, segment_starts=segment_starts)

    def finish(self, seq: Sequence) -> None:
        """Register every chunk of the sequence (prompt and output) and insert it into the tree."""
        planner = self.namespace(seq.tenant)
        try:
            n = seq.rows.length
            if n and seq.finish_reason != "abort":
                tokens = np.asarray(seq.tokens[:n], dtype=np.int64)
                block = seq.rows.rows[:, :n]
                self._register(planner, tokens, block, seq.segment_starts)
                planner.radix.insert(tokens, block)
        finally:
            if seq.plan is not None:
                planner.release(seq.plan)
                seq.plan = None
