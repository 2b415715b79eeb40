"""Does shifted reuse keep the reference's answers? (paper, Quality)

For each case (`eval/tasks.py`) the first context is prefilled once and registered into an
empty cache of every strategy, exactly as `LLM.generate(first)` would (with an empty cache every
mode computes all of `first`, so the rows are the same). Then each strategy scores the request:

- teacher-forced KL(full ‖ strategy) over the reference answer's tokens, mean and p95;
- argmax agreement with full prefill on those tokens;
- greedy first divergence: full prefill's greedy continuation (`greedy_tokens` long, past EOS) is
  teacher-forced under the strategy; the first position whose argmax differs is where the
  strategy's own greedy decode would leave it;
- task accuracy (needle recall / exact match / answer-token accuracy) and where rows came from.

The reference is full prefill (`off`). Its greedy continuation is decoded after a `prefix`-mode
copy of its own prompt rows, which are bit-identical to full prefill's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from irminsul.engine.build import build_engine
from irminsul.engine.config import EngineConfig
from irminsul.engine.engine import Engine
from irminsul.engine.llm import LLM
from irminsul.engine.sampling import SamplingParams
from irminsul.research.eval import metrics
from irminsul.research.eval.tasks import ShiftedCase


@dataclass(frozen=True)
class Strategy:
    name: str
    reuse: str
    options: tuple = ()  # cache options as (key, value) pairs

    def engine(self, llm: LLM, pool=None) -> Engine:
        """An engine with an empty cache of this strategy, sharing `llm`'s loaded weights (and
        `pool`, when given)."""
        return build_engine(EngineConfig.of(reuse=self.reuse, **dict(self.options)), llm.model, llm.tokenizer, pool)


STRATEGIES = (
    Strategy("off", "off"),
    Strategy("prefix", "prefix"),
    Strategy("naive", "naive"),
    Strategy("pic", "pic"),
    Strategy("pic-nocarve", "pic", (("carve_out", False),)),
    Strategy("pic+r0.05", "pic", (("recompute_ratio", 0.05),)),
    Strategy("pic+r0.15", "pic", (("recompute_ratio", 0.15),)),
)


@dataclass
class CaseScore:
    """One case under one strategy."""

    kl: np.ndarray  # [len(answer)] nats
    agreement: float
    divergence: int
    correct: float
    prompt_tokens: int
    prefix_tokens: int
    reused_tokens: int
    computed_tokens: int
    recomputed_tokens: int = 0
    answer_logprob: float = 0.0  # mean log-prob of the reference answer's tokens


def _answer_logprob(case: ShiftedCase, logprobs: torch.Tensor) -> float:
    return float(logprobs[torch.arange(len(case.answer)), torch.tensor(case.answer)].mean())


def _correct(case: ShiftedCase, logprobs: torch.Tensor) -> float:
    if case.scoring == "exact":
        return float(metrics.exact(case.answer, logprobs))
    return float((logprobs.argmax(-1) == torch.tensor(case.answer)).double().mean())


class QualityRunner:
    """Runs every strategy on a stream of cases; keeps per-case scores."""

    def __init__(self, llm: LLM, strategies=STRATEGIES, greedy_tokens: int = 16, segments: bool = True):
        self.llm, self.greedy_tokens, self.segments = llm, greedy_tokens, segments
        self.strategies = [s for s in strategies if self._supported(s)]
        self.skipped = [s.name for s in strategies if s not in self.strategies]
        self.off = build_engine(EngineConfig.of(reuse="off"), llm.model, llm.tokenizer)
        self.pool = self.off.pool  # every strategy's engine shares it: a case's cached rows exist once
        self.scores: dict[str, dict[str, list[CaseScore]]] = {}  # task -> strategy -> cases
        self.cases: dict[str, list[ShiftedCase]] = {}

    def _supported(self, s: Strategy) -> bool:
        try:
            s.engine(self.llm)
            return True
        except TypeError:  # an engine without this cache option (pic+r)
            return False

    def run_case(self, case: ShiftedCase) -> dict[str, CaseScore]:
        ref = build_engine(EngineConfig.of(reuse="prefix"), self.llm.model, self.llm.tokenizer, self.pool)
        # With segments, the cache restarts chunking at each segment start (S2), as for a chat request.
        fs, ps = (
            (list(case.first_segments) or None, list(case.prompt_segments) or None) if self.segments else (None, None)
        )
        ref_lp, ref_seq = ref.score(case.prompt, case.answer, ps)  # empty cache: full prefill
        g = ref.run(ref.add(case.prompt, SamplingParams(max_tokens=self.greedy_tokens, ignore_eos=True), ps)).output_ids
        ref.close()
        # The first request, computed once; its rows stay in the shared pool while every strategy's
        # cache registers them, as generate(first) would.
        first = self.off.add(case.first, SamplingParams(max_tokens=1), fs)
        self.off.prefill(first)
        first.finish_reason = "length"
        n = len(case.prompt)
        out = {}
        try:
            for s in self.strategies:
                if s.reuse == "off":
                    out[s.name] = CaseScore(
                        np.zeros(len(case.answer)),
                        1.0,
                        len(g),
                        _correct(case, ref_lp),
                        n,
                        0,
                        0,
                        n,
                        answer_logprob=_answer_logprob(case, ref_lp),
                    )
                    continue
                eng = s.engine(self.llm, self.pool)
                eng.kv.offer(first)  # what generate(first) registers
                lp, seq = eng.score(case.prompt, case.answer, ps)
                st = seq.stats
                div = metrics.first_divergence(g, eng.score(case.prompt, g, ps)[0]) if g else 0
                eng.close()
                out[s.name] = CaseScore(
                    metrics.kl_per_token(ref_lp, lp).numpy(),
                    metrics.argmax_agreement(ref_lp, lp),
                    div,
                    _correct(case, lp),
                    st.prompt_tokens,
                    st.prefix_tokens,
                    st.reused_tokens,
                    st.computed_tokens,
                    getattr(st, "recomputed_tokens", 0),
                    _answer_logprob(case, lp),
                )
        finally:
            self.off.finish(first)
        return out

    def run(self, cases: dict[str, list[ShiftedCase]], progress: bool = True) -> None:
        total = sum(map(len, cases.values()))
        bar = tqdm(total=total, desc="eval quality", disable=not progress, mininterval=2)
        for task, items in cases.items():
            self.cases[task] = items
            per = self.scores.setdefault(task, {s.name: [] for s in self.strategies})
            for case in items:
                for name, score in self.run_case(case).items():
                    per[name].append(score)
                bar.update()
        bar.close()


DELTA_BINS = (0, 32, 128, 512)  # |delta| bin lower edges
DEPTH_BINS = (0, 64, 256, 512)


def _bin(x: int, edges) -> str:
    lo = max(e for e in edges if e <= abs(x))
    i = edges.index(lo)
    return f"{lo}+" if i == len(edges) - 1 else f"{lo}-{edges[i + 1]}"


def summarize(scores: list[CaseScore]) -> dict:
    kl = np.concatenate([s.kl for s in scores])
    prompt = np.array([s.prompt_tokens for s in scores], dtype=float)
    return {
        "kl_mean": float(kl.mean()),
        "kl_p95": metrics.p95(kl),
        "argmax_agreement": float(np.mean([s.agreement for s in scores])),
        "first_divergence": float(np.mean([s.divergence for s in scores])),
        "accuracy": float(np.mean([s.correct for s in scores])),
        "answer_logprob": float(np.mean([s.answer_logprob for s in scores])),
        "reused_fraction": float(np.mean([(s.prefix_tokens + s.reused_tokens) / s.prompt_tokens for s in scores])),
        "content_reused_fraction": float(np.mean([s.reused_tokens / s.prompt_tokens for s in scores])),
        "computed_tokens": float(np.mean([s.computed_tokens for s in scores])),
        "recomputed_tokens": float(np.mean([s.recomputed_tokens for s in scores])),
        "prompt_tokens": float(prompt.mean()),
        "n": len(scores),
        "kl_mean_ci": metrics.bootstrap_ci([s.kl.mean() for s in scores]).as_dict(),
    }


@dataclass
class QualityResult:
    tasks: dict  # task -> strategy -> summary
    sweep: dict  # task -> {"delta"|"depth": bin -> strategy -> kl_mean}
    targets: dict
    skipped: list = field(default_factory=list)
    setup: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "tasks": self.tasks,
            "sweep": self.sweep,
            "targets": self.targets,
            "skipped_strategies": self.skipped,
            "setup": self.setup,
        }

    def table(self) -> str:
        from irminsul.table import table

        rows = []
        for task, per in self.tasks.items():
            for name, s in per.items():
                rows.append(
                    [
                        task,
                        name,
                        f"{s['kl_mean']:.4g}",
                        f"{s['kl_p95']:.4g}",
                        f"{s['argmax_agreement']:.3f}",
                        f"{s['first_divergence']:.1f}",
                        f"{s['accuracy']:.3f}",
                        f"{s['answer_logprob']:.3f}",
                        f"{100 * s['reused_fraction']:.1f}%",
                        f"{s['computed_tokens']:.0f}",
                    ]
                )
        out = table(
            [
                "task",
                "strategy",
                "KL mean",
                "KL p95",
                "argmax agr.",
                "first div.",
                "accuracy",
                "answer lp",
                "reused",
                "computed",
            ],
            rows,
        )
        lines = [out, ""]
        for task, t in self.targets.items():
            lines.append(f"{task}: " + "; ".join(f"{k} = {v['text']}" for k, v in t.items()))
        return "\n".join(lines)

    def plot(self, path: Path) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        tasks = list(self.tasks)
        fig, axes = plt.subplots(2, len(tasks) + 1, figsize=(4.6 * (len(tasks) + 1), 7.5), squeeze=False)
        names = list(next(iter(self.tasks.values())))
        x = np.arange(len(tasks))
        width = 0.8 / len(names)
        for row, (key, title) in enumerate(
            (("kl_mean", "teacher-forced KL(full ‖ strategy), nats/token"), ("accuracy", "task accuracy"))
        ):
            ax = axes[row, 0]
            for k, name in enumerate(names):
                ax.bar(x - 0.4 + width * (k + 0.5), [self.tasks[t][name][key] for t in tasks], width, label=name)
            ax.set_xticks(x, tasks)
            ax.set_title(title, fontsize=9)
            ax.legend(fontsize=6)
        for col, task in enumerate(tasks, start=1):
            for row, key in enumerate(("delta", "depth")):
                ax, bins = axes[row, col], list(self.sweep[task][key])
                for name in ("naive", "pic", "pic-nocarve", "pic+r0.05", "pic+r0.15"):
                    if name in names:
                        ax.plot(
                            bins,
                            [self.sweep[task][key][b].get(name, np.nan) for b in bins],
                            marker="o",
                            label=name,
                            alpha=0.8,
                        )
                label = "|shift δ|" if key == "delta" else "depth of the cached copy"
                ax.set(xlabel=f"{label} (tokens)", ylabel="KL mean")
                ax.set_title(f"{task}: KL by {label}", fontsize=9)
                ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


def _targets(runner: QualityRunner, summary: dict) -> dict:
    """The issue's two checks: pic recall = off within noise; pic KL >= 22% below naive."""
    out = {}
    for task, per in runner.scores.items():
        t = {}
        if "pic" in per and "naive" in per:
            pic_kl = np.array([s.kl.mean() for s in per["pic"]])
            naive_kl = np.array([s.kl.mean() for s in per["naive"]])
            pooled = 1 - summary[task]["pic"]["kl_mean"] / max(summary[task]["naive"]["kl_mean"], 1e-300)
            ci = metrics.bootstrap_ci(
                np.stack([pic_kl, naive_kl], 1), lambda v: 1 - v[:, 0].mean() / max(v[:, 1].mean(), 1e-300)
            )
            t["kl_reduction_pic_vs_naive"] = {
                "value": pooled,
                "ci": ci.as_dict(),
                "target": 0.22,
                "met": bool(pooled >= 0.22),
                "text": f"{100 * pooled:.1f}% (95% CI {100 * ci.low:.1f}..{100 * ci.high:.1f}%; target >= 22%)",
            }
        if "pic" in per and "off" in per:
            off = np.array([s.correct for s in per["off"]])
            pic = np.array([s.correct for s in per["pic"]])
            diff = metrics.bootstrap_ci(pic - off)
            w_off = metrics.wilson(int(off.sum()), len(off)) if set(off) <= {0.0, 1.0} else None
            w_pic = metrics.wilson(int(pic.sum()), len(pic)) if set(pic) <= {0.0, 1.0} else None
            t["accuracy_pic_minus_off"] = {
                "value": diff.value,
                "ci": diff.as_dict(),
                "within_noise": bool(diff.low <= 0 <= diff.high),
                "off": w_off.as_dict() if w_off else {"value": float(off.mean())},
                "pic": w_pic.as_dict() if w_pic else {"value": float(pic.mean())},
                "text": (
                    f"{diff.value:+.3f} (95% CI {diff.low:+.3f}..{diff.high:+.3f}); off {w_off or f'{off.mean():.3f}'}, "
                    f"pic {w_pic or f'{pic.mean():.3f}'}"
                ),
            }
        out[task] = t
    return out


