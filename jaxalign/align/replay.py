"""Routing record files (safetensors + JSON metadata, docs/router-replay.md) and the slime/verl converters.

The record type itself lives in `jaxalign.model.routing` (re-exported here so old imports work).
"""

from __future__ import annotations

import os

import numpy as np
from safetensors.numpy import save_file

from jaxalign.files import open_safetensors
from jaxalign.model.routing import RoutingRecord, check_expert_indices, index_layers, index_topk

__all__ = ["FORMAT", "FORMATS", "RoutingRecord", "empty_record", "from_slime", "from_verl", "load_record",
           "save_record", "to_slime", "validate_indices"]

# v1: expert ids (+ weights, margins). v2 adds the DSA index selections; a record without them is still v1.
FORMAT_V1 = "jaxalign-routing-v1"
FORMAT = "jaxalign-routing-v2"
FORMATS = (FORMAT_V1, FORMAT)


def empty_record(batch: int, seq: int, moe_layers: int, k: int) -> RoutingRecord:
    """A record with nothing routed (-1 everywhere), no index fields (see `RoutingRecord.empty`)."""
    import jax.numpy as jnp
    return RoutingRecord(indices=jnp.full((batch, seq, moe_layers, k), -1, jnp.int32),
                         weights=jnp.zeros((batch, seq, moe_layers, k), jnp.float32),
                         margins=jnp.full((batch, seq, moe_layers), jnp.inf, jnp.float32))


def validate_indices(indices, config):
    """Check indices are integer [batch, seq, moe_layers, k] with values in -1..n_experts-1; returns int32."""
    return check_expert_indices(np.asarray(indices), config)


def save_record(record: RoutingRecord, path, *, config, policy: str = "", source: str = "jaxalign") -> None:
    """Write a record as safetensors (`indices` int32, `weights` f32, `margins` f32, and for a DSA record
    `index_positions` int32 / `index_margins` f32) with JSON-able metadata (format, layout, config fingerprint,
    n_experts, top_k, moe_layers, [index_topk, index_layers], policy, source). See docs/router-replay.md.

    The file is written to a temporary name and renamed, so a failed write never leaves a half-written record.
    """
    record = record.validate(config)
    tensors = {"indices": record.indices, "weights": record.weights, "margins": record.margins}
    meta = {"format": FORMAT_V1, "layout": "batch,seq,moe_layers,k", "config_fingerprint": config.fingerprint(),
            "n_experts": str(config.n_experts), "top_k": str(config.top_k),
            "moe_layers": str(config.n_moe_layers), "policy": str(policy), "source": source}
    if record.index_positions is not None:
        tensors.update(index_positions=record.index_positions, index_margins=record.index_margins)
        meta.update(format=FORMAT, index_layout="batch,seq,layers,index_topk", index_topk=str(index_topk(config)),
                    index_layers=str(len(index_layers(config))))
    path = os.fspath(path)
    tmp = path + ".tmp"
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, tmp, metadata=meta)
    os.replace(tmp, path)


def load_record(path, *, config, check_fingerprint: bool = True) -> tuple[RoutingRecord, dict]:
    """Read a record written by `save_record` (or by another stack following docs/router-replay.md) and check
    it fits `config`. `weights`/`margins`/`index_margins` are optional in the file; `index_positions` needs
    format v2 and a model with an indexer (DSA, DeepSeek-V4's CSA layers). Returns (record, metadata)."""
    with open_safetensors(str(path)) as f:
        meta = dict(f.metadata() or {})
        names = set(f.keys())
        if "indices" not in names:
            raise ValueError(f"{path}: no 'indices' tensor; a routing record needs indices [batch, seq, "
                             f"moe_layers, k] int32 (found: {sorted(names)})")
        tensors = {name: f.get_tensor(name) for name in names}
    fmt = meta.get("format", FORMAT_V1)
    if fmt not in FORMATS:
        raise ValueError(f"{path}: format {fmt!r}; this reader understands {', '.join(map(repr, FORMATS))}")
    if "index_positions" in tensors and fmt != FORMAT:
        raise ValueError(f"{path}: holds index_positions but says format {fmt!r}; index records are {FORMAT!r}")
    if check_fingerprint and "config_fingerprint" in meta and meta["config_fingerprint"] != config.fingerprint():
        raise ValueError(f"{path}: recorded for model config {meta['config_fingerprint']}, but this model is "
                         f"{config.fingerprint()}; a record only replays on the architecture it was made for")
    try:
        record = RoutingRecord(indices=tensors["indices"], weights=tensors.get("weights"),
                               margins=tensors.get("margins"), index_positions=tensors.get("index_positions"),
                               index_margins=tensors.get("index_margins")).validate(config)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    return record, meta


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
    return from_verl(out, config)


def from_verl(indices, config) -> RoutingRecord:
    """Convert a verl record [batch, seq, moe_layers, k] (often int16) into a RoutingRecord."""
    return RoutingRecord(indices=indices, weights=None, margins=None).validate(config)


def to_slime(record: RoutingRecord, lengths) -> list:
    """The inverse of `from_slime`: per sequence, positions 0..len-2 of the record."""
    idx = np.asarray(record.indices)
    return [idx[i, : int(n) - 1] for i, n in enumerate(lengths)]
