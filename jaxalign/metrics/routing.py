"""Routing agreement between two RoutingRecords of the same tokens: flip rates, slot order, near ties."""

from __future__ import annotations

import numpy as np

MARGIN_BINS = (0.0, 1e-4, 1e-3, 1e-2, 1e-1, np.inf)


def routing_metrics(indices_a, indices_b, valid=None, margins_a=None) -> dict:
    """Compare expert indices [batch, seq, layers, k] of two passes over the same tokens.

    A *flip* is a token x layer decision whose expert set differs. `valid` [batch, seq] selects tokens that were
    routed on both sides (default: no -1 on either side). `margins_a` [batch, seq, layers] (side a's gap
    between the k-th and (k+1)-th score) gives flip probability by margin bin.
    """
    a = np.asarray(indices_a)
    b = np.asarray(indices_b)
    if a.shape != b.shape:
        raise ValueError(f"routing records differ in shape: {a.shape} vs {b.shape}")
    routed = (a >= 0).all(-1) & (b >= 0).all(-1)  # [batch, seq, layers]
    if valid is not None:
        routed &= np.asarray(valid, bool)[..., None]
    n = int(routed.sum())
    if n == 0:
        raise ValueError("no routed token is present in both records")
    set_differs = np.any(np.sort(a, -1) != np.sort(b, -1), axis=-1)
    order_differs = np.any(a != b, axis=-1) & ~set_differs
    token_routed = routed.any(-1)
    out = {
        "route_flip_rate": float(set_differs[routed].mean()),
        "route_token_any_flip": float((set_differs & routed).any(-1)[token_routed].mean()),
        "route_slot_order_diff_rate": float(order_differs[routed].mean()),
        "route_flip_rate_per_layer": [float(set_differs[..., i][routed[..., i]].mean())
                                      for i in range(a.shape[2])],
        "n_decisions": n,
    }
    if margins_a is not None:
        margins = np.asarray(margins_a)[routed]
        flips = set_differs[routed]
        bins = []
        for lo, hi in zip(MARGIN_BINS[:-1], MARGIN_BINS[1:]):
            sel = (margins >= lo) & (margins < hi)
            bins.append({"margin_lo": lo, "margin_hi": hi, "decisions": int(sel.sum()),
                         "flip_probability": float(flips[sel].mean()) if sel.any() else None})
        out["flip_by_margin"] = bins
    return out
