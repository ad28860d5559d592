"""GRPO: group-normalised advantages and the PPO-clip policy loss (with IS weights and a rejection mask from
`correction`).

Mirrors verl's `compute_policy_loss_vanilla` (`verl/trainer/ppo/core_algos.py`, checked in
tests/test_correction_parity.py): advantages divide by the unbiased std of the group (`torch.std`), and
`clip_fraction` is verl's `pg_clipfrac`, the fraction of valid tokens where clipping is active (the clipped term is
the one `min` keeps). The population std (`std="population"`, 1.15x larger advantages at G=4) and the fraction of
ratios outside the band whichever term wins (`GRPOConfig(clip_fraction="outside")`) are options.

Deliberate differences from verl's defaults (pinned by tests/test_correction_parity.py):
- `clip_high` = 0.28, DAPO's clip-higher (verl: `clip_ratio_high` = `clip_ratio` = 0.2). `clip_low` is verl's 0.2.
- Dual-clip is off (`clip_ratio_c=None`; verl applies it always, `clip_ratio_c` = 3.0): with
  `GRPOConfig(clip_ratio_c=3.0)` a negative-advantage token's loss is capped at -A * 3.0 as in verl, and
  `clip_fraction_lower` (verl's `pg_clipfrac_lower`) is reported. `GRPOConfig(clip_high=0.2, clip_ratio_c=3.0)` is
  verl's vanilla loss.

The advantage estimator and the loss aggregation are named parts (`jaxalign.rl.registry`): GRPO's own
(`group-std`; `token-mean`, `seq-mean-token-mean`) are registered here, variants in `jaxalign/rl/variants/`
(Dr.GRPO: `group-mean`, `seq-mean-token-sum-maxlen`). `GRPOConfig.parse_option` reads one field as text, as an
arm's `;key=value` gives it.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxalign.numerics.policy import NumericPolicy
from jaxalign.numerics.reduce import mean, reduce_sum, total, uncontracted
from jaxalign.rl import options
from jaxalign.rl.registry import ADVANTAGES, LOSS_AGGREGATIONS, register_advantage, register_loss_agg

CLIP_FRACTIONS = ("active", "outside")
ADVANTAGE_STDS = ("unbiased", "population")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """Group size, PPO clip range (separate low/high epsilon), advantage estimator and loss aggregation (names
    in `jaxalign.rl.registry`) and optional KL to a reference."""

    group_size: int = 4
    clip_low: float = 0.2
    clip_high: float = 0.28
    loss_agg: str = "token-mean"
    kl_coef: float = 0.0
    clip_fraction: str = "active"
    advantage: str = "group-std"
    clip_ratio_c: float | None = None  # dual-clip's cap on negative advantages (verl's clip_ratio_c); None = off

    def __post_init__(self):
        if self.group_size < 2:
            raise ValueError(f"group_size = {self.group_size}; allowed: >= 2 (advantages are relative to a group)")
        if not (0 < self.clip_low < 1 and self.clip_high > 0):
            raise ValueError(f"clip_low = {self.clip_low}, clip_high = {self.clip_high}; allowed: 0 < low < 1, high > 0")
        if self.loss_agg not in LOSS_AGGREGATIONS:
            raise ValueError(f"loss_agg = {self.loss_agg!r}; allowed: {', '.join(LOSS_AGGREGATIONS)}")
        if self.advantage not in ADVANTAGES:
            raise ValueError(f"advantage = {self.advantage!r}; allowed: {', '.join(ADVANTAGES)}")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1.0:
            raise ValueError(f"clip_ratio_c = {self.clip_ratio_c}; allowed: > 1.0 (verl's dual-clip bound, e.g. 3.0) "
                             f"or None (off)")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef = {self.kl_coef}; allowed: >= 0")
        if self.clip_fraction not in CLIP_FRACTIONS:
            raise ValueError(f"clip_fraction = {self.clip_fraction!r}; allowed: {', '.join(CLIP_FRACTIONS)}")

    @classmethod
    def parse_option(cls, key: str, text: str):
        """The typed value of field `key` written as `text` (`jaxalign.rl.options`), e.g. ("group_size", "4")
        -> 4; a clear error naming the key, the value and what is allowed."""
        return options.parse_option(cls, key, text)


def group_advantages(rewards, group_size: int, eps: float = 1e-6, *, std: str = "unbiased") -> np.ndarray:
    """(r - mean(group)) / (std(group) + eps) for rewards laid out group after group; `std` "unbiased" (verl's
    torch.std, n - 1) or "population" (n). A group of one gets mean 0 and std 1, as in verl."""
    if std not in ADVANTAGE_STDS:
        raise ValueError(f"std = {std!r}; allowed: {', '.join(ADVANTAGE_STDS)}")
    r = np.asarray(rewards, np.float64)
    if group_size < 1 or r.size % group_size:
        raise ValueError(f"{r.size} rewards do not split into groups of {group_size}")
    g = r.reshape(-1, group_size)
    if group_size == 1:
        mean, spread = np.zeros_like(g), np.ones_like(g)
    else:
        mean, spread = g.mean(1, keepdims=True), g.std(1, keepdims=True, ddof=1 if std == "unbiased" else 0)
    return ((g - mean) / (spread + eps)).reshape(-1).astype(np.float32)


register_advantage("group-std")(group_advantages)


def advantages_of(rewards, cfg: GRPOConfig) -> np.ndarray:
    """The advantages of `rewards` (laid out group after group) by `cfg.advantage`'s estimator."""
    r = np.asarray(rewards, np.float64)
    if r.size % cfg.group_size:
        raise ValueError(f"{r.size} rewards do not split into groups of {cfg.group_size}")
    return ADVANTAGES[cfg.advantage](r, cfg.group_size)


