"""DeepSeek-V4 (`deepseek_v4`, `DeepseekV4ForCausalLM`): per layer a sliding-window attention, alone or with
compressed sparse (CSA) or heavily compressed (HCA) attention (kinds `dsv4_sliding`, `dsv4_csa`, `dsv4_hca`,
`model/kinds/dsv4.py`); the residual stream as `hc_mult` hyper-connection streams (`model/hyper.py`); every layer a
routed MoE with `sqrtsoftplus` scores, one shared expert and the SwiGLU limit, hash-routed on the `hash_moe`
layers (`model/dsv4_moe.py`). All its settings become `ModelConfig.deepseek_v4` (`model/dsv4.DeepseekV4`).

Weights: `mlp.experts.gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I] fused (read by `interop.hf`, written back
fused by `tensors_out`), `mlp.gate.weight`, `mlp.gate.e_score_correction_bias` (top-k layers) or
`mlp.gate.tid2eid` [vocab, k] int64 (hash layers: a static table on the model, `attach`), `attn_hc.*`, `ffn_hc.*`
and `model.hc_head.*` (`block_params`, `model_params`). The multi-token-prediction tensors (`mtp.*`) are left
out, as transformers leaves them.

RoPE: the sliding layers' (`main`) unscaled at rope_theta; the compressed layers' (`compress`) at
compress_rope_theta, unscaled or YaRN (`DeepseekV4.compress_yarn`) with the attention factor 1 transformers fixes
for V4. Refused by name: other RoPE scalings (or YaRN on `main`, or another attention factor), scoring_func other than sqrtsoftplus, more than one KV head, attention or MLP biases, a hidden_act
other than silu, n_shared_experts other than 1. transformers ignores `norm_topk_prob` (its routers always
renormalise): so does this mapping.
"""

from __future__ import annotations

import numpy as np

from jaxalign.interop.families.base import Family, get
from jaxalign.model.dsv4 import DeepseekV4 as Settings
from jaxalign.model.rope_scaling import Yarn

LAYER_TYPES = {"sliding_attention": "dsv4_sliding", "compressed_sparse_attention": "dsv4_csa",
               "heavily_compressed_attention": "dsv4_hca"}
DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def _rope_type(params: dict) -> str:
    return params.get("rope_type", params.get("type", "default"))


# DeepSeek's checkpoint names -> transformers' module names inside a layer, applied in this order (the inverse
# applies the pairs backwards in reverse order; each pair is specific enough that the inverse is exact)
LAYER_RENAMES = (
    (".attn.", ".self_attn."), (".ffn.", ".mlp."),
    (".self_attn.indexer.compressor.", ".self_attn.compressor.indexer."),
    (".self_attn.indexer.weights_proj.", ".self_attn.compressor.indexer.scorer.weights_proj."),
    (".self_attn.indexer.wq_b.", ".self_attn.compressor.indexer.q_b_proj."),
    (".attn_norm.", ".input_layernorm."), (".ffn_norm.", ".post_attention_layernorm."),
    (".hc_attn_fn", ".attn_hc.fn"), (".hc_attn_base", ".attn_hc.base"), (".hc_attn_scale", ".attn_hc.scale"),
    (".hc_ffn_fn", ".ffn_hc.fn"), (".hc_ffn_base", ".ffn_hc.base"), (".hc_ffn_scale", ".ffn_hc.scale"),
    (".attn_sink", ".sinks"), (".norm.", ".kv_norm."), (".ape", ".position_bias"), (".wq_a.", ".q_a_proj."),
    (".self_attn.wq_b.", ".self_attn.q_b_proj."), (".wkv.", ".kv_proj."), (".wgate.", ".gate_proj."),
    (".wo_a.", ".o_a_proj."), (".wo_b.", ".o_b_proj."), (".q_norm.", ".q_a_norm."),
    (".gate.bias", ".gate.e_score_correction_bias"), (".shared_experts.w1.", ".shared_experts.gate_proj."),
    (".shared_experts.w2.", ".shared_experts.down_proj."), (".shared_experts.w3.", ".shared_experts.up_proj."),
)
# top-level names: DeepSeek's (either spelling) -> the modules'; `save_pretrained` writes the second column
TOP_RENAMES = {"head.weight": "lm_head.weight", "embed.weight": "model.embed_tokens.weight",
               "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
               "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale"}
WRITTEN_TOP = {"lm_head.weight": "head.weight"}  # what transformers 5.24 writes back differently


def to_module_name(name: str) -> str:
    """A checkpoint tensor name as transformers' modules name it (names already so spelled pass unchanged)."""
    if name in TOP_RENAMES:
        return TOP_RENAMES[name]
    if "layers." not in name:
        return name
    if not name.startswith("model."):
        name = "model." + name
    for old, new in LAYER_RENAMES:
        name = name.replace(old, new)
    return name


