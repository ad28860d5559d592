"""Layer kinds `dsv4_sliding`, `dsv4_csa` and `dsv4_hca`: DeepSeek-V4's attention over a sliding window of raw
keys, plus compressed sparse attention (CSA: entries of `csa_rate` tokens, overlapping, chosen per query by the
lightning indexer) or heavily compressed attention (HCA: entries of `hca_rate` tokens, all visible). The module is
`model/dsv4_attention.py` (compressors and indexer: `model/dsv4_compress.py`); the settings are
`ModelConfig.deepseek_v4` (`model/dsv4.py`), which these kinds own.

Engine state (a dict): `kv` [B, M, head_dim], the shared key = value head at slot = position (a sliding layer keeps
every position and masks those outside its window, as the sink kinds do); CSA / HCA layers add `compressor` =
{"kv", "gate"} [B, M, width] (the compressor's per-token projections) and CSA layers `indexer` likewise, M rounded
up to whole windows. All in the KV-cache dtype. Resetting a row zeros it (the default).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxalign.model.kinds.base import LayerKind, hf_linear
from jaxalign.numerics import dtype


def _padded(n: int, rate: int) -> int:
    return -(-n // rate) * rate


class DeepseekV4Kind(LayerKind):
    """One of DeepSeek-V4's three attention layer types (`compression`: none, csa, hca)."""

    name = "dsv4_sliding"
    fields = ("deepseek_v4",)
    compression = "none"

    def validate(self, cfg) -> None:
        """The settings are present and fit the model (`DeepseekV4.check`)."""
        if cfg.deepseek_v4 is None:
            raise ValueError(f"ModelConfig: a {self.name!r} layer needs deepseek_v4 settings; allowed: a "
                             f"jaxalign.model.dsv4.DeepseekV4 value")
        cfg.deepseek_v4.check(cfg)

    def rate(self, cfg) -> int:
        """Tokens per compressed entry (1 for the sliding kind)."""
        v4 = cfg.deepseek_v4
        return {"none": 1, "csa": v4.csa_rate, "hca": v4.hca_rate}[self.compression]

    def build(self, cfg, layer: int, *, rngs):
        """`V4Attention` with this kind's compression."""
        from jaxalign.model.dsv4_attention import V4Attention
        return V4Attention(cfg, self.compression, rngs=rngs)

    def form(self, policy) -> str:
        """The attention form and where the sink enters (e.g. `full,sink=seed`)."""
        return f"{policy.attention},sink={policy.attn_sink}"

    def init_state(self, cfg, batch: int, cache_len: int, policy):
        """Zeroed raw keys, and the compressor's (and indexer's) per-token projections."""
        v4, dt = cfg.deepseek_v4, dtype(policy.kv_cache_dtype)
        m = _padded(cache_len, self.rate(cfg))
        state = {"kv": jnp.zeros((batch, m, cfg.head_dim), dt)}
        if self.compression != "none":
            width = (2 if self.compression == "csa" else 1) * cfg.head_dim
            state["compressor"] = {"kv": jnp.zeros((batch, m, width), dt), "gate": jnp.zeros((batch, m, width), dt)}
        if self.compression == "csa":
            width = 2 * v4.index_dim
            state["indexer"] = {"kv": jnp.zeros((batch, m, width), dt), "gate": jnp.zeros((batch, m, width), dt)}
        return state

    def probes(self, cfg, policy, rng, q_len: int, k_len: int) -> dict:
        """`jaxalign check`'s kernels as this kind calls them: `dsv4_attention` (every kind: the queries over one
        shared key = value head, the window's raw keys visible, a learned sink per head), and on CSA / HCA layers
        the compressor's pooling (`dsv4_csa_compressor` / `dsv4_hca_compressor`: per-token projections rounded
        to the KV-cache dtype -> softmax-gated sums over each window, RMSNorm, RoPE), and on CSA layers the
        indexer (`dsv4_index`: its scores and the entries it selects, as 0/1 after the scores)."""
        found = {"dsv4_attention": _attention_probe(cfg, policy, rng, q_len, k_len)}
        if self.compression != "none":
            found[f"dsv4_{self.compression}_compressor"] = _compressor_probe(cfg, policy, self.rate(cfg),
                                                                            self.compression == "csa", k_len)
        if self.compression == "csa":
            found["dsv4_index"] = _index_probe(cfg, policy, q_len, k_len)
        return found

    # --- weights -----------------------------------------------------------------------------------------------
    def hf_params(self, cfg, take, prefix: str) -> dict:
        """transformers' `self_attn.*` tensors (o_a_proj's [G * o_rank, H * Dh / G] as [G, H * Dh / G, o_rank])."""
        v4, d, h, dh = cfg.deepseek_v4, cfg.d_model, cfg.n_heads, cfg.head_dim
        p = prefix + "self_attn."
        g, group_in = v4.o_groups, h * dh // v4.o_groups
        o_a = take(p + "o_a_proj.weight", (g * v4.o_rank, group_in))
        attn = {"q_a_proj": hf_linear(take, p + "q_a_proj", d, v4.q_rank, False),
                "q_a_norm": {"scale": take(p + "q_a_norm.weight", (v4.q_rank,))},
                "q_b_proj": hf_linear(take, p + "q_b_proj", v4.q_rank, h * dh, False),
                "kv_proj": hf_linear(take, p + "kv_proj", d, dh, False),
                "kv_norm": {"scale": take(p + "kv_norm.weight", (dh,))},
                "o_a_proj": o_a.reshape(g, v4.o_rank, group_in).transpose(0, 2, 1),
                "o_b_proj": hf_linear(take, p + "o_b_proj", g * v4.o_rank, d, False),
                "sinks": take(p + "sinks", (h,))}
        if self.compression != "none":
            c = p + "compressor."
            attn["compressor"] = _compressor(take, c, d, dh, self.rate(cfg), self.compression == "csa")
        if self.compression == "csa":
            i = p + "compressor.indexer."
            attn["indexer"] = {
                "compressor": _compressor(take, i, d, v4.index_dim, v4.csa_rate, True),
                "q_b_proj": hf_linear(take, i + "q_b_proj", v4.q_rank, v4.index_heads * v4.index_dim, False),
                "weights_proj": hf_linear(take, i + "scorer.weights_proj", d, v4.index_heads, False)}
        return attn

    def hf_tensors(self, cfg, params: dict, prefix: str) -> dict:
        """Inverse of `hf_params`."""
        p = prefix + "self_attn."
        out = {f"{p}{name}.weight": params[name]["w"].T for name in ("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj")}
        out[p + "q_a_norm.weight"] = params["q_a_norm"]["scale"]
        out[p + "kv_norm.weight"] = params["kv_norm"]["scale"]
        o_a = params["o_a_proj"]
        out[p + "o_a_proj.weight"] = o_a.transpose(0, 2, 1).reshape(-1, o_a.shape[1])
        out[p + "sinks"] = params["sinks"]
        if "compressor" in params:
            out.update(_compressor_tensors(params["compressor"], p + "compressor."))
        if "indexer" in params:
            i = p + "compressor.indexer."
            out.update(_compressor_tensors(params["indexer"]["compressor"], i))
            out[i + "q_b_proj.weight"] = params["indexer"]["q_b_proj"]["w"].T
            out[i + "scorer.weights_proj.weight"] = params["indexer"]["weights_proj"]["w"].T
        return out


