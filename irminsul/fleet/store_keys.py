"""Which of a prompt's chunks the fleet's shared store holds: the router's store credit.

The replicas' Redis tier keys each chunk as `<prefix><fingerprint as 16 hex digits>`, the prefix
naming the model and the store secret's id (`RedisRegistry.prefix`); a replica says its prefix in
its metadata. The ingress asks Redis, once per request and in one round trip (a pipeline of
EXISTS), which of the prompt's fingerprints are there, and the router gives those chunks
`RouterWeights.store_credit`.

A store that does not answer within `timeout_s` is a miss for every chunk (no credit), never an
error, and is not asked again for `backoff_s`: routing never waits on a failing store.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

log = logging.getLogger("irminsul.fleet")


class StoreKeys:
    def __init__(self, url: str, prefix: str, timeout_s: float = 0.05, backoff_s: float = 5.0, clock=time.monotonic):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.prefix, self.backoff_s, self.clock = prefix, backoff_s, clock
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
        )
        self._errors = (redis.RedisError, OSError)
        self._retry_at = 0.0
        self.lookups = self.failures = 0

    def found(self, fingerprints: Iterable[int]) -> frozenset[int]:
        """The fingerprints whose chunks the store holds (empty while the store is failing)."""
        wanted = list(dict.fromkeys(int(f) for f in fingerprints))
        if not wanted or self.clock() < self._retry_at:
            return frozenset()
        pipe = self.client.pipeline(transaction=False)
        for f in wanted:
            pipe.exists(f"{self.prefix}{f:016x}")
        try:
            answers = pipe.execute()
        except self._errors as e:
            self.failures += 1
            self._retry_at = self.clock() + self.backoff_s
            log.warning(
                "the shared store did not answer the router (%s); no store credit for %.0f s", e, self.backoff_s
            )
            return frozenset()
        self.lookups += 1
        return frozenset(f for f, there in zip(wanted, answers) if there)
