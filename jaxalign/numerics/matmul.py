"""Matrix products under a NumericPolicy: accumulation precision and kernel choice.

Kernels:
- `xla`: one `jnp.dot`. XLA:CPU picks blockings by shape, so the bits of one row depend on how many rows are
  multiplied with it (tests/test_batch_invariance.py documents this on the CPU).
- `tiled:T`: rows are zero-padded to a multiple of T and multiplied one fixed-shape [T, K] tile at a time
  (`lax.map`), so every row goes through the same compiled kernel with the same shape: batch invariant.
- `pallas:BMxBNxBK`: the tiled semantics held by Pallas kernels (numerics/pallas_matmul.py, pallas_grouped.py).
Which implementation runs is chosen per product by `numerics.kernels.select_matmul` from the policy and the
platform: on a GPU/TPU `tiled:T` runs the Pallas kernels with blocks derived from T.

Accumulation (`matmul_acc`): `f32` asks XLA for float32 output; `bf16`/`f16` round the partial sum every
ACC_CHUNK products of the contraction (what a low-precision accumulator does, emulated); a
`lax.DotAlgorithmPreset` name is passed to XLA as the algorithm (honoured on GPU/TPU; XLA:CPU ignores it).
Every product states its precision through `jaxalign.numerics.precision`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxalign.numerics.collectives import gather_axes, local_reduce, mesh_active, ordered_vjp, with_parameter
from jaxalign.numerics import invariance
from jaxalign.numerics.kernels import select_matmul
from jaxalign.numerics.pallas_grouped import pallas_grouped_tiles
from jaxalign.numerics.pallas_matmul import pallas_matmul
from jaxalign.numerics.platforms import platform
from jaxalign.numerics.policy import NumericPolicy
from jaxalign.numerics import precision
from jaxalign.numerics.dtypes import as_compute, as_param, cast

ACC_CHUNK = 16


def _dot_f32(a: jax.Array, b: jax.Array, policy: NumericPolicy) -> jax.Array:
    """a @ b with float32 accumulation, or the policy's DotAlgorithmPreset."""
    return precision.dot(a, b, policy)


def _dot(a: jax.Array, b: jax.Array, policy: NumericPolicy) -> jax.Array:
    """a [M, K] @ b [K, N] with the policy's accumulation; the result is float32 (or the low accumulation dtype)."""
    if not policy.low_precision_accumulation:
        return _dot_f32(a, b, policy)
    k = a.shape[-1]
    total = None
    for start in range(0, k, ACC_CHUNK):
        part = cast(precision.dot(a[:, start:start + ACC_CHUNK], b[start:start + ACC_CHUNK], policy),
                    policy.matmul_acc)
        total = part if total is None else total + part
    return total


def _rows(x2d: jax.Array, w: jax.Array, policy: NumericPolicy) -> jax.Array:
    """[M, K] @ [K, N] with the implementation `kernels.select_matmul` chooses for this platform."""
    k, n = w.shape
    probe = functools.partial(invariance.evidence, k, n, x2d.dtype, w.dtype, _dot_key(policy),
                              lambda weight: lambda rows: _dot(rows, weight, policy), platform())
    impl = select_matmul(policy, k, n, x2d.dtype, platform(), probe=probe)
    if impl.kind in ("lax-tiled", "xla-bucketed"):
        x2d, w = as_computed(x2d, w)
    if impl.kind == "pallas":
        return pallas_matmul(x2d, w, impl.blocks, impl.platform)
    if impl.kind == "xla-bucketed":
        return bucketed_rows(x2d, lambda t: _dot(t, w, policy))
    return row_tiles(x2d, lambda t: _dot(t, w, policy), impl.tile if impl.kind == "lax-tiled" else None)


