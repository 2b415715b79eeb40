"""`irminsul serve` and `irminsul bench serve`."""

from __future__ import annotations

import argparse

from irminsul.cli import DefaultsHelpFormatter
from irminsul.kvcache.modes import MODES
from irminsul.kvcache.store import StoreConfig
from irminsul.server.config import ServerConfig

DEFAULTS = ServerConfig()  # every default is the config's: the flags only name them


def register(sub) -> None:
    p = sub.add_parser(
        "serve", help="serve an OpenAI-compatible API with Irminsul's cache", formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled MLA model)")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: folder name)")
    p.add_argument("--host", default=DEFAULTS.host, help="address to listen on")
    p.add_argument("--port", type=int, default=DEFAULTS.port, help="port to listen on")
    p.add_argument(
        "--reuse",
        default=DEFAULTS.reuse,
        choices=MODES,
        help="how cached content is reused (off: full prefill; prefix: exact prefix only)",
    )
    p.add_argument("--dtype", default=DEFAULTS.dtype, choices=["float32", "bfloat16"], help="the model's dtype")
    p.add_argument("--device", default=DEFAULTS.device, help="torch device: cpu, cuda, cuda:1, ...")
    p.add_argument(
        "--attention-backend",
        default=DEFAULTS.attention_backend,
        choices=["cpu", "reference", "triton", "torch"],
        help="cpu: torch's ops with the native CPU kernels where they run (torch: its older name); "
        "reference: torch's ops only; triton: Triton kernels over the pool (a GPU, or "
        "TRITON_INTERPRET=1 for its CPU interpreter)",
    )
    p.add_argument(
        "--compile-decode",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode steps run compiled: torch.compile'd graphs (fp32 MLA on a CPU with a C++ "
        "compiler) or CUDA graphs (--attention-backend triton on a GPU); default: where "
        "available, on a CPU compiled in the background while requests decode eagerly; "
        "--compile-decode: built before serving; --no-compile-decode: eager (vLLM's --enforce-eager)",
    )
    p.add_argument(
        "--store",
        action="append",
        default=None,
        metavar="SPEC",
        help="chunk store tier: memory (always), disk:PATH, redis://host:port/db; repeat to tier them",
    )
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="the latent pool: rows of running requests and cached content, one budget (GiB; default "
        "1 on the CPU, 85%% of the free memory on a GPU)",
    )
    p.add_argument(
        "--tenant-cache-share",
        type=float,
        default=None,
        metavar="SHARE",
        help="keep each API key's cached rows, up to this share of the pool (0-1], from other keys' "
        "admissions (default: one least-recently-used order for everyone)",
    )
    p.add_argument("--disk-budget", default=f"{StoreConfig().disk_bytes / 2**30:g}GiB", help="disk tier budget")
    p.add_argument(
        "--start-redis",
        action="store_true",
        help="start a redis-server for the shared tier at the --store redis://127.0.0.1:PORT/0 address "
        "(no persistence, LRU within 2 GB), stopped with the server or the fleet",
    )
    p.add_argument(
        "--redis-ttl",
        type=int,
        default=None,
        metavar="SECONDS",
        help="expire Redis entries after this long (default: never; Redis's maxmemory policy bounds it)",
    )
    p.add_argument(
        "--redis-timeout",
        type=float,
        default=StoreConfig().redis_timeout_s,
        metavar="SECONDS",
        help="the deadline of one Redis command, connecting and reading the whole reply included; past "
        "it the read is a miss and the tier is skipped until Redis answers again",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="threads for the engine's torch operations and native kernels (default: torch's, the "
        "cores it sees, or 1 where one request ran faster on one thread when this model was "
        "first loaded here); 1 on a machine whose other cores are busy",
    )
    p.add_argument(
        "--max-running-requests",
        type=int,
        default=DEFAULTS.max_running_requests,
        help="requests the engine runs at once; the rest wait",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=DEFAULTS.max_queued_requests,
        help="requests admitted and not yet finished; more get a 429 (Retry-After)",
    )
    p.add_argument(
        "--max-prefill-tokens", type=int, default=DEFAULTS.max_prefill_tokens, help="prefill tokens per engine step"
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=DEFAULTS.default_max_tokens,
        help="max_tokens of a request that sends none",
    )
    p.add_argument(
        "--max-request-bytes",
        default=f"{DEFAULTS.max_request_bytes / 2**20:g}MiB",
        help="larger request bodies get a 413 before they are read",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY=TENANT",
        help="accept this bearer key as this tenant (repeat, or @FILE with one per line)",
    )
    p.add_argument("--admin-key", default=None, help="bearer key that may publish shared chunks")
    p.add_argument(
        "--store-secret",
        default=None,
        help="key of the MAC that authenticates disk and Redis entries (default: the "
        "IRMINSUL_STORE_SECRET environment variable; without one, entries are only checksummed)",
    )
    p.add_argument(
        "--timeout-header",
        type=float,
        default=DEFAULTS.timeout_header,
        metavar="SECONDS",
        help="a request's headers must arrive within this long of their first byte, or the connection "
        "gets a 408 and is closed",
    )
    p.add_argument(
        "--timeout-body",
        type=float,
        default=DEFAULTS.timeout_body,
        metavar="SECONDS",
        help="a request's body must arrive within this long of its headers (408 and closed otherwise)",
    )
    p.add_argument(
        "--timeout-write",
        type=float,
        default=DEFAULTS.timeout_write,
        metavar="SECONDS",
        help="an answer the client does not read (none of its waiting bytes drain for this long) is "
        "dropped and the connection closed",
    )
    p.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=DEFAULTS.timeout_keep_alive,
        metavar="SECONDS",
        help="an idle connection is closed after this long",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="open connections at once; more get a 503 and are closed (default: half the open-file "
        "limit, at most 4096)",
    )
    p.add_argument(
        "--prep-threads",
        type=int,
        default=DEFAULTS.prep_threads,
        help="threads that parse, render, tokenize and compile constraints for requests",
    )
    p.add_argument(
        "--prep-threads-per-tenant",
        type=int,
        default=DEFAULTS.prep_threads_per_tenant,
        help="of those, how many one tenant (API key; without keys, client address) may hold at once",
    )
    p.add_argument(
        "--log-repeats",
        type=int,
        default=DEFAULTS.log_repeats,
        metavar="N",
        help="log a repeated warning or error at most N times a minute (then say how many were left out)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="the least severe log level printed",
    )
    p.set_defaults(func=serve)


