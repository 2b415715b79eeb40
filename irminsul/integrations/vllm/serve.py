"""`irminsul vllm-serve MODEL [vLLM's serve options]`: vLLM's OpenAI server with Irminsul inside.

It is `vllm serve` — vLLM's own parser, options and server — with what Irminsul needs filled in where
the command line leaves it out:

- `--kv-transfer-config`: Irminsul's connector (`CONNECTOR`); a config that names no connector keeps
  its `kv_connector_extra_config` (tenant, registry_gib, sink, publish_salt, after_load_chunk);
- `--scheduler-cls`: `IrminsulScheduler` (`SCHEDULER`);
- `--no-async-scheduling`: that scheduler is vLLM's synchronous `Scheduler` with two overrides;
- on a CPU, `--attention-backend CPU_MLA`: the cache layout the connector reads and writes (on a CPU
  with AMX, vLLM would pick its AMX backend, whose layout differs);
- `--enable-prompt-tokens-details`: every answer's `usage.prompt_tokens_details.cached_tokens`, the
  rows Irminsul loaded included;
- on a CPU, `VLLM_CPU_NUM_OF_RESERVED_CPU` (vLLM's variable) unless it is set: the cores vLLM reserves
  without a KV connector, so the worker computes on the cores vLLM alone would (`reserve_cores`).

`vllm serve` itself does not start with the `vllm-cpu` distribution: vLLM's CLI looks up
`importlib.metadata.version("vllm")` for its `--version` before it parses anything, and that
distribution is named `vllm-cpu`. This command builds the serve subcommand's parser without vLLM's CLI
around it, so that lookup never runs. Nothing here imports vLLM until the command runs: `irminsul`
lists the command without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import MutableMapping

from irminsul.errors import UserFacingError

USAGE = "irminsul vllm-serve MODEL [vLLM serve options]"
DESCRIPTION = (
    "vLLM's OpenAI-compatible server (`vllm serve`) with Irminsul's KV connector and scheduler: "
    "prompts reuse stored chunks at any position. Every option is vLLM's; left out, "
    "--kv-transfer-config, --scheduler-cls, --no-async-scheduling, --enable-prompt-tokens-details "
    "and, on a CPU, --attention-backend CPU_MLA are filled in (docs/vllm.md)."
)


def register(subparsers) -> None:
    # NOTE: every argument is vLLM's and vLLM's parser reads them (its --help included); this parser
    # has no option prefix of its own, so it hands them all over as they are
    p = subparsers.add_parser(
        "vllm-serve",
        help="vLLM's OpenAI server with Irminsul's connector (docs/vllm.md)",
        usage=USAGE,
        add_help=False,
        prefix_chars="\x01",
    )
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="vLLM's own arguments, passed on as they are")
    p.set_defaults(func=lambda args: serve(args.vllm_args))


def parse(argv: list[str]) -> argparse.Namespace:
    """vLLM serve's arguments from argv, with Irminsul's filled in where argv leaves them out."""
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "vllm":
            raise
        raise UserFacingError(
            "vLLM is not installed in this environment: pip install -e '.[vllm]' (docs/vllm.md)"
        ) from None
    parser = make_arg_parser(FlexibleArgumentParser(prog="irminsul vllm-serve", usage=USAGE, description=DESCRIPTION))
    parser.set_defaults(enable_prompt_tokens_details=True)
    args = parser.parse_args(argv)
    _fill(args)
    return args


def _fill(args: argparse.Namespace) -> None:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    from irminsul.integrations.vllm import CONNECTOR, SCHEDULER

    if args.model_tag is None and args.model == EngineArgs.model:  # (vLLM's default model is not an MLA one)
        raise UserFacingError(f"name the model to serve: {USAGE}")
    transfer = args.kv_transfer_config
    if transfer is None:
        args.kv_transfer_config = KVTransferConfig(**CONNECTOR)
    elif transfer.kv_connector in (None, CONNECTOR["kv_connector"]):
        args.kv_transfer_config = dataclasses.replace(transfer, **CONNECTOR)
    else:
        raise UserFacingError(
            f"--kv-transfer-config names the connector {transfer.kv_connector!r}; this command "
            "runs Irminsul's: leave kv_connector out (kv_connector_extra_config is kept)"
        )
    if args.scheduler_cls is None:
        args.scheduler_cls = SCHEDULER
    if args.async_scheduling:
        raise UserFacingError(
            "--async-scheduling: Irminsul's scheduler is vLLM's synchronous one; leave the option out"
        )
    args.async_scheduling = False
    backend_chosen = args.attention_backend is not None or getattr(args.attention_config, "backend", None)
    if current_platform.is_cpu() and not backend_chosen:
        args.attention_backend = "CPU_MLA"


def reserve_cores(args: argparse.Namespace, env: MutableMapping[str, str]) -> None:
    """On a CPU, the cores vLLM keeps off its workers' threads, as it keeps them without a KV connector.

    vLLM binds each CPU worker's OpenMP threads to the cores of its NUMA node but the ones it reserves
    for its other processes (one per local worker on x86, Arm and RISC-V), and it reserves one more per
    worker wherever a KV connector is configured, for a transfer engine's threads. Irminsul's connector
    starts none (its loads and saves run in the worker's step), so unless VLLM_CPU_NUM_OF_RESERVED_CPU
    is set, it is set to what vLLM reserves without a connector: the server computes on the cores vLLM
    alone would (on two cores, vLLM would otherwise reserve both and then bind both)."""
    from vllm.platforms import CpuArchEnum, current_platform

    if not current_platform.is_cpu() or env.get("VLLM_CPU_NUM_OF_RESERVED_CPU"):
        return
    workers = args.tensor_parallel_size * args.pipeline_parallel_size
    per_worker = current_platform.get_cpu_architecture() in (CpuArchEnum.X86, CpuArchEnum.ARM, CpuArchEnum.RISCV)
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(workers if per_worker else 1)


def serve(argv: list[str]) -> int:
    """Parse as `vllm serve` does, fill in Irminsul's options, then run vLLM's serve command."""
    args = parse(argv)
    reserve_cores(args, os.environ)  # (read by the engine's processes, which inherit it)
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args

    cli_env_setup()  # (what vLLM's CLI does first: worker processes start by spawn)
    configure_logging_from_args(args)
    command = ServeSubcommand()
    command.validate(args)
    command.cmd(args)
    return 0
