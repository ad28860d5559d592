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


ROUTER_PARAMS = ("router", "selection_bias")


def _module_path(names: tuple[str, ...]) -> tuple[str, ...]:
    """A state path's names up to the parameter (nnx puts the Variable's `value` after it)."""
    return names[:-1] if names and names[-1] == "value" else names


def cast_params(state, policy: NumericPolicy):
    """Cast every floating leaf of a parameter pytree to the policy's param dtype (done once, at weight sync);
    router parameters go to the router dtype instead (see `moe.route`). Under `weight_quant=e4m3:RxC` linear
    and expert weights become `fp8.QuantizedWeight`s, quantised from the float32 masters (re-done at every sync,
    so no quantised copy outlives the weights it came from)."""
    from jaxalign.numerics import fp8

    def one(path, x):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        path_names = tuple(str(getattr(p, "key", getattr(p, "name", p))) for p in path)
        quantized = fp8.cast_weight(x, _module_path(path_names), policy)
        if quantized is not None:
            return quantized
        names = set(path_names)
        return cast(x, policy.router_logits_dtype if names & set(ROUTER_PARAMS) else policy.param_dtype)
    return jax.tree_util.tree_map_with_path(one, state)
