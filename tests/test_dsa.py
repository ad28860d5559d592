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
    with pytest.raises(ValueError, match=r"expected \(1, 4, 3, 6\) = \[batch, seq, index_layers, index_topk\]"):
        ja.token_logprobs(build_model("tiny-glm5"), tokens, ja.NumericPolicy.preset("fp32"),
                          index_replay=np.zeros((1, 4, 3, 5), np.int32))
    with pytest.raises(ValueError, match="has no indexer"):
        ja.token_logprobs(build_model("tiny-deepseek-v3"), tokens, ja.NumericPolicy.preset("fp32"),
                          index_replay=np.zeros((1, 4, 3, 6), np.int32))


# McIlroy's antiqsort adversary run against libstdc++'s introselect (nth = k - 1), values around the k-th merged
# into ties: each row runs the introselect out of depth (its heap fallback) and ties at the top-k boundary.
HOSTILE_ROWS = [
    (12, [33, 28, 23, 26, 24, 20, 34, 22, 35, 21, 36, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0, 37, 19, 25, 17, 29, 15, 31,
          13, 28, 11, 32, 9, 30, 7, 38, 5, 39, 3, 1]),
    (6, [36, 23, 20, 21, 37, 38, 22, 25, 24, 27, 26, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0, 29, 19, 28, 17, 31, 15, 30,
         13, 34, 11, 32, 9, 35, 7, 34, 5, 39, 3, 1]),
    (12, [2, 27, 23, 26, 24, 21, 28, 22, 18, 16, 14, 12, 10, 8, 6, 4, 0, 17, 29, 15, 30, 13, 25, 11, 31, 9, 32, 7, 19,
          5, 21, 3, 1]),
    (12, [49, 31, 27, 30, 28, 24, 58, 26, 59, 25, 60, 61, 29, 33, 35, 32, 36, 34, 38, 40, 37, 22, 20, 18, 16, 14, 12,
          10, 8, 6, 4, 2, 0, 53, 55, 52, 56, 54, 62, 63, 57, 41, 23, 39, 21, 43, 19, 45, 17, 42, 15, 46, 13, 44, 11,
          48, 9, 50, 7, 47, 5, 52, 3, 1]),
    (20, [38, 28, 33, 30, 25, 32, 28, 29, 26, 20, 39, 24, 40, 23, 41, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0, 42, 35, 43,
          44, 22, 19, 45, 17, 21, 15, 46, 13, 47, 11, 34, 9, 37, 7, 31, 5, 36, 3, 1]),
]


def _tied_rows(rng, count: int) -> list[tuple[np.ndarray, int]]:
    """(row, k) pairs full of exact ties (about half tie at the top-k boundary), of many shapes: all-zero rows,
    a few small integers, relu-like rows (half zeros), visible keys then masked ones (-inf, or transformers'
    float mask: finfo.min), NaN / +-0 / +-inf mixes, sorted either way, k = n (rows no longer than the top-k),
    and rows long enough for torch's partial-sort path (k * 64 <= n)."""
    out = []
    for i in range(count):
        n = int(rng.choice([1, 2, 3, 4, 5, 9, 13, 17, 24, 33, 40, 64, 129])) if i % 8 else int(rng.integers(128, 201))
        kind = i % 9
        if kind == 0:
            x = np.zeros(n)
        elif kind in (1, 2):
            x = rng.integers(0, 3, n).astype(float)
        elif kind == 3:
            x = np.where(rng.random(n) < 0.5, 0.0, rng.normal(size=n))
        elif kind == 4:
            x = rng.integers(0, 3, n).astype(float)
            x[rng.integers(1, n + 1):] = -np.inf if i % 2 else np.finfo(np.float32).min
        elif kind == 5:
            x = rng.choice([0.0, -0.0, 1.0, np.nan, -np.inf, np.inf], n)
        elif kind == 6:
            x = np.sort(rng.integers(0, 4, n).astype(float))[:: 1 if i % 2 else -1]
        elif kind == 7:
            x = rng.integers(0, 2, n) * rng.choice([1.0, 0.25], n)
        else:
            x = np.zeros(n)
            x[rng.integers(0, n)] = 1.0
        k = n if i % 5 == 0 else int(rng.choice([1, 2, 6, 12, 20])) if i % 3 else int(rng.integers(1, n + 1))
        out.append((x.astype(np.float32), min(k, n)))
    return out


