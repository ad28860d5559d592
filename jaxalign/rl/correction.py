"""Rollout correction as in verl's `algorithm.rollout_correction` (`verl/trainer/ppo/rollout_corr_helper.py`):
importance weights and rejection sampling for the gap between the rollout engine's logprobs and the trainer's.

All inputs are per-token arrays [batch, seq] with a mask of valid (completion) tokens; the log ratio is
log(pi_old / pi_rollout) = logp_old - logp_rollout. Weights and masks are computed with numpy in float64 on the
host: they are constants of the loss (no gradient flows through them). Semantics are verl's, checked against a
re-implementation of its helper in tests/test_correction_parity.py:

- IS level: "token" (w_t = exp(clamp(log ratio, +-20))), "sequence" (exp of the clamped *sum* of the unclamped
  token log ratios, broadcast over the sequence), or "none" (weights 1).
- IS threshold: a float C -> truncated IS (TIS, min(w, C)), verl's only mode. Extension, not in verl's helper:
  "lo_hi" -> IcePop (w outside [lo, hi] set to 0); its metrics use lo and hi where verl's use 1/C and C.
- Batch normalisation (`normalize_weights`, verl's rollout_is_batch_normalize): after truncation and before
  rejection, the weights are divided by their mean over valid tokens ("token") or over sequences with a valid
  token ("sequence"), when that mean exceeds 1e-8.
- Rejection sampling (`rs`, each entry "mode:threshold", AND of all; it edits the accepted mask, never the
  weights): token_k1 and seq_sum_k1 / seq_mean_k1 bound k1 = -log ratio = log(pi_rollout / pi_old) to the ratio
  band "lo_hi" (a single u meaning [1/u, u]); token_k2|k3, seq_sum_k2|k3, seq_mean_k2|k3 and seq_max_k2|k3 take
  an upper bound. "Geometric" RS is seq_mean_k1 with 0.999_1.001. Extension, not in verl: a sequence rule's
  threshold `top:F` re-fits the band on every batch so that the fraction F of the valid sequences furthest from
  the engine is rejected (|k1|, or k2 / k3; `rollout_rs_<mode>_fitted_band` reports the band) -- a ~45% band
  that follows the policy instead of one fitted once at the start.
- Metrics (prefix `rollout_corr/`): verl's off-policy metrics (`metrics.mismatch.verl_offpolicy_metrics`); its IS
  metrics, computed on the weights before truncation (`rollout_is_mean/min/max`, the fractions beyond the
  thresholds, per-sequence statistics), with `rollout_is_std` and `rollout_is_eff_sample_size` on the weights
  clamped into [1/C, C] (at sequence level verl clamps rollout_is_max's exponent to 20 but not rollout_is_min's, so
  min can exceed max); `rollout_rs_masked_fraction` (valid tokens rejected by any rule) and
  `rollout_rs_seq_masked_fraction` (rows with a rejected valid token, token rules included, over all rows), the
  same two per rule, verl's per-rule statistics (`rollout_rs_<mode>_mean/max/min/std/fraction_high/...`);
  plus this project's `max_abs_logp_diff`, `extreme_frac_tau2` and
  `bitwise_equal_fraction`.

Correction modes as text (`correction_settings`; an arm's `correction=`): `none` (the PPO ratio against the
trainer's recomputed logprobs, the engine's ignored: no weights, no rejection); verl's decoupled mode as
`+`-joined parts `tis[:C]` (token-level TIS, cap C, default 2), `seq-tis[:C]`, `icepop[:LO_HI]` (default 0.5_2)
and any number of `rs:RULE` (e.g. `tis:2+rs:seq_mean_k1:0.999_1.001`); `bypass[+rs:RULE...]` (the PPO ratio
against the engine's logprobs). One field at a time: `CorrectionConfig.parse_option` (`jaxalign.rl.options`).

Asynchronous rollouts (`RLConfig.max_lag`): with logp_old the trainer's at the current weights (the proximal
policy) and logp_rollout the engine's at the older behaviour weights, `correct` + `grpo.policy_loss` are AReaL's
decoupled PPO (`ppo_actor_loss_fn`, `use_decoupled_loss=True`): the PPO ratio against the proximal policy, the IS
weight pi_proximal / pi_behaviour. AReaL's `behav_imp_weight_cap` drops tokens above the cap from the loss (still
counted in its mean): `is_threshold="0_CAP"` here; verl's decoupled mode truncates instead (TIS, `"C"`). Checked in
tests/test_decoupled_parity.py; the log ratio's split into numerics and staleness is `metrics.staleness`.

Deliberate difference: the returned weights are exactly 0 on padding whatever the padding holds; verl's are
exp(padding) * 0, NaN where the padding is NaN. Valid tokens' weights never depend on padding in either.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import numpy as np

from jaxalign.metrics.mismatch import LOG_RATIO_CLAMP, mismatch_metrics, paired_logprobs, verl_offpolicy_metrics
from jaxalign.rl import options

# What the PPO ratio is taken against: decoupled = the trainer's recomputed old-policy logprobs (IS weights and
# rejection correct for the engine's); bypass = the engine's logprobs themselves (pi_old := pi_rollout)
DECOUPLED, BYPASS = "decoupled", "bypass"
MODES = (DECOUPLED, BYPASS)
IS_LEVELS = ("token", "sequence", "none")
RS_MODES = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
            "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


def _band(text: str) -> tuple[float, float]:
    parts = text.split("_")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"threshold {text!r}: allowed a float u (band [1/u, u]) or 'lo_hi'") from None
    if len(values) == 1:
        u = values[0]
        if u <= 1:
            raise ValueError(f"single-value ratio band {text!r} needs u > 1 (band [1/u, u])")
        return 1.0 / u, u
    if len(values) != 2 or not 0 <= values[0] < values[1]:
        raise ValueError(f"threshold {text!r}: allowed 'lo_hi' with 0 <= lo < hi")
    return values[0], values[1]


def _top_fraction(text: str) -> float:
    """F of a `top:F` threshold (0 < F < 1): reject that fraction of the sequences, those furthest from the
    engine (largest |k1|, largest k2 / k3), with the band re-fitted on every batch."""
    try:
        fraction = float(text[len("top:"):]) if text.startswith("top:") else -1.0
    except ValueError:
        fraction = -1.0
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"threshold {text!r}: allowed top:F with 0 < F < 1 (e.g. top:0.45)")
    return fraction


@dataclasses.dataclass(frozen=True)
class CorrectionConfig:
    """verl-style rollout correction settings (see module docstring)."""

    is_level: str = "token"
    is_threshold: str = "2.0"
    rs: tuple[str, ...] = ()
    normalize_weights: bool = False
    random_drop: float = 0.0  # a control, not verl's: drop this fraction of sequences at random (`random_keep`)

    def __post_init__(self):
        if not 0.0 <= self.random_drop < 1.0:
            raise ValueError(f"random_drop = {self.random_drop}; allowed: a fraction 0 <= F < 1")
        if self.is_level not in IS_LEVELS:
            raise ValueError(f"is_level = {self.is_level!r}; allowed: {', '.join(IS_LEVELS)}")
        if "_" in self.is_threshold:
            _band(self.is_threshold)
        else:
            try:
                if float(self.is_threshold) <= 0:
                    raise ValueError
            except ValueError:
                raise ValueError(f"is_threshold = {self.is_threshold!r}; allowed: a positive float C (TIS) or "
                                 f"'lo_hi' (IcePop)") from None
        for item in self.rs:
            mode, sep, threshold = item.partition(":")
            if mode not in RS_MODES or not sep:
                raise ValueError(f"rejection rule {item!r}; allowed: MODE:THRESHOLD with MODE in {', '.join(RS_MODES)}")
            if threshold.startswith("top"):
                if mode.startswith("token"):
                    raise ValueError(f"rejection rule {item!r}: a top:F threshold (re-fitted each batch) is for the "
                                     f"sequence rules; allowed modes: {', '.join(m for m in RS_MODES if m[:3] == 'seq')}")
                _top_fraction(threshold)
            elif mode.endswith("k1"):
                _band(threshold)
            else:
                try:
                    float(threshold)
                except ValueError:
                    raise ValueError(f"rejection rule {item!r}: k2/k3 take an upper bound (a float)") from None

    @classmethod
    def parse_option(cls, key: str, text: str):
        """The typed value of field `key` written as `text` (`jaxalign.rl.options`: `rs` is `+`-joined rules,
        `normalize_weights` true/false); a clear error naming the key, the value and what is allowed."""
        return options.parse_option(cls, key, text)


CORRECTION_GRAMMAR = ("none, bypass[+rs:RULE...], or +-joined tis[:C], seq-tis[:C], icepop[:LO_HI], rs:RULE "
                      "(e.g. tis:2+rs:seq_mean_k1:0.999_1.001)")


def correction_settings(text: str | None, default: CorrectionConfig) -> tuple[str, CorrectionConfig]:
    """(mode, CorrectionConfig) of a correction mode string (module docstring); None gives (decoupled,
    `default`). A mode with weights keeps `default.normalize_weights`."""
    if text is None:
        return DECOUPLED, default
    parts = [p.strip() for p in text.split("+")]
    if parts == ["none"]:
        return DECOUPLED, CorrectionConfig(is_level="none", rs=())
    if len(parts) == 1 and parts[0].startswith("drop:"):
        try:
            fraction = float(parts[0][5:])
        except ValueError:
            fraction = -1.0
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"correction {text!r}: drop takes a fraction 0 < F < 1, e.g. drop:0.45")
        return DECOUPLED, CorrectionConfig(is_level="none", rs=(), random_drop=fraction)
    mode = DECOUPLED
    if parts[0] == BYPASS:
        mode, parts = BYPASS, parts[1:]
    is_level, threshold, rs = "none", "2.0", []
    for part in parts:
        kind, _, value = part.partition(":")
        if kind == "rs" and value:
            rs.append(value)
        elif kind in ("tis", "seq-tis", "icepop") and mode == DECOUPLED:
            if is_level != "none":
                raise ValueError(f"correction {text!r}: at most one of tis, seq-tis, icepop")
            is_level = "sequence" if kind == "seq-tis" else "token"
            threshold = value or ("0.5_2.0" if kind == "icepop" else "2.0")
            if kind == "icepop" and "_" not in threshold:
                raise ValueError(f"correction {text!r}: icepop takes a band LO_HI, e.g. icepop:0.5_2.0")
            if kind != "icepop" and "_" in threshold:
                raise ValueError(f"correction {text!r}: {kind} takes a cap C, e.g. {kind}:2.0")
        else:
            raise ValueError(f"correction {text!r}: unknown part {part!r}; allowed: {CORRECTION_GRAMMAR}")
    return mode, CorrectionConfig(is_level=is_level, is_threshold=threshold, rs=tuple(rs),
                                  normalize_weights=default.normalize_weights)


def _masked_mean(x: np.ndarray, mask: np.ndarray, axis=None) -> np.ndarray:
    """verl's masked mean: values outside the mask are never read; the count gets + 1e-8."""
    return np.sum(np.where(mask, x, 0.0), axis=axis) / (np.sum(mask, axis=axis) + 1e-8)


