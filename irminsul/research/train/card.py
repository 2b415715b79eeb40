"""MODEL_CARD.md for a bundled checkpoint, written from its train_state.json and eval metrics."""

import json
import platform
from pathlib import Path

import torch


def machine(threads: int) -> str:
    return f"{platform.machine()} CPU, {threads} threads, torch {torch.__version__}"


def stage_command(stage: dict) -> str:
    """The `irminsul train-reference` command that runs one recorded stage (a train_state.json, or
    one of its `previous_stages`): every option that shapes the run, from its recorded config, and
    --stop-after where the stage ended before its schedule did."""
    c = stage["config"]
    args = [
        "irminsul train-reference",
        f"--arch {c['arch']}",
        f"--out {c['out']}",
        f"--steps {c['steps']}",
        f"--minutes {c['minutes']:g}",
        f"--seed {c['seed']}",
        f"--threads {c['threads']}",
        f"--lr {c['lr']:g}",
        f"--warmup {c['warmup']}",
        "--phases " + ",".join(f"{n}x{b}:{s:g}" for n, b, s in c["phases"]),
        "--mix " + ",".join(f"{k}={v:g}" for k, v in c["mix"]),
        f"--copy-steps {c['copy_steps']}",
        f"--eval-every {c['eval_every']}",
        f"--attn-weight {c['attn_weight']:g}",
        f"--attn-heads {c['attn_heads']}",
    ]
    if c.get("init"):
        args.append(f"--init {c['init']}")
    if c.get("start_step"):
        args.append(f"--start-step {c['start_step']}")
    if stage["step"] < c["steps"]:
        args.append(f"--stop-after {stage['step']}")
    if not c.get("shape", {}).get("tie_embeddings", True):
        args.append("--untied")
    return " ".join(args)


def train_commands(state: dict) -> list[str]:
    """One command per stage, in the order they ran."""
    return [stage_command(s) for s in [*state.get("previous_stages", []), state]]


