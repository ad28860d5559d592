"""RoutingRecord: which experts each token used, per MoE layer, in top-k slot order.

Layout: `indices` int32 [batch, seq, moe_layers, k], -1 = not routed (padding, or a token never forwarded);
`weights` float32 [batch, seq, moe_layers, k] gate weights; `margins` float32 [batch, seq, moe_layers], the
router's selection-score gap between the k-th and (k+1)-th expert (how close the decision was to flipping).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoutingRecord:
    """Expert choices of a forward pass (see module docstring for the layout)."""

    indices: jax.Array
    weights: jax.Array
    margins: jax.Array

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
