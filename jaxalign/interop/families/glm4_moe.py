"""GLM-4.5 (`Glm4MoeForCausalLM`): GQA (optional per-head q/k norm, partial rotary), the sigmoid grouped router
with a selection bias, shared experts and dense first layers."""

from __future__ import annotations

from jaxalign.interop.families.base import Family, get


class Glm4Moe(Family):
    model_type = "glm4_moe"
    architecture = "Glm4MoeForCausalLM"
    router = "sigmoid_grouped"
    qk_norm = None  # use_qk_norm says
    emulation = ",router=f32,gate=f32"  # router weight/bias kept in f32; f32 weights times bf16 expert outputs

    expert_counts = ("n_routed_experts", "num_local_experts", "num_experts")  # spellings of the expert count

    def groups(self, hf: dict) -> tuple:
        """(n_group, topk_group) as config.json gives them (absent: 1)."""
        return hf.get("n_group", 1), hf.get("topk_group", 1)

    def router_fields(self, hf: dict) -> dict:
        """The sigmoid grouped router, its shared experts and dense first layers (DeepSeek-V3 spells them alike)."""
        n_shared = hf.get("n_shared_experts") or 0
        n_groups, topk_groups = self.groups(hf)
        return dict(router="sigmoid_grouped", n_experts=get(hf, *self.expert_counts),
                    expert_dim=hf["moe_intermediate_size"], n_groups=n_groups, topk_groups=topk_groups,
                    routed_scaling_factor=hf.get("routed_scaling_factor", 1.0),
                    norm_topk_prob=hf.get("norm_topk_prob", True), n_shared_experts=n_shared,
                    shared_expert_dim=n_shared * hf["moe_intermediate_size"],
                    first_k_dense=hf.get("first_k_dense_replace", 0))

    def config_fields(self, hf: dict, common: dict) -> dict:
        return dict(common, **self.router_fields(hf), qkv_bias=hf.get("attention_bias", False),
                    qk_norm="head" if hf.get("use_qk_norm", False) else "none")

    def router_export(self, cfg, out: dict) -> None:
        out.update(n_routed_experts=cfg.n_experts, moe_intermediate_size=cfg.expert_dim, n_group=cfg.n_groups,
                   topk_group=cfg.topk_groups, routed_scaling_factor=cfg.routed_scaling_factor,
                   n_shared_experts=cfg.n_shared_experts, first_k_dense_replace=cfg.first_k_dense,
                   attention_bias=cfg.qkv_bias)

    def export_fields(self, cfg, out: dict) -> None:
        self.router_export(cfg, out)
        out["use_qk_norm"] = cfg.qk_norm == "head"
