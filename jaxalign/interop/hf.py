"""Hugging Face checkpoints <-> jaxalign: read and write transformers' MoE families without torch.

Each family is a module in `interop/families/` (config mapping, refused fields, MoE weight names); a layer's mixer
weights are named by its layer kind (`model/kinds/`). Supported `model_type`s: qwen3_moe, qwen2_moe, mixtral,
olmoe, glm4_moe, deepseek_v3 (multi-head latent attention), glm_moe_dsa (GLM-5: MLA with the DeepSeek sparse
attention indexer), qwen3_5_moe_text and the text tower of qwen3_5_moe (Qwen3.5: gated DeltaNet layers beside gated
attention), qwen3_next (the same hybrid, its DeltaNet projections fused per key head: a family's `tensors_in` /
`tensors_out` convert layouts), gpt_oss (attention sinks, sliding-window layers, YaRN, biased router and
experts). Weights are read with safetensors' numpy API (bf16 through ml_dtypes), from one file or a sharded index,
in either expert layout: per expert
(`experts.{e}.gate_proj/up_proj/down_proj`, Mixtral's `w1/w3/w2`) or fused (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]). `save` writes config.json + model.safetensors in transformers' per-expert layout.
gpt_oss checkpoints carry their own expert layout (interleaved gate/up, biases) and optionally MXFP4 experts
(uint8 `*_blocks` / `*_scales`, kept as bytes here and decoded by the family through `numerics.lowbit`).
"""

from __future__ import annotations

import json
import os
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy so safetensors can read bf16)
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from jaxalign.files import open_safetensors, read_json
from jaxalign.interop import families
from jaxalign.model import kinds
from jaxalign.model.config import ModelConfig
from jaxalign.model.transformer import Transformer



def supported() -> tuple[str, ...]:
    """The transformers model_types this module reads and writes (the family registry's)."""
    return families.names()


SUPPORTED = supported()  # the built-in families (families.register adds more at run time)


def _family_of(cfg: ModelConfig):
    """The family a ModelConfig is written as (family `jaxalign` as qwen3_moe)."""
    family = "qwen3_moe" if cfg.family == "jaxalign" else cfg.family
    if family not in families.names():
        raise ValueError(f"family {cfg.family!r} cannot be exported; supported: {', '.join(families.names())}")
    return families.get(family)


def config_from_hf(hf: dict) -> ModelConfig:
    """A ModelConfig from a transformers config.json dict (through its family in `interop.families`);
    unsupported features raise ValueError naming the field."""
    return families.get(hf.get("model_type")).config_from_hf(hf)


def config_to_hf(cfg: ModelConfig) -> dict:
    """A transformers config.json dict for a ModelConfig (family `jaxalign` is written as qwen3_moe)."""
    return _family_of(cfg).config_to_hf(cfg)


# --- tensors ---------------------------------------------------------------------------------------------------
def read_tensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint directory (model.safetensors, or shards listed in model.safetensors.index.json)
    as float32 numpy arrays; uint8 tensors (MXFP4 blocks and scales) are kept as they are, for the family's
    `tensors_in` to decode."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        content = read_json(index, "the safetensors index")
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no weight_map object (tensor name -> shard file)")
        files = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json (only safetensors "
                         f"checkpoints are read; pickled .bin files are never loaded)")
    out = {}
    for name in files:
        with open_safetensors(os.path.join(path, name)) as f:
            for key in f.keys():
                arr = f.get_tensor(key)
                if arr.dtype == np.uint8 or arr.dtype.kind == "i":  # MXFP4 bytes; integer tables (V4's tid2eid)
                    out[key] = arr
                    continue
                if arr.dtype.kind not in "fV" and str(arr.dtype) != "bfloat16":
                    raise ValueError(f"tensor {key} has dtype {arr.dtype}; allowed: float32, bfloat16, float16 "
                                     f"(uint8: MXFP4 blocks and scales)")
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


