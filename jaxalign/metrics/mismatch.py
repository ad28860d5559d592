"""Trainer-engine mismatch metrics on sampled tokens, with verl's names (`rollout_corr/...` there).

m = logp_trainer - logp_engine per valid token. Estimators of KL(engine || trainer): k1 = -m (the log of
pi_engine / pi_trainer, the ratio verl's k1 rejection bands bound), k2 = m^2/2, k3 = exp(m) - 1 - m (>= 0).

`mismatch_metrics` is this project's measurement: exact means over valid tokens, sequence figures over sequences
with a valid token, every exp of a log ratio clamped to +-20. `verl_offpolicy_metrics` is verl's
`compute_offpolicy_metrics` to the bit (what `rl.correction` reports under `rollout_corr/`); the two differ only by
verl's 1e-8 in denominators, its averaging over rows without valid tokens and its unclamped k3.
"""

from __future__ import annotations

import numpy as np

LOG_RATIO_CLAMP = 20.0


def _masked_mean(x: np.ndarray, mask: np.ndarray, axis=None) -> np.ndarray:
    return np.sum(np.where(mask, x, 0.0), axis=axis) / np.maximum(np.sum(mask, axis=axis), 1)


def paired_logprobs(a, b, mask, names: tuple[str, str] = ("logp_trainer", "logp_engine"),
                    purpose: str = "compare") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Two logprob arrays [batch, seq] as float64 and their validity mask as bool, checked: one 2-D shape for all
    three, and at least one valid token."""
    a, b, mask = np.asarray(a, np.float64), np.asarray(b, np.float64), np.asarray(mask, bool)
    if a.shape != b.shape or a.shape != mask.shape or a.ndim != 2:
        raise ValueError(f"{names[0]} {a.shape}, {names[1]} {b.shape} and mask {mask.shape} must be one "
                         f"[batch, seq] shape")
    if not mask.any():
        raise ValueError(f"mask selects no token; nothing to {purpose}")
    return a, b, mask


def mismatch_metrics(logp_trainer, logp_engine, mask) -> dict[str, float]:
    """All token/sequence mismatch metrics for logprobs [batch, seq] and a validity mask [batch, seq]."""
    lt, le, mask = paired_logprobs(logp_trainer, logp_engine, mask)
    m = np.clip(lt - le, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    rho = np.exp(m)
    seq_valid = mask.any(axis=1)
    seq_log_rho = np.sum(np.where(mask, m, 0.0), axis=1)
    seq_rho = np.exp(np.clip(seq_log_rho, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    mean_lt = _masked_mean(lt, mask, axis=1)[seq_valid]
    mean_le = _masked_mean(le, mask, axis=1)[seq_valid]
    abs_diff = np.abs(lt - le)[mask]
    return {
        "kl": float(_masked_mean(le - lt, mask)),
        "k2_kl": float(_masked_mean(0.5 * m * m, mask)),
        "k3_kl": float(_masked_mean(rho - 1.0 - m, mask)),
        "chi2_token": float(_masked_mean(rho * rho, mask) - 1.0),
        "chi2_seq": float(np.mean(seq_rho[seq_valid] ** 2) - 1.0),
        "training_ppl": float(np.mean(np.exp(-mean_lt))),
        "rollout_ppl": float(np.mean(np.exp(-mean_le))),
        "log_ppl_diff": float(np.mean(mean_le - mean_lt)),
        "log_ppl_abs_diff": float(np.mean(np.abs(mean_le - mean_lt))),
        "ppl_ratio": float(np.mean(np.exp(mean_le - mean_lt))),
        "max_abs_logp_diff": float(abs_diff.max()),
        "mean_abs_logp_diff": float(abs_diff.mean()),
        "prob_diff_mean": float(np.mean(np.abs(np.exp(lt) - np.exp(le))[mask])),
        "extreme_frac_tau2": float(np.mean(abs_diff > np.log(2.0))),
        "bitwise_equal_fraction": float(np.mean((np.asarray(logp_trainer) == np.asarray(logp_engine))[mask])),
        "n_tokens": int(mask.sum()),
        "n_sequences": int(seq_valid.sum()),
    }


def _verl_masked_mean(x: np.ndarray, mask: np.ndarray, axis=None) -> np.ndarray:
    """verl's `masked_mean`: sum over the mask (values outside it never read, NaN included) / (count + 1e-8)."""
    return np.sum(np.where(mask, x, 0.0), axis=axis) / (np.sum(mask, axis=axis) + 1e-8)


def verl_offpolicy_metrics(logp_trainer, logp_engine, mask) -> dict[str, float]:
    """verl's `compute_offpolicy_metrics` (rollout_corr_helper.py), names without the `rollout_corr/` prefix.

    Differences from `mismatch_metrics`, all verl's: means divide by (count + 1e-8); sequence figures average
    over every row, rows without a valid token included (their mean log-prob is 0, their ppl 1); `k3_kl` uses
    the unclamped log ratio (only chi2 clamps to +-20)."""
    lt, le, mask = paired_logprobs(logp_trainer, logp_engine, mask)
    with np.errstate(over="ignore", invalid="ignore"):
        m = np.where(mask, lt - le, 0.0)
        mean_lt = _verl_masked_mean(lt, mask, axis=1)
        mean_le = _verl_masked_mean(le, mask, axis=1)
        log_ppl_diff = mean_le - mean_lt
        seq_log_rho = np.clip(np.sum(m, axis=1), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        rho = np.exp(np.clip(m, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        return {
            "training_ppl": float(np.mean(np.exp(-mean_lt))),
            "training_log_ppl": float(np.mean(-mean_lt)),
            "kl": float(_verl_masked_mean(le - lt, mask)),
            "k3_kl": float(_verl_masked_mean(np.exp(m) - m - 1.0, mask)),
            "rollout_ppl": float(np.mean(np.exp(-mean_le))),
            "rollout_log_ppl": float(np.mean(-mean_le)),
            "log_ppl_diff": float(np.mean(log_ppl_diff)),
            "log_ppl_abs_diff": float(np.mean(np.abs(log_ppl_diff))),
            "log_ppl_diff_max": float(np.max(log_ppl_diff)),
            "log_ppl_diff_min": float(np.min(log_ppl_diff)),
            "ppl_ratio": float(np.mean(np.exp(log_ppl_diff))),
            "chi2_token": float(_verl_masked_mean(rho * rho, mask) - 1.0),
            "chi2_seq": float(np.mean(np.exp(2.0 * seq_log_rho)) - 1.0),
        }