def write_card(model_dir: Path, metrics: dict, eval_cmd: str, notes: str = "") -> Path:
    model_dir = Path(model_dir)
    state = json.loads((model_dir / "train_state.json").read_text())
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = cfg["architectures"][0]
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 1e6
    loads = (
        "loads in transformers and in `irminsul.LLM`"
        if "kv_lora_rank" in cfg
        else "loads in transformers; the MLA model's twin for architecture comparisons (the engine serves MLA only)"
    )
    lines = [
        f"# Irminsul reference model: {state['arch'].upper()} ({arch})",
        "",
        "A small model trained from scratch on this project's CPU, so that quality questions (context",
        "dependence of the latent KV at depth, attention sinks, long-context retrieval) are measured on",
        "a model that has learned to attend. It is a test instrument, not a useful assistant.",
        "",
        "## Model",
        "",
        "| | |",
        "|---|---|",
        f"| architecture | `{arch}` ({loads}) |",
        f"| parameters | {state['params'] / 1e6:.2f} M |",
        f"| layers / hidden / heads | {cfg['num_hidden_layers']} / {cfg['hidden_size']} / {cfg['num_attention_heads']} |",
    ]
    if "kv_lora_rank" in cfg:
        lines += [
            f"| MLA | kv_lora_rank {cfg['kv_lora_rank']}, qk_rope_head_dim {cfg['qk_rope_head_dim']}, "
            f"qk_nope_head_dim {cfg['qk_nope_head_dim']}, v_head_dim {cfg['v_head_dim']}, q_lora_rank {cfg['q_lora_rank']} |",
            f"| MoE | layers {cfg['first_k_dense_replace']}..{cfg['num_hidden_layers'] - 1}: {cfg['n_routed_experts']} routed "
            f"experts (top-{cfg['num_experts_per_tok']}) + {cfg['n_shared_experts']} shared, width {cfg['moe_intermediate_size']}; "
            f"layer 0 dense, width {cfg['intermediate_size']} |",
        ]
    else:
        lines += [
            f"| GQA | {cfg['num_key_value_heads']} KV heads, head_dim {cfg.get('head_dim')}, FFN {cfg['intermediate_size']} |"
        ]
    lines += [
        f"| context | {cfg['max_position_embeddings']} tokens, RoPE theta {cfg['rope_parameters']['rope_theta']:g} |",
        f"| vocabulary | {cfg['vocab_size']} (byte-level BPE trained on the training text; chat special tokens and template) |",
        f"| weights | {cfg.get('dtype', cfg.get('torch_dtype'))}, {size:.1f} MB |",
        "",
        "## Training",
        "",
        "| | |",
        "|---|---|",
        f"| steps | {state['step']} of {state['steps']} |",
        f"| training tokens | {state['tokens'] / 1e6:.2f} M (sequence positions, including packed text) |",
        f"| wall time | {state['wall_s'] / 60:.1f} min |",
        f"| machine | {machine(state['config']['threads'])}, shared with other jobs |",
        f"| seed | {state['config']['seed']} |",
        "",
        "Data: tau-bench, BFCL, ToolBench and MuSiQue text from `irminsul/data/` (1 document in 10 held out",
        "by a hash of its text), plus synthetic retrieval tasks built from it: passkey, multi-key lookup,",
        "multi-document span QA, tool-schema lookup, span continuation and random-span copying (loss on",
        "the answer tokens only). Contexts grow "
        f"{' -> '.join(str(p[0]) for p in state['config']['phases'])} over the run. Licences of the sources: see",
        "`irminsul/data/ATTRIBUTION.md`.",
        "",
    ]
    attn = state["config"].get("attn_weight", 0)
    if attn:
        lines += [
            f"Attention supervision (`irminsul/research/train/attention.py`, weight {attn:g}): at the positions that",
            f"predict a copied answer token, heads 0..{state['config']['attn_heads'] - 1} of the last layer get a",
            "cross-entropy loss on their attention to the token's source position, and their summed output,",
            "read through the final norm and the LM head, must predict the token. These are training losses",
            "only; the checkpoint is a plain HF model and the evaluation below sees none of it.",
            "",
        ]
    lines += [
        "Reproduce the training (the stages as `train_state.json` records them, one after the other;",
        "`--stop-after` ends a stage where the recorded one ended; `--minutes` is only a wall-clock guard,",
        "so raise it on a slower machine):",
        "",
        *(f"    {cmd}" for cmd in train_commands(state)),
        "",
        "## Evaluation",
        "",
        "Reproduce every number below:",
        "",
        f"    {eval_cmd}",
        "",
        "Held-out next-token loss (nats/token, windows of 1,024 tokens):",
        "",
        "| source | loss |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v:.3f} |" for k, v in metrics["held_out_loss"].items()]
    for impl in ("transformers", "engine"):
        nd = metrics.get(f"needle/{impl}")
        if not nd:
            continue
        lines += [
            "",
            f"Needle-in-a-haystack recall at full prefill ({impl}; 5-digit passkey in held-out text,",
            "5 depths; greedy decoding must reproduce it exactly):",
            "",
            "| context | recall | answer log-prob/token | n |",
            "|---|---|---|---|",
        ]
        lines += [f"| {n} | {nd['recall'][n]:.2f} | {nd['logprob'][n]:.2f} | {nd['n'][n]} |" for n in nd["recall"]]
        mq = metrics[f"musique/{impl}"]
        lines += [
            "",
            f"Multi-document QA ({impl}):",
            "",
            f"- MuSiQue (real multi-hop questions, gold passages first, 2k-token prompts): exact match "
            f"{mq['exact_match']:.3f}, answer contained {mq['contains']:.3f} (n={mq['n']}); "
            f"held-out questions only: {mq['held_out_exact_match']} (n={mq['held_out_n']})",
        ]
        sy = metrics[f"synthetic/{impl}"]
        lines += [
            "- synthetic tasks on held-out text (exact match of the answer, greedy):",
            "",
            "| task | accuracy | answer log-prob/token | n |",
            "|---|---|---|---|",
        ]
        lines += [f"| {k} | {v['accuracy']:.2f} | {v['logprob']:.2f} | {v['n']} |" for k, v in sy.items()]
    if "engine_vs_transformers_max_abs_logprob_diff" in metrics:
        lines += [
            "",
            f"Engine vs transformers, max |Δ log-prob| on a 512-token probe: "
            f"{metrics['engine_vs_transformers_max_abs_logprob_diff']:.2e}",
        ]
    if notes:
        lines += ["", "## Notes", "", notes]
    path = model_dir / "MODEL_CARD.md"
    path.write_text("\n".join(lines) + "\n")
    return path
