"""Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"): GRPO without its
two normalisations that bias the objective.

- Advantage `group-mean`: r - mean(group), no division by the group's std (GRPO's std up-weights questions whose
  rewards barely vary: too easy or too hard). A group of one gets r, as GRPO's gets (r - 0) / 1.
- Loss aggregation `seq-mean-token-sum-maxlen`: each sequence's per-token terms summed (no 1/|o_i|, which
  favours long wrong answers and short right ones), divided by a constant, the generation budget
  (`max_tokens`, the run's `max_new_tokens`), then averaged over every row of the batch -- rows without an
  accepted token included, so the divisor never depends on the masks: loss = sum_i sum_t m_it x_it / (B L).
  (verl's `seq-mean-token-sum-norm` divides the same double sum by the horizon only, so its loss is B times
  this one.)

Select both on an arm: `;advantage=group-mean;loss_agg=seq-mean-token-sum-maxlen`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxalign.numerics.reduce import mean, reduce_sum, uncontracted
from jaxalign.rl.registry import register_advantage, register_loss_agg


@register_advantage("group-mean")
def group_mean_advantages(rewards, group_size: int) -> np.ndarray:
    """r - mean(group), in float64, returned as float32 [R]."""
    g = np.asarray(rewards, np.float64).reshape(-1, group_size)
    centre = g.mean(1, keepdims=True) if group_size > 1 else np.zeros_like(g)
    return (g - centre).reshape(-1).astype(np.float32)


@register_loss_agg("seq-mean-token-sum-maxlen")
def token_sum_over_budget(per_token, mask, policy, max_tokens: int):
    """mean over rows of (sum over accepted tokens) / max_tokens; every sum in the policy's order."""
    kept = uncontracted(jnp.where(mask, per_token, 0.0), policy)
    per_seq = reduce_sum(kept, policy, axis=1)
    return mean(per_seq, policy) / jnp.asarray(max_tokens, per_token.dtype)
