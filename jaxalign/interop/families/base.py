"""What every transformers MoE family shares: the config fields all of them spell alike, the refusals that hold
for all of them, the decoder-layer and MoE weight names. A family module subclasses `Family` and overrides what
its transformers modeling file does differently."""

from __future__ import annotations

from jaxalign.model import kinds
from jaxalign.model.config import ModelConfig
from jaxalign.model.kinds.base import hf_field as get  # noqa: F401  (the families import it from here)


def rope(hf: dict, rope_types: tuple[str, ...] = ("default",), default_theta: float = 10000.0
         ) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor); a RoPE scaling other than `rope_types` is refused by name (a layer
    kind that owns a scaling reads its settings)."""
    field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in rope_types and rope_type is not None:
        unscaled = " (unscaled RoPE)" if rope_types == ("default",) else ""
        raise ValueError(f"{field}.rope_type = {rope_type!r} (a RoPE scaling) is not supported; supported: "
                         f"{', '.join(rope_types)}{unscaled}")
    theta = params.get("rope_theta", hf.get("rope_theta", default_theta))
    return float(theta), float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))


class Family:
    """One transformers `model_type`: config.json <-> ModelConfig, and the names of its weights.

    Subclasses set `model_type` and `architecture`, implement `config_fields` (the ModelConfig fields besides
    the common ones) and `export_fields` (the config.json fields besides the common ones), and override the
    weight-name attributes where the modeling file differs."""

    model_type: str = ""
    architecture: str = ""
    # transformers' `layer_types` values this family runs -> jaxalign layer kind (jaxalign.model.kinds)
    layer_types: dict[str, str] = {"full_attention": "gqa"}
    router: str = "softmax_topk"  # what config_to_hf checks a ModelConfig against
    qk_norm: str | None = "none"  # None: either (a config field says)
    # the MoE block's module name in a decoder layer and its experts' (gate, up, down) names, as `save` writes
    # them (reading detects either layout: `block_sparse_moe.` or `mlp.`, w1/w3/w2 or *_proj, or fused experts)
    moe_prefix: str = "mlp."
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    router_name: str = "gate"  # the router's module name in the MoE block (gpt-oss: `router`)
    # gpt-oss's MoE extras (ModelConfig router_bias, expert_bias, swiglu_*): whether the family has them
    moe_extras: bool = False
    # RoPE types config.json may name (a layer kind reads a scaling's settings) and rope_theta when it names none
    rope_types: tuple[str, ...] = ("default",)
    default_theta: float = 10000.0
    # where the decoder's tensors live: `{tensor_prefix}embed_tokens.weight`, `{tensor_prefix}layers.{i}.`,
    # `{tensor_prefix}norm.weight` (a multimodal checkpoint's text tower: e.g. "model.language_model.")
    tensor_prefix: str = "model."
    # NumericPolicy overrides (on hf-eager-bf16 / hf-grouped-bf16) that emulate its bf16 forward
    emulation: str = ""

    def tensors_in(self, tensors: dict, cfg: ModelConfig) -> dict:
        """The checkpoint's tensors in the layout the layer kinds read (e.g. fused projections split); by default
        as they are."""
        return tensors

    def tensors_out(self, tensors: dict, cfg: ModelConfig) -> dict:
        """The inverse of `tensors_in`: the layer kinds' tensors in this family's checkpoint layout."""
        return tensors

    def quantize_experts(self, tensors: dict, cfg: ModelConfig, fmt: str) -> tuple[dict, dict]:
        """The checkpoint's tensors (`tensors_out`'s, float32) with the routed experts in the 4-bit format `fmt`
        this family's checkpoints use, and the config.json `quantization_config` naming it. By default refused:
        only gpt_oss checkpoints carry quantised experts."""
        raise ValueError(f"experts = {fmt!r} export is not supported for {self.model_type}; supported: float "
                         f"(MXFP4 experts are gpt_oss's checkpoint format)")

    def block_params(self, cfg: ModelConfig, t, prefix: str, layer: int, block: dict) -> None:
        """Add a decoder layer's parameters beyond the shared names to `block` (its parameter dict), taking
        tensors with `t.take(name, shape)` (`t.has(name)` tests); e.g. DeepSeek-V4's hyper-connections. By
        default nothing."""

    def model_params(self, cfg: ModelConfig, t, params: dict) -> None:
        """Add model-level parameters beyond the embedding, final norm and LM head to `params` (default none)."""

    def block_tensors(self, cfg: ModelConfig, block: dict, prefix: str, out: dict) -> None:
        """Inverse of `block_params`: add the layer's extra tensors to `out` (default none)."""

    def model_tensors(self, model, params: dict, out: dict) -> None:
        """Inverse of `model_params` (and of `attach`): add model-level tensors to `out` (default none)."""

    def attach(self, model, tensors: dict) -> None:
        """After `load` set the parameters: fix whatever the checkpoint holds that is not a parameter (e.g.
        DeepSeek-V4's hash-routing tables) on the built `model`, from `tensors` (after `tensors_in`). Default
        nothing."""

    def ignores(self, name: str) -> bool:
        """Whether `load` may leave the checkpoint tensor `name` unused (e.g. a vision tower the text model does
        not run; say so in `refuse` or the docs). By default every tensor must be used."""
        return False

    def ignored_note(self) -> str:
        """What `load` warns when it left tensors out (`ignores`)."""
        return "tensors this family does not run"

    # --- config.json -> ModelConfig ---------------------------------------------------------------------------
    def refuse(self, hf: dict) -> None:
        """Raise ValueError for a config feature this mapping does not implement, naming the field, its value
        and what is supported."""
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf.get('hidden_act')!r} is not supported; allowed: silu")
        if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
            raise ValueError("mlp_only_layers / decoder_sparse_step != 1 (interleaved dense layers) are not supported")
        if hf.get("clip_qkv") is not None:
            raise ValueError("clip_qkv is not supported")
        self.layer_kinds(hf)
        if hf.get("use_sliding_window"):
            raise ValueError(f"use_sliding_window = True (sliding_window = {hf.get('sliding_window')!r}) is not "
                             f"supported; supported: use_sliding_window = False (full causal attention)")

    def layer_kinds(self, hf: dict) -> tuple[str, ...] | None:
        """The jaxalign kind of each layer from `layer_types` (None: every layer the attention kind); a layer type
        this family does not run is refused."""
        layer_types = hf.get("layer_types")
        if layer_types is None:
            return None
        odd = sorted({t for t in layer_types if t not in self.layer_types})
        if odd:
            allowed = ", ".join(repr(t) for t in self.layer_types)
            raise ValueError(f"layer_types holds {odd}; supported: only {allowed} layers")
        found = tuple(self.layer_types[t] for t in layer_types)
        return None if len(set(found)) == 1 else found

    def common(self, hf: dict) -> dict:
        """The ModelConfig fields every family spells alike."""
        theta, partial = rope(hf, self.rope_types, self.default_theta)
        heads = hf["num_attention_heads"]
        return dict(family=self.model_type, vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
                    n_layers=hf["num_hidden_layers"], n_heads=heads, n_kv_heads=hf.get("num_key_value_heads") or heads,
                    head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, rope_theta=theta,
                    partial_rotary_factor=partial, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                    max_seq_len=hf.get("max_position_embeddings", 4096), rms_eps=hf.get("rms_norm_eps", 1e-6),
                    top_k=hf["num_experts_per_tok"], dense_mlp_dim=hf.get("intermediate_size", 1))

    def config_fields(self, hf: dict, common: dict) -> dict:
        """All ModelConfig fields (starting from `common`)."""
        raise NotImplementedError

    def kinds(self) -> tuple:
        """The layer kinds this family runs (`jaxalign.model.kinds`)."""
        return tuple(kinds.get(name) for name in dict.fromkeys(self.layer_types.values()))

    def config_from_hf(self, hf: dict) -> ModelConfig:
        """A ModelConfig from a transformers config.json dict; unsupported features raise ValueError. The
        common fields, then each layer kind's (`LayerKind.config_from_hf`), then the family's."""
        self.refuse(hf)
        common = self.common(hf)
        for kind in self.kinds():
            common.update(kind.config_from_hf(hf, common))
        fields = self.config_fields(hf, common)
        layer_kinds = self.layer_kinds(hf)
        if layer_kinds is not None:
            fields["layer_types"] = layer_kinds
        return ModelConfig(**fields)

    # --- ModelConfig -> config.json -------------------------------------------------------------------------------
    def check_export(self, cfg: ModelConfig) -> None:
        """Refuse a ModelConfig this family cannot express."""
        qk_norm = cfg.qk_norm if self.qk_norm is None else self.qk_norm
        mla = any(k in ("mla", "dsa") for k in cfg.layer_kinds)
        wants_mla = any(k in ("mla", "dsa") for k in self.layer_types.values())
        if (cfg.router, cfg.qk_norm) != (self.router, qk_norm) or mla != wants_mla:
            raise ValueError(f"config (router {cfg.router}, qk_norm {cfg.qk_norm}, attention {cfg.attention_kind}) "
                             f"does not fit {self.model_type}")
        extras = (cfg.router_bias, cfg.expert_bias, cfg.swiglu_alpha is not None)
        if extras != (self.moe_extras,) * 3:
            raise ValueError(f"config (router_bias {cfg.router_bias}, expert_bias {cfg.expert_bias}, swiglu_alpha "
                             f"{cfg.swiglu_alpha}) does not fit {self.model_type}: "
                             f"{'it has all three' if self.moe_extras else 'gpt-oss MoE features are gpt_oss only'}")

    def export_fields(self, cfg: ModelConfig, out: dict) -> None:
        """Add (or remove) this family's config.json fields in `out`."""
        raise NotImplementedError

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        """A transformers config.json dict for `cfg`."""
        rope_params = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
        if cfg.partial_rotary_factor != 1.0:
            rope_params["partial_rotary_factor"] = cfg.partial_rotary_factor
        out = dict(model_type=self.model_type, architectures=[self.architecture], vocab_size=cfg.vocab_size,
                   hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                   num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, rope_parameters=rope_params,
                   tie_word_embeddings=cfg.tie_embeddings, max_position_embeddings=cfg.max_seq_len,
                   rms_norm_eps=cfg.rms_eps, num_experts_per_tok=cfg.top_k, intermediate_size=cfg.dense_mlp_dim,
                   hidden_act="silu", norm_topk_prob=cfg.norm_topk_prob)
        self.check_export(cfg)
        self.export_fields(cfg, out)
        for name in dict.fromkeys(cfg.layer_kinds):
            out.update(kinds.get(name).config_to_hf(cfg))
        if cfg.layer_types is not None:
            by_kind = {kind: hf_type for hf_type, kind in self.layer_types.items()}
            out["layer_types"] = [by_kind[k] for k in cfg.layer_kinds]
        return out

    # --- weights ----------------------------------------------------------------------------------------------
