"""The `irminsul` command line.

Each area of the project owns its subcommands in a module of AREAS, which defines
`register(subparsers)` and, optionally, `register_bench(bench_subparsers)` for `irminsul bench ...`.
This file only discovers them, in this order (a later area may add options to an earlier one's
command: the fleet's to `serve`).
"""

import argparse
import importlib
import importlib.metadata
import sys

AREAS = (
    "irminsul.engine.cli",
    "irminsul.research.train.cli",
    "irminsul.research.workloads.cli",
    "irminsul.research.eval.cli",
    "irminsul.server.cli",
    "irminsul.fleet.cli",
    "irminsul.research.bench_serve",
    "irminsul.model.random_checkpoint",
    "irminsul.integrations.vllm.serve",
)


def _area_modules():
    for name in AREAS:
        try:
            yield importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise


DESCRIPTION = "Irminsul: an LLM serving engine for MLA models whose KV cache reuses content at any position."


def version() -> str:
    try:
        return importlib.metadata.version("irminsul")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        from irminsul import __version__

        return __version__


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default in --help, unless its help already says it or there is none to show."""

    def _get_help_string(self, action):
        nothing = action.default is None or action.default is False or action.default == []
        if nothing or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="irminsul", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"irminsul {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="benchmarks that replay traces")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for module in _area_modules():
        if hasattr(module, "register"):
            module.register(sub)
        if hasattr(module, "register_bench"):
            module.register_bench(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_for_people(lambda: args.func(args))


def at_least(low: int):
    """An argparse type: an integer >= low (a clear usage error otherwise, never a crash later)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
        return value

    parse.__name__ = f"integer >= {low}"  # (argparse names the type in its message)
    return parse


def run_for_people(fn, prog: str = "irminsul") -> int:
    """Run a command (the CLI's, or a benchmark script's main): an error meant for people is one
    line on stderr and exit status 2, never a traceback; Ctrl-C is 130."""
    try:
        return int(fn() or 0)
    except KeyboardInterrupt:
        return 130
    except UserFacingError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


from irminsul.errors import UserFacingError  # noqa: E402  (kept last: cli must import cheaply)

if __name__ == "__main__":
    sys.exit(main())
