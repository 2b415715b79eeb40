"""The router's view of the shared store: which chunks Redis holds, and a failing Redis as no credit."""

import time

from irminsul.fleet.store_keys import StoreKeys
from tests.support.services import RedisProcess


def test_the_store_says_which_chunks_it_holds_and_a_dead_store_is_no_credit_never_an_error():
    redis = RedisProcess()
    try:
        prefix = "irminsul:tiny:abc:"
        client = redis.client()
        for f in (1, 2**63 + 5):
            client.set(f"{prefix}{f:016x}", b"rows")
        client.set(f"irminsul:other-model:abc:{3:016x}", b"rows")  # another model's key: not ours
        now = [0.0]
        keys = StoreKeys(redis.url, prefix, backoff_s=5.0, clock=lambda: now[0])
        assert keys.found([1, 3, 2**63 + 5, 1]) == {1, 2**63 + 5}
        assert keys.found([]) == frozenset()
        redis.stop()
        started = time.monotonic()
        assert keys.found([1]) == frozenset() and keys.failures == 1
        assert time.monotonic() - started < 1.0  # the timeout is the router's, not a client default
        assert keys.found([1]) == frozenset() and keys.failures == 1  # backing off: not asked again
        redis.start()
        for f in (1,):
            redis.client().set(f"{prefix}{f:016x}", b"rows")
        assert keys.found([1]) == frozenset()  # still within the backoff
        now[0] = 6.0
        assert keys.found([1]) == {1}
    finally:
        redis.stop()
