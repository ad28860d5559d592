"""Reductions, softmaxes and norms under a NumericPolicy.

`reduction="tree"` sums with a fixed halving tree: the axis is zero-padded to a power of two and folded in half
(`x[:n/2] + x[n/2:]`) until one element is left. Every add is an elementwise IEEE add, so the result for one row
does not depend on how many rows are computed beside it, and zero padding to any larger power of two leaves the
bits unchanged (the first folds add exact zeros). That is what makes prefill, decode and the trainer's full
forward agree bitwise when they reduce over different cache lengths.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxalign.numerics.dtypes import as_compute, as_param, cast
from jaxalign.numerics.policy import NumericPolicy


def tree_sum(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """Sum over `axis` with a fixed halving tree (batch- and padding-invariant; see module docstring)."""
    axis = axis % x.ndim
    n = x.shape[axis]
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, width - n)
        x = jnp.pad(x, pad)
    while width > 1:
        width //= 2
        x = jax.lax.slice_in_dim(x, 0, width, axis=axis) + jax.lax.slice_in_dim(x, width, 2 * width, axis=axis)
    return x if keepdims else jnp.squeeze(x, axis)


def reduce_sum(x: jax.Array, policy: NumericPolicy, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """Sum over one axis in x's dtype, in the order the policy's `reduction` names."""
    if policy.reduction == "tree":
        return tree_sum(x, axis, keepdims)
    return jnp.sum(x, axis=axis, keepdims=keepdims, dtype=x.dtype)


def softmax(x: jax.Array, policy: NumericPolicy, dtype_name: str, axis: int = -1) -> jax.Array:
    """Softmax computed in `dtype_name`; masked entries should be -inf."""
    x = cast(x, dtype_name)
    shifted = x - jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
    e = jnp.exp(shifted)
    return e / reduce_sum(e, policy, axis=axis, keepdims=True)


def log_softmax(x: jax.Array, policy: NumericPolicy, dtype_name: str = "f32", axis: int = -1) -> jax.Array:
    """log-softmax computed in `dtype_name` (f32 by default, for logprobs)."""
    x = cast(x, dtype_name)
    shifted = x - jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
    return shifted - jnp.log(reduce_sum(jnp.exp(shifted), policy, axis=axis, keepdims=True))


def rms_norm(x: jax.Array, weight: jax.Array, policy: NumericPolicy, eps: float) -> jax.Array:
    """RMSNorm over the last axis: normalised in `norm_dtype`, cast to the compute dtype, then times the weight
    (in the compute dtype, as transformers does)."""
    xn = cast(x, policy.norm_dtype)
    mean_sq = reduce_sum(xn * xn, policy, axis=-1, keepdims=True) / xn.shape[-1]
    normed = xn * jax.lax.rsqrt(mean_sq + jnp.asarray(eps, xn.dtype))
    return as_compute(normed, policy) * as_compute(as_param(weight, policy), policy)
