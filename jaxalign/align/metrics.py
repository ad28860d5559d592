"""Trainer-engine mismatch metrics on sampled tokens, with verl's names (`rollout_corr/...` there).

m = logp_trainer - logp_engine per valid token. Estimators of KL(engine || trainer): k1 = -m, k2 = m^2/2,
k3 = exp(m) - 1 - m (>= 0). Sequence-level figures average per-sequence values over sequences.
"""

from __future__ import annotations

import numpy as np

LOG_RATIO_CLAMP = 20.0


def _masked_mean(x: np.ndarray, mask: np.ndarray, axis=None) -> np.ndarray:
    return np.sum(np.where(mask, x, 0.0), axis=axis) / np.maximum(np.sum(mask, axis=axis), 1)


def mismatch_metrics(logp_trainer, logp_engine, mask) -> dict[str, float]:
    """All token/sequence mismatch metrics for logprobs [batch, seq] and a validity mask [batch, seq]."""
    lt = np.asarray(logp_trainer, np.float64)
    le = np.asarray(logp_engine, np.float64)
    mask = np.asarray(mask, bool)
    if lt.shape != le.shape or lt.shape != mask.shape:
        raise ValueError(f"logp_trainer {lt.shape}, logp_engine {le.shape} and mask {mask.shape} must match")
    if not mask.any():
        raise ValueError("mask selects no token; nothing to compare")
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
