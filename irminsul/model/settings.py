"""Every environment variable the model layer reads, in one place: its name, its default and what it
does (as vLLM's envs.py). Nothing else under irminsul/model reads the environment
(tests/test_layout.py checks it).

A model reads its switches once, when it is loaded: `Settings.from_env()` is a frozen snapshot of
every one, which `DeepseekModel` takes when it is built (or is handed: `load_model(path,
settings=...)`) and holds as `settings`. It passes the snapshot to its layers and its attention
backend, which keep it, and `pack` passes it to the kernel choice; the compiled decode steps read
the model's. So a variable changed while a model serves changes no path of it, and one set before a
model is loaded takes effect in it. A layer or backend built on its own takes a snapshot when it is
built, unless it is handed one (`Settings(native_moe=False)`, `dataclasses.replace(snapshot, ...)`:
how tests switch a path). A flag is on unless its variable is "0".

The switches read "per process" below belong to the process rather than to a model, and are read
through `settings`, the environment as it is when asked: the native library's build, when it is built
(once per process and build: model/native), and Triton's interpreter, when model/attention/triton.py
is imported (Triton itself reads it then). XDG_CACHE_HOME is read both ways: the kernel choice's cache
by the model's snapshot, the native builds' and the checkpoint identities' by the process; and
model/gemv.py's `available` asks `settings` for IRMINSUL_GEMV when a model is packed, beside the
snapshot the kernel choice reads it from.

| variable | attribute | default | read | what it does |
|---|---|---|---|---|
| IRMINSUL_NATIVE | native | on | per process | the native C kernels at all (model/native); 0: torch's kernels only |
| IRMINSUL_NATIVE_DECODE | native_decode | on | at load | native decode attention (eager and inside compiled steps) |
| IRMINSUL_NATIVE_PREFILL | native_prefill | on | at load | native prefill attention |
| IRMINSUL_NATIVE_MOE | native_moe | on | at load | native routed experts (eager and inside compiled steps) |
| IRMINSUL_NATIVE_ELEMENTWISE | native_elementwise | on | at load | native RMSNorm and silu * up |
| IRMINSUL_GEMV | gemv | on | at load | the native one-row products as a candidate of the kernel choice, and attention's per-head products |
| IRMINSUL_NATIVE_MARCH | native_march | native | per process | the build: a VARIANTS name of model/native or any -march |
| IRMINSUL_NATIVE_CACHE | native_cache | $XDG_CACHE_HOME/irminsul/native | per process | where built kernels are kept |
| CC | c_compiler | cc, gcc, clang | per process | the C compiler the kernels are built with |
| IRMINSUL_COMPILE_DECODE | compile_decode | on | at load | compiled decode steps by default (`compile_decode=None`) |
| IRMINSUL_COMPILE_CPP_WRAPPER | compile_cpp_wrapper | on | at load | inductor's C++ wrapper for the compiled steps |
| IRMINSUL_NATIVE_STEP | native_step | measured | at load | whole decode steps in one native call (model/native_step.py): where measured faster than eager; 0: never, 1: always where it runs |
| IRMINSUL_KERNEL_CHOICE | kernel_choice | measured | at load | measured or fixed layouts and kernels (model/kernel_choice.py) |
| IRMINSUL_KERNEL_CACHE | kernel_cache | $XDG_CACHE_HOME/irminsul/kernels-<cpu>.json | at load | the measurements' cache |
| IRMINSUL_KERNEL_COPIES | kernel_copies | 1/3 | at load | oneDNN copies' budget, a fraction of the weight bytes |
| XDG_CACHE_HOME | cache_home | ~/.cache | both | the user's cache directory |
| TRITON_INTERPRET | triton_interpret | off | per process | "1": Triton's CPU interpreter runs the triton backend |
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple


def _text(value: str | None) -> str | None:
    return value


def _flag(value: str | None) -> bool:  # on unless "0"
    return value != "0"


def _path(value: str | None) -> Path | None:
    return Path(value).expanduser() if value else None


def _fraction(value: str | None) -> float | None:
    return float(value) if value else None


def _cache_home(value: str | None) -> Path:
    return Path(value) if value else Path.home() / ".cache"


class _Variable(NamedTuple):
    """An environment variable and how its value (None where unset or empty) becomes a switch."""

    name: str
    parse: Callable[[str | None], Any] = _text

    def read(self, environ: Mapping[str, str]) -> Any:
        return self.parse(environ.get(self.name) or None)


# each attribute of `Settings`, with the variable it is read from
VARIABLES: dict[str, _Variable] = {
    "native": _Variable("IRMINSUL_NATIVE", _flag),
    "native_decode": _Variable("IRMINSUL_NATIVE_DECODE", _flag),
    "native_prefill": _Variable("IRMINSUL_NATIVE_PREFILL", _flag),
    "native_moe": _Variable("IRMINSUL_NATIVE_MOE", _flag),
    "native_elementwise": _Variable("IRMINSUL_NATIVE_ELEMENTWISE", _flag),
    "gemv": _Variable("IRMINSUL_GEMV", _flag),
    "native_march": _Variable("IRMINSUL_NATIVE_MARCH"),
    "native_cache": _Variable("IRMINSUL_NATIVE_CACHE", _path),
    "c_compiler": _Variable("CC"),
    "compile_decode": _Variable("IRMINSUL_COMPILE_DECODE", _flag),
    "compile_cpp_wrapper": _Variable("IRMINSUL_COMPILE_CPP_WRAPPER", _flag),
    "native_step": _Variable("IRMINSUL_NATIVE_STEP"),
    "kernel_choice": _Variable("IRMINSUL_KERNEL_CHOICE"),
    "kernel_cache": _Variable("IRMINSUL_KERNEL_CACHE", _path),
    "kernel_copies": _Variable("IRMINSUL_KERNEL_COPIES", _fraction),
    "cache_home": _Variable("XDG_CACHE_HOME", _cache_home),
    "triton_interpret": _Variable("TRITON_INTERPRET", lambda value: value == "1"),
}


@dataclass(frozen=True)
class Settings:
    """The switches, frozen: `from_env()` reads each variable once; `Settings()` is every default (an
    environment that sets none of them)."""

    native: bool = True
    native_decode: bool = True
    native_prefill: bool = True
    native_moe: bool = True
    native_elementwise: bool = True
    gemv: bool = True
    native_march: str | None = None
    native_cache: Path | None = None
    c_compiler: str | None = None
    compile_decode: bool = True
    compile_cpp_wrapper: bool = True
    native_step: str | None = None  # None: where measured to pay; "0": never; "1": always
    kernel_choice: str | None = None
    kernel_cache: Path | None = None
    kernel_copies: float | None = None
    cache_home: Path = field(default_factory=lambda: _cache_home(None))
    triton_interpret: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Every switch as `environ` (default os.environ) sets it now."""
        env = os.environ if environ is None else environ
        return cls(**{attr: variable.read(env) for attr, variable in VARIABLES.items()})


class _Environment:
    """`settings`: the switches as the environment sets them when each is asked for, for the
    per-process ones (the table's "read" column)."""

    def __getattr__(self, name: str) -> Any:
        if name not in VARIABLES:
            raise AttributeError(name)
        return VARIABLES[name].read(os.environ)


settings = _Environment()
