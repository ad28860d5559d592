"""gpt-oss (`gpt_oss`, `GptOssForCausalLM`): layers alternate sliding-window and full attention, both with
per-head attention sinks and biased q/k/v/o projections (kinds `sliding_sink_attention` and `sink_attention`,
`model/kinds/sinks.py`), YaRN RoPE; every layer a routed MoE whose router has a bias and picks the top-k logits
before a softmax over them (router `topk_softmax`), whose experts carry biases and run a clamped SwiGLU.

Its checkpoints hold the experts fused, in the layout transformers' `GptOssExperts` multiplies: `gate_up_proj`
[E, H, 2I] with gate and up interleaved (gate = columns 0, 2, 4, ..., up = 1, 3, 5, ...), `gate_up_proj_bias`
[E, 2I] interleaved alike, `down_proj` [E, I, H], `down_proj_bias` [E, H]; the router is `mlp.router`. Released
checkpoints quantise the experts to MXFP4 (`quantization_config.quant_method = "mxfp4"`): `gate_up_proj_blocks`
[E, 2I, H/32, 16] and `gate_up_proj_scales` [E, 2I, H/32] (uint8), `down_proj_blocks` / `_scales` alike. They
are decoded through jaxalign's MXFP4 format (`numerics.lowbit.mxfp4_from_blocks`, exactly: a code times its
power-of-two scale) into the float32 masters; an `aligned-mxfp4` or `serve-mxfp4` engine quantises those back to
the same values. `save` writes the float layout (no quantization_config), or with `experts="mxfp4"` the
released one (`quantize_experts`).

Defaults follow transformers' `GptOssConfig` where config.json leaves a field out (layer_types alternating from a
sliding first layer, YaRN factor 32 over 4096 positions, rope_theta 150000, swiglu alpha 1.702 and limit 7);
the sizes (`head_dim` included: transformers' default is 64, not hidden / heads) are required.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxalign.interop.families.base import Family, get
from jaxalign.numerics.lowbit import mxfp4_from_blocks, mxfp4_to_blocks, quantize_mxfp4

# transformers' GptOssConfig defaults for the fields a config.json may leave out
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
DEFAULT_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}
SINK_KINDS = ("sink_attention", "sliding_sink_attention")


def default_layer_types(n_layers: int) -> list[str]:
    """transformers' default: sliding on even layers (0, 2, ...), full on odd ones."""
    return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]


