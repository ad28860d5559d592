"""DeepSeek-V4's compressors and indexer (transformers `DeepseekV4HCACompressor`, `DeepseekV4CSACompressor`,
`DeepseekV4Indexer`): token projections pooled into one entry per `rate` tokens.

Every token contributes a value `kv` and a gate; entry w pools a window of tokens with a softmax over the gates
(plus a learned per-slot `position_bias`), then an RMSNorm and the compressed RoPE at position w * rate:

- HCA (`overlap=False`): window w is tokens [w * rate, (w + 1) * rate);
- CSA (`overlap=True`): the projections are twice as wide, two series Ca | Cb; entry w pools window w - 1's Ca
  and window w's Cb (2 * rate slots; window -1 is empty: gate -inf).

Entry w is complete once token (w + 1) * rate - 1 has been seen, so a query at position t sees entries
w < (t + 1) // rate: the entry's "position" is (w + 1) * rate - 1 and the causal mask does the rest.

**Engine state, and a deliberate difference from transformers' cache.** transformers' cache keeps the compressed
entries, a buffer of the current window's tokens and the last window's Ca. Here the state holds every token's
projections at slot = position (`kv`, `gate` [B, M, width], in the KV-cache dtype) and each call pools all of
them again. The entries are the same numbers (pooling is per entry), a pad's slot is rewritten before any query
that could see its entry, and trainer and engine pool with identical per-entry operations, so entries are
bitwise equal whatever the number of slots -- at the cost of pooling M / rate entries per call. The trainer rounds
the projections to the KV-cache dtype as the engine stores them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxalign.model.dsv4 import rope_tail
from jaxalign.model.layers import Linear, RMSNorm, param
from jaxalign.numerics import NumericPolicy, as_param, cast
from jaxalign.numerics.dtypes import as_compute
from jaxalign.numerics.reduce import reduce_sum, softmax


def padded_len(n: int, rate: int) -> int:
    """n rounded up to a multiple of `rate` (the slots a pooling over whole windows reads)."""
    return -(-n // rate) * rate


def entry_positions(n_entries: int, rate: int, batch: int) -> jax.Array:
    """[B, T] int32: entry w's position (w + 1) * rate - 1 (its last token), what the causal mask compares."""
    return jnp.broadcast_to((jnp.arange(n_entries, dtype=jnp.int32) + 1) * rate - 1, (batch, n_entries))


