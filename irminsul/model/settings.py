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


class _Variable:
    """A class attribute that reads its environment variable whenever it is read, through `parse`."""

    def __init__(self, name: str, parse=lambda value: value):
        self.name, self.parse = name, parse

    def __get__(self, obj, owner=None):
        return self.parse(os.environ.get(self.name) or None)


def _flag(value: str | None) -> bool:  # on unless "0"
    return value != "0"


def _path(value: str | None) -> Path | None:
    return Path(value).expanduser() if value else None


class Settings:
    """The switches, each read from the environment when asked for (`settings`)."""

    native = _Variable("IRMINSUL_NATIVE", _flag)
    native_decode = _Variable("IRMINSUL_NATIVE_DECODE", _flag)
    native_prefill = _Variable("IRMINSUL_NATIVE_PREFILL", _flag)
    native_moe = _Variable("IRMINSUL_NATIVE_MOE", _flag)
    native_elementwise = _Variable("IRMINSUL_NATIVE_ELEMENTWISE", _flag)
    gemv = _Variable("IRMINSUL_GEMV", _flag)
    native_march = _Variable("IRMINSUL_NATIVE_MARCH")
    native_cache = _Variable("IRMINSUL_NATIVE_CACHE", _path)
    c_compiler = _Variable("CC")
    compile_decode = _Variable("IRMINSUL_COMPILE_DECODE", _flag)
    compile_cpp_wrapper = _Variable("IRMINSUL_COMPILE_CPP_WRAPPER", _flag)
    kernel_choice = _Variable("IRMINSUL_KERNEL_CHOICE")
    kernel_cache = _Variable("IRMINSUL_KERNEL_CACHE", _path)
    kernel_copies = _Variable("IRMINSUL_KERNEL_COPIES", lambda value: float(value) if value else None)
    cache_home = _Variable("XDG_CACHE_HOME", lambda value: Path(value) if value else Path.home() / ".cache")
    triton_interpret = _Variable("TRITON_INTERPRET", lambda value: value == "1")


settings = Settings()
