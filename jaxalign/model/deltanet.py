"""Gated DeltaNet: the linear-attention mixer of Qwen3.5 / Qwen3-Next (transformers' `Qwen3_5MoeGatedDeltaNet`).

in_proj_qkv -> short causal depthwise conv + SiLU -> q, k, v; in_proj_b -> beta, in_proj_a -> decay g (with A_log
and dt_bias); the gated delta rule (`numerics/delta_rule.py`, its form the policy's `delta_rule`); a gated
RMSNorm per value head with in_proj_z as its gate; out_proj. Its engine state is {"recurrent": [B, H, Dk, Dv],
"conv": [B, K-1, conv channels]} -- no dependence on the cache length.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from jaxalign.model.layers import Linear, RMSNorm, param
from jaxalign.numerics import NumericPolicy, as_param
from jaxalign.numerics.delta_rule import causal_conv, delta_rule, gated_rms_norm, gates

if TYPE_CHECKING:  # annotations only: config imports the layer kinds, which import this module
    from jaxalign.model.config import ModelConfig


def dims(cfg: ModelConfig) -> tuple[int, int, int]:
    """(key dim Hk*Dk, value dim H*Dv, conv channels 2*key dim + value dim)."""
    key_dim = cfg.linear_n_k_heads * cfg.linear_k_head_dim
    value_dim = cfg.linear_n_v_heads * cfg.linear_v_head_dim
    return key_dim, value_dim, 2 * key_dim + value_dim


class GatedDeltaNet(nnx.Module):
    """The mixer (call as in `model/kinds/base.py`); parameters named as transformers names them."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, h = cfg.d_model, cfg.linear_n_v_heads
        key_dim, value_dim, conv_dim = dims(cfg)
        self.in_proj_qkv = Linear(d, conv_dim, ("embed", "unsharded"), rngs=rngs)
        self.in_proj_z = Linear(d, value_dim, ("embed", "unsharded"), rngs=rngs)
        self.in_proj_b = Linear(d, h, ("embed", "unsharded"), rngs=rngs)
        self.in_proj_a = Linear(d, h, ("embed", "unsharded"), rngs=rngs)
        # conv taps [K, C]: tap j multiplies the input K-1-j steps back (transformers' conv1d.weight[:, 0, j])
        self.conv = param(rngs, (cfg.linear_conv_kernel, conv_dim), ("unsharded", "unsharded"),
                          fan_in=cfg.linear_conv_kernel)
        # decays spread over transformers' init range exp(A_log) in [1, 16]
        self.A_log = nnx.Param(jnp.log(jnp.linspace(1.0, 16.0, h, dtype=jnp.float32)), logical_axes=("unsharded",))
        self.dt_bias = param(rngs, (h,), ("unsharded",), init="ones")
        self.norm = RMSNorm(cfg.linear_v_head_dim, cfg.rms_eps, "unsharded", rngs=rngs)
        self.out_proj = Linear(value_dim, d, ("unsharded", "embed"), rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, policy: NumericPolicy, state=None, *, valid=None,
                 index_replay=None):
        """x [B, S, D] -> (out [B, S, D], new state or None, None). Invalid entries leave both states as they
        were (`numerics/delta_rule.py`)."""
        cfg = self.cfg
        b, s, _ = x.shape
        key_dim, value_dim, _ = dims(cfg)
        mixed, conv_state = causal_conv(self.in_proj_qkv(x, policy), as_param(self.conv[...], policy),
                                        None if state is None else state["conv"], valid, policy)
        q, k, v = jnp.split(mixed, [key_dim, 2 * key_dim], axis=-1)
        q = q.reshape(b, s, cfg.linear_n_k_heads, cfg.linear_k_head_dim)
        k = k.reshape(b, s, cfg.linear_n_k_heads, cfg.linear_k_head_dim)
        v = v.reshape(b, s, cfg.linear_n_v_heads, cfg.linear_v_head_dim)
        g, beta = gates(self.in_proj_a(x, policy), self.in_proj_b(x, policy), as_param(self.A_log[...], policy),
                        as_param(self.dt_bias[...], policy), policy)
        out, recurrent = delta_rule(q, k, v, g, beta, None if state is None else state["recurrent"], valid, policy)
        z = self.in_proj_z(x, policy).reshape(b, s, cfg.linear_n_v_heads, cfg.linear_v_head_dim)
        out = gated_rms_norm(out.astype(x.dtype), self.norm.scale[...], z, policy, cfg.rms_eps)
        out = self.out_proj(out.reshape(b, s, value_dim), policy)
        return out, (None if state is None else {"recurrent": recurrent, "conv": conv_state}), None