def as_computed(*operands):
    """The operands of a row-invariant product as their producers computed them (an optimization barrier).

    XLA folds a transpose it can see into the dot's dimension numbers, which runs another kernel with other bits
    (YNNPACK's [M, K] x [N, K]^T against [M, K] x [K, N]). It can see it only where the tiles' loop is gone: one
    tile, e.g. an engine's decode step at batch <= T, while the trainer's and the prefill's many tiles read a
    transposed copy made outside their loop. DeepSeek-V4's `fn.T` (hyper.py) gave the decode step's mixing
    weights other float32 bits than the trainer's, so an aligned engine left the trainer where a bf16 rounding
    sat on a tie (tests/test_deepseek_v4_engine.py)."""
    return lax.optimization_barrier(operands)


def _dot_key(policy: NumericPolicy) -> str:
    """The policy fields `_dot` reads: what a row-invariance proof of it depends on."""
    return f"matmul={policy.matmul_acc}"


def bucketed_rows(x2d: jax.Array, product) -> jax.Array:
    """product(rows [R, K]) -> [R, N] on x2d [M, K] with the rows zero-padded to their bucket
    (`invariance.bucket`), or, past the largest bucket, in whole chunks of it (`lax.map`): only bucket-sized
    products run, the sizes a probe proved row-invariant."""
    m, k = x2d.shape
    largest = invariance.max_rows(k)
    if m > largest:
        return row_tiles(x2d, product, largest)
    size = invariance.bucket(m, k)
    return product(jnp.pad(x2d, ((0, size - m), (0, 0))))[:m]


def row_tiles(x2d: jax.Array, product, tile: int | None) -> jax.Array:
    """product(rows [R, K]) -> [R, N] on x2d [M, K]: whole, or (`tile` T) on zero-padded [T, K] row tiles one at a
    time (`lax.map`: every row through the same compiled kernel of the same shape, so batch invariant)."""
    if tile is None:
        return product(x2d)
    m, k = x2d.shape
    pad = (-m) % tile
    # a whole tile stays on one device: split rows would be multiplied by a smaller kernel, with other bits
    tiles = gather_axes(jnp.pad(x2d, ((0, pad), (0, 0))).reshape(-1, tile, k), (1, 2))
    # ... and its product too (the partitioner may otherwise split the dot by the rows its consumers want)
    out = gather_axes(lax.map(lambda t: gather_axes(product(t), (0,)), tiles), (1,))
    return out.reshape(m + pad, -1)[:m]


def matmul(x: jax.Array, w: jax.Array, policy: NumericPolicy, *, operand_dtype: str | None = None,
           out_dtype: str | None = None) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N].

    Operands are cast to `operand_dtype` (default: the compute dtype), accumulated as the policy says and the
    result cast to `out_dtype` (default: the compute dtype).
    """
    op = operand_dtype or policy.compute_dtype
    lead = x.shape[:-1]
    product = lambda a, b: _rows(a, b, policy)  # noqa: E731
    if policy.ordered_cross_device and mesh_active():
        product = ordered_vjp(product, ((1,), (0,)))  # K gathered; weight gradients summed on one device
    y = product(cast(x.reshape(-1, x.shape[-1]), op), cast(w, op))
    return cast(y.reshape(lead + (w.shape[-1],)), out_dtype or policy.compute_dtype)


def expert_matmul(x: jax.Array, w: jax.Array, policy: NumericPolicy, *, out_dtype: str | None = None) -> jax.Array:
    """Per-expert products: x [E, R, K] @ w [E, K, N] -> [E, R, N] in `out_dtype` (default: the compute dtype)."""
    one = lambda a, b: matmul(a, b, policy, out_dtype=out_dtype)  # noqa: E731
    if policy.tile_rows is None and policy.pallas_blocks is None:
        return jax.vmap(one)(x, w)
    return lax.map(lambda ab: one(ab[0], ab[1]), (x, w))


def gathered_matmul(x: jax.Array, w: jax.Array, policy: NumericPolicy) -> jax.Array:
    """Per-row weights: x [N, k, K] @ w [N, k, K, M] -> [N, k, M] (float32 accumulation, compute dtype out)."""
    cdt = policy.compute_dtype
    x, w = local_reduce(x, policy, (2,)), local_reduce(w, policy, (2,))
    y = precision.einsum("nkc,nkcm->nkm", cast(x, cdt), cast(w, cdt), policy)
    return cast(y, cdt)


def _tiled_grouped(x: jax.Array, w: jax.Array, group_sizes: jax.Array, policy: NumericPolicy) -> jax.Array:
    """The tiled kernel for rows sorted by expert: each expert's rows are zero-padded to whole [T, K] tiles and
    every tile is multiplied by its expert's weight, one tile per dot. A row's bits are those the dense
    dispatch gives it (same row-invariant kernel), at k/E of the dense dispatch's work."""
    n_tiles, dest, tile_expert = tile_layout(group_sizes, x.shape[0], policy.tile_rows)
    # ordered: every expert's whole weight on each device, so no per-tile product (forward or backward) sums
    # across devices
    return _expert_tiles(policy, n_tiles, x, local_reduce(w, policy, (0, 1, 2)), dest, tile_expert)


