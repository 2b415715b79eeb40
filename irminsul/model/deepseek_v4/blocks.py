"""The rest of a V4 layer: hyper-connections (parallel residual streams mixed by Sinkhorn-normalised
matrices) and the MoE (hash-routed or top-k, a shared expert, clipped SwiGLU)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from irminsul.model.deepseek_v4.attention import unit_rms
from irminsul.model.deepseek_v4.config import HASH_MOE, V4Config

# ------------------------------------------------------------------------------------------------ hyper-connections


class StreamMix(NamedTuple):
    block_input: torch.Tensor  # [B, S, hidden]: the streams collapsed for the block
    post: torch.Tensor  # [B, S, n] float32: how the block's output spreads over the streams
    comb: torch.Tensor  # [B, S, n, n] float32, doubly stochastic: how the streams mix


def sinkhorn(m: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Sinkhorn-Knopp on the last two dims of positive m: columns, then (rows, columns) iters - 1 more times."""
    m = m / (m.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


class HyperConnection(nn.Module):
    """Manifold-constrained hyper-connection around one block: a one-layer map of the flattened, RMS-normed
    streams gives pre (collapse), post (spread) and comb (mix) weights."""

    def __init__(self, cfg: V4Config):
        super().__init__()
        n = self.n = cfg.hc_mult
        self.iters, self.hc_eps, self.norm_eps = cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * cfg.hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))  # one each for pre, post, comb

    def forward(self, streams: torch.Tensor) -> StreamMix:
        n = self.n
        mix = F.linear(unit_rms(streams.flatten(2).float(), self.norm_eps), self.fn.float())  # [B, S, (2+n)n]
        pre, post, comb = mix.split([n, n, n * n], dim=-1)
        pre_base, post_base, comb_base = self.base.split([n, n, n * n])
        pre_scale, post_scale, comb_scale = self.scale.unbind(0)
        pre = torch.sigmoid(pre * pre_scale + pre_base) + self.hc_eps
        post = 2 * torch.sigmoid(post * post_scale + post_base)
        comb = torch.softmax(comb.unflatten(-1, (n, n)) * comb_scale + comb_base.view(n, n), dim=-1) + self.hc_eps
        block_input = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
        return StreamMix(block_input, post, sinkhorn(comb, self.iters, self.hc_eps))


def merge_streams(streams: torch.Tensor, block_output: torch.Tensor, mix: StreamMix) -> torch.Tensor:
    """Streams [B, S, n, hidden] after a block: post spreads its output, comb^T mixes the streams
    (new_k = sum_j comb[j, k] * stream_j: the sum runs over comb's FIRST index)."""
    dtype = streams.dtype
    spread = mix.post.to(dtype).unsqueeze(-1) * block_output.unsqueeze(-2)
    return spread + torch.matmul(mix.comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """The final collapse of the streams: sigmoid weights from the flattened streams, no mixing."""

    def __init__(self, cfg: V4Config):
        super().__init__()
        self.hc_eps, self.norm_eps = cfg.hc_eps, cfg.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.empty(cfg.hc_mult, cfg.hc_mult * cfg.hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(cfg.hc_mult))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mix = F.linear(unit_rms(streams.flatten(2).float(), self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mix * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)


# ------------------------------------------------------------------------------------------------ MoE


def clipped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class ClippedMLP(nn.Module):
    """The shared expert: SwiGLU with clipped pre-activations, `moe_intermediate_size` wide."""

    def __init__(self, cfg: V4Config):
        super().__init__()
        hidden, inner = cfg.hidden_size, cfg.moe_intermediate_size
        self.limit = cfg.swiglu_limit
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clipped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class Experts(nn.Module):
    """The routed experts, stacked as transformers holds them: gate_up_proj [E, 2I, hidden] (gate rows first),
    down_proj [E, hidden, I]."""

    def __init__(self, cfg: V4Config):
        super().__init__()
        e, hidden, inner = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.limit = cfg.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(e, hidden, inner))

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, hidden], experts / weights [N, k] -> sum over k of weight * expert(x)"""
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            token, slot = (experts == e).nonzero(as_tuple=True)
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(clipped_swiglu(gate, up, self.limit), self.down_proj[e]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


def router_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    return logits.softmax(dim=-1)


class TopKRouter(nn.Module):
    """Experts by top-k of score + e_score_correction_bias (the bias steers the choice only)."""

    def __init__(self, cfg: V4Config):
        super().__init__()
        self.top_k, self.scoring_func = cfg.num_experts_per_tok, cfg.scoring_func
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] (token_ids unused: HashRouter's signature) -> scores [N, E], experts [N, k]"""
        scores = router_scores(F.linear(x, self.weight), self.scoring_func)
        experts = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        return scores, experts


class HashRouter(nn.Module):
    """Experts by a fixed table of the input token id (tid2eid [vocab, k]); the router still weighs them."""

    def __init__(self, cfg: V4Config):
        super().__init__()
        self.scoring_func = cfg.scoring_func
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return router_scores(F.linear(x, self.weight), self.scoring_func), self.tid2eid[token_ids].long()


class V4MoE(nn.Module):
    def __init__(self, cfg: V4Config, layer: int):
        super().__init__()
        self.scaling = cfg.routed_scaling_factor
        self.gate = HashRouter(cfg) if cfg.mlp_layer_types[layer] == HASH_MOE else TopKRouter(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = ClippedMLP(cfg)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """x [B, S, hidden], token_ids [B, S] -> [B, S, hidden]"""
        flat = x.flatten(0, 1)
        scores, experts = self.gate(flat, token_ids.flatten())
        chosen = scores.gather(1, experts)
        # NOTE: always normalised over the chosen k, as transformers does (`norm_topk_prob` is not read)
        weights = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling
        return self.experts(flat, experts, weights).view_as(x) + self.shared_experts(x)
