"""The V4 decoder: layers of attention and MoE between hyper-connections, the hyper head, the LM head;
the full forward and the prefill over per-token rows."""

from __future__ import annotations

import torch
from torch import nn

from irminsul.model.deepseek_v4.attention import RMSNorm, V4Attention
from irminsul.model.deepseek_v4.blocks import HyperConnection, HyperHead, V4MoE, merge_streams
from irminsul.model.deepseek_v4.config import Rotations, V4Config, rotary_table

# ------------------------------------------------------------------------------------------------ model


class V4DecoderLayer(nn.Module):
    def __init__(self, cfg: V4Config, layer: int):
        super().__init__()
        self.self_attn = V4Attention(cfg, layer)
        self.mlp = V4MoE(cfg, layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(cfg)
        self.ffn_hc = HyperConnection(cfg)

    def forward(
        self,
        streams: torch.Tensor,
        token_ids: torch.Tensor,
        rotations: Rotations,
        rows: torch.Tensor | None = None,
        q_pos: torch.Tensor | None = None,
        key_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """streams [B, n, hc_mult, hidden] -> the same. Without `rows`: the tokens are positions 0..n-1 and
        attend to each other. With `rows` [B, T, row_width] (this layer's rows of positions 0..T-1, the
        ones of other positions filled in, e.g. reused): the tokens are positions q_pos [n], their rows are
        written into `rows` at q_pos, and they attend over all of them."""
        mix = self.attn_hc(streams)
        x = self.input_layernorm(mix.block_input)
        if rows is None:
            out = self.self_attn(x, rotations)
        else:
            rows[:, q_pos] = self.self_attn.rows(x).to(rows.dtype)
            out = self.self_attn.attend(x, rows, q_pos, key_pos, rotations)
        streams = merge_streams(streams, out, mix)
        mix = self.ffn_hc(streams)
        return merge_streams(streams, self.mlp(self.post_attention_layernorm(mix.block_input), token_ids), mix)


class V4Backbone(nn.Module):
    def __init__(self, cfg: V4Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(V4DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg)


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(self, cfg: V4Config):
        super().__init__()
        self.config = cfg
        self.model = V4Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def rotations(self, n: int, device) -> Rotations:
        cfg = self.config
        return Rotations(
            main=rotary_table(cfg.main_rope, 1.0, n, device),
            compress=rotary_table(cfg.compress_rope, cfg.compress_attention_factor, n, device),
        )

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [B, S] (or [S]) at positions 0..S-1 -> float32 logits [B, S, vocab] (or [S, vocab])."""
        squeeze = token_ids.dim() == 1
        token_ids = token_ids.reshape(-1, token_ids.shape[-1]).to(self.lm_head.weight.device)
        rotations = self.rotations(token_ids.shape[1], token_ids.device)
        x = self.model.embed_tokens(token_ids)
        streams = x.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()  # [B, S, n, hidden]
        for layer in self.model.layers:
            streams = layer(streams, token_ids, rotations)
        logits = self.lm_head(self.model.norm(self.model.hc_head(streams))).float()
        return logits[0] if squeeze else logits

    def new_rows(self, n: int) -> list[torch.Tensor]:
        """Empty per-layer rows [n, row_width] for a sequence of n positions (`prefill`)."""
        w = self.lm_head.weight
        return [w.new_zeros(n, layer.self_attn.row_width) for layer in self.model.layers]

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: torch.Tensor,
        compute: torch.Tensor,
        rows: list[torch.Tensor],
        key_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Compute the positions `compute` [n] (increasing) of one sequence token_ids [T], given every other
        position's per-layer rows in `rows` (a list of [T, row_width], from `new_rows`; e.g. rows another
        prompt computed for the same content at other positions). The computed positions' rows are written
        into `rows`. -> float32 logits [n, vocab] of the computed positions.

        This is position-independent reuse for V4 (docs/deepseek-v4.md): a row holds a token's key with its
        rope slice un-rotated and its compressors' pooling inputs, so reused rows are read at their new
        positions and compressed entries are pooled at the new prompt's window alignment. key_pos [T]: the
        position each key is rotated at (default its own; the `naive` baseline passes where it was computed)."""
        compute = compute.to(token_ids.device)
        return self.logits(self.prefill_hidden(token_ids[compute], compute, rows, key_pos))

    @torch.inference_mode()
    def prefill_hidden(
        self,
        token_ids: torch.Tensor,
        compute: torch.Tensor,
        rows: list[torch.Tensor],
        key_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`prefill` given the computed positions' own token ids [n]; -> the final hidden states [n, hidden]
        (after the hyper head and the norm, before lm_head)."""
        device = self.lm_head.weight.device
        token_ids, compute = token_ids.to(device), compute.to(device)
        key_pos = None if key_pos is None else key_pos.to(device)
        span = rows[0].shape[0] if key_pos is None else max(rows[0].shape[0], int(key_pos.max()) + 1)
        rotations = self.rotations(span, device)
        chosen = token_ids[None]
        streams = self.model.embed_tokens(chosen).unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        for layer, layer_rows in zip(self.model.layers, rows):
            streams = layer(streams, chosen, rotations, layer_rows[None], compute, key_pos)
        return self.model.norm(self.model.hc_head(streams))[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
