"""The `variant` fixture: a test that takes it runs once on each named build of the native kernels
this CPU executes (model/native VARIANTS: x86-64-v4 with AVX-512, x86-64-v3 with AVX2 + FMA, x86-64's
plain loops), each loaded side by side from its own cache file; the wrappers (native_ops, elementwise,
gemv) call that build while the test runs."""

import pytest

from irminsul.model import native

VARIANTS = native.variants() if native._compiler() is not None else []


@pytest.fixture(params=VARIANTS)
def variant(request, monkeypatch):
    lib = native.library(request.param)
    assert lib is not None, f"the {request.param} build failed"
    real = native.library
    monkeypatch.setattr(native, "library", lambda variant=None: lib if variant is None else real(variant))
    return request.param
