"""The vLLM integration's tests; each module starts with `require_vllm()`."""

import os

import pytest


def require_vllm() -> None:
    """Skip the calling test module where vLLM is not installed; in .ci/run's vLLM step
    (IRMINSUL_REQUIRE_VLLM=1) a missing vLLM fails instead of skipping."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        if os.environ.get("IRMINSUL_REQUIRE_VLLM") == "1":
            raise
        pytest.skip(
            "vLLM is not installed: pip install -e '.[vllm]' (the optional extra, docs/vllm.md) to run "
            "the vLLM integration tests",
            allow_module_level=True,
        )