class GptOss(Family):
    model_type = "gpt_oss"
    architecture = "GptOssForCausalLM"
    layer_types = {"sliding_attention": "sliding_sink_attention", "full_attention": "sink_attention"}
    router = "topk_softmax"
    router_name = "router"
    moe_extras = True
    rope_types = ("default", "yarn")
    default_theta = 150000.0
    # transformers' bf16 router takes its softmax over the top-k logits in bf16 (softmax(dtype=logits.dtype));
    # its RMSNorm multiplies the f32 weight before the cast, which no policy field says (not measured)
    emulation = ",router_softmax=bf16"

    # --- config.json ---------------------------------------------------------------------------------------------
    @staticmethod
    def with_defaults(hf: dict) -> dict:
        """config.json with transformers' defaults filled in where it leaves a field out."""
        out = dict(DEFAULT_SWIGLU, **hf)
        if out.get("layer_types") is None and isinstance(out.get("num_hidden_layers"), int):
            out["layer_types"] = default_layer_types(out["num_hidden_layers"])
        if not out.get("rope_parameters") and not out.get("rope_scaling"):
            out["rope_parameters"] = dict(DEFAULT_ROPE, rope_theta=out.get("rope_theta", 150000.0))
        return out

    def refuse(self, hf: dict) -> None:
        """The common refusals, then: quantisation other than mxfp4, no head_dim, a partial rotary factor."""
        super().refuse(hf)
        quant = hf.get("quantization_config")
        if quant is not None and (not isinstance(quant, dict) or quant.get("quant_method") != "mxfp4"):
            method = quant.get("quant_method") if isinstance(quant, dict) else quant
            raise ValueError(f"quantization_config.quant_method = {method!r} is not supported for gpt_oss; "
                             f"supported: mxfp4 (the released checkpoints' experts), or no quantization_config")
        if hf.get("head_dim") is None:
            raise ValueError("config.json has no value for head_dim (required for model_type 'gpt_oss': "
                             "transformers' default is 64, not hidden_size / num_attention_heads)")
        params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"rope_parameters.partial_rotary_factor = {params['partial_rotary_factor']!r} is not "
                             f"supported for gpt_oss; supported: 1.0")

    def layer_kinds(self, hf: dict):
        """Each layer's kind, named per layer even when every layer is of one kind."""
        kinds = super().layer_kinds(hf)
        if kinds is None and hf.get("layer_types") is not None:  # one kind everywhere: still named per layer
            kinds = tuple(self.layer_types[t] for t in hf["layer_types"])
        return kinds

    def config_from_hf(self, hf: dict):
        """A ModelConfig from config.json with transformers' defaults filled in (`with_defaults`)."""
        return super().config_from_hf(self.with_defaults(hf))

    def config_fields(self, hf: dict, common: dict) -> dict:
        """The MoE's sizes and gpt-oss's router, biases and clamped SwiGLU."""
        return dict(common, n_experts=get(hf, "num_local_experts", "num_experts"), expert_dim=hf["intermediate_size"],
                    dense_mlp_dim=hf["intermediate_size"], router="topk_softmax", norm_topk_prob=False,
                    qkv_bias=bool(hf.get("attention_bias", True)), router_bias=True, expert_bias=True,
                    swiglu_alpha=float(hf["swiglu_alpha"]), swiglu_limit=float(hf["swiglu_limit"]))

    def check_export(self, cfg) -> None:
        """Refuse a config gpt-oss cannot express (other kinds, dense layers, shared experts, ...)."""
        super().check_export(cfg)
        if (any(kind not in SINK_KINDS for kind in cfg.layer_kinds) or cfg.first_k_dense or cfg.shared_expert_dim
                or cfg.attn_output_gate or cfg.norm_zero_centred or cfg.partial_rotary_factor != 1.0):
            raise ValueError(f"config does not fit gpt_oss: it needs every layer {' or '.join(SINK_KINDS)}, no dense "
                             f"layers, no shared experts, no output gate, plain norms and full rotary")

    def export_fields(self, cfg, out: dict) -> None:
        """num_local_experts, intermediate_size, attention_bias and the SwiGLU's alpha and limit."""
        out.update(num_local_experts=cfg.n_experts, intermediate_size=cfg.expert_dim, attention_bias=cfg.qkv_bias,
                   swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit)
        out.pop("norm_topk_prob", None)

    # --- tensors -------------------------------------------------------------------------------------------------
    def _experts_prefixes(self, cfg) -> list[str]:
        return [f"{self.tensor_prefix}layers.{i}.mlp.experts." for i in cfg.moe_layers]

    def tensors_in(self, tensors: dict, cfg) -> dict:
        """MXFP4 experts decoded, and the interleaved [in, out] experts as `interop.hf` reads fused ones:
        `gate_up_proj` [E, 2I, H] gate rows first, `gate_up_proj_bias` [E, 2I] gate first, `down_proj` [E, H, I]."""
        tensors = dict(tensors)
        e, h, i = cfg.n_experts, cfg.d_model, cfg.expert_dim
        for p in self._experts_prefixes(cfg):
            for proj, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
                if p + proj + "_blocks" in tensors or p + proj + "_scales" in tensors:
                    tensors[p + proj] = self.decode_mxfp4(tensors, p + proj, (e, rows, cols))
            for name, shape in ((p + "gate_up_proj", (e, h, 2 * i)), (p + "down_proj", (e, i, h)),
                                (p + "gate_up_proj_bias", (e, 2 * i))):
                if name not in tensors:
                    raise ValueError(f"checkpoint is missing tensor {name!r} (expected shape {shape})")
                if tensors[name].shape != shape:
                    raise ValueError(f"tensor {name!r} has shape {tensors[name].shape}; expected {shape}")
            gate_up = tensors[p + "gate_up_proj"]
            gate_first = np.concatenate([gate_up[..., 0::2], gate_up[..., 1::2]], -1)
            tensors[p + "gate_up_proj"] = gate_first.transpose(0, 2, 1)
            tensors[p + "down_proj"] = tensors[p + "down_proj"].transpose(0, 2, 1)
            bias = tensors[p + "gate_up_proj_bias"]
            tensors[p + "gate_up_proj_bias"] = np.concatenate([bias[:, 0::2], bias[:, 1::2]], -1)
        return tensors

    @staticmethod
    def decode_mxfp4(tensors: dict, name: str, shape: tuple[int, int, int]) -> np.ndarray:
        """`name`_blocks / `name`_scales (popped from `tensors`) as the float32 tensor [E, in, out] they encode;
        `shape` = (E, out rows, in) says what the blocks must hold."""
        for suffix in ("_blocks", "_scales"):
            if name + suffix not in tensors:
                raise ValueError(f"checkpoint has {name}{'_scales' if suffix == '_blocks' else '_blocks'} but no "
                                 f"{name}{suffix} (MXFP4 experts need both)")
        blocks, scales = tensors.pop(name + "_blocks"), tensors.pop(name + "_scales")
        e, rows, cols = shape
        want = (e, rows, -(-cols // 32), 16)
        if blocks.shape != want or scales.shape != want[:3] or blocks.dtype != np.uint8 or scales.dtype != np.uint8:
            raise ValueError(f"{name}_blocks {blocks.shape} {blocks.dtype} / _scales {scales.shape} {scales.dtype}; "
                             f"expected uint8 {want} / {want[:3]}")
        values = np.asarray(mxfp4_from_blocks(blocks, scales).dequantized(), np.float32)
        if values.shape[1] != cols:
            raise ValueError(f"{name}: MXFP4 blocks of 32 hold {values.shape[1]} inputs; the config needs {cols} (a "
                             f"multiple of 32)")
        return values

    def quantize_experts(self, tensors: dict, cfg, fmt: str) -> tuple[dict, dict]:
        """MXFP4 experts as the released checkpoints hold them (`gate_up_proj_blocks` / `_scales`, `down_proj_*`),
        quantised from the float32 masters by jaxalign's MXFP4 format (`numerics.lowbit.quantize_mxfp4`): masters
        that came from an MXFP4 checkpoint are written back to the same values (a block whose largest code is
        below 4 may come out at half the scale with doubled codes: the OCP canonical form of the same values);
        other masters are rounded to MXFP4. Biases stay float."""
        if fmt != "mxfp4":
            raise ValueError(f"experts = {fmt!r}; supported for gpt_oss: float, mxfp4")
        tensors = dict(tensors)
        for p in self._experts_prefixes(cfg):
            for proj in ("gate_up_proj", "down_proj"):
                weight = quantize_mxfp4(jnp.asarray(tensors.pop(p + proj), jnp.float32))  # [E, in, out]
                tensors[p + proj + "_blocks"], tensors[p + proj + "_scales"] = mxfp4_to_blocks(weight)
        return tensors, {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}

    def tensors_out(self, tensors: dict, cfg) -> dict:
        """The per-expert tensors `interop.hf` writes, fused and interleaved as gpt-oss checkpoints hold them."""
        tensors = dict(tensors)
        for p in self._experts_prefixes(cfg):
            def take(name, key):
                return np.stack([tensors.pop(f"{p}{x}.{name}.{key}") for x in range(cfg.n_experts)])
            gate, up, down = (take(n, "weight") for n in ("gate_proj", "up_proj", "down_proj"))  # [E, out, in]
            gate_up = np.empty((cfg.n_experts, cfg.d_model, 2 * cfg.expert_dim), gate.dtype)
            gate_up[..., 0::2], gate_up[..., 1::2] = gate.transpose(0, 2, 1), up.transpose(0, 2, 1)
            tensors[p + "gate_up_proj"], tensors[p + "down_proj"] = gate_up, down.transpose(0, 2, 1)
            b_gate, b_up = take("gate_proj", "bias"), take("up_proj", "bias")
            bias = np.empty((cfg.n_experts, 2 * cfg.expert_dim), b_gate.dtype)
            bias[:, 0::2], bias[:, 1::2] = b_gate, b_up
            tensors[p + "gate_up_proj_bias"], tensors[p + "down_proj_bias"] = bias, take("down_proj", "bias")
        return tensors
