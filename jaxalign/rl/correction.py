"""Rollout correction as in verl's `algorithm.rollout_correction`: importance weights and rejection sampling for
the gap between the rollout engine's logprobs and the trainer's.

All inputs are per-token arrays [batch, seq] with a mask of valid (completion) tokens. Log ratios are clamped to
+-20 before exp. Weights and masks are computed with numpy on the host: they are constants of the loss (no
gradient flows through them).

- IS level: "token" (w_t = pi_old/pi_rollout per token), "sequence" (the product over the sequence, broadcast),
  or "none".
- IS threshold: a float C -> truncated IS (TIS, min(w, C)); "lo_hi" -> IcePop (w outside [lo, hi] set to 0).
- Rejection sampling (`rs`, each entry "mode:threshold", AND of all): token_k1 (ratio band "lo_hi", a single u
  meaning [1/u, u]), token_k2, token_k3 (upper bounds); seq_sum_k1|k2|k3, seq_mean_k1|k2|k3, seq_max_k2|k3 reject
  whole sequences. "Geometric" RS is seq_mean_k1 with 0.999_1.001.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxalign.align.metrics import LOG_RATIO_CLAMP, mismatch_metrics

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


@dataclasses.dataclass(frozen=True)
class CorrectionConfig:
    """verl-style rollout correction settings (see module docstring)."""

    is_level: str = "token"
    is_threshold: str = "2.0"
    rs: tuple[str, ...] = ()
    normalize_weights: bool = False

    def __post_init__(self):
        if self.is_level not in ("token", "sequence", "none"):
            raise ValueError(f"is_level = {self.is_level!r}; allowed: token, sequence, none")
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
            if mode.endswith("k1"):
                _band(threshold)
            else:
                try:
                    float(threshold)
                except ValueError:
                    raise ValueError(f"rejection rule {item!r}: k2/k3 take an upper bound (a float)") from None


def _estimators(log_ratio: np.ndarray) -> dict[str, np.ndarray]:
    return {"k1": log_ratio, "k2": 0.5 * log_ratio ** 2, "k3": np.exp(log_ratio) - 1.0 - log_ratio}


def correct(logp_old, logp_rollout, mask, cfg: CorrectionConfig) -> tuple[np.ndarray, np.ndarray, dict]:
    """IS weights [B, S], the accepted-token mask [B, S] and verl-named metrics (`rollout_corr/...`)."""
    lo = np.asarray(logp_old, np.float64)
    lr = np.asarray(logp_rollout, np.float64)
    mask = np.asarray(mask, bool)
    log_ratio = np.clip(lo - lr, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) * mask
    # --- importance weights
    if cfg.is_level == "sequence":
        seq = np.clip(log_ratio.sum(1, keepdims=True), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        weights = np.broadcast_to(np.exp(seq), lo.shape).copy()
    elif cfg.is_level == "token":
        weights = np.exp(log_ratio)
    else:
        weights = np.ones_like(lo)
    raw = weights.copy()
    if cfg.is_level != "none":
        if "_" in cfg.is_threshold:
            low, high = _band(cfg.is_threshold)
            weights = np.where((weights >= low) & (weights <= high), weights, 0.0)
        else:
            weights = np.minimum(weights, float(cfg.is_threshold))
    # --- rejection sampling
    accept = mask.copy()
    seq_accept = np.ones(lo.shape[0], bool)
    est = _estimators(log_ratio)
    count = np.maximum(mask.sum(1), 1)
    for item in cfg.rs:
        mode, _, threshold = item.partition(":")
        kind, estimator = mode.rsplit("_", 1)
        value = est[estimator]
        if kind == "token":
            if estimator == "k1":
                low, high = _band(threshold)
                ok = (np.exp(log_ratio) >= low) & (np.exp(log_ratio) <= high)
            else:
                ok = value <= float(threshold)
            accept &= ok | ~mask
            continue
        masked = np.where(mask, value, 0.0)
        stat = {"seq_sum": masked.sum(1), "seq_mean": masked.sum(1) / count,
                "seq_max": np.where(mask, value, -np.inf).max(1)}[kind]
        if estimator == "k1":
            low, high = _band(threshold)
            ok = (np.exp(stat) >= low) & (np.exp(stat) <= high)
        else:
            ok = stat <= float(threshold)
        seq_accept &= ok
    accept &= seq_accept[:, None]
    weights = weights * accept
    if cfg.normalize_weights and accept.any():
        weights = weights / weights[accept].mean()
    valid_w = raw[mask]
    normalised = valid_w / max(valid_w.mean(), 1e-12)
    metrics = {f"rollout_corr/{k}": v for k, v in mismatch_metrics(lo, lr, mask).items()
               if k in ("kl", "k3_kl", "chi2_token", "chi2_seq", "training_ppl", "rollout_ppl", "log_ppl_diff",
                        "log_ppl_abs_diff", "ppl_ratio", "max_abs_logp_diff", "extreme_frac_tau2",
                        "bitwise_equal_fraction")}
    metrics.update({
        "rollout_corr/rollout_is_mean": float(valid_w.mean()),
        "rollout_corr/rollout_is_std": float(valid_w.std()),
        "rollout_corr/rollout_is_min": float(valid_w.min()),
        "rollout_corr/rollout_is_max": float(valid_w.max()),
        "rollout_corr/rollout_is_eff_sample_size": float(1.0 / np.mean(normalised ** 2)),
        "rollout_corr/rollout_rs_masked_fraction": float(1.0 - accept[mask].mean()),
        "rollout_corr/rollout_rs_seq_masked_fraction": float(1.0 - seq_accept[mask.any(1)].mean()),
    })
    return weights.astype(np.float32), accept, metrics
