"""Qwen2-MoE (`Qwen2MoeForCausalLM`): GQA with q/k/v biases, softmax top-k routing without renormalisation, a
sigmoid-gated shared expert."""

from __future__ import annotations

from jaxalign.interop.families.base import Family, get


class Qwen2Moe(Family):
    model_type = "qwen2_moe"
    architecture = "Qwen2MoeForCausalLM"

    def config_fields(self, hf: dict, common: dict) -> dict:
        return dict(common, n_experts=get(hf, "num_experts", "num_local_experts"),
                    expert_dim=hf["moe_intermediate_size"], norm_topk_prob=hf.get("norm_topk_prob", False),
                    qkv_bias=hf.get("qkv_bias", True), shared_expert_dim=hf["shared_expert_intermediate_size"],
                    shared_expert_gate=True)

    def export_fields(self, cfg, out: dict) -> None:
        out.update(num_experts=cfg.n_experts, moe_intermediate_size=cfg.expert_dim, qkv_bias=cfg.qkv_bias,
                   shared_expert_intermediate_size=cfg.shared_expert_dim)
