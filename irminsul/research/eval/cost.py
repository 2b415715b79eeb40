"""What a cache hit saves, per request, against a miss (paper: prefill energy
saved per hit, NVML-measured: GQA 86%, MLA 63%).

A request of N tokens is a header (different in each request: computed), a shared span (the hit:
reused, except rows at positions < 32, which the sink carve-out computes) and a tail (the new
question: computed). A miss computes all N. The accounting (`accounting.py`) counts the FLOPs of
both passes from the model config and models the bytes they move; a hit also copies its reused
rows (read + write) and corrects them: MLA rotates k_r (64 of 576 values per row in DeepSeek),
GQA rotates its whole K (every KV head, every dim), 3 FLOPs per rotated value (a·c − b·s,
b·c + a·s per pair) and a read + write of the rotated values.

Energy = FLOPs · pJ/FLOP + bytes · pJ/byte (`EnergyModel`, assumptions in its docstring).
Wall time is measured on this CPU for the bundled models (`timing.py`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from irminsul.research.eval.accounting import Arch, Pass, forward_bytes, forward_flops

SINK = 32  # the sink carve-out: rows at positions < 32 are always computed (docs/design.md §3.4)
PAPER = {"mla": 0.63, "gqa": 0.86}


@dataclass(frozen=True)
class EnergyModel:
    """Energy per FLOP and per byte of off-chip traffic, for a bf16 accelerator.

    pj_per_flop 0.7: an H100 SXM at its 700 W board limit running 989 dense bf16 TFLOP/s spends
        0.71 pJ per FLOP (board level, so it includes on-chip data movement and static power).
    pj_per_byte 31: HBM2 access energy ~3.9 pJ/bit (O'Connor et al., "Fine-Grained DRAM", MICRO
        2017), i.e. ~31 pJ per byte read or written.
    Idle power and host work are not modelled; the paper's NVML numbers include them.
    """

    pj_per_flop: float = 0.7
    pj_per_byte: float = 31.0

    def joules(self, flops: float, nbytes: float) -> float:
        return (flops * self.pj_per_flop + nbytes * self.pj_per_byte) * 1e-12


@dataclass(frozen=True)
class Scenario:
    prompt_tokens: int
    header_tokens: int
    shared_tokens: int
    carve_out: bool = True

    @classmethod
    def of(cls, prompt_tokens: int, shared_fraction: float = 0.875) -> Scenario:
        """The shared span in the middle; header and tail split the rest evenly."""
        shared = int(round(prompt_tokens * shared_fraction))
        return cls(prompt_tokens, (prompt_tokens - shared) // 2, shared)

    def computed(self) -> np.ndarray:
        h, s, n = self.header_tokens, self.shared_tokens, self.prompt_tokens
        pos = np.r_[np.arange(h), np.arange(h + s, n)]
        if self.carve_out:
            pos = np.union1d(pos, np.arange(h, min(h + s, SINK)))
        return np.union1d(pos, [n - 1])  # the last prompt token is always computed (its logits)

    @property
    def reused(self) -> int:
        return self.prompt_tokens - len(self.computed())


def hit_vs_miss(a: Arch, sc: Scenario, energy: EnergyModel = EnergyModel(), dtype_bytes: int = 2) -> dict:
    miss = Pass.causal(np.arange(sc.prompt_tokens))
    hit = Pass.causal(sc.computed())
    f_miss, f_hit = forward_flops(a, miss), forward_flops(a, hit)
    b_miss, b_hit = forward_bytes(a, miss, dtype_bytes), forward_bytes(a, hit, dtype_bytes)
    r = sc.reused
    copy_bytes = 2.0 * r * a.layers * a.row_values * dtype_bytes
    rotate_bytes = 2.0 * r * a.layers * a.rotated_values * dtype_bytes
    rotate_flops = 3.0 * r * a.layers * a.rotated_values
    flops_hit = f_hit["total"] + rotate_flops
    bytes_hit = b_hit["total"] + copy_bytes + rotate_bytes
    e_miss, e_hit = energy.joules(f_miss["total"], b_miss["total"]), energy.joules(flops_hit, bytes_hit)
    return {
        "arch": a.kind,
        "flops_saved_fraction": 1 - flops_hit / f_miss["total"],
        "bytes_moved_per_hit": bytes_hit,
        "bytes_moved_per_miss": b_miss["total"],
        "bytes_saved_fraction": 1 - bytes_hit / b_miss["total"],
        "energy_saved_fraction": 1 - e_hit / e_miss,
        "energy_j_per_hit": e_hit,
        "energy_j_per_miss": e_miss,
        "flops_per_hit": flops_hit,
        "flops_per_miss": f_miss["total"],
        "hit_flops_breakdown": {k: v for k, v in f_hit.items() if k != "total"} | {"rotation": rotate_flops},
        "hit_bytes_breakdown": {k: v for k, v in b_hit.items() if k != "total"}
        | {"copy": copy_bytes, "rotate": rotate_bytes},
        "reused_tokens": r,
        "computed_tokens": len(sc.computed()),
        "correction_per_reused_token": correction(a, dtype_bytes),
        "paper_energy_saved": PAPER.get(a.kind),
        "scenario": asdict(sc),
    }


def correction(a: Arch, dtype_bytes: int = 2) -> dict:
    """What fixing one reused token's rows costs: MLA rotates k_r only, GQA its whole K."""
    return {
        "rotated_values_per_layer": a.rotated_values,
        "row_values_per_layer": a.row_values,
        "rotated_fraction_of_row": a.rotated_values / a.row_values,
        "flops": 3 * a.rotated_values * a.layers,
        "bytes": 2 * a.rotated_values * a.layers * dtype_bytes,
        "copied_bytes": 2 * a.row_values * a.layers * dtype_bytes,
    }