def _compressor(take, prefix: str, d: int, dim: int, rate: int, overlap: bool) -> dict:
    width = 2 * dim if overlap else dim
    return {"kv_proj": hf_linear(take, prefix + "kv_proj", d, width, False),
            "gate_proj": hf_linear(take, prefix + "gate_proj", d, width, False),
            "position_bias": take(prefix + "position_bias", (rate, width)),
            "kv_norm": {"scale": take(prefix + "kv_norm.weight", (dim,))}}


def _compressor_tensors(params: dict, prefix: str) -> dict:
    return {prefix + "kv_proj.weight": params["kv_proj"]["w"].T, prefix + "gate_proj.weight": params["gate_proj"]["w"].T,
            prefix + "position_bias": params["position_bias"], prefix + "kv_norm.weight": params["kv_norm"]["scale"]}


def _attention_probe(cfg, policy, rng, q_len: int, k_len: int) -> tuple:
    """(make, fn): rows of queries [q_len, H, Dh] and shared keys [k_len, Dh]; the last `window` positions visible
    to each query (entries' slots are the same kernel with other masks), sinks drawn once for every row."""
    from jaxalign.numerics import as_param, cast
    from jaxalign.numerics.attention import attention
    from jaxalign.numerics.dtypes import as_compute
    from jaxalign.model.kinds.base import random_rows, rows_width, split_rows
    h, dh, window = cfg.n_heads, cfg.head_dim, cfg.deepseek_v4.window
    sinks = jnp.asarray(rng.normal(0, 1, (h,)), jnp.float32)
    q_pos = jnp.arange(k_len - q_len, k_len, dtype=jnp.int32)[None]
    k_pos = jnp.arange(k_len, dtype=jnp.int32)[None]
    shapes = ((q_len, h, dh), (k_len, dh))

    def attn(x):
        b = x.shape[0]
        q, keys = split_rows(x, shapes)
        keys = cast(keys, policy.kv_cache_dtype)
        allowed = jnp.broadcast_to(k_pos[:, None, :] > q_pos[:, :, None] - window, (b, q_len, k_len))
        return attention(as_compute(q, policy), jnp.transpose(keys, (0, 2, 1))[:, None], keys[:, None],
                         jnp.repeat(q_pos, b, 0), jnp.repeat(k_pos, b, 0), policy, allowed=allowed,
                         sinks=as_param(sinks, policy))

    return random_rows(rows_width(shapes)), attn


