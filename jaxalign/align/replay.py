"""RoutingRecord: which experts each token used, per MoE layer, in top-k slot order.

Layout: `indices` int32 [batch, seq, moe_layers, k], -1 = not routed (padding, or a token never forwarded);
`weights` float32 [batch, seq, moe_layers, k] gate weights; `margins` float32 [batch, seq, moe_layers], the
router's selection-score gap between the k-th and (k+1)-th expert (how close the decision was to flipping).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoutingRecord:
    """Expert choices of a forward pass (see module docstring for the layout)."""

    indices: jax.Array
    weights: jax.Array
    margins: jax.Array
    # DSA models only: the indexer's chosen key positions [batch, seq, layers, index_topk] (-1 = none) and its
    # selection margins [batch, seq, layers]; None otherwise
    index_positions: jax.Array | None = None
    index_margins: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """(batch, seq, moe_layers, k)."""
        return tuple(self.indices.shape)

    def masked(self, valid: jax.Array) -> "RoutingRecord":
        """Entries where `valid` [batch, seq] is False become -1 / 0 / inf."""
        v = jnp.asarray(valid, bool)
        return RoutingRecord(
            indices=jnp.where(v[..., None, None], self.indices, -1),
            weights=jnp.where(v[..., None, None], self.weights, 0.0),
            margins=jnp.where(v[..., None], self.margins, jnp.inf),
        )


def empty_record(batch: int, seq: int, moe_layers: int, k: int) -> RoutingRecord:
    """A record with nothing routed (-1 everywhere)."""
    return RoutingRecord(indices=jnp.full((batch, seq, moe_layers, k), -1, jnp.int32),
                         weights=jnp.zeros((batch, seq, moe_layers, k), jnp.float32),
                         margins=jnp.full((batch, seq, moe_layers), jnp.inf, jnp.float32))


# --- file format -----------------------------------------------------------------------------------------------
FORMAT = "jaxalign-routing-v1"


def save_record(record: RoutingRecord, path, *, config, policy: str = "", source: str = "jaxalign") -> None:
    """Write a record as safetensors (`indices` int32, `weights` f32, `margins` f32) with JSON-able metadata
    (format, layout, config fingerprint, n_experts, top_k, moe_layers, policy, source). See docs/router-replay.md.

    The file is written to a temporary name and renamed, so a failed write never leaves a half-written record.
    """
    tensors = {"indices": np.ascontiguousarray(np.asarray(record.indices, np.int32)),
               "weights": np.ascontiguousarray(np.asarray(record.weights, np.float32)),
               "margins": np.ascontiguousarray(np.asarray(record.margins, np.float32))}
    validate_indices(tensors["indices"], config)
    meta = {"format": FORMAT, "layout": "batch,seq,moe_layers,k", "config_fingerprint": config.fingerprint(),
            "n_experts": str(config.n_experts), "top_k": str(config.top_k),
            "moe_layers": str(config.n_moe_layers), "policy": str(policy), "source": source}
    path = os.fspath(path)
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata=meta)
    os.replace(tmp, path)


def load_record(path, *, config, check_fingerprint: bool = True) -> tuple[RoutingRecord, dict]:
    """Read a record written by `save_record` (or by another stack following docs/router-replay.md) and check
    it fits `config`. `weights`/`margins` are optional in the file. Returns (record, metadata)."""
    with safe_open(str(path), framework="np") as f:
        meta = dict(f.metadata() or {})
        names = set(f.keys())
        if "indices" not in names:
            raise ValueError(f"{path}: no 'indices' tensor; a routing record needs indices [batch, seq, "
                             f"moe_layers, k] int32 (found: {sorted(names)})")
        indices = f.get_tensor("indices")
        weights = f.get_tensor("weights") if "weights" in names else None
        margins = f.get_tensor("margins") if "margins" in names else None
    if meta.get("format", FORMAT) != FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r}; this reader understands {FORMAT!r}")
    if check_fingerprint and "config_fingerprint" in meta and meta["config_fingerprint"] != config.fingerprint():
        raise ValueError(f"{path}: recorded for model config {meta['config_fingerprint']}, but this model is "
                         f"{config.fingerprint()}; a record only replays on the architecture it was made for")
    indices = validate_indices(indices, config)
    weights = np.zeros(indices.shape, np.float32) if weights is None else np.asarray(weights, np.float32)
    margins = np.full(indices.shape[:3], np.inf, np.float32) if margins is None else np.asarray(margins, np.float32)
    if weights.shape != indices.shape or margins.shape != indices.shape[:3]:
        raise ValueError(f"{path}: weights {weights.shape} / margins {margins.shape} do not match indices "
                         f"{indices.shape}")
    return RoutingRecord(indices=indices, weights=weights, margins=margins), meta


def validate_indices(indices, config):
    """Check indices are integer [batch, seq, moe_layers, k] with values in -1..n_experts-1; returns int32."""
    arr = np.asarray(indices)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"routing indices must be integers, got {arr.dtype}")
    if arr.ndim != 4 or arr.shape[2] != config.n_moe_layers or arr.shape[3] != config.top_k:
        raise ValueError(f"routing indices have shape {arr.shape}; expected [batch, seq, {config.n_moe_layers}, "
                         f"{config.top_k}] = [batch, seq, moe_layers, k] for this model")
    if arr.size and (arr.min() < -1 or arr.max() >= config.n_experts):
        raise ValueError(f"routing indices span [{arr.min()}, {arr.max()}]; allowed: -1 (not routed) .. "
                         f"{config.n_experts - 1}")
    return arr.astype(np.int32)


def from_slime(per_sequence, config, seq_len: int | None = None) -> RoutingRecord:
    """Convert slime/SGLang records, one array per sequence of shape (len(tokens) - 1, moe_layers, k) (the last
    sampled token is never forwarded), into a batch record [batch, seq, moe_layers, k] padded with -1."""
    arrays = [np.asarray(a) for a in per_sequence]
    if not arrays:
        raise ValueError("from_slime needs at least one sequence")
    width = seq_len or max(a.shape[0] for a in arrays) + 1
    out = np.full((len(arrays), width, config.n_moe_layers, config.top_k), -1, np.int32)
    for i, a in enumerate(arrays):
        if a.ndim != 3:
            raise ValueError(f"sequence {i}: slime layout is (len(tokens)-1, moe_layers, k), got shape {a.shape}")
        if a.shape[0] + 1 > width:
            raise ValueError(f"sequence {i} has {a.shape[0] + 1} tokens > seq_len {width}")
        out[i, : a.shape[0]] = a
    indices = validate_indices(out, config)
    return RoutingRecord(indices=indices, weights=np.zeros(indices.shape, np.float32),
                         margins=np.full(indices.shape[:3], np.inf, np.float32))


def from_verl(indices, config) -> RoutingRecord:
    """Convert a verl record [batch, seq, moe_layers, k] (often int16) into a RoutingRecord."""
    idx = validate_indices(indices, config)
    return RoutingRecord(indices=idx, weights=np.zeros(idx.shape, np.float32),
                         margins=np.full(idx.shape[:3], np.inf, np.float32))


def to_slime(record: RoutingRecord, lengths) -> list:
    """The inverse of `from_slime`: per sequence, positions 0..len-2 of the record."""
    idx = np.asarray(record.indices)
    return [idx[i, : int(n) - 1] for i, n in enumerate(lengths)]
