"""The grouped per-expert product of the sorted dispatch as Pallas kernels (`kernel=pallas:BMxBNxBK`).

Rows sorted by expert are laid out by `matmul.tile_layout` in whole [BM, K] tiles, each tile holding rows of one
expert only (as `tiled:T` does with T = BM). One kernel instance computes one [BM, BN] output block of one tile
with its expert's weight: the contraction in BK chunks, in order, float32 accumulation, so a row's bits are those
`pallas_matmul` gives it against that expert's weight alone -- the dense dispatch's bits, at k/E of its work.

The weight gradient dW[e] = sum over e's tiles of tile^T @ g_tile is one kernel instance per [BM, BN] block of
dW[e], looping over e's tiles in tile order (f32). The weights (forward) and the tiles (dW) are read from whole
arrays with a dynamic expert/tile index: portable to interpret mode, Triton and Mosaic, but on a TPU they then sit
whole in VMEM (fine for small experts; blocking them with scalar prefetch is not done here).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxalign.numerics import platforms
from jaxalign.numerics.pallas_matmul import _block, _precision, _round_up, backend

def _whole():
    """BlockSpec for an operand read whole (indexed inside the kernel)."""
    return pl.no_block_spec


def _scalars(platform: str):
    """BlockSpec for a whole int32 vector read one scalar at a time (SMEM on a TPU: Mosaic reads scalars
    from there)."""
    return pl.BlockSpec(memory_space=pltpu.SMEM) if platform == "tpu" else pl.no_block_spec


def _grouped_kernel(te_ref, x_ref, w_ref, o_ref, *, bk: int, bn: int, n_k: int, precision):
    """Output block (tile i, columns j) = tile i @ w[expert of tile i][:, j-th bn columns]."""
    e = te_ref[pl.program_id(0)]
    cols = pl.ds(pl.multiple_of(pl.program_id(1) * bn, bn), bn)

    def chunk(c, acc):
        start = pl.multiple_of(c * bk, bk)
        return acc + jnp.dot(x_ref[:, pl.ds(start, bk)], w_ref[e, pl.ds(start, bk), cols],
                             preferred_element_type=jnp.float32, precision=precision)
    o_ref[...] = lax.fori_loop(0, n_k, chunk, jnp.zeros(o_ref.shape, jnp.float32))


def _grouped(tiles: jax.Array, w: jax.Array, tile_expert: jax.Array, blocks: tuple[int, int, int],
             platform: str) -> jax.Array:
    """tiles [n_tiles, BM, K] @ w[tile_expert] [., K, N] -> float32 [n_tiles, BM, N]."""
    bm, bn_req, bk_req = blocks
    n_tiles, tile, k = tiles.shape
    assert tile == bm, (tile, bm)
    n = w.shape[-1]
    bn, bk = _block(bn_req, n, platform), _block(bk_req, k, platform)
    np_, kp = _round_up(n, bn), _round_up(k, bk)
    if platform == "gpu":
        kp = pl.next_power_of_2(kp)
    x = jnp.pad(tiles, ((0, 0), (0, 0), (0, kp - k))).reshape(n_tiles * bm, kp)
    w = jnp.pad(w.astype(tiles.dtype), ((0, 0), (0, kp - k), (0, np_ - n)))
    out = pl.pallas_call(
        functools.partial(_grouped_kernel, bk=bk, bn=bn, n_k=kp // bk, precision=_precision(tiles.dtype)),
        out_shape=jax.ShapeDtypeStruct((n_tiles * bm, np_), jnp.float32),
        grid=(n_tiles, np_ // bn),
        in_specs=[_scalars(platform), pl.BlockSpec((bm, kp), lambda i, j: (i, 0)), _whole()],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        interpret=platforms.interpret_mode(platform),
        name="jaxalign_grouped_matmul",
    )(tile_expert.astype(jnp.int32), x, w)
    return out.reshape(n_tiles, bm, np_)[..., :n]


def _weight_grad_kernel(first_ref, end_ref, x_ref, g_ref, o_ref, *, bm: int, bn: int, precision):
    """dW[e] block (rows i, columns j) = sum over e's tiles t, in order, of x[t][:, rows]^T @ g[t][:, columns]."""
    e = pl.program_id(0)
    rows = pl.ds(pl.multiple_of(pl.program_id(1) * bm, bm), bm)
    cols = pl.ds(pl.multiple_of(pl.program_id(2) * bn, bn), bn)

    def one_tile(t, acc):
        return acc + jnp.dot(x_ref[t, :, rows].T, g_ref[t, :, cols],
                             preferred_element_type=jnp.float32, precision=precision)
    o_ref[...] = lax.fori_loop(first_ref[e], end_ref[e], one_tile, jnp.zeros(o_ref.shape, jnp.float32))