def to_checkpoint_name(name: str) -> str:
    """Inverse of `to_module_name`, as transformers' `save_pretrained` writes DeepSeek-V4 checkpoints."""
    if name in WRITTEN_TOP:
        return WRITTEN_TOP[name]
    if "layers." not in name:
        return name
    for old, new in reversed(LAYER_RENAMES):
        name = name.replace(new, old)
    return name


def default_layer_types(n: int) -> list[str]:
    """transformers' default: two HCA layers, then CSA / HCA alternating (CSA on odd indices)."""
    tail = ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))]
    return ["heavily_compressed_attention"] * min(n, 2) + tail


class DeepseekV4(Family):
    model_type = "deepseek_v4"
    architecture = "DeepseekV4ForCausalLM"
    layer_types = LAYER_TYPES
    router = "sqrtsoftplus"
    qk_norm = "none"
    expert_names = ("w1", "w3", "w2")  # per-expert, as the checkpoints hold them
    rope_types = ("default", "yarn")  # YaRN on the compressed layers only (`_compress_yarn`)

    # --- config.json -------------------------------------------------------------------------------------------
    def refuse(self, hf: dict) -> None:
        """The common refusals, then what this mapping does not implement (named)."""
        super().refuse(hf)
        if hf.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
            raise ValueError(f"scoring_func = {hf['scoring_func']!r} is not supported for deepseek_v4; supported: "
                             f"sqrtsoftplus")
        if hf.get("num_key_value_heads", 1) != 1:
            raise ValueError(f"num_key_value_heads = {hf['num_key_value_heads']} is not supported for deepseek_v4; "
                             f"supported: 1 (one shared key = value head)")
        for name in ("attention_bias", "mlp_bias"):
            if hf.get(name):
                raise ValueError(f"{name} = True is not supported for deepseek_v4; supported: false")
        if hf.get("n_shared_experts", 1) != 1:
            raise ValueError(f"n_shared_experts = {hf['n_shared_experts']} is not supported for deepseek_v4; "
                             f"supported: 1 (transformers builds one shared expert)")
        main = self._rope(hf, "main")[0]
        if _rope_type(main) != "default":
            raise ValueError(f"rope_parameters.main.rope_type = {_rope_type(main)!r} is not supported for "
                             f"deepseek_v4; supported: default (the sliding layers' RoPE is unscaled; YaRN belongs "
                             f"to rope_parameters.compress)")
        self._compress_yarn(hf)  # refuses what it cannot read
        for name in ("quantization_config",):
            if hf.get(name) is not None:
                raise ValueError(f"{name} is not supported for deepseek_v4; supported: an unquantised checkpoint")

    def layer_kinds(self, hf: dict):
        """Each layer's kind from `layer_types` (transformers' default schedule when absent), named per layer."""
        types = hf.get("layer_types") or default_layer_types(hf["num_hidden_layers"])
        odd = sorted({t for t in types if t not in LAYER_TYPES})
        if odd:
            raise ValueError(f"layer_types holds {odd}; supported: only {', '.join(map(repr, LAYER_TYPES))} layers")
        if len(types) != hf["num_hidden_layers"]:
            raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers = {hf['num_hidden_layers']}")
        return tuple(LAYER_TYPES[t] for t in types)

    @staticmethod
    def hash_layers(hf: dict) -> tuple[int, ...]:
        """Layers whose `mlp_layer_types` entry is `hash_moe` (default: the first 3)."""
        n = hf["num_hidden_layers"]
        types = hf.get("mlp_layer_types")
        if types is None:
            return tuple(range(min(n, 3)))
        odd = sorted({t for t in types if t not in ("hash_moe", "moe")})
        if odd or len(types) != n:
            raise ValueError(f"mlp_layer_types = {types}; supported: {n} entries of 'hash_moe' or 'moe'")
        return tuple(i for i, t in enumerate(types) if t == "hash_moe")

    @staticmethod
    def _rope(hf: dict, label: str) -> tuple[dict, str]:
        """(the `rope_parameters` of rope type `label`, the config field that holds them) -- main: the sliding
        layers, compress: CSA / HCA -- from the nested form transformers writes or the flat one it nests: a flat
        form's scaling is the compressed layers' (as transformers reads it), the sliding layers' RoPE then
        unscaled."""
        field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
        rope = hf.get(field) or {}
        if isinstance(rope.get(label), dict):
            return rope[label], f"{field}.{label}"
        if any(isinstance(v, dict) for v in rope.values()):
            return {}, f"{field}.{label}"
        return (rope if label == "compress" else {}), field

    def _compress_yarn(self, hf: dict) -> Yarn | None:
        """YaRN of the compressed layers (rope_parameters.compress of rope_type yarn), or None. transformers sets
        its attention factor to 1 for V4 (cos and sin unscaled); another value is refused by name."""
        sub, field = self._rope(hf, "compress")
        rope_type = _rope_type(sub)
        if rope_type == "default":
            return None
        if rope_type != "yarn":
            raise ValueError(f"{field}.rope_type = {rope_type!r} is not supported for deepseek_v4; supported: "
                             f"default, yarn")
        if sub.get("attention_factor") not in (None, 1.0):
            raise ValueError(f"{field}.attention_factor = {sub['attention_factor']!r} is not supported for "
                             f"deepseek_v4; supported: 1.0 (V4 leaves cos and sin unscaled)")
        return Yarn.from_hf({k: v for k, v in sub.items() if k != "attention_factor"}, field)

    def _theta(self, hf: dict, label: str, fallback: str, default: float) -> float:
        return float(self._rope(hf, label)[0].get("rope_theta", hf.get(fallback, default)))

    def config_fields(self, hf: dict, common: dict) -> dict:
        """The MoE's sizes and router, and every DeepSeek-V4 setting as `ModelConfig.deepseek_v4`."""
        rates = dict(DEFAULT_RATES, **(hf.get("compress_rates") or {}))
        head_dim = hf.get("head_dim") or 512
        partial = hf.get("partial_rotary_factor") or 64 / 512
        settings = Settings(
            q_rank=hf.get("q_lora_rank", 1024), window=hf.get("sliding_window", 128),
            csa_rate=rates["compressed_sparse_attention"], hca_rate=rates["heavily_compressed_attention"],
            compress_theta=self._theta(hf, "compress", "compress_rope_theta", 160000.0),
            compress_yarn=self._compress_yarn(hf),
            o_groups=hf.get("o_groups", 8), o_rank=hf.get("o_lora_rank", 1024),
            index_heads=hf.get("index_n_heads", 64), index_dim=hf.get("index_head_dim", 128),
            index_topk=hf.get("index_topk", 512), hc_mult=hf.get("hc_mult", 4),
            hc_iters=hf.get("hc_sinkhorn_iters", 20), hc_eps=hf.get("hc_eps", 1e-6),
            hash_layers=self.hash_layers(hf), swiglu_limit=hf.get("swiglu_limit", 10.0))
        expert_dim = get(hf, "moe_intermediate_size")
        return dict(common, head_dim=head_dim, n_kv_heads=1, partial_rotary_factor=float(partial),
                    rope_theta=self._theta(hf, "main", "rope_theta", 10000.0),
                    n_experts=get(hf, "n_routed_experts", "num_local_experts"), expert_dim=expert_dim,
                    dense_mlp_dim=expert_dim, router="sqrtsoftplus", norm_topk_prob=True,
                    routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.5)), n_shared_experts=1,
                    shared_expert_dim=expert_dim, deepseek_v4=settings)

    def check_export(self, cfg) -> None:
        """Refuse a config deepseek_v4 cannot express."""
        super().check_export(cfg)
        if cfg.deepseek_v4 is None or any(k not in LAYER_TYPES.values() for k in cfg.layer_kinds) or \
                cfg.first_k_dense or cfg.shared_expert_gate or cfg.qkv_bias:
            raise ValueError(f"config does not fit deepseek_v4: it needs deepseek_v4 settings, every layer one of "
                             f"{', '.join(LAYER_TYPES.values())}, no dense layers, no shared-expert gate, no biases")

    def export_fields(self, cfg, out: dict) -> None:
        """The DeepSeek-V4 fields (rope_parameters nested per rope type, as transformers writes them)."""
        v4 = cfg.deepseek_v4
        by_kind = {kind: hf_type for hf_type, kind in LAYER_TYPES.items()}
        out.pop("intermediate_size", None)
        out.pop("norm_topk_prob", None)
        out.update(
            moe_intermediate_size=cfg.expert_dim, n_routed_experts=cfg.n_experts, n_shared_experts=1,
            scoring_func="sqrtsoftplus", routed_scaling_factor=cfg.routed_scaling_factor, q_lora_rank=v4.q_rank,
            partial_rotary_factor=cfg.partial_rotary_factor, rope_theta=cfg.rope_theta,
            compress_rope_theta=v4.compress_theta, sliding_window=v4.window,
            compress_rates={"compressed_sparse_attention": v4.csa_rate, "heavily_compressed_attention": v4.hca_rate},
            o_groups=v4.o_groups, o_lora_rank=v4.o_rank, index_n_heads=v4.index_heads, index_head_dim=v4.index_dim,
            index_topk=v4.index_topk, hc_mult=v4.hc_mult, hc_sinkhorn_iters=v4.hc_iters, hc_eps=v4.hc_eps,
            swiglu_limit=v4.swiglu_limit, num_nextn_predict_layers=0,
            layer_types=[by_kind[k] for k in cfg.layer_kinds],
            mlp_layer_types=["hash_moe" if i in v4.hash_layers else "moe" for i in range(cfg.n_layers)],
            rope_parameters={"main": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                                      "partial_rotary_factor": cfg.partial_rotary_factor},
                             "compress": {"rope_type": "default", "rope_theta": v4.compress_theta,
                                          "partial_rotary_factor": cfg.partial_rotary_factor,
                                          **({} if v4.compress_yarn is None else
                                             dict(v4.compress_yarn.to_hf(), attention_factor=1.0))}})

    # --- tensors -----------------------------------------------------------------------------------------------
    def ignores(self, name: str) -> bool:
        """The multi-token-prediction layers (`mtp.*`), which transformers does not instantiate."""
        return name.startswith("mtp.") or ".mtp." in name

    def ignored_note(self) -> str:
        return "the multi-token-prediction (mtp.*) tensors, which transformers does not run either"

    def tensors_in(self, tensors: dict, cfg) -> dict:
        """The checkpoint's names (DeepSeek's own, which transformers' `save_pretrained` writes back) as the
        modules' (`to_module_name`), and the hash tables (int64) as float32 ids (exact below 2 ** 24) for the
        float-only reader; `attach` makes them tables again."""
        out = {}
        for name, value in tensors.items():
            name = to_module_name(name)
            out[name] = value.astype(np.float32) if name.endswith("gate.tid2eid") else value
        return out

    def tensors_out(self, tensors: dict, cfg) -> dict:
        """Inverse of `tensors_in`: the names transformers' `save_pretrained` writes."""
        return {to_checkpoint_name(name): value for name, value in tensors.items()}

    def block_params(self, cfg, t, prefix: str, layer: int, block: dict) -> None:
        """The two hyper-connections, the router's correction bias (top-k layers) and, marked as read, the hash
        table (hash layers; `attach` installs it)."""
        v4, d = cfg.deepseek_v4, cfg.d_model
        n = v4.hc_mult
        for site in ("attn_hc", "ffn_hc"):
            block[site] = {"fn": t.take(f"{prefix}{site}.fn", ((2 + n) * n, n * d)),
                           "base": t.take(f"{prefix}{site}.base", ((2 + n) * n,)),
                           "scale": t.take(f"{prefix}{site}.scale", (3,))}
        if layer in v4.hash_layers:
            t.take(prefix + "mlp.gate.tid2eid", (cfg.vocab_size, cfg.top_k))
        else:
            block["mlp"]["selection_bias"] = t.take(prefix + "mlp.gate.e_score_correction_bias", (cfg.n_experts,))

    def model_params(self, cfg, t, params: dict) -> None:
        """The final collapse `model.hc_head.*`."""
        n, d, top = cfg.deepseek_v4.hc_mult, cfg.d_model, self.tensor_prefix
        params["hc_head"] = {"hc_fn": t.take(top + "hc_head.hc_fn", (n, n * d)),
                             "hc_base": t.take(top + "hc_head.hc_base", (n,)),
                             "hc_scale": t.take(top + "hc_head.hc_scale", (1,))}

    def attach(self, model, tensors: dict) -> None:
        """Each hash layer's `tid2eid` as its MoE's table (ids checked against n_experts)."""
        from jaxalign.model.dsv4_moe import HashTable
        cfg = model.config
        for i in cfg.deepseek_v4.hash_layers:
            ids = np.asarray(tensors[f"{self.tensor_prefix}layers.{i}.mlp.gate.tid2eid"])
            if ids.min() < 0 or ids.max() >= cfg.n_experts or np.any(ids != np.round(ids)):
                raise ValueError(f"layers.{i}.mlp.gate.tid2eid holds values outside expert ids 0..{cfg.n_experts - 1}")
            model.blocks[i].mlp.table = HashTable(ids.astype(np.int32))

    def block_tensors(self, cfg, block: dict, prefix: str, out: dict) -> None:
        """Inverse of `block_params` (the tables: `model_tensors`)."""
        for site in ("attn_hc", "ffn_hc"):
            for name in ("fn", "base", "scale"):
                out[f"{prefix}{site}.{name}"] = block[site][name]
        if "selection_bias" in block["mlp"]:
            out[prefix + "mlp.gate.e_score_correction_bias"] = block["mlp"]["selection_bias"]

    def model_tensors(self, model, params: dict, out: dict) -> None:
        """`model.hc_head.*` and every hash layer's table as int64 `tid2eid`."""
        top = self.tensor_prefix
        for name in ("hc_fn", "hc_base", "hc_scale"):
            out[f"{top}hc_head.{name}"] = params["hc_head"][name]
        for i in model.config.deepseek_v4.hash_layers:
            out[f"{top}layers.{i}.mlp.gate.tid2eid"] = model.blocks[i].mlp.table.array.astype(np.int64)
