"""Qwen3.5-MoE: `qwen3_5_moe_text` (`Qwen3_5MoeForCausalLM`) and the text tower of `qwen3_5_moe`
(`Qwen3_5MoeForConditionalGeneration`). A hybrid: `layer_types` mixes gated DeltaNet layers (`linear_attention`,
kind `gated_deltanet`) with gated full-attention layers (`full_attention`, kind `gqa` with a sigmoid output gate,
per-head q/k norms and partial rotary); every RMSNorm but the DeltaNet's gated one is zero-centred (1 + w);
softmax top-k routing with renormalised weights and a sigmoid-gated shared expert.

The vision-language checkpoint's text tower lives under `model.language_model.`; its vision tower
(`model.visual.*`) is not loaded (text only), and `load` warns how many tensors it left out.
"""

from __future__ import annotations

from jaxalign.interop.families.base import Family, get


class Qwen3_5MoeText(Family):
    model_type = "qwen3_5_moe_text"
    architecture = "Qwen3_5MoeForCausalLM"
    layer_types = {"linear_attention": "gated_deltanet", "full_attention": "gqa"}
    qk_norm = "head"
    # Qwen3.5 always renormalises its top-k weights (no config field); a family that reads `norm_topk_prob` from
    # config.json sets this False
    always_renormalises = True

    def refuse(self, hf: dict) -> None:
        super().refuse(hf)
        if hf.get("attention_bias"):
            raise ValueError("attention_bias = True is not supported for qwen3_5_moe; supported: False (no q/k/v/o "
                             "biases)")
        if hf.get("layer_types") is None:
            raise ValueError("config.json has no value for layer_types (required for model_type "
                             f"{hf.get('model_type')!r}: which layers are linear_attention / full_attention)")
        if hf.get("mtp_num_hidden_layers"):
            raise ValueError(f"mtp_num_hidden_layers = {hf['mtp_num_hidden_layers']} (multi-token prediction "
                             f"layers) is not supported; supported: 0")

    def layer_kinds(self, hf: dict):
        kinds = super().layer_kinds(hf)
        if kinds is None and hf.get("layer_types") is not None:  # one kind everywhere: still named per layer
            kinds = tuple(self.layer_types[t] for t in hf["layer_types"])
        return kinds

    def config_fields(self, hf: dict, common: dict) -> dict:
        renormalise = True if self.always_renormalises else bool(hf.get("norm_topk_prob", True))
        return dict(common, n_experts=get(hf, "num_experts"), expert_dim=hf["moe_intermediate_size"],
                    norm_topk_prob=renormalise, qk_norm="head", shared_expert_dim=hf["shared_expert_intermediate_size"],
                    shared_expert_gate=True, attn_output_gate=True, norm_zero_centred=True,
                    dense_mlp_dim=hf.get("intermediate_size") or hf["moe_intermediate_size"])

    def check_export(self, cfg) -> None:
        super().check_export(cfg)
        if not (cfg.attn_output_gate and cfg.norm_zero_centred and cfg.shared_expert_gate
                and (cfg.norm_topk_prob or not self.always_renormalises) and cfg.first_k_dense == 0
                and not cfg.qkv_bias):
            needs = ("attn_output_gate, norm_zero_centred, shared_expert_gate and norm_topk_prob"
                     if self.always_renormalises else "attn_output_gate, norm_zero_centred and shared_expert_gate")
            raise ValueError(f"config does not fit {self.model_type}: it needs {needs} set, no dense layers and no "
                             f"q/k/v biases")

    def export_fields(self, cfg, out: dict) -> None:
        out.update(num_experts=cfg.n_experts, moe_intermediate_size=cfg.expert_dim, attention_bias=False,
                   shared_expert_intermediate_size=cfg.shared_expert_dim)
        for name in ("intermediate_size",) + (("norm_topk_prob",) if self.always_renormalises else ()):
            out.pop(name, None)
        if cfg.layer_types is None:  # every layer full attention
            out["layer_types"] = ["full_attention"] * cfg.n_layers


class Qwen3_5Moe(Qwen3_5MoeText):
    """The vision-language checkpoint: its `text_config` and the text tower's tensors."""

    model_type = "qwen3_5_moe"
    architecture = "Qwen3_5MoeForConditionalGeneration"
    tensor_prefix = "model.language_model."

    @staticmethod
    def text(hf: dict) -> dict:
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise ValueError("config.json of model_type 'qwen3_5_moe' has no text_config object")
        return {**text, "tie_word_embeddings": hf.get("tie_word_embeddings", text.get("tie_word_embeddings"))}

    def refuse(self, hf: dict) -> None:
        super().refuse(self.text(hf) if "text_config" in hf or "layer_types" not in hf else hf)

    def config_from_hf(self, hf: dict):
        cfg = super().config_from_hf(self.text(hf))
        return cfg.replace(family=self.model_type)

    def ignores(self, name: str) -> bool:
        return name.startswith("model.visual.")

    def ignored_note(self) -> str:
        return "the vision tower (model.visual.*) is not loaded: jaxalign runs the text model only"

    def check_export(self, cfg) -> None:
        raise ValueError("a qwen3_5_moe (vision-language) checkpoint cannot be written without its vision tower; "
                         "export the text model as qwen3_5_moe_text (ModelConfig.family = 'qwen3_5_moe_text')")
