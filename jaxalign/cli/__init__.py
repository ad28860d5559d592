"""The `jaxalign` command: one module per subcommand (`jaxalign.cli.<name>`: `add_parser(sub)` and `run(args)`),
the argument groups they share in `jaxalign.cli.args`.

The subcommand modules import what they run at the top: building the parser needs the defaults of `compare`,
`localize`, `run_check` and the RL configs, so every floor below is imported by `jaxalign --help` anyway
(`import jaxalign` imports most of them too), and lazy imports would buy no start-up time."""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from jaxalign import runtime
from jaxalign.cli import check, compare, demo, experiment, golden, import_hf, localize, policies, vllm
from jaxalign.cli.args import UsageError, finish
from jaxalign.distributed import initialize_from_env
from jaxalign.engines.vllm.engine import SyncMismatch
from jaxalign.engines.vllm.process import VllmUnavailable
from jaxalign.version import __version__

# the subcommands in the order `jaxalign --help` lists them
COMMANDS = (policies, check, demo, compare, localize, experiment, import_hf, golden, vllm)


def make_parser() -> argparse.ArgumentParser:
    """The `jaxalign` argument parser, every subcommand added."""
    parser = argparse.ArgumentParser(prog="jaxalign", description=(
        "One MoE transformer under two numeric policies (trainer and rollout engine): measure, localise and "
        "close the gap between them."))
    parser.add_argument("--version", action="version", version=f"jaxalign {__version__}",
                        help="print the installed package's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    finish(parser)
    return parser



def _raised_by_jaxalign(err: BaseException) -> bool:
    """True when jaxalign's own validation raised `err` (the innermost frame is in the jaxalign package): those
    ValueErrors name the bad value and what is allowed. A ValueError from JAX, NumPy or another library is a bug
    to see with its traceback, not a usage error."""
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(_PACKAGE_DIR)


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the jaxalign package


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `jaxalign` console command."""
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        if getattr(args, "host_devices", None) is not None:
            runtime.configure(host_devices=args.host_devices)
        initialize_from_env()  # a no-op unless the environment names a multi-process job (docs/scaling.md)
        return args.func(args)
    except (UsageError, VllmUnavailable) as err:  # VllmUnavailable: one line naming what to install
        print(f"jaxalign {args.command}: error: {err}", file=sys.stderr)
        return 2
    except SyncMismatch as err:  # an engine's weight sync failed its verification: the run stopped, on one line
        print(f"jaxalign {args.command}: error: {err}; the run stopped (its last checkpoint resumes it)",
              file=sys.stderr)
        return 1
    except OSError as err:
        if err.filename is None:  # not about a path the user gave: a bug or the machine, with its traceback
            raise
        path = os.fspath(err.filename) + (f" -> {os.fspath(err.filename2)}" if err.filename2 is not None else "")
        print(f"jaxalign {args.command}: error: {path}: {err.strerror or type(err).__name__}", file=sys.stderr)
        return 2
    except ValueError as err:
        if not _raised_by_jaxalign(err):
            raise
        print(f"jaxalign {args.command}: error: {err}", file=sys.stderr)
        return 2
