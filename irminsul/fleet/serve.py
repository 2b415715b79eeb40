"""Irminsul replicas on Ray Serve behind one OpenAI-compatible ingress, routed by content.

    Serve's HTTP proxy -> FleetIngress (1 replica, no CPU of its own: reads, renders, forwards)
                       -> IrminsulReplica x N (one engine each, its own threads or device)
                          routed by ContentRequestRouter, which runs in the ingress's process

`irminsul serve --replicas N` runs it on this host (`run_fleet`). On a cluster: `ray start --head`
on one node and `ray start --address HEAD:6379` on the others, then
`serve run irminsul/fleet/fleet.yaml` (or `serve run irminsul.fleet.serve:app_builder model=PATH
replicas=8 device=cuda ...`: the keys are `irminsul serve`'s flags, `_` or `-` alike, a comma
between the values of a flag that repeats).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from irminsul.server.config import ServerConfig

# `--router`: the content router; Ray Serve's prefix-affinity and power-of-two routers, to compare against
ROUTERS = {
    "content": "irminsul.fleet.ray_router.ContentRequestRouter",
    "prefix": "irminsul.fleet.prefix_router.PrefixAffinityRequestRouter",
    "pow2": "irminsul.fleet.prefix_router.PowerOfTwoRequestRouter",
}
REPLICA, INGRESS, VLLM_REPLICA = "IrminsulReplica", "FleetIngress", "VllmReplica"


@dataclass(frozen=True)
class FleetConfig:
    replicas: int = 2
    threads: int = 1  # each replica's torch / OpenMP threads (and the Ray CPUs it reserves)
    gpus: float = 0  # each replica's devices: 1 for one replica per GPU
    stats_period_s: float = 1.0  # how often Serve polls each replica's load and chunk journal
    router: str = "content"  # a key of ROUTERS
    # the content router counts a request's chunks as on the replica it sent them to for this long, before
    # its journal shows them (ContentRouter's assignment_ttl_s)
    assignment_ttl_s: float = 30.0

    def __post_init__(self):
        if self.replicas < 1:
            raise ValueError(f"--replicas {self.replicas}: a fleet needs at least one replica")
        if self.threads < 1:
            raise ValueError(f"--replica-threads {self.threads} must be at least 1")
        if self.stats_period_s <= 0:
            raise ValueError(f"--stats-period {self.stats_period_s} must be positive")
        if self.router not in ROUTERS:
            raise ValueError(f"--router {self.router!r}: choose one of {', '.join(ROUTERS)}")


def build(config: ServerConfig, fleet: FleetConfig):
    """The Serve application: the ingress bound to the replica deployment."""
    from irminsul.fleet.replica import IrminsulReplica

    replica = _replicas(REPLICA, IrminsulReplica, config, fleet, {})
    return _ingress().bind(replica.bind(config, fleet.threads), config, REPLICA, fleet.replicas)


def build_vllm(vllm_args: list[str], config: ServerConfig, fleet: FleetConfig, env: dict[str, str] | None = None):
    """The Serve application over vLLM replicas (`vllm_replica.py`): `vllm_args` are `irminsul vllm-serve`'s
    (the model first), `config` the ingress's (its `model` the same checkpoint), `env` the replicas'
    environment beyond their threads (vLLM's own variables: VLLM_CPU_KVCACHE_SPACE, ...)."""
    from irminsul.fleet.vllm_replica import VllmReplica

    # NOTE: vLLM binds its CPU worker's threads to cores of its own choosing, the same ones in every
    # replica of a host; unbound, the replicas' threads spread as the OS schedules them
    env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", **(env or {})}
    replica = _replicas(VLLM_REPLICA, VllmReplica, config, fleet, env)
    return _ingress().bind(replica.bind(list(vllm_args)), config, VLLM_REPLICA, fleet.replicas, vllm=True)


def _ingress():
    from ray import serve

    from irminsul.fleet.ingress import FleetIngress

    return serve.deployment(name=INGRESS)(FleetIngress).options(
        num_replicas=1, max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0}
    )


def _replicas(name: str, cls: type, config: ServerConfig, fleet: FleetConfig, env: dict[str, str]):
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    return serve.deployment(name=name)(cls).options(
        num_replicas=fleet.replicas,
        # the engine queues and batches; Serve's own cap only has to stay out of its way
        max_ongoing_requests=config.max_queued_requests + 16,
        ray_actor_options={
            "num_cpus": fleet.threads,
            "num_gpus": fleet.gpus,
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(fleet.threads), **env}},
        },
        # (RequestRouterConfig.__init__ annotates its **kwargs as dict[str, Any]: each value's type, not the mapping's)
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTERS[fleet.router],  # type: ignore[arg-type]  # Ray's **kwargs annotation
            request_routing_stats_period_s=fleet.stats_period_s,  # type: ignore[arg-type]  # (the same)
            request_routing_stats_timeout_s=max(5.0, 4 * fleet.stats_period_s),  # type: ignore[arg-type]  # (the same)
            request_router_kwargs=(  # type: ignore[arg-type]  # (the same)
                {"assignment_ttl_s": fleet.assignment_ttl_s} if fleet.router == "content" else {}
            ),
        ),
        health_check_period_s=2.0,
        graceful_shutdown_timeout_s=10.0,
    )


