"""`irminsul serve --replicas N`: the fleet's options on `irminsul serve`, and its launch on this host.

The server's CLI (irminsul/server/cli.py) registers `serve` for one engine; this module, registered
after it, adds the fleet's options to that command and takes it over: without --replicas it serves
one engine exactly as before, with them a Ray Serve fleet (serve.py). The server never imports the
fleet.
"""

from __future__ import annotations

from irminsul.server import cli as server_cli


def register(sub) -> None:
    p = sub.choices["serve"]  # (irminsul.server.cli registers it first: irminsul/cli.py's AREAS)
    fleet = p.add_argument_group(
        "fleet",
        "N engine replicas on Ray Serve behind one ingress, routed by content "
        "(pip install 'irminsul[fleet]'; docs/fleet.md)",
    )
    fleet.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="N",
        help="run N replicas on a local Ray (each its own process, with the options above; the "
        "ingress listens on --host/--port); default: one engine in this process",
    )
    fleet.add_argument(
        "--router",
        choices=("content", "prefix", "pow2"),
        default="content",
        help="how the fleet routes: by content (default), or Ray Serve's prefix-affinity or "
        "power-of-two router, to compare against",
    )
    fleet.add_argument(
        "--replica-threads",
        type=int,
        default=1,
        metavar="N",
        help="torch / OpenMP threads (and Ray CPUs) of each replica",
    )
    fleet.add_argument(
        "--replica-gpus",
        type=float,
        default=0,
        metavar="N",
        help="GPUs each replica reserves (1: one replica per device)",
    )
    fleet.add_argument(
        "--stats-period",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="how often each replica reports its load and its chunk journal's changes to the router",
    )
    p.set_defaults(func=serve)


def serve(args) -> int:
    if args.replicas is None:
        return server_cli.serve(args)
    import signal

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a fleet stops on SIGTERM as on Ctrl-C, its Redis too
    return server_cli.with_local_redis(args, serve_fleet)


def serve_fleet(args) -> int:
    """`--replicas N`: the Ray Serve fleet on this host (serve.py)."""
    import logging

    from irminsul.server.config import ServerConfigError

    try:
        import ray.serve  # noqa: F401
    except ImportError as e:
        raise ServerConfigError(
            f"--replicas needs Ray Serve ({e.name} is not installed): pip install 'irminsul[fleet]'"
        ) from None
    from irminsul.fleet.serve import configs_from_args, run_fleet

    config, fleet = configs_from_args(args)
    server_cli.check_port(config.host, config.port)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run_fleet(config, fleet, args.log_level)