def _weights(log_ratio: np.ndarray, mask: np.ndarray, level: str) -> tuple[np.ndarray, np.ndarray]:
    """Untruncated IS weights [B, S] (0 on padding) and the log ratio verl's metrics read ([B, S] or [B, 1])."""
    if level == "sequence":
        seq = np.sum(np.where(mask, log_ratio, 0.0), axis=1, keepdims=True)
        w = np.broadcast_to(np.exp(np.clip(seq, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)), log_ratio.shape)
        return np.where(mask, w, 0.0), seq
    return np.where(mask, np.exp(np.clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)), 0.0), log_ratio


def _is_metrics(w: np.ndarray, for_metrics: np.ndarray, mask: np.ndarray, level: str, low: float,
                high: float) -> dict[str, float]:
    """verl's `compute_is_metrics` on the untruncated weights `w`; [low, high] = [1/C, C] for TIS."""
    out = {"rollout_is_mean": float(_masked_mean(w, mask))}
    if level == "sequence":
        out["rollout_is_max"] = float(np.exp(min(for_metrics.max(), LOG_RATIO_CLAMP)))
        out["rollout_is_min"] = float(np.exp(for_metrics.min()))
        out["rollout_is_ratio_fraction_high"] = float(np.mean(for_metrics > np.log(high)))
        out["rollout_is_ratio_fraction_low"] = float(np.mean(for_metrics < np.log(low)) if low > 0 else 0.0)
    else:
        out["rollout_is_ratio_fraction_high"] = float(_masked_mean(w > high, mask))
        out["rollout_is_ratio_fraction_low"] = float(_masked_mean(w < low, mask))
        out["rollout_is_max"] = float(w[mask].max())
        out["rollout_is_min"] = float(w[mask].min())
    clamped = np.clip(w, low, high)
    if mask.sum() > 1:
        mean = _masked_mean(clamped, mask)
        out["rollout_is_std"] = float(np.sqrt(max(_masked_mean(clamped ** 2, mask) - mean ** 2, 0.0)))
    else:
        out["rollout_is_std"] = 0.0
    normalised = clamped / (_masked_mean(clamped, mask) + 1e-8)
    out["rollout_is_eff_sample_size"] = float(1.0 / _masked_mean(normalised ** 2, mask))
    seq = _masked_mean(w, mask, axis=1)
    out.update({
        "rollout_is_seq_mean": float(seq.mean()),
        "rollout_is_seq_std": float(seq.std(ddof=1)) if seq.size > 1 else 0.0,
        "rollout_is_seq_max": float(seq.max()), "rollout_is_seq_min": float(seq.min()),
        "rollout_is_seq_max_deviation": float(np.abs(seq - 1.0).max()),
        "rollout_is_seq_fraction_high": float(np.mean(seq > high)),
        "rollout_is_seq_fraction_low": float(np.mean(seq < low)),
    })
    return out


