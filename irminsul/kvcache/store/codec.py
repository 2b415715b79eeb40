"""One registry entry as bytes: a safetensors blob with a keyed MAC, shared by the disk and Redis tiers.

Layout: tensors ``rows`` [n_layers, n_tokens, row_width] (the model's dtype; c_KV and un-rotated
k_r, as the engine's pool holds them) and ``token_ids`` [n_tokens] int64; metadata ``format``,
``model_id`` (the checkpoint's identity), ``namespace`` (the tenant's namespace id, compared on
every hit), ``fingerprint`` (hex, itself seeded by the tenant's namespace), ``base_pos``, ``dtype``,
``shape``, ``key_id`` and ``mac``: BLAKE2b keyed with the store secret over the other metadata
fields, the token ids and the row bytes.

Anyone who can write to Redis or the disk directory can write bytes there, but without the secret
they cannot make an entry that verifies: substituted rows are reported as corrupt and never reach
the engine (docs/design.md section 6). ``decode`` tells the two kinds of failure apart: an entry
naming another model or another secret's ``key_id`` is ``ForeignEntry``; anything else that fails
(truncated, bit-flipped, forged) is ``CorruptEntry``. Both tiers key their entries by model id and
key id, so an entry of either kind found at one of our keys was not written there by a holder of our
secret: the tiers drop it and let a legitimate write replace it. Without a secret the MAC is keyed
with the empty key: integrity, not authenticity.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from dataclasses import dataclass, field

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from irminsul.kvcache.chunker import ChunkerConfig
from irminsul.kvcache.registry import Entry, namespace_id

# v4: the writer's namespace (v3: a keyed MAC; v2: k_r un-rotated, an unkeyed checksum; v1: k_r rotated)
FORMAT = "irminsul-chunk-v4"
MAC_BYTES = 32


class CorruptEntry(Exception):
    """A stored blob failed verification; the message says which check."""


class ForeignEntry(CorruptEntry):
    """A blob naming another model or store secret: never served (the tiers key entries by both, so
    one found at our key was put there by someone without our secret)."""


def row_bytes(n_layers: int, row_width: int, dtype: torch.dtype) -> int:
    """Bytes of one token's rows: every layer's [c_KV | k_r] (the pool's slot, a stored entry's token)."""
    return n_layers * row_width * torch.finfo(dtype).bits // 8


@dataclass(frozen=True)
class RowLayout:
    """What every entry of one model's namespace must look like."""

    model_id: str
    n_layers: int
    row_width: int
    dtype: torch.dtype
    device: str = "cpu"
    secret: bytes = field(default=b"", repr=False)  # the store secret keying every entry's MAC
    max_tokens: int = ChunkerConfig.max_len  # the longest entry: the chunker cuts no longer chunk

    def __post_init__(self):
        if not self.model_id or self.n_layers < 1 or self.row_width < 1 or self.max_tokens < 1:
            raise ValueError(f"incomplete row layout: {self}")

    @property
    def bytes_per_token(self) -> int:
        return row_bytes(self.n_layers, self.row_width, self.dtype)

    @property
    def max_blob_bytes(self) -> int:
        """The longest blob ``encode`` writes for this layout: an entry of ``max_tokens`` tokens with
        every metadata field at its longest. A file or value longer than this is no entry of ours."""
        n = self.max_tokens
        shape, data = (self.n_layers, n, self.row_width), n * (self.bytes_per_token + 8)  # rows + int64 ids
        meta = _metadata(self, 2**64 - 1, "f" * len(namespace_id("", "")), -(2**63), self.dtype, shape)
        meta["mac"] = "0" * 2 * MAC_BYTES
        # NOTE: an upper bound on safetensors' header: json.dumps adds spaces and escapes non-ASCII, and
        # torch's dtype names are longer than safetensors' dtype codes
        header = {
            "__metadata__": meta,
            "rows": {"dtype": str(self.dtype), "shape": list(shape), "data_offsets": [data, data]},
            "token_ids": {"dtype": str(torch.int64), "shape": [n], "data_offsets": [data, data]},
        }
        return 8 + len(json.dumps(header)) + 7 + data  # length prefix, header padded to 8 bytes, tensors

    @property
    def key_id(self) -> str:
        """Names the secret without revealing it (entries under another secret are foreign)."""
        return (
            hashlib.blake2b(self.secret, digest_size=8, person=b"irminsul-keyid").hexdigest() if self.secret else "none"
        )

    @classmethod
    def of(cls, model, model_id: str, secret: bytes = b"") -> RowLayout:
        cfg = model.config
        return cls(model_id, cfg.num_hidden_layers, cfg.row_width, model.dtype, str(model.device), secret)


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _mac(secret: bytes, meta: dict, tokens: torch.Tensor, rows: torch.Tensor) -> str:
    h = hashlib.blake2b(key=secret, digest_size=MAC_BYTES, person=b"irminsul-entry")
    h.update(json.dumps({k: meta[k] for k in sorted(meta) if k != "mac"}).encode())
    h.update(_raw(tokens))
    h.update(_raw(rows))
    return h.hexdigest()