def _compressor_probe(cfg, policy, rate: int, overlap: bool, k_len: int) -> tuple:
    """(make, fn): rows of per-token (kv, gate) projections over `k_len` positions rounded up to whole windows,
    pooled by a `Compressor` built once (its position bias and norm shared by every row)."""
    from flax import nnx

    from jaxalign.model.dsv4_compress import Compressor, padded_len
    from jaxalign.model.kinds.base import random_rows, rows_width, split_rows
    from jaxalign.numerics import cast
    compressor = Compressor(cfg, cfg.head_dim, rate, overlap, rngs=nnx.Rngs(0))
    n = padded_len(k_len, rate)
    shapes = ((n, compressor.width), (n, compressor.width))

    def pool(x):
        kv, gate = split_rows(x, shapes)
        return compressor.pool(cast(kv, policy.kv_cache_dtype), cast(gate, policy.kv_cache_dtype), policy)

    return random_rows(rows_width(shapes)), pool


def _index_probe(cfg, policy, q_len: int, k_len: int) -> tuple:
    """(make, fn): rows of indexer queries [q_len, H_I, D_I], entries [T, D_I] (T = the windows in `k_len`) and
    head weights [q_len, H_I]; the visible entries' scores (0 for the others), then which entries the top-k keeps
    (1.0) or not (0.0)."""
    from jaxalign.model.dsv4_compress import entry_positions, padded_len
    from jaxalign.model.kinds.base import random_rows, rows_width, split_rows
    from jaxalign.numerics import cast
    from jaxalign.numerics.dtypes import as_compute
    from jaxalign.numerics.indexer import index_scores, select_keys
    v4 = cfg.deepseek_v4
    t = padded_len(k_len, v4.csa_rate) // v4.csa_rate
    q_pos = jnp.arange(k_len - q_len, k_len, dtype=jnp.int32)[None]
    shapes = ((q_len, v4.index_heads, v4.index_dim), (t, v4.index_dim), (q_len, v4.index_heads))

    def index(x):
        b = x.shape[0]
        q, entries, weights = split_rows(x, shapes)
        e_pos = entry_positions(t, v4.csa_rate, b)
        scores = index_scores(as_compute(q, policy), cast(entries, policy.kv_cache_dtype), weights,
                              jnp.repeat(q_pos, b, 0), e_pos, policy)
        allowed = select_keys(scores, e_pos, v4.index_topk, policy.index_ties)[1]
        visible = jnp.where(jnp.isfinite(scores), scores, 0.0)  # -inf (not visible yet) would make diffs NaN
        return jnp.concatenate([visible, allowed.astype(jnp.float32)], axis=-1)

    return random_rows(rows_width(shapes)), index


class DeepseekV4CSAKind(DeepseekV4Kind):
    """Compressed sparse attention (transformers' `compressed_sparse_attention` layers)."""

    name = "dsv4_csa"
    compression = "csa"

    def index_topk(self, cfg) -> int:
        return cfg.deepseek_v4.index_topk


class DeepseekV4HCAKind(DeepseekV4Kind):
    """Heavily compressed attention (transformers' `heavily_compressed_attention` layers)."""

    name = "dsv4_hca"
    compression = "hca"