def tile_layout(group_sizes: jax.Array, rows: int, tile: int) -> tuple[int, jax.Array, jax.Array]:
    """Whole tiles of `tile` rows for rows sorted by expert (group_sizes [E]): (n_tiles, dest [rows] = each row's
    slot in the [n_tiles * tile] tiled rows, tile_expert [n_tiles] non-decreasing). Each expert's rows start a
    new tile; tiles past the last expert's are unused (zero) and belong to the last expert."""
    experts = group_sizes.shape[0]
    n_tiles = -(-rows // tile) + experts  # each expert adds at most one partly filled tile
    padded = (group_sizes + tile - 1) // tile * tile
    padded_end = jnp.cumsum(padded)
    end = jnp.cumsum(group_sizes)
    start = end - group_sizes
    # counts of ends passed, as one compare-and-sum each (the same integers as jnp.repeat and a right-sided
    # jnp.searchsorted, whose loop and scatter kernels were an eighth of an aligned forward's distinct kernels)
    row_expert = jnp.minimum(_ends_passed(end, jnp.arange(rows)), experts - 1)
    dest = (padded_end - padded)[row_expert] + jnp.arange(rows) - start[row_expert]  # row -> slot in the tiles
    tile_expert = jnp.minimum(_ends_passed(padded_end, jnp.arange(n_tiles) * tile), experts - 1)
    return n_tiles, dest, tile_expert


def _ends_passed(ends: jax.Array, positions: jax.Array) -> jax.Array:
    """For non-decreasing `ends` [E]: how many are <= each of `positions` [P] (searchsorted, side="right")."""
    return jnp.sum(ends[None, :] <= positions[:, None], axis=1, dtype=jnp.int32)


def _pallas_grouped(x: jax.Array, w: jax.Array, group_sizes: jax.Array, policy: NumericPolicy,
                    blocks: tuple[int, int, int], target: str) -> jax.Array:
    """The Pallas grouped kernel on the same tile layout as `_tiled_grouped` (T = BM), lowered for `target`."""
    n_tiles, dest, tile_expert = tile_layout(group_sizes, x.shape[0], blocks[0])
    tiles = _to_tiles(x, dest, n_tiles, blocks[0])
    w = local_reduce(w, policy, (0, 1, 2))
    return pallas_grouped_tiles(tiles, w, tile_expert, blocks, target).reshape(-1, w.shape[-1])[dest]


def _to_tiles(rows: jax.Array, dest: jax.Array, n_tiles: int, tile: int) -> jax.Array:
    """Rows scattered to their slots in [n_tiles, tile, width] (unused slots zero), kept whole on one device."""
    buf = jnp.zeros((n_tiles * tile, rows.shape[-1]), rows.dtype).at[dest].set(rows)
    return gather_axes(buf.reshape(n_tiles, tile, -1), (0, 1, 2))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _expert_tiles(policy, n_tiles, x, w, dest, tile_expert):
    tiles = _to_tiles(x, dest, n_tiles, policy.tile_rows)

    def one_tile(carry, tile_and_expert):
        t, e = tile_and_expert
        return carry, gather_axes(_dot(t, w[e], policy), (0,))
    _, out = lax.scan(one_tile, None, (tiles, tile_expert))
    return out.reshape(-1, w.shape[-1])[dest]


def _expert_tiles_fwd(policy, n_tiles, x, w, dest, tile_expert):
    return _expert_tiles(policy, n_tiles, x, w, dest, tile_expert), (x, w, dest, tile_expert)


def _expert_tiles_bwd(policy, n_tiles, residuals, g):
    """Tile by tile, in tile order: dx = g @ w[e]^T, and dW[e] += x^T @ g into one [E, K, N] accumulator (float32
    accumulation). Autodiff of the forward scan instead added a zero-padded [E, K, N] cotangent per tile."""
    x, w, dest, tile_expert = residuals
    x_tiles = _to_tiles(x, dest, n_tiles, policy.tile_rows)
    g_tiles = _to_tiles(g.astype(w.dtype), dest, n_tiles, policy.tile_rows)

    def one_tile(dw, inputs):
        xt, gt, e = inputs
        dx = precision.backward_dot(gt, w[e].T, policy)
        return dw.at[e].add(precision.backward_dot(xt.T, gt, policy)), dx
    dw0 = local_reduce(jnp.zeros(w.shape, jnp.float32), policy, (0, 1, 2))
    dw, dx = lax.scan(one_tile, dw0, (x_tiles, g_tiles, tile_expert))
    return dx.reshape(-1, x.shape[-1])[dest].astype(x.dtype), dw.astype(w.dtype), None, None


_expert_tiles.defvjp(_expert_tiles_fwd, _expert_tiles_bwd)


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, policy: NumericPolicy, *,
                   out_dtype: str | None = None) -> jax.Array:
    """Rows sorted by expert: x [R, K], w [E, K, N], group_sizes [E] -> [R, N] (`lax.ragged_dot` under the xla
    kernel, per-expert [T, K] tiles under `tiled:T` and `pallas:...`; `kernels.select_matmul` chooses the
    implementation for this platform), in `out_dtype` (default: the compute dtype)."""
    x = cast(local_reduce(x, policy, (1,)), policy.compute_dtype)
    w = cast(local_reduce(w, policy, (1,)), policy.compute_dtype)
    impl = select_matmul(policy, x.shape[1], w.shape[2], x.dtype, platform(), kernel="grouped_matmul")
    if impl.kind == "pallas":
        y = _pallas_grouped(x, w, group_sizes, policy, impl.blocks, impl.platform)
    elif impl.kind == "lax-tiled":
        y = _tiled_grouped(x, w, group_sizes, policy)
    elif not policy.low_precision_accumulation:
        y = precision.ragged_dot(x, w, group_sizes, policy)
    else:
        y = None
        for start in range(0, x.shape[-1], ACC_CHUNK):
            part = cast(precision.ragged_dot(x[:, start:start + ACC_CHUNK], w[:, start:start + ACC_CHUNK],
                                             group_sizes, policy), policy.matmul_acc)
            y = part if y is None else y + part
    return cast(y, out_dtype or policy.compute_dtype)


def add_bias(y: jax.Array, b: jax.Array, policy: NumericPolicy) -> jax.Array:
    """y + b, the bias cast to the parameter then the compute dtype."""
    return with_parameter(lambda a, bias: a + as_compute(as_param(bias, policy), policy), policy)(y, b)


def lookup(table: jax.Array, ids: jax.Array, policy: NumericPolicy) -> jax.Array:
    """Rows `ids` of an embedding table, in the compute dtype (its gradient is a scatter-add over ids)."""
    return with_parameter(lambda t, i: as_compute(as_param(t, policy)[i], policy), policy)(table, ids)
