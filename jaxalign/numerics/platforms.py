"""Which platform the kernels are chosen and lowered for, and how a Pallas kernel runs there.

The platform is JAX's default backend ('cuda'/'rocm' count as 'gpu'), unless a test asks for another one with
`simulate`: kernels are then chosen as on that platform and the Pallas kernels run in interpret mode on this
host (Pallas' TPU interpreter for 'tpu', which simulates its memory spaces).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import jax

PLATFORMS = ("cpu", "gpu", "tpu")
_simulated: str | None = None


def host_platform() -> str:
    """The platform JAX runs on: 'cpu', 'gpu' or 'tpu' ('cuda'/'rocm' count as 'gpu'); any other name as JAX
    gives it (the kernel selection then keeps the lax paths and refuses the Pallas kernels)."""
    name = jax.default_backend()
    return "gpu" if name in ("cuda", "rocm") else name


def platform() -> str:
    """The platform kernels are chosen for: the simulated one inside `simulate`, else `host_platform()`."""
    return _simulated or host_platform()


def interpret_mode(target: str):
    """The `interpret=` a pallas_call lowered for `target` takes on this host: False when it compiles (the host
    is that GPU or TPU), Pallas' TPU interpreter for a TPU kernel elsewhere, else True (the generic interpreter:
    on the CPU, and for a GPU kernel simulated on the CPU)."""
    host = host_platform()
    if target == host and host != "cpu":
        return False
    if target == "tpu":
        from jax.experimental.pallas import tpu as pltpu
        return pltpu.InterpretParams()
    return True


@contextlib.contextmanager
def simulate(target: str) -> Iterator[None]:
    """Choose kernels as on `target` ('cpu', 'gpu' or 'tpu') inside the block, running the Pallas kernels in
    interpret mode on this host. The choice is made when a function is traced, so JAX's caches are cleared on
    entry and on exit: no program traced for one platform is reused for another."""
    global _simulated
    if target not in PLATFORMS:
        raise ValueError(f"simulate({target!r}): allowed platforms: {', '.join(PLATFORMS)}")
    previous = _simulated
    jax.clear_caches()
    _simulated = target
    try:
        yield
    finally:
        _simulated = previous
        jax.clear_caches()
