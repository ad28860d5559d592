"""The numerics/staleness split on arrays (`jaxalign.metrics.staleness`), against float64 numpy by hand."""

import numpy as np
import pytest

from jaxalign.metrics.staleness import split_log_ratios, split_metrics, split_summary


def _case():
    rng = np.random.default_rng(0)
    engine = np.log(rng.uniform(0.05, 1.0, (3, 5))).astype(np.float32)
    behaviour = (engine + 0.01 * rng.standard_normal((3, 5))).astype(np.float32)
    current = (behaviour + 0.1 * rng.standard_normal((3, 5))).astype(np.float32)
    mask = np.arange(5)[None, :] < np.array([[5], [2], [0]])
    return current, behaviour, engine, mask


def test_split_parts_shares_and_exact_zeros():
    current, behaviour, engine, mask = _case()
    m = split_metrics(current, behaviour, engine, mask)
    c, b, e = (x.astype(np.float64)[mask] for x in (current, behaviour, engine))
    n, s = b - e, c - b
    assert m["numerics/k3_kl"] == pytest.approx(np.mean(np.exp(n) - 1 - n), rel=1e-12)
    assert m["staleness/k3_kl"] == pytest.approx(np.mean(np.exp(s) - 1 - s), rel=1e-12)
    assert m["numerics/kl"] == pytest.approx(np.mean(e - b), rel=1e-12)
    assert m["staleness/max_abs_logp_diff"] == np.abs(s).max()
    share = np.abs(n).sum() / (np.abs(n).sum() + np.abs(s).sum())
    assert m["numerics/share"] == pytest.approx(share, rel=1e-12)
    assert m["numerics/share"] + m["staleness/share"] == pytest.approx(1.0, rel=1e-15)
    ratios = split_log_ratios(current, behaviour, engine, mask)
    assert (ratios["total"][~mask] == 0).all()
    np.testing.assert_allclose(ratios["numerics"] + ratios["staleness"], ratios["total"], rtol=0, atol=1e-15)
    # lag 0 (behaviour = current) and an aligned engine (engine = behaviour): exact zeros, shares 0 when both are
    zero = split_metrics(engine, engine, engine, mask)
    assert all(v == 0.0 for v in zero.values())
    stale_only = split_metrics(current, engine, engine, mask)
    assert stale_only["numerics/k3_kl"] == 0.0 and stale_only["staleness/share"] == 1.0


def test_split_summary_and_bad_input():
    current, behaviour, engine, mask = _case()
    row = split_metrics(current, behaviour, engine, mask)
    summary = split_summary([{"step": 0}, row, split_metrics(engine, engine, engine, mask)])
    assert summary["staleness/mean_k3"] == pytest.approx(row["staleness/k3_kl"] / 2)
    assert summary["numerics/max_k3"] == row["numerics/k3_kl"]
    assert split_summary([{"step": 0}]) == {}
    with pytest.raises(ValueError, match="one"):
        split_metrics(current, behaviour[:, :4], engine, mask)
    with pytest.raises(ValueError, match="no token"):
        split_metrics(current, behaviour, engine, np.zeros_like(mask))
