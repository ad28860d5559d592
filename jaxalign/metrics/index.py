"""DSA index metrics: how many of the keys the engine's indexer picked the trainer's did not pick, per layer,
and how close the selections were to flipping (like route flips and router margins)."""

from __future__ import annotations

import numpy as np


def index_flip_metrics(positions_a, positions_b, valid=None, margins_a=None) -> dict:
    """Compare DSA selections [batch, seq, layers, index_topk] (key positions, -1 = none) of two passes.

    `index_flip_rate`: fraction of side a's selected keys missing from side b's set, over tokens in `valid`
    [batch, seq] (default all); `per_layer`: the same per layer; `row_any_flip`: fraction of token x layer sets
    that differ; with `margins_a` [batch, seq, layers], `median_margin` of side a's finite margins and
    `flipped_median_margin` over the rows that flipped."""
    a, b = np.asarray(positions_a), np.asarray(positions_b)
    if a.shape != b.shape:
        raise ValueError(f"index selections differ in shape: {a.shape} vs {b.shape}")
    keep = np.ones(a.shape[:2], bool) if valid is None else np.asarray(valid, bool)
    in_b = (a[..., :, None] == b[..., None, :]).any(-1)  # [B, S, L, k]
    chosen = (a >= 0) & keep[..., None, None]
    missing = chosen & ~in_b
    per_layer = missing.sum((0, 1, 3)) / np.maximum(chosen.sum((0, 1, 3)), 1)
    row_flip = missing.any(-1)
    rows = keep[..., None] & chosen.any(-1)
    out = {"index_flip_rate": float(missing.sum() / max(chosen.sum(), 1)),
           "index_flip_rate_per_layer": [float(x) for x in per_layer],
           "index_row_any_flip": float(row_flip[rows].mean()) if rows.any() else 0.0}
    if margins_a is not None:
        m = np.asarray(margins_a)
        finite = rows & np.isfinite(m)
        out["median_margin"] = float(np.median(m[finite])) if finite.any() else float("nan")
        flipped = finite & row_flip
        out["flipped_median_margin"] = float(np.median(m[flipped])) if flipped.any() else float("nan")
    return out
