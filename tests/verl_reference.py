"""verl's rollout correction and GRPO pieces, re-implemented from their documented behaviour for the parity tests.

Written row by row in plain Python floats (no numpy), so it shares no code or vectorisation with jaxalign's:
- `verl/trainer/ppo/rollout_corr_helper.py`: `compute_offpolicy_metrics`, `compute_rollout_correction_weights` /
  `compute_is_metrics` (TIS), `compute_rollout_rejection_mask`. Every masked mean there is
  sum(values where mask) / (count + 1e-8); log ratios are clamped to +-20 before exp (k3_kl excepted).
- `verl/trainer/ppo/core_algos.py`: `compute_grpo_outcome_advantage` ((r - mean) / (torch.std + eps), torch.std
  being the unbiased std; a group of one gets mean 0, std 1) and the PPO `pg_clipfrac` (the fraction of valid
  tokens where the clipped loss is strictly larger than the unclipped one, i.e. where clipping is active).
Inputs are lists of rows; a row is a list of (logp_old, logp_rollout, valid) triples.
"""

from __future__ import annotations

import math

BOUND = 20.0


def _clamp(x: float) -> float:
    return min(max(x, -BOUND), BOUND)


def _mean(values, valid) -> float:
    total = 0.0
    count = 0
    for v, ok in zip(values, valid):
        if ok:
            total += v
            count += 1
    return total / (count + 1e-8)


def _flat(rows):
    return [t for row in rows for t in row]


def offpolicy_metrics(rows) -> dict[str, float]:
    """The thirteen metrics of verl's `compute_offpolicy_metrics`."""
    flat = _flat(rows)
    valid = [ok for _, _, ok in flat]
    mean_old = [_mean([o for o, _, _ in row], [ok for _, _, ok in row]) for row in rows]
    mean_roll = [_mean([r for _, r, _ in row], [ok for _, _, ok in row]) for row in rows]
    diff = [b - a for a, b in zip(mean_old, mean_roll)]
    seq_sum = [sum(o - r for o, r, ok in row if ok) for row in rows]
    n = len(rows)
    return {
        "training_ppl": sum(math.exp(-m) for m in mean_old) / n,
        "training_log_ppl": sum(-m for m in mean_old) / n,
        "kl": _mean([r - o if ok else 0.0 for o, r, ok in flat], valid),
        "k3_kl": _mean([math.exp(o - r) - (o - r) - 1 if ok else 0.0 for o, r, ok in flat], valid),
        "rollout_ppl": sum(math.exp(-m) for m in mean_roll) / n,
        "rollout_log_ppl": sum(-m for m in mean_roll) / n,
        "log_ppl_diff": sum(diff) / n,
        "log_ppl_abs_diff": sum(abs(d) for d in diff) / n,
        "log_ppl_diff_max": max(diff),
        "log_ppl_diff_min": min(diff),
        "ppl_ratio": sum(math.exp(d) for d in diff) / n,
        "chi2_token": _mean([math.exp(_clamp(o - r)) ** 2 if ok else 0.0 for o, r, ok in flat], valid) - 1.0,
        "chi2_seq": sum(math.exp(2.0 * _clamp(s)) for s in seq_sum) / n - 1.0,
    }


