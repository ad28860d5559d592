"""Batch invariance: the tiled matmul and the whole aligned-bf16 forward give bitwise-identical per-row results
whatever the batch size and the row's position; XLA's own kernel does not on this CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxalign import ModelConfig
from jaxalign.numerics import NumericPolicy
from jaxalign.numerics.matmul import matmul

from conftest import FAMILY_PRESETS, build_model, forward_logits, random_tokens

ALIGNED = NumericPolicy.preset("aligned-bf16")


def _rows_by_batch(policy, rng_seed=0, k=64, n=96):
    rng = np.random.default_rng(rng_seed)
    x = jnp.asarray(rng.standard_normal((32, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    f = jax.jit(lambda a: matmul(a, w, policy, out_dtype="f32"))
    alone = np.stack([np.asarray(f(x[i:i + 1]))[0] for i in range(32)])
    results = {}
    for batch in range(1, 33):
        results[batch] = np.asarray(f(x[:batch]))
    shuffled = np.random.default_rng(1).permutation(32)
    results["shuffled"] = np.asarray(f(x[shuffled]))[np.argsort(shuffled)]
    return alone, results


@pytest.mark.parametrize("policy", [ALIGNED, ALIGNED.replace(matmul_kernel="tiled:4"),
                                    NumericPolicy.parse("fp32,kernel=tiled:8")], ids=str)
def test_tiled_matmul_is_batch_and_position_invariant(policy):
    alone, results = _rows_by_batch(policy)
    for batch, rows in results.items():
        expected = alone if batch == "shuffled" else alone[:batch]
        np.testing.assert_array_equal(rows, expected, err_msg=f"batch {batch}")


@pytest.mark.bitwise
def test_tiled_matmul_of_a_transposed_weight_is_batch_invariant():
    """A weight stored [N, K] and multiplied as `w.T` (DeepSeek-V4's hyper-connection `fn`): at one tile (8 rows or
    fewer, an engine's decode step) XLA folded the transpose into the dot, YNNPACK's [M, K] x [N, K]^T kernel, while
    more tiles read a transposed copy, [M, K] x [K, N]: for float32 operands at K=64, N=8 other bits. The
    product now sees its operands as computed (`matmul.as_computed`)."""
    policy = NumericPolicy.parse("fp32,kernel=tiled:8")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
    w_t = jnp.asarray(rng.standard_normal((8, 64)), jnp.float32)
    f = jax.jit(lambda a, w_t: matmul(a, w_t.T, policy, out_dtype="f32"))
    alone = np.stack([np.asarray(f(x[i:i + 1], w_t))[0] for i in range(32)])
    for batch in (8, 9, 16, 32):
        np.testing.assert_array_equal(np.asarray(f(x[:batch], w_t)), alone[:batch], err_msg=f"batch {batch}")


def test_xla_matmul_is_not_batch_invariant_on_this_cpu():
    """Documents the problem the tiled kernel solves: XLA:CPU's dot gives other bits for the same row when it
    is multiplied together with other rows."""
    alone, results = _rows_by_batch(NumericPolicy.preset("train-bf16"))
    differing = [b for b, rows in results.items() if b != "shuffled" and not np.array_equal(rows, alone[:b])]
    assert differing, "XLA's kernel happened to be batch invariant here; the tiled kernel is then not needed"


@pytest.mark.bitwise
def test_aligned_forward_is_batch_and_position_invariant():
    model = build_model("tiny")
    pool = random_tokens(model.config, 13, 16, seed=4)
    alone = np.stack([np.asarray(forward_logits(model, pool[i:i + 1], ALIGNED)[0])[0] for i in range(13)])
    for batch in (3, 8, 13):  # part of a row tile (tiled:8), one tile, one and a part
        got = np.asarray(forward_logits(model, pool[:batch], ALIGNED)[0])
        np.testing.assert_array_equal(got, alone[:batch], err_msg=f"batch {batch}")
    order = np.random.default_rng(5).permutation(13)  # rows moved between the two tiles and within them
    got = np.asarray(forward_logits(model, pool[order], ALIGNED)[0])[np.argsort(order)]
    np.testing.assert_array_equal(got, alone)


# The dispatch sees the routed experts' shapes (8 experts, top 4, width 16 in every tiny family) and the combine
# weights; the families differ in how those weights are made. One family per kind of weight: softmax top-k
# renormalised (tiny, as qwen3-moe and mixtral), softmax top-k as is (olmoe, as qwen2-moe), grouped sigmoid scaled
# by 2.5 beside a shared expert and a first dense layer (glm5, as glm4-moe and deepseek-v3).
DISPATCH_FAMILIES = ("tiny", "tiny-olmoe", "tiny-glm5")


def test_the_dispatch_families_cover_every_kind_of_combine_weight():
    """DISPATCH_FAMILIES stands for every family: each family's routed experts have the shapes of one of them and
    makes its combine weights as that one does."""
    def routed(preset):
        c = ModelConfig.preset(preset)
        return c.n_experts, c.top_k, c.expert_dim, c.d_model

    def weights(preset):
        c = ModelConfig.preset(preset)
        return c.router, c.norm_topk_prob, c.n_groups, c.topk_groups, c.routed_scaling_factor

    assert {routed(p) for p in FAMILY_PRESETS} == {routed(p) for p in DISPATCH_FAMILIES}
    assert {weights(p) for p in FAMILY_PRESETS} == {weights(p) for p in DISPATCH_FAMILIES}
    assert len({weights(p) for p in DISPATCH_FAMILIES}) == len(DISPATCH_FAMILIES)


@pytest.mark.parametrize("preset", DISPATCH_FAMILIES)
def test_tiled_sorted_and_bucketed_dispatches_give_the_dense_dispatch_bits(preset):
    """Under the tiled kernel a row's bits do not depend on its tile-mates, so running only the selected experts
    (sorted tiles, or the bucketed dispatch's per-expert buffers) gives exactly what running every expert on
    every token (dense) gives."""
    model = build_model(preset)
    tokens = random_tokens(model.config, 5, 23, seed=1)
    sorted_ = NumericPolicy.preset("aligned-bf16")
    assert sorted_.dispatch == "sorted"
    dense = np.asarray(forward_logits(model, tokens, sorted_.replace(dispatch="dense"))[0])
    np.testing.assert_array_equal(np.asarray(forward_logits(model, tokens, sorted_)[0]), dense)
    np.testing.assert_array_equal(
        np.asarray(forward_logits(model, tokens, sorted_.replace(dispatch="bucketed"))[0]), dense)