def _weight_grad(tiles: jax.Array, g_tiles: jax.Array, tile_expert: jax.Array, n_experts: int,
                 blocks: tuple[int, int, int], platform: str) -> jax.Array:
    """dW [E, K, N] float32 from tiles [n_tiles, BM, K] and cotangent tiles [n_tiles, BM, N]."""
    bm, bn_req, _ = blocks
    k, n = tiles.shape[-1], g_tiles.shape[-1]
    bk_rows, bn = _block(bm, k, platform), _block(bn_req, n, platform)
    kp, np_ = _round_up(k, bk_rows), _round_up(n, bn)
    x = jnp.pad(tiles, ((0, 0), (0, 0), (0, kp - k)))
    g = jnp.pad(g_tiles.astype(tiles.dtype), ((0, 0), (0, 0), (0, np_ - n)))
    experts = jnp.arange(n_experts, dtype=tile_expert.dtype)
    first = jnp.searchsorted(tile_expert, experts, side="left").astype(jnp.int32)
    end = jnp.searchsorted(tile_expert, experts, side="right").astype(jnp.int32)
    out = pl.pallas_call(
        functools.partial(_weight_grad_kernel, bm=bk_rows, bn=bn, precision=_precision(tiles.dtype)),
        out_shape=jax.ShapeDtypeStruct((n_experts, kp, np_), jnp.float32),
        grid=(n_experts, kp // bk_rows, np_ // bn),
        in_specs=[_scalars(platform), _scalars(platform), _whole(), _whole()],
        out_specs=pl.BlockSpec((None, bk_rows, bn), lambda e, i, j: (e, i, j)),
        interpret=platforms.interpret_mode(platform),
        name="jaxalign_grouped_weight_grad",
    )(first, end, x, g)
    return out[:, :k, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def pallas_grouped_tiles(tiles: jax.Array, w: jax.Array, tile_expert: jax.Array,
                         blocks: tuple[int, int, int], platform: str | None = None) -> jax.Array:
    """Per-tile expert products: tiles [n_tiles, BM, K], w [E, K, N], tile_expert [n_tiles] (non-decreasing:
    tiles sorted by expert) -> float32 [n_tiles, BM, N]. Gradients by the same kernels: dtiles = g @ w[e]^T
    (this kernel on the transposed weights), dW[e] summed over e's tiles in tile order. Lowered for `platform`
    (default: `backend()`; pass it positionally)."""
    return _grouped(tiles, w, tile_expert, blocks, platform or backend())


def _fwd(tiles, w, tile_expert, blocks, platform):
    return _grouped(tiles, w, tile_expert, blocks, platform or backend()), (tiles, w, tile_expert)


def _bwd(blocks, platform, residuals, g):
    tiles, w, tile_expert = residuals
    g = g.astype(tiles.dtype)
    platform = platform or backend()
    d_tiles = _grouped(g, jnp.swapaxes(w, 1, 2), tile_expert, blocks, platform).astype(tiles.dtype)
    d_w = _weight_grad(tiles, g, tile_expert, w.shape[0], blocks, platform).astype(w.dtype)
    return d_tiles, d_w, None


pallas_grouped_tiles.defvjp(_fwd, _bwd)
