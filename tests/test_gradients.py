"""Gradients under train-bf16 and aligned-bf16 are finite and agree with fp32 to bf16 tolerance; the
hand-written backward passes of the batch-invariant kernels agree with fp32 autodiff to float32 tolerance."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxalign import NumericPolicy, sequence_logprobs

from conftest import build_model, forward_logits, random_tokens


def _grads(model, tokens, policy, replay):
    graphdef, state = nnx.split(model, nnx.Param)

    def loss(params):
        lp, _ = sequence_logprobs(nnx.merge(graphdef, params), tokens, policy, replay=replay)
        return -jnp.mean(lp)

    return jax.jit(jax.grad(loss))(state)


@pytest.mark.parametrize("name", [pytest.param("train-bf16", marks=pytest.mark.full_matrix(
    cover="tests/test_gradients.py::test_bf16_gradients_match_fp32[aligned-bf16]",
    why="the same tolerance from fp32 for the other bf16 trainer")), "aligned-bf16"])
def test_bf16_gradients_match_fp32(name):
    model = build_model("tiny-qwen3-moe")
    tokens = jnp.asarray(random_tokens(model.config, 4, 24, seed=6))
    fp32, bf16 = NumericPolicy.preset("fp32"), NumericPolicy.preset(name)
    # Same experts on both sides (R2-style replay of the fp32 routing), so only precision differs.
    _, record = forward_logits(model, tokens, fp32)
    g32 = jax.tree.leaves(_grads(model, tokens, fp32, record.indices))
    g16_tree = _grads(model, tokens, bf16, record.indices)
    g16 = jax.tree.leaves(g16_tree)
    assert len(g32) == len(g16) > 10
    checked = 0
    for a, b in zip(g32, g16):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.all(np.isfinite(b))
        norm = np.linalg.norm(a)
        if norm > 1e-6:
            checked += 1
            assert np.linalg.norm(a - b) <= 0.05 * norm, (np.linalg.norm(a - b) / norm)
    assert checked > 10
    # the router receives gradient through the recomputed gate weights even under replay
    router_grads = [np.abs(np.asarray(g)).sum() for path, g in jax.tree_util.tree_leaves_with_path(g16_tree)
                    if "router" in jax.tree_util.keystr(path)]
    assert router_grads and all(g > 0 for g in router_grads)


@pytest.mark.parametrize("preset", ["tiny", pytest.param("tiny-glm4-moe", marks=pytest.mark.full_matrix(
    cover="tests/test_gradients.py::test_custom_backward_passes_match_autodiff_in_fp32[tiny]",
    why="the same custom backward passes on shared experts and the grouped sigmoid router"))])
def test_custom_backward_passes_match_autodiff_in_fp32(preset):
    """Tiled kernels, tree reductions and the tiled sorted dispatch have hand-written VJPs (numerics/); in fp32
    their gradients equal XLA's autodiff of the plain kernels to float32 rounding."""
    model = build_model(preset)
    tokens = jnp.asarray(random_tokens(model.config, 3, 20, seed=2))
    plain = NumericPolicy.preset("fp32")
    custom = plain.replace(matmul_kernel="tiled:8", reduction="tree", dispatch="sorted")
    _, record = forward_logits(model, tokens, plain)
    for a, b in zip(jax.tree.leaves(_grads(model, tokens, plain, record.indices)),
                    jax.tree.leaves(_grads(model, tokens, custom, record.indices))):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(a) + 1e-9


def test_clipping_norm_in_tree_order_matches_optax():
    """The trainer clips by a global norm summed as its policy says (a fixed tree under reduction=tree, so a
    sharded trainer gets one device's bits); it equals optax's norm and clipping to float32 rounding, and under
    the tree order it no longer depends on how the leaves' adds were fused (the mesh tests check the bits)."""
    import optax

    from jaxalign.numerics.reduce import global_norm
    from jaxalign.rl.trainer import clip_by_global_norm

    model = build_model("tiny")
    tokens = jnp.asarray(random_tokens(model.config, 3, 20, seed=2))
    grads = _grads(model, tokens, NumericPolicy.preset("fp32"), None)
    tree = NumericPolicy.preset("aligned-bf16")
    # jitted, as the trainer runs them (op by op, each leaf's ops would compile apart)
    norm = jax.jit(optax.tree.norm)
    reference = float(norm(grads))
    policy_norm = jax.jit(global_norm, static_argnums=1)
    for policy in (NumericPolicy.preset("fp32"), tree):
        assert float(policy_norm(grads, policy)) == pytest.approx(reference, rel=1e-6)
    max_norm = reference / 3  # clipping active
    ours = jax.jit(lambda g: clip_by_global_norm(max_norm, tree).update(g, optax.EmptyState())[0])(grads)
    theirs = jax.jit(lambda g: optax.clip_by_global_norm(max_norm).update(g, optax.EmptyState())[0])(grads)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9)
    assert float(norm(ours)) == pytest.approx(max_norm, rel=1e-6)