def configs_from_args(args: argparse.Namespace) -> tuple[ServerConfig, FleetConfig]:
    from irminsul.server.cli import config_from_args
    from irminsul.server.config import ServerConfigError

    try:
        fleet = FleetConfig(args.replicas or 1, args.replica_threads, args.replica_gpus, args.stats_period, args.router)
    except ValueError as e:
        raise ServerConfigError(str(e)) from None
    return config_from_args(args), fleet


def app_builder(args: dict):
    """`serve run irminsul.fleet.serve:app_builder key=value ...`: `irminsul serve`'s flags as keys."""
    from irminsul.cli import build_parser

    argv = ["serve"]
    for key, value in args.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool) or str(value).lower() in ("true", "false"):
            on = value if isinstance(value, bool) else str(value).lower() == "true"
            argv.append(flag if on else "--no-" + flag[2:])
            continue
        for item in value if isinstance(value, list) else str(value).split(","):
            argv += [flag, str(item)]
    parsed = build_parser().parse_args(argv)
    return build(*configs_from_args(parsed))


def run_fleet(config: ServerConfig, fleet: FleetConfig, log_level: str = "info") -> int:
    """The fleet on this host until Ctrl-C or SIGTERM: a local Ray, Serve's proxy on the server's host and port.

    Both signals take one path: Serve and Ray shut down, then whatever Ray started and left running
    (its agents ignore SIGTERM) is killed after REAP_GRACE_S. Ray's workers each lead their own
    process group, so the processes are found by descent from this one, not by group."""
    import logging
    import os
    import signal
    import time

    import ray
    from ray import serve

    log = logging.getLogger("irminsul.fleet")
    # (Ray's prefix router keeps its tree in an actor that needs a CPU to be placed)
    cpus = max(os.cpu_count() or 1, fleet.replicas * fleet.threads + (fleet.router == "prefix"))
    before = _descendants()  # (a --start-redis Redis: its owner stops it)
    try:
        # NOTE: after ray.init, which installs a SIGTERM handler that logs a stack and exits, skipping the shutdown
        # (ray.init annotates logging_level as int; its setup_logger takes a level's name too)
        ray.init(
            num_cpus=cpus,
            include_dashboard=False,
            logging_level=log_level.upper(),  # type: ignore[arg-type]
            runtime_env={"env_vars": {"OMP_NUM_THREADS": str(fleet.threads)}},
        )
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        serve.start(
            http_options={"host": config.host, "port": config.port, "keep_alive_timeout_s": config.timeout_keep_alive}
        )
        serve.run(build(config, fleet), name="irminsul", route_prefix="/")
        log.info(
            "serving a fleet of %d replicas on http://%s:%d (Ctrl-C or SIGTERM stops it)",
            fleet.replicas,
            config.host,
            config.port,
        )
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        log.info("stopping the fleet")
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):  # (a second signal must not cut the shutdown short)
            signal.signal(sig, signal.SIG_IGN)
        started = {pid: start for pid, start in _descendants().items() if before.get(pid) != start}
        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()
            left = _reap(started, REAP_GRACE_S)
            if left:
                log.warning("killed %d process(es) Ray left running after its shutdown", left)
    return 0


REAP_GRACE_S = 5.0  # how long Ray's processes have to exit after ray.shutdown before they are killed


def _descendants() -> dict[int, int]:
    """This process's living descendants, pid: start time (which tells a reused pid); {} without /proc."""
    import os

    parents: dict[int, int] = {}  # pid -> its parent's
    starts: dict[int, int] = {}  # pid -> its start time
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not name.isdigit():
            continue
        stat = _stat(int(name))
        if stat is not None and stat[0] != "Z":
            parents[int(name)], starts[int(name)] = int(stat[1]), int(stat[19])
    found: dict[int, int] = {}
    frontier = {os.getpid()}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier and pid not in found}
        found.update((pid, starts[pid]) for pid in frontier)
    return found


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command's name (state, ppid, ...), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def _reap(processes: dict[int, int], grace_s: float) -> int:
    """SIGKILL those of `processes` (pid: start time) still running after `grace_s`; how many were."""
    import os
    import signal
    import time

    def running() -> list[int]:
        alive = []
        for pid, start in processes.items():
            stat = _stat(pid)
            if stat is not None and stat[0] != "Z" and int(stat[19]) == start:
                alive.append(pid)
        return alive

    end = time.monotonic() + grace_s
    while (left := running()) and time.monotonic() < end:
        time.sleep(0.1)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:  # (it exited meanwhile)
            pass
    return len(left)
