"""DeepSeek-V4's attention (transformers `DeepseekV4Attention`), the mixer of the `dsv4_sliding`, `dsv4_csa` and
`dsv4_hca` kinds (`model/kinds/dsv4.py`).

- queries through a bottleneck: q_a_proj -> RMSNorm (q_a_norm) -> q_b_proj, then an unweighted RMSNorm per head;
- one shared key = value head: kv_proj -> RMSNorm (kv_norm); RoPE on the last `rotary_dim` dims of queries and
  keys (interleaved pairs, `model/dsv4.rope_tail`), theta `rope_theta` on sliding layers and the compressed
  theta on CSA / HCA layers;
- every layer attends to the raw keys of its last `window` positions (its own included), a CSA / HCA layer also
  to its compressor's entries (`model/dsv4_compress.py`): HCA to every complete entry, CSA to the `index_topk`
  entries its indexer picks among the complete ones; one learned sink logit per head joins the softmax;
- the value's rotated tail is un-rotated at the query's position (RoPE at -position), then the grouped low-rank
  output projection: the heads' outputs in `o_groups` groups, each group projected to `o_rank` (`o_a_proj`
  [G, H * Dh / G, o_rank]), then `o_b_proj` to the model width.

Keys are laid out so that the trainer's key axis is a prefix of the engine's: raw keys in blocks of `rate` slots,
each block followed by its compressed entry (slot = position for raw keys, block w's entry after them). Invisible
slots are masked (-inf), so under `reduction=tree` a query's attention is the same bits over S or over the
engine's M slots. The mask of a compressed entry is carried in `allowed` (its key position is 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxalign.model.dsv4 import rope_tail
from jaxalign.model.dsv4_compress import Compressor, Indexer, padded_len
from jaxalign.model.layers import Linear, RMSNorm, param
from jaxalign.numerics import NumericPolicy, as_param, cast
from jaxalign.numerics.attention import attention
from jaxalign.numerics.indexer import index_scores, replayed_keys, select_keys, torch_row_len
from jaxalign.numerics.matmul import matmul
from jaxalign.numerics.reduce import rms_norm

COMPRESSION = ("none", "csa", "hca")


def unweighted_rms_norm(x: jax.Array, policy: NumericPolicy, eps: float) -> jax.Array:
    """RMSNorm over the last axis without a learned scale (transformers' `DeepseekV4UnweightedRMSNorm`)."""
    return rms_norm(x, jnp.ones((x.shape[-1],), jnp.float32), policy, eps)


def interleave(raw: jax.Array, entries: jax.Array, rate: int, axis: int) -> jax.Array:
    """Raw slots [.., N, ..] (N = T * rate) and entries [.., T, ..] along `axis` as blocks of `rate` raw slots,
    each followed by its entry: [.., T * (rate + 1), ..]."""
    raw = jnp.moveaxis(raw, axis, -1)
    entries = jnp.moveaxis(entries, axis, -1)
    t = entries.shape[-1]
    blocks = raw.reshape(raw.shape[:-1] + (t, rate))
    out = jnp.concatenate([blocks, entries[..., None]], axis=-1).reshape(raw.shape[:-1] + (t * (rate + 1),))
    return jnp.moveaxis(out, -1, axis)


class V4Attention(nnx.Module):
    """One DeepSeek-V4 attention layer; `compression` is `none` (sliding only), `csa` or `hca`."""

    def __init__(self, cfg, compression: str, *, rngs: nnx.Rngs):
        if compression not in COMPRESSION:
            raise ValueError(f"compression {compression!r}; allowed: {', '.join(COMPRESSION)}")
        v4 = cfg.deepseek_v4
        self.cfg, self.compression = cfg, compression
        h, dh = cfg.n_heads, cfg.head_dim
        self.q_a_proj = Linear(cfg.d_model, v4.q_rank, ("embed", "unsharded"), rngs=rngs)
        self.q_a_norm = RMSNorm(v4.q_rank, cfg.rms_eps, "norm", rngs=rngs)
        self.q_b_proj = Linear(v4.q_rank, h * dh, ("unsharded", "q_heads"), rngs=rngs)
        self.kv_proj = Linear(cfg.d_model, dh, ("embed", "unsharded"), rngs=rngs)
        self.kv_norm = RMSNorm(dh, cfg.rms_eps, "norm", rngs=rngs)
        group_in = h * dh // v4.o_groups
        self.o_a_proj = param(rngs, (v4.o_groups, group_in, v4.o_rank), ("unsharded", "q_heads", "unsharded"),
                              fan_in=group_in)
        self.o_b_proj = Linear(v4.o_groups * v4.o_rank, cfg.d_model, ("unsharded", "embed"), rngs=rngs)
        self.sinks = param(rngs, (h,), ("q_heads",), std=1.0)
        rate = v4.csa_rate if compression == "csa" else v4.hca_rate
        self.rate = rate if compression != "none" else 1
        self.compressor = (Compressor(cfg, dh, rate, compression == "csa", rngs=rngs)
                           if compression != "none" else None)
        self.indexer = Indexer(cfg, rngs=rngs) if compression == "csa" else None

    @property
    def theta(self) -> float:
        """This layer's RoPE base: the compressed theta on CSA / HCA layers, rope_theta on sliding ones."""
        return self.cfg.rope_theta if self.compression == "none" else self.cfg.deepseek_v4.compress_theta

    @property
    def inv_freq(self):
        """This layer's scaled RoPE frequencies (the compressed layers' YaRN), or None (theta's own)."""
        return None if self.compression == "none" else self.cfg.deepseek_v4.compress_inv_freq(self.cfg.rotary_dim)

    def _select(self, x, q_latent, positions, policy, state, index_replay, valid):
        """The CSA indexer: (allowed [B, S, T] entries each query attends to, selection or None, new state)."""
        v4 = self.cfg.deepseek_v4
        keys, k_pos, new_state = self.indexer.compressor.entries(x, positions, policy, state)
        q, weights = self.indexer.queries(x, q_latent, positions, policy)
        scores = index_scores(q, keys, weights, positions, k_pos, policy)
        row_len = torch_row_len(positions, k_pos, valid) if policy.index_ties == "torch-cpu" else None
        chosen, allowed, margin = select_keys(scores, k_pos, v4.index_topk, policy.index_ties, row_len)
        if index_replay is not None:
            allowed = replayed_keys(index_replay, k_pos, allowed) & (k_pos[:, None, :] <= positions[:, :, None])
        return allowed, (chosen, margin), new_state

    def __call__(self, x: jax.Array, positions: jax.Array, policy: NumericPolicy, state=None, *, valid=None,
                 index_replay=None):
        """The mixer call of `model/kinds/base.py`. `state` (engine): {"kv": [B, M, Dh]} raw keys at slot =
        position, plus {"compressor": ..., "indexer": ...} projections for CSA / HCA layers. `index_replay`
        [B, S, index_topk] (CSA layers): recorded entry positions each query attends to. Returns (out, new state
        or None, the indexer's (entry positions, margins) on CSA layers, else None)."""
        cfg, v4 = self.cfg, self.cfg.deepseek_v4
        b, s, _ = x.shape
        h, dh = cfg.n_heads, cfg.head_dim
        freqs = self.inv_freq
        q_latent = self.q_a_norm(self.q_a_proj(x, policy), policy)
        q = unweighted_rms_norm(self.q_b_proj(q_latent, policy).reshape(b, s, h, dh), policy, cfg.rms_eps)
        q = rope_tail(q, positions, self.theta, cfg.rotary_dim, policy, freqs)
        kv = self.kv_norm(self.kv_proj(x, policy), policy)
        kv = cast(rope_tail(kv[:, :, None], positions, self.theta, cfg.rotary_dim, policy, freqs)[:, :, 0],
                  policy.kv_cache_dtype)
        new_state = None
        if state is None:
            n = padded_len(s, self.rate)
            raw = jnp.pad(kv, ((0, 0), (0, n - s), (0, 0)))
        else:
            rows = jnp.arange(b)[:, None]
            raw = state["kv"].at[rows, positions].set(kv, mode="drop")
            n = raw.shape[1]
            new_state = {"kv": raw}
        raw_pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
        raw_allowed = raw_pos[:, None, :] > positions[:, :, None] - v4.window  # [B, S, N]; causal in attention
        selection = None
        if self.compressor is None:
            keys, k_pos, allowed = raw, raw_pos, raw_allowed
        else:
            entries, e_pos, c_state = self.compressor.entries(
                x, positions, policy, None if state is None else state["compressor"])
            if self.indexer is not None:
                e_allowed, selection, i_state = self._select(x, q_latent, positions, policy,
                                                             None if state is None else state["indexer"],
                                                             index_replay, valid)
            else:
                e_allowed, i_state = e_pos[:, None, :] <= positions[:, :, None], None
            if new_state is not None:
                new_state["compressor"] = c_state
                if i_state is not None:
                    new_state["indexer"] = i_state
            keys = interleave(raw, entries, self.rate, 1)
            k_pos = interleave(raw_pos, jnp.zeros_like(e_pos), self.rate, 1)
            allowed = interleave(raw_allowed, e_allowed, self.rate, 2)
        out = attention(q, jnp.transpose(keys, (0, 2, 1))[:, None], keys[:, None], positions, k_pos, policy,
                        allowed=allowed, sinks=as_param(self.sinks[...], policy))
        out = rope_tail(out, -positions, self.theta, cfg.rotary_dim, policy, freqs)  # un-rotate the values' tail
        groups = out.reshape(b, s, v4.o_groups, -1)
        w = as_param(self.o_a_proj[...], policy)
        mixed = jnp.concatenate([matmul(groups[:, :, g], w[g], policy) for g in range(v4.o_groups)], axis=-1)
        return self.o_b_proj(mixed, policy), new_state, selection
