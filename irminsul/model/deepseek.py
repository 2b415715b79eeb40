"""The DeepSeek-V2/V3 decoder: embeddings, MLA + (dense | MoE) layers, final norm, LM head.

Module names mirror the HF checkpoint keys (`model.layers.N.self_attn.kv_b_proj.weight`, ...), so
a checkpoint's state dict loads as it is.

The one forward operation is "prefill of any subset of positions": given sequences whose slot
tables already point at some rows of the pool, compute the given tokens at the given absolute
positions in one pass. Each computed token attends to every filled or computed row at a position
<= its own. Full prefill, chunked prefill, decode and the cache's sparse prefill are all special
cases; the engine batches any mix of them (`ForwardBatch`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from irminsul.errors import CheckpointError
from irminsul.model import attention
from irminsul.model.attention import AttentionBackend, CPUAttention
from irminsul.model.base import Capabilities
from irminsul.model.config import ModelConfig
from irminsul.model.layers import MLP, Linear, LongcatMoE, MoE, RMSNorm
from irminsul.model.loader import owned, read_tensors, resolve_dtype, weight_files
from irminsul.model.mla import ForwardBatch, MLAttention, SequenceRows
from irminsul.model.rope import Rotary
from irminsul.model.settings import Settings

# `DeepseekModel.embed`'s row-major copy of a tied table is kept up to this size (the bundled model's
# is 8 MiB; a large tied table is read strided rather than held twice)
EMBED_COPY_BYTES = 64 * 2**20


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: Rotary, backend: AttentionBackend, settings: Settings):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, settings)
        self.self_attn = MLAttention(cfg, layer, rotary, backend, settings)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, settings)
        self.mlp = (
            MoE(cfg, settings) if cfg.is_moe_layer(layer) else MLP(cfg.hidden_size, cfg.intermediate_size, settings)
        )

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch)
        return x + self.mlp(self.post_attention_layernorm(x))

    def sublayers(self) -> list[tuple[MLAttention, RMSNorm]]:
        return [(self.self_attn, self.input_layernorm)]


class LongcatBlock(nn.Module):
    """LongCat-Flash's decoder block: two MLA sublayers (pool layers 2i and 2i + 1), each followed by
    a dense MLP, and a shortcut MoE fed after the first sublayer and added after the second."""

    def __init__(self, cfg: ModelConfig, block: int, rotary: Rotary, backend: AttentionBackend, settings: Settings):
        super().__init__()
        self.mlp = LongcatMoE(cfg, settings)
        self.self_attn = nn.ModuleList(MLAttention(cfg, 2 * block + j, rotary, backend, settings) for j in range(2))
        self.mlps = nn.ModuleList(MLP(cfg.hidden_size, cfg.intermediate_size, settings) for _ in range(2))
        self.input_layernorm = nn.ModuleList(RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, settings) for _ in range(2))
        self.post_attention_layernorm = nn.ModuleList(
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, settings) for _ in range(2)
        )

    def forward(self, x: torch.Tensor, batch: ForwardBatch, stop: int | None = None) -> torch.Tensor:
        """stop=1: the hidden state entering the second sublayer (its norm not applied)."""
        x = x + self.self_attn[0](self.input_layernorm[0](x), batch)
        h = self.post_attention_layernorm[0](x)
        shortcut = None if stop == 1 else self.mlp(h)
        x = x + self.mlps[0](h)
        if stop == 1:
            return x
        x = x + self.self_attn[1](self.input_layernorm[1](x), batch)
        return x + self.mlps[1](self.post_attention_layernorm[1](x)) + shortcut

    def sublayers(self) -> list[tuple[MLAttention, RMSNorm]]:
        return list(zip(self.self_attn, self.input_layernorm))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary, backend: AttentionBackend, settings: Settings):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        block = LongcatBlock if cfg.model_type == "longcat_flash" else DecoderLayer
        self.layers = nn.ModuleList(block(cfg, i, rotary, backend, settings) for i in range(cfg.num_blocks))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, settings)


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary | None = None, settings: Settings | None = None):
        """settings: the switches it runs by (model/settings.py), else the environment's, read now."""
        super().__init__()
        self.config = cfg
        self.rotary = rotary or Rotary(cfg.rope)
        # the switches, read once: its layers, its attention backend, its kernel choice and its compiled
        # steps run by these, whatever the environment says later
        self.settings = settings if settings is not None else Settings.from_env()
        # the attention backend every layer calls (the default)
        self.attention = CPUAttention(cfg, self.rotary, self.settings)
        self.model = Backbone(cfg, self.rotary, self.attention, self.settings)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # a row-major copy of a tied table whose LM head `pack` laid out input-major (`embed`)
        self.embed_rows: torch.Tensor | None = None
        self._embed_from: int | None = None  # the data pointer of the table it was copied from

    @classmethod
    def load(
        cls,
        path: str | Path,
        dtype: str | torch.dtype = "float32",
        device: str = "cpu",
        pack: bool = True,
        settings: Settings | None = None,
    ) -> DeepseekModel:
        """An MLA checkpoint (DeepSeek-V2/V3/V3.2, GLM-4.7-Flash, LongCat-Flash) as a DeepseekModel
        (`loader.load_model` reaches it through the registry); `pack`: laid out for inference;
        `settings`: the switches it runs by (default: the environment's, read now)."""
        settings = settings if settings is not None else Settings.from_env()
        path = Path(path)
        cfg = ModelConfig.from_file(path / "config.json")
        dtype = resolve_dtype(dtype)
        tensors = read_tensors(weight_files(path), cfg.num_blocks)
        rotary = Rotary(cfg.rope, device)  # built outside the meta context: it holds real buffers
        with torch.device("meta"):
            model = cls(cfg, rotary, settings)
        expected = model.state_dict()
        if cfg.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
        missing = [k for k in expected if k not in tensors and not (cfg.tie_word_embeddings and k == "lm_head.weight")]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise CheckpointError(f"{path}: weights missing for {shown}; is config.json the one for these weights?")
        state = {}
        for key, ref in expected.items():
            if key not in tensors:
                continue
            t = tensors[key]
            if tuple(t.shape) != tuple(ref.shape):
                raise CheckpointError(
                    f"{path}: {key} has shape {tuple(t.shape)} but config.json implies {tuple(ref.shape)}"
                )
            # kept in float32 whatever the model dtype, as transformers keeps them: routers, the V3.2
            # indexer's head weights
            keep_fp32 = key.endswith(
                (
                    "mlp.gate.weight",
                    "e_score_correction_bias",
                    "router.classifier.weight",
                    "indexer.weights_proj.weight",
                )
            )
            state[key] = owned(t, t.to(device=device, dtype=torch.float32 if keep_fp32 else dtype))
        model.load_state_dict(state, strict=False, assign=True)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.eval()
        return model.pack() if pack else model

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(backend=self.attention.name, fresh_rows=True, indexer=bool(self.config.index_n_heads))

    def set_attention_backend(self, name: str) -> None:
        """ "cpu" (the default: the reference with native kernels), "reference" (plain torch ops, any device)
        or "triton" (a GPU, or Triton's interpreter on CPU tensors): attention in model/attention/triton.py,
        and the MoE layers' routed experts in model/triton_moe.py (one grouped launch per product, no host
        sync)."""
        backend = attention.backend(name, self.config, self.rotary, self.settings)
        kernel = None
        if name == "triton":
            from irminsul.model import triton_moe

            kernel = triton_moe.fused_experts
        self.attention = backend
        for module in self.modules():
            if isinstance(module, MLAttention):
                module.backend = backend
            elif isinstance(module, MoE):
                module.kernel = kernel

    def pack(self, kernels=None) -> DeepseekModel:
        """Lay the weights out for inference, once, after loading (the parameters become views, state
        dicts are unchanged): the products that read one input fused (q|kv_a, gate|up, the stacked
        experts), each product's weight held once in the layout, and with the oneDNN blocked copy (if
        any), that `kernel_choice.choose` measured fastest for its shape on this machine (cached per CPU
        model; `kernel_choice`). kernels="fixed" (or IRMINSUL_KERNEL_CHOICE=fixed in its `settings`):
        the earlier fixed rule instead, input-major with oneDNN copies for 256, 32 and 8 rows of each
        float32 weight; a `kernel_choice.KernelChoices`: those. Each layer's `pack` is handed them, and
        they are kept as `kernel_choices`."""
        from irminsul.model import kernel_choice
        from irminsul.model.layers import chosen_layout, laid_out

        choices = kernel_choice.choose(
            self.products(), *self._weight_bytes(), device=self.device, kernels=kernels, settings=self.settings
        )
        for module in self.modules():  # (an MoE before its experts: they are packed into its stack)
            if module is not self and hasattr(module, "pack"):
                module.pack(choices)
        with torch.no_grad():
            w = self.lm_head.weight
            head = nn.Parameter(laid_out(w, chosen_layout(*w.shape, w.dtype, w.device, choices)), requires_grad=False)
        self.lm_head.weight = head
        self.embed_rows = None
        if self.config.tie_word_embeddings:
            self.model.embed_tokens.weight = head
            if not head.is_contiguous() and head.numel() * head.element_size() <= EMBED_COPY_BYTES:
                self.embed_rows, self._embed_from = head.detach().contiguous(), head.data_ptr()
        self.lm_head.pack_dnn(choices, layout=None)
        self.kernel_choices = choices
        if choices.kernels == "measured" and self.dtype == torch.bfloat16 and isinstance(self.attention, CPUAttention):
            self.attention.widen_prefill()  # (timed at load, not inside the first request's prefill)
        if choices.seconds > 0.05:
            kernel_choice.log.info(
                "linear kernels measured in %.1f s: %s", choices.seconds, "; ".join(kernel_choice.describe(choices))
            )
        return self

    def products(self) -> list:
        """The linear products `pack` lays out, as `kernel_choice.Product`s (with how many calls per
        token each weight gets: a routed expert's share of the tokens)."""
        from irminsul.model.kernel_choice import Product

        experts = set()
        found = []
        for module in self.modules():
            if isinstance(module, (MoE, LongcatMoE)):
                experts.update(id(e) for e in module.experts)
                if isinstance(module, MoE):
                    found += module.products()
                else:  # (its zero-computation experts take a share of the tokens too)
                    share = self.config.num_experts_per_tok / (len(module.experts) + self.config.zero_expert_num)
                    found += [p for e in module.experts for p in e.products(share)]
        for module in self.modules():
            if isinstance(module, MLP) and id(module) not in experts:
                found += module.products()
            elif isinstance(module, MLAttention):
                q_in, kv_a = module._q_in(), module.kv_a_proj_with_mqa
                found.append(
                    Product(q_in.out_features + kv_a.out_features, kv_a.in_features, kv_a.weight.dtype, 1, 1.0)
                )
                for lin in (module.kv_b_proj, module.o_proj) + ((module.q_b_proj,) if module.cfg.q_lora_rank else ()):
                    found.append(Product(*lin.weight.shape, lin.weight.dtype, 1, 1.0, "out"))
                cfg, dtype = module.cfg, module.kv_b_proj.weight.dtype
                if dtype == torch.bfloat16:  # (each head's absorbed product: whether to widen it, `MLAttention.pack`)
                    heads = cfg.num_attention_heads
                    found += [
                        Product(cfg.kv_lora_rank, cfg.qk_nope_head_dim, dtype, heads, heads, "out", held=False),
                        Product(cfg.v_head_dim, cfg.kv_lora_rank, dtype, heads, heads, "out", held=False),
                    ]
        w = self.lm_head.weight
        found.append(Product(*w.shape, w.dtype, 1, 1.0))
        return found

    def _weight_bytes(self) -> tuple[int, int]:
        """(all the weights' bytes, those one decode token reads: not the routed experts it is not routed
        to, nor the embedding table beyond its row)."""
        cfg = self.config
        total = decode = 0
        routed = {
            id(p): len(m.experts)
            for m in self.modules()
            if isinstance(m, (MoE, LongcatMoE))
            for e in m.experts
            for p in e.parameters()
        }
        for name, p in self.named_parameters():
            size = p.numel() * p.element_size()
            total += size
            if id(p) in routed:
                decode += size * cfg.num_experts_per_tok // routed[id(p)]
            elif not ("embed_tokens" in name and not cfg.tie_word_embeddings):
                decode += size
        return total, decode

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def new_rows(self, capacity: int = 256) -> SequenceRows:
        return SequenceRows(self.config, self.dtype, self.device, capacity)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, stop_layer: int | None = None) -> torch.Tensor:
        """Compute batch.token_ids at batch.positions; write their rows; return final hidden [N, hidden].

        With stop_layer, run only layers [0, stop_layer) and return the (un-normed) hidden state
        entering stop_layer; rows of later layers are left untouched."""
        return self.hidden(batch, stop_layer)

    def hidden(self, batch, stop_layer: int | None = None) -> torch.Tensor:
        """`forward` without its inference mode, for a caller that compiles it (model/compiled.py:
        `batch` is then its decode batch, which keeps the rows instead of writing them)."""
        x = self.embed(batch.token_ids)
        per = self.config.attention_per_block
        for i, block in enumerate(self.model.layers):
            if stop_layer is not None and i * per >= stop_layer:
                break
            if stop_layer is not None and stop_layer < (i + 1) * per:  # inside a LongCat block
                return block(x, batch, stop=stop_layer - i * per)
            x = block(x, batch)
        return x if stop_layer is not None else self.model.norm(x)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of token_ids. A table tied to an LM head stored input-major is read from
        its row-major copy (`embed_rows`), kept while that copy is small: looking up rows of the
        transposed table reads one float per cache line, an order of magnitude slower than the copy."""
        rows = self.embed_rows
        if (
            rows is not None
            and not torch.compiler.is_compiling()
            and self.model.embed_tokens.weight.data_ptr() != self._embed_from
        ):
            rows = self.embed_rows = None  # (the table was replaced since `pack`)
        return self.model.embed_tokens(token_ids) if rows is None else F.embedding(token_ids, rows)

    def sublayers(self) -> list[tuple[MLAttention, RMSNorm]]:
        """Every MLA sublayer with the norm in front of it, in pool-layer order (one per decoder
        layer; two per LongCat block)."""
        return [pair for block in self.model.layers for pair in block.sublayers()]

    @torch.inference_mode()
    def fresh_rows(self, batch: ForwardBatch, layer: int) -> torch.Tensor:
        """Rows [N, row_width] that pool layer `layer` would cache for the batch in its current context."""
        attn, norm = self.sublayers()[layer]
        return attn.stored_rows(norm(self.forward(batch, stop_layer=layer)))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def prefill(self, seq: SequenceRows, token_ids, positions) -> torch.Tensor:
        """Single-sequence convenience: compute token_ids at positions into seq; hidden [n, hidden]."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
        pos = torch.as_tensor(positions, dtype=torch.long, device=self.device)
        return self.forward(seq.batch(self.attention, ids, pos))
