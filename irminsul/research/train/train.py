"""Trainer of the reference models: a length curriculum over real text plus retrieval tasks.

Each sequence of length L is either plain text (next-token loss on every token) or retrieval
examples packed back to back (loss on the answer tokens only), topped up with text. The losses are
averaged separately and added, so a few answer tokens weigh as much as thousands of text tokens
(calibration: with the loss on every token, retrieval stayed at chance while the model
memorised the filler). Attention supervision (`attention.py`) adds two losses on a few heads at
the answer positions. Contexts grow 256 -> 2048 over the run; the schedule is a function of the
step, so `--seed` and `--steps` reproduce a run. The defaults are the bundled models' recipe;
their step count is in their model cards.
"""

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from irminsul.model.chat_format import BOS
from irminsul.research.train import retrieval, tasks
from irminsul.research.train.arch import ReferenceShape, build_model, hf_config
from irminsul.research.train.attention import HeadProbe
from irminsul.research.train.checkpoint import max_reload_error, save_checkpoint
from irminsul.research.train.data import Corpus
from irminsul.research.train.tokenizer import train_tokenizer


@dataclass(frozen=True)
class TrainConfig:
    arch: str = "mla"
    out: str = "runs/mla"
    steps: int | None = None  # None: fit the run to `minutes` by timing a few steps first
    minutes: float = 75.0  # wall-clock guard (and the target when steps is None)
    seed: int = 0
    threads: int = 2
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup: int = 60
    weight_decay: float = 0.1
    # (sequence length, batch size, share of steps): short contexts first so copying forms early
    phases: tuple = ((256, 8, 0.4), (512, 4, 0.2), (1024, 2, 0.2), (2048, 1, 0.2))
    retrieval_share: float = 0.8  # fraction of sequences that carry a retrieval example
    mix: tuple = (("passkey", 0.4), ("kv", 0.2), ("copy", 0.1), ("repeat", 0.1), ("doc_qa", 0.1), ("tool", 0.1))
    # Retrieval examples are all `copy` for the first steps (an induction-first curriculum; without
    # attention supervision 1,300 such steps did not form induction heads, with it none are needed)
    copy_steps: int = 0
    # attention supervision (train/attention.py): weight of the attention and copy losses on the
    # probe heads at answer positions; 0 turns it off. Layer -1 is the last layer.
    attn_weight: float = 1.0
    attn_layer: int = -1
    attn_heads: int = 4  # heads 0 .. attn_heads-1 of that layer
    eval_every: int = 250
    ckpt_minutes: float = 10.0
    data: str | None = None
    init: str | None = None  # start from this checkpoint's weights (a second stage) instead of `seed`
    stop_after: int | None = None  # stop (and save) after this many steps of the `steps` schedule
    # resume the `steps` schedule at this step (with `init`: finish a run that a wall-clock guard
    # stopped; the optimizer state starts fresh, tokens and wall time carry over from `init`)
    start_step: int = 0
    shape: ReferenceShape = field(default_factory=ReferenceShape)

    def __post_init__(self):
        assert self.arch in ("mla", "gqa", "v4"), self.arch
        if self.arch == "v4" and self.attn_weight:
            from irminsul.errors import UserFacingError

            raise UserFacingError("--arch v4 trains without attention supervision: pass --attn-weight 0")
        assert abs(sum(p[2] for p in self.phases) - 1) < 1e-6
        assert max(p[0] for p in self.phases) <= self.shape.max_positions

    def phase(self, step: int, steps: int) -> tuple[int, int]:
        acc = 0.0
        for length, batch, share in self.phases:
            acc += share
            if step < acc * steps:
                return length, batch
        return self.phases[-1][:2]

    def lr_at(self, step: int, steps: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        t = (step - self.warmup) / max(1, steps - self.warmup)
        return self.lr * (self.min_lr_frac + (1 - self.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


class Batches:
    """Deterministic batches: `get(step)` depends only on (seed, step)."""

    def __init__(self, cfg: TrainConfig, tok, pool: tasks.TokenPool, lm_docs: dict[str, list[str]]):
        self.cfg, self.tok, self.pool = cfg, tok, pool
        bos = tok.token_to_id(BOS)
        self.stream = np.concatenate(
            [np.array([bos] + e.ids, dtype=np.int32) for texts in lm_docs.values() for e in tok.encode_batch(texts)]
        )  # all training text, documents separated by BOS
        self.mix = dict(cfg.mix)

    def text(self, rng, n: int) -> list[int]:
        start = int(rng.integers(0, len(self.stream) - n))
        return self.stream[start : start + n].tolist()

    def get(self, step: int, length: int, batch: int):
        """(inputs, targets, text mask, answer mask, source) for one step; `source[b, t]` is the
        position an answer token predicted at t was copied from, or -1."""
        rng = np.random.default_rng([self.cfg.seed, step])
        x = np.zeros((batch, length + 1), dtype=np.int64)
        lm = np.zeros((batch, length + 1), dtype=bool)  # position predicts a text token
        ans = np.zeros((batch, length + 1), dtype=bool)  # position predicts an answer token
        src = np.full((batch, length + 1), -1, dtype=np.int64)
        copying = step < self.cfg.copy_steps
        lo = 64 if copying else max(64, length // 4)
        for b in range(batch):
            ids: list[int] = []
            # a retrieval sequence packs examples back to back (several answers per sequence)
            retrieval = copying or rng.random() < self.cfg.retrieval_share
            while len(ids) < length + 1:
                room = length + 1 - len(ids)
                ex = None
                if retrieval and room >= lo:
                    n = int(rng.integers(lo, room + 1))
                    ex = tasks.sample_example(self.pool, rng, n, {"copy": 1.0} if copying else self.mix)
                    ex = ex if len(ex.ids) <= room else None  # never train on a cut-off answer
                if ex is None:
                    text = [self.tok.token_to_id(BOS)] + self.text(rng, room) if ids else self.text(rng, room)
                    lm[b, len(ids) + 1 : len(ids) + room] = True
                    ids += text[:room]
                    break
                at = len(ids) + len(ex.prompt_ids)
                ans[b, at : len(ids) + len(ex.ids)] = True
                if ex.sources is not None:
                    src[b, at : at + ex.answer_len] = [len(ids) + i for i in ex.sources]
                ids += ex.ids
            x[b] = ids
        # position t predicts token t+1: shift masks by one
        return (
            torch.from_numpy(x[:, :-1]),
            torch.from_numpy(x[:, 1:]),
            torch.from_numpy(lm[:, 1:]),
            torch.from_numpy(ans[:, 1:]),
            torch.from_numpy(src[:, 1:]),
        )


def losses(model, x, y, lm_mask, ans_mask):
    """(mean text loss, mean answer loss); the LM head runs only where a loss is taken.
    A `HeadProbe` on the model records the probe head's scores during this forward pass."""
    hidden = model.model(input_ids=x).last_hidden_state  # [B, L, H]
    keep = lm_mask | ans_mask
    nll = F.cross_entropy(model.lm_head(hidden[keep]).float(), y[keep], reduction="none")  # [n_keep]
    lm, ans = lm_mask[keep], ans_mask[keep]
    zero = hidden.new_zeros(())
    return (nll[lm].mean() if lm.any() else zero), (nll[ans].mean() if ans.any() else zero)


class Probes:
    """Fixed held-out probes: answer log-prob per task and context length, held-out loss per source."""

    def __init__(self, cfg: TrainConfig, tok, held: tasks.TokenPool):
        rng = np.random.default_rng(10_000 + cfg.seed)
        self.examples = {}
        for n in (256, 512, 1024, 2048):
            self.examples[f"passkey@{n}"] = [
                tasks.passkey(held, rng, n, depth=d, n_digits=5) for d in (0.1, 0.4, 0.7, 0.95)
            ]
        for kind in ("copy", "repeat", "kv", "doc_qa", "tool"):
            self.examples[f"{kind}@512"] = [tasks.BUILDERS[kind](held, rng, 512) for _ in range(4)]
        self.windows = {}
        bos = tok.token_to_id(BOS)
        for src, docs in held.docs.items():
            stream = np.concatenate([np.concatenate([[bos], d]) for d in docs]).astype(np.int64)
            starts = np.linspace(0, max(0, len(stream) - 513), 4).astype(int)
            self.windows[src] = torch.tensor(np.stack([stream[s : s + 513] for s in starts]))

    @torch.no_grad()
    def run(self, model) -> dict:
        model.eval()
        score = retrieval.hf_score(model)
        out = {}
        for name, exs in self.examples.items():
            s = retrieval.score_examples(score, exs)
            out[f"lp/{name}"] = float(np.mean([p.logprob for p in s]))
            out[f"acc/{name}"] = retrieval.accuracy(s)
        for src, w in self.windows.items():
            logits = model(input_ids=w[:, :-1]).logits
            out[f"heldout/{src}"] = float(F.cross_entropy(logits.flatten(0, 1).float(), w[:, 1:].flatten()))
        model.train()
        return out


def plot(log: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    tr = [r for r in log if "lm" in r]
    ev = [r for r in log if "eval" in r]
    axes[0].plot([r["step"] for r in tr], [r["lm"] for r in tr], lw=0.6, label="text loss")
    axes[0].plot([r["step"] for r in tr], [r["ans"] for r in tr], lw=0.6, label="answer loss")
    axes[0].set(title="training loss", xlabel="step", ylim=(0, None))
    for key in sorted({k for r in ev for k in r["eval"] if k.startswith("lp/")}):
        axes[1].plot([r["step"] for r in ev], [r["eval"][key] for r in ev], marker=".", label=key[3:])
    axes[1].axhline(-math.log(10), color="gray", ls=":", label="chance over digits")
    axes[1].set(title="held-out answer log-prob / token", xlabel="step")
    for key in sorted({k for r in ev for k in r["eval"] if k.startswith("heldout/")}):
        axes[2].plot([r["step"] for r in ev], [r["eval"][key] for r in ev], marker=".", label=key[8:])
    axes[2].set(title="held-out text loss per source", xlabel="step")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:  # a panel may be empty early in a run
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _time_steps(cfg, model, batches) -> float:
    """Seconds for the whole schedule per step, measured on 2 steps of each phase."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    per = 0.0
    for length, batch, share in cfg.phases:
        times = []
        for i in range(2):
            x, y, lm, ans, _ = batches.get(10**9 + i, length, batch)
            t = time.time()
            lm_loss, ans_loss = losses(model, x, y, lm, ans)
            (lm_loss + ans_loss).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.time() - t)
        per += share * min(times)
    return per


def train(cfg: TrainConfig) -> Path:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(cfg.threads)
    t0 = time.time()
    corpus = Corpus.load(cfg.data)
    tok = train_tokenizer(corpus.all_train_text())
    pool = tasks.TokenPool(tok, corpus.train, corpus.tools_train, corpus.words)
    held = tasks.TokenPool(tok, corpus.held_out, corpus.tools_held_out, corpus.words)
    batches = Batches(cfg, tok, pool, corpus.train)
    probes = Probes(cfg, tok, held)
    config = hf_config(cfg.arch, tok, cfg.shape)

    steps = cfg.steps
    if steps is None:
        torch.manual_seed(cfg.seed)
        per_step = _time_steps(cfg, build_model(config), batches)
        steps = int(cfg.minutes * 60 * 0.9 / per_step)  # 10% for evals and checkpoints
        tqdm.write(
            f"timed {per_step:.2f} s/step -> {steps} steps for {cfg.minutes} min (reproduce with --steps {steps})"
        )
    if cfg.start_step >= steps:
        from irminsul.errors import UserFacingError

        raise UserFacingError(
            f"--start-step {cfg.start_step} is at or past the schedule's end (--steps {steps}): "
            f"nothing is left to train"
        )
    torch.manual_seed(cfg.seed)
    if cfg.init:
        from irminsul.research.train.checkpoint import load_checkpoint

        model = load_checkpoint(cfg.init).train()
        assert model.config.vocab_size == tok.get_vocab_size(), "the init checkpoint has another vocabulary"
    else:
        model = build_model(config).train()
    probe = (
        HeadProbe(model, cfg.attn_layer % cfg.shape.layers, tuple(range(cfg.attn_heads))) if cfg.attn_weight else None
    )
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    tqdm.write(
        f"{cfg.arch}: {n_params / 1e6:.2f} M params, vocab {tok.get_vocab_size()}, {steps} steps, "
        f"{len(batches.stream) / 1e6:.2f} M text tokens; setup {time.time() - t0:.0f} s"
    )

    log: list[dict] = []
    logf = (out / "log.jsonl").open("w")
    tokens, last_ckpt, t_train = 0, time.time(), time.time()
    prior = {}
    if cfg.init and (Path(cfg.init) / "train_state.json").exists():
        prior = json.loads((Path(cfg.init) / "train_state.json").read_text())
        tokens = prior.get("tokens", 0)
    state = {}

    def record(r):
        log.append(r)
        logf.write(json.dumps(r) + "\n")
        logf.flush()

    def snapshot(dir_name):
        state.update(
            arch=cfg.arch,
            step=step + 1,
            steps=steps,
            tokens=tokens,
            params=n_params,
            wall_s=round(time.time() - t_train) + prior.get("wall_s", 0),
            config=_jsonable(asdict(cfg)) | {"steps": steps},
        )
        if prior:
            state["previous_stages"] = prior.get("previous_stages", []) + [
                {k: prior[k] for k in ("step", "steps", "tokens", "wall_s", "config") if k in prior}
            ]
        save_checkpoint(model, tok, out / dir_name, state)
        plot(log, out / "loss_curve.png")

    bar = tqdm(range(cfg.start_step, steps), desc=f"train {cfg.arch}", mininterval=5)
    for step in bar:
        length, batch = cfg.phase(step, steps)
        for g in opt.param_groups:
            g["lr"] = cfg.lr_at(step, steps)
        x, y, lm_mask, ans_mask, src = batches.get(step, length, batch)
        if probe:
            probe.target(src)
        lm_loss, ans_loss = losses(model, x, y, lm_mask, ans_mask)
        attn_loss = probe.attention_loss() if probe else torch.zeros(())
        copy_loss = probe.copy_loss(y) if probe else torch.zeros(())
        (lm_loss + ans_loss + cfg.attn_weight * (attn_loss + copy_loss)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += x.numel()
        extra = {}
        if probe:
            mass = probe.mass()
            extra = {
                "attn": round(attn_loss.item(), 4),
                "copy": round(copy_loss.item(), 4),
                **({"mass": round(mass, 4)} if mass is not None else {}),
            }
            probe.target(None)  # the probes and checkpoints below run the model without targets
        record(
            {
                "step": step,
                "len": length,
                "lm": round(lm_loss.item(), 4),
                "ans": round(ans_loss.item(), 4),
                **extra,
                "lr": opt.param_groups[0]["lr"],
                "tokens": tokens,
                "t": round(time.time() - t_train, 1),
            }
        )
        bar.set_postfix(
            len=length,
            lm=f"{lm_loss.item():.2f}",
            ans=f"{ans_loss.item():.2f}",
            **({"mass": f"{extra['mass']:.2f}"} if "mass" in extra else {}),
            refresh=False,
        )
        if (step + 1) % cfg.eval_every == 0 or step + 1 == steps:
            ev = probes.run(model)
            record({"step": step, "eval": ev, "t": round(time.time() - t_train, 1)})
            tqdm.write(
                f"step {step + 1} len {length} tokens {tokens / 1e6:.2f}M | answer lp (acc): "
                + " ".join(f"{k[3:]}={v:.2f}({ev['acc/' + k[3:]]:.2f})" for k, v in ev.items() if k.startswith("lp/"))
            )
            tqdm.write(
                "  held-out loss: " + " ".join(f"{k[8:]}={v:.2f}" for k, v in ev.items() if k.startswith("heldout/"))
            )
            state["eval"] = ev
            plot(log, out / "loss_curve.png")
        if time.time() - last_ckpt > cfg.ckpt_minutes * 60:
            snapshot("latest")
            last_ckpt = time.time()
        if cfg.stop_after is not None and step + 1 >= cfg.stop_after:
            break
        if time.time() - t0 > cfg.minutes * 60 * 1.25:
            tqdm.write(f"wall-clock guard hit at step {step + 1}/{steps}; stopping early")
            break
    if probe:
        probe.remove()
    snapshot("final")
    err = max_reload_error(model, out / "final", probes.examples["passkey@512"][0].ids)
    tqdm.write(f"saved {out / 'final'}; reload max |Δ log-prob| = {err:.2e}")
    return out / "final"


def _jsonable(d):
    return json.loads(json.dumps(d, default=lambda o: o.__dict__ if hasattr(o, "__dict__") else str(o)))
