"""OLMoE (`OlmoeForCausalLM`): GQA with q/k RMSNorm over the whole projection, softmax top-k routing."""

from __future__ import annotations

from jaxalign.interop.families.base import Family, get


class Olmoe(Family):
    model_type = "olmoe"
    architecture = "OlmoeForCausalLM"
    qk_norm = "proj"

    def config_fields(self, hf: dict, common: dict) -> dict:
        return dict(common, n_experts=get(hf, "num_experts", "num_local_experts"), expert_dim=hf["intermediate_size"],
                    norm_topk_prob=hf.get("norm_topk_prob", False), qk_norm="proj",
                    qkv_bias=hf.get("attention_bias", False))

    def export_fields(self, cfg, out: dict) -> None:
        out.update(num_experts=cfg.n_experts, intermediate_size=cfg.expert_dim, attention_bias=cfg.qkv_bias)
