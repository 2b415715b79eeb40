"""The connector's chunk journal, served to the process that runs vLLM's front end (a fleet replica).

The registry the connector loads from lives in vLLM's engine-core process, beside the scheduler; a
fleet replica runs vLLM's OpenAI app in another process (vLLM spawns the engine core). vLLM 0.32 gives a
connector two ways out of the engine core, neither of them a follower's pull: its stats
(`get_kv_connector_stats`, summed by the front end's stat loggers once a log interval, and only where
stats are on) and KV events (`take_events`, published over ZMQ as vLLM's own BlockStored/BlockRemoved
where `kv_events_config` asks for it). So the connector answers for its journal itself, on a Unix socket
named in its extra config (`journal_socket`): `RemoteJournal` has the journal's follower side (`seq`,
`since`), which `irminsul.fleet.feed.JournalFeed` reads exactly as it reads an Irminsul engine's.

Wire format (`multiprocessing.connection` framing, raw bytes, nothing unpickled): a request is b"seq",
b"naming" or a little-endian int64 journal number (-1: the whole set); a delta is a header
(`_HEADER`: its number, whether it is the whole set, the count added) then the added and the removed
fingerprints as little-endian uint64.
"""

from __future__ import annotations

import json
import struct
import threading
from multiprocessing.connection import Client, Connection, Listener

import numpy as np

from irminsul.kvcache.journal import ChunkJournal, JournalDelta

_HEADER = struct.Struct("<qBq")  # seq, full, number of added fingerprints


class JournalServer:
    """Answers `journal`'s followers on a Unix socket at `path`, one thread a connection. `naming`:
    what a router needs to fingerprint chunks as this registry does (model id, tenant, sink, marker)."""

    def __init__(self, journal: ChunkJournal, path: str, naming: dict):
        self.journal, self.naming = journal, naming
        self._listener = Listener(path, "AF_UNIX")
        threading.Thread(target=self._accept, name="irminsul-journal", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except OSError:  # (closed)
                return
            threading.Thread(target=self._answer, args=(conn,), name="irminsul-journal-follower", daemon=True).start()

    def _answer(self, conn: Connection) -> None:
        with conn:
            while True:
                try:
                    asked = conn.recv_bytes(64)
                except (EOFError, OSError):
                    return
                if asked == b"seq":
                    conn.send_bytes(struct.pack("<q", self.journal.seq))
                elif asked == b"naming":
                    conn.send_bytes(json.dumps(self.naming).encode())
                else:
                    (seq,) = struct.unpack("<q", asked)
                    delta = self.journal.since(None if seq < 0 else seq)
                    added, removed = np.asarray(delta.added, "<u8"), np.asarray(delta.removed, "<u8")
                    conn.send_bytes(
                        _HEADER.pack(delta.seq, delta.full, len(added)) + added.tobytes() + removed.tobytes()
                    )

    def close(self) -> None:
        self._listener.close()


class RemoteJournal:
    """The follower's side of a `ChunkJournal` served by `JournalServer` at `path`. Thread-safe."""

    def __init__(self, path: str):
        self._conn = Client(path, "AF_UNIX")
        self._lock = threading.Lock()

    def _ask(self, request: bytes) -> bytes:
        with self._lock:
            self._conn.send_bytes(request)
            return self._conn.recv_bytes()

    @property
    def seq(self) -> int:
        return struct.unpack("<q", self._ask(b"seq"))[0]

    def naming(self) -> dict:
        return json.loads(self._ask(b"naming"))

    def since(self, seq: int | None) -> JournalDelta:
        raw = self._ask(struct.pack("<q", -1 if seq is None else seq))
        at, full, n_added = _HEADER.unpack_from(raw)
        fingerprints = np.frombuffer(raw, "<u8", offset=_HEADER.size).astype(np.uint64)
        return JournalDelta(at, fingerprints[:n_added], fingerprints[n_added:], bool(full))

    def close(self) -> None:
        self._conn.close()
