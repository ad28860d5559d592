"""The DeepSeek sparse attention (DSA) indexer's scores and top-k under a NumericPolicy.

index score(query, key) = sum_h w_h * relu(scale * q_h . k), w = weights_proj(x) * n_heads ** -0.5, in
`index_scores_dtype` (products accumulated in float32, rounded to that dtype after the dot, the scale, the
head weighting and the head sum). Invisible keys (position > the query's) score -inf. The top-k follows
`lax.top_k` exactly (IEEE total order, ties to the lower slot; `index_ties=lower-slot`), so trainer and engine
pick the same keys from the same scores whatever their number of slots. Under `index_ties=torch-cpu` the keys
kept at an exact tie are those `torch.topk` keeps on the CPU (`jaxalign.numerics.torch_topk`): what transformers'
indexer selects, at the price of that invariance (torch's choice depends on the length of the row it is given).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxalign.numerics import precision
from jaxalign.numerics.dtypes import cast
from jaxalign.numerics.policy import NumericPolicy
from jaxalign.numerics.select import top_k  # the router's rank-based lax.top_k
from jaxalign.numerics.torch_topk import members as torch_cpu_members


def _sequential(a: jax.Array, b: jax.Array, axis_a: int, axis_b: int):
    """sum_d a[.., d] * b[.., d] as a fixed sequential loop (the same order for every query and key count)."""
    total = None
    for d in range(a.shape[axis_a]):
        term = jnp.take(a, d, axis=axis_a) * jnp.take(b, d, axis=axis_b)
        total = term if total is None else total + term
    return total


def index_scores(q: jax.Array, k: jax.Array, weights: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
                 policy: NumericPolicy) -> jax.Array:
    """q [B, S, H, D], k [B, T, D], weights [B, S, H] (the head weights, already scaled), positions q_pos [B, S],
    k_pos [B, T]. Returns the index scores [B, S, T] in float32 (values of `index_scores_dtype`), -inf where a
    key is not visible."""
    dt = policy.index_scores_dtype
    scale = jnp.float32(q.shape[-1] ** -0.5)
    qf, kf = cast(q, dt).astype(jnp.float32), cast(k, dt).astype(jnp.float32)
    if policy.tree_reduction:
        dots = _sequential(qf[:, :, :, None, :], kf[:, None, None, :, :], 4, 4)  # [B, S, H, T]
    else:
        dots = precision.einsum("bshd,btd->bsht", qf, kf, policy)
    per_head = cast(jnp.maximum(cast(cast(dots, dt).astype(jnp.float32) * scale, dt), 0), dt).astype(jnp.float32)
    w = cast(weights, dt).astype(jnp.float32)
    if policy.tree_reduction:
        summed = _sequential(w[..., None], per_head, 2, 2)
    else:
        summed = precision.einsum("bsh,bsht->bst", w, per_head, policy)
    scores = cast(summed, dt).astype(jnp.float32)
    visible = k_pos[:, None, :] <= q_pos[:, :, None]
    return jnp.where(visible, scores, -jnp.inf)


def torch_row_len(positions: jax.Array, k_pos: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """The length [B] of the row transformers' indexer runs torch.topk over in a call whose queries sit at
    `positions` [B, S] (`valid` [B, S]: the real ones; None = all) over key slots at `k_pos` [B, T]: every slot up
    to the last real query's position (its cache after the call: the whole sequence in a forward, the tokens so
    far in a cached decode step). A row without a real query keeps all T slots."""
    last = jnp.max(positions if valid is None else jnp.where(valid, positions, -1), axis=1)  # [B]
    length = jnp.sum(k_pos <= last[:, None], axis=1, dtype=jnp.int32)
    return jnp.where(last >= 0, length, k_pos.shape[1]).astype(jnp.int32)


def select_keys(scores: jax.Array, k_pos: jax.Array, top: int, ties: str = "lower-slot",
                row_len: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The `top` best keys of scores [B, S, T], exact ties broken as `ties` (a NumericPolicy's `index_ties`) says.

    lower-slot: `lax.top_k`'s order and ties. torch-cpu: the keys `torch.topk(row, min(top, len(row)))` keeps
    on the CPU, where a query's row is the first `row_len[b]` slots (default all T; see `torch_row_len`), listed
    in lax.top_k's order (torch's order inside the kept set is not reproduced: nothing reads it).

    Returns (positions [B, S, top] of the selected visible keys, -1 where fewer than `top` are visible;
    allowed [B, S, T] bool, the keys a query attends to; margin [B, S], the score gap between the last selected
    and the best unselected visible key (inf when every visible key is selected; the same under both ties))."""
    if ties not in ("lower-slot", "torch-cpu"):
        raise ValueError(f"index ties {ties!r}; allowed: lower-slot, torch-cpu")
    n_keys = scores.shape[-1]
    requested, top = top, min(top, n_keys)
    b, s, _ = scores.shape
    flat = scores.reshape(b * s, n_keys)
    values, slots = top_k(flat, min(top + 1, n_keys))
    values, slots = values.reshape(b, s, -1), slots.reshape(b, s, -1)
    chosen_values, chosen = values[..., :top], slots[..., :top]
    if ties == "torch-cpu":
        length = jnp.full((b,), n_keys, jnp.int32) if row_len is None else row_len.astype(jnp.int32)
        length = jnp.repeat(length, s)  # [B * S]
        kept = torch_cpu_members(flat, jnp.minimum(requested, length), length)
        chosen_values, chosen = top_k(jnp.where(kept, flat, -jnp.inf), top)  # kept keys first, lax's order
        chosen_values, chosen = chosen_values.reshape(b, s, top), chosen.reshape(b, s, top)
    visible = jnp.isfinite(chosen_values)
    positions = jnp.where(visible, jnp.take_along_axis(k_pos[:, None, :], chosen, axis=-1), -1)
    allowed = jnp.zeros(scores.shape, bool).at[
        jnp.arange(b)[:, None, None], jnp.arange(s)[None, :, None], chosen].set(visible)
    if values.shape[-1] > top:
        runner_up = values[..., top]
        margin = jnp.where(jnp.isfinite(runner_up), values[..., top - 1] - runner_up, jnp.inf)
    else:
        margin = jnp.full((b, s), jnp.inf, jnp.float32)
    if requested > top:  # fewer keys than the record's width: the rest are "none"
        positions = jnp.pad(positions, ((0, 0), (0, 0), (0, requested - top)), constant_values=-1)
    return positions.astype(jnp.int32), allowed, margin


def replayed_keys(replay: jax.Array, k_pos: jax.Array, allowed: jax.Array) -> jax.Array:
    """Index replay: replay [B, S, top] recorded key positions (-1 = none). A query whose first entry is >= 0
    attends to exactly the recorded keys; others keep `allowed` (their own selection)."""
    recorded = jnp.any((k_pos[:, None, :, None] == replay[:, :, None, :]) & (replay[:, :, None, :] >= 0), axis=-1)
    use = replay[..., :1] >= 0
    return jnp.where(use, recorded, allowed)
