"""Open RL axes: an arm overrides any RLConfig / GRPOConfig / CorrectionConfig field (`;key=value`), refuses the
fields that would make arms incomparable, and Dr.GRPO's parts change the numbers as documented."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxalign.rl.arms import FIXED, option_keys, parse_arm
from jaxalign.rl.experiment import ExperimentConfig, run_config
from jaxalign.rl.grpo import GRPOConfig, advantages_of, group_advantages, policy_loss


def test_overrides_round_trip_and_reach_the_run_config():
    text = ("x=aligned-bf16/serve-bf16;correction=tis:2;learning_rate=2e-3;group_size=4;clip_high=0.2;"
            "is_threshold=3;rs=token_k3:0.1+seq_mean_k1:1.001;normalize_weights=true;lora_targets=q_proj+k_proj")
    arm = parse_arm(text)
    assert parse_arm(arm.spec()) == arm
    cfg = run_config(ExperimentConfig(), arm, seed=0)
    base = run_config(ExperimentConfig(), parse_arm("x=aligned-bf16/serve-bf16;correction=tis:2"), seed=0)
    assert (cfg.learning_rate, cfg.grpo.group_size, cfg.grpo.clip_high) == (2e-3, 4, 0.2)
    assert cfg.correction.is_threshold == "3" and cfg.correction.rs == ("token_k3:0.1", "seq_mean_k1:1.001")
    assert cfg.correction.normalize_weights and cfg.lora_targets == ("q_proj", "k_proj")
    assert base.learning_rate == ExperimentConfig().learning_rate and base.grpo.group_size == 8
    assert (cfg.steps, cfg.seed, cfg.eval_problems) == (base.steps, base.seed, base.eval_problems)
    # every field of the three configs is a key or refused with a reason
    assert set(option_keys()) >= {"learning_rate", "group_size", "advantage", "loss_agg", "rs", "temperature"}


def test_lag_is_an_arm_axis_and_dual_clip_an_arm_option():
    """`;lag=k` (short for max_lag) makes an arm asynchronous; `;clip_ratio_c=3` turns verl's dual-clip on."""
    arm = parse_arm("stale=aligned-bf16/serve-bf16;correction=tis:2;lag=2;clip_ratio_c=3")
    assert arm.spec() == "stale=aligned-bf16/serve-bf16;correction=tis:2;clip_ratio_c=3.0;max_lag=2"
    assert parse_arm(arm.spec()) == arm
    cfg = run_config(ExperimentConfig(), arm, seed=0)
    assert (cfg.max_lag, cfg.grpo.clip_ratio_c) == (2, 3.0)
    assert run_config(ExperimentConfig(), parse_arm("x=aligned-bf16/serve-bf16"), seed=0).max_lag == 0
    with pytest.raises(ValueError, match="max_lag"):
        parse_arm("x=aligned-bf16/serve-bf16;lag=-1")


@pytest.mark.parametrize("text, needle", [
    ("x=fp32/fp32;steps=3", "steps is not an arm option: every arm runs"),
    ("x=fp32/fp32;seed=1", "seed is not an arm option"),
    ("x=fp32/fp32;trainer_policy=fp16", "TRAINER policy"),
    ("x=fp32/fp32;lr=1", r"unknown arm option 'lr'; allowed: correction, replay, .*learning_rate"),
    ("x=fp32/fp32;group_size=x", r"GRPOConfig.group_size = 'x': allowed an integer"),
    ("x=fp32/fp32;group_size=1", "allowed: >= 2"),
    ("x=fp32/fp32;loss_agg=sum", r"loss_agg = 'sum'; allowed: token-mean"),
    ("x=fp32/fp32;normalize_weights=maybe", "allowed true or false"),
    ("x=fp32/fp32;grpo=1", "nested config; set its fields by name"),
    ("x=fp32/fp32;learning_rate=1;learning_rate=2", "given twice"),
    ("x=fp32/fp32;tis", "not KEY=VALUE"),
])
def test_bad_overrides_are_clear_errors(text, needle):
    with pytest.raises(ValueError, match=needle):
        parse_arm(text)
    assert all(FIXED.values())


def _numpy_loss(logp, old, adv, w, mask, agg, max_tokens):
    ratio = np.exp(np.clip(logp - old, -20, 20))
    per = -np.minimum(ratio * adv[:, None], np.clip(ratio, 0.8, 1.28) * adv[:, None]) * w
    per = np.where(mask, per, 0.0)
    if agg == "token-mean":
        return per.sum() / max(mask.sum(), 1)
    return per.sum(1).mean() / max_tokens


def test_dr_grpo_changes_the_numbers_as_documented():
    rng = np.random.default_rng(0)
    b, s, g, budget = 8, 6, 4, 5
    for case in range(150):
        rewards = rng.choice([0.0, 0.1, 1.0], b) if case % 3 else np.full(b, 0.5)  # all-equal rewards too
        mask = rng.random((b, s)) < 0.6
        if case % 5 == 0:
            mask[:] = False  # masks all zero
        if case % 7 == 0:
            mask = np.eye(b, s, dtype=bool)  # one-token sequences
        logp, old = rng.normal(-1, 0.3, (b, s)), rng.normal(-1, 0.3, (b, s))
        w = rng.uniform(0.5, 2, (b, s))
        grpo, dr = GRPOConfig(group_size=g), GRPOConfig(group_size=g, advantage="group-mean",
                                                          loss_agg="seq-mean-token-sum-maxlen")
        centred = (rewards.reshape(-1, g) - rewards.reshape(-1, g).mean(1, keepdims=True)).reshape(-1)
        np.testing.assert_allclose(advantages_of(rewards, dr), centred, atol=1e-6)
        np.testing.assert_array_equal(advantages_of(rewards, grpo), group_advantages(rewards, g))
        for cfg, agg in ((grpo, "token-mean"), (dr, "dr")):
            adv = advantages_of(rewards, cfg)
            loss, _ = policy_loss(*(jnp.asarray(x, jnp.float32) for x in (logp, old, adv, w)), jnp.asarray(mask),
                                  cfg, max_tokens=budget)
            ref = _numpy_loss(logp, old, adv.astype(np.float64), w, mask, agg, budget)
            np.testing.assert_allclose(float(loss), ref, rtol=2e-5, atol=1e-6)
            if not mask.any() or np.all(rewards == rewards[0]):
                assert float(loss) == 0.0