@register_loss_agg("token-mean")
def token_mean(per_token, mask, policy: NumericPolicy, max_tokens: int):
    """The mean over every accepted token of the batch (verl's token-mean)."""
    del max_tokens
    return mean(per_token, policy, mask)


@register_loss_agg("seq-mean-token-mean")
def seq_mean_token_mean(per_token, mask, policy: NumericPolicy, max_tokens: int):
    """The mean over rows with an accepted token of each row's mean over its accepted tokens."""
    del max_tokens
    tokens = reduce_sum(jnp.asarray(mask, per_token.dtype), policy, axis=1)
    kept = uncontracted(jnp.where(mask, per_token, 0.0), policy)
    per_seq = reduce_sum(kept, policy, axis=1) / jnp.maximum(tokens, 1.0)
    return mean(per_seq, policy, tokens > 0)


def policy_loss(logp, logp_old, advantages, weights, mask, cfg: GRPOConfig, logp_ref=None,
                policy: NumericPolicy | None = None, max_tokens: int | None = None):
    """PPO-clip loss and diagnostics. All per-token [B, S] except advantages [B]; `mask` = accepted tokens,
    `weights` = IS weights (constants). Returns (loss, {"clip_fraction", "ratio_mean", "kl_ref"}); clip_fraction
    per `cfg.clip_fraction` (module docstring). The per-token terms are aggregated by `cfg.loss_agg`;
    `max_tokens` is the constant some aggregations divide by (the generation budget; default: S).

    Every sum runs as `policy.reduction` says (`numerics.reduce.total`; XLA's reduce without a policy), so
    under `reduction=tree` the loss and its diagnostics have one set of bits in every program and on every
    mesh."""
    policy = policy or NumericPolicy()
    mask = mask != 0
    # The loss's first ops subtract its inputs: an input made by a product in the same program (XLA turns
    # `x / c` into `x * (1/c)`) would be contracted with that subtraction into an FMA, so the loss's bits would
    # depend on how its inputs were computed, not only on their values.
    logp, logp_old = uncontracted(logp, policy), uncontracted(logp_old, policy)
    if logp_ref is not None:
        logp_ref = uncontracted(logp_ref, policy)

    ratio = jnp.exp(jnp.clip(logp - logp_old, -20.0, 20.0))
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * adv
    per_token = -jnp.minimum(unclipped, clipped)
    if cfg.clip_ratio_c is not None:  # dual-clip: a negative advantage's loss is capped at -A * c (verl)
        capped = -adv * cfg.clip_ratio_c
        lower = (per_token > capped) & (adv < 0)
        per_token = jnp.where(adv < 0, jnp.minimum(per_token, capped), per_token)
    per_token = per_token * weights
    kl_ref = jnp.zeros_like(per_token)
    if logp_ref is not None and cfg.kl_coef > 0:
        m = jnp.clip(logp_ref - logp, -20.0, 20.0)
        kl_ref = uncontracted(jnp.exp(m), policy) - 1.0 - m  # exp's last multiply must not meet the - 1 in an FMA
        per_token = uncontracted(per_token, policy) + uncontracted(cfg.kl_coef * kl_ref, policy)
    loss = LOSS_AGGREGATIONS[cfg.loss_agg](per_token, mask, policy, mask.shape[1] if max_tokens is None
                                           else max_tokens)
    n = jnp.maximum(total(jnp.asarray(mask, jnp.float32), policy), 1.0)
    # verl's pg_clipfrac compares the losses: -A*clip(ratio) > -A*ratio, i.e. min() takes the clipped term
    active = (-clipped > -unclipped) if cfg.clip_fraction == "active" else (unclipped != clipped)
    stats = {"clip_fraction": total(active.astype(jnp.float32), policy, mask) / n,
             "ratio_mean": total(ratio, policy, mask) / n, "kl_ref": total(kl_ref, policy, mask) / n}
    if cfg.clip_ratio_c is not None:
        stats["clip_fraction_lower"] = total(lower.astype(jnp.float32), policy, mask) / n

    return loss, stats


from jaxalign.rl import variants  # noqa: E402,F401  (registers the variants' parts, after GRPO's own)