@dataclass
class CostResult:
    models: dict  # name -> hit_vs_miss(...) (+ "wall_time")
    energy: EnergyModel
    sweep: dict  # name -> {shared_fraction: energy_saved_fraction}

    def to_json(self) -> dict:
        return self.models | {"energy_model": asdict(self.energy), "sweep": self.sweep}

    def table(self) -> str:
        from irminsul.table import table

        rows = []
        for name, m in self.models.items():
            wt = m.get("wall_time")
            c = m["correction_per_reused_token"]
            rows.append(
                [
                    name,
                    f"{m['scenario']['prompt_tokens']}",
                    f"{m['reused_tokens']}",
                    f"{100 * m['flops_saved_fraction']:.1f}%",
                    f"{100 * m['bytes_saved_fraction']:.1f}%",
                    f"{m['bytes_moved_per_hit'] / 1e6:,.1f} MB",
                    f"{100 * m['energy_saved_fraction']:.1f}%",
                    f"{100 * m['paper_energy_saved']:.0f}%" if m["paper_energy_saved"] else "-",
                    f"{100 * wt['saved_fraction']:.1f}% ({wt['miss_s'] * 1e3:.0f}→{wt['hit_s'] * 1e3:.0f} ms)"
                    if wt
                    else "-",
                    f"{c['rotated_values_per_layer']}/{c['row_values_per_layer']} · {c['flops']:,} FLOP",
                ]
            )
        return table(
            [
                "model",
                "prompt",
                "reused",
                "FLOPs saved",
                "bytes saved",
                "bytes/hit",
                "energy saved",
                "paper",
                "wall time saved (CPU)",
                "correction/token (values · FLOPs)",
            ],
            rows,
        )

    def plot(self, path: Path) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.2))
        for name, curve in self.sweep.items():
            xs = sorted(curve)
            ax0.plot(xs, [100 * curve[x] for x in xs], marker="o", label=name)
        for kind, v in PAPER.items():
            ax0.axhline(100 * v, ls=":", color="gray")
            ax0.text(0.5, 100 * v + 1, f"paper {kind.upper()} {100 * v:.0f}%", fontsize=7, color="gray")
        ax0.set(
            xlabel="shared (reused) fraction of the prompt",
            ylabel="energy saved per hit (%)",
            title="modelled prefill energy saved by a hit",
        )
        ax0.legend(fontsize=7)
        names = list(self.models)
        x = np.arange(len(names))
        for k, key in enumerate(("flops_saved_fraction", "bytes_saved_fraction", "energy_saved_fraction")):
            ax1.bar(x - 0.3 + 0.2 * k + 0.1, [100 * self.models[n][key] for n in names], 0.2, label=key[:-15])
        timed = [i for i, n in enumerate(names) if "wall_time" in self.models[n]]
        ax1.scatter(
            x[timed],
            [100 * self.models[names[i]]["wall_time"]["saved_fraction"] for i in timed],
            color="black",
            zorder=3,
            label="wall time (CPU, measured)",
        )
        ax1.set_xticks(x, names, rotation=15, fontsize=7)
        ax1.set(ylabel="% saved per hit", title="hit vs miss at the default scenario")
        ax1.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


def run_cost(
    archs: dict[str, Arch],
    prompt_tokens: dict[str, int],
    shared_fraction: float = 0.875,
    energy: EnergyModel = EnergyModel(),
    timings: dict | None = None,
) -> CostResult:
    models, sweep = {}, {}
    for name, a in archs.items():
        models[name] = hit_vs_miss(a, Scenario.of(prompt_tokens[name], shared_fraction), energy)
        if timings and name in timings:
            t = timings[name]
            models[name]["wall_time"] = asdict(t) | {"saved_fraction": t.saved_fraction}
        sweep[name] = {
            f: hit_vs_miss(a, Scenario.of(prompt_tokens[name], f), energy)["energy_saved_fraction"]
            for f in (0.25, 0.5, 0.75, 0.875, 0.95)
        }
    return CostResult(models, energy, sweep)
