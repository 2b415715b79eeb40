"""The position-free parts of a DeepSeek decoder layer: RMSNorm, the dense MLP and the MoE.

Routing follows HF transformers' modelling code (the project's numerical reference) and
DeepSeek's own `inference/model.py`:
  V2: softmax scores, `greedy` or `group_limited_greedy` (best expert per group), weights scaled by
      `routed_scaling_factor` (normalised first when `norm_topk_prob`, as DeepSeek's original code
      does; HF's V2 port ignores that flag, and every released V2 config has it false);
  V3: sigmoid scores, `e_score_correction_bias` for the choice only, groups ranked by the sum of
      their top-2 scores, `norm_topk_prob`, `routed_scaling_factor`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from irminsul.model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # Kept in float32 whatever the model dtype (HF `_keep_in_fp32_modules_strict`).
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        if cfg.scoring_func == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, hidden] -> (weights [n, k] float32, expert ids [n, k])."""
        cfg = self.cfg
        logits = F.linear(x.float(), self.weight.float())  # [n, E]
        n, experts = logits.shape
        per_group = experts // cfg.n_group
        if cfg.scoring_func == "sigmoid":
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
            group_scores = choice.view(n, cfg.n_group, per_group).topk(min(2, per_group), dim=-1)[0].sum(-1)
            fill = float("-inf")
        else:
            scores = logits.softmax(dim=-1)
            choice = scores
            group_scores = choice.view(n, cfg.n_group, per_group).max(dim=-1).values
            fill = 0.0
        if cfg.topk_method != "greedy":
            groups = group_scores.topk(cfg.topk_group, dim=-1, sorted=False)[1]  # [n, topk_group]
            group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1.0).bool()
            expert_mask = group_mask.unsqueeze(-1).expand(n, cfg.n_group, per_group).reshape(n, experts)
            choice = choice.masked_fill(~expert_mask, fill)
        ids = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, ids


class MoE(nn.Module):
    """Routed experts (top-k of n_routed_experts) plus always-on shared experts."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(
            MLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.n_routed_experts)
        )
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts) if cfg.n_shared_experts else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)  # [n, k]
        out = torch.zeros_like(x)
        # Loop over the experts that were hit, not over tokens: one matmul per active expert.
        for expert in ids.unique().tolist():
            token, slot = torch.where(ids == expert)
            y = self.experts[expert](x[token]) * weights[token, slot, None].to(x.dtype)
            out[token] += y  # a token picks an expert at most once: no duplicate indices here
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
