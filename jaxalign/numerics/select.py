"""Selections: the router's top-k and the engine's argmax, written so their bits never depend on how XLA
compiles a sort or an index-carrying reduce.

Both are numeric decisions (which expert fires, which token is sampled): a top-k or argmax that resolved ties
or NaNs differently in two programs would send the trainer and the engine down different paths.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k(x, k)` over the last axis of x [..., E], bit for bit (IEEE total order, ties to the lower index),
    computed from each entry's rank among the E: for the few experts of a router this is a handful of fused
    elementwise ops, where XLA:CPU runs a comparator sort per row."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    key = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)  # signed-int order = total order of floats
    n_exp = x.shape[-1]
    ids = jnp.arange(n_exp, dtype=jnp.int32)
    mine, other = key[..., :, None], key[..., None, :]
    ahead = (other > mine) | ((other == mine) & (ids[None, :] < ids[:, None]))  # [.., i, j]: j ranks above i
    rank = jnp.sum(ahead, axis=-1, dtype=jnp.int32)
    picked = rank[..., :, None] == jnp.arange(k, dtype=jnp.int32)  # [.., E, k]: the entry of rank r
    idx = jnp.sum(jnp.where(picked, ids[:, None], 0), axis=-2, dtype=jnp.int32)
    return jnp.take_along_axis(x, idx, axis=-1), idx


def argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` (first index of the maximum; of the first NaN if any) as plain reduces: XLA:CPU
    runs argmax's (value, index) reduce as a scalar loop, several times slower over a vocabulary."""
    ids = jnp.arange(x.shape[-1], dtype=jnp.int32)
    none = jnp.int32(x.shape[-1])
    first_nan = jnp.min(jnp.where(jnp.isnan(x), ids, none), axis=-1)
    top = jnp.max(jnp.where(jnp.isnan(x), -jnp.inf, x), axis=-1, keepdims=True)
    first_top = jnp.min(jnp.where(x == top, ids, none), axis=-1)
    return jnp.where(first_nan < none, first_nan, first_top)
