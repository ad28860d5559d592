"""The bucketed expert dispatch (exact, only the selected experts' rows) and the exact selection helpers the
decode loop uses instead of XLA:CPU's slow sort and argmax: each against the plain version it replaces."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxalign import NumericPolicy
from jaxalign.numerics.select import argmax, top_k
from jaxalign.numerics.experts import _buffer_slots, bucket_index, bucket_sizes, dispatch

from conftest import build_model, forward_logits, random_tokens
from reference import forward as reference_forward

FP32 = NumericPolicy.preset("fp32")
E, K, H, F, N = 16, 4, 32, 16, 8


def _weights(seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((E, H, F)), jnp.float32),
            jnp.asarray(rng.standard_normal((E, H, F)), jnp.float32),
            jnp.asarray(rng.standard_normal((E, F, H)), jnp.float32))


def _routing_with_max_load(load: int) -> np.ndarray:
    """idx [N, K] with distinct experts per token, every expert loaded twice except expert 0, loaded `load` times
    (2 <= load <= N)."""
    idx = np.array([[(K * i + j) % E for j in range(K)] for i in range(N)])  # every expert exactly twice
    without_zero = [i for i in range(N) if 0 not in idx[i]]
    for i in without_zero[: load - 2]:
        idx[i, 0] = 0  # moves one assignment from another expert (now loaded once) to expert 0
    return idx.astype(np.int32)


@jax.jit
def _both(x, idx, w_gate, w_up, w_down):
    dense = dispatch(x, idx, w_gate, w_up, w_down, FP32)
    bucketed = dispatch(x, idx, w_gate, w_up, w_down, FP32.replace(dispatch="bucketed"))
    return dense, bucketed


def test_bucket_sizes_ladder():
    assert bucket_sizes(8, 4, 16) == (2, 3, 4, 5, 6, 8)  # a decode step of 8 rows, 16 experts top-4
    assert bucket_sizes(1, 4, 16) == (1,)
    assert bucket_sizes(128, 4, 16) == (32, 40, 48, 64, 80, 96, 128)
    for tokens, k, experts in [(3, 2, 8), (1000, 8, 64), (64, 1, 4)]:
        sizes = bucket_sizes(tokens, k, experts)
        assert list(sizes) == sorted(set(sizes)) and sizes[-1] == tokens


@pytest.mark.parametrize("load", [2, 3, 4, 5, 6, 7, 8])
def test_bucketed_equals_dense_whatever_bucket_it_takes(load):
    """The busiest expert's load picks the smallest bucket that holds it (7 -> the last, all 8 rows), no
    assignment is dropped, and every expert output matches the dense dispatch's."""
    idx = _routing_with_max_load(load)
    _, counts = _buffer_slots(jnp.asarray(idx.reshape(-1)), E)
    assert int(np.max(np.asarray(counts))) == load
    sizes = bucket_sizes(N, K, E)
    chosen = sizes[int(bucket_index(counts, sizes))]
    assert chosen >= load and all(size < load for size in sizes if size < chosen)
    x = jnp.asarray(np.random.default_rng(load).standard_normal((N, H)), jnp.float32)
    (dense, dense_kept), (bucketed, kept) = _both(x, jnp.asarray(idx), *_weights())
    assert bool(np.all(np.asarray(kept))) and bool(np.all(np.asarray(dense_kept)))
    np.testing.assert_allclose(np.asarray(bucketed), np.asarray(dense), rtol=1e-5, atol=1e-4)


