"""Which platform the kernels are chosen and lowered for, and how a Pallas kernel runs there.

The platform is JAX's default backend ('cuda'/'rocm' count as 'gpu'), unless a test asks for another one with
`simulate`: kernels are then chosen as on that platform and the Pallas kernels run in interpret mode on this
host (Pallas' TPU interpreter for 'tpu', which simulates its memory spaces).
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform as _platform
import re
from typing import Iterator

import jax
import jax.numpy as jnp

PLATFORMS = ("cpu", "gpu", "tpu")
_simulated: str | None = None
# /proc/cpuinfo flag -> the name `--xla_cpu_max_isa` takes for that instruction set, best first
ISA_LADDER = (("amx_tile", "AMX"), ("avx512f", "AVX512"), ("avx2", "AVX2"), ("avx", "AVX"), ("sse4_2", "SSE4_2"))


def host_platform() -> str:
    """The platform JAX runs on: 'cpu', 'gpu' or 'tpu' ('cuda'/'rocm' count as 'gpu'); any other name as JAX
    gives it (the kernel selection then keeps the lax paths and refuses the Pallas kernels)."""
    name = jax.default_backend()
    return "gpu" if name in ("cuda", "rocm") else name


def platform() -> str:
    """The platform kernels are chosen for: the simulated one inside `simulate`, else `host_platform()`."""
    return _simulated or host_platform()


def cpu_model_and_flags() -> tuple[str, set[str]]:
    """This CPU's model name and its /proc/cpuinfo flags (the machine name and no flags where there is none)."""
    model, flags = _platform.processor() or _platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model in ("", _platform.machine(), _platform.processor()):
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model, flags


def host_isa(cpu_flags: set[str] | None = None) -> str | None:
    """The best instruction set of ISA_LADDER this CPU reports (None where it reports none of them), named as
    `--xla_cpu_max_isa` names it: what XLA:CPU generates code for without a cap."""
    cpu_flags = cpu_model_and_flags()[1] if cpu_flags is None else cpu_flags
    return next((name for flag, name in ISA_LADDER if flag in cpu_flags), None)


def isa_cap(xla_flags: str | None = None) -> str | None:
    """The `--xla_cpu_max_isa` value in XLA_FLAGS (the last one wins), upper-cased; None without a cap."""
    found = re.findall(r"--xla_cpu_max_isa=(\S+)", os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags)
    return found[-1].upper() if found else None


def effective_isa(xla_flags: str | None = None, cpu_flags: set[str] | None = None) -> str:
    """The instruction set XLA:CPU generates code for: `NAME (XLA_FLAGS)` under a cap, else `host_isa()` (or the
    machine's name where /proc/cpuinfo says nothing)."""
    cap = isa_cap(xla_flags)
    if cap:
        return f"{cap} (XLA_FLAGS)"
    return host_isa(cpu_flags) or _platform.machine()


@functools.lru_cache(maxsize=None)
def float16_error(backend: str = "cpu") -> str | None:
    """None when XLA on `backend` compiles float16 arithmetic; otherwise XLA's error, in one line.

    jaxlib 0.10.2's XLA:CPU converts float16 with F16C instructions; where the target has no F16C (an SSE4.2-only
    CPU, or `XLA_FLAGS=--xla_cpu_max_isa=SSE4_2` on any x86 host) it emits calls to compiler-rt's
    `__extendhfsf2`/`__truncsfhf2`, which its JIT does not link, so every program that touches float16 fails to
    load ("Failed to materialize symbols"). One tiny compile per backend and process, lowered on its own (so it
    also runs while another function is being traced)."""
    f16_round_trip = jax.jit(lambda v: (v.astype(jnp.float16) + 1).astype(jnp.float32), backend=backend)
    try:
        f16_round_trip.lower(jax.ShapeDtypeStruct((2,), jnp.float32)).compile()
    except jax.errors.JaxRuntimeError as exc:
        return str(exc).splitlines()[0]
    return None


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
