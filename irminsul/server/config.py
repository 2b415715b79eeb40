"""The server's configuration: one frozen dataclass, validated at construction."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from irminsul.errors import UserFacingError
from irminsul.kvcache.modes import MODES
from irminsul.kvcache.store import StoreConfig

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


class ServerConfigError(UserFacingError, ValueError):
    """A server option is invalid; the message names the flag."""


def parse_bytes(text: str | int, flag: str = "size") -> int:
    """'512MiB', '2GB', '1e9' or an int -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ServerConfigError(f"{flag}={text!r} is not a size; write e.g. 512MiB, 2GB or 1000000")
    try:
        return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    except ValueError:
        raise ServerConfigError(f"{flag}={text!r} is not a size; write e.g. 512MiB, 2GB or 1000000") from None


def parse_api_keys(items: list[str] | tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """['KEY=TENANT', ...] or a file path ('@keys.txt', one KEY=TENANT per line) -> pairs."""
    lines: list[str] = []
    for item in items:
        if item.startswith("@"):
            try:
                text = Path(item[1:]).read_text()
            except OSError as e:
                raise ServerConfigError(f"--api-key {item}: cannot read {item[1:]} ({e.strerror})") from None
            lines += [s.strip() for s in text.splitlines() if s.strip() and s[0] != "#"]
        else:
            lines.append(item)
    pairs = []
    for line in lines:
        key, sep, tenant = line.partition("=")
        if not sep or not key or not tenant:
            raise ServerConfigError(f"--api-key {line!r} must look like KEY=TENANT")
        pairs.append((key, tenant))
    return tuple(pairs)


@dataclass(frozen=True)
class ServerConfig:
    model: str | None = None  # checkpoint directory; None: the bundled MLA model
    served_model_name: str | None = None  # the name clients send as "model"; default: the folder name
    host: str = "127.0.0.1"
    port: int = 8000
    reuse: str = "pic"
    dtype: str = "float32"
    device: str = "cpu"
    attention_backend: str = "cpu"  # cpu | reference | triton (a GPU, or TRITON_INTERPRET=1); torch: cpu's older name
    compile_decode: bool | None = (
        None  # compiled decode steps (model/compiled.py, model/graphs.py); None: where available
    )
    store: StoreConfig = field(default_factory=StoreConfig)
    kv_cache_gib: float | None = None  # the latent pool, one budget; None: the device's default (engine.py)
    tenant_cache_share: float | None = (
        None  # each API key's cached rows kept from other keys' admissions, up to this share
    )
    threads: int | None = None  # torch's intra-op threads; None: torch's default or 1, measured (model/threads.py)
    max_running_requests: int = 64
    max_queued_requests: int = 1024
    max_prefill_tokens: int = 2048  # per engine step; longer prompts are prefilled in chunks
    default_max_tokens: int = 256
    max_request_bytes: int = 8 * 2**20  # larger bodies get a 413 before they are read
    api_keys: tuple[tuple[str, str], ...] = ()  # (key, tenant); empty: no authentication
    admin_key: str | None = None  # required to publish shared chunks
    store_secret: str | None = field(default=None, repr=False)  # keys the MAC of disk and Redis entries
    # slow clients (http.py): seconds for a request's headers, for its body, idle between requests
    timeout_header: float = 10.0
    timeout_body: float = 60.0
    timeout_keep_alive: float = 5.0  # uvicorn's default
    timeout_write: float = 30.0  # an answer waiting to be written, none of it read for this long, is dropped
    max_connections: int | None = None  # None: half the open-file limit, at most 4096 (connection_limit)
    # request preparation (workers.py): threads, and how many of them one tenant may hold at once
    prep_threads: int = 8
    prep_threads_per_tenant: int = 2
    log_repeats: int = 10  # a repeated warning or error is logged at most this often a minute (logs.py)

    def __post_init__(self):
        if self.reuse not in MODES:
            raise ServerConfigError(f"--reuse {self.reuse!r}: choose one of {', '.join(MODES)}")
        if not 0 <= self.port < 65536:
            raise ServerConfigError(f"--port {self.port} is not a TCP port")
        for name in (
            "max_running_requests",
            "max_queued_requests",
            "max_prefill_tokens",
            "default_max_tokens",
            "max_request_bytes",
            "prep_threads",
            "prep_threads_per_tenant",
            "log_repeats",
        ):
            if getattr(self, name) < 1:
                raise ServerConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise ServerConfigError(f"--kv-cache-gib must be > 0, got {self.kv_cache_gib}")
        if self.tenant_cache_share is not None and not 0 < self.tenant_cache_share <= 1:
            raise ServerConfigError(f"--tenant-cache-share must be in (0, 1], got {self.tenant_cache_share}")
        for name in ("timeout_header", "timeout_body", "timeout_keep_alive", "timeout_write"):
            if not getattr(self, name) > 0:
                raise ServerConfigError(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(self, name)}")
        if self.threads is not None and self.threads < 1:
            raise ServerConfigError(f"--threads must be >= 1, got {self.threads}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ServerConfigError(f"--max-connections must be >= 1, got {self.max_connections}")
        if self.prep_threads_per_tenant > self.prep_threads:
            raise ServerConfigError(
                f"--prep-threads-per-tenant {self.prep_threads_per_tenant} is more than "
                f"--prep-threads {self.prep_threads}"
            )
        if len({k for k, _ in self.api_keys}) != len(self.api_keys):
            raise ServerConfigError("--api-key lists the same key twice")

    @property
    def tenants(self) -> dict[str, str]:
        return dict(self.api_keys)

    @property
    def connection_limit(self) -> int:
        """Open connections served at once: --max-connections, else half the process's open-file
        limit (the other half for the checkpoint, the stores and the engine), at most 4096."""
        if self.max_connections is not None:
            return self.max_connections
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return max(16, min(4096, soft // 2)) if soft != resource.RLIM_INFINITY else 4096
