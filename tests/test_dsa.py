"""DSA index metrics and the index replay input's checks."""

import numpy as np
import pytest

import jaxalign as ja
from jaxalign.metrics.index import index_flip_metrics

from conftest import build_model


def test_index_flip_metrics_count_missing_keys_per_layer():
    a = np.array([[[[0, 1, 2], [0, 1, -1]], [[3, 4, 5], [1, 2, 3]]]])  # [1, 2 tokens, 2 layers, 3]
    b = np.array([[[[2, 1, 0], [0, 1, -1]], [[3, 4, 6], [1, 2, 0]]]])
    margins = np.array([[[0.5, np.inf], [0.01, 0.02]]])
    out = index_flip_metrics(a, b, margins_a=margins)
    assert out["index_flip_rate"] == pytest.approx(2 / 11)
    assert out["index_flip_rate_per_layer"] == pytest.approx([1 / 6, 1 / 5])
    assert out["index_row_any_flip"] == pytest.approx(2 / 4)
    assert out["flipped_median_margin"] == pytest.approx(0.015)
    assert index_flip_metrics(a, a)["index_flip_rate"] == 0.0
    with pytest.raises(ValueError, match="differ in shape"):
        index_flip_metrics(a, b[..., :2])


def test_index_replay_input_is_checked():
    tokens = np.zeros((1, 4), np.int32)
    with pytest.raises(ValueError, match=r"expected \(1, 4, 3, 6\) = \[batch, seq, layers, index_topk\]"):
        ja.token_logprobs(build_model("tiny-glm5"), tokens, ja.NumericPolicy.preset("fp32"),
                          index_replay=np.zeros((1, 4, 3, 5), np.int32))
    with pytest.raises(ValueError, match="no DSA indexer"):
        ja.token_logprobs(build_model("tiny-deepseek-v3"), tokens, ja.NumericPolicy.preset("fp32"),
                          index_replay=np.zeros((1, 4, 3, 6), np.int32))
