"""Hugging Face checkpoints <-> jaxalign: read and write transformers' MoE families without torch.

Supported `model_type`s: qwen3_moe, qwen2_moe, mixtral, olmoe, glm4_moe, deepseek_v3 (multi-head latent
attention), glm_moe_dsa (GLM-5: MLA with the DeepSeek sparse attention indexer). Weights are read with safetensors'
numpy API (bf16 through ml_dtypes), from one file or a sharded index, in either expert layout: per expert
(`experts.{e}.gate_proj/up_proj/down_proj`, Mixtral's `w1/w3/w2`) or fused (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]). `save` writes config.json + model.safetensors in transformers' per-expert layout.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy so safetensors can read bf16)
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxalign.model import kinds
from jaxalign.model.config import ModelConfig
from jaxalign.model.transformer import Transformer

SUPPORTED = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "deepseek_v3", "glm_moe_dsa")
_ARCH = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "mixtral": "MixtralForCausalLM",
         "olmoe": "OlmoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
         "glm_moe_dsa": "GlmMoeDsaForCausalLM"}
_MLA_FAMILIES = ("deepseek_v3", "glm_moe_dsa")
_LAYER_TYPES = {"glm_moe_dsa": "indexed_attention"}  # the attention layer type each family runs; others full


# --- config ----------------------------------------------------------------------------------------------------
def _rope(hf: dict) -> tuple[float, float]:
    field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None):
        raise ValueError(f"{field}.rope_type = {rope_type!r} (a RoPE scaling) is not supported; supported: default "
                         f"(unscaled RoPE)")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    return float(theta), float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))


def _refuse_windows(hf: dict) -> None:
    """Sliding-window attention and per-layer attention patterns are not implemented: refuse a config that asks
    for them (transformers would mask keys we attend to)."""
    layer_types, supported = hf.get("layer_types"), _LAYER_TYPES.get(hf.get("model_type"), "full_attention")
    if layer_types is not None and any(t != supported for t in layer_types):
        odd = sorted({t for t in layer_types if t != supported})
        raise ValueError(f"layer_types holds {odd}; supported: only {supported!r} layers")
    if hf.get("use_sliding_window"):
        raise ValueError(f"use_sliding_window = True (sliding_window = {hf.get('sliding_window')!r}) is not "
                         f"supported; supported: use_sliding_window = False (full causal attention)")
    window, longest = hf.get("sliding_window"), hf.get("max_position_embeddings", 4096)
    if hf.get("model_type") == "mixtral" and window is not None and window < longest:
        raise ValueError(f"sliding_window = {window} is not supported; supported: null, or a window >= "
                         f"max_position_embeddings = {longest} (which masks nothing)")


def _get(hf: dict, *names):
    """The first of several spellings transformers uses for one field (e.g. num_experts / num_local_experts)."""
    for name in names:
        if hf.get(name) is not None:
            return hf[name]
    raise ValueError(f"config.json has no value for {' / '.join(names)} (required for model_type "
                     f"{hf.get('model_type')!r})")


def config_from_hf(hf: dict) -> ModelConfig:
    """A ModelConfig from a transformers config.json dict; unsupported features raise ValueError."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf.get('hidden_act')!r} is not supported; allowed: silu")
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise ValueError("mlp_only_layers / decoder_sparse_step != 1 (interleaved dense layers) are not supported")
    if hf.get("clip_qkv") is not None:
        raise ValueError("clip_qkv is not supported")
    _refuse_windows(hf)
    theta, partial = _rope(hf)
    heads = hf["num_attention_heads"]
    common = dict(family=model_type, vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
                  n_layers=hf["num_hidden_layers"], n_heads=heads,
                  n_kv_heads=hf.get("num_key_value_heads") or heads,
                  head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, rope_theta=theta,
                  partial_rotary_factor=partial, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                  max_seq_len=hf.get("max_position_embeddings", 4096), rms_eps=hf.get("rms_norm_eps", 1e-6),
                  top_k=hf["num_experts_per_tok"], dense_mlp_dim=hf.get("intermediate_size", 1))
    if model_type == "qwen3_moe":
        return ModelConfig(**common, n_experts=_get(hf, "num_experts", "num_local_experts"), expert_dim=hf["moe_intermediate_size"],
                           norm_topk_prob=hf.get("norm_topk_prob", True), qk_norm="head",
                           qkv_bias=hf.get("attention_bias", False))
    if model_type == "qwen2_moe":
        return ModelConfig(**common, n_experts=_get(hf, "num_experts", "num_local_experts"), expert_dim=hf["moe_intermediate_size"],
                           norm_topk_prob=hf.get("norm_topk_prob", False), qkv_bias=hf.get("qkv_bias", True),
                           shared_expert_dim=hf["shared_expert_intermediate_size"], shared_expert_gate=True)
    if model_type == "mixtral":
        return ModelConfig(**common, n_experts=_get(hf, "num_local_experts", "num_experts"), expert_dim=hf["intermediate_size"],
                           norm_topk_prob=True)
    if model_type == "olmoe":
        return ModelConfig(**common, n_experts=_get(hf, "num_experts", "num_local_experts"), expert_dim=hf["intermediate_size"],
                           norm_topk_prob=hf.get("norm_topk_prob", False), qk_norm="proj",
                           qkv_bias=hf.get("attention_bias", False))
    n_shared = hf.get("n_shared_experts") or 0
    if model_type in _MLA_FAMILIES:
        return _mla_config(hf, common, n_shared)
    return ModelConfig(**common, router="sigmoid_grouped", n_experts=_get(hf, "n_routed_experts", "num_local_experts", "num_experts"),
                       expert_dim=hf["moe_intermediate_size"], n_groups=hf.get("n_group", 1),
                       topk_groups=hf.get("topk_group", 1), routed_scaling_factor=hf.get("routed_scaling_factor", 1.0),
                       norm_topk_prob=hf.get("norm_topk_prob", True), n_shared_experts=n_shared,
                       shared_expert_dim=n_shared * hf["moe_intermediate_size"],
                       first_k_dense=hf.get("first_k_dense_replace", 0), qkv_bias=hf.get("attention_bias", False),
                       qk_norm="head" if hf.get("use_qk_norm", False) else "none")


