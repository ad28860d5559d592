"""Layer kinds `mla` (DeepSeek-V3 multi-head latent attention) and `dsa` (MLA with GLM-5's DeepSeek sparse
attention indexer); the module is `model/mla.py`, the state its latent cache. The policy's `mla` field picks
the expanded (trainer) or absorbed (engine) form."""

from __future__ import annotations

import jax.numpy as jnp

from jaxalign.model.kinds.base import LayerKind, hf_field, hf_linear, random_rows, rows_width, split_rows
from jaxalign.numerics import dtype

MLA_FIELDS = ("attention_kind", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim", "rope_interleave")
DSA_FIELDS = ("index_topk", "index_n_heads", "index_head_dim")
# transformers' MLA parameter names -> jaxalign's (model/mla.py)
HF_NAMES = (("q_proj", "q_proj"), ("q_a_proj", "q_a_proj"), ("q_b_proj", "q_b_proj"),
            ("kv_a_proj_with_mqa", "kv_a_proj"), ("kv_b_proj", "kv_b_proj"), ("o_proj", "o_proj"))
HF_NORMS = (("q_a_layernorm", "q_a_norm"), ("kv_a_layernorm", "kv_a_norm"))


class MLA(LayerKind):
    """Multi-head latent attention without an indexer."""

    name = "mla"
    fields = MLA_FIELDS
    # q_proj without a q bottleneck, else q_a_proj / q_b_proj; the KV latent's down- and up-projection; o_proj
    lora_names = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj", "o_proj")
    indexed = False

    def validate(self, cfg) -> None:
        if cfg.attention_kind != "mla":
            raise ValueError(f"ModelConfig: an {self.name!r} layer in a model with attention_kind = "
                             f"{cfg.attention_kind!r}; allowed: attention_kind='mla'")
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(cfg, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} = {value!r}; allowed under attention_kind='mla': a positive int")
        q = cfg.q_lora_rank
        if q is not None and (not isinstance(q, int) or isinstance(q, bool) or q <= 0):
            raise ValueError(f"ModelConfig.q_lora_rank = {q!r}; allowed: None (a plain q projection) or a positive int")
        if cfg.qk_rope_head_dim % 2:
            raise ValueError(f"ModelConfig.qk_rope_head_dim = {cfg.qk_rope_head_dim}; allowed: an even number")
        if cfg.head_dim != cfg.qk_nope_head_dim + cfg.qk_rope_head_dim:
            raise ValueError(f"ModelConfig.head_dim = {cfg.head_dim}; under attention_kind='mla' it is the q.k head "
                             f"dim, allowed: qk_nope_head_dim + qk_rope_head_dim = "
                             f"{cfg.qk_nope_head_dim + cfg.qk_rope_head_dim}")
        if cfg.n_kv_heads != cfg.n_heads:
            raise ValueError(f"ModelConfig.n_kv_heads = {cfg.n_kv_heads}; under attention_kind='mla' every head "
                             f"has its own keys, allowed: n_heads = {cfg.n_heads}")
        if cfg.qk_norm != "none" or cfg.qkv_bias or cfg.partial_rotary_factor != 1.0:
            raise ValueError("ModelConfig: attention_kind='mla' has no qk_norm, qkv_bias or partial_rotary_factor; "
                             "allowed: qk_norm='none', qkv_bias=False, partial_rotary_factor=1.0")

    def build(self, cfg, layer: int, *, rngs):
        from jaxalign.model.mla import MLAttention
        return MLAttention(cfg, rngs=rngs, indexed=self.indexed)

    def form(self, policy) -> str:
        return str(policy.mla)

    def cache_rows(self, cfg) -> int:
        """Numbers cached per slot: the latent, the rope key and (DSA) the indexer key."""
        from jaxalign.model.mla import cache_rows
        return cache_rows(cfg, self.indexed)

    def init_state(self, cfg, batch: int, cache_len: int, policy):
        from jaxalign.model.mla import empty_latent_cache
        return empty_latent_cache(cfg, batch, cache_len, dtype(policy.kv_cache_dtype), self.cache_rows(cfg))

    def reset_state(self, cfg, state, rows):
        from jaxalign.model.mla import LATENT_CACHE_AXES
        from jaxalign.model.sharding import constrain
        return constrain(super().reset_state(cfg, state, rows), LATENT_CACHE_AXES)

    def state_bytes(self, cfg, batch: int, cache_len: int, policy) -> int:
        return batch * cache_len * self.cache_rows(cfg) * jnp.dtype(dtype(policy.kv_cache_dtype)).itemsize

    def lora_targets(self, cfg) -> tuple[str, ...]:
        query = ("q_proj",) if cfg.q_lora_rank is None else ("q_a_proj", "q_b_proj")
        return query + ("kv_a_proj", "kv_b_proj", "o_proj")

    def config_from_hf(self, hf: dict, common: dict) -> dict:
        """MLA's fields and the head layout it implies; refused: attention biases and fewer KV heads than query
        heads."""
        if hf.get("attention_bias", False):
            raise ValueError("attention_bias = True is not supported for multi-head latent attention; allowed: False")
        heads = common["n_heads"]
        if (hf.get("num_key_value_heads") or heads) != heads:
            raise ValueError(f"num_key_value_heads = {hf['num_key_value_heads']} with multi-head latent attention; "
                             f"allowed: num_attention_heads = {heads} (transformers expands one key per head)")
        nope, rope_dim = hf_field(hf, "qk_nope_head_dim"), hf_field(hf, "qk_rope_head_dim")
        return dict(n_kv_heads=heads, head_dim=nope + rope_dim, attention_kind="mla",
                    q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf_field(hf, "kv_lora_rank"),
                    qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim, v_head_dim=hf_field(hf, "v_head_dim"),
                    rope_interleave=bool(hf.get("rope_interleave", True)))

    def config_to_hf(self, cfg) -> dict:
        return dict(q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
                    qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                    v_head_dim=cfg.v_head_dim)

    def _shapes(self, cfg) -> dict[str, tuple[int, int]]:
        h, qk = cfg.n_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        shapes = {"kv_a_proj": (cfg.d_model, cfg.kv_lora_rank + cfg.qk_rope_head_dim),
                  "kv_b_proj": (cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim)),
                  "o_proj": (h * cfg.v_head_dim, cfg.d_model)}
        if cfg.q_lora_rank is None:
            shapes["q_proj"] = (cfg.d_model, h * qk)
        else:
            shapes.update(q_a_proj=(cfg.d_model, cfg.q_lora_rank), q_b_proj=(cfg.q_lora_rank, h * qk))
        return shapes

    def hf_params(self, cfg, take, prefix: str) -> dict:
        shapes, p = self._shapes(cfg), prefix + "self_attn."
        attn = {ours: hf_linear(take, p + theirs, *shapes[ours], False) for theirs, ours in HF_NAMES if ours in shapes}
        for theirs, ours in HF_NORMS:
            if ours != "q_a_norm" or cfg.q_lora_rank is not None:
                dim = cfg.kv_lora_rank if ours == "kv_a_norm" else cfg.q_lora_rank
                attn[ours] = {"scale": take(p + theirs + ".weight", (dim,))}
        if self.indexed:
            h, d, ix = cfg.index_n_heads, cfg.index_head_dim, p + "indexer."
            attn["indexer"] = {"wq_b": hf_linear(take, ix + "wq_b", cfg.q_lora_rank, h * d, False),
                               "wk": hf_linear(take, ix + "wk", cfg.d_model, d, False),
                               "k_norm_scale": take(ix + "k_norm.weight", (d,)),
                               "k_norm_bias": take(ix + "k_norm.bias", (d,)),
                               "weights_proj": hf_linear(take, ix + "weights_proj", cfg.d_model, h, False)}
        return attn

    def hf_tensors(self, cfg, params: dict, prefix: str) -> dict:
        p = prefix + "self_attn."
        out = {f"{p}{theirs}.weight": params[ours]["w"].T for theirs, ours in HF_NAMES if params.get(ours)}
        out.update({f"{p}{theirs}.weight": params[ours]["scale"] for theirs, ours in HF_NORMS if params.get(ours)})
        if params.get("indexer"):
            ix, pre = params["indexer"], p + "indexer."
            out.update({pre + "wq_b.weight": ix["wq_b"]["w"].T, pre + "wk.weight": ix["wk"]["w"].T,
                        pre + "k_norm.weight": ix["k_norm_scale"], pre + "k_norm.bias": ix["k_norm_bias"],
                        pre + "weights_proj.weight": ix["weights_proj"]["w"].T})
        return out

    def probes(self, cfg, policy, rng, q_len: int, k_len: int) -> dict:
        """MLA (and, with a DSA indexer, its scores and the sparse attention) as the model calls them: queries in
        the compute dtype, the latent cache [B, 1, R + r, K] in the kv-cache dtype, kv_b_proj's f32 master shared
        by every row, attention in the policy's `mla` form over the keys the indexer selected."""
        from jaxalign.numerics.dtypes import as_compute, cast
        from jaxalign.numerics.indexer import index_scores, select_keys
        from jaxalign.numerics.mla import mla_attention
        h, nope, r, latent = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        w_kv_b = jnp.asarray(rng.normal(0, latent ** -0.5, (latent, h * (nope + cfg.v_head_dim))), jnp.float32)
        q_pos = jnp.arange(k_len - q_len, k_len)[None]
        k_pos = jnp.arange(k_len)[None]
        attn_shapes = ((q_len, h, nope + r), (1, latent + r, k_len))
        index_shapes = ((q_len, cfg.index_n_heads, cfg.index_head_dim), (k_len, cfg.index_head_dim),
                        (q_len, cfg.index_n_heads))
        indexed = self.indexed

        def scores_of(index_q, index_k, weights, b):
            return index_scores(as_compute(index_q, policy), cast(index_k, policy.kv_cache_dtype), weights,
                                jnp.repeat(q_pos, b, 0), jnp.repeat(k_pos, b, 0), policy)

        def attn(x):
            b = x.shape[0]
            q, cache, *index = split_rows(x, attn_shapes + (index_shapes if indexed else ()))
            allowed = None
            if indexed:
                allowed = select_keys(scores_of(*index, b), jnp.repeat(k_pos, b, 0), cfg.index_topk,
                                      policy.index_ties)[1]
            return mla_attention(as_compute(q, policy), cast(cache, policy.kv_cache_dtype), w_kv_b,
                                 jnp.repeat(q_pos, b, 0), jnp.repeat(k_pos, b, 0), policy, nope_dim=nope,
                                 v_dim=cfg.v_head_dim, allowed=allowed)

        found = {"mla_attention": (random_rows(rows_width(attn_shapes) + (rows_width(index_shapes) if indexed else 0)),
                                   attn)}
        if indexed:
            def scores(x):
                s = scores_of(*split_rows(x, index_shapes), x.shape[0])
                return jnp.where(jnp.isfinite(s), s, 0.0)  # invisible keys (-inf) compare as 0
            found["index_scores"] = (random_rows(rows_width(index_shapes)), scores)
        return found


