"""Codec and disk tier: round trip, verification, budget, restarts, corruption."""

import numpy as np
import pytest
import torch

from irminsul.kvcache.registry import Entry
from irminsul.kvcache.store import CorruptEntry, ForeignEntry, RowLayout, decode, encode
from irminsul.kvcache.store.disk import DiskRegistry
from tests.kvcache.store.conftest import LAYOUT


def entry(fp, n=8, base=0, seed=0, layout=None):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(2, n, 6, generator=g)
    ids = np.arange(seed, seed + n, dtype=np.int64)
    return Entry(fp, ids, base, rows, rows.numel() * 4)


def test_codec_round_trip_and_every_check(layout):
    e = entry(0xABC, base=40)
    blob = encode(e, layout)
    got = decode(blob, layout, 0xABC)
    assert got.fingerprint == 0xABC and got.base_pos == 40 and got.nbytes == e.nbytes
    assert np.array_equal(got.token_ids, e.token_ids) and torch.equal(got.payload, e.payload)
    flipped = bytearray(blob)
    flipped[-5] ^= 0xFF  # inside the row bytes
    cases = {
        "checksum": bytes(flipped),
        "unreadable": blob[:-10],  # truncated
        "holds": blob,  # stored under another fingerprint
    }
    for what, data in cases.items():
        with pytest.raises(CorruptEntry, match=what):
            decode(data, layout, 0xABD if what == "holds" else 0xABC)
    with pytest.raises(ForeignEntry, match="model"):
        decode(blob, RowLayout("model-b", 2, 6, torch.float32))
    with pytest.raises(CorruptEntry, match="rows"):
        decode(blob, RowLayout("model-a", 3, 6, torch.float32))


def test_disk_survives_restart_and_drops_corrupt_entries(tmp_path, layout):
    disk = DiskRegistry(tmp_path, layout, budget_bytes=1 << 20)
    for i in range(3):
        assert disk.put(entry(100 + i, seed=i))
    again = DiskRegistry(tmp_path, layout, budget_bytes=1 << 20)
    assert len(again) == 3
    hit = again.get(101, np.arange(1, 9))
    assert hit is not None and torch.equal(hit.payload, entry(101, seed=1).payload)
    assert again.get(101, np.arange(2, 10)) is None  # token ids verified: a mismatch is a miss ...
    assert 101 not in again and len(again) == 2  # ... and dropped
    path = again._path(102)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    assert again.get(102, np.arange(2, 10)) is None
    s = again.tier_stats
    assert s.corrupt == 1 and s.entries == 1 and not path.exists()
    assert again.put(entry(102, seed=2)) and again.get(102, np.arange(2, 10)) is not None
    again._path(100).unlink()  # removed behind the store's back: a miss and dropped, not corruption
    assert again.get(100, np.arange(0, 8)) is None
    s = again.tier_stats
    assert s.corrupt == 1 and 100 not in again


def test_disk_budget_evicts_least_recently_used(tmp_path, layout):
    size = len(encode(entry(1), layout))
    disk = DiskRegistry(tmp_path, layout, budget_bytes=3 * size)
    for fp in (1, 2, 3):
        disk.put(entry(fp))
    disk.get(1, np.arange(0, 8))  # 1 becomes most recent
    disk.put(entry(4))
    assert 2 not in disk and 1 in disk and disk.stats.bytes <= 3 * size
    disk.pin(1), disk.pin(3), disk.pin(4)
    assert not disk.put(entry(5))  # everything else pinned: rejected, store untouched
    assert len(disk) == 3 and disk.stats.rejected == 1


def test_corrupt_entries_are_logged_but_never_flood_the_log(tmp_path, layout, caplog):
    import logging

    disk = DiskRegistry(tmp_path, layout, budget_bytes=1 << 20)
    for i in range(5):
        disk.put(entry(200 + i, seed=i))
        path = disk._path(200 + i)
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x01
        path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="irminsul.store"):
        for i in range(5):
            assert disk.get(200 + i, np.arange(i, i + 8)) is None
    lines = [r.getMessage() for r in caplog.records if r.name == "irminsul.store"]
    assert len(lines) == 1 and "disk tier" in lines[0] and "checksum" in lines[0]  # the rest held back
    assert disk.tier_stats.corrupt == 5


def test_entries_are_authenticated_by_the_store_secret(tmp_path):
    """Anyone who could write to the store could substitute rows: the checksum was an unkeyed xxh64.
    Now an entry rewritten without the secret does not verify, and an entry under another secret is
    left alone for its owner."""
    import dataclasses
    import json
    import struct

    from safetensors.torch import load, save

    ours = dataclasses.replace(LAYOUT, secret=b"operator secret")
    theirs = dataclasses.replace(LAYOUT, secret=b"another operator")
    e = entry(0x77)
    blob = encode(e, ours)
    assert torch.equal(decode(blob, ours, 0x77).payload, e.payload)
    # an attacker without the secret replaces the rows and keeps every metadata field as it was
    (n,) = struct.unpack("<Q", blob[:8])
    meta = json.loads(blob[8 : 8 + n])["__metadata__"]
    tensors = load(blob)
    forged = save({"rows": torch.zeros_like(tensors["rows"]), "token_ids": tensors["token_ids"]}, metadata=meta)
    with pytest.raises(CorruptEntry, match="MAC"):
        decode(forged, ours, 0x77)
    with pytest.raises(ForeignEntry, match="secret"):
        decode(blob, theirs, 0x77)
    # a store shared with another secret: its entries are neither served nor deleted
    disk = DiskRegistry(tmp_path, ours, budget_bytes=1 << 20)
    disk.put(entry(0x78))
    other = DiskRegistry(tmp_path, theirs, budget_bytes=1 << 20)
    assert other.get(0x78, np.arange(8)) is None and other.tier_stats.corrupt == 0
    assert disk._path(0x78).exists() and disk.get(0x78, np.arange(8)) is not None
