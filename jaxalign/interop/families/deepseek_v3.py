"""DeepSeek-V3 / Kimi K2 (`DeepseekV3ForCausalLM`): multi-head latent attention (layer kind `mla`) over the
GLM-4.5 sigmoid grouped router, with shared experts and dense first layers."""

from __future__ import annotations

from jaxalign.interop.families.glm4_moe import Glm4Moe


class DeepseekV3(Glm4Moe):
    model_type = "deepseek_v3"
    architecture = "DeepseekV3ForCausalLM"
    layer_types = {"full_attention": "mla"}
    qk_norm = "none"
    expert_counts = ("n_routed_experts", "num_local_experts")
    emulation = ",router=f32,gate=f32"  # the same router (weight and bias kept in f32)

    def groups(self, hf: dict) -> tuple:
        return hf.get("n_group") or 1, hf.get("topk_group") or 1

    def check_mlp_layer_types(self, hf: dict) -> None:
        dense = hf.get("first_k_dense_replace", 0)
        mlp_types = hf.get("mlp_layer_types")
        expected = ["dense"] * dense + ["sparse"] * (hf["num_hidden_layers"] - dense)
        if mlp_types is not None and list(mlp_types) != expected:
            raise ValueError(f"mlp_layer_types = {mlp_types} is not supported; supported: the first "
                             f"first_k_dense_replace = {dense} layers 'dense', the rest 'sparse'")

    def extra_fields(self, hf: dict) -> dict:
        """Fields a subclass adds (GLM-5: the indexer)."""
        return {}

    def config_fields(self, hf: dict, common: dict) -> dict:
        # `common` holds the MLA fields already (layer kind `mla`, model/kinds/mla.py)
        self.check_mlp_layer_types(hf)
        return dict(common, **self.router_fields(hf), **self.extra_fields(hf))

    def export_fields(self, cfg, out: dict) -> None:
        self.router_export(cfg, out)
        del out["head_dim"]  # transformers derives it (= qk_rope_head_dim); the MLA fields come from the kind
        out.update(rope_interleave=cfg.rope_interleave, num_nextn_predict_layers=0)