class Compressor(nnx.Module):
    """Projections `kv_proj`, `gate_proj` (width `dim`, twice that with `overlap`), `position_bias` [rate, width]
    (float32, as transformers keeps it) and `kv_norm` [dim]; pools the projections into entries of `dim`."""

    def __init__(self, cfg, dim: int, rate: int, overlap: bool, *, rngs: nnx.Rngs):
        self.cfg, self.dim, self.rate, self.overlap = cfg, dim, rate, overlap
        width = 2 * dim if overlap else dim
        self.kv_proj = Linear(cfg.d_model, width, ("embed", "unsharded"), rngs=rngs)
        self.gate_proj = Linear(cfg.d_model, width, ("embed", "unsharded"), rngs=rngs)
        self.position_bias = param(rngs, (rate, width), ("unsharded", "unsharded"), std=0.1)
        self.kv_norm = RMSNorm(dim, cfg.rms_eps, "norm", rngs=rngs)

    @property
    def width(self) -> int:
        """Per-token projection width (what the engine state stores)."""
        return 2 * self.dim if self.overlap else self.dim

    def project(self, x: jax.Array, policy: NumericPolicy) -> tuple[jax.Array, jax.Array]:
        """Per-token (kv, gate) [B, S, width], rounded to the KV-cache dtype (as the engine stores them)."""
        return (cast(self.kv_proj(x, policy), policy.kv_cache_dtype),
                cast(self.gate_proj(x, policy), policy.kv_cache_dtype))

    def pool(self, kv: jax.Array, gate: jax.Array, policy: NumericPolicy) -> jax.Array:
        """kv, gate [B, N, width] (N a multiple of rate, slot = position) -> entries [B, N / rate, dim] (RMSNorm,
        RoPE at w * rate with the compressed theta), in the KV-cache dtype."""
        b, n, width = kv.shape
        r, d = self.rate, self.dim
        nb = n // r
        kv = as_compute(kv, policy).reshape(b, nb, r, width)
        # transformers adds its float32 position_bias to the gate: the sum is float32 (the bias rounded to the
        # param dtype first, as every parameter: trainer masters and engine copies agree)
        gate = gate.astype(jnp.float32).reshape(b, nb, r, width) + as_param(self.position_bias[...],
                                                                            policy).astype(jnp.float32)
        if self.overlap:  # entry w: window w-1's Ca (first d), window w's Cb (last d)
            prev_kv = jnp.pad(kv[:, :-1, :, :d], ((0, 0), (1, 0), (0, 0), (0, 0)))
            prev_gate = jnp.pad(gate[:, :-1, :, :d], ((0, 0), (1, 0), (0, 0), (0, 0)), constant_values=-jnp.inf)
            kv = jnp.concatenate([prev_kv, kv[..., d:]], axis=2)  # [B, nb, 2r, d]
            gate = jnp.concatenate([prev_gate, gate[..., d:]], axis=2)
        weights = softmax(gate, policy, "f32", axis=2).astype(kv.dtype)
        pooled = reduce_sum(kv * weights, policy, axis=2)  # [B, nb, d]
        normed = self.kv_norm(pooled, policy)
        positions = jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32) * r, (b, nb))
        v4 = self.cfg.deepseek_v4
        rotated = rope_tail(normed[:, :, None], positions, v4.compress_theta, self.rope_dim, policy,
                            v4.compress_inv_freq(self.rope_dim))[:, :, 0]
        return cast(rotated, policy.kv_cache_dtype)

    @property
    def rope_dim(self) -> int:
        """The rotated tail of an entry (the model's rotary dims)."""
        return self.cfg.rotary_dim

    def entries(self, x: jax.Array, positions: jax.Array, policy: NumericPolicy, state=None):
        """Entries for this call's queries: (entries [B, T, dim], entry positions [B, T], new state or None).
        Without state (trainer): the sequence's own windows (a partial last window is padded; its entry is never
        visible). With state {"kv", "gate"} [B, M, width]: the call's projections written at slot = position, then
        every window of the state pooled."""
        kv, gate = self.project(x, policy)
        if state is None:
            b, s, _ = kv.shape
            pad = padded_len(s, self.rate) - s
            kv, gate = (jnp.pad(a, ((0, 0), (0, pad), (0, 0))) for a in (kv, gate))
            new_state = None
        else:
            rows = jnp.arange(kv.shape[0])[:, None]
            kv = state["kv"].at[rows, positions].set(kv, mode="drop")
            gate = state["gate"].at[rows, positions].set(gate, mode="drop")
            new_state = {"kv": kv, "gate": gate}
        out = self.pool(kv, gate, policy)
        return out, entry_positions(out.shape[1], self.rate, out.shape[0]), new_state


class Indexer(nnx.Module):
    """The CSA layers' lightning indexer: its own overlapping compressor at `index_dim`, queries from the query
    latent (`q_b_proj`, compressed RoPE on the tail), head weights `weights_proj` (times index_heads ** -0.5)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        v4 = cfg.deepseek_v4
        self.cfg = cfg
        self.compressor = Compressor(cfg, v4.index_dim, v4.csa_rate, True, rngs=rngs)
        self.q_b_proj = Linear(v4.q_rank, v4.index_heads * v4.index_dim, ("unsharded", "unsharded"), rngs=rngs)
        self.weights_proj = Linear(cfg.d_model, v4.index_heads, ("embed", "unsharded"), rngs=rngs)

    def queries(self, x: jax.Array, q_latent: jax.Array, positions: jax.Array, policy: NumericPolicy):
        """(queries [B, S, H_I, index_dim], head weights [B, S, H_I] float32 already times H_I ** -0.5)."""
        v4 = self.cfg.deepseek_v4
        b, s, _ = x.shape
        q = self.q_b_proj(q_latent, policy).reshape(b, s, v4.index_heads, v4.index_dim)
        q = rope_tail(q, positions, v4.compress_theta, self.cfg.rotary_dim, policy,
                      v4.compress_inv_freq(self.cfg.rotary_dim))
        weights = self.weights_proj(x, policy).astype(jnp.float32) * jnp.float32(v4.index_heads ** -0.5)
        return q, weights
