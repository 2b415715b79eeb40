"""How many threads each kind of step runs on: measured while the engine runs, on the machine it runs on.

A CPU engine is given some threads (`irminsul serve --threads`, else torch's default: the cores it
sees). A prefill or a large batch splits well over them; a decode step of a few sequences of a
small model is mostly fixed costs per operation, where a second thread only adds the cost of
starting and joining a team, so on some machines and models it runs faster on one thread. Which
is faster is measured, not assumed: the first decode steps of each batch-size class alternate
between one thread and all of them, and once each has run TRIALS times the class keeps the one
whose median step time was lower. It measures again every RECHECK steps of the class (a machine's
load changes). Steps that carry prefill always run on all the threads.

The native kernels give the same bits at any thread count; torch's own products may round their
last bits differently on another count, as they would under another `--threads`.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

import torch

TRIALS = 4  # steps timed on each candidate before a class chooses
RECHECK = 4096  # steps of a class after which it measures again


class StepThreads:
    """Per decode batch-size class (powers of two), the thread count it runs on."""

    def __init__(self, most: int | None = None):
        self.most = most if most is not None else torch.get_num_threads()
        self._times: dict[int, dict[int, list[float]]] = {}
        self._chosen: dict[int, int] = {}
        self._since: dict[int, int] = {}

    @staticmethod
    def _class(sequences: int) -> int:
        return 1 << max(0, (sequences - 1).bit_length())

    def choose(self, sequences: int) -> int:
        """The thread count the next decode step of `sequences` sequences runs on."""
        if self.most <= 1:
            return self.most
        key = self._class(sequences)
        if key in self._chosen:
            return self._chosen[key]
        times = self._times.setdefault(key, {1: [], self.most: []})
        return min(times, key=lambda n: len(times[n]))  # (alternating: the candidate timed least)

    def observe(self, sequences: int, threads: int, seconds: float) -> None:
        """A decode step of `sequences` sequences ran on `threads` threads in `seconds`."""
        if self.most <= 1:
            return
        key = self._class(sequences)
        if key in self._chosen:
            self._since[key] = self._since.get(key, 0) + 1
            if self._since[key] >= RECHECK:  # measure again
                del self._chosen[key]
                self._times[key] = {1: [], self.most: []}
            return
        times = self._times.setdefault(key, {1: [], self.most: []})
        if threads in times:
            times[threads].append(seconds)
        if all(len(t) >= TRIALS for t in times.values()):
            self._chosen[key] = min(times, key=lambda n: statistics.median(times[n]))
            self._since[key] = 0

    def chosen(self) -> dict[int, int]:
        """Batch-size class -> the thread count chosen for it (the classes measured so far)."""
        return dict(self._chosen)

    @contextmanager
    def decode_step(self, sequences: int):
        """Run a decode step of `sequences` sequences on the chosen threads, timed."""
        threads = self.choose(sequences)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        start = time.perf_counter()
        try:
            yield threads
        finally:
            self.observe(sequences, threads, time.perf_counter() - start)
            if threads != self.most:
                torch.set_num_threads(self.most)