def _experts(t: _Tensors, moe: str, cfg: ModelConfig) -> dict:
    """The routed experts' parameters (`w_gate`, `w_up`, `w_down`, and with `expert_bias` `b_gate`, `b_up`,
    `b_down`) from the fused or the per-expert layout."""
    e, h, i = cfg.n_experts, cfg.d_model, cfg.expert_dim
    if t.has(moe + "experts.gate_up_proj"):
        gate_up = t.take(moe + "experts.gate_up_proj", (e, 2 * i, h))
        down = t.take(moe + "experts.down_proj", (e, h, i))
        out = {"w_gate": np.transpose(gate_up[:, :i], (0, 2, 1)), "w_up": np.transpose(gate_up[:, i:], (0, 2, 1)),
               "w_down": np.transpose(down, (0, 2, 1))}
        if cfg.expert_bias:
            gate_up_bias = t.take(moe + "experts.gate_up_proj_bias", (e, 2 * i))
            out.update(b_gate=gate_up_bias[:, :i], b_up=gate_up_bias[:, i:],
                       b_down=t.take(moe + "experts.down_proj_bias", (e, h)))
        return out
    names = ("w1", "w3", "w2") if t.has(moe + "experts.0.w1.weight") else ("gate_proj", "up_proj", "down_proj")
    out = {}
    for key, name, shape in zip(("gate", "up", "down"), names, ((i, h), (i, h), (h, i))):
        out["w_" + key] = np.stack([t.take(f"{moe}experts.{x}.{name}.weight", shape).T for x in range(e)])
        if cfg.expert_bias:
            out["b_" + key] = np.stack([t.take(f"{moe}experts.{x}.{name}.bias", shape[:1]) for x in range(e)])
    return out


def _mlp(t: _Tensors, prefix: str, d: int, hidden: int) -> dict:
    return {"gate": {"w": t.take(prefix + "gate_proj.weight", (hidden, d)).T},
            "up": {"w": t.take(prefix + "up_proj.weight", (hidden, d)).T},
            "down": {"w": t.take(prefix + "down_proj.weight", (d, hidden)).T}}


def params_from_hf(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict:
    """Map transformers tensor names to jaxalign's parameter tree; every tensor must be used."""
    d, family = cfg.d_model, _family_of(cfg)
    tensors = family.tensors_in(tensors, cfg)
    raw = sorted(name for name, arr in tensors.items() if arr.dtype.kind != "f")
    if raw:
        raise ValueError(f"checkpoint tensors {raw[:4]} are {tensors[raw[0]].dtype}, which the {cfg.family} mapping "
                         f"does not decode (MXFP4 blocks and scales are read by the gpt_oss family only)")
    t = _Tensors(tensors)
    top = family.tensor_prefix
    blocks = {}
    for i in range(cfg.n_layers):
        p = f"{top}layers.{i}."
        attn = kinds.kind_of(cfg, i).hf_params(cfg, t.take, p)  # the mixer's names: its layer kind's
        block = {"attn": attn, "attn_norm": {"scale": t.take(p + "input_layernorm.weight", (d,))},
                 "mlp_norm": {"scale": t.take(p + "post_attention_layernorm.weight", (d,))}}
        if i in cfg.moe_layers:
            router = family.router_name
            moe = p + ("block_sparse_moe." if t.has(f"{p}block_sparse_moe.{router}.weight") else "mlp.")
            mlp = {"router": t.take(f"{moe}{router}.weight", (cfg.n_experts, d)).T, **_experts(t, moe, cfg)}
            if cfg.router_bias:
                mlp["router_bias"] = t.take(f"{moe}{router}.bias", (cfg.n_experts,))
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
        family.block_params(cfg, t, p, i, block)
        blocks[i] = block
    params = {"embed": {"table": t.take(top + "embed_tokens.weight", (cfg.vocab_size, d))}, "blocks": blocks,
              "final_norm": {"scale": t.take(top + "norm.weight", (d,))}}
    if not cfg.tie_embeddings:
        params["lm_head"] = {"w": t.take("lm_head.weight", (cfg.vocab_size, d)).T}
    family.model_params(cfg, t, params)
    unused = sorted(set(tensors) - t.used - {"lm_head.weight"})
    ignored = [u for u in unused if family.ignores(u)]
    if ignored:
        warnings.warn(f"{cfg.family}: {len(ignored)} checkpoint tensors not loaded: {family.ignored_note()}",
                      stacklevel=3)
    unused = [u for u in unused if "rotary_emb" not in u and not family.ignores(u)]
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
    hf_config = read_json(config_path, "the transformers config")
    if not isinstance(hf_config, dict):
        raise ValueError(f"{config_path}: expected a JSON object (a transformers config)")
    cfg = config_from_hf(hf_config)
    tensors = read_tensors(path)
    params = params_from_hf(tensors, cfg)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params))
    nnx.update(model, state)
    family = _family_of(cfg)
    family.attach(model, family.tensors_in(tensors, cfg))
    return model


