"""Multi-head latent attention (DeepSeek-V3, GLM-5): projections, the latent KV cache, and the form the policy
picks (`jaxalign.numerics.mla`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from jaxalign.model.layers import Linear, RMSNorm
from jaxalign.model.sharding import constrain
from jaxalign.numerics import NumericPolicy, cast, fp8
from jaxalign.numerics.attention import rope
from jaxalign.numerics.indexer import index_scores, replayed_keys, select_keys, torch_row_len
from jaxalign.numerics.mla import mla_attention

if TYPE_CHECKING:  # annotations only: config imports the layer kinds, which import this module
    from jaxalign.model.config import ModelConfig

# the engine's MLA cache: [B, 1, kv_lora_rank + qk_rope_head_dim (+ index_head_dim), M] (latent rows, the rope
# key, and under DSA the indexer key; slots last)
LATENT_CACHE_AXES = ("cache_batch", None, None, "cache_seq")
# transformers builds q_a_layernorm / kv_a_layernorm with the RMSNorm default eps, not config.rms_norm_eps
LATENT_NORM_EPS = 1e-6


def cache_rows(cfg: ModelConfig, indexed: bool) -> int:
    """Numbers cached per slot and layer: the latent, the rope key and (DSA) the indexer key."""
    return cfg.kv_lora_rank + cfg.qk_rope_head_dim + (cfg.index_head_dim if indexed else 0)


def empty_latent_cache(cfg: ModelConfig, batch: int, cache_len: int, dtype, rows: int) -> jax.Array:
    """One layer's zeroed latent cache for `batch` rows of `cache_len` slots, `rows` numbers per slot."""
    return constrain(jnp.zeros((batch, 1, rows, cache_len), dtype), LATENT_CACHE_AXES)


class MLAttention(nnx.Module):
    """Multi-head latent attention. Parameter names follow transformers' DeepseekV3Attention."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, indexed: bool | None = None):
        """`indexed`: with the DSA indexer (default: when cfg.index_topk > 0; the `dsa` layer kind)."""
        self.cfg = cfg
        h, qk = cfg.n_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(cfg.d_model, h * qk, ("embed", "q_heads"), rngs=rngs)
            self.q_a_proj = self.q_a_norm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(cfg.d_model, cfg.q_lora_rank, ("embed", "unsharded"), rngs=rngs)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, "norm", rngs=rngs)
            self.q_b_proj = Linear(cfg.q_lora_rank, h * qk, ("unsharded", "q_heads"), rngs=rngs)
        self.kv_a_proj = Linear(cfg.d_model, cfg.kv_lora_rank + cfg.qk_rope_head_dim, ("embed", "unsharded"), rngs=rngs)
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS, "norm", rngs=rngs)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), ("unsharded", "q_heads"),
                                rngs=rngs)
        self.o_proj = Linear(h * cfg.v_head_dim, cfg.d_model, ("q_heads", "embed"), rngs=rngs)
        if cfg.index_topk if indexed is None else indexed:
            from jaxalign.model.dsa import Indexer
            self.indexer = Indexer(cfg, rngs=rngs)
        else:
            self.indexer = None

    def query_latent(self, x: jax.Array, policy: NumericPolicy) -> jax.Array | None:
        """The normalised q bottleneck q_a_norm(q_a_proj(x)) (the DSA indexer reads it), or None without one."""
        if self.q_a_proj is None:
            return None
        return self.q_a_norm(self.q_a_proj(x, policy), policy)

    def __call__(self, x: jax.Array, positions: jax.Array, policy: NumericPolicy, kv: jax.Array | None = None, *,
                 valid=None, index_replay: jax.Array | None = None):
        """x [B, S, D], positions [B, S] (the mixer call of `model/kinds/base.py`); `kv` the latent cache
        [B, 1, rows, M] (written at slot = position, then read whole; `valid` is not needed, as for GQA, except
        that under `index_ties=torch-cpu` it bounds the row torch.topk would see: `torch_row_len`). Under DSA,
        `index_replay` [B, S, index_topk] recorded key positions replace the indexer's choice (rows whose first
        entry is -1 keep their own).
        Returns (out [B, S, D], new cache or None, selection): selection is None without an indexer, else the
        indexer's own (positions [B, S, index_topk] (-1 = fewer visible keys), margins [B, S])."""
        cfg = self.cfg
        b, s, _ = x.shape
        nope, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        q_latent = self.query_latent(x, policy)
        q = self.q_proj(x, policy) if q_latent is None else self.q_b_proj(q_latent, policy)
        q = constrain(q.reshape(b, s, cfg.n_heads, nope + r), ("batch", "seq", "act_heads", None))
        q_rope = rope(q[..., nope:], positions, cfg.rope_theta, policy, interleaved=cfg.rope_interleave)
        q = jnp.concatenate([cast(q[..., :nope], policy.compute_dtype), q_rope], axis=-1)
        compressed = self.kv_a_proj(x, policy)
        latent = self.kv_a_norm(compressed[..., :cfg.kv_lora_rank], policy)
        k_rope = rope(compressed[..., None, cfg.kv_lora_rank:], positions, cfg.rope_theta, policy,
                      interleaved=cfg.rope_interleave)[:, :, 0]
        parts = [latent, k_rope]
        if self.indexer is not None:
            parts.append(self.indexer.keys(x, positions, policy))
        entry = jnp.concatenate(parts, axis=-1)  # [B, S, rows]
        entry = fp8.kv_entries(entry, policy) if policy.kv_quant != "none" else cast(entry, policy.kv_cache_dtype)
        if kv is None:
            cache, k_pos, new_kv = jnp.transpose(entry, (0, 2, 1))[:, None], positions, None
        else:
            rows = jnp.arange(b)[:, None]
            cache = constrain(kv.at[rows, :, :, positions].set(entry[:, :, None], mode="drop"), LATENT_CACHE_AXES)
            k_pos = jnp.broadcast_to(jnp.arange(cache.shape[-1]), (b, cache.shape[-1]))
            new_kv = cache
        allowed, selection = None, None
        if self.indexer is not None:
            index_keys = jnp.transpose(cache[:, 0, cfg.kv_lora_rank + r:], (0, 2, 1))  # [B, M, index_head_dim]
            index_q, weights = self.indexer.queries(x, q_latent, positions, policy)
            scores = index_scores(index_q, index_keys, weights, positions, k_pos, policy)
            row_len = torch_row_len(positions, k_pos, valid) if policy.index_ties == "torch-cpu" else None
            chosen, allowed, margins = select_keys(scores, k_pos, cfg.index_topk, policy.index_ties, row_len)
            if index_replay is not None:
                allowed = replayed_keys(index_replay, k_pos, allowed)
            selection = (chosen, margins)
        kv_b = self.kv_b_proj
        kv_b_lora = None if kv_b.lora_a is None else (kv_b.lora_a[...], kv_b.lora_b[...], kv_b.lora_scale)
        out = mla_attention(q, cache, kv_b.w[...], positions, k_pos, policy, nope_dim=nope, v_dim=cfg.v_head_dim,
                            allowed=allowed, kv_b_lora=kv_b_lora)
        return self.o_proj(out.reshape(b, s, -1), policy), new_kv, selection
