"""Layer kind `gated_deltanet`: Qwen3.5 / Qwen3-Next linear attention (`model/deltanet.py`). Its state is the
delta rule's recurrent state [B, H, Dk, Dv] (in `delta_state_dtype`) and the short conv's last K-1 inputs
[B, K-1, C] (in `conv_state_dtype`), neither growing with the cache length; its forms are the policy's
`delta_rule` (chunked:C for trainers, recurrent for decode engines)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxalign.model.kinds.base import LayerKind, hf_field, hf_linear, split_rows
from jaxalign.numerics import dtype

FIELDS = ("linear_n_k_heads", "linear_n_v_heads", "linear_k_head_dim", "linear_v_head_dim", "linear_conv_kernel")
TARGETS = ("in_proj_qkv", "in_proj_z", "out_proj")
HF_FIELDS = dict(linear_n_k_heads="linear_num_key_heads", linear_n_v_heads="linear_num_value_heads",
                 linear_k_head_dim="linear_key_head_dim", linear_v_head_dim="linear_value_head_dim",
                 linear_conv_kernel="linear_conv_kernel_dim")


class GatedDeltaNetKind(LayerKind):
    """Gated DeltaNet layers."""

    name = "gated_deltanet"
    fields = FIELDS
    lora_names = TARGETS + ("in_proj_a", "in_proj_b")

    def validate(self, cfg) -> None:
        for field in FIELDS:
            value = getattr(cfg, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{field} = {value!r}; allowed: a positive int (a 'gated_deltanet' "
                                 f"layer needs it)")
        if cfg.linear_n_v_heads % cfg.linear_n_k_heads:
            raise ValueError(f"ModelConfig.linear_n_v_heads = {cfg.linear_n_v_heads} is not divisible by "
                             f"linear_n_k_heads = {cfg.linear_n_k_heads}; allowed: key heads dividing value heads")
        if cfg.linear_conv_kernel < 2:
            raise ValueError(f"ModelConfig.linear_conv_kernel = {cfg.linear_conv_kernel}; allowed: >= 2")

    def build(self, cfg, layer: int, *, rngs):
        from jaxalign.model.deltanet import GatedDeltaNet
        return GatedDeltaNet(cfg, rngs=rngs)

    def form(self, policy) -> str:
        return str(policy.delta_rule)

    def init_state(self, cfg, batch: int, cache_len: int, policy):
        from jaxalign.model.deltanet import dims
        h, dk, dv = cfg.linear_n_v_heads, cfg.linear_k_head_dim, cfg.linear_v_head_dim
        return {"recurrent": jnp.zeros((batch, h, dk, dv), dtype(policy.delta_state_dtype)),
                "conv": jnp.zeros((batch, cfg.linear_conv_kernel - 1, dims(cfg)[2]), dtype(policy.conv_state_dtype))}

    def config_from_hf(self, hf: dict, common: dict) -> dict:
        return {field: hf_field(hf, name) for field, name in HF_FIELDS.items()}

    def config_to_hf(self, cfg) -> dict:
        return {name: getattr(cfg, field) for field, name in HF_FIELDS.items()}

    def lora_targets(self, cfg) -> tuple[str, ...]:
        return TARGETS

    def hf_params(self, cfg, take, prefix: str) -> dict:
        from jaxalign.model.deltanet import dims
        d, h, p = cfg.d_model, cfg.linear_n_v_heads, prefix + "linear_attn."
        _, value_dim, conv_dim = dims(cfg)
        conv = take(p + "conv1d.weight", (conv_dim, 1, cfg.linear_conv_kernel))
        return {"in_proj_qkv": hf_linear(take, p + "in_proj_qkv", d, conv_dim, False),
                "in_proj_z": hf_linear(take, p + "in_proj_z", d, value_dim, False),
                "in_proj_b": hf_linear(take, p + "in_proj_b", d, h, False),
                "in_proj_a": hf_linear(take, p + "in_proj_a", d, h, False),
                "conv": np.ascontiguousarray(conv[:, 0, :].T),
                "A_log": take(p + "A_log", (h,)), "dt_bias": take(p + "dt_bias", (h,)),
                "norm": {"scale": take(p + "norm.weight", (cfg.linear_v_head_dim,))},
                "out_proj": hf_linear(take, p + "out_proj", value_dim, d, False)}

    def hf_tensors(self, cfg, params: dict, prefix: str) -> dict:
        p = prefix + "linear_attn."
        out = {f"{p}{name}.weight": params[name]["w"].T
               for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")}
        out[p + "conv1d.weight"] = np.ascontiguousarray(params["conv"].T[:, None, :])
        out[p + "A_log"], out[p + "dt_bias"] = params["A_log"], params["dt_bias"]
        out[p + "norm.weight"] = params["norm"]["scale"]
        return out

    def probes(self, cfg, policy, rng, q_len: int, k_len: int) -> dict:
        """`delta_rule`: the gated delta rule over `k_len` tokens from a zero state, as the model calls it
        (q, k, v, decay inputs and rates per row), its last `q_len` outputs."""
        from jaxalign.numerics.delta_rule import delta_rule
        hk, h = cfg.linear_n_k_heads, cfg.linear_n_v_heads
        dk, dv = cfg.linear_k_head_dim, cfg.linear_v_head_dim
        shapes = ((k_len, hk, dk), (k_len, hk, dk), (k_len, h, dv), (k_len, h), (k_len, h))

        def make(b, seed):
            return jnp.asarray(np.random.default_rng(seed).normal(0, 1, (b, sum(int(np.prod(s)) for s in shapes))),
                               jnp.float32)

        def rule(x):
            q, k, v, a, bb = split_rows(x, shapes)
            g = -jnp.log1p(jnp.exp(a))  # a decay in log space, <= 0
            beta = 1.0 / (1.0 + jnp.exp(-bb))
            out, _ = delta_rule(q, k, v, g, beta, None, None, policy)
            return out[:, -q_len:]

        return {"delta_rule": (make, rule)}
