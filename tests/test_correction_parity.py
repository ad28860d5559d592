"""Rollout correction and GRPO against verl (re-implemented row by row in tests/verl_reference.py) on generated
batches, and each semantic point where this project used to differ, pinned."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
import verl_reference as verl

from jaxalign.metrics.mismatch import verl_offpolicy_metrics
from jaxalign.rl.correction import CorrectionConfig, correct
from jaxalign.rl.grpo import GRPOConfig, group_advantages, policy_loss

CASES = 300
OFFPOLICY = ("kl", "k3_kl", "chi2_token", "chi2_seq", "training_ppl", "rollout_ppl", "log_ppl_diff",
             "log_ppl_abs_diff", "ppl_ratio")  # the nine; the other four of verl's are checked too


def _batch(rng: np.random.Generator, padding: str = "finite"):
    """logp_old, logp_rollout, mask [B, S]: ragged rows (some empty), gaps from 0 to beyond the +-20 clamp."""
    b, s = rng.integers(1, 7), rng.integers(1, 21)
    lengths = rng.integers(0, s + 1, b)
    lengths[rng.integers(b)] = max(lengths.max(), 1)
    mask = np.arange(s)[None, :] < lengths[:, None]
    old = np.log(rng.uniform(1e-6, 1.0, (b, s)))
    scale = rng.choice([0.0, 1e-7, 1e-3, 0.05, 0.5, 3.0, 30.0])
    roll = old + scale * rng.standard_normal((b, s))
    fill = {"finite": rng.normal(0, 50, (b, s)), "nan": np.full((b, s), np.nan)}[padding]
    return np.where(mask, old, fill), np.where(mask, roll, fill), mask


def _rows(old, roll, mask):
    return [list(zip(o.tolist(), r.tolist(), m.tolist())) for o, r, m in zip(old, roll, mask)]


def _close(ours: dict, ref: dict, prefix: str = "") -> list[str]:
    """Keys that differ beyond 1e-9 (relative, or absolute below 1); a spread of near-equal values is a
    difference of large numbers, so its tolerance scales with them (the largest per-sequence weight)."""
    scale = {"rollout_is_seq_std": max(1.0, abs(ref.get("rollout_is_seq_max", 1.0)))}
    return [k for k, v in ref.items()
            if not math.isclose(ours[prefix + k], v, rel_tol=1e-9, abs_tol=1e-9 * scale.get(k, 1.0))]


def test_offpolicy_metrics_match_verl():
    rng = np.random.default_rng(0)
    worst = {k: 0.0 for k in OFFPOLICY}
    for _ in range(CASES):
        old, roll, mask = _batch(rng, padding=rng.choice(["finite", "nan"]))
        ref = verl.offpolicy_metrics(_rows(old, roll, mask))
        ours = verl_offpolicy_metrics(old, roll, mask)
        assert set(ours) == set(ref) and len(ref) == 13
        assert not _close(ours, ref), _close(ours, ref)
        for k in OFFPOLICY:
            worst[k] = max(worst[k], abs(ours[k] - ref[k]) / max(1.0, abs(ref[k])))
        _, _, corr = correct(old, roll, mask, CorrectionConfig())
        assert not _close(corr, ref, prefix="rollout_corr/")
    print("\nmax relative deviation from verl over", CASES, "batches:",
          ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("normalize", [False, True])
def test_is_weights_and_metrics_match_verl(level, normalize):
    rng = np.random.default_rng(1 + normalize + 2 * (level == "token"))
    for _ in range(CASES // 2):
        old, roll, mask = _batch(rng, padding=rng.choice(["finite", "nan"]))
        threshold = float(rng.choice([1.001, 1.5, 2.0, 10.0]))
        cfg = CorrectionConfig(is_level=level, is_threshold=repr(threshold), normalize_weights=normalize)
        weights, _, ours = correct(old, roll, mask, cfg)
        ref_weights, ref = verl.is_weights(_rows(old, roll, mask), level, threshold, normalize)
        np.testing.assert_array_equal(weights[mask], np.asarray(ref_weights, np.float32)[mask])
        assert np.all(weights[~mask] == 0.0)
        assert not _close(ours, ref, prefix="rollout_corr/"), _close(ours, ref, prefix="rollout_corr/")


RULES = [("token_k1", "1.2"), ("token_k1", "0.9_1.5"), ("token_k2", "0.01"), ("token_k3", "0.005"),
         ("seq_sum_k1", "0.5_3"), ("seq_sum_k2", "0.1"), ("seq_sum_k3", "0.1"), ("seq_mean_k1", "0.999_1.001"),
         ("seq_mean_k2", "0.001"), ("seq_mean_k3", "0.001"), ("seq_max_k2", "0.02"), ("seq_max_k3", "0.02")]


def test_rejection_masks_and_metrics_match_verl():
    rng = np.random.default_rng(5)
    rejected = 0
    for case in range(CASES):
        old, roll, mask = _batch(rng, padding=rng.choice(["finite", "nan"]))
        picked = [RULES[i] for i in rng.choice(len(RULES), rng.integers(1, 4), replace=False)]
        if case < len(RULES):
            picked = [RULES[case]]  # every rule alone at least once
        _, accept, ours = correct(old, roll, mask, CorrectionConfig(rs=tuple(f"{m}:{t}" for m, t in picked)))
        ref_accept, ref = verl.rejection_mask(_rows(old, roll, mask), picked)
        np.testing.assert_array_equal(accept, np.array(ref_accept, bool).reshape(mask.shape))
        assert not _close(ours, ref, prefix="rollout_corr/"), _close(ours, ref, prefix="rollout_corr/")
        rejected += int((mask & ~accept).sum())
    assert rejected > 0


def test_k1_bands_bound_rollout_over_old_as_verl():
    """pi_old / pi_rollout = 1.4 (pi_rollout / pi_old = 0.71): the band [0.8, 2] rejects it, as in verl (the
    project used to bound pi_old / pi_rollout and kept it); a symmetric band is the same either way."""
    old, roll, mask = np.log([[0.7]]), np.log([[0.5]]), np.array([[True]])
    _, accept, _ = correct(old, roll, mask, CorrectionConfig(rs=("token_k1:0.8_2.0",)))
    assert not accept[0, 0]
    _, accept, _ = correct(roll, old, mask, CorrectionConfig(rs=("token_k1:0.8_2.0",)))
    assert accept[0, 0]  # ratio 0.71 the other way round: pi_rollout / pi_old = 1.4, inside
    for rule in ("token_k1:1.5", "seq_mean_k1:1.5"):
        assert correct(old, roll, mask, CorrectionConfig(rs=(rule,)))[1][0, 0]
        assert correct(roll, old, mask, CorrectionConfig(rs=(rule,)))[1][0, 0]


def test_sequence_is_clamps_the_sum_not_each_token():
    old, roll, mask = np.array([[25.0, -10.0]]), np.zeros((1, 2)), np.ones((1, 2), bool)
    weights, _, m = correct(old, roll, mask, CorrectionConfig(is_level="sequence", is_threshold="1e30"))
    np.testing.assert_allclose(weights, np.float32(np.exp(15.0)))  # clamping tokens first would give exp(10)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(np.exp(15.0))


def test_is_metric_names_mean_what_verl_means():
    """rollout_is_mean/min/max: the weights before truncation; std and ESS: the weights clamped into [1/C, C]."""
    old, roll, mask = np.log([[3.0, 1.0, 0.25]]), np.zeros((1, 3)), np.ones((1, 3), bool)
    weights, _, m = correct(old, roll, mask, CorrectionConfig(is_threshold="2.0"))
    np.testing.assert_allclose(weights[0], [2.0, 1.0, 0.25], rtol=1e-6)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(4.25 / 3, rel=1e-7)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(3.0) and m["rollout_corr/rollout_is_min"] == 0.25
    clamped = np.array([2.0, 1.0, 0.5])
    assert m["rollout_corr/rollout_is_std"] == pytest.approx(clamped.std(), rel=1e-6)
    ess = 1.0 / np.mean((clamped / clamped.mean()) ** 2)
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(ess, rel=1e-6)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)


def test_batch_normalisation_is_over_valid_tokens_before_rejection():
    old, roll, mask = np.log([[1.5, 1.0, 0.2]]), np.zeros((1, 3)), np.ones((1, 3), bool)
    weights, accept, m = correct(old, roll, mask, CorrectionConfig(is_threshold="2.0", normalize_weights=True,
                                                                   rs=("token_k3:0.1",)))
    assert accept.tolist() == [[True, True, False]]  # k3: 0.095, 0, 0.81
    assert m["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(0.9, rel=1e-7)  # not 1.25 (accepted)
    np.testing.assert_allclose(weights[0], np.array([1.5, 1.0, 0.2]) / 0.9, rtol=1e-6)


def test_seq_masked_fraction_counts_token_rules():
    old = np.array([[0.0, 0.0], [0.5, 0.0], [0.0, 0.0]])
    roll, mask = np.zeros((3, 2)), np.array([[True, True], [True, True], [False, False]])
    _, accept, m = correct(old, roll, mask, CorrectionConfig(rs=("token_k2:0.01",)))
    assert accept.tolist() == [[True, True], [False, True], [False, False]]
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 3)  # over all rows, as verl
    assert m["rollout_corr/rollout_rs_token_k2_seq_masked_fraction"] == pytest.approx(1 / 2)  # valid rows
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 4, rel=1e-7)


def test_nan_padding_never_reaches_valid_tokens():
    rng = np.random.default_rng(3)
    old, roll, mask = _batch(rng)
    nan_old, nan_roll = np.where(mask, old, np.nan), np.where(mask, roll, np.nan)
    for level in ("token", "sequence"):
        cfg = CorrectionConfig(is_level=level, normalize_weights=True, rs=("seq_mean_k3:0.5", "token_k1:3"))
        clean = correct(old, roll, mask, cfg)
        dirty = correct(nan_old, nan_roll, mask, cfg)
        np.testing.assert_array_equal(clean[0], dirty[0])  # padding weights exactly 0 in both
        np.testing.assert_array_equal(clean[1], dirty[1])
        assert {k: v for k, v in clean[2].items() if k != "rollout_corr/bitwise_equal_fraction"} == {
            k: v for k, v in dirty[2].items() if k != "rollout_corr/bitwise_equal_fraction"}


def test_grpo_advantages_match_verl_and_population_std_is_an_option():
    rng = np.random.default_rng(4)
    for g in (1, 2, 4, 8):
        rewards = rng.choice([0.0, 0.1, 1.0], 6 * g).tolist()
        np.testing.assert_allclose(group_advantages(rewards, g), verl.grpo_advantages(rewards, g), rtol=1e-6,
                                   atol=1e-6)
    ours = group_advantages([1.0, 0.0, 0.0, 0.0], 4)
    population = group_advantages([1.0, 0.0, 0.0, 0.0], 4, std="population")
    assert ours[0] == pytest.approx(0.75 / np.sqrt(0.25), rel=1e-5)  # unbiased std 0.5
    assert population[0] / ours[0] == pytest.approx(np.sqrt(4 / 3), rel=1e-5)  # 1.15x at G=4
    with pytest.raises(ValueError, match="std"):
        group_advantages([1.0, 0.0], 2, std="sample")


@pytest.mark.parametrize("case", range(6))
def test_dual_clip_is_verl_vanilla_loss(case):
    """GRPOConfig(clip_high=0.2, clip_ratio_c=3.0) is verl's vanilla policy loss (token-mean) with its
    pg_clipfrac and pg_clipfrac_lower, on generated batches including hostile ones: ratios far outside the band
    (up to e^8), advantages of both signs and zero, rows with no valid token, and IS weights of 1."""
    rng = np.random.default_rng(100 + case)
    b, s = 5, 9
    logp_old = np.log(rng.uniform(0.01, 1, (b, s)))
    spread = [0.05, 0.5, 2.0, 4.0, 8.0, 1.0][case]
    logp = logp_old + rng.normal(0, spread, (b, s))
    adv = rng.choice([-2.0, -0.7, 0.0, 0.4, 1.5], b)
    mask = rng.uniform(size=(b, s)) < 0.7
    mask[case % b] = False  # a row with nothing valid
    lp, lpo = jnp.asarray(logp, jnp.float32), jnp.asarray(logp_old, jnp.float32)
    loss, stats = policy_loss(lp, lpo, jnp.asarray(adv, jnp.float32), jnp.ones((b, s)), jnp.asarray(mask),
                              GRPOConfig(clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0))
    ratio = np.exp(np.clip(np.asarray(lp - lpo, np.float64), -20, 20))
    advs = np.broadcast_to(adv[:, None], ratio.shape)
    want, frac, lower = verl.vanilla_policy_loss(ratio.ravel().tolist(), advs.ravel().tolist(), mask.ravel().tolist(),
                                                 0.2, 0.2, 3.0)
    assert float(loss) == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert float(stats["clip_fraction"]) == pytest.approx(frac, abs=1e-6)
    assert float(stats["clip_fraction_lower"]) == pytest.approx(lower, abs=1e-6)


def test_dual_clip_changes_the_loss_only_where_a_negative_advantage_meets_a_large_ratio():
    """The option is real (the loss moves when ratio > c with A < 0) and off by default, a deliberate difference
    from verl listed in grpo's docstring, as is clip_high 0.28 (DAPO's clip-higher; verl 0.2)."""
    default = GRPOConfig()
    assert default.clip_ratio_c is None and default.clip_high == 0.28 and default.clip_low == 0.2
    logp_old = jnp.zeros((2, 3), jnp.float32)
    logp = jnp.asarray([[2.0, 0.1, -0.1], [2.0, 0.1, -0.1]], jnp.float32)  # ratio e^2 = 7.4 > 3 in column 0
    mask, w = jnp.ones((2, 3), bool), jnp.ones((2, 3))
    for adv, moves in (([-1.0, -1.0], True), ([1.0, 1.0], False)):
        off, s_off = policy_loss(logp, logp_old, jnp.asarray(adv), w, mask, GRPOConfig())
        on, s_on = policy_loss(logp, logp_old, jnp.asarray(adv), w, mask, GRPOConfig(clip_ratio_c=3.0))
        assert (float(on) != float(off)) == moves
        assert "clip_fraction_lower" not in s_off and float(s_on["clip_fraction_lower"]) == pytest.approx(2 / 6 if moves else 0, abs=1e-7)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        GRPOConfig(clip_ratio_c=1.0)


def test_clip_fraction_is_verl_pg_clipfrac_by_default():
    rng = np.random.default_rng(6)
    logp_old = jnp.asarray(np.log(rng.uniform(0.1, 1, (6, 10))), jnp.float32)
    logp = logp_old + jnp.asarray(rng.normal(0, 0.3, (6, 10)), jnp.float32)
    adv = jnp.asarray(rng.choice([-1.0, -0.3, 0.5, 1.2], 6), jnp.float32)
    mask = jnp.asarray(rng.uniform(size=(6, 10)) < 0.8)
    cfg = GRPOConfig(clip_low=0.2, clip_high=0.28)
    _, stats = policy_loss(logp, logp_old, adv, jnp.ones((6, 10)), mask, cfg)
    ratio = np.exp(np.asarray(logp - logp_old, np.float64))
    advs = np.broadcast_to(np.asarray(adv)[:, None], ratio.shape)
    expected = verl.pg_clipfrac(ratio.ravel().tolist(), advs.ravel().tolist(), np.asarray(mask).ravel().tolist(),
                                0.2, 0.28)
    assert float(stats["clip_fraction"]) == pytest.approx(expected, abs=1e-6)
    _, outside = policy_loss(logp, logp_old, adv, jnp.ones((6, 10)), mask,
                             GRPOConfig(clip_low=0.2, clip_high=0.28, clip_fraction="outside"))
    band = (ratio < 0.8) | (ratio > 1.28)
    assert float(outside["clip_fraction"]) == pytest.approx(band[np.asarray(mask)].mean(), abs=1e-6)
    assert float(outside["clip_fraction"]) > float(stats["clip_fraction"]) > 0  # min() keeps some unclipped
    with pytest.raises(ValueError, match="clip_fraction"):
        GRPOConfig(clip_fraction="all")
