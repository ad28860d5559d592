"""Layer kinds `sink_attention` and `sliding_sink_attention`: gpt-oss's attention (GQA with per-head attention
sinks, biased q/k/v/o projections, YaRN RoPE), over every earlier position or over a sliding window of
`sliding_window` positions. The module is `model/sink_attention.py`; the engine state is GQA's KV cache (a
sliding layer keeps every position too and masks the ones outside its window, so trainer and engine read the
same keys in the same slots).

The kinds own `sliding_window` and `rope_yarn`; where the sink enters the softmax is the policy's `attn_sink`
(numerics/attention.py).
"""

from __future__ import annotations

import numpy as np

from jaxalign.model.kinds.gqa import GQA, attention_probe
from jaxalign.model.rope_scaling import Yarn
from jaxalign.numerics.dtypes import as_param


class SinkAttentionKind(GQA):
    """Full causal attention with sinks (transformers' `full_attention` layers of gpt-oss)."""

    name = "sink_attention"
    fields = ("sliding_window", "rope_yarn")
    sliding = False

    def validate(self, cfg) -> None:
        """GQA's checks, and a window (>= 0; > 0 for the sliding kind)."""
        super().validate(cfg)
        window = cfg.sliding_window
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"ModelConfig.sliding_window = {window!r}; allowed: an int >= 0 (0: no sliding layer)")
        if self.sliding and window <= 0:
            raise ValueError(f"ModelConfig.sliding_window = {window} with a {self.name!r} layer; allowed: a "
                             f"positive int (the positions a query sees, its own included)")

    def build(self, cfg, layer: int, *, rngs):
        """`SinkAttention` with this kind's window (None for full attention)."""
        from jaxalign.model.sink_attention import SinkAttention
        return SinkAttention(cfg, cfg.sliding_window if self.sliding else None, rngs=rngs)

    def form(self, policy) -> str:
        """The attention form and where the sink enters (e.g. `full,sink=seed`)."""
        return f"{policy.attention},sink={policy.attn_sink}"

    # --- transformers config -----------------------------------------------------------------------------------
    def config_from_hf(self, hf: dict, common: dict) -> dict:
        """`sliding_window` (required when a layer slides) and the YaRN settings of `rope_parameters` /
        `rope_scaling` (rope_type `default` or `yarn`; the family's `rope_types` refuse others)."""
        sliding = "sliding_attention" in (hf.get("layer_types") or ())
        window = hf.get("sliding_window")
        if sliding and window is None:
            raise ValueError(f"config.json has no value for sliding_window (required for model_type "
                             f"{hf.get('model_type')!r} with sliding_attention layers)")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
            raise ValueError(f"sliding_window = {window!r} is not supported; allowed: a positive int")
        field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
        params = hf.get(field) or {}
        yarn = Yarn.from_hf(params, field) if params.get("rope_type", params.get("type")) == "yarn" else None
        return {"sliding_window": window if sliding else 0, "rope_yarn": yarn}

    def config_to_hf(self, cfg) -> dict:
        """`sliding_window` (null without one) and, with YaRN, its `rope_parameters`."""
        out = {"sliding_window": cfg.sliding_window or None}
        if cfg.rope_yarn is not None:
            out["rope_parameters"] = {"rope_theta": cfg.rope_theta, **cfg.rope_yarn.to_hf()}
        return out

    # --- weights -----------------------------------------------------------------------------------------------
    def hf_params(self, cfg, take, prefix: str) -> dict:
        """GQA's projections plus o_proj's bias (with attention_bias) and `self_attn.sinks` [H]."""
        attn = super().hf_params(cfg, take, prefix)
        p = prefix + "self_attn."
        if cfg.qkv_bias:  # attention_bias: o_proj too
            attn["o_proj"]["b"] = take(p + "o_proj.bias", (cfg.d_model,))
        attn["sinks"] = take(p + "sinks", (cfg.n_heads,))
        return attn

    def hf_tensors(self, cfg, params: dict, prefix: str) -> dict:
        """Inverse of `hf_params`."""
        out = super().hf_tensors(cfg, params, prefix)  # o_proj's bias with the others
        out[prefix + "self_attn.sinks"] = params["sinks"]
        return out

    def probes(self, cfg, policy, rng, q_len: int, k_len: int) -> dict:
        """The attention kernel with sinks (random, one per head) and, for the sliding kind, a window shorter
        than the probe's keys."""
        sinks = as_param(np.asarray(rng.normal(0, 1, cfg.n_heads), np.float32), policy)
        window = max(1, min(cfg.sliding_window, k_len // 2)) if self.sliding else None
        return {self.name: attention_probe(cfg, policy, q_len, k_len, window=window, sinks=sinks)}


class SlidingSinkAttentionKind(SinkAttentionKind):
    """Sliding-window attention with sinks (transformers' `sliding_attention` layers of gpt-oss)."""

    name = "sliding_sink_attention"
    sliding = True