def is_weights(rows, level: str, threshold: float, normalize: bool = False):
    """(truncated, optionally batch-normalised weights as rows (padding: 0), verl's IS metrics)."""
    valid_rows = [[ok for _, _, ok in row] for row in rows]
    if level == "token":
        raw = [[math.exp(_clamp(o - r)) if ok else 0.0 for o, r, ok in row] for row in rows]
        for_metrics = [o - r for o, r, ok in _flat(rows) if ok]
    else:
        sums = [sum(o - r for o, r, ok in row if ok) for row in rows]
        raw = [[math.exp(_clamp(s)) if ok else 0.0 for _, _, ok in row] for s, row in zip(sums, rows)]
        for_metrics = sums
    flat_raw, flat_valid = _flat(raw), _flat(valid_rows)
    upper, lower = threshold, 1.0 / threshold
    m = {"rollout_is_mean": _mean(flat_raw, flat_valid)}
    if level == "sequence":
        m["rollout_is_max"] = math.exp(min(max(for_metrics), BOUND))
        m["rollout_is_min"] = math.exp(min(for_metrics))
        m["rollout_is_ratio_fraction_high"] = sum(x > math.log(upper) for x in for_metrics) / len(rows)
        m["rollout_is_ratio_fraction_low"] = sum(x < math.log(lower) for x in for_metrics) / len(rows)
    else:
        m["rollout_is_ratio_fraction_high"] = _mean([float(w > upper) for w in flat_raw], flat_valid)
        m["rollout_is_ratio_fraction_low"] = _mean([float(w < lower) for w in flat_raw], flat_valid)
        m["rollout_is_max"] = max(w for w, ok in zip(flat_raw, flat_valid) if ok)
        m["rollout_is_min"] = min(w for w, ok in zip(flat_raw, flat_valid) if ok)
    clamped = [min(max(w, lower), upper) for w in flat_raw]
    mean_c = _mean(clamped, flat_valid)
    if sum(flat_valid) > 1:
        m["rollout_is_std"] = math.sqrt(max(_mean([c * c for c in clamped], flat_valid) - mean_c ** 2, 0.0))
    else:
        m["rollout_is_std"] = 0.0
    m["rollout_is_eff_sample_size"] = 1.0 / _mean([(c / (mean_c + 1e-8)) ** 2 for c in clamped], flat_valid)
    seq = [_mean(w, v) for w, v in zip(raw, valid_rows)]
    mu = sum(seq) / len(seq)
    m["rollout_is_seq_mean"] = mu
    m["rollout_is_seq_std"] = (math.sqrt(sum((s - mu) ** 2 for s in seq) / (len(seq) - 1)) if len(seq) > 1
                               else 0.0)
    m["rollout_is_seq_max"], m["rollout_is_seq_min"] = max(seq), min(seq)
    m["rollout_is_seq_max_deviation"] = max(abs(s - 1.0) for s in seq)
    m["rollout_is_seq_fraction_high"] = sum(s > upper for s in seq) / len(seq)
    m["rollout_is_seq_fraction_low"] = sum(s < lower for s in seq) / len(seq)
    weights = [[min(w, upper) for w in row] for row in raw]
    if normalize:
        if level == "token":
            mean = _mean(_flat(weights), flat_valid)
        else:
            per_row = [_mean(w, v) for w, v in zip(weights, valid_rows)]
            has = [any(v) for v in valid_rows]
            mean = sum(p for p, h in zip(per_row, has) if h) / max(sum(has), 1e-8)
        m["rollout_is_batch_norm_factor"] = mean if mean > 1e-8 else 1.0
        if mean > 1e-8:
            weights = [[w / mean for w in row] for row in weights]
    return weights, m


def rejection_mask(rows, rules: list[tuple[str, str]]):
    """(accepted mask rows, verl's rejection metrics) for rules [(option, threshold spec)]."""
    keep_all = [[True] * len(row) for row in rows]
    metrics = {}
    valid_rows = [[ok for _, _, ok in row] for row in rows]
    has = [any(v) for v in valid_rows]
    for option, spec in rules:
        kind, estimator = option.rsplit("_", 1)
        if estimator == "k1":
            if "_" in spec:
                lo_text, hi_text = spec.split("_", 1)
            else:
                hi_text, lo_text = spec, str(1.0 / float(spec))
            lo_log, hi_log = math.log(float(lo_text)), math.log(float(hi_text))
        else:
            upper = float(spec)
        keep_rows, stat_rows = [], []
        for row, valid in zip(rows, valid_rows):
            stats = []
            for o, r, _ in row:
                x = _clamp(o - r)
                stats.append({"k1": -x, "k2": 0.5 * x * x, "k3": math.exp(x) - 1.0 - x}[estimator])
            if kind == "seq_sum":
                stats = [sum(s for s, ok in zip(stats, valid) if ok)] * len(row)
            elif kind == "seq_mean":
                stats = [_mean(stats, valid)] * len(row)
            elif kind == "seq_max":
                chosen = [s for s, ok in zip(stats, valid) if ok]
                stats = [max(chosen) if chosen else 0.0] * len(row)
            stat_rows.append(stats)
            if estimator == "k1":
                keep_rows.append([lo_log <= s <= hi_log for s in stats])
            else:
                keep_rows.append([s <= upper for s in stats])
        metrics.update(_rule_metrics(option, stat_rows, valid_rows, *((lo_log, hi_log) if estimator == "k1"
                                                                      else (None, upper))))
        rejected_rows = [any(ok and not k for k, ok in zip(kr, v)) for kr, v in zip(keep_rows, valid_rows)]
        metrics[f"rollout_rs_{option}_masked_fraction"] = _mean([float(not k) for k in _flat(keep_rows)],
                                                                _flat(valid_rows))
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = (
            sum(r and h for r, h in zip(rejected_rows, has)) / sum(has))
        keep_all = [[a and b for a, b in zip(ka, kr)] for ka, kr in zip(keep_all, keep_rows)]
    metrics["rollout_rs_masked_fraction"] = _mean([float(not k) for k in _flat(keep_all)], _flat(valid_rows))
    metrics["rollout_rs_seq_masked_fraction"] = sum(
        any(ok and not k for k, ok in zip(ka, v)) for ka, v in zip(keep_all, valid_rows)) / len(rows)
    accepted = [[k and ok for k, ok in zip(ka, v)] for ka, v in zip(keep_all, valid_rows)]
    return accepted, metrics


