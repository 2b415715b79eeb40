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
from torch.utils.flop_counter import register_flop_formula

from irminsul.model import elementwise, gemv, kernel_choice, native_ops
from irminsul.model.config import ModelConfig
from irminsul.model.kernel_choice import KernelChoices
from irminsul.model.settings import Settings
from irminsul.model.widen import widened


def snapshot(settings: Settings | None) -> Settings:
    """The switches a layer built with `settings` runs by: those (its model's), else the environment's
    now (a layer built on its own reads it once, when it is built)."""
    return settings if settings is not None else Settings.from_env()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, settings: Settings | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.settings = snapshot(settings)  # (native_elementwise: the native kernel where it runs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: not F.rms_norm: on a CPU it is no faster for one row and 10x slower for 1,500
        # (one pass, where the native kernel runs)
        fused = elementwise.rms_norm(x, self.weight, self.eps) if self.settings.native_elementwise else None
        if fused is not None:
            return fused
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


# oneDNN is called on blocks of these many rows: it builds (and keeps) a kernel and a copy of the
# weight for every row count it sees, so a server's varying batch sizes would grow its memory
# without end (~0.75 MB more per row count for a 1.5 MB weight); blocked for 32 and 8 rows, and
# called on multiples of 256 for the bulk, it sees at most a few row counts per weight
DNN_BLOCKS = (256, 32, 8)


def dnn_weight(
    w: torch.Tensor,
    blocks: tuple[int, ...] | None = None,
    layout: str | None = None,
    choices: KernelChoices | None = None,
) -> tuple[torch.Tensor | None, ...] | None:
    """oneDNN's blocked copies of a weight [out, in] for blocks of 256, 32 and 8 rows (None for a block
    not kept; `dnn_linear`), or None where none is kept or applies (not a CPU, no oneDNN in this
    torch, bfloat16 on a CPU without bf16 instructions).

    Which blocks: `blocks` when given; else the block `choices` (`DeepseekModel.pack`'s) measured on
    this machine for this shape, if any (`kernel_choice`: at most one, where it pays and fits the copy
    budget; `layout`: "out" for a weight that keeps nn.Linear's layout, None for one laid out by the
    choices); without choices the fixed rule (float32 only: every block whose rows x weight size
    reach `kernel_choice.DNN_MIN_MACS`). Each copy is one more copy of the weight.

    torch's CPU GEMM is MKL's, and MKL runs its AVX2 code on AMD processors: there oneDNN's product
    over a pre-blocked weight can be much faster than MKL's, while on Intel CPUs it loses on most
    products (`python benchmarks/bench_gemv_layout.py` shows a machine's).
    """

    if blocks is None:
        choice = (
            choices.choice(w.shape[0], w.shape[1], w.dtype, w.device, layout=layout)
            if choices is not None
            else kernel_choice.fixed_choice(w.shape[0], w.shape[1], w.dtype, w.device)
        )
        blocks = choice.blocks
    if not blocks or not kernel_choice.dnn_applies(w.dtype, w.device):
        return None
    with torch.no_grad():
        w = w.detach().contiguous()
        return tuple(
            torch.ops.mkldnn._reorder_linear_weight(w, rows) if rows in blocks else None for rows in DNN_BLOCKS
        )


