"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4; transformers `DeepseekV4HyperConnection`,
`DeepseekV4HyperHead`, `DeepseekV4DecoderLayer`): the residual stream as `hc_mult` streams [B, S, N, D].

Before each mixer and each MLP, a `HyperConnection` reads the streams (flattened, unweighted RMSNorm, one linear
map `fn` [(2 + N) * N, N * D] plus `base`, three `scale`s) and gives
    pre  = sigmoid(pre_w * scale[0] + base) + eps                 [N]   (collapses the streams to the block input)
    post = 2 * sigmoid(post_w * scale[1] + base)                  [N]   (spreads the block output over the streams)
    comb = Sinkhorn(softmax(comb_w * scale[2] + base, rows) + eps) [N, N] (mixes the streams)
with Sinkhorn: columns normalised, then `hc_iters - 1` times rows then columns (each sum + eps; the count and the
dtype are the policy's `sinkhorn_iters` and `sinkhorn_dtype`, numerics/sinkhorn.py). The block's new
streams are  post[k] * out + sum_j comb[j, k] * streams[j].  `HyperHead` collapses the streams once more (its own
pre weights) before the final norm.

Numerics: as transformers, the weights are computed in float32 (the streams read in float32); the collapse sums
in float32 and rounds once to the compute dtype; post and comb are rounded to the compute dtype and the mix is
computed in it. Sums go through the policy's reductions. Deliberate difference: transformers keeps `fn`, `base`,
`scale` and `hc_head` in float32 whatever the model's dtype; here they are rounded to the policy's param dtype
(`as_param`, then used in float32) as every parameter is, so a trainer's masters and an engine's cast copy give
the same weights (tests/test_deepseek_v4_engine.py: without it the aligned engine differed on every token).

`HyperBlock` is the block that carries the streams: the layer kind's mixer, then DeepSeek-V4's MoE
(`model/dsv4_moe.py`), each between two hyper-connections.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxalign.model import kinds
from jaxalign.model.dsv4_moe import V4MoE
from jaxalign.model.layers import RMSNorm, param
from jaxalign.numerics import NumericPolicy, as_compute, as_param, cast
from jaxalign.numerics import precision
from jaxalign.numerics.matmul import matmul
from jaxalign.numerics.reduce import reduce_sum, rms_norm, softmax
from jaxalign.numerics.schedule import policy_for
from jaxalign.numerics.sinkhorn import sinkhorn


def _f32_param(p, policy: NumericPolicy) -> jax.Array:
    """A parameter rounded to the policy's param dtype, then in float32."""
    return as_param(p[...], policy).astype(jnp.float32)


def _normed_mixes(x: jax.Array, fn: jax.Array, policy: NumericPolicy, eps: float) -> jax.Array:
    """x [B, S, N, D] flattened, RMS-normalised (no scale) and mapped by fn [O, N * D], all in float32."""
    b, s, n, d = x.shape
    flat = x.reshape(b, s, n * d).astype(jnp.float32)
    f32 = policy.replace(norm_dtype="f32", compute_dtype="f32")
    flat = rms_norm(flat, jnp.ones((n * d,), jnp.float32), f32, eps)
    return matmul(flat, fn.T, f32, operand_dtype="f32", out_dtype="f32")


def collapse(pre: jax.Array, x: jax.Array, policy: NumericPolicy) -> jax.Array:
    """sum_n pre[n] * x[n]: pre [B, S, N] float32, x [B, S, N, D] -> [B, S, D] in the compute dtype."""
    return as_compute(reduce_sum(pre[..., None] * x.astype(jnp.float32), policy, axis=2), policy)


class HyperConnection(nnx.Module):
    """One mHC site: `fn`, `base`, `scale` as transformers names them."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        v4 = cfg.deepseek_v4
        self.n, self.iters, self.eps, self.norm_eps = v4.hc_mult, v4.hc_iters, v4.hc_eps, cfg.rms_eps
        width = (2 + self.n) * self.n
        self.fn = param(rngs, (width, self.n * cfg.d_model), ("unsharded", "unsharded"), std=0.02)
        self.base = param(rngs, (width,), ("unsharded",), std=0.1)
        self.scale = param(rngs, (3,), ("unsharded",), init="ones")

    def weights(self, x: jax.Array, policy: NumericPolicy):
        """(pre [B, S, N], post [B, S, N], comb [B, S, N, N]) in float32 for streams x [B, S, N, D]."""
        n = self.n
        mixes = _normed_mixes(x, _f32_param(self.fn, policy), policy, self.norm_eps)
        base, scale = _f32_param(self.base, policy), _f32_param(self.scale, policy)
        pre_w, post_w, comb_w = mixes[..., :n], mixes[..., n:2 * n], mixes[..., 2 * n:]
        pre = precision.logistic(pre_w * scale[0] + base[:n], policy) + jnp.float32(self.eps)
        post = 2.0 * precision.logistic(post_w * scale[1] + base[n:2 * n], policy)
        comb_logits = (comb_w * scale[2] + base[2 * n:]).reshape(*comb_w.shape[:-1], n, n)
        comb = softmax(comb_logits, policy, "f32", axis=-1) + jnp.float32(self.eps)
        comb = self._sinkhorn(comb, policy)
        return pre, post, comb

    def _sinkhorn(self, comb: jax.Array, policy: NumericPolicy) -> jax.Array:
        """Columns normalised, then rounds of rows then columns (each divided by its sum + eps): `iters - 1` of
        them under the policy's `sinkhorn_iters=model`, in its `sinkhorn_dtype` (numerics/sinkhorn.py)."""
        return sinkhorn(comb, policy, self.iters, self.eps)

    def __call__(self, x: jax.Array, policy: NumericPolicy):
        """(post, comb, the collapsed block input [B, S, D])."""
        pre, post, comb = self.weights(x, policy)
        return post, comb, collapse(pre, x, policy)


def mix(post: jax.Array, comb: jax.Array, out: jax.Array, x: jax.Array, policy: NumericPolicy) -> jax.Array:
    """New streams post[k] * out + sum_j comb[j, k] * x[j], in the compute dtype (post and comb rounded to it)."""
    dt = x.dtype
    spread = cast(post, policy.compute_dtype).astype(dt)[..., None] * out.astype(dt)[:, :, None, :]
    c = cast(comb, policy.compute_dtype).astype(dt)  # [B, S, N(j), N(k)]
    mixed = reduce_sum(c[..., None] * x[:, :, :, None, :], policy, axis=2)  # [B, S, N(k), D]
    return spread + mixed


class HyperHead(nnx.Module):
    """The final collapse (`hc_head`: `hc_fn` [N, N * D], `hc_base` [N], `hc_scale` [1])."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        v4 = cfg.deepseek_v4
        self.n, self.eps, self.norm_eps = v4.hc_mult, v4.hc_eps, cfg.rms_eps
        self.hc_fn = param(rngs, (self.n, self.n * cfg.d_model), ("unsharded", "unsharded"), std=0.02)
        self.hc_base = param(rngs, (self.n,), ("unsharded",), std=0.1)
        self.hc_scale = param(rngs, (1,), ("unsharded",), init="ones")

    def __call__(self, x: jax.Array, policy: NumericPolicy) -> jax.Array:
        mixes = _normed_mixes(x, _f32_param(self.hc_fn, policy), policy, self.norm_eps)
        pre = precision.logistic(mixes * _f32_param(self.hc_scale, policy)[0] + _f32_param(self.hc_base, policy),
                                 policy) + jnp.float32(self.eps)
        return collapse(pre, x, policy)


def expand_streams(x: jax.Array, n: int) -> jax.Array:
    """The embedding [B, S, D] copied into n streams [B, S, N, D]."""
    return jnp.broadcast_to(x[:, :, None, :], (x.shape[0], x.shape[1], n, x.shape[2]))


class HyperBlock(nnx.Module):
    """DeepSeek-V4's decoder block on the streams: mHC -> norm -> mixer -> mHC mix, mHC -> norm -> MoE -> mHC mix.
    Parameter names as `transformer.Block` (`attn`, `attn_norm`, `mlp_norm`, `mlp`) plus `attn_hc`, `ffn_hc`."""

    wants_tokens = True

    def __init__(self, cfg, moe: bool, *, rngs: nnx.Rngs, layer: int = 0):
        if not moe:
            raise ValueError("DeepSeek-V4 blocks are all MoE (first_k_dense = 0)")
        self.attn_norm = RMSNorm(cfg.d_model, cfg.rms_eps, "embed", rngs=rngs)
        self.kind = cfg.layer_kinds[layer]
        self.attn = kinds.get(self.kind).build(cfg, layer, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.rms_eps, "embed", rngs=rngs)
        self.mlp = V4MoE(cfg, layer in cfg.deepseek_v4.hash_layers, rngs=rngs)
        self.is_moe = True
        self.attn_hc = HyperConnection(cfg, rngs=rngs)
        self.ffn_hc = HyperConnection(cfg, rngs=rngs)

    def __call__(self, x, positions, policy, kv=None, replay=None, layer: int = 0, index_replay=None,
                 replay_weights=None, valid=None, tokens=None):
        """x: the streams [B, S, N, D]; the rest as `transformer.Block`, plus `tokens` [B, S] for hash routing."""
        attn_policy, mlp_policy = policy_for(policy, "attn", layer), policy_for(policy, "mlp", layer)
        x = as_compute(x, attn_policy)
        post, comb, collapsed = self.attn_hc(x, attn_policy)
        h, kv, selection = self.attn(self.attn_norm(collapsed, attn_policy), positions, attn_policy, kv,
                                     valid=valid, index_replay=index_replay)
        x = mix(post, comb, h, x, attn_policy)
        post, comb, collapsed = self.ffn_hc(x, mlp_policy)
        h, routing = self.mlp(self.mlp_norm(collapsed, mlp_policy), mlp_policy, replay, replay_weights,
                              tokens=tokens)
        return mix(post, comb, h, x, mlp_policy), kv, routing, selection
