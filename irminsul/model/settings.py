"""Every environment variable the model layer reads, in one place: its name, its default and what it
does (as vLLM's envs.py). Nothing else under irminsul/model reads the environment
(tests/test_layout.py checks it).

Each switch is read when it is asked for, so one set before a model is loaded, or by a test before
the call it is about, takes effect there. A flag is on unless its variable is "0".

| variable | attribute | default | what it does |
|---|---|---|---|
| IRMINSUL_NATIVE | native | on | the native C kernels at all (model/native); 0: torch's kernels only |
| IRMINSUL_NATIVE_DECODE | native_decode | on | native decode attention (eager and inside compiled steps) |
| IRMINSUL_NATIVE_PREFILL | native_prefill | on | native prefill attention |
| IRMINSUL_NATIVE_MOE | native_moe | on | native routed experts (eager and inside compiled steps) |
| IRMINSUL_NATIVE_ELEMENTWISE | native_elementwise | on | native RMSNorm and silu * up |
| IRMINSUL_GEMV | gemv | on | the native one-row products as a candidate of the kernel choice |
| IRMINSUL_NATIVE_MARCH | native_march | native | the build: a VARIANTS name of model/native or any -march |
| IRMINSUL_NATIVE_CACHE | native_cache | $XDG_CACHE_HOME/irminsul/native | where built kernels are kept |
| CC | c_compiler | cc, gcc, clang | the C compiler the kernels are built with |
| IRMINSUL_COMPILE_DECODE | compile_decode | on | compiled decode steps by default (`compile_decode=None`) |
| IRMINSUL_COMPILE_CPP_WRAPPER | compile_cpp_wrapper | on | inductor's C++ wrapper for the compiled steps |
| IRMINSUL_KERNEL_CHOICE | kernel_choice | measured | measured or fixed layouts and kernels (model/kernel_choice.py) |
| IRMINSUL_KERNEL_CACHE | kernel_cache | $XDG_CACHE_HOME/irminsul/kernels-<cpu>.json | the measurements' cache |
| IRMINSUL_KERNEL_COPIES | kernel_copies | 1/3 | oneDNN copies' budget, a fraction of the weight bytes |
| XDG_CACHE_HOME | cache_home | ~/.cache | the user's cache directory |
| TRITON_INTERPRET | triton_interpret | off | "1": Triton's CPU interpreter runs the triton backend |
"""

from __future__ import annotations

import os
from pathlib import Path


def _flag(name: str) -> bool:
    return os.environ.get(name) != "0"


def _text(name: str) -> str | None:
    return os.environ.get(name) or None


class Settings:
    """The switches, each read from the environment when asked for (`settings`)."""

    @property
    def native(self) -> bool:
        return _flag("IRMINSUL_NATIVE")

    @property
    def native_decode(self) -> bool:
        return _flag("IRMINSUL_NATIVE_DECODE")

    @property
    def native_prefill(self) -> bool:
        return _flag("IRMINSUL_NATIVE_PREFILL")

    @property
    def native_moe(self) -> bool:
        return _flag("IRMINSUL_NATIVE_MOE")

    @property
    def native_elementwise(self) -> bool:
        return _flag("IRMINSUL_NATIVE_ELEMENTWISE")

    @property
    def gemv(self) -> bool:
        return _flag("IRMINSUL_GEMV")

    @property
    def native_march(self) -> str | None:
        return _text("IRMINSUL_NATIVE_MARCH")

    @property
    def native_cache(self) -> Path | None:
        named = _text("IRMINSUL_NATIVE_CACHE")
        return Path(named) if named else None

    @property
    def c_compiler(self) -> str | None:
        return _text("CC")

    @property
    def compile_decode(self) -> bool:
        return _flag("IRMINSUL_COMPILE_DECODE")

    @property
    def compile_cpp_wrapper(self) -> bool:
        return _flag("IRMINSUL_COMPILE_CPP_WRAPPER")

    @property
    def kernel_choice(self) -> str | None:
        return _text("IRMINSUL_KERNEL_CHOICE")

    @property
    def kernel_cache(self) -> Path | None:
        named = _text("IRMINSUL_KERNEL_CACHE")
        return Path(named).expanduser() if named else None

    @property
    def kernel_copies(self) -> float | None:
        named = _text("IRMINSUL_KERNEL_COPIES")
        return float(named) if named is not None else None

    @property
    def cache_home(self) -> Path:
        return Path(_text("XDG_CACHE_HOME") or Path.home() / ".cache")

    @property
    def triton_interpret(self) -> bool:
        return os.environ.get("TRITON_INTERPRET") == "1"


settings = Settings()
