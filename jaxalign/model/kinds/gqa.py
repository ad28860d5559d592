"""Layer kind `gqa`: grouped-query softmax attention (Qwen, Mixtral, OLMoE, GLM-4.5); the module is
`model/attention.py`, its state the per-head KV cache."""

from __future__ import annotations

import jax.numpy as jnp

from jaxalign.model.kinds.base import LayerKind, hf_linear, random_rows
from jaxalign.numerics import dtype

GQA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


class GQA(LayerKind):
    """Grouped-query attention. Its fields (n_heads, n_kv_heads, head_dim, qk_norm, qkv_bias, RoPE) are the
    model-wide ones ModelConfig validates itself."""

    name = "gqa"
    fields = ()
    lora_names = GQA_TARGETS

    def validate(self, cfg) -> None:
        if cfg.attention_kind != "gqa":
            raise ValueError(f"ModelConfig: a 'gqa' layer in a model with attention_kind = {cfg.attention_kind!r}; "
                             f"allowed: attention_kind='gqa' (the attention kind names its softmax attention)")

    def build(self, cfg, layer: int, *, rngs):
        from jaxalign.model.attention import Attention
        return Attention(cfg, rngs=rngs)

    def form(self, policy) -> str:
        return str(policy.attention)

    def init_state(self, cfg, batch: int, cache_len: int, policy):
        from jaxalign.model.attention import empty_kv_cache
        return empty_kv_cache(cfg, batch, cache_len, dtype(policy.kv_cache_dtype))

    def reset_state(self, cfg, state, rows):
        from jaxalign.model.attention import K_CACHE_AXES, V_CACHE_AXES
        from jaxalign.model.sharding import constrain
        keys, values = super().reset_state(cfg, state, rows)
        return constrain(keys, K_CACHE_AXES), constrain(values, V_CACHE_AXES)

    def state_bytes(self, cfg, batch: int, cache_len: int, policy) -> int:
        itemsize = jnp.dtype(dtype(policy.kv_cache_dtype)).itemsize
        return 2 * batch * cache_len * cfg.n_kv_heads * cfg.head_dim * itemsize

    def lora_targets(self, cfg) -> tuple[str, ...]:
        return GQA_TARGETS

    def hf_params(self, cfg, take, prefix: str) -> dict:
        d, hd = cfg.d_model, cfg.head_dim
        q_dim, kv_dim, p = cfg.n_heads * hd, cfg.n_kv_heads * hd, prefix + "self_attn."
        q_out = 2 * q_dim if cfg.attn_output_gate else q_dim  # each head's query, then its output gate
        attn = {"q_proj": hf_linear(take, p + "q_proj", d, q_out, cfg.qkv_bias),
                "k_proj": hf_linear(take, p + "k_proj", d, kv_dim, cfg.qkv_bias),
                "v_proj": hf_linear(take, p + "v_proj", d, kv_dim, cfg.qkv_bias),
                "o_proj": hf_linear(take, p + "o_proj", q_dim, d, False)}
        if cfg.qk_norm != "none":
            dims = (hd, hd) if cfg.qk_norm == "head" else (q_dim, kv_dim)
            attn["q_norm"] = {"scale": take(p + "q_norm.weight", (dims[0],))}
            attn["k_norm"] = {"scale": take(p + "k_norm.weight", (dims[1],))}
        return attn

    def hf_tensors(self, cfg, params: dict, prefix: str) -> dict:
        out, p = {}, prefix + "self_attn."
        for name in GQA_TARGETS:
            out[f"{p}{name}.weight"] = params[name]["w"].T
            if "b" in params[name]:
                out[f"{p}{name}.bias"] = params[name]["b"]
        if cfg.qk_norm != "none":
            out[p + "q_norm.weight"] = params["q_norm"]["scale"]
            out[p + "k_norm.weight"] = params["k_norm"]["scale"]
        return out

    def probes(self, cfg, policy, rng, q_len: int, k_len: int) -> dict:
        return {"attention": attention_probe(cfg, policy, q_len, k_len)}


def attention_probe(cfg, policy, q_len: int, k_len: int, **options) -> tuple:
    """(make, fn) for `jaxalign check`: GQA attention as the model calls it on `q_len` queries over `k_len`
    positions, each row holding its queries, keys and values; `options` go to the kernel (a window, sinks)."""
    from jaxalign.numerics.attention import attention
    from jaxalign.numerics.dtypes import as_compute, cast
    q_pos = jnp.arange(k_len - q_len, k_len)[None]
    k_pos = jnp.arange(k_len)[None]

    def attn(x):
        b = x.shape[0]
        q, k, v = jnp.split(x, [q_len * cfg.n_heads * cfg.head_dim,
                                (q_len * cfg.n_heads + cfg.n_kv_heads * k_len) * cfg.head_dim], axis=1)
        # as the model calls it: queries in the compute dtype, keys and values as the KV cache stores them
        return attention(as_compute(q.reshape(b, q_len, cfg.n_heads, cfg.head_dim), policy),
                         cast(k.reshape(b, cfg.n_kv_heads, cfg.head_dim, k_len), policy.kv_cache_dtype),
                         cast(v.reshape(b, cfg.n_kv_heads, k_len, cfg.head_dim), policy.kv_cache_dtype),
                         jnp.repeat(q_pos, b, 0), jnp.repeat(k_pos, b, 0), policy, **options)

    width = (q_len * cfg.n_heads + 2 * cfg.n_kv_heads * k_len) * cfg.head_dim
    return random_rows(width), attn
