"""LoRA numerics: a low-rank update folded into the weight (`merged`) or applied as its own path
(`unmerged`). The two are the same function in exact arithmetic and differ in rounding -- one of the things an
engine that serves adapters unmerged changes."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxalign.numerics import precision
from jaxalign.numerics.dtypes import as_param, cast
from jaxalign.numerics.matmul import matmul
from jaxalign.numerics.policy import NumericPolicy


def merged_weight(w: jax.Array, a: jax.Array, b: jax.Array, scale: float, policy: NumericPolicy) -> jax.Array:
    """w + scale * (a @ b): the delta is formed in float32, rounded to the parameter dtype, then added there
    (every merge -- the trainer's at use, the engine's at weight sync -- rounds the same way)."""
    delta = precision.dot(a.astype(jnp.float32), b.astype(jnp.float32), policy) * jnp.float32(scale)
    return as_param(w, policy) + cast(delta, policy.param_dtype)


def lora_linear(x: jax.Array, w: jax.Array, a: jax.Array, b: jax.Array, scale: float,
                policy: NumericPolicy) -> jax.Array:
    """x @ (w + scale * a @ b) under the policy's `lora` mode, in the compute dtype."""
    if policy.lora == "merged":
        return matmul(x, merged_weight(w, a, b, scale, policy), policy)
    low_rank = matmul(matmul(x, as_param(a, policy), policy), as_param(b, policy), policy)
    return matmul(x, as_param(w, policy), policy) + cast(low_rank * jnp.asarray(scale, low_rank.dtype),
                                                         policy.compute_dtype)
