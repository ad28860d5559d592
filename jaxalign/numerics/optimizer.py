"""AdamW with every multiply-add decided by the policy (`reduction="tree"`: never contracted into an FMA).

optax's AdamW computes `(1 - b1) * g + b1 * mu`, `g + wd * p` and (with `apply_updates`) `p + (-lr * u)`:
multiply-adds that XLA:CPU lets LLVM fuse into FMAs on ISAs that have them (AVX2 and later), whenever the
multiply and the add share a fusion -- which differs between a one-device program and a mesh's or another
process's, so the same update rounded differently (a two-process RL run drifted from one device from its second
step on an AVX2 CPU). Here each product is rounded on its own (`numerics.reduce.uncontracted`): the arithmetic is
optax's, with two roundings per multiply-add in every program and under every ISA -- and one deliberate difference:
the bias correction multiplies by the reciprocal where optax divides (`_bias_corrected`). The optimizer state has
optax.adamw's structure (ScaleByAdamState, EmptyState, EmptyState), so checkpoints are interchangeable.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxalign.numerics.policy import NumericPolicy
from jaxalign.numerics.reduce import uncontracted


def _bias_corrected(moment, decay: float, count):
    """optax's bias correction `t / (1 - decay**count)`, stated as `t * (1 / (1 - decay**count))`.

    XLA:CPU's compiler turns a division by a broadcast scalar into that product in some programs and keeps the
    division in others (where the broadcast has several users, e.g. leaves of one shape): the same leaf's update
    took other bits when updated alone than beside other leaves (647 of 2,048 entries of one leaf in its test). The
    product is the form it never rewrites back, so every program rounds alike (`numerics.reduce.divide_by` does the
    same for sums)."""
    inverse = 1.0 / (1.0 - jnp.asarray(decay, jnp.float32) ** count)
    return jax.tree.map(lambda t: t * inverse.astype(t.dtype), moment)


def _scale_by_adam(b1: float, b2: float, eps: float, policy: NumericPolicy) -> optax.GradientTransformation:
    def init(params):
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)  # noqa: E731
        return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=zeros(), nu=zeros())

    def moment(g, t, decay):
        return uncontracted((1 - decay) * g, policy) + uncontracted(decay * t, policy)

    def update(updates, state, params=None):
        del params
        mu = jax.tree.map(lambda g, t: moment(g, t, b1), updates, state.mu)
        nu = jax.tree.map(lambda g, t: moment(g * g, t, b2), updates, state.nu)
        count = optax.safe_increment(state.count)
        mu_hat, nu_hat = _bias_corrected(mu, b1, count), _bias_corrected(nu, b2, count)
        out = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu_hat, nu_hat)
        return out, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init, update)


def _add_decayed_weights(weight_decay: float, policy: NumericPolicy) -> optax.GradientTransformation:
    def update(updates, state, params):
        return jax.tree.map(lambda g, p: g + uncontracted(weight_decay * p, policy), updates, params), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _scale_by_learning_rate(learning_rate: float, policy: NumericPolicy) -> optax.GradientTransformation:
    def update(updates, state, params=None):
        del params  # `optax.apply_updates` adds the product to the parameters: kept from contracting with it
        return jax.tree.map(lambda u: uncontracted(-learning_rate * u, policy), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def adamw(learning_rate: float, weight_decay: float, policy: NumericPolicy, b1: float = 0.9, b2: float = 0.999,
          eps: float = 1e-8) -> optax.GradientTransformation:
    """optax.adamw(learning_rate, b1, b2, eps, weight_decay=weight_decay) (constant learning rate, no mask, no
    nesterov) with its multiply-adds uncontracted under `policy.tree_reduction` (see module docstring);
    under `reduction="xla"` optax's own."""
    if isinstance(learning_rate, bool) or not isinstance(learning_rate, (int, float)):
        raise TypeError(f"learning_rate = {learning_rate!r}; allowed: a number (no schedule)")
    if not policy.tree_reduction:
        return optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    return optax.chain(_scale_by_adam(b1, b2, eps, policy), _add_decayed_weights(weight_decay, policy),
                       _scale_by_learning_rate(learning_rate, policy))
