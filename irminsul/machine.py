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


def describe() -> str:
    """One line: OS, CPU, cores, Python and torch versions."""
    try:
        import torch

        extra = f", torch {torch.__version__} ({torch.get_num_threads()} threads)"
    except ImportError:
        extra = ""
    return (f"{platform.platform()} | {cpu_model()} | {os.cpu_count()} cores | "
            f"python {platform.python_version()}{extra}")


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