def _metadata(
    layout: RowLayout, fingerprint: int, namespace: str, base_pos: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> dict:
    return {
        "format": FORMAT,
        "model_id": layout.model_id,
        "namespace": namespace,
        "fingerprint": f"{fingerprint:016x}",
        "base_pos": str(base_pos),
        "dtype": str(dtype).removeprefix("torch."),
        "shape": ",".join(map(str, shape)),
        "key_id": layout.key_id,
    }


def encode(entry: Entry, layout: RowLayout) -> bytes:
    if not isinstance(entry.payload, torch.Tensor):
        raise TypeError(
            f"entry {entry.fingerprint:016x}: a stored entry holds its rows as a tensor, "
            f"not {type(entry.payload).__name__}"
        )
    rows = entry.payload.detach().contiguous().cpu()
    tokens = torch.as_tensor(np.asarray(entry.token_ids, dtype=np.int64))
    meta = _metadata(layout, entry.fingerprint, entry.namespace, entry.base_pos, rows.dtype, tuple(rows.shape))
    meta["mac"] = _mac(layout.secret, meta, tokens, rows)
    return st_save({"rows": rows, "token_ids": tokens}, metadata=meta)


def metadata(blob: bytes) -> dict:
    """The metadata of a blob without loading its tensors (raises CorruptEntry)."""
    if len(blob) < 8:
        raise CorruptEntry("blob shorter than a safetensors header")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > len(blob) - 8:
        raise CorruptEntry("header length beyond the end of the blob (truncated)")
    try:
        meta = json.loads(blob[8 : 8 + n]).get("__metadata__") or {}
    except (ValueError, AttributeError) as e:
        raise CorruptEntry(f"unreadable header ({e})") from None
    if meta.get("format") != FORMAT:
        raise CorruptEntry(f"format {meta.get('format')!r} is not {FORMAT!r}")
    return meta


def decode(blob: bytes, layout: RowLayout, fingerprint: int | None = None) -> Entry:
    """Verify and unpack a blob; raises CorruptEntry when any check fails."""
    meta = metadata(blob)
    try:
        tensors = st_load(blob)
        rows, tokens = tensors["rows"], tensors["token_ids"]
    except Exception as e:  # safetensors raises its own error types for truncated data
        raise CorruptEntry(f"unreadable tensors ({e})") from None
    if meta.get("model_id") != layout.model_id:
        raise ForeignEntry(f"entry of model {meta.get('model_id')}, expected {layout.model_id}")
    if meta.get("key_id") != layout.key_id:
        raise ForeignEntry(f"entry written under another store secret (key id {meta.get('key_id')})")
    if not hmac.compare_digest(str(meta.get("mac", "")), _mac(layout.secret, meta, tokens, rows)):
        raise CorruptEntry("checksum mismatch: the MAC does not verify (damaged, or written without the secret)")
    # NOTE: without a secret anyone can make a MAC that verifies, so nothing below trusts the fields
    try:
        fp, base_pos, namespace = int(meta["fingerprint"], 16), int(meta["base_pos"]), str(meta["namespace"])
    except (KeyError, ValueError, TypeError) as e:
        raise CorruptEntry(f"unreadable metadata ({type(e).__name__}: {e})") from None
    if fingerprint is not None and fp != fingerprint:
        raise CorruptEntry(f"stored under {fingerprint:016x} but holds {fp:016x}")
    want = (layout.n_layers, len(tokens), layout.row_width)
    if tokens.dim() != 1 or tokens.dtype != torch.int64 or tuple(rows.shape) != want or rows.dtype != layout.dtype:
        raise CorruptEntry(
            f"rows {tuple(rows.shape)} {rows.dtype}, token ids {tuple(tokens.shape)} {tokens.dtype}; "
            f"expected {want} {layout.dtype}"
        )
    rows = rows.to(layout.device)
    return Entry(fp, tokens.numpy(), base_pos, rows, rows.numel() * rows.element_size(), namespace)
