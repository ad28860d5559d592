"""The trainer's AdamW under `reduction=tree` (numerics.optimizer): optax's arithmetic and state, with every
multiply-add rounded twice (never contracted into an FMA), so an update has the same bits in any program."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxalign.numerics import NumericPolicy
from jaxalign.numerics.optimizer import adamw

TREE = NumericPolicy.preset("aligned-bf16")


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    params = {"w": jnp.asarray(rng.normal(size=(33, 17)), jnp.float32), "b": jnp.asarray(rng.normal(size=5),
                                                                                          jnp.float32)}
    grads = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params) for _ in range(3)]
    return params, grads


def _steps(opt, params, grads, step):
    state = opt.init(params)
    for g in grads:
        params, state = step(opt, params, state, g)
    return params, state


def _one_program(opt, params, state, g):
    @jax.jit
    def run(params, state, g):
        updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state
    return run(params, state, g)


def _two_programs(opt, params, state, g):
    updates, state = jax.jit(lambda g, s, p: opt.update(g, s, p))(g, state, params)
    return jax.jit(optax.apply_updates)(params, updates), state


@pytest.mark.bitwise
def test_adamw_is_optax_adamw_with_uncontracted_multiply_adds():
    params, grads = _problem()
    ours = _steps(adamw(1e-2, 0.1, TREE), params, grads, _one_program)
    theirs = _steps(optax.adamw(1e-2, weight_decay=0.1), params, grads, _one_program)
    assert jax.tree.structure(ours[1]) == jax.tree.structure(theirs[1])  # checkpoints interchangeable
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    # the same bits whether the update and its application are one program or two (they fuse differently)
    apart = _steps(adamw(1e-2, 0.1, TREE), params, grads, _two_programs)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(apart)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_adamw_under_xla_reduction_is_optax_and_refuses_a_schedule():
    assert type(adamw(1e-3, 0.0, NumericPolicy.preset("fp32")).update) is type(optax.adamw(1e-3).update)
    with pytest.raises(TypeError, match="learning_rate"):
        adamw(optax.constant_schedule(1e-3), 0.0, TREE)


@pytest.mark.bitwise
def test_a_leafs_update_does_not_depend_on_the_other_leaves_in_its_program():
    """optax divides each moment by its bias correction, a broadcast scalar; XLA made that division a
    reciprocal-multiply in some programs and not in others (here, before `_bias_corrected`, leaf `a` updated alone
    vs beside the others: 647 of its 2,048 entries differed). `_bias_corrected` states the product, so a leaf's
    update has one set of bits."""
    rng = np.random.default_rng(3)
    shapes = {"a": (64, 32), "b": (64, 32), "c": (48, 16), "d": (7,)}
    params = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
    grads = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
    opt = adamw(1e-3, 0.01, TREE)
    state = opt.init(params)
    step = jax.jit(lambda g, s, p: opt.update(g, s, p))
    for _ in range(3):  # moments and count past their initial values
        _, state = step(grads, state, params)
    together = step(grads, state, params)[0]
    adam, *rest = state
    for name in shapes:
        def alone(g, mu, nu, count, p, name=name):
            one = (optax.ScaleByAdamState(count=count, mu={name: mu}, nu={name: nu}), *rest)
            return opt.update({name: g}, one, {name: p})[0][name]
        update = jax.jit(alone)(grads[name], adam.mu[name], adam.nu[name], adam.count, params[name])
        assert np.asarray(update).tobytes() == np.asarray(together[name]).tobytes(), name
