"""A checkpoint's cache identity follows its weights' content, dtype and row format."""

import shutil

from irminsul.model.identity import checkpoint_id
from irminsul.model.tiny import make_tiny_checkpoint
from tests.checkpoints import rows_reversed_copy


def test_the_identity_follows_content_not_names_and_sizes(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    a = make_tiny_checkpoint(tmp_path / "a")
    same = tmp_path / "same"
    shutil.copytree(a, same)
    shuffled = rows_reversed_copy(a, tmp_path / "shuffled")  # same names, same sizes, other rows
    assert (shuffled / "model.safetensors").stat().st_size == (a / "model.safetensors").stat().st_size
    assert checkpoint_id(a) == checkpoint_id(same)  # the same weights make the same rows, wherever they sit
    assert checkpoint_id(a) != checkpoint_id(shuffled)
    assert checkpoint_id(a, "bfloat16") != checkpoint_id(a, "float32")


def test_file_hashes_are_remembered_until_the_file_changes(tmp_path, monkeypatch):
    import irminsul.model.identity as identity

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    a = make_tiny_checkpoint(tmp_path / "a")
    first = checkpoint_id(a)
    reads = []
    real = identity.xxhash.xxh64
    monkeypatch.setattr(identity.xxhash, "xxh64", lambda *x: reads.append(x) or real(*x))
    assert checkpoint_id(a) == first and len(reads) == 1  # the config only: the weights' hash is remembered
    (a / "model.safetensors").write_bytes((a / "model.safetensors").read_bytes() + b"")
    import os

    os.utime(a / "model.safetensors", ns=(1, 1))  # a changed file (mtime) is hashed again
    reads.clear()
    assert checkpoint_id(a) == first and len(reads) == 2