def dnn_linear(
    x: torch.Tensor, dnn: tuple[torch.Tensor | None, ...], weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [..., in] times weight [out, in] (any strides) plus bias, through its `dnn_weight` copies."""
    out = weight.shape[0]
    x2 = x.reshape(-1, x.shape[-1])
    # in a compiled graph, an op of our own: inductor lowers oneDNN's linear only for weights it
    # blocked itself, and the op chooses by the row count at run time, where a graph would guard,
    # and recompile, on it; eagerly, the same function without the op's dispatch (tens of us)
    rows = _dnn_op(x2, *dnn, weight, bias) if torch.compiler.is_compiling() else _dnn_rows(x2, *dnn, weight, bias)
    return rows.view(*x.shape[:-1], out)


def _dnn_rows(
    x: torch.Tensor,
    b256: torch.Tensor | None,
    b32: torch.Tensor | None,
    b8: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """A multiple of 256 rows in one call, then blocks of 32; a rest of 20 or more padded to 32 (16
    without 8-row blocks); else blocks of 8 (the last padded from 4 rows); each where the weight has
    them (a rest of 128 or more padded to 256 where it has only those); the rest through torch's own
    product (`kernel_choice._block_saving` counts the same)."""
    n = x.shape[0]
    y = x.new_empty(n, weight.shape[0])
    at = 0

    def run(blocked, rows: int, take: int) -> None:
        nonlocal at
        part = x[at : at + take]
        if take < rows:  # (take > rows: the bulk, a multiple of the block)
            part = torch.cat([part, part.new_zeros(rows - take, x.shape[1])])
        y[at : at + take] = torch.ops.mkldnn._linear_pointwise(part.contiguous(), blocked, bias, "none", [], "")[:take]
        at += take

    if (
        b256 is not None and n >= 256
    ):  # one call for the bulk: a multiple of 256 rows (at most a step's prefill / 256 kinds)
        run(b256, 256, n // 256 * 256)
    if b256 is not None and b32 is None and b8 is None and n - at >= 128:
        run(b256, 256, n - at)
    while b32 is not None and n - at >= 32:
        run(b32, 32, 32)
    if b32 is not None and n - at >= (20 if b8 is not None else 16):
        run(b32, 32, n - at)
    elif b8 is not None:
        while n - at >= 4:
            run(b8, 8, min(8, n - at))
    if n > at:
        y[at:] = F.linear(x[at:], weight, bias)
    return y


_dnn_op = torch.library.custom_op("irminsul::dnn_rows", _dnn_rows, mutates_args=())


def chosen_layout(out: int, inp: int, dtype: torch.dtype, device, choices: KernelChoices | None) -> str:
    """The dense layout a weight [out, in] is stored in: "in" ([in, out], x @ W) or "out" ([out, in]),
    as `choices` measured it (`kernel_choice`), else input-major (no choices: the fixed rule)."""

    if choices is None or choices.kernels == "fixed":
        return "in"
    return choices.choice(out, inp, dtype, device).layout


def gemv_rows(w: torch.Tensor, choices: KernelChoices | None, layout: str | None = None) -> int:
    """How many rows at most the products of w [out, in] take `gemv.product` for (0: none): what
    `choices` (`DeepseekModel.pack`'s) measured for this shape (`kernel_choice.Choice.gemv`), where
    w's rows are contiguous and the kernel is available; 0 without choices (the fixed rule)."""

    if choices is None or choices.kernels == "fixed" or w.stride(1) != 1 or not gemv.available(w.device, w.dtype):
        return 0
    return choices.choice(w.shape[0], w.shape[1], w.dtype, w.device, layout=layout).gemv


def widen_rows(w: torch.Tensor, choices: KernelChoices | None, layout: str | None = None) -> int:
    """From how many rows on the products of w [out, in] run `widened` (0: never): what `choices`
    (`DeepseekModel.pack`'s) measured for this shape (`kernel_choice.Choice.widen`); 0 without choices
    (the fixed rule)."""

    return widen_rows_of(w.shape[0], w.shape[1], w.dtype, w.device, choices, layout)


def widen_rows_of(
    out: int, inp: int, dtype: torch.dtype, device, choices: KernelChoices | None, layout: str | None = "out"
) -> int:
    """`widen_rows` for a product shape [out, in] that has no weight of its own laid out by the choices
    (each head's share of the absorbed W_UK / W_UV products)."""
    if choices is None or choices.kernels == "fixed" or torch.device(device).type != "cpu":
        return 0
    return choices.choice(out, inp, dtype, device, layout=layout).widen


def laid_out(w: torch.Tensor, layout: str) -> torch.Tensor:
    """w [out, in] (any strides) as a [out, in] tensor stored `layout`-major ("in": the transpose of a
    contiguous [in, out]); w itself where it already is."""
    if layout == "in":
        return w if w.t().is_contiguous() else w.t().contiguous().t()
    return w.contiguous()


@_dnn_op.register_fake
def _(x, b256, b32, b8, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


@register_flop_formula(torch.ops.irminsul.dnn_rows)
def _(x_shape, b256_shape, b32_shape, b8_shape, weight_shape, bias_shape, **kwargs) -> int:
    return 2 * x_shape[0] * x_shape[1] * weight_shape[0]  # what torch's FLOP counter counts for the same mm


class Linear(nn.Linear):
    """nn.Linear (the same parameters and state-dict names) that, once packed, computes products of
    up to `gemv_rows` rows through `gemv.product` where that was chosen (`gemv_rows`), larger ones
    through oneDNN where a copy was kept for it (`dnn_weight`); else F.linear."""

    dnn: tuple[torch.Tensor | None, ...] | None = None
    gemv_rows: int = 0  # products of at most this many rows through gemv.product
    widen_rows: int = 0  # products of at least this many rows through `widened` (0: none)

    def pack_dnn(self, choices: KernelChoices | None, layout: str | None = "out") -> None:
        """Its oneDNN copy, gemv and widened rows as `choices` measured them for its shape (None: the
        fixed rule). (Named apart from `pack`: a linear fused into another product needs no copy of
        its own.) layout: "out" (the default) for a weight that keeps nn.Linear's layout (others read
        it as [out, in] views: attention's W_UK / W_UV), None for one laid out by the choices already."""
        self.dnn = dnn_weight(self.weight, layout=layout, choices=choices)
        self.gemv_rows = gemv_rows(self.weight, choices, layout=layout)
        self.widen_rows = widen_rows(self.weight, choices, layout=layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = gemv.rows(x)
        if 0 < rows <= self.gemv_rows:
            return gemv.product(x, self.weight, self.bias)
        if 0 < self.widen_rows <= rows:
            return widened(x, self.weight, self.bias)
        if rows > 1 and self.dnn is not None:
            return dnn_linear(x, self.dnn, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def pack_linears(
    *linears: nn.Linear, layout: str | None = None, choices: KernelChoices | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Linears that read the same input, as one product: (weight [in, sum of outs], bias or None).

    The weight is stored in one layout, `layout` or the one `choices` measured for this shape
    (`chosen_layout`; input-major without choices): input-major ([in, out] contiguous) or
    out-major (the returned [in, out] is then the transpose of a contiguous [out, in]; `x @ w` is
    F.linear's product); each linear's weight becomes a view of it, so nothing is held twice and
    state dicts are unchanged. One product instead of several is fewer calls.
    """
    with torch.no_grad():
        cat = torch.cat([lin.weight for lin in linears])  # [sum of outs, in]
        if layout is None:
            layout = chosen_layout(cat.shape[0], cat.shape[1], cat.dtype, cat.device, choices)
        w = cat.t().contiguous() if layout == "in" else cat.contiguous().t()
        del cat
        biases = [lin.bias for lin in linears]
        bias = (
            None
            if all(b is None for b in biases)
            else torch.cat([b if b is not None else w.new_zeros(lin.out_features) for b, lin in zip(biases, linears)])
        )
        at = 0
        for lin in linears:
            lin.weight = nn.Parameter(w[:, at : at + lin.out_features].t(), requires_grad=False)
            if lin.bias is not None:
                lin.bias = nn.Parameter(bias[at : at + lin.out_features], requires_grad=False)
            at += lin.out_features
    return w, bias


def packed(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    dnn: tuple[torch.Tensor | None, ...] | None = None,
    gemv_rows: int = 0,
    widen_rows: int = 0,
) -> torch.Tensor:
    """x [..., in] times a weight [in, out] (`pack_linears`: either layout), plus bias; up to
    `gemv_rows` rows (`gemv_rows` for w.t()) through `gemv.product`, from `widen_rows` rows on
    (`widen_rows` for w.t()) through `widened`, more than one through `dnn`, the same weight's
    `dnn_weight`, when there is one."""
    rows = gemv.rows(x)
    if 0 < rows <= gemv_rows:
        return gemv.product(x, w.t(), bias)
    if 0 < widen_rows <= rows:
        return widened(x, w.t(), bias)
    if rows > 1 and dnn is not None:
        return dnn_linear(x, dnn, w.t(), bias)
    return (
        torch.matmul(x, w)
        if bias is None
        else torch.addmm(bias, x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[1])
    )


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)); after `pack`, gate and up are one product."""

    def __init__(self, hidden: int, inner: int, settings: Settings | None = None):
        super().__init__()
        self.settings = snapshot(settings)  # (native_elementwise: silu * up through the native kernel)
        self.gate_proj = Linear(hidden, inner, bias=False)
        self.up_proj = Linear(hidden, inner, bias=False)
        self.down_proj = Linear(inner, hidden, bias=False)
        self.gate_up: torch.Tensor | None = None  # [hidden, 2 * inner] after `pack`
        self.gate_up_dnn: tuple[torch.Tensor | None, ...] | None = None  # its `dnn_weight`
        self.gate_up_gemv_rows = 0  # its products of at most this many rows through gemv.product (`gemv_rows`)
        self.gate_up_widen_rows = 0  # its products of at least this many rows through `widened` (`widen_rows`)

    def pack(self, choices: KernelChoices | None = None) -> None:
        """gate and up as one product, each product laid out, copied and routed as `choices` measured
        for its shape (`DeepseekModel.pack`'s; None: the fixed rule)."""
        stacked = self.packed  # (a stacked expert's gate|up is a view of its MoE's stack, laid out there)
        if not stacked:
            self.gate_up, _ = pack_linears(self.gate_proj, self.up_proj, choices=choices)
        self.gate_up_dnn = dnn_weight(self.gate_up.t(), choices=choices)
        self.gate_up_gemv_rows = gemv_rows(self.gate_up.t(), choices)
        self.gate_up_widen_rows = widen_rows(self.gate_up.t(), choices)
        self.down_proj.pack_dnn(choices, layout=None if stacked else "out")

    def products(self, uses: float = 1.0, stacked: bool = False) -> list:
        """The products `pack` lays out (`kernel_choice.Product`s): gate|up, down; `uses` per token each."""

        inner, hidden = self.gate_proj.weight.shape
        dtype = self.gate_proj.weight.dtype
        return [
            kernel_choice.Product(2 * inner, hidden, dtype, 1, uses),
            kernel_choice.Product(hidden, inner, dtype, 1, uses, None if stacked else "out"),
        ]

    @property
    def packed(self) -> bool:
        return self.gate_up is not None and self.gate_up.data_ptr() == self.gate_proj.weight.data_ptr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (a compiled graph cannot compare data pointers: the compiled step takes packed models only)
        if not (torch.compiler.is_compiling() or self.packed):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.packed_forward(x)

    def packed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """forward of a packed MLP, without the check (a compiled graph cannot compare data pointers)."""
        gate_up = packed(x, self.gate_up, None, self.gate_up_dnn, self.gate_up_gemv_rows, self.gate_up_widen_rows)
        # (one pass, where the native kernel runs)
        act = elementwise.silu_mul(gate_up) if self.settings.native_elementwise else None
        if act is None:
            g, u = gate_up.chunk(2, dim=-1)
            act = F.silu(g) * u
        return self.down_proj(act)


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
        else:
            scores = logits.softmax(dim=-1)
            choice = scores
        if cfg.topk_method != "greedy":
            if cfg.scoring_func == "sigmoid":
                group_scores = choice.view(n, cfg.n_group, per_group).topk(min(2, per_group), dim=-1)[0].sum(-1)
                fill = float("-inf")
            else:
                group_scores = choice.view(n, cfg.n_group, per_group).max(dim=-1).values
                fill = 0.0
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
    """Routed experts (top-k of n_routed_experts) plus always-on shared experts.

    The routed experts run grouped: each expert's tokens are gathered into one padded batch and all
    experts run in two batched matmuls (gate|up, then down) over weights stacked once
    ([E, H, 2I] and [E, I, H]; the per-expert parameters become views of them, so nothing is held
    twice and checkpoints load as they are). When fewer than half the experts are hit (a decode step
    of a few sequences: the grouped product would read every expert's weights), or routing is so
    uneven that its padding would cost more than the loop's calls (`_padding_pays`), it loops over
    the experts hit. On a CPU, float32, the experts of a decode step's few tokens run in one native
    call instead (model/native/moe.c), at the token counts measured to pay (`routed`).
    """

    grouped = True  # False: always loop (exact FLOPs: the grouped path also multiplies its padding)
    # inside a compiled batched step: the routed experts through `native_ops.moe_experts` (set by
    # model/compiled.py where the native kernels run), instead of every expert on every token (`dense`)
    native_graph = False

    def __init__(self, cfg: ModelConfig, settings: Settings | None = None):
        super().__init__()
        self.settings = settings = snapshot(settings)  # (native_moe: the native experts where they run)
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(
            MLP(cfg.hidden_size, cfg.moe_intermediate_size, settings) for _ in range(cfg.n_routed_experts)
        )
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, settings)
            if cfg.n_shared_experts
            else None
        )
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None
        # the triton backend's grouped kernel (triton_moe.fused_experts), set by set_attention_backend
        self.kernel = None

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate|up [E, H, 2I], down [E, I, H]), each stored in the layout `pack` chose for an
        expert's product (`layouts`: input-major, the default and always with the triton kernel, or
        out-major: the transpose of a contiguous [E, 2I, H] / [E, H, I]); built on first use from the
        loaded weights, the experts' parameters re-pointed at them."""
        w = self._stacked
        # (the triton kernel reads input-major stacks)
        gate_up_layout, down_layout = ("in", "in") if self.kernel is not None else self.layouts
        if (
            w is None
            or w[0].data_ptr() != self.experts[0].gate_proj.weight.data_ptr()
            or (w[0].stride(2) == 1) != (gate_up_layout == "in")
            or (w[1].stride(2) == 1) != (down_layout == "in")
        ):
            inner = self.experts[0].gate_proj.weight.shape[0]
            with torch.no_grad():
                # (one copy each: a stack of transposed views is already contiguous input-major)
                if gate_up_layout == "in":
                    gate_up = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]).t() for e in self.experts])
                else:
                    gate_up = torch.stack(
                        [torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in self.experts]
                    ).transpose(1, 2)
                if down_layout == "in":
                    down = torch.stack([e.down_proj.weight.t() for e in self.experts])
                else:
                    down = torch.stack([e.down_proj.weight for e in self.experts]).transpose(1, 2)
                for i, e in enumerate(self.experts):  # re-point the experts at the stacked storage
                    e.gate_proj.weight = nn.Parameter(gate_up[i, :, :inner].t(), requires_grad=False)
                    e.up_proj.weight = nn.Parameter(gate_up[i, :, inner:].t(), requires_grad=False)
                    e.down_proj.weight = nn.Parameter(down[i].t(), requires_grad=False)
                    e.gate_up = gate_up[i]
            self._stacked = w = (gate_up, down)
        return w

    layouts: tuple[str, str] = ("in", "in")  # the stacked gate|up's and down's (`stacked`), set by `pack`

    def pack(self, choices: KernelChoices | None = None) -> None:
        """The experts stacked in the layouts `choices` measured for an expert's products (None: the
        fixed rule), and the native kernel's token counts and the expert loop's costs measured."""
        inner, hidden = self.experts[0].gate_proj.weight.shape
        dtype, device = self.experts[0].gate_proj.weight.dtype, self.experts[0].gate_proj.weight.device
        self.layouts = (
            chosen_layout(2 * inner, hidden, dtype, device, choices),
            chosen_layout(hidden, inner, dtype, device, choices),
        )
        self._stacked = None
        self.stacked()
        if device.type == "cpu":
            how = choices.kernels if choices is not None else None
            self.native_counts = kernel_choice.native_experts_counts(self, dtype, how)
            self.native_tokens = max(self.native_counts, default=0)
            if how not in ("fixed", "forced") and kernel_choice.mode(how, self.settings) == "measured":
                self.loop_call_s, self.macs_per_s = kernel_choice.expert_costs(self, dtype)
        else:
            self.native_counts, self.native_tokens = (), 0

    def products(self) -> list:
        """The routed experts' products (`kernel_choice.Product`s), each expert used by k / E of the tokens."""
        share = self.gate.cfg.num_experts_per_tok / len(self.experts)
        return [p for e in self.experts for p in e.products(share, stacked=True)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)  # [n, k]
        out = self.routed(x, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' output [n, H], through one of four backends: the triton kernel (where
        `set_attention_backend("triton")` set it), the graph forms (inside a compiled decode step), the
        native kernel (a CPU, the token counts measured to pay at `pack`), else
        torch's products (`torch_experts`)."""
        if self.kernel is not None:
            return self.kernel(x, weights, ids, *self.stacked())
        if torch.compiler.is_compiling():
            return self._in_graph(x, weights, ids)
        out = self._native(x, weights, ids)
        return self.torch_experts(x, weights, ids) if out is None else out

    def _native(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
        """The routed experts through the native kernel, or None where it does not run: more than
        `native_tokens` tokens, a count the kernel lost at when it was measured (`native_counts`), not
        on a CPU, or no kernel for them here (`native_kernel`)."""
        n = x.shape[0]
        if n > self.native_tokens or x.device.type != "cpu":
            return None
        if self.native_counts is not None and kernel_choice.expert_bucket(n) not in self.native_counts:
            return None
        kernel = self.native_kernel(x.dtype)
        return None if kernel is None else kernel(x, weights, ids, *self.stacked())

    def _in_graph(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        # NOTE: in a graph no shape may follow the routing, and the grouped batch is sized on the
        # host: one token takes its k experts, several run every expert (model/compiled.py bounds how
        # many, `DENSE_EXPERTS`), or the native kernel as a torch operator (model/compiled.py's
        # batched step, where the native kernels run)
        if x.shape[0] > 1 and self.native_graph:
            return native_ops.moe_experts(x, weights, ids, *self._stacked)
        return self.one_token(x, weights, ids) if x.shape[0] == 1 else self.dense(x, weights, ids)

    def torch_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts through torch's products: one token's k experts alone where few experts
        are hit; else grouped (one batched product over every expert's padded rows) where most experts
        are hit and the padding costs less than a loop's calls (`_padding_pays`; on a GPU always),
        else a loop over the experts hit."""
        n, k = ids.shape
        experts = len(self.experts)
        if n == 1 and not (self.grouped and (x.is_cuda or 2 * k >= experts)):
            return self.one_token(x, weights, ids)
        flat = ids.reshape(-1)
        counts = torch.bincount(flat, minlength=experts)
        cap = int(counts.max())
        # (on a CPU with oneDNN's copies of the experts, or their many-row products widened to float32,
        # the loop is faster: its products run at oneDNN's or float32's speed, the grouped batched
        # product at MKL's in the weights' dtype)
        first = self.experts[0]
        if (
            self.grouped
            and first.gate_up_dnn is None
            and not first.gate_up_widen_rows
            and (x.is_cuda or self._padding_pays(n * k, int((counts > 0).sum()), cap))
        ):
            return self._grouped(x, weights, flat, counts, cap)
        return self.loop_experts(x, weights, ids)

    def loop_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts by a loop over the experts hit (`expert_loop`)."""
        return expert_loop(x, weights, ids, lambda e, xs: self.experts[e](xs))

    # The routed experts of at most `native_tokens` tokens (a decode step's batch) go through
    # model/native/moe.c, where it runs: one call instead of ~10 torch operations per expert hit. The
    # counts are measured per layer shape when the model is packed (`kernel_choice.native_experts_counts`);
    # NATIVE_TOKENS is the fixed rule's (IRMINSUL_KERNEL_CHOICE=fixed) and an unpacked model's.
    NATIVE_TOKENS = 64
    native_tokens = NATIVE_TOKENS
    # the measured token counts (`kernel_choice.EXPERT_TOKENS`) where the kernel won; None: unmeasured
    # (an unpacked model), every count up to native_tokens
    native_counts: tuple[int, ...] | None = None

    def native_kernel(self, dtype: torch.dtype):
        """The native experts' call for tokens of `dtype` over this layer's stacks, whatever the token
        count (`native_tokens` bounds it; benchmarks/bench_moe.py times it), or None where it cannot
        run: the library not built, switched off (its settings' native_moe: IRMINSUL_NATIVE_MOE=0), or
        stacks it does not read (float32, or bfloat16 out-major where the bf16 experts were built:
        `native_ops.moe_bf16_available`)."""
        if not native_ops.available() or not self.settings.native_moe:
            return None
        gate_up, down = self.stacked()
        if dtype == gate_up.dtype == down.dtype == torch.float32:
            return native_ops._moe_experts
        if (
            dtype == gate_up.dtype == down.dtype == torch.bfloat16
            and gate_up.stride(1) == 1
            and down.stride(1) == 1
            and native_ops.moe_bf16_available()
        ):
            return native_ops._moe_experts_bf16
        return None

    # The cost of the expert loop's per-expert calls (gather, three products, the scatter back) and the
    # rate the grouped product multiplies at: measured on this machine when the model is packed
    # (`kernel_choice.expert_costs`); these are an unpacked model's (`python benchmarks/bench_moe.py`
    # times both paths and the choice)
    loop_call_s = 60e-6
    macs_per_s = 20e9

    def _padding_pays(self, assignments: int, hit: int, cap: int) -> bool:
        """On a CPU: the grouped product computes every expert's `cap` rows, the busiest expert's
        count, so it multiplies (experts x cap - assignments) padding rows; the loop instead pays a
        call per expert hit. Grouped only when most experts are hit (it reads every expert's weights)
        and its padding costs less than the loop's calls: on the bundled model's small experts a few
        dozen rows do; at DeepSeek's sizes (3 x 2048 x 1408 multiply-adds a row) a padding row costs
        about seven calls, and padding every expert to the busiest one's rows reached 4-5x the real
        rows on real text."""
        experts = len(self.experts)
        if 2 * hit < experts:
            return False
        inner, hidden = self.experts[0].gate_proj.weight.shape
        padding_s = (experts * cap - assignments) * 3 * inner * hidden / self.macs_per_s
        return padding_s <= hit * self.loop_call_s

    def one_token(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """One token's k experts (a single sequence's decode step), each as two products over its own
        weights in the stack: no counts, no gathers.
        NOTE: each expert id is read as a number (in a compiled graph an unbacked size,
        `capture_scalar_outputs`), so its weights are views of the stack: indexing the stack by the id
        tensor would copy the k experts' weights at every step (~7% of a one-sequence decode of the
        bundled model)."""
        compiling = torch.compiler.is_compiling()
        gate_up, down = self._stacked if compiling else self.stacked()
        out = None
        for j in range(ids.shape[1]):
            e = ids[0, j].item()
            if compiling:
                torch._check(e >= 0)
                torch._check(e < gate_up.shape[0])
                g, u = torch.mm(x, gate_up[e]).chunk(2, dim=-1)
                y = torch.mm(F.silu(g) * u, down[e])
            else:  # (the expert's own products: views of the stack, with its gemv choice)
                y = self.experts[e].packed_forward(x)
            y = y * weights[0, j].to(x.dtype)
            out = y if out is None else out + y
        return out

    def dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every token through every expert, weighted by its routing weight (0 where not chosen): no
        shape depends on routing, at E / k times the routed products."""
        gate_up, down = self._stacked if torch.compiler.is_compiling() else self.stacked()  # [E, H, 2I], [E, I, H]
        mix = torch.zeros(x.shape[0], gate_up.shape[0], dtype=x.dtype, device=x.device)
        mix = mix.scatter(1, ids, weights.to(x.dtype))  # [n, E] (a token picks an expert at most once)
        g, u = torch.matmul(x[None], gate_up).chunk(2, dim=-1)  # [E, n, I] each
        return torch.bmm(F.silu(g) * u * mix.t()[..., None], down).sum(0)

    def _grouped(self, x, weights, flat, counts, cap) -> torch.Tensor:
        gate_up, down = self.stacked()
        k = flat.shape[0] // x.shape[0]
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        expert = flat[order]
        rank = torch.arange(len(flat), device=x.device) - (torch.cumsum(counts, 0) - counts)[expert]
        token = order // k
        batch = x.new_zeros(len(self.experts), cap, x.shape[1])  # [E, C, H]
        batch[expert, rank] = x[token]
        g, u = torch.bmm(batch, gate_up).chunk(2, dim=-1)  # [E, C, I] each
        y = torch.bmm(F.silu(g) * u, down)[expert, rank]  # [n * k, H]
        y = y * weights.reshape(-1)[order, None].to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, y)


class LongcatRouter(nn.Module):
    """LongCat-Flash's router: softmax over routed and zero-computation experts, the correction
    bias added for the choice only, top-k weights scaled (not normalised)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        total = cfg.n_routed_experts + cfg.zero_expert_num
        self.classifier = nn.Linear(cfg.hidden_size, total, bias=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(total))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.classifier.weight.float()).softmax(dim=-1)
        ids = (scores + self.e_score_correction_bias).topk(self.cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
        return scores.gather(1, ids) * self.cfg.routed_scaling_factor, ids


class LongcatMoE(nn.Module):
    """Routed experts plus `zero_expert_num` identity experts (a token routed there keeps its
    input, weighted): the zero-computation experts that let a token spend less compute."""

    def __init__(self, cfg: ModelConfig, settings: Settings | None = None):
        super().__init__()
        settings = snapshot(settings)
        self.router = LongcatRouter(cfg)
        self.experts = nn.ModuleList(
            MLP(cfg.hidden_size, cfg.moe_intermediate_size, settings) for _ in range(cfg.n_routed_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x)
        routed = len(self.experts)  # experts beyond these are identities: zero computation
        return expert_loop(x, weights, ids, lambda e, xs: self.experts[e](xs) if e < routed else xs)


def expert_loop(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, run) -> torch.Tensor:
    """Routed experts by a loop over the experts hit, not over tokens: one `run(expert, rows)` per
    expert on the rows routed to it, weighted and added back (a token picks an expert at most once)."""
    out = torch.zeros_like(x)
    for expert in ids.unique().tolist():
        token, slot = torch.where(ids == expert)
        out.index_add_(0, token, run(expert, x[token]) * weights[token, slot, None].to(x.dtype))
    return out
