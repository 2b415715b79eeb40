"""deploy/: the fleet under systemd (irminsul-fleet.service) and on Kubernetes with KubeRay (rayservice.yaml).

Nothing here starts Ray or a cluster. The RayService manifest is checked against KubeRay's own schema
(its CustomResourceDefinition, tests/data/ray.io_rayservices.yaml), its Serve config against Ray
Serve's, and its application's args against `irminsul serve`'s parser, the way `serve run` hands them
to `app_builder`; the unit is parsed, its command line read by the same parser, and checked with
`systemd-analyze verify` where that is installed.
"""

import configparser
import copy
import importlib
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy" / "irminsul-fleet.service"
MANIFEST = ROOT / "deploy" / "rayservice.yaml"
CRD = ROOT / "tests" / "data" / "ray.io_rayservices.yaml"
FLEET_YAML = ROOT / "irminsul" / "fleet" / "fleet.yaml"

# SIGTERM to the fleet's exit, every process it started gone: the bound tests/fleet/test_operations.py holds it to
FLEET_STOP_S = 30


def manifest() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def serve_config(doc: dict) -> dict:
    return yaml.safe_load(doc["spec"]["serveConfigV2"])


def closed(schema):
    """`schema` with every object that lists its properties closed to others: what a Kubernetes API server
    with strict field validation (`kubectl apply --validate=strict`) rejects, instead of dropping."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k != "properties" else {p: closed(s) for p, s in v.items()} for k, v in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema:
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    return out


def crd_validator() -> jsonschema.Draft4Validator:
    crd = yaml.safe_load(CRD.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    # (OpenAPI v3's schema objects are JSON Schema draft 4's keywords, plus the x-kubernetes-* that jsonschema ignores)
    return jsonschema.Draft4Validator(closed(v1["schema"]["openAPIV3Schema"]))


def errors(validator, doc) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


# -- the RayService manifest


def test_the_manifest_is_a_rayservice_that_kuberays_schema_accepts():
    crd = yaml.safe_load(CRD.read_text())
    doc = manifest()
    assert doc["apiVersion"] == f"{crd['spec']['group']}/v1" == "ray.io/v1"
    assert doc["kind"] == crd["spec"]["names"]["kind"] == "RayService"
    found = errors(crd_validator(), doc)
    assert not found, found


def test_the_schema_check_can_fail():
    validator, doc = crd_validator(), manifest()
    cases = []
    typo = copy.deepcopy(doc)  # a misspelt field (an API server without strict field validation drops it in silence)
    container = typo["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    cases.append(typo)
    wrong_type = copy.deepcopy(doc)  # rayStartParams are strings
    wrong_type["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["rayStartParams"]["num-cpus"] = 2
    cases.append(wrong_type)
    missing = copy.deepcopy(doc)  # a worker group needs its name
    del missing["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["groupName"]
    cases.append(missing)
    for case in cases:
        assert errors(validator, case)


def test_the_serve_config_runs_the_fleet_application_of_fleet_yaml():
    from ray.serve.schema import ServeDeploySchema  # (Ray Serve's own check of a config; starts nothing)

    config = serve_config(manifest())
    ServeDeploySchema.model_validate(config)
    fleet_yaml = yaml.safe_load(FLEET_YAML.read_text())
    ServeDeploySchema.model_validate(fleet_yaml)
    (app,), (reference,) = config["applications"], fleet_yaml["applications"]
    assert app["import_path"] == reference["import_path"] == "irminsul.fleet.serve:app_builder"
    assert app["route_prefix"] == "/"
    # the same args as fleet.yaml's, the fleet's size apart
    assert {k: v for k, v in app["args"].items() if k != "replicas"} == {
        k: v for k, v in reference["args"].items() if k != "replicas"
    }


def test_app_builder_takes_the_args(monkeypatch):
    """`serve run` calls app_builder with the args; it reads them with `irminsul serve`'s parser (an
    unknown key or a bad value exits there) and builds the application from the configs."""
    import irminsul.fleet.serve as fleet_serve

    built = []
    monkeypatch.setattr(fleet_serve, "build", lambda config, fleet: built.append((config, fleet)) or "app")
    (app,) = serve_config(manifest())["applications"]
    args = app["args"]
    module, name = app["import_path"].split(":")
    assert getattr(importlib.import_module(module), name)(dict(args)) == "app"
    ((config, fleet),) = built
    assert (fleet.replicas, fleet.threads, fleet.gpus) == (args["replicas"], args["replica_threads"], 0)
    assert fleet.stats_period_s == args["stats_period"] and config.reuse == args["reuse"]
    with pytest.raises(SystemExit):  # (the parser's answer to a key `irminsul serve` does not have)
        fleet_serve.app_builder({**args, "replica_cpus": 1})


def test_one_replica_a_worker_cpu():
    doc = manifest()
    args = serve_config(doc)["applications"][0]["args"]
    cluster = doc["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # (no replica on the head)
    cpus = 0
    for group in cluster["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        resources = container["resources"]
        assert resources["requests"]["cpu"] == resources["limits"]["cpu"] == group["rayStartParams"]["num-cpus"]
        assert group["minReplicas"] == group["replicas"] == group["maxReplicas"]  # (a fleet of fixed size)
        cpus += group["replicas"] * int(group["rayStartParams"]["num-cpus"])
    assert args["replicas"] * args["replica_threads"] == cpus
    assert cluster["rayVersion"].startswith("2.60.")  # irminsul[fleet]'s pin


def test_workers_are_ready_while_the_fleet_serves_health():
    from irminsul.fleet.ingress import api

    assert "get" in api.openapi()["paths"]["/health"]  # the fleet's readiness answer (the ingress's route)
    doc = manifest()
    port = serve_config(doc)["http_options"]["port"]
    assert serve_config(doc)["proxy_location"] == "EveryNode"  # (each worker's own proxy answers its probe)
    for group in doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["serve"] == port  # (the port KubeRay's serve Service targets, by that name)
        probe = container["readinessProbe"]["httpGet"]
        assert probe["path"] == "/health" and probe["port"] in ("serve", port), probe
        assert "livenessProbe" not in container  # (KubeRay's own: /health speaks for the whole fleet)
    # the head: KubeRay deploys the application once the head is ready, so the head keeps KubeRay's probes
    # and stays out of the serve Service, whose endpoints are then the workers the probe found ready
    head = doc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "readinessProbe" not in head and "livenessProbe" not in head
    assert doc["spec"]["excludeHeadPodFromServeSvc"] is True


def test_ray_asks_for_its_token():
    # (as a local Ray 2.60 does by default; KubeRay makes the Secret and reads it to deploy the application)
    assert manifest()["spec"]["rayClusterConfig"]["authOptions"]["mode"] == "token"


# -- the systemd unit


def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=False, comment_prefixes=("#", ";"))
    parser.optionxform = str  # (systemd's keys are case-sensitive)
    # (a value continued with a trailing backslash: configparser keeps the indented lines, joined by newlines)
    parser.read_string(re.sub(r"\\\n\s*", " ", UNIT.read_text()))
    return parser


def seconds(span: str) -> float:
    """A systemd time span ("90", "1min 30s", "infinity") in seconds."""
    units = {"us": 1e-6, "ms": 1e-3, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600}
    if span.strip() == "infinity":
        return float("inf")
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", span)
    assert parts and "".join(n + u for n, u in parts) == span.replace(" ", ""), span
    return sum(float(n) * units[u or "s"] for n, u in parts)


def test_the_unit_runs_the_fleet_and_stops_it_with_sigterm():
    from irminsul.cli import build_parser

    service = unit()["Service"]
    argv = shlex.split(service["ExecStart"])
    assert argv[0].startswith("/") and argv[0].endswith("/bin/irminsul"), argv  # (systemd wants a full path)
    assert argv[1:3] == ["serve", "--replicas"], argv
    args = build_parser().parse_args(argv[1:])  # every flag is one of `irminsul serve`'s
    assert args.replicas >= 1
    if args.start_redis:  # (--start-redis starts its Redis at the --store address)
        assert any(s.startswith("redis://127.0.0.1:") for s in args.store), args.store
    assert service["KillSignal"] == "SIGTERM"
    # SIGTERM to `irminsul serve` alone, which stops Ray and the Redis in order; SIGKILL to what is left after
    assert service["KillMode"] == "mixed"
    assert seconds(service["TimeoutStopSec"]) >= FLEET_STOP_S
    assert service["Restart"] == "on-failure"
    assert unit()["Install"]["WantedBy"] == "multi-user.target"


def test_time_spans_are_read_as_systemd_reads_them():
    assert seconds("60") == seconds("60s") == seconds("1min") == 60
    assert seconds("1min 30s") == 90 and seconds("infinity") == float("inf")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verifies_the_unit(tmp_path):
    """The unit as systemd reads it, with its placeholder venv replaced by this one's (verify checks that
    ExecStart's program exists); systemd-analyze warns, not fails, on an unknown key or a bad value."""
    irminsul = Path(sys.executable).parent / "irminsul"
    if not irminsul.exists():
        pytest.skip("no irminsul script beside this Python")
    text = UNIT.read_text()
    program = shlex.split(unit()["Service"]["ExecStart"])[0]
    copy_ = tmp_path / UNIT.name
    copy_.write_text(text.replace(program, str(irminsul)))
    run = subprocess.run(["systemd-analyze", "verify", str(copy_)], capture_output=True, text=True, timeout=60)
    said = [line for line in (run.stdout + run.stderr).splitlines() if UNIT.name in line]
    assert run.returncode == 0 and not said, run.stdout + run.stderr
    # (and the check can fail)
    copy_.write_text(text.replace(program, str(irminsul)).replace("KillMode=mixed", "KillMode=mixd"))
    run = subprocess.run(["systemd-analyze", "verify", str(copy_)], capture_output=True, text=True, timeout=60)
    assert any(UNIT.name in line and "kill mode" in line for line in run.stderr.splitlines()), run.stderr