def result(runner: QualityRunner) -> QualityResult:
    summary = {task: {name: summarize(sc) for name, sc in per.items()} for task, per in runner.scores.items()}
    sweep = {}
    for task, per in runner.scores.items():
        cases = runner.cases[task]
        sweep[task] = {}
        for key, edges, attr in (("delta", DELTA_BINS, "delta"), ("depth", DEPTH_BINS, "depth")):
            bins: dict[str, dict[str, list[float]]] = {}
            for i, case in enumerate(cases):
                b = _bin(getattr(case, attr), edges)
                for name, sc in per.items():
                    bins.setdefault(b, {}).setdefault(name, []).append(float(sc[i].kl.mean()))
            order = sorted(bins, key=lambda b: int(b.split("-")[0].rstrip("+")))
            sweep[task][key] = {
                b: {name: float(np.mean(v)) for name, v in bins[b].items()} | {"n": len(next(iter(bins[b].values())))}
                for b in order
            }
    return QualityResult(summary, sweep, _targets(runner, summary), runner.skipped)


def run_quality(
    model: str | Path,
    cases: dict[str, list[ShiftedCase]],
    strategies=STRATEGIES,
    greedy_tokens: int = 16,
    progress: bool = True,
    dtype: str = "float32",
    segments: bool = True,
) -> QualityResult:
    runner = QualityRunner(LLM(model, dtype=dtype, compile_decode=False), strategies, greedy_tokens, segments)
    runner.run(cases, progress)
    return result(runner)
