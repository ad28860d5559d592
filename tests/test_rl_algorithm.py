"""GRPO advantages and loss, and verl-style rollout correction, on hand-made inputs."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxalign.rl.correction import CorrectionConfig, correct
from jaxalign.rl.grpo import GRPOConfig, group_advantages, policy_loss


def test_group_advantages():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0, 0.1, 0.1, 0.1, 0.1], 4)  # verl: unbiased std, sqrt(1/3)
    np.testing.assert_allclose(adv[:4], np.array([1, -1, -1, 1]) * np.sqrt(3) / 2, atol=1e-5)
    np.testing.assert_allclose(adv[4:], 0.0, atol=1e-5)
    population = group_advantages([1.0, 0.0, 0.0, 1.0, 0.1, 0.1, 0.1, 0.1], 4, std="population")
    np.testing.assert_allclose(population[:4], [1, -1, -1, 1], atol=1e-5)
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages([1.0, 2.0, 3.0], 4)


def test_ppo_clip_with_separate_epsilons_and_aggregations():
    logp_old = jnp.zeros((2, 3))
    logp = jnp.log(jnp.array([[1.5, 0.5, 1.0], [1.1, 1.0, 1.0]]))
    adv = jnp.array([1.0, -1.0])
    mask = jnp.array([[1, 1, 0], [1, 1, 1]], bool)
    cfg = GRPOConfig(clip_low=0.2, clip_high=0.28)
    loss, stats = policy_loss(logp, logp_old, adv, jnp.ones((2, 3)), mask, cfg)
    # row 0 (A=+1): min(1.5, 1.28) = 1.28, min(0.5, 0.8) = 0.5; row 1 (A=-1): -max(1.1,...)... per token:
    per_token = np.array([[-1.28, -0.5, 0.0], [1.1, 1.0, 1.0]])
    assert float(loss) == pytest.approx(per_token[np.asarray(mask)].mean(), rel=1e-5)
    assert float(stats["clip_fraction"]) == pytest.approx(1 / 5)  # clipping active only for the 1.5 (A > 0)
    _, outside = policy_loss(logp, logp_old, adv, jnp.ones((2, 3)), mask,
                             GRPOConfig(clip_low=0.2, clip_high=0.28, clip_fraction="outside"))
    assert float(outside["clip_fraction"]) == pytest.approx(2 / 5)  # 1.5 and 0.5 lie outside [0.8, 1.28]
    seq_loss, _ = policy_loss(logp, logp_old, adv, jnp.ones((2, 3)), mask,
                              GRPOConfig(loss_agg="seq-mean-token-mean"))
    assert float(seq_loss) == pytest.approx(np.mean([(-1.28 - 0.5) / 2, (1.1 + 1.0 + 1.0) / 3]), rel=1e-5)
    with pytest.raises(ValueError, match="loss_agg"):
        GRPOConfig(loss_agg="sum")


def test_token_tis_and_icepop():
    lo = np.log(np.array([[3.0, 1.0, 0.4, 1.0]]))
    lr = np.zeros((1, 4))
    mask = np.array([[True, True, True, False]])
    w, accept, m = correct(lo, lr, mask, CorrectionConfig(is_level="token", is_threshold="2.0"))
    np.testing.assert_allclose(w[0, :3], [2.0, 1.0, 0.4], rtol=1e-6)
    assert accept[0, :3].all() and not accept[0, 3]
    w, _, _ = correct(lo, lr, mask, CorrectionConfig(is_level="token", is_threshold="0.5_5"))
    np.testing.assert_allclose(w[0, :3], [3.0, 1.0, 0.0], rtol=1e-6)  # IcePop zeroes the 0.4 weight
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(3.0)
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(0.4)


def test_sequence_is_and_rejection_rules():
    lo = np.array([[0.1, 0.1], [0.0, 0.0], [2.0, 0.0]])
    lr = np.zeros((3, 2))
    mask = np.ones((3, 2), bool)
    w, accept, m = correct(lo, lr, mask, CorrectionConfig(is_level="sequence", is_threshold="10"))
    np.testing.assert_allclose(w[0], np.exp(0.2), rtol=1e-6)
    np.testing.assert_allclose(w[2], np.exp(2.0), rtol=1e-6)
    # geometric RS rejects rows 0 and 2 (mean log ratio 0.1 and 1.0), keeps row 1
    _, accept, m = correct(lo, lr, mask, CorrectionConfig(rs=("seq_mean_k1:0.999_1.001",)))
    assert accept.tolist() == [[False, False], [True, True], [False, False]]
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(2 / 3)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(4 / 6)
    # token_k1 band with a single u, AND-ed with seq_max_k3
    _, accept, _ = correct(lo, lr, mask, CorrectionConfig(rs=("token_k1:1.2", "seq_max_k3:1.0")))
    assert accept.tolist() == [[True, True], [True, True], [False, False]]
    _, accept, _ = correct(lo, lr, mask, CorrectionConfig(rs=("token_k3:0.01",)))
    assert accept.tolist() == [[True, True], [True, True], [False, True]]


def test_identical_logprobs_reject_nothing_and_weigh_one():
    lp = np.log(np.random.default_rng(0).uniform(0.1, 1, (4, 6)))
    mask = np.ones((4, 6), bool)
    w, accept, m = correct(lp, lp, mask, CorrectionConfig(rs=("seq_mean_k1:0.999_1.001", "token_k2:0.0")))
    assert accept.all() and np.all(w == 1.0)
    assert m["rollout_corr/kl"] == 0.0 and m["rollout_corr/k3_kl"] == 0.0
    assert m["rollout_corr/rollout_rs_masked_fraction"] == 0.0


@pytest.mark.parametrize("kw, needle", [
    (dict(is_level="batch"), "is_level"),
    (dict(is_threshold="abc"), "is_threshold"),
    (dict(rs=("token_k4:1",)), "rejection rule"),
    (dict(rs=("token_k1:0.5",)), "u > 1"),
    (dict(rs=("seq_mean_k2:big",)), "upper bound"),
])
def test_bad_correction_settings(kw, needle):
    with pytest.raises(ValueError, match=needle):
        CorrectionConfig(**kw)


def test_log_ratios_clamped_before_exp():
    w, _, _ = correct(np.array([[100.0]]), np.array([[0.0]]), np.array([[True]]),
                      CorrectionConfig(is_threshold="1e30"))
    assert w[0, 0] == pytest.approx(np.exp(20.0), rel=1e-5)


@pytest.mark.bitwise
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_policy_loss_sums_in_the_policys_order(loss_agg):
    """Under `reduction=tree` the loss and its diagnostics are tree sums (numerics.reduce.total): the same values
    as XLA's sums to float32 rounding, and the same bits whether the loss is its own program or fused with the
    computation of its inputs (XLA's reduce, and an FMA-contracted product before it, vary with the fusion)."""
    import jax

    from jaxalign.numerics import NumericPolicy

    rng = np.random.default_rng(1)
    logp, logp_old, logp_ref = (jnp.asarray(rng.normal(-2, 0.3, (6, 37)), jnp.float32) for _ in range(3))
    adv = jnp.asarray(rng.normal(size=6), jnp.float32)
    weights = jnp.asarray(rng.uniform(0.5, 1.5, (6, 37)), jnp.float32)
    mask = jnp.asarray(rng.uniform(size=(6, 37)) < 0.8).at[2].set(False)
    cfg = GRPOConfig(loss_agg=loss_agg, kl_coef=0.1)
    tree, xla = NumericPolicy.preset("aligned-bf16"), NumericPolicy.preset("fp32")
    assert (tree.reduction, xla.reduction) == ("tree", "xla")
    ours = policy_loss(logp, logp_old, adv, weights, mask, cfg, logp_ref, policy=tree)
    theirs = policy_loss(logp, logp_old, adv, weights, mask, cfg, logp_ref, policy=xla)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):  # sums of O(1) terms that cancel
        assert float(a) == pytest.approx(float(b), rel=1e-6, abs=1e-6)
    # inputs made in the same program as the loss, or in a program of their own. XLA turns `lp / scale` into
    # `lp * (1/scale)`, which LLVM would contract with the loss's `logp - logp_old` and `logp_ref - logp` into
    # FMAs on CPUs that have them, unless the loss keeps its inputs uncontracted (it does, under reduction=tree)
    scale = jnp.float32(1.5)
    fused = jax.jit(lambda lp, w: policy_loss(lp / scale, logp_old, adv, w / scale, mask, cfg, logp_ref,
                                              policy=tree))(logp, weights)
    apart = jax.jit(lambda lp, w: policy_loss(lp, logp_old, adv, w, mask, cfg, logp_ref, policy=tree))(
        *jax.jit(lambda lp, w: (lp / scale, w / scale))(logp, weights))
    for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(apart)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_random_drop_control_drops_that_fraction_of_rows_whatever_the_gap():
    """`correction=drop:F` (the study's control): round(F * B) whole sequences rejected, no IS weights, the
    choice fixed by the batch (same batch, same rows) and unrelated to which rows have the largest gap."""
    from jaxalign.rl.correction import CorrectionConfig, correct, correction_settings

    rng = np.random.default_rng(0)
    mode, cfg = correction_settings("drop:0.45", CorrectionConfig())
    assert cfg.random_drop == 0.45 and cfg.is_level == "none" and cfg.rs == ()
    dropped_big_gap = []
    for trial in range(40):
        lo = rng.normal(-1.0, 0.3, (32, 10))
        lr = lo + rng.normal(0, 0.05, (32, 10)) * (np.arange(32) >= 16)[:, None]  # rows 16.. carry the gap
        mask = np.ones((32, 10), bool)
        weights, accept, metrics = correct(lo, lr, mask, cfg)
        assert np.all(weights == 1.0)
        rows_kept = accept.all(1)
        assert np.array_equal(accept, rows_kept[:, None] & mask) and (~rows_kept).sum() == 14  # round(0.45 * 32)
        assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == 14 / 32
        assert np.array_equal(correct(lo, lr, mask, cfg)[1], accept)
        dropped_big_gap.append((~rows_kept[16:]).sum() / 14)
    assert 0.35 < np.mean(dropped_big_gap) < 0.65  # not the rows with the gap, as rejection sampling would pick
    for bad in ("drop:0", "drop:1", "drop:x", "drop:0.5+tis"):
        with pytest.raises(ValueError, match="drop"):
            correction_settings(bad, CorrectionConfig())