def test_bucketed_gradients_match_dense():
    idx = jnp.asarray(_routing_with_max_load(5))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((N, H)), jnp.float32)
    probe = jnp.asarray(np.random.default_rng(2).standard_normal((N, K, H)), jnp.float32)

    def loss(policy):
        return lambda x, w: jnp.sum(dispatch(x, idx, *w, policy)[0] * probe)

    weights = _weights()
    dense = jax.jit(jax.grad(loss(FP32), argnums=(0, 1)))(x, weights)
    bucketed = jax.jit(jax.grad(loss(FP32.replace(dispatch="bucketed")), argnums=(0, 1)))(x, weights)
    for got, want in zip(jax.tree.leaves(bucketed), jax.tree.leaves(dense)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


def test_dense_dispatch_input_gradient_is_the_tree_sum_over_experts():
    """The dense dispatch's input gradient (a custom VJP of its broadcast) is the halving-tree sum of the experts'
    contributions: equal to autodiff of a plain broadcast within f32 rounding."""
    from jaxalign.numerics.experts import expert_ffn

    idx = jnp.asarray(_routing_with_max_load(3))
    x = jnp.asarray(np.random.default_rng(3).standard_normal((N, H)), jnp.float32)
    probe = jnp.asarray(np.random.default_rng(4).standard_normal((N, K, H)), jnp.float32)
    w = _weights()

    def plain(x):
        y_all = expert_ffn(jnp.broadcast_to(x, (E,) + x.shape), *w, FP32)
        return jnp.sum(jnp.take_along_axis(jnp.moveaxis(y_all, 0, 1), idx[..., None], axis=1) * probe)

    ours = jax.jit(jax.grad(lambda x: jnp.sum(dispatch(x, idx, *w, FP32)[0] * probe)))(x)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(jax.jit(jax.grad(plain))(x)), rtol=1e-5, atol=1e-4)


def test_bucketed_model_gradients_match_dense():
    """Through a whole model (the bucketed backward recomputes each branch's forward inside its own switch)."""
    from flax import nnx

    from jaxalign import sequence_logprobs

    model = build_model("tiny")
    graphdef, params = nnx.split(model)
    tokens = jnp.asarray(random_tokens(model.config, 4, 24, seed=5))

    def grads(policy):
        loss = lambda p: -jnp.mean(sequence_logprobs(nnx.merge(graphdef, p), tokens, policy)[0])  # noqa: E731
        return jax.jit(jax.grad(loss))(params)

    dense, bucketed = grads(FP32), grads(FP32.replace(dispatch="bucketed"))
    for got, want in zip(jax.tree.leaves(bucketed), jax.tree.leaves(dense)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("preset", ["tiny", "tiny-glm4-moe"])
def test_bucketed_fp32_matches_float64_reference(preset):
    model = build_model(preset)
    tokens = random_tokens(model.config, 2, 16, seed=1)
    logits, record = forward_logits(model, jnp.asarray(tokens), FP32.replace(dispatch="bucketed"))
    ref_logits, ref_idx = reference_forward(model, tokens)
    np.testing.assert_array_equal(np.asarray(record.indices), ref_idx)
    err = np.max(np.abs(np.asarray(logits, np.float64) - ref_logits)) / np.max(np.abs(ref_logits))
    assert err <= 1e-5


def _awkward_scores(rng, shape):
    """Scores with ties, signed zeros, infinities and NaNs."""
    x = rng.standard_normal(shape).astype(np.float32)
    for value, share in [(0.5, 0.3), (-0.0, 0.1), (0.0, 0.1), (np.inf, 0.05), (-np.inf, 0.05), (np.nan, 0.05)]:
        x[rng.random(shape) < share] = value
    return x


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_top_k_equals_lax_top_k_bit_for_bit(dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(_awkward_scores(rng, (64, 16)), dtype)
    for k in (1, 2, 5, 16):
        want_vals, want_idx = lax.top_k(x, k)
        got_vals, got_idx = jax.jit(top_k, static_argnums=1)(x, k)
        np.testing.assert_array_equal(np.asarray(got_idx), np.asarray(want_idx))
        bits = np.uint16 if dtype == jnp.bfloat16 else np.uint32
        np.testing.assert_array_equal(np.asarray(got_vals).view(bits), np.asarray(want_vals).view(bits))


def test_argmax_equals_jnp_argmax():
    rng = np.random.default_rng(1)
    x = _awkward_scores(rng, (256, 40))
    x[0] = -np.inf  # all -inf: index 0
    x[1] = 0.25  # all tied: index 0
    x[2, 7] = x[2, 30] = np.nan  # the first NaN
    np.testing.assert_array_equal(np.asarray(jax.jit(argmax)(jnp.asarray(x))),
                                  np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
