"""The Redis tier: one registry shared by every replica that points at the same Redis.

Keys are ``irminsul:<model id>:<key id>:<fingerprint hex>``; values are codec blobs, verified on
every read: a corrupt or mismatching one is deleted, counted and a miss. Redis's own ``maxmemory``
policy bounds its size.

Redis may be down at start or die mid-run, or something else may answer on its address. Requests
never wait on it for long: every command (connect, handshake, send and the whole reply) has one
deadline, ``timeout_s``, not a timeout per socket read, which a server sending a byte at a time
would never trip; there are no client retries; and after a connection failure, a command past its
deadline or a handshake no Redis would answer, a circuit breaker skips Redis entirely (reads miss,
writes are dropped and counted) until a background thread's PING succeeds again, probing with
exponential backoff. A backend that fails again soon after it came back (a server that answers
PING but drips every value) waits twice as long each time. A command Redis answers with an error (a
write refused at ``maxmemory`` under ``noeviction``, a read-only replica) is a failure of that
command only: it is counted and the write dropped, but Redis is up and reads go on. Writes always
go through that background thread, so a slow Redis never sits on a request's path.

First writer wins (``SET NX``) among entries that verify. A key held by a value that does not (a
planted or damaged entry) is replaced by the next legitimate write, and a read that finds one
deletes it, both only if the key still holds that same value (a compare-and-set script), so a
racing legitimate writer is never clobbered.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time

import numpy as np

from irminsul.kvcache.registry import Entry, Registry, RegistryStats
from irminsul.kvcache.store import deadline
from irminsul.kvcache.store.codec import CorruptEntry, RowLayout, decode, encode
from irminsul.kvcache.store.stats import TierLog, TierStats

# Compare-and-set on the SHA-1 of the value a client saw: a key is replaced or deleted only if it
# still holds that value (or, for a replacement, nothing).
_REPLACE = """
local v = redis.call('GET', KEYS[1])
if v and redis.sha1hex(v) ~= ARGV[1] then return 0 end
if ARGV[3] == '' then redis.call('SET', KEYS[1], ARGV[2]) else redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3]) end
return 1
"""
_DELETE = """
local v = redis.call('GET', KEYS[1])
if v and redis.sha1hex(v) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisRegistry(Registry):
    log: TierLog  # (set in __init__: this tier's own, which the tiered registry shares)

    def __init__(
        self,
        url: str,
        layout: RowLayout,
        timeout_s: float = 0.25,
        backoff: tuple = (0.2, 5.0),
        max_pending: int = 1024,
        ttl_s: int | None = None,
    ):
        """`timeout_s`: the deadline of one command, its connection and its whole reply included."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        super().__init__()
        self.url, self.layout, self.ttl_s, self.timeout_s = url, layout, ttl_s, timeout_s
        try:
            self.client = redis.Redis.from_url(
                url,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0),
                redis_connect_func=deadline.on_connect,
            )
        except ValueError as e:
            raise ValueError(f"--store {url!r} is not a Redis URL ({e}); use redis://host:port/db") from None
        # NOTE: keyed by the store secret's id too: an entry under another secret is never at our key,
        # so whatever at our key fails verification was not written by a holder of our secret.
        self.prefix = f"irminsul:{layout.model_id}:{layout.key_id}:"
        self._errors = (redis.RedisError, OSError)
        self._refused = redis.ResponseError  # Redis answered, with an error: it is up
        self._replace = self.client.register_script(_REPLACE)
        self._delete_if = self.client.register_script(_DELETE)
        self._min_backoff, self._max_backoff = backoff
        self._backoff, self._retry_at = self._min_backoff, 0.0
        self._up, self._up_since = False, 0.0  # down until the first successful command
        self._queue: queue.Queue = queue.Queue(max_pending)
        self._wake = threading.Event()
        self._closed = False
        self._hits = self._misses = self._collisions = self._corrupt = 0
        self._failures = self._dropped = self._insertions = self._reconnects = 0
        self.log = TierLog("redis")
        self._entries = self._bytes = 0  # refreshed by the background thread (DBSIZE-like count of our keys)
        self._probe(log=True)
        self._thread = threading.Thread(target=self._run, name="irminsul-redis", daemon=True)
        self._thread.start()

    # -- the breaker ---------------------------------------------------------------------

    @property
    def available(self) -> bool:
        return self._up

    @property
    def key_prefix(self) -> str:
        return self.prefix

    @property
    def location(self) -> str:
        return self.url

    def _error(self, what: str, error: Exception) -> None:
        """A command failed: a refusal is counted; a connection-level failure also opens the breaker."""
        self.log.failed(what, error)
        if isinstance(error, self._refused):
            self._failures += 1
        else:
            self._failed()

    def _failed(self) -> None:
        self._failures += 1
        now = time.monotonic()
        if self._up and now - self._up_since > self._max_backoff:  # after a healthy stretch: start over
            self._backoff = self._min_backoff
        else:  # still down, or down again soon after it came back
            self._backoff = min(self._max_backoff, self._backoff * 2)
        self._up, self._retry_at = False, now + self._backoff
        self._wake.set()

    def _probe(self, log: bool = False) -> None:
        try:
            self._command(self.client.ping)
        except self._errors as e:
            if log:  # (at start; later, the command that failed has said why)
                self.log.failed(f"connecting to {self.url}", e)
            self._failed()
            return
        if not self._up:
            self._reconnects += 1
            self._up, self._up_since = True, time.monotonic()

    def _command(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``: one command or pipeline, its connection and whole reply included."""
        return deadline.call(self.timeout_s, fn, *args, **kwargs)

    def _key(self, fingerprint: int) -> str:
        return f"{self.prefix}{fingerprint:016x}"

    # -- background: writes, probes, size ------------------------------------------------

    def _run(self) -> None:
        last_size = 0.0
        while not self._closed:
            if not self._up:
                self._drain()  # writes queued before the failure are dropped, not replayed later
                self._wake.wait(max(0.0, self._retry_at - time.monotonic()))
                self._wake.clear()
                if not self._closed and time.monotonic() >= self._retry_at:
                    self._probe()
                continue
            try:
                entry = self._queue.get(timeout=0.5)
            except queue.Empty:
                entry = None
            if entry is not None:
                try:
                    self._write(entry)
                except Exception as e:  # NOTE: this thread outlives any one bad write
                    self._dropped += 1
                    self.log.failed("writing an entry", e)
                finally:
                    self._queue.task_done()
            if self._up and time.monotonic() - last_size > 10.0:
                self._refresh_size()
                last_size = time.monotonic()

    def _drain(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return
            self._dropped += 1
            self._queue.task_done()

    def _write(self, entry: Entry) -> None:
        if not self._up:
            self._dropped += 1
            return
        key, blob = self._key(entry.fingerprint), encode(entry, self.layout)
        try:
            if self._command(self.client.set, key, blob, nx=True, ex=self.ttl_s):
                self._insertions += 1
                return
            held = self._command(self.client.get, key)
            problem = self._problem(held, entry.fingerprint) if held is not None else None
            if held is not None and problem is None:
                return  # first writer wins among entries that verify
            if problem is not None:  # taken by a value that does not verify (planted, damaged)
                self._corrupt += 1
                self.log.corrupt(entry.fingerprint, problem)
            if self._command(self._replace, keys=[key], args=[_sha1(held), blob, self.ttl_s or ""]):  # if still there
                self._insertions += 1
        except self._errors as e:
            self._dropped += 1
            self._error(f"writing entry {entry.fingerprint:016x}", e)

    def _problem(self, blob: bytes, fingerprint: int) -> str | None:
        """Why a stored value does not verify, or None if it does."""
        try:
            decode(blob, self.layout, fingerprint)
        except CorruptEntry as e:
            return str(e)
        return None

    def _refresh_size(self, sample: int = 64) -> None:
        """Entries and bytes for the gauges, in bounded work whatever Redis holds: DBSIZE (O(1)) times
        the mean size of one SCAN batch. Both describe the whole Redis db, so give Irminsul a db of
        its own. (Scanning every key every few seconds cost Redis O(keys).)"""
        try:
            total = self._command(self.client.dbsize)
            _, keys = self._command(self.client.scan, cursor=0, count=sample)
            pipe = self.client.pipeline(transaction=False)
            for key in keys[:sample]:
                pipe.strlen(key)
            sizes = self._command(pipe.execute)
            size = sum(sizes) * total // len(sizes) if sizes else 0
        except Exception as e:  # NOTE: a reply of the wrong shape (no Redis sent it) too: this thread must live on
            self._error("reading the size", e)
            return
        self._entries, self._bytes = total, size

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until queued writes are done (tests, shutdown); False on timeout."""
        end = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < end:
            time.sleep(0.01)
        return not self._queue.unfinished_tasks

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    # -- Registry ------------------------------------------------------------------------

    def get(self, fingerprint: int, token_ids: np.ndarray, namespace: str = "") -> Entry | None:
        entry, blob = self._fetch(fingerprint)
        if entry is None or not entry.matches(token_ids, namespace):
            self._misses += 1
            if entry is not None:
                self._collisions += 1
                if entry.namespace == namespace:  # another chunk of ours: dropped, the caller recomputes
                    assert blob is not None, "_fetch gives an entry with the blob it decoded"
                    self._delete(fingerprint, blob)  # (another namespace's entry is left to its owner)
            return None
        self._hits += 1
        return entry

    def _fetch(self, fingerprint: int) -> tuple[Entry | None, bytes | None]:
        """The verified entry under a fingerprint and its blob; (None, None) on a miss."""
        if not self._up:
            return None, None  # NOTE: never wait on a Redis that is known to be down
        try:
            blob = self._command(self.client.get, self._key(fingerprint))
        except self._errors as e:
            self._error(f"reading entry {fingerprint:016x}", e)
            return None, None
        if blob is None:
            return None, None
        try:
            return decode(blob, self.layout, fingerprint), blob
        except CorruptEntry as e:  # foreign ones too: at our key, no holder of our secret wrote them
            self._corrupt += 1
            self.log.corrupt(fingerprint, str(e))
            self._delete(fingerprint, blob)
            return None, None

    def _delete(self, fingerprint: int, blob: bytes) -> None:
        """Delete the key if it still holds ``blob`` (a racing writer's new value is kept)."""
        try:
            self._command(self._delete_if, keys=[self._key(fingerprint)], args=[_sha1(blob)])
        except self._errors as e:
            self._error(f"deleting entry {fingerprint:016x}", e)

    def peek(self, fingerprint: int) -> Entry | None:
        return self._fetch(fingerprint)[0]

    def put(self, entry: Entry) -> bool:
        """Queue a write (done in the background); False when Redis is down or the queue is full."""
        if not self._up:
            self._dropped += 1
            return False
        try:
            self._queue.put_nowait(entry)
        except queue.Full:
            self._dropped += 1
            return False
        return True

    def pin(self, fingerprint: int) -> None:
        """No-op: a shared remote entry cannot be pinned; the engine copies rows before using them."""

    def unpin(self, fingerprint: int) -> None:
        """No-op (see pin)."""

    def __contains__(self, fingerprint: int) -> bool:
        if not self._up:
            return False
        try:
            return bool(self._command(self.client.exists, self._key(fingerprint)))
        except self._errors as e:
            self._error("checking an entry", e)
            return False

    def __len__(self) -> int:
        return self._entries

    @property
    def stats(self) -> RegistryStats:
        return RegistryStats(
            self._hits,
            self._misses,
            self._collisions,
            0,
            self._insertions,
            self._dropped,
            self._entries,
            0,
            self._bytes,
            0,
        )

    @property
    def tier_stats(self) -> TierStats:
        return TierStats(
            "redis",
            self._hits,
            self._misses,
            0,
            self._insertions,
            self._entries,
            self._bytes,
            0,
            corrupt=self._corrupt,
            failures=self._failures,
            dropped=self._dropped,
            pending=self._queue.qsize(),
            available=self._up,
        )


def _sha1(blob: bytes | None) -> str:
    return hashlib.sha1(blob or b"").hexdigest()
