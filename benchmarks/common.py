"""Helpers shared by the benchmark scripts: timing, tables, JSON output."""

from __future__ import annotations

import json
import os
import platform
import time

import jax


def best_of(fn, repeats: int = 3) -> float:
    """Best wall time (s) of `fn()` over `repeats` runs, after one warm-up run (compilation excluded)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def trainer_step_seconds(model, policy, tokens) -> float:
    """Best time of one jitted forward+backward of the mean next-token logprob under `policy`."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxalign import sequence_logprobs

    graphdef, params = nnx.split(model)

    @jax.jit
    def step(params, tokens):
        def loss(p):
            lp, _ = sequence_logprobs(nnx.merge(graphdef, p), tokens, policy)
            return -jnp.mean(lp)
        return jax.value_and_grad(loss)(params)

    return best_of(lambda: step(params, tokens))


def machine() -> dict:
    """Where the numbers were measured."""
    return {"platform": platform.platform(), "python": platform.python_version(), "jax": jax.__version__,
            "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
            "cpu_count": os.cpu_count()}


def write_json(path: str, payload: dict) -> None:
    """Write a result file (creating its folder)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"machine": machine(), **payload}, f, indent=2)
    print(f"wrote {path}")
