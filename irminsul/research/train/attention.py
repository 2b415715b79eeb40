"""Attention supervision: some heads are told where the answer's source tokens are.

Retrieval examples know where each answer token was copied from (`Example.sources`). For those
examples the trainer adds two training-time losses on a few heads of one layer (the probe heads),
at the positions that predict an answer token:

- attention: cross-entropy of each probe head's attention distribution against the source
  position (the query/key circuit gets a direct gradient);
- copy: the probe heads' summed output, read through the final norm and the LM head ("logit
  lens"), must predict the answer token (the value/output circuit gets a direct gradient).

Under the answer loss alone retrieval did not emerge within the CPU budget: the signal
through a flat attention pattern is too weak. With the attention loss alone the heads found the
source within 400 steps but the answer stayed at chance, which is what the copy loss is for.
Both are losses only: the saved checkpoint is a plain HF model and evaluation sees none of it.

The probe recomputes the heads from the layer's input, captured by a forward hook, with
transformers' own projections and RoPE, so it follows the module exactly (tested against
`output_attentions`).
"""

import torch
import torch.nn.functional as F

SUPPORTED = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "LlamaForCausalLM")


class HeadProbe:
    """Recomputes `heads` of `layer` at the query positions set by `target(src)`."""

    def __init__(self, model, layer: int, heads: tuple[int, ...]):
        if type(model).__name__ not in SUPPORTED:
            raise ValueError(f"attention supervision supports {SUPPORTED}, not {type(model).__name__}")
        n_heads = model.config.num_attention_heads
        if not heads or not all(0 <= h < n_heads for h in heads):
            raise ValueError(f"probe heads {tuple(heads)} must be among the model's {n_heads} heads")
        self.model = model
        self.attn = model.model.layers[layer].self_attn
        self.heads = tuple(heads)
        self.mla = type(model).__name__.startswith("Deepseek")
        self.src: torch.Tensor | None = None  # [B, L] source position per query, -1 = none
        self.scores: torch.Tensor | None = None  # [n, H, L] pre-softmax scores at the query rows
        self.out: torch.Tensor | None = None  # [n, hidden] summed output of the probe heads
        self._handle = self.attn.register_forward_hook(self._hook, with_kwargs=True)

    def remove(self) -> None:
        self._handle.remove()

    def target(self, src: torch.Tensor | None) -> None:
        """Set the sources for the next forward pass (None: record nothing)."""
        self.src = src if src is not None and bool((src >= 0).any()) else None
        self.scores = self.out = None

    def _hook(self, module, args, kwargs, output):
        if self.src is None:
            return
        hs = args[0] if args else kwargs["hidden_states"]
        b, t = (self.src >= 0).nonzero(as_tuple=True)
        q, k, v = (
            self._mla(hs, kwargs["position_embeddings"]) if self.mla else self._llama(hs, kwargs["position_embeddings"])
        )
        # q [B, H, L, d], k [B, H, L, d], v [B, H, L, dv]
        s = torch.einsum("nhd,nhld->nhl", q[b, :, t], k[b]).float() * module.scaling  # [n, H, L]
        L = hs.shape[1]
        s = s.masked_fill(torch.arange(L, device=s.device)[None, None, :] > t[:, None, None], float("-inf"))
        self.scores = s
        o = torch.einsum("nhl,nhld->nhd", torch.softmax(s, -1).to(v.dtype), v[b])  # [n, H, dv]
        w = module.o_proj.weight.view(module.o_proj.weight.shape[0], -1, o.shape[-1])[:, list(self.heads)]
        self.out = torch.einsum("nhd,ehd->ne", o, w)  # [n, hidden]

    def _mla(self, hs, freqs_cis):
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb

        a, H = self.attn, list(self.heads)
        B, L, _ = hs.shape
        q = a.q_proj(hs) if a.q_lora_rank is None else a.q_b_proj(a.q_a_layernorm(a.q_a_proj(hs)))
        q = q.view(B, L, -1, a.qk_head_dim)[:, :, H].transpose(1, 2)  # [B, H, L, d]
        q_nope, q_pe = q.split([a.qk_nope_head_dim, a.qk_rope_head_dim], -1)
        kv_nope, k_pe = a.kv_a_proj_with_mqa(hs).split([a.kv_lora_rank, a.qk_rope_head_dim], -1)
        kv = a.kv_a_layernorm(kv_nope) @ a.kv_b_proj.weight.T  # [B, L, nH * (nope + v)]
        kv = kv.view(B, L, -1, a.qk_nope_head_dim + a.v_head_dim)[:, :, H].transpose(1, 2)
        k_nope, v = kv.split([a.qk_nope_head_dim, a.v_head_dim], -1)
        q_pe, k_pe = apply_rotary_emb(q_pe, k_pe[:, None], freqs_cis)
        k = torch.cat([k_nope, k_pe.expand(-1, len(H), -1, -1)], -1)
        return torch.cat([q_nope, q_pe], -1), k, v

    def _llama(self, hs, cos_sin):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        a, H = self.attn, list(self.heads)
        B, L, _ = hs.shape
        d = a.head_dim
        kv_of = [h // a.num_key_value_groups for h in H]
        q = a.q_proj(hs).view(B, L, -1, d)[:, :, H].transpose(1, 2)
        k = a.k_proj(hs).view(B, L, -1, d)[:, :, kv_of].transpose(1, 2)
        v = a.v_proj(hs).view(B, L, -1, d)[:, :, kv_of].transpose(1, 2)
        cos, sin = cos_sin
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def _at_source(self, per_key: torch.Tensor) -> torch.Tensor:
        """per_key [n, H, L] -> [n, H]: each query's value at its source position."""
        target = self.src[self.src >= 0]
        return per_key.gather(2, target[:, None, None].expand(-1, per_key.shape[1], 1))[..., 0]

    def attention_loss(self) -> torch.Tensor:
        """Mean over probe heads and queries of -log attention(query -> its source)."""
        if self.scores is None:
            return torch.zeros(())
        return -self._at_source(torch.log_softmax(self.scores, -1)).mean()

    def copy_loss(self, y: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of the probe heads' output, read by the final norm + LM head, against y."""
        if self.out is None:
            return torch.zeros(())
        logits = self.model.lm_head(self.model.model.norm(self.out)).float()
        return F.cross_entropy(logits, y[self.src >= 0])

    def mass(self) -> float | None:
        """Mean attention weight on the source (a progress probe, 1.0 = always on target); None
        when the last batch had no answer to supervise (plain text only)."""
        if self.scores is None:
            return None
        return float(self._at_source(torch.softmax(self.scores.detach(), -1)).mean())
