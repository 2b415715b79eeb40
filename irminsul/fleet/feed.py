"""A replica's chunk journal as Ray Serve routing stats, and a router following it.

Ray Serve's controller calls each replica's `record_routing_stats` every
`request_routing_stats_period_s`, keeps the latest answer only, and pushes every replica's latest
answer to every router (the deployment's long-poll broadcast, whenever one of them changed). A
router can therefore miss answers: two polls may land between two broadcasts it reads. So each
answer carries the journal's changes of the last few periods that had any, each tagged with the
journal numbers it spans (`Period`), and a router applies the ones after the number it holds. A
router further behind than that (or new: restarted, or a replica it never saw) fetches the whole
set once, out of band (`Snapshot`, through the replica's `journal_snapshot` method).

The replica cuts periods from a mirror of what it has published, so a snapshot is the set exactly
at a period's end and the periods after it apply to it without gaps or overlap.

Bytes per answer: 8 per fingerprint changed in the kept periods, plus ~100 of framing; a replica
that holds a million chunks and churns a few hundred a second ships kilobytes, not its 8 MiB set.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from irminsul.fleet.fingerprints import FingerprintSet
from irminsul.fleet.router import ReplicaLoad, ReplicaView
from irminsul.kvcache.journal import JournalDelta

KEEP_PERIODS = 4  # periods an answer carries: a router may miss this many broadcasts minus one


@dataclass(frozen=True)
class Period:
    start: int  # the journal number the changes are since ...
    end: int  # ... and the number after them
    added: bytes  # uint64 fingerprints, little-endian
    removed: bytes


@dataclass(frozen=True)
class Snapshot:
    seq: int  # a period's end: the periods after it continue from here
    fingerprints: bytes  # every resident fingerprint, uint64 little-endian


@dataclass(frozen=True)
class RoutingStats:
    """One `record_routing_stats` answer (sent as `as_dict()`: Serve wants a dict)."""

    report: int  # counts the answers: a new number is a fresh load report
    load: ReplicaLoad
    seq: int  # the journal's number now (the last period's end)
    periods: tuple[Period, ...]

    def as_dict(self) -> dict:
        return {
            "report": self.report,
            "load": (self.load.running, self.load.waiting, self.load.queued_prefill_tokens),
            "seq": self.seq,
            "periods": [(p.start, p.end, p.added, p.removed) for p in self.periods],
        }

    @classmethod
    def of(cls, stats: dict | None) -> RoutingStats | None:
        if not stats or "report" not in stats:
            return None  # (a replica that has not answered yet)
        return cls(
            stats["report"], ReplicaLoad(*stats["load"]), stats["seq"], tuple(Period(*p) for p in stats["periods"])
        )

    @property
    def nbytes(self) -> int:
        """The fingerprints' bytes (the rest is a few numbers)."""
        return sum(len(p.added) + len(p.removed) for p in self.periods)


def _bytes(a: np.ndarray) -> bytes:
    return np.asarray(a, "<u8").tobytes()


def fingerprints(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, "<u8").astype(np.uint64)


class Journal(Protocol):
    """A journal's follower side: a `ChunkJournal`, or one in another process (vLLM's connector's)."""

    @property
    def seq(self) -> int: ...

    def since(self, seq: int | None) -> JournalDelta: ...


class JournalFeed:
    """The replica's side: periods cut from its KV manager's journal (None: no content reuse)."""

    def __init__(self, journal: Journal | None, keep: int = KEEP_PERIODS):
        self.journal = journal
        self.seq = 0 if journal is None else journal.seq
        self._mirror = FingerprintSet()  # what the periods so far say is resident (at self.seq)
        if journal is not None and journal.seq:  # (a journal with history: start from its whole set)
            self._mirror.replace(journal.since(None).added)
        self._periods: deque[Period] = deque(maxlen=keep)
        self._lock = threading.Lock()  # (stats polls and snapshot calls may overlap)

    def cut(self) -> tuple[int, tuple[Period, ...]]:
        """Close the period since the last cut (if anything changed): the journal number now, and the
        kept periods (the last ends there)."""
        with self._lock:
            if self.journal is not None:
                self._advance(self.journal.since(self.seq))
            return self.seq, tuple(self._periods)

    def snapshot(self) -> Snapshot:
        with self._lock:
            if self.journal is not None:
                self._advance(self.journal.since(self.seq))
            return Snapshot(self.seq, _bytes(self._mirror.to_array()))

    def _advance(self, delta: JournalDelta) -> None:
        if delta.full:  # the journal dropped changes we had not cut: every follower starts over
            self._mirror.replace(delta.added)
            self._periods.clear()
        elif delta.seq != self.seq:
            self._mirror.remove(delta.removed)
            self._mirror.add(delta.added)
            self._periods.append(Period(self.seq, delta.seq, _bytes(delta.added), _bytes(delta.removed)))
        self.seq = delta.seq


def follow(view: ReplicaView, stats: RoutingStats) -> bool:
    """The router's side: bring `view` to `stats.seq` with the periods it has not applied; False
    when it cannot (it holds no number, or an older one than the first period starts at), and needs
    a snapshot. A replica whose journal is still at 0 has nothing to fetch."""
    if view.seq is None and stats.seq == 0:
        view.seq = 0
    if view.seq is None:
        return False
    if view.seq == stats.seq:
        return True
    pending = [p for p in stats.periods if p.end > view.seq]
    if not pending or pending[0].start != view.seq:
        return False
    for p in pending:
        view.apply(JournalDelta(p.end, fingerprints(p.added), fingerprints(p.removed), False))
    return True


def restore(view: ReplicaView, snapshot: Snapshot) -> None:
    """Replace `view`'s chunks with a snapshot (unless the view has already moved past it)."""
    if view.seq is None or view.seq < snapshot.seq:
        view.apply(JournalDelta(snapshot.seq, fingerprints(snapshot.fingerprints), np.zeros(0, np.uint64), True))
