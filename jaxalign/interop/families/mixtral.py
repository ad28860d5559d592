"""Mixtral (`MixtralForCausalLM`): GQA, softmax top-k routing, experts `block_sparse_moe.experts.{e}.w1/w3/w2`;
its top-k routing weights stay float32 in transformers."""

from __future__ import annotations

from jaxalign.interop.families.base import Family, get


class Mixtral(Family):
    model_type = "mixtral"
    architecture = "MixtralForCausalLM"
    moe_prefix = "block_sparse_moe."
    expert_names = ("w1", "w3", "w2")
    emulation = ",gate=f32"  # Mixtral keeps the top-k routing weights in float32

    def refuse(self, hf: dict) -> None:
        super().refuse(hf)
        window, longest = hf.get("sliding_window"), hf.get("max_position_embeddings", 4096)
        if window is not None and window < longest:
            raise ValueError(f"sliding_window = {window} is not supported; supported: null, or a window >= "
                             f"max_position_embeddings = {longest} (which masks nothing)")

    def config_fields(self, hf: dict, common: dict) -> dict:
        return dict(common, n_experts=get(hf, "num_local_experts", "num_experts"), expert_dim=hf["intermediate_size"],
                    norm_topk_prob=True)

    def export_fields(self, cfg, out: dict) -> None:
        out.update(num_local_experts=cfg.n_experts, intermediate_size=cfg.expert_dim)
