"""Dtype names and the casts the model applies to parameters and activations."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxalign.numerics.policy import NumericPolicy

_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


def dtype(name: str) -> jnp.dtype:
    """The jnp dtype for a policy dtype name (`f32`, `bf16`, `f16`)."""
    return _DTYPES[name]


def as_param(x: jax.Array, policy: NumericPolicy) -> jax.Array:
    """A weight as the policy stores it (a no-op once the engine has cast its copy of the weights)."""
    return x.astype(dtype(policy.param_dtype))


def as_compute(x: jax.Array, policy: NumericPolicy) -> jax.Array:
    """An activation (or a weight used elementwise) in the compute dtype."""
    return x.astype(dtype(policy.compute_dtype))


def cast_params(state, policy: NumericPolicy):
    """Cast every floating leaf of a parameter pytree to the policy's param dtype (done once, at weight sync)."""
    target = dtype(policy.param_dtype)
    return jax.tree.map(lambda x: x.astype(target) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
