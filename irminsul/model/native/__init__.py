"""Native CPU kernels: C sources shipped with the package, built for the CPU they run on at first use.

`library()` compiles the sources (`gemv.c`: products of a few rows; `mla_decode.c`: MLA decode
attention read from the latent pool; `prefill_attention.c`: expanded prefill attention;
`elementwise.c`: RMSNorm and SwiGLU's silu(gate) * up in one pass; `moe.c`: the routed experts of
a few tokens; `step.c`: a whole float32 decode step over the others, model/native_step.py;
`common.h`: what they share) into one shared
library with the C compiler found (`CC`, else cc, gcc or clang) and `-march=native` (or a named
variant: `VARIANTS`, `library(variant)`), into a cache
directory keyed by the sources, the flags, the compiler's version and the CPU's model and flags
(`IRMINSUL_NATIVE_CACHE`, default ~/.cache/irminsul/native), and loads it with ctypes; a second
process loads the cached library.

With no compiler, or a build that fails, it is None and callers keep torch's kernels
(`IRMINSUL_NATIVE=0` turns the kernels off). A build takes ~0.5 s.

The kernels share their work among the threads each call is given (`#pragma omp parallel for`, the
thread count an argument, torch's own count where the wrappers call them). They are built with
-fopenmp where the compiler takes it and torch's parallel backend is OpenMP: the library's libgomp.so.1
is then the one torch loaded (its wheel ships it; the dynamic linker finds it by that name), one
runtime and one pool of threads for torch's operators and these kernels. Elsewhere the pragmas are
ignored and every kernel runs on one thread.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from irminsul.model.settings import settings

log = logging.getLogger("irminsul.model")

SOURCES = [
    Path(__file__).with_name(n)
    for n in ("gemv.c", "mla_decode.c", "prefill_attention.c", "elementwise.c", "moe.c", "step.c")
]
HEADERS = [Path(__file__).with_name(n) for n in ("common.h", "simd.h")]
# reassociating the sums (they are fp32 sums of fp32 products, in any order: torch's kernels reorder
# them too) lets the compiler vectorise the plain loops; no -ffast-math (it would also assume no NaN)
FLAGS = ["-O3", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-fPIC", "-shared"]


# The named builds (-march targets, x86-64 psABI levels) and the /proc/cpuinfo flags a CPU needs to run
# each: the kernels' vector layer (simd.h) takes AVX-512 on v4, AVX2 + FMA on v3, its plain loops on
# x86-64 (SSE2). "native" is the CPU it is built on.
_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"})
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
VARIANTS = {
    "x86-64-v4": _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
    "x86-64-v3": _V3,
    "x86-64": frozenset(),
    "native": frozenset(),
}


@functools.cache
def default_variant() -> str:
    """IRMINSUL_NATIVE_MARCH (a VARIANTS name, or any -march value), else "native": read once per process
    (every kernel call asks for the library; `library.cache_clear()` or
    `default_variant.cache_clear()` reads it again)."""
    return settings.native_march or "native"


def runnable(variant: str) -> bool:
    """Whether this CPU executes `variant`'s build: native always; an x86 one where /proc/cpuinfo lists
    every flag it needs (on x86-64); any other -march value is taken on trust."""
    if variant == "native" or variant not in VARIANTS:
        return True
    from irminsul.machine import cpu_flags

    return platform.machine() in ("x86_64", "AMD64") and VARIANTS[variant] <= cpu_flags()


def variants() -> list[str]:
    """The named builds other than native that this CPU executes (the tests run each kernel on each)."""
    return [v for v in VARIANTS if v != "native" and runnable(v)]


def _flags(variant: str | None = None) -> list[str]:
    """FLAGS, -fopenmp where `_openmp` says so, and the target: -march=`variant` (default_variant())."""
    cc = _compiler()
    omp = ["-fopenmp"] if cc is not None and _openmp(cc) else []
    return [*FLAGS, *omp, f"-march={variant or default_variant()}"]


def _torch_uses_openmp() -> bool:
    import torch

    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


_PROBE = (
    "#include <omp.h>\nint irm_probe(void) { int n = 0;\n#pragma omp parallel reduction(+:n)\nn += 1;\n"
    "return n + omp_get_thread_num(); }\n"
)


@functools.cache
def _openmp(cc: str) -> bool:
    """Whether the kernels are built with -fopenmp: torch's parallel backend is OpenMP, and `cc`
    builds a shared library with it that names libgomp.so.1 (GCC's runtime, the one torch's wheel
    loads; clang's -fopenmp would bring a second runtime, libomp). Said once in the log where not."""
    why = None
    if not _torch_uses_openmp():
        why = "torch's parallel backend is not OpenMP"
    else:
        with tempfile.TemporaryDirectory() as tmp:
            src, out = Path(tmp) / "probe.c", Path(tmp) / "probe.so"
            src.write_text(_PROBE)
            try:
                built = (
                    subprocess.run(
                        [cc, "-fopenmp", "-fPIC", "-shared", str(src), "-o", str(out)], capture_output=True, timeout=60
                    ).returncode
                    == 0
                )
            except (OSError, subprocess.SubprocessError):
                built = False
            if not built:
                why = f"{cc} does not build with -fopenmp"
            elif b"libgomp.so.1" not in out.read_bytes():
                why = f"{cc}'s OpenMP runtime is not libgomp, torch's"
    if why:
        log.info("the native kernels run on one thread: %s", why)
    return why is None


def _compiler() -> str | None:
    for name in (settings.c_compiler, "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_line() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = [x for x in f if x.startswith(("model name", "flags"))][:2]
        return "".join(info)
    except OSError:
        import platform

        return platform.processor()


def cache_dir() -> Path:
    """IRMINSUL_NATIVE_CACHE, else irminsul/native in the user's cache directory ($XDG_CACHE_HOME or
    ~/.cache, as kernel_choice's cache)."""
    if settings.native_cache is not None:
        return settings.native_cache
    return settings.cache_home / "irminsul" / "native"


@functools.cache
def _compiler_version(cc: str) -> str:
    return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout


def _key(cc: str, sources: list[Path] | None = None, variant: str | None = None) -> str:
    """What the built library (or the kernel in `sources`) depends on: the sources, the shared headers,
    the flags (the variant's among them), the compiler's version, the CPU."""
    parts = [src.read_text() for src in (SOURCES if sources is None else sources) + HEADERS]
    parts += [" ".join(_flags(variant)), _compiler_version(cc), _cpu_line()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def fingerprint(source: str | None = None) -> str:
    """A short name of the library `library()` loads (empty without one): its key, read from its
    file name (`kernels-<key>.so`); with `source` (a file name of SOURCES), the key of that kernel
    alone. kernel_choice keys the times it measured for a kernel by the latter, so a changed kernel
    is timed again and a change to another leaves its times be (re-timing every shape after any
    change made choices within the box's noise flip between builds: one build's LM head took gemv,
    the next F.linear)."""
    lib = library()
    if lib is None:
        return ""
    if source is None:
        return Path(lib._name).stem.removeprefix("kernels-")[:8]
    return _key(_compiler(), [Path(__file__).with_name(source)])[:8]


def _build(cc: str, variant: str) -> Path:
    key = _key(cc, variant=variant)
    lib = cache_dir() / f"kernels-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)  # built beside it, then renamed: no half-written library
    os.close(fd)
    try:
        subprocess.run(
            [cc, *_flags(variant), *map(str, SOURCES), "-o", tmp, "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def library(variant: str | None = None) -> ctypes.CDLL | None:
    """The built kernels, or None (no compiler, a failed build, IRMINSUL_NATIVE=0); built once per
    process. `variant` (a VARIANTS name, default default_variant()): that build, side by side with the
    others in its own cache file; None where this CPU cannot execute it (`runnable`)."""
    return _library(variant or default_variant())


@functools.cache
def _library(variant: str) -> ctypes.CDLL | None:
    """library(variant), cached per variant (library.cache_clear() forgets every one)."""
    if not settings.native:
        return None
    cc = _compiler()
    if cc is None:
        log.info("no C compiler found: the native kernels are off")
        return None
    if not runnable(variant):
        log.info("this CPU cannot execute the %s build of the native kernels", variant)
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc, variant)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("the native kernels did not build (%s): torch's kernels are used", str(detail).strip()[:500])
        return None
    _declare(lib)
    return lib


def _forget() -> None:
    _library.cache_clear()
    default_variant.cache_clear()


library.cache_clear = _forget


def _declare(lib: ctypes.CDLL) -> None:
    """The kernels' signatures; each takes the threads it may use as its last argument."""
    c_long, c_int, c_void = ctypes.c_long, ctypes.c_int, ctypes.c_void_p
    lib.irm_linear.argtypes = [
        c_void,
        c_int,
        c_long,
        c_long,
        c_void,
        c_int,
        c_long,
        c_long,
        c_long,
        c_void,
        c_int,
        c_void,
        c_int,
        c_long,
        c_int,
    ]
    lib.irm_linear.restype = c_int
    lib.irm_gemv_set_prefetch.argtypes = [c_long]
    lib.irm_gemv_set_prefetch.restype = None
    lib.irm_heads_linear.argtypes = [
        c_void,
        c_int,
        c_long,
        c_long,
        c_long,
        c_long,
        c_void,
        c_int,
        c_long,
        c_long,
        c_long,
        c_long,
        c_void,
        c_int,
        c_long,
        c_long,
        c_int,
    ]
    lib.irm_heads_linear.restype = c_int
    lib.irm_max_rows.restype = c_int
    lib.irm_openmp.restype = c_int
    lib.irm_mla_decode.argtypes = [
        c_void,
        c_long,
        c_long,
        c_long,
        c_long,
        c_void,
        c_int,
        c_long,
        c_void,
        c_long,
        c_void,
        c_void,
        c_long,
        c_int,
        ctypes.c_float,
        c_void,
        c_long,
        c_void,
        c_int,
    ]
    lib.irm_mla_decode.restype = c_int
    lib.irm_prefill_attention.argtypes = (
        [c_long] * 7
        + [c_void, c_long, c_long, c_long] * 3
        + [c_void, c_long, c_long]
        + [c_void, c_long, c_long, c_long]
        + [c_void] * 3
        + [ctypes.c_float]
        + [c_void, c_long, c_long, c_long, c_int]
    )
    lib.irm_prefill_attention.restype = c_int
    lib.irm_vectorised.restype = c_int
    c_float = ctypes.c_float
    lib.irm_rms_norm.argtypes = [c_void, c_long, c_long, c_long, c_void, c_float, c_void, c_long, c_int]
    lib.irm_rms_norm.restype = None
    lib.irm_rms_norm_bf16.argtypes = [c_void, c_long, c_long, c_long, c_void, c_float, c_void, c_long, c_int]
    lib.irm_rms_norm_bf16.restype = None
    lib.irm_silu_mul.argtypes = [c_void, c_long, c_long, c_long, c_void, c_long, c_int]
    lib.irm_silu_mul.restype = None
    lib.irm_moe.argtypes = [
        c_void,
        c_long,
        c_long,
        c_long,
        c_void,
        c_void,
        c_long,
        c_long,
        c_long,
        c_void,
        c_long,
        c_long,
        c_long,
        c_void,
        c_long,
        c_long,
        c_long,
        c_void,
        c_long,
        c_int,
    ]
    lib.irm_moe.restype = c_int
    lib.irm_moe_has_bf16.restype = c_int
    lib.irm_moe_bf16.argtypes = [
        c_void,
        c_long,
        c_long,
        c_long,
        c_void,
        c_void,
        c_long,
        c_long,
        c_long,
        c_void,
        c_long,
        c_long,
        c_void,
        c_long,
        c_long,
        c_void,
        c_long,
        c_int,
    ]
    lib.irm_moe_bf16.restype = c_int