def _mla_config(hf: dict, common: dict, n_shared: int) -> ModelConfig:
    """DeepSeek-V3-style configs: multi-head latent attention over the sigmoid grouped router."""
    if hf.get("attention_bias", False):
        raise ValueError("attention_bias = True is not supported for multi-head latent attention; allowed: False")
    heads = common["n_heads"]
    if (hf.get("num_key_value_heads") or heads) != heads:
        raise ValueError(f"num_key_value_heads = {hf['num_key_value_heads']} with multi-head latent attention; "
                         f"allowed: num_attention_heads = {heads} (transformers expands one key per head)")
    nope, rope_dim = _get(hf, "qk_nope_head_dim"), _get(hf, "qk_rope_head_dim")
    common = dict(common, n_kv_heads=heads, head_dim=nope + rope_dim)
    dense = hf.get("first_k_dense_replace", 0)
    mlp_types = hf.get("mlp_layer_types")
    expected_types = ["dense"] * dense + ["sparse"] * (hf["num_hidden_layers"] - dense)
    if mlp_types is not None and list(mlp_types) != expected_types:
        raise ValueError(f"mlp_layer_types = {mlp_types} is not supported; supported: the first "
                         f"first_k_dense_replace = {dense} layers 'dense', the rest 'sparse'")
    index = {}
    if hf["model_type"] == "glm_moe_dsa":
        if not hf.get("rope_interleave", True):  # transformers' GLM-5 rotates interleaved pairs whatever it says
            raise ValueError("rope_interleave = False is not supported for glm_moe_dsa; supported: True (GLM-5's "
                             "attention and indexer always rotate interleaved pairs)")
        indexer_types = hf.get("indexer_types") or ["full"] * hf["num_hidden_layers"]
        if any(t != "full" for t in indexer_types):
            raise ValueError(f"indexer_types = {indexer_types} is not supported; supported: 'full' for every "
                             f"layer (each layer runs its own indexer; 'shared' top-k reuse is not implemented)")
        index = dict(index_topk=_get(hf, "index_topk"), index_n_heads=_get(hf, "index_n_heads"),
                     index_head_dim=_get(hf, "index_head_dim"))
    return ModelConfig(**common, router="sigmoid_grouped", n_experts=_get(hf, "n_routed_experts", "num_local_experts"),
                       expert_dim=hf["moe_intermediate_size"], n_groups=hf.get("n_group") or 1,
                       topk_groups=hf.get("topk_group") or 1,
                       routed_scaling_factor=hf.get("routed_scaling_factor", 1.0),
                       norm_topk_prob=hf.get("norm_topk_prob", True), n_shared_experts=n_shared,
                       shared_expert_dim=n_shared * hf["moe_intermediate_size"],
                       first_k_dense=hf.get("first_k_dense_replace", 0), attention_kind="mla",
                       q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=_get(hf, "kv_lora_rank"),
                       qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim, v_head_dim=_get(hf, "v_head_dim"),
                       rope_interleave=bool(hf.get("rope_interleave", True)), **index)