def tensors_to_hf(model: Transformer, dtype=np.float32) -> dict[str, np.ndarray]:
    """transformers tensor names (per-expert layout) -> arrays, for `model`'s parameters."""
    cfg = model.config
    p = jax.tree.map(lambda x: np.asarray(x, np.float32), nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    family = _family_of(cfg)
    top = family.tensor_prefix
    out = {top + "embed_tokens.weight": p["embed"]["table"], top + "norm.weight": p["final_norm"]["scale"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = p["lm_head"]["w"].T
    for i in range(cfg.n_layers):
        b, pre = p["blocks"][i], f"{top}layers.{i}."
        out.update(kinds.kind_of(cfg, i).hf_tensors(cfg, b["attn"], pre))
        out[pre + "input_layernorm.weight"] = b["attn_norm"]["scale"]
        out[pre + "post_attention_layernorm.weight"] = b["mlp_norm"]["scale"]
        m = b["mlp"]
        if i not in cfg.moe_layers:
            for name in ("gate", "up", "down"):
                out[f"{pre}mlp.{name}_proj.weight"] = m[name]["w"].T
            continue
        moe, names = pre + family.moe_prefix, family.expert_names
        out[f"{moe}{family.router_name}.weight"] = m["router"].T
        if cfg.router_bias:
            out[f"{moe}{family.router_name}.bias"] = m["router_bias"]
        if cfg.router == "sigmoid_grouped":
            out[moe + "gate.e_score_correction_bias"] = m["selection_bias"]
        for e in range(cfg.n_experts):
            for name, key in zip(names, ("gate", "up", "down")):
                out[f"{moe}experts.{e}.{name}.weight"] = m["w_" + key][e].T
                if cfg.expert_bias:
                    out[f"{moe}experts.{e}.{name}.bias"] = m["b_" + key][e]
        if cfg.shared_expert_dim:
            shared = "shared_expert." if cfg.shared_expert_gate else "shared_experts."
            for name in ("gate", "up", "down"):
                out[f"{moe}{shared}{name}_proj.weight"] = m["shared"][name]["w"].T
        if cfg.shared_expert_gate:
            out[moe + "shared_expert_gate.weight"] = m["shared_gate"]["w"].T
        family.block_tensors(cfg, b, pre, out)
    family.model_tensors(model, p, out)
    return {k: np.ascontiguousarray(v.astype(dtype) if v.dtype.kind == "f" else v)  # integer tables as they are
            for k, v in family.tensors_out(out, cfg).items()}


EXPERT_FORMATS = ("float", "mxfp4")


def save(model: Transformer, path: str, dtype=np.float32, *, experts: str = "float") -> None:
    """Write config.json + model.safetensors that transformers' `from_pretrained` loads. `experts="mxfp4"`: the
    routed experts in the family's MXFP4 checkpoint layout (gpt_oss only, `Family.quantize_experts`), quantised
    from the float32 masters; the other tensors in `dtype`."""
    if experts not in EXPERT_FORMATS:
        raise ValueError(f"experts = {experts!r}; allowed: {', '.join(EXPERT_FORMATS)}")
    hf_config = config_to_hf(model.config)
    hf_config["torch_dtype"] = "bfloat16" if dtype == ml_dtypes.bfloat16 else "float32"
    if experts == "float":
        tensors = tensors_to_hf(model, dtype)
    else:  # quantised from float32 (never from a bf16 copy), then the rest cast
        tensors, hf_config["quantization_config"] = _family_of(model.config).quantize_experts(
            tensors_to_hf(model, np.float32), model.config, experts)
        tensors = {k: np.ascontiguousarray(v.astype(dtype) if v.dtype.kind == "f" else v) for k, v in tensors.items()}
    os.makedirs(path, exist_ok=True)
    tmp = os.path.join(path, "model.safetensors.tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)


# --- numeric emulation -------------------------------------------------------------------------------------------
def emulation_policy(family: str, experts_implementation: str = "eager", dtype: str = "bf16"):
    """The NumericPolicy that emulates transformers' CPU forward for `family`: in bf16 (`dtype="bf16"`) with
    `attn_implementation="eager"` and the given `experts_implementation` ("eager" or "grouped_mm"); in float32
    (`dtype="f32"`: `hf-fp32`, either experts implementation). Both keep the DSA indexer's exact ties as torch.topk
    does on the CPU (`index_ties=torch-cpu`)."""
    from jaxalign.numerics import NumericPolicy
    if experts_implementation not in ("eager", "grouped_mm"):
        raise ValueError(f"experts_implementation {experts_implementation!r}; allowed: eager, grouped_mm")
    if dtype not in ("bf16", "f32"):
        raise ValueError(f"dtype {dtype!r}; allowed: bf16, f32")
    family = "qwen3_moe" if family == "jaxalign" else family
    if family not in families.names():
        raise ValueError(f"family {family!r}; supported: {', '.join(families.names())}")
    if dtype == "f32":
        return NumericPolicy.preset("hf-fp32")
    base = "hf-eager-bf16" if experts_implementation == "eager" else "hf-grouped-bf16"
    return NumericPolicy.parse(base + families.get(family).emulation)
