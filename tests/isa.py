"""XLA flags for test subprocesses, so that a run under `XLA_FLAGS=--xla_cpu_max_isa=...` tests its children
under the same instruction set (XLA:CPU's code, and with it some bits, depend on the ISA it targets)."""

from __future__ import annotations

import os

ISA_FLAG = "--xla_cpu_max_isa"


def child_xla_flags(*extra: str, flags: str | None = None) -> str:
    """This process's XLA_FLAGS (the user's, e.g. `--xla_cpu_max_isa=AVX2`, plus jaxalign's own) without any fake
    device count (a child sets its own), followed by `extra`."""
    flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
    kept = [f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join(kept + list(extra))


def child_env(*xla_flags: str, **extra: str) -> dict[str, str]:
    """os.environ for a child process: XLA_FLAGS from `child_xla_flags(*xla_flags)`, plus `extra`."""
    env = dict(os.environ)
    flags = child_xla_flags(*xla_flags)
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    env.update(extra)
    return env


def current_isa() -> str:
    """The ISA cap this process runs under (`native` without one)."""
    for flag in os.environ.get("XLA_FLAGS", "").split():
        if flag.startswith(ISA_FLAG + "="):
            return flag.split("=", 1)[1]
    return "native"