def config_to_hf(cfg: ModelConfig) -> dict:
    """A transformers config.json dict for a ModelConfig (family `jaxalign` is written as qwen3_moe)."""
    family = "qwen3_moe" if cfg.family == "jaxalign" else cfg.family
    if family not in SUPPORTED:
        raise ValueError(f"family {cfg.family!r} cannot be exported; supported: {', '.join(SUPPORTED)}")
    rope = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.partial_rotary_factor != 1.0:
        rope["partial_rotary_factor"] = cfg.partial_rotary_factor
    out = dict(model_type=family, architectures=[_ARCH[family]], vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
               num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
               head_dim=cfg.head_dim, rope_parameters=rope, tie_word_embeddings=cfg.tie_embeddings,
               max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.rms_eps, num_experts_per_tok=cfg.top_k,
               intermediate_size=cfg.dense_mlp_dim, hidden_act="silu", norm_topk_prob=cfg.norm_topk_prob)
    expected = {"qwen3_moe": ("softmax_topk", "head"), "qwen2_moe": ("softmax_topk", "none"),
                "mixtral": ("softmax_topk", "none"), "olmoe": ("softmax_topk", "proj"),
                "glm4_moe": ("sigmoid_grouped", cfg.qk_norm), "deepseek_v3": ("sigmoid_grouped", "none"),
                "glm_moe_dsa": ("sigmoid_grouped", "none")}[family]
    if (cfg.router, cfg.qk_norm) != expected or (cfg.attention_kind == "mla") != (family in _MLA_FAMILIES):
        raise ValueError(f"config (router {cfg.router}, qk_norm {cfg.qk_norm}, attention {cfg.attention_kind}) "
                         f"does not fit {family}")
    if family == "qwen3_moe":
        out.update(num_experts=cfg.n_experts, moe_intermediate_size=cfg.expert_dim, attention_bias=cfg.qkv_bias)
    elif family == "qwen2_moe":
        out.update(num_experts=cfg.n_experts, moe_intermediate_size=cfg.expert_dim, qkv_bias=cfg.qkv_bias,
                   shared_expert_intermediate_size=cfg.shared_expert_dim)
    elif family == "mixtral":
        out.update(num_local_experts=cfg.n_experts, intermediate_size=cfg.expert_dim)
    elif family == "olmoe":
        out.update(num_experts=cfg.n_experts, intermediate_size=cfg.expert_dim, attention_bias=cfg.qkv_bias)
    else:
        out.update(n_routed_experts=cfg.n_experts, moe_intermediate_size=cfg.expert_dim, n_group=cfg.n_groups,
                   topk_group=cfg.topk_groups, routed_scaling_factor=cfg.routed_scaling_factor,
                   n_shared_experts=cfg.n_shared_experts, first_k_dense_replace=cfg.first_k_dense,
                   attention_bias=cfg.qkv_bias)
        if family in _MLA_FAMILIES:
            del out["head_dim"]  # transformers derives it (= qk_rope_head_dim)
            out.update(q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
                       qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                       v_head_dim=cfg.v_head_dim)
            if family == "deepseek_v3":
                out.update(rope_interleave=cfg.rope_interleave, num_nextn_predict_layers=0)
            else:
                if not cfg.rope_interleave or not cfg.index_topk:
                    raise ValueError("glm_moe_dsa has interleaved RoPE and an indexer; this config has "
                                     f"rope_interleave = {cfg.rope_interleave}, index_topk = {cfg.index_topk}")
                out.update(index_topk=cfg.index_topk, index_n_heads=cfg.index_n_heads,
                           index_head_dim=cfg.index_head_dim, indexer_types=["full"] * cfg.n_layers,
                           mlp_layer_types=["dense"] * cfg.first_k_dense + ["sparse"] * cfg.n_moe_layers)
        else:
            out["use_qk_norm"] = cfg.qk_norm == "head"
    return out


# --- tensors ---------------------------------------------------------------------------------------------------
def read_tensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint directory (model.safetensors, or shards listed in model.safetensors.index.json)
    as float32 numpy arrays."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json (only safetensors "
                         f"checkpoints are read; pickled .bin files are never loaded)")
    out = {}
    for name in files:
        with safe_open(os.path.join(path, name), framework="np") as f:
            for key in f.keys():
                arr = f.get_tensor(key)
                if arr.dtype.kind not in "fV" and str(arr.dtype) != "bfloat16":
                    raise ValueError(f"tensor {key} has dtype {arr.dtype}; allowed: float32, bfloat16, float16")
                out[key] = np.asarray(arr, np.float32)
    return out