def _rule(mode: str, threshold: str, log_ratio: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, dict]:
    """verl's per-token keep mask [B, S] for one rejection rule (before AND-ing with the valid mask) and its
    `compute_rs_metrics` (names without the `rollout_rs_<mode>` prefix)."""
    kind, estimator = mode.rsplit("_", 1)
    safe = np.clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    value = {"k1": -safe, "k2": 0.5 * safe ** 2, "k3": np.exp(safe) - 1.0 - safe}[estimator]
    if kind == "token":
        seq = _masked_mean(value, mask, axis=1)
    else:
        if kind == "seq_max":
            top = np.where(mask, value, -np.inf).max(axis=1)
            seq = np.where(top == -np.inf, 0.0, top)
        else:
            seq = _masked_mean(value, mask, axis=1) if kind == "seq_mean" else np.sum(np.where(mask, value, 0.0),
                                                                                      axis=1)
        value = np.broadcast_to(seq[:, None], log_ratio.shape)
    if threshold.startswith("top"):
        # a band re-fitted on this batch: the round(F * n) valid sequences furthest from the engine (|k1|, or k2 /
        # k3) are rejected, ties going to the later row; the band's edge is the largest distance kept
        valid_rows = mask.any(1)
        distance = np.where(valid_rows, np.abs(seq) if estimator == "k1" else seq, -np.inf)
        n_reject = int(round(_top_fraction(threshold) * valid_rows.sum()))
        order = np.lexsort((-np.arange(len(distance)), -distance))  # furthest first; among equals, later rows
        rejected_rows = np.zeros(len(distance), bool)
        rejected_rows[order[:n_reject]] = True
        kept = distance[valid_rows & ~rejected_rows]
        edge = float(kept.max()) if kept.size else 0.0
        low, high = (-edge, edge) if estimator == "k1" else (0.0, edge)
        keep = np.broadcast_to(~rejected_rows[:, None], log_ratio.shape)
    elif estimator == "k1":
        low, high = _band(threshold)  # compared in log space with math.log, as verl does
        low, high = (math.log(low) if low > 0 else -math.inf), math.log(high)
        keep = (value >= low) & (value <= high)
    else:
        low, high = 0.0, float(threshold)
        keep = value <= high
    seq_valid = seq[mask.any(1)]
    if kind == "token":  # verl: token statistics over valid tokens (masked means), sequence ones over valid rows
        level_values = value[mask]
        fraction = lambda hit: _masked_mean(hit, mask)  # noqa: E731
    else:
        level_values = seq_valid
        fraction = lambda hit: np.mean(hit[mask.any(1), 0])  # noqa: E731
    stats = {"mean": _masked_mean(value, mask), "max": level_values.max(), "min": level_values.min(),
             "fraction_high": fraction(value > high),
             "fraction_low": fraction(value < low) if estimator == "k1" else 0.0}
    if mask.sum() > 1:
        clamped = np.clip(value, low, high)
        var = _masked_mean(clamped ** 2, mask) - _masked_mean(clamped, mask) ** 2
        stats["std"] = np.sqrt(max(var, 0.0))
    else:
        stats["std"] = 0.0
    stats.update({"seq_mean": seq_valid.mean(), "seq_std": seq_valid.std(ddof=1) if seq_valid.size > 1 else 0.0,
                  "seq_max": seq_valid.max(), "seq_min": seq_valid.min(),
                  "seq_max_deviation": np.abs(seq_valid).max(), "seq_fraction_high": np.mean(seq_valid > high)})
    if estimator == "k1":
        stats["seq_fraction_low"] = np.mean(seq_valid < low)
    if threshold.startswith("top"):
        stats["fitted_band"] = math.exp(high) if estimator == "k1" else high  # the ratio band [1/u, u] it fitted
    return keep, {k: float(v) for k, v in stats.items()}


