"""The native kernels' build (model/native): built once per CPU and source into a cache, and where no
library can be had (no compiler, a failing build, IRMINSUL_NATIVE=0) it is None and products keep
torch's kernels, computing the same."""

import platform

import pytest
import torch
import torch.nn.functional as F

from irminsul.model import gemv, native


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("IRMINSUL_NATIVE_CACHE", str(tmp_path / "native"))
    monkeypatch.delenv("IRMINSUL_GEMV", raising=False)
    native.library.cache_clear()
    yield tmp_path / "native"
    native.library.cache_clear()


@pytest.mark.skipif(native._compiler() is None, reason="needs a C compiler")
def test_built_once_into_the_cache_and_loaded_from_it(fresh, monkeypatch):
    assert native.library() is not None
    built = list(fresh.glob("kernels-*.so"))
    assert len(built) == 1 and not list(fresh.glob("*.so.*")) and len(list(fresh.iterdir())) == 1  # (no temp left)
    stamp = built[0].stat().st_mtime_ns
    native.library.cache_clear()
    calls = []
    real = native.subprocess.run
    monkeypatch.setattr(native.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or real(cmd, **kw))
    assert native.library() is not None
    assert all("--version" in c for c in calls) and built[0].stat().st_mtime_ns == stamp  # (not compiled again)
    # the kernels' name (kernel_choice's times for them are keyed by it) is the library's
    assert native.fingerprint() and built[0].name.startswith(f"kernels-{native.fingerprint()}")


@pytest.mark.skipif(native._compiler() is None, reason="needs a C compiler")
def test_a_kernels_times_are_keyed_by_its_own_source(fresh, monkeypatch):
    """kernel_choice keys the gemv kernel's times by gemv.c's own fingerprint: a change to another
    kernel's source rebuilds the library but leaves those times be; a change to gemv.c does not."""
    from pathlib import Path

    from irminsul.model import kernel_choice

    assert native.library() is not None
    cc, gemv_fp, whole = native._compiler(), native.fingerprint("gemv.c"), native._key(native._compiler())
    assert gemv_fp and gemv_fp != native.fingerprint() and kernel_choice._gemv_fingerprint() == gemv_fp
    real = Path.read_text
    for edited, moves in (("moe.c", False), ("gemv.c", True)):
        with monkeypatch.context() as m:
            m.setattr(
                Path, "read_text", lambda self, *a, **k: real(self, *a, **k) + ("//" if self.name == edited else "")
            )
            assert native._key(cc) != whole  # (the library is built again)
            assert (native.fingerprint("gemv.c") != gemv_fp) == moves, edited


@pytest.mark.parametrize("how", ["failing compiler", "no compiler", "switched off"])
def test_no_library_means_torch_kernels(fresh, monkeypatch, tmp_path, how):
    if how == "failing compiler":
        bad = tmp_path / "cc"
        bad.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo fake && exit 0\necho 'error: no' >&2; exit 1\n")
        bad.chmod(0o755)
        monkeypatch.setenv("CC", str(bad))
    elif how == "no compiler":
        monkeypatch.setattr(native, "_compiler", lambda: None)
    else:
        monkeypatch.setenv("IRMINSUL_NATIVE", "0")
    assert native.library() is None and not gemv.available() and native.fingerprint() == ""
    assert not list(fresh.glob("*.so")) if fresh.exists() else True
    w, x = torch.randn(30, 20), torch.randn(1, 20)
    assert torch.equal(gemv.product(x, w), F.linear(x, w))


@pytest.mark.skipif(
    native._compiler() is None or platform.machine() != "x86_64", reason="needs a C compiler for x86-64"
)
def test_the_plain_loops_compute_the_same(fresh, monkeypatch):
    """Built for a CPU without AVX-512 (x86-64-v2: the loops the compiler vectorises, as on AVX2 or ARM
    machines): the products and the decode attention still compute F.linear's and the reference's."""
    from irminsul.model.attention.cpu import CPUAttention
    from tests.model.test_attention_flash import _case, _reference, _run, _setup

    monkeypatch.setenv("IRMINSUL_NATIVE_MARCH", "x86-64-v2")
    assert native.library() is not None
    g = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.bfloat16):
        for rows, out_f, in_f in ((1, 70, 33), (3, 129, 2049), (8, 40, 16)):
            w = (torch.randn(out_f, in_f, generator=g) / in_f**0.5).to(dtype)
            x = torch.randn(rows, in_f, generator=g).to(dtype)
            ref = F.linear(x.double(), w.double())
            got = gemv.product(x, w)
            assert (got.double() - ref).abs().max().item() <= (
                1e-2 if dtype == torch.bfloat16 else 2e-5
            ) * ref.abs().max()
    monkeypatch.setattr(CPUAttention, "NATIVE_DECODE", True)
    cfg, backend, attn, g = _setup(1)
    q_nope, q_pe, pool, seqs = _case(cfg, g, [(n - 1, 1) for n in (30, 7, 19)], holes=True, moved=True)
    got, _, _ = _run(backend, attn, q_nope, q_pe, pool, seqs, expanded=False)
    want = _reference(cfg, backend, attn, q_nope, q_pe, pool, seqs)
    assert (got.double() - want).abs().max().item() < 1e-4