def test_torch_cpu_ties_keep_exactly_the_keys_torch_topk_keeps():
    """`index_ties=torch-cpu` (numerics/torch_topk.py) against torch.topk on the CPU itself, over a few hundred
    rows tied at the top-k boundary (and the hostile rows above): the same kept set in every row. lax.top_k's
    order (lower-slot) keeps another set in many of them, and the hostile rows do take libstdc++'s heap code."""
    torch = pytest.importorskip("torch")
    import jax
    import jax.numpy as jnp

    from jaxalign.numerics.torch_topk import arrangement
    rows = _tied_rows(np.random.default_rng(0), 400)
    rows += [(np.asarray(x, np.float32), k) for k, x in HOSTILE_ROWS]
    width = max(len(x) for x, _ in rows)
    x = np.full((len(rows), width), 5.0, np.float32)  # past a row's length: not part of it
    for i, (row, _) in enumerate(rows):
        x[i, :len(row)] = row
    k = np.array([k for _, k in rows], np.int32)
    n = np.array([len(row) for row, _ in rows], np.int32)
    perm, heap = (np.asarray(a) for a in jax.jit(arrangement)(jnp.asarray(x), jnp.asarray(k), jnp.asarray(n)))
    differs_from_lower_slot = 0
    for i, (row, top) in enumerate(rows):
        theirs = set(torch.tensor(row).topk(top).indices.tolist())
        assert set(perm[i, :top].tolist()) == theirs, (i, row.tolist(), top)
        order = sorted(range(len(row)), key=lambda j: (not np.isnan(row[j]), -np.nan_to_num(row[j], nan=0.0), j))
        differs_from_lower_slot += set(order[:top]) != theirs
    assert differs_from_lower_slot > 100
    assert heap[-len(HOSTILE_ROWS):].all()
    assert (heap & (k * 64 <= n)).sum() >= 10  # and the partial-sort path


def test_torch_cpu_selection_in_select_keys_follows_the_rows_torch_sees():
    """select_keys under torch-cpu: a query's keys are what torch.topk keeps from the row transformers' indexer
    builds (its scores, -inf past the query) over the first `row_len` slots -- the whole sequence in a forward,
    the tokens so far in a cached decode step -- and the other slots are never picked; the record lists visible
    keys (-1 after them) and the margins are lower-slot's."""
    torch = pytest.importorskip("torch")
    import jax
    import jax.numpy as jnp

    from jaxalign.numerics.indexer import select_keys, torch_row_len
    rng = np.random.default_rng(1)
    b, s, t, top = 3, 20, 24, 6
    raw = np.where(rng.random((b, s, t)) < 0.6, 0.0, rng.integers(1, 3, (b, s, t))).astype(np.float32)
    q_pos = np.broadcast_to(np.arange(s), (b, s))
    k_pos = np.broadcast_to(np.arange(t), (b, t))
    scores = np.where(k_pos[:, None, :] <= q_pos[:, :, None], raw, -np.inf).astype(np.float32)
    valid = q_pos < np.array([20, 13, 7])[:, None]  # each batch row's call ends at another position
    row_len = np.asarray(torch_row_len(jnp.asarray(q_pos), jnp.asarray(k_pos), jnp.asarray(valid)))
    assert row_len.tolist() == [20, 13, 7]
    select = jax.jit(select_keys, static_argnums=(2, 3))
    positions, allowed, margin = (np.asarray(a) for a in select(
        jnp.asarray(scores), jnp.asarray(k_pos), top, "torch-cpu", jnp.asarray(row_len)))
    lower = [np.asarray(a) for a in select(jnp.asarray(scores), jnp.asarray(k_pos), top, "lower-slot")]
    np.testing.assert_array_equal(margin, lower[2])
    flips = 0
    for i in range(b):
        for q in range(s):
            row = torch.tensor(scores[i, q, :row_len[i]])
            theirs = {j for j in row.topk(min(top, row_len[i])).indices.tolist() if j <= q}
            mine = positions[i, q]
            assert set(mine[mine >= 0].tolist()) == theirs and (mine[:len(theirs)] >= 0).all()
            assert set(np.flatnonzero(allowed[i, q]).tolist()) == theirs
            flips += theirs != set(np.flatnonzero(lower[1][i, q]).tolist())
    assert flips > 5
    with pytest.raises(ValueError, match="allowed: lower-slot, torch-cpu"):
        select_keys(jnp.asarray(scores), jnp.asarray(k_pos), top, "higher-slot")