def random_keep(log_ratio: np.ndarray, fraction: float) -> np.ndarray:
    """Rows [B] kept by the random-drop control: round(fraction * B) rows dropped, chosen without regard to the
    trainer-engine gap -- what rejection sampling does to the batch size, without its selection. The choice is
    seeded by a hash of the batch's bytes (deterministic for a deterministic run, different every step)."""
    rows = log_ratio.shape[0]
    seed = int.from_bytes(hashlib.sha256(np.ascontiguousarray(log_ratio).tobytes()).digest()[:8], "little")
    keep = np.ones(rows, bool)
    keep[np.random.default_rng(seed).permutation(rows)[: int(round(fraction * rows))]] = False
    return keep


def correct(logp_old, logp_rollout, mask, cfg: CorrectionConfig) -> tuple[np.ndarray, np.ndarray, dict]:
    """IS weights [B, S] (0 on padding; not zeroed where rejected), the accepted-token mask [B, S] (valid and
    kept by every rejection rule) and verl-named metrics (`rollout_corr/...`). See the module docstring."""
    lo, lr, mask = paired_logprobs(logp_old, logp_rollout, mask, ("logp_old", "logp_rollout"), "correct")
    with np.errstate(over="ignore", invalid="ignore"):
        log_ratio = np.where(mask, lo - lr, 0.0)  # padding is never read, whatever it holds (NaN included)
        metrics = {}
        if cfg.is_level == "none":
            weights = mask.astype(np.float64)
        else:
            weights, for_metrics = _weights(log_ratio, mask, cfg.is_level)
            if "_" in cfg.is_threshold:
                low, high = _band(cfg.is_threshold)
            else:
                high = float(cfg.is_threshold)
                low = 1.0 / high
            metrics.update(_is_metrics(weights, for_metrics, mask, cfg.is_level, low, high))
            if "_" in cfg.is_threshold:
                weights = np.where((weights >= low) & (weights <= high), weights, 0.0)
            else:
                weights = np.minimum(weights, high)
            if cfg.normalize_weights:
                if cfg.is_level == "token":
                    mean = _masked_mean(weights, mask)
                else:
                    valid_rows = mask.any(1)
                    mean = np.sum(_masked_mean(weights, mask, axis=1) * valid_rows) / max(valid_rows.sum(), 1e-8)
                metrics["rollout_is_batch_norm_factor"] = float(mean) if mean > 1e-8 else 1.0
                if mean > 1e-8:
                    weights = weights / mean
        keep = np.ones(lo.shape, bool)
        valid_rows = mask.any(1)
        for item in dict.fromkeys(cfg.rs):  # verl drops repeated rules
            mode, _, threshold = item.partition(":")
            rule_keep, rule_stats = _rule(mode, threshold, log_ratio, mask)
            metrics.update({f"rollout_rs_{mode}_{k}": v for k, v in rule_stats.items()})
            keep &= rule_keep
            rejected = ~rule_keep & mask
            metrics[f"rollout_rs_{mode}_masked_fraction"] = float(_masked_mean(~rule_keep, mask))
            metrics[f"rollout_rs_{mode}_seq_masked_fraction"] = (
                float(np.sum(rejected.any(1) & valid_rows) / valid_rows.sum()))
        if cfg.random_drop:
            keep &= random_keep(log_ratio, cfg.random_drop)[:, None]
        accept = keep & mask
        metrics["rollout_rs_masked_fraction"] = float(_masked_mean(~keep, mask))
        metrics["rollout_rs_seq_masked_fraction"] = float(np.mean((~keep & mask).any(1)))
    metrics.update(verl_offpolicy_metrics(lo, lr, mask))
    extras = mismatch_metrics(lo, lr, mask)
    metrics.update({k: extras[k] for k in ("max_abs_logp_diff", "extreme_frac_tau2", "bitwise_equal_fraction")})
    return weights.astype(np.float32), accept, {f"rollout_corr/{k}": v for k, v in metrics.items()}
