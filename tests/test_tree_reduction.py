"""The halving tree's own gradient and the sorted dispatch's tile layout: the forms that keep the aligned
programs' kernels few (docs/testing.md) give exactly the numbers of the forms they replaced. And the tree policies'
normalisations (`reduce.divide_by`) round the same way in every program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxalign import NumericPolicy
from jaxalign.numerics import precision
from jaxalign.numerics.attention import attention
from jaxalign.numerics.experts import normalize_gate_weights
from jaxalign.numerics.matmul import tile_layout
from jaxalign.numerics.reduce import divide_by, softmax, tree_sum


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


def _forward_and_gradient_programs(fn, *args):
    """fn(*args) from a forward-only program and from one that also computes its gradient (the backward live)."""
    alone = jax.jit(fn)(*args)

    def with_gradient(*xs):
        out, vjp = jax.vjp(fn, *xs)
        return out, vjp(jnp.ones_like(out))
    return np.asarray(alone, np.float32), np.asarray(jax.jit(with_gradient)(*args)[0], np.float32)


@pytest.mark.bitwise
def test_attention_weights_round_the_same_in_a_gradient_program():
    """A division by a broadcast sum is left to XLA:CPU's compiler, which made it a reciprocal-multiply in a
    forward program and kept the division in a gradient program: `token_logprobs` and the RL update's forward
    disagreed (ratio_mean 0.99977 instead of 1 on one device; found by the trainer-mesh RL test under AVX2).
    With compute=f32 nothing rounds the weights to bf16, so every one-ulp difference shows: 9,546 of these
    65,536 outputs differed before `reduce.divide_by`."""
    aligned = NumericPolicy.preset("aligned-bf16")
    policy = NumericPolicy.parse(str(aligned).replace("compute=bf16", "compute=f32"))
    rng = np.random.default_rng(0)
    b, s, h, kvh, d = 16, 64, 4, 2, 16
    q = jnp.asarray(rng.normal(size=(b, s, h, d)) * 2, jnp.bfloat16)
    k = jnp.asarray(rng.normal(size=(b, kvh, d, s)) * 2, jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(b, kvh, s, d)), jnp.bfloat16)
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    alone, in_gradient = _forward_and_gradient_programs(lambda q, k, v: attention(q, k, v, pos, pos, policy),
                                                        q, k, v)
    assert alone.tobytes() == in_gradient.tobytes()


@pytest.mark.bitwise
@pytest.mark.parametrize("normalise", ["softmax", "gate_weights"])
def test_tree_normalisation_is_a_reciprocal_multiply_in_every_program(normalise):
    """Under reduction=tree, x / sum is x * (1 / sum) in float32 -- in a forward program and in a gradient
    program -- and under reduction=xla the sum's order and the quotient are XLA's (the knob changes bits; both stay
    within float32 rounding of the float64 quotient)."""
    tree = NumericPolicy.preset("aligned-bf16")
    rng = np.random.default_rng(1)
    if normalise == "softmax":
        x = jnp.asarray(rng.normal(size=(64, 48)) * 3, jnp.float32)
        fn = lambda p: lambda v: softmax(v, p, "f32")  # noqa: E731
        numerators = jax.jit(lambda v: precision.exp(v - jnp.max(v, -1, keepdims=True), tree))(x)
    else:
        x = jnp.asarray(rng.uniform(0.01, 1.0, size=(256, 8)), jnp.float32)
        fn = lambda p: lambda v: normalize_gate_weights(v, p, renormalize=True)  # noqa: E731
        numerators = x
    total = np.asarray(jax.jit(lambda e: tree_sum(e, -1, keepdims=True))(numerators))  # its order: tested above
    expected = np.asarray(numerators) * (np.float32(1) / total)
    alone, in_gradient = _forward_and_gradient_programs(fn(tree), x)
    assert alone.tobytes() == expected.tobytes()
    assert in_gradient.tobytes() == expected.tobytes()
    xla = NumericPolicy.parse(str(tree).replace("reduce=tree", "reduce=xla"))
    divided = np.asarray(jax.jit(fn(xla))(x))
    assert not np.array_equal(divided, alone)
    exact = np.asarray(numerators, np.float64) / np.asarray(numerators, np.float64).sum(-1, keepdims=True)
    for quotient in (alone, divided):  # a few float32 ulps from the float64 quotient either way
        np.testing.assert_allclose(quotient, exact, rtol=1e-6, atol=0)


@pytest.mark.bitwise
def test_a_narrow_quotient_is_rounded_once():
    """`divide_by` on bf16 operands: the reciprocal and the product in float32, then one rounding to bf16 (a bf16
    reciprocal would have rounded twice more)."""
    tree = NumericPolicy.preset("aligned-bf16")
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.uniform(0.01, 1.0, size=(512, 8)), jnp.bfloat16)
    total = jax.jit(lambda v: tree_sum(v, -1, keepdims=True))(x)
    out = jax.jit(lambda v, t: divide_by(v, t, -1, tree))(x, total)
    assert out.dtype == jnp.bfloat16
    wide = np.asarray(x, np.float32) * (np.float32(1) / np.asarray(total, np.float32))
    assert np.asarray(out).tobytes() == wide.astype(jnp.bfloat16).tobytes()
    narrow = np.asarray(x) * (np.float32(1) / np.asarray(total, np.float32)).astype(jnp.bfloat16)
    assert not np.array_equal(np.asarray(out, np.float32), narrow.astype(np.float32))
