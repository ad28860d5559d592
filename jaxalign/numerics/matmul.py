"""Matrix products under a NumericPolicy: accumulation precision and kernel choice.

Kernels:
- `xla`: one `jnp.dot`. XLA:CPU picks blockings by shape, so the bits of one row depend on how many rows are
  multiplied with it (see tests/numerics/test_matmul.py, which documents this on the CPU).
- `tiled:T`: rows are zero-padded to a multiple of T and multiplied one fixed-shape [T, K] tile at a time
  (`lax.map`), so every row goes through the same compiled kernel with the same shape: batch invariant.

Accumulation (`matmul_acc`): `f32` asks XLA for float32 output; `bf16`/`f16` round the partial sum every
ACC_CHUNK products of the contraction (what a low-precision accumulator does, emulated); a
`lax.DotAlgorithmPreset` name is passed to XLA as `precision=` (honoured on GPU/TPU; XLA:CPU ignores most).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxalign.numerics.collectives import gather_axes, local_reduce, mesh_active, ordered_vjp, with_parameter
from jaxalign.numerics.policy import NumericPolicy
from jaxalign.numerics.dtypes import as_compute, as_param, cast

ACC_CHUNK = 16


def _dot_f32(a: jax.Array, b: jax.Array, policy: NumericPolicy) -> jax.Array:
    """a @ b with float32 accumulation, or the policy's DotAlgorithmPreset."""
    if policy.matmul_acc in ("f32", "bf16", "f16"):
        return jnp.dot(a, b, preferred_element_type=jnp.float32)
    return jnp.dot(a, b, precision=policy.matmul_acc).astype(jnp.float32)


def _dot(a: jax.Array, b: jax.Array, policy: NumericPolicy) -> jax.Array:
    """a [M, K] @ b [K, N] with the policy's accumulation; the result is float32 (or the low accumulation dtype)."""
    if policy.matmul_acc not in ("bf16", "f16"):
        return _dot_f32(a, b, policy)
    k = a.shape[-1]
    total = None
    for start in range(0, k, ACC_CHUNK):
        part = cast(jnp.dot(a[:, start:start + ACC_CHUNK], b[start:start + ACC_CHUNK],
                            preferred_element_type=jnp.float32), policy.matmul_acc)
        total = part if total is None else total + part
    return total


def _rows(x2d: jax.Array, w: jax.Array, policy: NumericPolicy) -> jax.Array:
    """[M, K] @ [K, N] with the policy's kernel."""
    tile = policy.tile_rows
    if tile is None:
        return _dot(x2d, w, policy)
    m, k = x2d.shape
    pad = (-m) % tile
    # a whole tile stays on one device: split rows would be multiplied by a smaller kernel, with other bits
    tiles = gather_axes(jnp.pad(x2d, ((0, pad), (0, 0))).reshape(-1, tile, k), (1, 2))
    # ... and its product too (the partitioner may otherwise split the dot by the rows its consumers want)
    out = gather_axes(lax.map(lambda t: gather_axes(_dot(t, w, policy), (0,)), tiles), (1,))
    return out.reshape(-1, w.shape[-1])[:m]


def matmul(x: jax.Array, w: jax.Array, policy: NumericPolicy, *, operand_dtype: str | None = None,
           out_dtype: str | None = None) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N].

    Operands are cast to `operand_dtype` (default: the compute dtype), accumulated as the policy says and the
    result cast to `out_dtype` (default: the compute dtype).
    """
    op = operand_dtype or policy.compute_dtype
    lead = x.shape[:-1]
    product = lambda a, b: _rows(a, b, policy)  # noqa: E731
    if policy.cross_device == "ordered" and mesh_active():
        product = ordered_vjp(product, ((1,), (0,)))  # K gathered; weight gradients summed on one device
    y = product(cast(x.reshape(-1, x.shape[-1]), op), cast(w, op))
    return cast(y.reshape(lead + (w.shape[-1],)), out_dtype or policy.compute_dtype)


def expert_matmul(x: jax.Array, w: jax.Array, policy: NumericPolicy) -> jax.Array:
    """Per-expert products: x [E, R, K] @ w [E, K, N] -> [E, R, N] in the compute dtype."""
    if policy.tile_rows is None:
        return jax.vmap(lambda a, b: matmul(a, b, policy))(x, w)
    return lax.map(lambda ab: matmul(ab[0], ab[1], policy), (x, w))


def gathered_matmul(x: jax.Array, w: jax.Array, policy: NumericPolicy) -> jax.Array:
    """Per-row weights: x [N, k, K] @ w [N, k, K, M] -> [N, k, M] (float32 accumulation, compute dtype out)."""
    cdt = policy.compute_dtype
    x, w = local_reduce(x, policy, (2,)), local_reduce(w, policy, (2,))
    y = jnp.einsum("nkc,nkcm->nkm", cast(x, cdt), cast(w, cdt), preferred_element_type=jnp.float32)
    return cast(y, cdt)


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, policy: NumericPolicy) -> jax.Array:
    """Rows sorted by expert: x [R, K], w [E, K, N], group_sizes [E] -> [R, N] (lax.ragged_dot)."""
    x = cast(local_reduce(x, policy, (1,)), policy.compute_dtype)
    w = cast(local_reduce(w, policy, (1,)), policy.compute_dtype)
    if policy.matmul_acc not in ("bf16", "f16"):
        y = lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)
    else:
        y = None
        for start in range(0, x.shape[-1], ACC_CHUNK):
            part = cast(lax.ragged_dot(x[:, start:start + ACC_CHUNK], w[:, start:start + ACC_CHUNK], group_sizes,
                                       preferred_element_type=jnp.float32), policy.matmul_acc)
            y = part if y is None else y + part
    return cast(y, policy.compute_dtype)


def add_bias(y: jax.Array, b: jax.Array, policy: NumericPolicy) -> jax.Array:
    """y + b, the bias cast to the parameter then the compute dtype."""
    return with_parameter(lambda a, bias: a + as_compute(as_param(bias, policy), policy), policy)(y, b)


def lookup(table: jax.Array, ids: jax.Array, policy: NumericPolicy) -> jax.Array:
    """Rows `ids` of an embedding table, in the compute dtype (its gradient is a scatter-add over ids)."""
    return with_parameter(lambda t, i: as_compute(as_param(t, policy)[i], policy), policy)(table, ids)
