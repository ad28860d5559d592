"""The halving tree's own gradient and the sorted dispatch's tile layout: the forms that keep the aligned
programs' kernels few (README, Set-up) give exactly the numbers of the forms they replaced."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxalign.numerics.matmul import tile_layout
from jaxalign.numerics.reduce import tree_sum


@pytest.mark.parametrize("shape, axis, keepdims", [((5, 13), -1, False), ((4, 8, 3), 1, True), ((7,), 0, False),
                                                   ((2, 3, 6), 0, True)])
def test_tree_sum_gradient_is_the_cotangent_broadcast_back(shape, axis, keepdims):
    """d(sum)/dx_i = 1: every element's cotangent is the output's, bit for bit -- a -0.0 stays -0.0 (autodiff of
    the folds gave `-0 + 0 = +0`) -- and the gradient program pads nothing (autodiff transposed each fold into
    two pads and an add)."""
    rng = np.random.default_rng(len(shape) + axis)
    x = jnp.asarray(rng.normal(size=shape), jnp.float32)
    forward = lambda v: tree_sum(v, axis, keepdims)  # noqa: E731
    out_shape = jax.eval_shape(forward, x).shape
    g = rng.normal(size=out_shape).astype(np.float32)
    g.reshape(-1)[::3] = -0.0
    (dx,) = jax.jit(lambda v, c: jax.vjp(forward, v)[1](c))(x, jnp.asarray(g))
    expected = np.broadcast_to(g if keepdims else np.expand_dims(g, axis), shape)
    assert np.asarray(dx).tobytes() == np.ascontiguousarray(expected).tobytes()
    program = jax.jit(lambda v, c: jax.vjp(forward, v)[1](c)).lower(x, jnp.asarray(g)).as_text()
    assert "stablehlo.pad" not in program
    # the forward is still the fixed halving tree: zero padding to the next power of two, then folds
    width = 1 << (shape[axis] - 1).bit_length()
    padded = np.concatenate([np.asarray(x), np.zeros(shape[:axis % len(shape)] + (width - shape[axis],)
                                                     + shape[axis % len(shape) + 1:], np.float32)], axis=axis)
    while padded.shape[axis] > 1:
        half = padded.shape[axis] // 2
        padded = np.take(padded, range(half), axis=axis) + np.take(padded, range(half, 2 * half), axis=axis)
    folded = padded if keepdims else np.squeeze(padded, axis)
    assert np.asarray(forward(x)).tobytes() == folded.astype(np.float32).tobytes()


def _numpy_layout(group_sizes: np.ndarray, rows: int, tile: int):
    """The layout as jnp.repeat (padded with its last value) and a right-sided searchsorted define it."""
    experts = len(group_sizes)
    n_tiles = -(-rows // tile) + experts
    padded = (group_sizes + tile - 1) // tile * tile
    padded_end = np.cumsum(padded)
    start = np.cumsum(group_sizes) - group_sizes
    row_expert = np.repeat(np.arange(experts), group_sizes)[:rows]
    row_expert = np.concatenate([row_expert, np.full(rows - len(row_expert), experts - 1)]).astype(int)
    dest = (padded_end - padded)[row_expert] + np.arange(rows) - start[row_expert]
    tile_expert = np.minimum(np.searchsorted(padded_end, np.arange(n_tiles) * tile, side="right"), experts - 1)
    return n_tiles, dest, tile_expert


@pytest.mark.parametrize("experts, rows, tile", [(8, 32, 8), (5, 20, 3), (1, 7, 4), (11, 64, 16)])
def test_tile_layout_is_repeat_and_searchsorted(experts, rows, tile):
    """Generated loads -- rows split over the experts, fewer rows than slots (replay padding), every row on one
    expert, empty experts -- give numpy's repeat/searchsorted layout exactly."""
    rng = np.random.default_rng(experts * rows + tile)
    layout = jax.jit(tile_layout, static_argnums=(1, 2))
    loads = [np.bincount(rng.integers(0, experts, rows), minlength=experts) for _ in range(8)]
    loads += [np.bincount(rng.integers(0, experts, int(rng.integers(0, rows))), minlength=experts) for _ in range(4)]
    loads += [np.eye(experts, dtype=int)[rng.integers(0, experts)] * rows, np.zeros(experts, int)]
    for load in loads:
        n_tiles, dest, tile_expert = layout(jnp.asarray(load, jnp.int32), rows, tile)
        want = _numpy_layout(load, rows, tile)
        assert n_tiles == want[0]
        np.testing.assert_array_equal(np.asarray(dest), want[1], err_msg=str(load))
        np.testing.assert_array_equal(np.asarray(tile_expert), want[2], err_msg=str(load))
