"""Multi-host start-up: `jax.distributed.initialize` driven by environment variables.

Every process of a job runs the same command; before any JAX computation, `initialize_from_env()` (called by
the `jaxalign` CLI) connects them:

- `JAXALIGN_COORDINATOR=host:port`, `JAXALIGN_NUM_PROCESSES=N`, `JAXALIGN_PROCESS_ID=i` (explicit; works
  anywhere, including several processes on one CPU machine), or
- `JAXALIGN_DISTRIBUTED=auto`: `jax.distributed.initialize()` with no arguments, which detects TPU pods,
  SLURM and Open MPI launches by itself.

After it, `jax.devices()` lists every process's devices and a mesh from `jaxalign.make_mesh` spans all of them
(docs/scaling.md).
"""

from __future__ import annotations

import os

EXPLICIT = ("JAXALIGN_COORDINATOR", "JAXALIGN_NUM_PROCESSES", "JAXALIGN_PROCESS_ID")


def _int_env(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}; allowed: a non-negative int") from None


def initialize_from_env() -> bool:
    """Connect this process to the others if the environment names a job; True when it did."""
    import jax

    if os.environ.get("JAXALIGN_DISTRIBUTED", "") == "auto":
        jax.distributed.initialize()
        return True
    present = [name for name in EXPLICIT if os.environ.get(name)]
    if not present:
        return False
    if len(present) != len(EXPLICIT):
        missing = [name for name in EXPLICIT if name not in present]
        raise ValueError(f"multi-host start needs all of {', '.join(EXPLICIT)}; missing {', '.join(missing)}")
    num, pid = _int_env("JAXALIGN_NUM_PROCESSES"), _int_env("JAXALIGN_PROCESS_ID")
    if num < 1 or not 0 <= pid < num:
        raise ValueError(f"JAXALIGN_PROCESS_ID={pid} with JAXALIGN_NUM_PROCESSES={num}; allowed: 0 <= id < N")
    jax.distributed.initialize(coordinator_address=os.environ["JAXALIGN_COORDINATOR"], num_processes=num,
                               process_id=pid)
    return True


def is_primary() -> bool:
    """True on the process that writes shared files (metrics, plots, caches): process 0."""
    import jax

    return jax.process_index() == 0
