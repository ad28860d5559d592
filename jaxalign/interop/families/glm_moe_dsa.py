"""GLM-5 (`GlmMoeDsaForCausalLM`): DeepSeek-V3's MLA and router with the DeepSeek sparse attention indexer on
every layer (layer kind `dsa`); attention and indexer rotate interleaved pairs."""

from __future__ import annotations

from jaxalign.interop.families.deepseek_v3 import DeepseekV3


class GlmMoeDsa(DeepseekV3):
    model_type = "glm_moe_dsa"
    architecture = "GlmMoeDsaForCausalLM"
    layer_types = {"indexed_attention": "dsa"}
    # the indexer's scores are float32 in transformers (index=f32); its exact ties are kept as torch.topk keeps them
    # on the CPU by every hf-* preset (index_ties=torch-cpu)
    emulation = ",router=f32,gate=f32"

    def extra_fields(self, hf: dict) -> dict:
        if not hf.get("rope_interleave", True):  # transformers' GLM-5 rotates interleaved pairs whatever it says
            raise ValueError("rope_interleave = False is not supported for glm_moe_dsa; supported: True (GLM-5's "
                             "attention and indexer always rotate interleaved pairs)")
        return {}  # the indexer's fields come from the layer kind (`dsa`, model/kinds/mla.py)

    def export_fields(self, cfg, out: dict) -> None:
        super().export_fields(cfg, out)
        del out["rope_interleave"], out["num_nextn_predict_layers"]
        if not cfg.rope_interleave or not cfg.index_topk:
            raise ValueError("glm_moe_dsa has interleaved RoPE and an indexer; this config has "
                             f"rope_interleave = {cfg.rope_interleave}, index_topk = {cfg.index_topk}")
        out["mlp_layer_types"] = ["dense"] * cfg.first_k_dense + ["sparse"] * cfg.n_moe_layers
