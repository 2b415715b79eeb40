"""What a benchmark ran on, and a noise-resistant timer: these machines are shared and noisy."""

from __future__ import annotations

import functools
import os
import platform
import time
from collections.abc import Callable


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo's first "flags" line; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


# the instruction sets that decide which kernels run, in the order they grow
ISA_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "asimd",
    "sve",
)


def instruction_sets() -> str:
    """The vector instruction sets this CPU has among ISA_FLAGS, space-separated ("" where unknown)."""
    flags = cpu_flags()
    return " ".join(f for f in ISA_FLAGS if f in flags)


def describe() -> str:
    """One line: OS, CPU, its instruction sets, cores, Python and torch versions (and torch's threads)."""
    try:
        import torch

        extra = f", torch {torch.__version__} ({torch.get_num_threads()} threads)"
    except ImportError:
        extra = ""
    return (
        f"{platform.platform()} | {cpu_model()} [{instruction_sets() or 'instruction sets unknown'}] | "
        f"{os.cpu_count()} cores | "
        f"python {platform.python_version()}{extra}"
    )


def median_of(fn: Callable[[], object], repeats: int = 5) -> float:
    """Median wall time of `repeats` calls after one untimed call, in seconds."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[repeats // 2]


def best_of(fn: Callable[[], object], repeats: int = 3) -> float:
    """Best wall time of `repeats` calls, in seconds (the minimum is the least noisy estimate)."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best