class DSA(MLA):
    """MLA with the DeepSeek sparse attention indexer (GLM-5): each query attends to its `index_topk` best keys
    by the indexer's scores; the indexer key is cached with the latent."""

    name = "dsa"
    fields = MLA_FIELDS + DSA_FIELDS
    indexed = True

    def index_topk(self, cfg) -> int:
        return cfg.index_topk

    def validate(self, cfg) -> None:
        super().validate(cfg)
        if cfg.q_lora_rank is None or cfg.index_topk <= 0:
            raise ValueError("ModelConfig.index_topk > 0 (DeepSeek sparse attention) needs attention_kind='mla' "
                             "with a q_lora_rank (the indexer reads the q latent)")
        if cfg.index_n_heads <= 0 or cfg.index_head_dim < cfg.qk_rope_head_dim or cfg.index_head_dim % 2:
            raise ValueError(f"ModelConfig.index_n_heads = {cfg.index_n_heads}, index_head_dim = "
                             f"{cfg.index_head_dim}; allowed: index_n_heads > 0 and an even index_head_dim >= "
                             f"qk_rope_head_dim = {cfg.qk_rope_head_dim}")

    def config_from_hf(self, hf: dict, common: dict) -> dict:
        """MLA's fields and the indexer's; refused: `indexer_types` other than 'full' (shared top-k reuse)."""
        fields = super().config_from_hf(hf, common)
        indexer_types = hf.get("indexer_types") or ["full"] * hf["num_hidden_layers"]
        if any(t != "full" for t in indexer_types):
            raise ValueError(f"indexer_types = {indexer_types} is not supported; supported: 'full' for every "
                             f"layer (each layer runs its own indexer; 'shared' top-k reuse is not implemented)")
        return dict(fields, index_topk=hf_field(hf, "index_topk"), index_n_heads=hf_field(hf, "index_n_heads"),
                    index_head_dim=hf_field(hf, "index_head_dim"))

    def config_to_hf(self, cfg) -> dict:
        return dict(super().config_to_hf(cfg), index_topk=cfg.index_topk, index_n_heads=cfg.index_n_heads,
                    index_head_dim=cfg.index_head_dim, indexer_types=["full"] * cfg.n_layers)