class _Tensors:
    """Takes tensors by name, checking shapes, and remembers which were used."""

    def __init__(self, tensors: dict[str, np.ndarray]):
        self.tensors, self.used = tensors, set()

    def has(self, name: str) -> bool:
        return name in self.tensors

    def take(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.tensors:
            raise ValueError(f"checkpoint is missing tensor {name!r} (expected shape {shape})")
        arr = self.tensors[name]
        if arr.shape != tuple(shape):
            raise ValueError(f"tensor {name!r} has shape {arr.shape}; expected {tuple(shape)}")
        self.used.add(name)
        return arr


def _experts(t: _Tensors, moe: str, cfg: ModelConfig):
    e, h, i = cfg.n_experts, cfg.d_model, cfg.expert_dim
    if t.has(moe + "experts.gate_up_proj"):
        gate_up = t.take(moe + "experts.gate_up_proj", (e, 2 * i, h))
        down = t.take(moe + "experts.down_proj", (e, h, i))
        return (np.transpose(gate_up[:, :i], (0, 2, 1)), np.transpose(gate_up[:, i:], (0, 2, 1)),
                np.transpose(down, (0, 2, 1)))
    names = ("w1", "w3", "w2") if t.has(moe + "experts.0.w1.weight") else ("gate_proj", "up_proj", "down_proj")
    gate = np.stack([t.take(f"{moe}experts.{x}.{names[0]}.weight", (i, h)).T for x in range(e)])
    up = np.stack([t.take(f"{moe}experts.{x}.{names[1]}.weight", (i, h)).T for x in range(e)])
    down = np.stack([t.take(f"{moe}experts.{x}.{names[2]}.weight", (h, i)).T for x in range(e)])
    return gate, up, down


def _mlp(t: _Tensors, prefix: str, d: int, hidden: int) -> dict:
    return {"gate": {"w": t.take(prefix + "gate_proj.weight", (hidden, d)).T},
            "up": {"w": t.take(prefix + "up_proj.weight", (hidden, d)).T},
            "down": {"w": t.take(prefix + "down_proj.weight", (d, hidden)).T}}


def params_from_hf(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict:
    """Map transformers tensor names to jaxalign's parameter tree; every tensor must be used."""
    t = _Tensors(tensors)
    d = cfg.d_model
    blocks = {}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        attn = kinds.kind_of(cfg, i).hf_params(cfg, t.take, p)
        block = {"attn": attn, "attn_norm": {"scale": t.take(p + "input_layernorm.weight", (d,))},
                 "mlp_norm": {"scale": t.take(p + "post_attention_layernorm.weight", (d,))}}
        if i in cfg.moe_layers:
            moe = p + ("block_sparse_moe." if t.has(p + "block_sparse_moe.gate.weight") else "mlp.")
            gate, up, down = _experts(t, moe, cfg)
            mlp = {"router": t.take(moe + "gate.weight", (cfg.n_experts, d)).T, "w_gate": gate, "w_up": up,
                   "w_down": down}
            if cfg.router == "sigmoid_grouped":
                mlp["selection_bias"] = t.take(moe + "gate.e_score_correction_bias", (cfg.n_experts,))
            if cfg.shared_expert_dim:
                shared = "shared_expert." if cfg.shared_expert_gate else "shared_experts."
                mlp["shared"] = _mlp(t, moe + shared, d, cfg.shared_expert_dim)
            if cfg.shared_expert_gate:
                mlp["shared_gate"] = {"w": t.take(moe + "shared_expert_gate.weight", (1, d)).T}
            block["mlp"] = mlp
        else:
            block["mlp"] = _mlp(t, p + "mlp.", d, cfg.dense_mlp_dim)
        blocks[i] = block
    params = {"embed": {"table": t.take("model.embed_tokens.weight", (cfg.vocab_size, d))}, "blocks": blocks,
              "final_norm": {"scale": t.take("model.norm.weight", (d,))}}
    if not cfg.tie_embeddings:
        params["lm_head"] = {"w": t.take("lm_head.weight", (cfg.vocab_size, d)).T}
    unused = sorted(set(tensors) - t.used - {"lm_head.weight"})
    unused = [u for u in unused if "rotary_emb" not in u]
    if unused:
        raise ValueError(f"checkpoint has tensors this {cfg.family} mapping does not expect: {unused[:8]}"
                         f"{' ...' if len(unused) > 8 else ''}")
    return params


def load(path: str) -> Transformer:
    """A jaxalign Transformer (f32 masters) from a transformers checkpoint directory; `.config` is its
    ModelConfig."""
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise ValueError(f"{path}: no config.json; expected a transformers checkpoint directory")
    with open(config_path) as f:
        cfg = config_from_hf(json.load(f))
    params = params_from_hf(read_tensors(path), cfg)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params))
    nnx.update(model, state)
    return model


