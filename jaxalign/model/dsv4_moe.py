"""DeepSeek-V4's MoE block (transformers `DeepseekV4SparseMoeBlock`): `sqrtsoftplus` router scores (the routed
scaling and 1e-20 renormalisation of DeepSeek-V3, no groups), routed and shared experts with the limited SwiGLU,
and on the `hash_layers` a hash router: each token's experts are a fixed table lookup `tid2eid[token]`, the gate
weights its gathered scores.

**Replay on hash layers.** The route of a hash layer is a function of the token, not of the activations, so there
is nothing a rollout could record that the trainer would not recompute exactly: R3 replay (`replay` indices) is
ignored on these layers (the table's experts are used) and their routing margin is +inf (no flip is possible);
`replay_weights` (R3w) still apply, as they replace scores, which do depend on the activations.

The table is a static attribute (`HashTable`, in the module's graph definition, never a parameter): the optimizer,
weight casts and quantisation never see it, and an engine built or synced from the model carries it.
"""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxalign.model.layers import Linear
from jaxalign.model.moe import MoE, route
from jaxalign.numerics import NumericPolicy, as_param
from jaxalign.numerics.experts import LimitedSwiGLU, combine, dispatch, gated


class HashTable:
    """An immutable token id -> expert ids table [vocab, k] (int32), hashable by content (a static attribute)."""

    def __init__(self, table):
        arr = np.array(table, dtype=np.int32, copy=True)
        if arr.ndim != 2:
            raise ValueError(f"a hash-routing table is [vocab, top_k], got shape {arr.shape}")
        arr.setflags(write=False)
        self.array = arr
        self._digest = hashlib.sha256(arr.tobytes() + str(arr.shape).encode()).hexdigest()

    @classmethod
    def default(cls, vocab: int, k: int, n_experts: int, seed: int = 0) -> "HashTable":
        """A fixed table for a freshly built model: k distinct experts per token from a seeded generator (a
        checkpoint's `tid2eid` replaces it)."""
        rng = np.random.default_rng(seed)
        return cls(np.stack([rng.permutation(n_experts)[:k] for _ in range(vocab)]))

    def __hash__(self) -> int:
        return hash(self._digest)

    def __eq__(self, other) -> bool:
        return isinstance(other, HashTable) and other._digest == self._digest

    def __repr__(self) -> str:
        return f"HashTable(shape={self.array.shape}, sha256={self._digest[:12]})"


class LimitedMLP(nnx.Module):
    """The shared expert: down(silu(min(x @ gate, limit)) * clip(x @ up, -limit, limit)) (`DeepseekV4MLP`)."""

    def __init__(self, d_model: int, hidden: int, limit: float, *, rngs: nnx.Rngs):
        self.gate = Linear(d_model, hidden, ("embed", "mlp"), rngs=rngs)
        self.up = Linear(d_model, hidden, ("embed", "mlp"), rngs=rngs)
        self.down = Linear(hidden, d_model, ("mlp", "embed"), rngs=rngs)
        self.act = LimitedSwiGLU(limit)

    def __call__(self, x: jax.Array, policy: NumericPolicy) -> jax.Array:
        return self.down(gated(self.gate(x, policy), self.up(x, policy), policy, self.act), policy)


class V4MoE(MoE):
    """MoE with DeepSeek-V4's router, activation and shared expert; `hashed` layers route by `table`."""

    def __init__(self, cfg, hashed: bool, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        v4 = cfg.deepseek_v4
        self.act = LimitedSwiGLU(v4.swiglu_limit)
        self.shared = LimitedMLP(cfg.d_model, cfg.shared_expert_dim, v4.swiglu_limit, rngs=rngs)
        self.hashed = hashed
        if hashed:
            self.selection_bias = None  # transformers' hash router has no correction bias
        self.table = HashTable.default(cfg.vocab_size, cfg.top_k, cfg.n_experts) if hashed else None

    def __call__(self, x: jax.Array, policy: NumericPolicy, replay: jax.Array | None = None,
                 replay_weights: jax.Array | None = None, *, tokens: jax.Array | None = None):
        """x [B, S, D]; `tokens` [B, S] (required on a hash layer); replay / replay_weights as `MoE` (replay
        ignored on hash layers, see the module doc). Returns (out [B, S, D], (idx, weights, margin))."""
        b, s, d = x.shape
        flat = x.reshape(b * s, d)
        if self.hashed:
            if tokens is None:
                raise ValueError("a DeepSeek-V4 hash-routed layer needs the token ids (tokens=...)")
            replay = jnp.asarray(self.table.array)[tokens.reshape(-1)]
        elif replay is not None:
            replay = replay.reshape(b * s, -1)
        bias = self.selection_bias[...] if self.selection_bias is not None else None
        idx, weights, margin = route(flat, self.router[...], bias, self.cfg, policy, replay,
                                     None if replay_weights is None else replay_weights.reshape(b * s, -1))
        if self.hashed:
            margin = jnp.full_like(margin, jnp.inf)
        weight = (lambda v: v[...]) if policy.quantizes_products else (lambda v: as_param(v[...], policy))  # noqa: E731
        y, kept = dispatch(flat, idx, weight(self.w_gate), weight(self.w_up), weight(self.w_down), policy,
                           act=self.act)
        out = combine(y, idx, jnp.where(kept, weights, jnp.zeros_like(weights)), self.cfg.n_experts, policy)
        out = out + self.shared(flat, policy)
        routing = (idx.reshape(b, s, -1), weights.astype(jnp.float32).reshape(b, s, -1), margin.reshape(b, s))
        return out.reshape(b, s, d), routing
