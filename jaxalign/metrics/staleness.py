"""The staleness/numerics split of an off-policy batch's log ratio (asynchronous rollouts, stale weights).

Three logprobs of the same sampled tokens [batch, seq]: the engine's at the behaviour weights (`logp_engine`, the
weights that generated the batch), the trainer's at the same behaviour weights (`logp_behaviour`) and the
trainer's at the current weights (`logp_current`, the proximal policy). The total log ratio the rollout
correction sees, m = logp_current - logp_engine, is per token the sum of

- numerics, m_n = logp_behaviour - logp_engine: one set of weights under two numeric policies (the engine's
  error; exactly 0 for an aligned pair, whatever the lag), and
- staleness, m_s = logp_current - logp_behaviour: one numeric policy at two weight versions (the lag; exactly 0
  at lag 0, whatever the engine).

`split_metrics` reports each part under its own prefix with the names verl uses under `rollout_corr/`
(`kl` = the k1 mean of log(pi_a / pi_b) over valid tokens, `k3_kl`, `max_abs_logp_diff`; the estimators of
`metrics.mismatch.mismatch_metrics`, where a part's "engine" side is the older/engine pass) and each part's share
of the total: sum |m_part| / (sum |m_n| + sum |m_s|) over valid tokens (both 0 when neither part moved any token).
"""

from __future__ import annotations

import numpy as np

from jaxalign.metrics.mismatch import mismatch_metrics, paired_logprobs

PARTS = ("numerics", "staleness")
_REPORTED = ("kl", "k3_kl", "max_abs_logp_diff")


def split_log_ratios(logp_current, logp_behaviour, logp_engine, mask) -> dict[str, np.ndarray]:
    """Per-token log ratios in float64 [batch, seq] (0 outside `mask`): `total` = current - engine,
    `numerics` = behaviour - engine, `staleness` = current - behaviour; total = numerics + staleness up to
    float64 rounding of the two subtractions."""
    current, behaviour, mask = paired_logprobs(logp_current, logp_behaviour, mask,
                                               ("logp_current", "logp_behaviour"), "split")
    _, engine, _ = paired_logprobs(logp_current, logp_engine, mask, ("logp_current", "logp_engine"), "split")
    with np.errstate(invalid="ignore", over="ignore"):
        return {"total": np.where(mask, current - engine, 0.0),
                "numerics": np.where(mask, behaviour - engine, 0.0),
                "staleness": np.where(mask, current - behaviour, 0.0)}


def split_metrics(logp_current, logp_behaviour, logp_engine, mask) -> dict[str, float]:
    """`numerics/{kl,k3_kl,max_abs_logp_diff,share}` and `staleness/{...}` of one batch (module docstring)."""
    parts = {"numerics": mismatch_metrics(logp_behaviour, logp_engine, mask),
             "staleness": mismatch_metrics(logp_current, logp_behaviour, mask)}
    ratios = split_log_ratios(logp_current, logp_behaviour, logp_engine, mask)
    mass = {part: float(np.abs(ratios[part]).sum()) for part in PARTS}
    whole = mass["numerics"] + mass["staleness"]
    out = {}
    for part in PARTS:
        out.update({f"{part}/{name}": parts[part][name] for name in _REPORTED})
        out[f"{part}/share"] = mass[part] / whole if whole > 0 else 0.0
    return out


def split_summary(rows: list[dict]) -> dict[str, float]:
    """A run's split from its metrics rows (those with `numerics/k3_kl`): the mean over steps of each part's
    k3 and share, and the largest per-step k3 of each; {} when no row has the split."""
    steps = [r for r in rows if "numerics/k3_kl" in r]
    if not steps:
        return {}
    out = {}
    for part in PARTS:
        k3 = [r[f"{part}/k3_kl"] for r in steps]
        out[f"{part}/mean_k3"] = float(np.mean(k3))
        out[f"{part}/max_k3"] = float(np.max(k3))
        out[f"{part}/mean_share"] = float(np.mean([r[f"{part}/share"] for r in steps]))
    return out
