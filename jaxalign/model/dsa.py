"""The DeepSeek sparse attention (DSA) indexer of GLM-5 (transformers `GlmMoeDsaIndexer`): its own query heads
from the q latent, one key per token (LayerNorm, interleaved RoPE on the first qk_rope_head_dim dims), a
per-head weighting, and a top-k over the visible keys (`jaxalign.numerics.indexer`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from jaxalign.model.layers import Linear, param
from jaxalign.numerics import NumericPolicy
from jaxalign.numerics.attention import rope
from jaxalign.numerics.reduce import layer_norm

if TYPE_CHECKING:  # annotations only: config imports the layer kinds, which import this module
    from jaxalign.model.config import ModelConfig

INDEX_KEY_NORM_EPS = 1e-6  # transformers: nn.LayerNorm(index_head_dim, eps=1e-6)


class Indexer(nnx.Module):
    """Parameter names follow transformers: wq_b, wk, k_norm (LayerNorm weight and bias), weights_proj."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        h, d = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = Linear(cfg.q_lora_rank, h * d, ("unsharded", "unsharded"), rngs=rngs)
        self.wk = Linear(cfg.d_model, d, ("embed", "unsharded"), rngs=rngs)
        self.k_norm_scale = param(rngs, (d,), ("norm",), init="ones")
        self.k_norm_bias = param(rngs, (d,), ("norm",), init="zeros")
        self.weights_proj = Linear(cfg.d_model, h, ("embed", "unsharded"), rngs=rngs)

    def keys(self, x: jax.Array, positions: jax.Array, policy: NumericPolicy) -> jax.Array:
        """The indexer key of every token: x [B, S, D] -> [B, S, index_head_dim] (what the engine caches)."""
        cfg = self.cfg
        k = layer_norm(self.wk(x, policy), self.k_norm_scale[...], self.k_norm_bias[...], policy, INDEX_KEY_NORM_EPS)
        return rope(k[:, :, None], positions, cfg.rope_theta, policy, cfg.qk_rope_head_dim, interleaved=True)[:, :, 0]

    def queries(self, x: jax.Array, q_latent: jax.Array, positions: jax.Array, policy: NumericPolicy):
        """(queries [B, S, H, index_head_dim], head weights [B, S, H] already times n_heads ** -0.5)."""
        cfg = self.cfg
        b, s, _ = x.shape
        q = self.wq_b(q_latent, policy).reshape(b, s, cfg.index_n_heads, cfg.index_head_dim)
        q = rope(q, positions, cfg.rope_theta, policy, cfg.qk_rope_head_dim, interleaved=True)
        weights = self.weights_proj(x, policy).astype(jnp.float32) * jnp.float32(cfg.index_n_heads ** -0.5)
        return q, weights
