"""RoutingRecord: the top-k decisions of a forward pass -- which experts each token used per MoE layer and, for
DSA models, which keys the indexer chose per layer. One type for the model, the engine's decode loops, the
Rollout, the trainer's replay and the record files (`jaxalign.align.replay`).

Layout: `indices` int32 [batch, seq, moe_layers, k] in top-k slot order, -1 = not routed (padding, or a token
never forwarded); `weights` float32 [batch, seq, moe_layers, k] the combine weights the pass used; `margins`
float32 [batch, seq, moe_layers], the router's selection-score gap between the k-th and (k+1)-th expert (how
close the decision was to flipping). Models with an indexer (DSA on every layer, DeepSeek-V4's CSA layers) also
carry `index_positions` int32 [batch, seq, index_layers, index_topk], the key (or compressed entry) positions each
query attended to (-1 = none: fewer visible keys, or not forwarded), and `index_margins` float32 [batch, seq,
index_layers]; both are None for other models. `index_layers` are the layers whose kind selects
(`index_layers(config)`), in layer order.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxalign.model import kinds
from jaxalign.model.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoutingRecord:
    """Expert (and indexer) choices of a forward pass (see the module docstring for the layout)."""

    indices: jax.Array
    weights: jax.Array
    margins: jax.Array
    index_positions: jax.Array | None = None
    index_margins: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """(batch, seq, moe_layers, k)."""
        return tuple(self.indices.shape)

    @classmethod
    def empty(cls, config: ModelConfig, batch: int, seq: int) -> "RoutingRecord":
        """A record with nothing routed (-1 / 0 / inf everywhere); with index fields iff the model has an indexer."""
        shape = (batch, seq, config.n_moe_layers, config.top_k)
        index_positions = index_margins = None
        if index_layers(config):
            index_positions = jnp.full(index_replay_shape(config, batch, seq), -1, jnp.int32)
            index_margins = jnp.full((batch, seq, len(index_layers(config))), jnp.inf, jnp.float32)
        return cls(indices=jnp.full(shape, -1, jnp.int32), weights=jnp.zeros(shape, jnp.float32),
                   margins=jnp.full(shape[:3], jnp.inf, jnp.float32), index_positions=index_positions,
                   index_margins=index_margins)

    def masked(self, valid: jax.Array) -> "RoutingRecord":
        """Entries where `valid` [batch, seq] is False become -1 / 0 / inf."""
        v = jnp.asarray(valid, bool)
        return RoutingRecord(
            indices=jnp.where(v[..., None, None], self.indices, -1),
            weights=jnp.where(v[..., None, None], self.weights, 0.0),
            margins=jnp.where(v[..., None], self.margins, jnp.inf),
            index_positions=(None if self.index_positions is None
                             else jnp.where(v[..., None, None], self.index_positions, -1)),
            index_margins=None if self.index_margins is None else jnp.where(v[..., None], self.index_margins, jnp.inf))

    def written(self, update: "RoutingRecord", rows: jax.Array, positions: jax.Array) -> "RoutingRecord":
        """This record [R, M, ...] with a forward's record [B, T, ...] scattered in at (rows [B, 1], positions
        [B, T]); writes to an out-of-range row or position are dropped."""
        return jax.tree.map(lambda buf, new: buf.at[rows, positions].set(new.astype(buf.dtype), mode="drop"),
                            self, update)

    def rows(self, rows, seq: int | None = None) -> "RoutingRecord":
        """Host copy of some rows (in the given order), optionally cut to the first `seq` positions."""
        return jax.tree.map(lambda a: np.asarray(a)[np.asarray(rows), :seq], self)

    def validate(self, config: ModelConfig, batch: int | None = None, seq: int | None = None) -> "RoutingRecord":
        """Check the record fits `config` (and [batch, seq] if given): shapes, dtypes, expert ids in
        -1..n_experts-1, index positions in -1..seq-1 and never after their query. Returns a host copy with
        int32 ids and float32 weights/margins; missing weights become 0, missing margins inf."""
        indices = check_expert_indices(self.indices, config, batch, seq)
        weights = np.zeros(indices.shape, np.float32) if self.weights is None else np.asarray(self.weights, np.float32)
        margins = (np.full(indices.shape[:3], np.inf, np.float32) if self.margins is None
                   else np.asarray(self.margins, np.float32))
        if weights.shape != indices.shape or margins.shape != indices.shape[:3]:
            raise ValueError(f"routing weights {weights.shape} / margins {margins.shape} do not match indices "
                             f"{indices.shape}: expected weights {indices.shape} and margins {indices.shape[:3]}")
        positions = index_margins = None
        if self.index_positions is not None:
            positions = check_index_positions(self.index_positions, config, *indices.shape[:2])
            index_margins = (np.full(positions.shape[:3], np.inf, np.float32) if self.index_margins is None
                             else np.asarray(self.index_margins, np.float32))
            if index_margins.shape != positions.shape[:3]:
                raise ValueError(f"index margins have shape {index_margins.shape}; expected {positions.shape[:3]} "
                                 f"= [batch, seq, index_layers]")
        return RoutingRecord(indices=indices, weights=weights, margins=margins, index_positions=positions,
                             index_margins=index_margins)


def replay_shape(config: ModelConfig, batch: int, seq: int) -> tuple[int, int, int, int]:
    """The shape of expert-replay indices for [batch, seq] tokens."""
    return (batch, seq, config.n_moe_layers, config.top_k)


def index_layers(config: ModelConfig) -> tuple[int, ...]:
    """The layers whose kind selects keys by an indexer (`LayerKind.index_topk` > 0: every layer under DSA,
    the CSA layers of DeepSeek-V4), in layer order: the third axis of index records and index replay."""
    return tuple(i for i in range(config.n_layers) if kinds.kind_of(config, i).index_topk(config))


def index_topk(config: ModelConfig) -> int:
    """Keys (or entries) each indexing layer selects per query; 0 when the model has no indexer."""
    sizes = {kinds.kind_of(config, i).index_topk(config) for i in index_layers(config)}
    if len(sizes) > 1:
        raise ValueError(f"the indexing layers {index_layers(config)} select {sorted(sizes)} entries; a routing "
                         f"record holds one index_topk for all of them")
    return sizes.pop() if sizes else 0


def index_replay_shape(config: ModelConfig, batch: int, seq: int) -> tuple[int, int, int, int]:
    """The shape of index-replay positions for [batch, seq] tokens: [batch, seq, index_layers, index_topk]."""
    return (batch, seq, len(index_layers(config)), index_topk(config))


def check_expert_indices(indices, config: ModelConfig, batch: int | None = None, seq: int | None = None):
    """Expert ids [batch, seq, moe_layers, k]: integer, the model's shape, values -1 (not routed) ..
    n_experts-1. A traced array is checked for shape only and returned as is; a concrete one comes back as
    int32 NumPy."""
    shape, traced = tuple(np.shape(indices)), isinstance(indices, jax.core.Tracer)
    want = replay_shape(config, batch if batch is not None else (shape[0] if shape else 0),
                        seq if seq is not None else (shape[1] if len(shape) > 1 else 0))
    if len(shape) != 4 or shape != want:
        raise ValueError(f"routing indices have shape {shape}; expected {want} = [batch, seq, moe_layers, k] "
                         f"for this model")
    if traced:
        return indices
    arr = np.asarray(indices)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"routing indices must be integers, got {arr.dtype}")
    if arr.size and (arr.min() < -1 or arr.max() >= config.n_experts):
        raise ValueError(f"routing indices span [{arr.min()}, {arr.max()}]; allowed: -1 (not routed) .. "
                         f"{config.n_experts - 1}")
    return arr.astype(np.int32)


def check_index_positions(positions, config: ModelConfig, batch: int | None = None, seq: int | None = None):
    """Indexer key positions [batch, seq, index_layers, index_topk]: the model has an indexer, the shape fits,
    values are -1 (none) or a position no later than the query's. Traced arrays: shape only."""
    shape, traced = tuple(np.shape(positions)), isinstance(positions, jax.core.Tracer)
    if not index_layers(config):
        raise ValueError(f"index replay given, but this model has no indexer (no layer of kinds "
                         f"{sorted(set(config.layer_kinds))} selects keys; DSA and DeepSeek-V4's CSA do)")
    want = index_replay_shape(config, batch if batch is not None else (shape[0] if shape else 0),
                              seq if seq is not None else (shape[1] if len(shape) > 1 else 0))
    if shape != want:
        raise ValueError(f"index_replay has shape {shape}; expected {want} = [batch, seq, index_layers, "
                         f"index_topk] (index_layers {index_layers(config)})")
    if traced:
        return positions
    arr = np.asarray(positions)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"index positions must be integers, got {arr.dtype}")
    query = np.arange(arr.shape[1])[None, :, None, None]
    if arr.size and (arr.min() < -1 or np.any(arr > query)):
        raise ValueError(f"index positions span [{arr.min()}, {arr.max()}]; allowed: -1 (none) .. the query's own "
                         f"position (a key at or before it)")
    return arr.astype(np.int32)


def check_replay_weights(weights, indices):
    """Gate-weight replay (R3w) inputs: float weights shaped like the replayed expert ids `indices` (which must
    be given). Traced arrays: shape only; concrete ones come back as float32 NumPy."""
    if indices is None:
        raise ValueError("replay_weights given without replay: gate-weight replay needs the expert ids too")
    shape, want = tuple(np.shape(weights)), tuple(np.shape(indices))
    if shape != want:
        raise ValueError(f"replay_weights have shape {shape}; expected {want} = [batch, seq, moe_layers, k], like "
                         f"the replayed ids")
    if isinstance(weights, jax.core.Tracer):
        return weights
    arr = np.asarray(weights)
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"replay_weights must be floats, got {arr.dtype}")
    return arr.astype(np.float32)
