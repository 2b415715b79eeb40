"""A checkpoint's identity for cache namespaces: what its cached rows depend on, and nothing else.

Cached rows depend on the weights' *content*, the dtype they are computed in, and the layout the
engine stores them in. The identity hashes all three: config.json, every weight file's bytes
(xxHash64), the dtype and the row format. Names and sizes alone are not enough: a copy of a model
with every matrix's rows shuffled has the same files' names and sizes and must not be served the
original's rows.

Hashing a large checkpoint takes seconds, so each file's hash is remembered in a small JSON file
under the user's cache directory, keyed by the file's resolved path, size and modification time;
a changed file is hashed again.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import xxhash

from irminsul.model.settings import settings

ROW_FORMAT = "irminsul-rows-v2"  # c_KV and un-rotated k_r per token and layer (see kvcache/pool.py)


def _memo_file() -> Path:
    root = settings.cache_home
    return root / "irminsul" / "weight-hashes.json"


def file_hash(path: Path, chunk: int = 1 << 24) -> str:
    """xxHash64 of a file's bytes, remembered by (resolved path, size, mtime)."""
    st = path.stat()
    key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    memo_path = _memo_file()
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if key in memo:
        return memo[key]
    h = xxhash.xxh64()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    memo[key] = h.hexdigest()
    try:  # best effort: a read-only home only costs hashing again next time
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=memo_path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as out:
            json.dump(memo, out)
        os.replace(tmp, memo_path)
    except OSError:
        pass
    return memo[key]


def checkpoint_id(path: str | Path, dtype: str = "float32") -> str:
    """The namespace identity of a checkpoint served in `dtype`."""
    path = Path(path)
    h = xxhash.xxh64((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        h.update(f"{f.name}:{file_hash(f)};".encode())
    h.update(f"dtype={dtype};rows={ROW_FORMAT}".encode())
    return h.hexdigest()
