"""Mismatch and routing metrics on hand-made inputs."""

import numpy as np
import pytest

from jaxalign.metrics.mismatch import mismatch_metrics
from jaxalign.metrics.routing import routing_metrics


def test_mismatch_metrics_match_definitions():
    lt = np.array([[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0]])
    le = np.array([[-1.1, -1.8, -0.5], [-0.3, -1.0, -9.0]])
    mask = np.array([[True, True, True], [True, True, False]])
    m = (lt - le)[mask]
    out = mismatch_metrics(lt, le, mask)
    assert out["kl"] == pytest.approx(np.mean(-m))
    assert out["k3_kl"] == pytest.approx(np.mean(np.exp(m) - 1 - m))
    assert out["k2_kl"] == pytest.approx(np.mean(m * m / 2))
    assert out["chi2_token"] == pytest.approx(np.mean(np.exp(2 * m)) - 1)
    seq = [np.sum((lt - le)[0]), np.sum((lt - le)[1, :2])]
    assert out["chi2_seq"] == pytest.approx(np.mean(np.exp(2 * np.array(seq))) - 1)
    ppl_t = [np.exp(-np.mean(lt[0])), np.exp(-np.mean(lt[1, :2]))]
    ppl_e = [np.exp(-np.mean(le[0])), np.exp(-np.mean(le[1, :2]))]
    assert out["training_ppl"] == pytest.approx(np.mean(ppl_t))
    assert out["rollout_ppl"] == pytest.approx(np.mean(ppl_e))
    assert out["ppl_ratio"] == pytest.approx(np.mean(np.array(ppl_t) / np.array(ppl_e)))
    assert out["max_abs_logp_diff"] == pytest.approx(0.2)
    assert out["bitwise_equal_fraction"] == pytest.approx(2 / 5)
    assert out["extreme_frac_tau2"] == 0.0 and out["n_tokens"] == 5
    # identical inputs: every estimator is exactly zero
    same = mismatch_metrics(lt, lt, mask)
    assert same["k3_kl"] == 0.0 and same["kl"] == 0.0 and same["max_abs_logp_diff"] == 0.0
    assert same["bitwise_equal_fraction"] == 1.0


def test_log_ratios_are_clamped():
    out = mismatch_metrics(np.array([[0.0]]), np.array([[-100.0]]), np.array([[True]]))
    assert out["k3_kl"] == pytest.approx(np.exp(20.0) - 21.0)
    with pytest.raises(ValueError, match="no token"):
        mismatch_metrics(np.zeros((1, 2)), np.zeros((1, 2)), np.zeros((1, 2), bool))


def test_routing_metrics():
    a = np.array([[[[0, 1]], [[2, 3]], [[4, 5]], [[-1, -1]]]])  # [1, 4, 1, 2]
    b = np.array([[[[1, 0]], [[2, 7]], [[4, 5]], [[-1, -1]]]])
    margins = np.array([[[0.5], [1e-5], [0.2], [np.inf]]])
    out = routing_metrics(a, b, margins_a=margins)
    assert out["n_decisions"] == 3
    assert out["route_flip_rate"] == pytest.approx(1 / 3)  # token 1: {2,3} vs {2,7}
    assert out["route_slot_order_diff_rate"] == pytest.approx(1 / 3)  # token 0: same set, other order
    assert out["route_token_any_flip"] == pytest.approx(1 / 3)
    tie_bin = [b for b in out["flip_by_margin"] if b["margin_lo"] == 0.0][0]
    assert tie_bin["decisions"] == 1 and tie_bin["flip_probability"] == 1.0
