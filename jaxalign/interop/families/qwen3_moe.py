"""Qwen3-MoE (`Qwen3MoeForCausalLM`): GQA with per-head q/k RMSNorm, softmax top-k routing."""

from __future__ import annotations

from jaxalign.interop.families.base import Family, get


class Qwen3Moe(Family):
    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    qk_norm = "head"

    def config_fields(self, hf: dict, common: dict) -> dict:
        return dict(common, n_experts=get(hf, "num_experts", "num_local_experts"),
                    expert_dim=hf["moe_intermediate_size"], norm_topk_prob=hf.get("norm_topk_prob", True),
                    qk_norm="head", qkv_bias=hf.get("attention_bias", False))

    def export_fields(self, cfg, out: dict) -> None:
        out.update(num_experts=cfg.n_experts, moe_intermediate_size=cfg.expert_dim, attention_bias=cfg.qkv_bias)