def config_from_args(args):
    import os

    from irminsul.server.config import ServerConfig, ServerConfigError, parse_api_keys, parse_bytes

    disk_bytes = parse_bytes(args.disk_budget, "--disk-budget")
    if disk_bytes < 1 and any(s.startswith("disk:") for s in args.store or ()):
        raise ServerConfigError(
            f"--disk-budget {args.disk_budget} holds nothing; give it a size, or drop the disk tier"
        )
    try:
        store = StoreConfig(
            tuple(args.store or ("memory",)),
            disk_bytes=disk_bytes,
            redis_ttl_s=args.redis_ttl,
            redis_timeout_s=args.redis_timeout,
        )
    except ValueError as e:
        raise ServerConfigError(str(e)) from None
    return ServerConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        reuse=args.reuse,
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        compile_decode=args.compile_decode,
        store=store,
        kv_cache_gib=args.kv_cache_gib,
        tenant_cache_share=args.tenant_cache_share,
        threads=args.threads,
        max_running_requests=args.max_running_requests,
        max_queued_requests=args.max_queued_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        default_max_tokens=args.default_max_tokens,
        api_keys=parse_api_keys(args.api_key),
        admin_key=args.admin_key,
        max_request_bytes=parse_bytes(args.max_request_bytes, "--max-request-bytes"),
        timeout_header=args.timeout_header,
        timeout_body=args.timeout_body,
        timeout_keep_alive=args.timeout_keep_alive,
        timeout_write=args.timeout_write,
        max_connections=args.max_connections,
        prep_threads=args.prep_threads,
        prep_threads_per_tenant=args.prep_threads_per_tenant,
        log_repeats=args.log_repeats,
        store_secret=args.store_secret if args.store_secret is not None else os.environ.get("IRMINSUL_STORE_SECRET"),
    )


def uvicorn_config(app, config, log_level: str = "info"):
    """uvicorn's settings for this server: its HTTP protocol with read and write deadlines, the cap on
    a body's pieces and the connection cap (http.py), the keep-alive timeout."""
    import functools

    import uvicorn

    from irminsul.server.http import ConnectionLimits, GuardedH11Protocol

    # a body may arrive in pieces of 256 bytes on average (a slow but honest upload's reads are larger)
    limits = ConnectionLimits(
        config.timeout_header,
        config.timeout_body,
        config.connection_limit,
        config.timeout_write,
        max(16384, config.max_request_bytes // 256),
    )
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=config.timeout_keep_alive,
        # uvicorn annotates `http` as a class; it only calls it, so a factory serves
        http=functools.partial(GuardedH11Protocol, limits=limits),  # type: ignore[arg-type]
    )


def check_port(host: str, port: int) -> None:
    """A ServerConfigError if nothing can listen on host:port now (in use, or not this machine's)."""
    import socket

    from irminsul.server.config import ServerConfigError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ServerConfigError(f"--host {host}: not an address of this machine ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as e:
            raise ServerConfigError(
                f"--port {port}: cannot listen on {host}:{port} ({e.strerror}); is another server running there?"
            ) from None


def serve(args) -> int:
    """One engine in this process (with --start-redis, the Redis of its shared tier too). The fleet's
    `--replicas N` is irminsul/fleet/cli.py's, which adds its options to this command."""
    return with_local_redis(args, serve_one)


def with_local_redis(args, run) -> int:
    """``run(args)``, within the lifetime of the redis-server --start-redis asks for."""
    if not args.start_redis:
        return run(args)
    from irminsul.server.config import ServerConfigError
    from irminsul.server.local_redis import LocalRedis

    url = next((s for s in args.store or () if s.startswith("redis://")), None)
    if url is None:
        raise ServerConfigError("--start-redis needs the address to start it at: --store redis://127.0.0.1:PORT/0")
    redis = LocalRedis(url)
    print(
        f"started redis-server on {redis.host}:{redis.port} for the shared tier (stopped with the server)", flush=True
    )
    try:
        return run(args)
    finally:
        redis.stop()


def serve_one(args) -> int:
    import logging

    import uvicorn

    from irminsul.server import logs
    from irminsul.server.app import create_app
    from irminsul.server.state import ServerState

    config = config_from_args(args)
    check_port(config.host, config.port)  # before the model loads and compiles, not after
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    state = ServerState(config)  # loads the model; errors reach the CLI's one-line handler
    try:
        server = uvicorn.Server(uvicorn_config(create_app(config, state), config, args.log_level))
        logs.install(config.log_repeats)  # (after uvicorn has set up its handlers)
        try:
            server.run()
        except KeyboardInterrupt:
            pass
        if not server.started:
            return 1
    finally:
        # NOTE: a forced exit (a second Ctrl-C) skips the app's shutdown; the engine thread must still be
        # stopped before the interpreter exits, or it dies inside a torch call and the process aborts
        state.close()
    return 0
