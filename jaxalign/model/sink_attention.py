"""gpt-oss's attention: grouped-query attention with attention sinks, an optional sliding window, biased q/k/v/o
projections and (optionally) YaRN RoPE. The mixer of the `sink_attention` and `sliding_sink_attention` kinds
(`model/kinds/sinks.py`); its KV cache is GQA's (`model/attention.py`).

transformers' `GptOssAttention`: `attention_bias` puts a bias on all four projections (jaxalign's `qkv_bias` on
q/k/v, and on o_proj under these kinds); `sinks` [H] is one logit per query head that joins the softmax and is
dropped after it; sliding layers see the keys of their last `sliding_window` positions (their own included).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
from flax import nnx

from jaxalign.model.attention import Attention
from jaxalign.model.layers import Linear, param
from jaxalign.numerics import NumericPolicy, as_param
from jaxalign.numerics.attention import attention, rope

if TYPE_CHECKING:
    from jaxalign.model.config import ModelConfig


class SinkAttention(Attention):
    """GQA with per-head sinks (`attn_sink` says where they enter the softmax) and a window (None: full causal)."""

    def __init__(self, cfg: ModelConfig, window: int | None, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        if cfg.qkv_bias:  # transformers' attention_bias: o_proj has a bias too
            self.o_proj = Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, ("q_heads", "embed"), rngs=rngs, bias=True)
        self.sinks = param(rngs, (cfg.n_heads,), ("q_heads",), std=1.0)
        self.window = window

    def rotate(self, x: jax.Array, positions: jax.Array, policy: NumericPolicy) -> jax.Array:
        """RoPE, YaRN-scaled when the config has `rope_yarn`."""
        cfg = self.cfg
        if cfg.rope_yarn is None:
            return super().rotate(x, positions, policy)
        return rope(x, positions, cfg.rope_theta, policy, cfg.rotary_dim,
                    inv_freq=cfg.rope_yarn.inv_freq(cfg.rope_theta, cfg.rotary_dim),
                    attention_factor=cfg.rope_yarn.attention_factor)

    def attend(self, q, keys, values, q_pos, k_pos, policy: NumericPolicy) -> jax.Array:
        """Attention with this layer's sinks and window."""
        return attention(q, keys, values, q_pos, k_pos, policy, window=self.window,
                         sinks=as_param(self.sinks[...], policy))