def tensors_to_hf(model: Transformer, dtype=np.float32) -> dict[str, np.ndarray]:
    """transformers tensor names (per-expert layout) -> arrays, for `model`'s parameters."""
    cfg = model.config
    p = jax.tree.map(lambda x: np.asarray(x, np.float32), nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    out = {"model.embed_tokens.weight": p["embed"]["table"], "model.norm.weight": p["final_norm"]["scale"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = p["lm_head"]["w"].T
    family = "qwen3_moe" if cfg.family == "jaxalign" else cfg.family
    for i in range(cfg.n_layers):
        b, pre = p["blocks"][i], f"model.layers.{i}."
        out.update(kinds.kind_of(cfg, i).hf_tensors(cfg, b["attn"], pre))
        out[pre + "input_layernorm.weight"] = b["attn_norm"]["scale"]
        out[pre + "post_attention_layernorm.weight"] = b["mlp_norm"]["scale"]
        m = b["mlp"]
        if i not in cfg.moe_layers:
            for name in ("gate", "up", "down"):
                out[f"{pre}mlp.{name}_proj.weight"] = m[name]["w"].T
            continue
        moe = pre + ("block_sparse_moe." if family == "mixtral" else "mlp.")
        names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        out[moe + "gate.weight"] = m["router"].T
        if cfg.router == "sigmoid_grouped":
            out[moe + "gate.e_score_correction_bias"] = m["selection_bias"]
        for e in range(cfg.n_experts):
            for name, key in zip(names, ("w_gate", "w_up", "w_down")):
                out[f"{moe}experts.{e}.{name}.weight"] = m[key][e].T
        if cfg.shared_expert_dim:
            shared = "shared_expert." if cfg.shared_expert_gate else "shared_experts."
            for name in ("gate", "up", "down"):
                out[f"{moe}{shared}{name}_proj.weight"] = m["shared"][name]["w"].T
        if cfg.shared_expert_gate:
            out[moe + "shared_expert_gate.weight"] = m["shared_gate"]["w"].T
    return {k: np.ascontiguousarray(v.astype(dtype)) for k, v in out.items()}


def save(model: Transformer, path: str, dtype=np.float32) -> None:
    """Write config.json + model.safetensors that transformers' `from_pretrained` loads."""
    os.makedirs(path, exist_ok=True)
    hf_config = config_to_hf(model.config)
    hf_config["torch_dtype"] = "bfloat16" if dtype == ml_dtypes.bfloat16 else "float32"
    tensors = tensors_to_hf(model, dtype)
    tmp = os.path.join(path, "model.safetensors.tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)


# --- numeric emulation -------------------------------------------------------------------------------------------
_FAMILY_OVERRIDES = {
    "mixtral": ",gate=f32",  # Mixtral keeps the top-k routing weights in float32
    "glm4_moe": ",router=f32,gate=f32",  # router weight/bias kept in f32; f32 weights times bf16 expert outputs
    "deepseek_v3": ",router=f32,gate=f32",  # the same router (weight and bias kept in f32)
    "glm_moe_dsa": ",router=f32,gate=f32",  # the indexer's scores are float32 in transformers (index=f32)
}


def emulation_policy(family: str, experts_implementation: str = "eager"):
    """The NumericPolicy that emulates transformers' bf16 forward for `family` with
    `attn_implementation="eager"` and the given `experts_implementation` ("eager" or "grouped_mm")."""
    from jaxalign.numerics import NumericPolicy
    if experts_implementation not in ("eager", "grouped_mm"):
        raise ValueError(f"experts_implementation {experts_implementation!r}; allowed: eager, grouped_mm")
    family = "qwen3_moe" if family == "jaxalign" else family
    if family not in SUPPORTED:
        raise ValueError(f"family {family!r}; supported: {', '.join(SUPPORTED)}")
    base = "hf-eager-bf16" if experts_implementation == "eager" else "hf-grouped-bf16"
    return NumericPolicy.parse(base + _FAMILY_OVERRIDES.get(family, ""))
