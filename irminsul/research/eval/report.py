"""Writing an evaluation's outputs: a table on stdout (or one JSON object with --json), and
`<out>/<name>.json`, `<name>.md` and `<name>.png`, each recording how the run was made."""

from __future__ import annotations

import json
import math
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from irminsul.machine import describe


@dataclass(frozen=True)
class RunInfo:
    command: str
    seed: int
    model: str
    n: int
    started_utc: str
    wall_s: float
    machine: str
    torch: str
    threads: int

    @classmethod
    def now(cls, args, model: str, started: float) -> RunInfo:
        argv = getattr(args, "argv", None) or sys.argv
        command = "irminsul " + shlex.join(argv[1:]) if argv and argv[0].endswith("irminsul") else shlex.join(argv)
        return cls(
            command=command,
            seed=args.seed,
            model=str(model),
            n=args.n,
            started_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            wall_s=round(time.time() - started, 1),
            machine=describe(),
            torch=torch.__version__,
            threads=torch.get_num_threads(),
        )


def jsonable(obj):
    """Tuples -> lists, numpy scalars -> floats, NaN/inf -> None, dict keys -> str (strict JSON)."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, (str, bytes)):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def emit(name: str, result, args, model: str, started: float) -> dict:
    """Write <out>/<name>.{json,md,png}; print the table (or the JSON object with --json)."""
    info = RunInfo.now(args, model, started)
    data = jsonable(result.to_json() | {"run": asdict(info)})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    text = result.table()
    (out / f"{name}.md").write_text(
        f"`{info.command}` (seed {info.seed}, model {info.model}, {info.started_utc}, {info.wall_s} s)\n\n{text}\n"
    )
    png = result.plot(out / f"{name}.png")
    if args.json:
        print(json.dumps(data))
    else:
        print(text)
        print(f"\nwrote {out / (name + '.json')}, {out / (name + '.md')}, {png}  ({info.wall_s} s; {info.command})")
    return data
