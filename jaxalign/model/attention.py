"""Grouped-query attention with RoPE, optional q/k norm and an optional KV cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from jaxalign.model.layers import Linear, RMSNorm
from jaxalign.model.sharding import constrain
from jaxalign.numerics import NumericPolicy
from jaxalign.numerics.attention import attention, kv_cache_entries, rope
from jaxalign.numerics.experts import sigmoid

if TYPE_CHECKING:  # annotations only: config imports the layer kinds, which import this module
    from jaxalign.model.config import ModelConfig

# the engine's cache: keys [B, KVH, Dh, M], values [B, KVH, M, Dh] (model/sharding.py splits the named axes)
K_CACHE_AXES = ("cache_batch", "cache_kv_heads", None, "cache_seq")
V_CACHE_AXES = ("cache_batch", "cache_kv_heads", "cache_seq", None)


def empty_kv_cache(cfg: ModelConfig, batch: int, cache_len: int, dtype):
    """One GQA layer's zeroed (keys, values) cache for `batch` rows of `cache_len` slots, in the layout above."""
    keys = jnp.zeros((batch, cfg.n_kv_heads, cfg.head_dim, cache_len), dtype)
    values = jnp.zeros((batch, cfg.n_kv_heads, cache_len, cfg.head_dim), dtype)
    return constrain(keys, K_CACHE_AXES), constrain(values, V_CACHE_AXES)


class Attention(nnx.Module):
    """GQA self-attention. q/k norm: `head` (per head over head_dim, Qwen3) or `proj` (whole projection, OLMoE)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        # with an output gate (Qwen3.5), q_proj emits each head's query then its gate: [H, 2 * Dh]
        q_out = 2 * q_dim if cfg.attn_output_gate else q_dim
        self.q_proj = Linear(cfg.d_model, q_out, ("embed", "q_heads"), rngs=rngs, bias=cfg.qkv_bias)
        self.k_proj = Linear(cfg.d_model, kv_dim, ("embed", "kv_heads"), rngs=rngs, bias=cfg.qkv_bias)
        self.v_proj = Linear(cfg.d_model, kv_dim, ("embed", "kv_heads"), rngs=rngs, bias=cfg.qkv_bias)
        self.o_proj = Linear(q_dim, cfg.d_model, ("q_heads", "embed"), rngs=rngs)
        if cfg.qk_norm == "head":
            zc = cfg.norm_zero_centred
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps, "head_dim", rngs=rngs, zero_centred=zc)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps, "head_dim", rngs=rngs, zero_centred=zc)
        elif cfg.qk_norm == "proj":
            self.q_norm = RMSNorm(q_dim, cfg.rms_eps, "q_heads", rngs=rngs)
            self.k_norm = RMSNorm(kv_dim, cfg.rms_eps, "kv_heads", rngs=rngs)
        else:
            self.q_norm = self.k_norm = None

    def rotate(self, x: jax.Array, positions: jax.Array, policy: NumericPolicy) -> jax.Array:
        """RoPE on queries or keys [B, S, H, Dh] (a subclass may scale it)."""
        return rope(x, positions, self.cfg.rope_theta, policy, self.cfg.rotary_dim)

    def attend(self, q, keys, values, q_pos, k_pos, policy: NumericPolicy) -> jax.Array:
        """The attention kernel over the keys and values in the cache layout (a subclass may add a window or
        sinks): [B, S, H, Dh]."""
        return attention(q, keys, values, q_pos, k_pos, policy)

    def __call__(self, x: jax.Array, positions: jax.Array, policy: NumericPolicy,
                 kv: tuple[jax.Array, jax.Array] | None = None, *, valid=None, index_replay=None):
        """x [B, S, D], positions [B, S] (the mixer call of `model/kinds/base.py`). With `kv` = (k_cache
        [B, KVH, Dh, M], v_cache [B, KVH, M, Dh]) -- the layouts a decode step's two products read without
        transposing the cache -- the new keys/values are written at slot = position and attention reads the whole
        cache. `valid` is not needed: a pad's slot is masked for earlier queries and rewritten before a later one
        reads it. Returns (out [B, S, D], new kv or None, None)."""
        cfg = self.cfg
        b, s, _ = x.shape
        q, k, v = self.q_proj(x, policy), self.k_proj(x, policy), self.v_proj(x, policy)
        gate = None
        if cfg.attn_output_gate:
            q, gate = jnp.split(q.reshape(b, s, cfg.n_heads, 2 * cfg.head_dim), 2, axis=-1)
            q, gate = q.reshape(b, s, -1), gate.reshape(b, s, -1)
        if cfg.qk_norm == "proj":
            q, k = self.q_norm(q, policy), self.k_norm(k, policy)
        q = q.reshape(b, s, cfg.n_heads, cfg.head_dim)
        k = k.reshape(b, s, cfg.n_kv_heads, cfg.head_dim)
        v = v.reshape(b, s, cfg.n_kv_heads, cfg.head_dim)
        q = constrain(q, ("batch", "seq", "act_heads", None))
        k = constrain(k, ("batch", "seq", "act_kv_heads", None))
        v = constrain(v, ("batch", "seq", "act_kv_heads", None))
        if cfg.qk_norm == "head":
            q, k = self.q_norm(q, policy), self.k_norm(k, policy)
        q = self.rotate(q, positions, policy)
        k, v = kv_cache_entries(self.rotate(k, positions, policy), v, policy)
        if kv is None:
            keys, values = jnp.transpose(k, (0, 2, 3, 1)), jnp.transpose(v, (0, 2, 1, 3))
            k_pos, new_kv = positions, None
        else:
            rows = jnp.arange(b)[:, None]
            # (rows, positions) index [B, S] pairs, so both updates are [B, S, KVH, Dh]: k and v as they are
            keys = constrain(kv[0].at[rows, :, :, positions].set(k, mode="drop"), K_CACHE_AXES)
            values = constrain(kv[1].at[rows, :, positions].set(v, mode="drop"), V_CACHE_AXES)
            k_pos = jnp.broadcast_to(jnp.arange(values.shape[2]), (b, values.shape[2]))
            new_kv = (keys, values)
        out = self.attend(q, keys, values, positions, k_pos, policy).reshape(b, s, -1)
        if gate is not None:  # transformers: attn_output * torch.sigmoid(gate), in the model dtype
            out = out * sigmoid(gate, policy).astype(out.dtype)
        return self.o_proj(out, policy), new_kv, None
