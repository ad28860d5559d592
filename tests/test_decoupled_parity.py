"""The decoupled objective of asynchronous rollouts against AReaL's (re-implemented in tests/areal_reference.py).

jaxalign's decoupled mode is two steps: `correct(logp_proximal, logp_behaviour, mask, cfg)` makes the IS weights
pi_proximal / pi_behaviour (constants) and `policy_loss(logp, logp_proximal, ...)` takes the PPO-clip ratio
against the proximal policy. With the weights' band set to AReaL's cap (`is_threshold="0_CAP"`: weights above the
cap are 0, their tokens still counted in the mean) or unbounded (`"inf"`), that is AReaL's `ppo_actor_loss_fn`
with `use_decoupled_loss=True`: the loss, its gradient, the behaviour weights and the clip fraction agree on
generated batches to float32 rounding (jaxalign computes the loss in float32, the reference in float64)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import areal_reference as areal

from jaxalign.rl.correction import CorrectionConfig, correct
from jaxalign.rl.grpo import GRPOConfig, policy_loss

CASES = 60
EPS32 = 2.0 ** -24


def _case(rng: np.random.Generator):
    """current, proximal, behaviour logprobs [6, 16] (float32, as the trainer holds them; one shape, so one
    compiled loss), advantages [6] and a ragged mask (some rows empty): the proximal policy up to ~1 nat from the
    behaviour one (staleness and numerics), the current one up to ~0.3 nat from the proximal one (the update)."""
    b, s = 6, 16
    lengths = rng.integers(0, s + 1, b)
    lengths[rng.integers(b)] = max(lengths.max(), 1)
    mask = np.arange(s)[None, :] < lengths[:, None]
    behaviour = np.log(rng.uniform(1e-4, 1.0, (b, s)))
    proximal = behaviour + rng.choice([0.0, 1e-3, 0.05, 0.3, 1.0]) * rng.standard_normal((b, s))
    current = proximal + rng.choice([0.0, 0.05, 0.3]) * rng.standard_normal((b, s))
    adv = rng.choice([-1.5, -0.3, 0.0, 0.4, 1.2], b)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    return f32(current), f32(proximal), f32(behaviour), f32(adv), mask


@pytest.mark.parametrize("cap", [None, 2.0, 5.0])
@pytest.mark.parametrize("clip_high", [0.2, 0.28])
def test_decoupled_loss_matches_areal(cap, clip_high):
    rng = np.random.default_rng(int(10 * (cap or 0) + 100 * clip_high))
    cfg = GRPOConfig(clip_low=0.2, clip_high=clip_high, loss_agg="token-mean")
    correction = CorrectionConfig(is_level="token", is_threshold="inf" if cap is None else f"0_{cap}")
    capped = 0

    @jax.jit
    def loss_and_grad(lp, prox, adv, weights, accept):
        return jax.value_and_grad(lambda x: policy_loss(x, prox, adv, weights, accept, cfg), has_aux=True)(lp)

    for _ in range(CASES):
        current, proximal, behaviour, adv, mask = _case(rng)
        weights, accept, _ = correct(proximal, behaviour, mask, correction)
        assert (accept == mask).all()  # no rejection rule: the cap acts through the weights, as in AReaL
        (loss, stats), grad = loss_and_grad(*map(jnp.asarray, (current, proximal, adv, weights, accept)))
        rows = lambda x: np.asarray(x, np.float64).tolist()  # noqa: E731
        ref_loss, ref = areal.decoupled_ppo_loss(rows(current), rows(proximal), rows(behaviour), rows(adv),
                                                 mask.tolist(), 0.2, clip_high, cap)
        ref_w = np.asarray(ref["behave_imp_weight"])
        # behaviour weights: ours are float64 weights rounded to float32 once
        np.testing.assert_allclose(weights[mask], ref_w[mask], rtol=EPS32, atol=0)
        assert ((weights > 0) == np.asarray(ref["behave_mask"]))[mask].all()
        capped += int((~np.asarray(ref["behave_mask"]) & mask).sum())
        # the loss: a float32 mean of `count` terms, each a few float32 operations
        count = int(mask.sum())
        assert abs(float(loss) - ref_loss) <= (8 + count) * EPS32 * max(np.abs(ref["terms"]).max(), 1e-30)
        # the gradient with respect to the current logprobs, token by token
        ref_g = np.asarray(ref["grad"])
        np.testing.assert_allclose(np.asarray(grad, np.float64), ref_g, rtol=16 * EPS32,
                                   atol=16 * EPS32 * np.abs(ref_g).max())
        assert float(stats["clip_fraction"]) == pytest.approx(ref["clip_fraction"], abs=1e-6)
    if cap is not None:
        assert capped > 0  # the cap really dropped tokens in these batches


def test_proximal_equal_to_behaviour_is_plain_ppo():
    """Synchronous and aligned (pi_proximal == pi_behaviour bitwise): every behaviour weight is exactly 1 and
    the decoupled loss is the on-policy PPO-clip loss."""
    rng = np.random.default_rng(3)
    current, proximal, _, adv, mask = _case(rng)
    weights, accept, metrics = correct(proximal, proximal, mask, CorrectionConfig())
    assert (weights[mask] == 1.0).all() and metrics["rollout_corr/k3_kl"] == 0.0
    ref_loss, _ = areal.decoupled_ppo_loss(*(np.asarray(x, np.float64).tolist() for x in (current, proximal,
                                                                                         proximal, adv)),
                                           mask.tolist(), 0.2, 0.28, None)
    loss, _ = policy_loss(jnp.asarray(current), jnp.asarray(proximal), jnp.asarray(adv), jnp.asarray(weights),
                          jnp.asarray(accept), GRPOConfig())
    assert abs(float(loss) - ref_loss) <= (8 + mask.sum()) * EPS32 * max(1.0, abs(ref_loss))