def _rule_metrics(option: str, stat_rows, valid_rows, low, high) -> dict[str, float]:
    """verl's `compute_rs_metrics` for one rule: per-token statistics `stat_rows` (a sequence rule repeats its
    sequence statistic over the row), thresholds in the statistic's units (low None: no lower bound)."""
    sequence = not option.startswith("token")
    flat, flat_valid = _flat(stat_rows), _flat(valid_rows)
    has = [any(v) for v in valid_rows]
    seq = [row[0] if sequence else _mean(row, v) for row, v in zip(stat_rows, valid_rows)]
    seq = [x for x, h in zip(seq, has) if h]
    p = f"rollout_rs_{option}"
    m = {f"{p}_mean": _mean(flat, flat_valid)}
    chosen = seq if sequence else [x for x, ok in zip(flat, flat_valid) if ok]
    m[f"{p}_max"], m[f"{p}_min"] = max(chosen), min(chosen)
    if sequence:
        m[f"{p}_fraction_high"] = sum(x > high for x in seq) / len(seq)
        m[f"{p}_fraction_low"] = sum(x < low for x in seq) / len(seq) if low is not None else 0.0
    else:
        m[f"{p}_fraction_high"] = _mean([float(x > high) for x in flat], flat_valid)
        m[f"{p}_fraction_low"] = _mean([float(x < low) for x in flat], flat_valid) if low is not None else 0.0
    if sum(flat_valid) > 1:
        floor = low if low is not None else 0.0
        clamped = [min(max(x, floor), high) for x in flat]
        var = _mean([c * c for c in clamped], flat_valid) - _mean(clamped, flat_valid) ** 2
        m[f"{p}_std"] = math.sqrt(max(var, 0.0))
    else:
        m[f"{p}_std"] = 0.0
    mu = sum(seq) / len(seq)
    m[f"{p}_seq_mean"] = mu
    m[f"{p}_seq_std"] = math.sqrt(sum((x - mu) ** 2 for x in seq) / (len(seq) - 1)) if len(seq) > 1 else 0.0
    m[f"{p}_seq_max"], m[f"{p}_seq_min"] = max(seq), min(seq)
    m[f"{p}_seq_max_deviation"] = max(abs(x) for x in seq)
    m[f"{p}_seq_fraction_high"] = sum(x > high for x in seq) / len(seq)
    if low is not None:
        m[f"{p}_seq_fraction_low"] = sum(x < low for x in seq) / len(seq)
    return m


def grpo_advantages(rewards, group_size: int, eps: float = 1e-6) -> list[float]:
    """verl's `compute_grpo_outcome_advantage` for rewards laid out group after group."""
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start:start + group_size]
        if len(group) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(group) / len(group)
            std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1))
        out += [(r - mean) / (std + eps) for r in group]
    return out


def pg_clipfrac(ratios, advantages, valid, clip_low: float, clip_high: float) -> float:
    """verl's `pg_clipfrac`: valid tokens where -A*clip(ratio) > -A*ratio (the clipped term is the one kept)."""
    active = []
    for ratio, adv in zip(ratios, advantages):
        unclipped = -adv * ratio
        clipped = -adv * min(max(ratio, 1.0 - clip_low), 1.0 + clip_high)
        active.append(float(clipped > unclipped))
    return _mean(active, valid)


def vanilla_policy_loss(ratios, advantages, valid, clip_low: float, clip_high: float, clip_ratio_c: float):
    """verl's `compute_policy_loss_vanilla` with token-mean aggregation, per its documented behaviour: the PPO
    clipped loss max(-A*r, -A*clip(r)); for A < 0 it is further capped at -A*clip_ratio_c (dual-clip, always on in
    verl). Returns (loss, pg_clipfrac, pg_clipfrac_lower)."""
    losses, active, lower = [], [], []
    for ratio, adv in zip(ratios, advantages):
        unclipped = -adv * ratio
        clipped = -adv * min(max(ratio, 1.0 - clip_low), 1.0 + clip_high)
        loss1 = max(unclipped, clipped)
        active.append(float(clipped > unclipped))
        cap = -adv * clip_ratio_c
        lower.append(float(loss1 > cap and adv < 0))
        losses.append(min(cap, loss1) if adv < 0 else loss1)
    return _mean(losses, valid), _mean(active, valid), _mean(lower, valid)
