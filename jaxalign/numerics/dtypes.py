"""Dtype names and the casts the model applies to parameters and activations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxalign.numerics.policy import NumericPolicy
from jaxalign.numerics.policy_values import DType

_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


def dtype(name: DType | str) -> jnp.dtype:
    """The jnp dtype for a policy dtype name (`f32`, `bf16`, `f16`)."""
    return _DTYPES[name]


def dtype_name(dt) -> str:
    """The policy dtype name (`f32`, `bf16`, `f16`) of a jnp dtype."""
    for name, candidate in _DTYPES.items():
        if jnp.dtype(candidate) == jnp.dtype(dt):
            return name
    raise ValueError(f"dtype {dt} has no policy name; allowed: {', '.join(_DTYPES)}")


def cast(x: jax.Array, name: DType | str) -> jax.Array:
    """Cast to a policy dtype, rounding for real when the target is narrower.

    A bare narrowing `astype` can be elided by XLA:CPU: its XNNPACK ("ynn") fusions fold a convert pair
    f32 -> bf16 -> f32 inside a fused dot/softmax, so a bf16 router silently ran in f32 for some shapes. An
    explicit `lax.reduce_precision` is an op those rewrites keep, so the rounding the policy asks for happens.
    """
    target = dtype(name)
    if (jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != target
            and jnp.finfo(x.dtype).bits > jnp.finfo(target).bits):
        info = jnp.finfo(target)
        x = lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    return x.astype(target)


def as_param(x: jax.Array, policy: NumericPolicy) -> jax.Array:
    """A weight as the policy stores it (a no-op once the engine has cast its copy of the weights)."""
    return cast(x, policy.param_dtype)


def as_compute(x: jax.Array, policy: NumericPolicy) -> jax.Array:
    """An activation (or a weight used elementwise) in the compute dtype."""
    return cast(x, policy.compute_dtype)


ROUTER_PARAMS = ("router", "selection_bias", "router_bias")
