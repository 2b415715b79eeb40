"""The reuse census (paper §5): how much of a trace is the same content at a shifted position.

Every request's tokens are fingerprinted with a 64-token sliding-window xxHash (xxh3-64 over the
int32 token ids). A token is
- `prefix`  if it lies in the longest common prefix with an earlier request (what a prefix cache reuses),
- `shifted` if not, but a 64-token window covering it was seen in an earlier request (at any
  position, the same one included: a prefix cache cannot reuse it either),
- `novel`   otherwise.
Shifted tokens are `within_session` when a covering window was seen earlier in the same session,
else `cross_session`. The `oracle` is what a perfect position-independent cache could reuse:
the prefix plus the shifted tokens outside the first `sink` positions (the carve-out, design §3.4).
Windows of a request that repeat its session's previous request are copied, not rehashed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import xxhash

from irminsul.kvcache.radix import common_prefix
from irminsul.research.workloads.prefix import PrefixIndex


@dataclass(frozen=True)
class CensusConfig:
    window: int = 64
    sink: int = 32
    seed: int = 0

    def __post_init__(self):
        assert self.window > 0 and self.sink >= 0, "window must be positive, sink non-negative"


@dataclass(frozen=True)
class RequestCensus:
    session: str
    prompt_tokens: int
    prefix_tokens: int
    within_tokens: int  # shifted, seen earlier in the same session
    cross_tokens: int  # shifted, seen only in other sessions
    novel_tokens: int
    oracle_tokens: int

    @property
    def shifted_tokens(self) -> int:
        return self.within_tokens + self.cross_tokens


@dataclass(frozen=True)
class CensusResult:
    requests: int
    sessions: int
    prompt_tokens: int
    prefix_tokens: int
    shifted_tokens: int
    novel_tokens: int
    oracle_tokens: int
    within_session_shifted: int
    cross_session_shifted: int
    per_request: tuple[RequestCensus, ...]

    def fraction(self, tokens: int) -> float:
        return tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_json(self) -> dict:
        f = self.fraction
        return {
            "requests": self.requests,
            "sessions": self.sessions,
            "prompt_tokens": self.prompt_tokens,
            "prefix_tokens": self.prefix_tokens,
            "shifted_tokens": self.shifted_tokens,
            "novel_tokens": self.novel_tokens,
            "oracle_tokens": self.oracle_tokens,
            "prefix_fraction": f(self.prefix_tokens),
            "shifted_fraction": f(self.shifted_tokens),
            "novel_fraction": f(self.novel_tokens),
            "oracle_fraction": f(self.oracle_tokens),
            "within_session": {
                "shifted_tokens": self.within_session_shifted,
                "shifted_fraction": f(self.within_session_shifted),
            },
            "cross_session": {
                "shifted_tokens": self.cross_session_shifted,
                "shifted_fraction": f(self.cross_session_shifted),
            },
        }


def covered(flags: np.ndarray, n: int, window: int) -> np.ndarray:
    """[n] bool: token i is covered by a flagged window j (j <= i < j + window); flags is [n-window+1]."""
    if len(flags) == 0:
        return np.zeros(n, dtype=bool)
    c = np.concatenate(([0], np.cumsum(flags, dtype=np.int64)))
    i = np.arange(n)
    return c[np.minimum(i, len(flags) - 1) + 1] - c[np.maximum(i - window + 1, 0)] > 0


class Census:
    """Streaming census: `add` requests in arrival order, then `result()`."""

    def __init__(self, config: CensusConfig = CensusConfig()):
        self.config = config
        self._prefix = PrefixIndex()
        self._seen: set[int] = set()
        self._session_seen: dict[str, set[int]] = {}
        self._last: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # session -> (tokens, window hashes)
        self._rows: list[RequestCensus] = []

    def add(self, session: str, tokens: np.ndarray) -> RequestCensus:
        w, seed = self.config.window, self.config.seed
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        n, n_win = len(tokens), max(0, len(tokens) - w + 1)
        prefix = self._prefix.add(tokens)
        session_seen = self._session_seen.setdefault(session, set())
        # windows wholly inside the common prefix with the session's last request are already known
        last_tokens, last_hashes = self._last.get(session, (tokens[:0], np.zeros(0, np.uint64)))
        same = max(0, min(common_prefix(tokens, last_tokens), n_win + w - 1) - w + 1)
        data, hash64, step = tokens.tobytes(), xxhash.xxh3_64_intdigest, 4 * w
        fresh = [hash64(data[k : k + step], seed) for k in range(4 * same, 4 * n_win, 4)]
        hashes = np.concatenate((last_hashes[:same], np.array(fresh, dtype=np.uint64)))
        seen_any, seen_own = np.ones(n_win, dtype=bool), np.ones(n_win, dtype=bool)
        seen_any[same:] = [h in self._seen for h in fresh]
        seen_own[same:] = [h in session_seen for h in fresh]
        self._seen.update(fresh)
        session_seen.update(fresh)
        self._last[session] = (tokens, hashes)

        pos = np.arange(n)
        tail = pos >= prefix
        shifted = covered(seen_any, n, w) & tail
        within = covered(seen_own, n, w) & tail
        n_shift, n_within = int(shifted.sum()), int(within.sum())
        oracle = prefix + int((shifted & (pos >= self.config.sink)).sum())
        row = RequestCensus(session, n, prefix, n_within, n_shift - n_within, n - prefix - n_shift, oracle)
        self._rows.append(row)
        return row

    def result(self) -> CensusResult:
        rows = self._rows
        total = {
            k: sum(getattr(r, k) for r in rows)
            for k in (
                "prompt_tokens",
                "prefix_tokens",
                "within_tokens",
                "cross_tokens",
                "novel_tokens",
                "oracle_tokens",
            )
        }
        return CensusResult(
            requests=len(rows),
            sessions=len({r.session for r in rows}),
            prompt_tokens=total["prompt_tokens"],
            prefix_tokens=total["prefix_tokens"],
            shifted_tokens=total["within_tokens"] + total["cross_tokens"],
            novel_tokens=total["novel_tokens"],
            oracle_tokens=total["oracle_tokens"],
            within_session_shifted=total["within_tokens"],
            cross_session_shifted=total["cross_tokens"],
            per_request=tuple(rows),
        )


def run_census(sequences: Iterable[tuple[str, np.ndarray]], config: CensusConfig = CensusConfig()) -> CensusResult:
    """Census over (session, token ids) pairs in arrival order."""
    census = Census(config)
    for session, tokens in sequences:
        census.add(session, tokens)
    return census.result()
