"""ModelConfig: the architecture of one MoE transformer, with named presets for tests, the demo, benchmarks and
the model families transformers ships (at tiny sizes)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from jaxalign.model.dsv4 import DeepseekV4
from jaxalign.model.rope_scaling import Yarn

ROUTERS = ("softmax_topk", "sigmoid_grouped", "topk_softmax", "sqrtsoftplus")
QK_NORMS = ("none", "head", "proj")
ATTENTION_KINDS = ("gqa", "mla")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture of a decoder-only MoE transformer.

    Routers: `softmax_topk` (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE): softmax over expert logits, top-k, optional
    renormalisation (`norm_topk_prob`). `sigmoid_grouped` (DeepSeek-V3, GLM-4.5): sigmoid scores, a selection-only
    bias, group-limited top-k (`n_groups`, `topk_groups`, group score = sum of its top-2), weights from the
    bias-free scores, optional renormalisation, times `routed_scaling_factor`. `topk_softmax` (gpt-oss): top-k
    on the logits, then a softmax over the k chosen (`norm_topk_prob` does not apply). `sqrtsoftplus`
(DeepSeek-V4): scores sqrt(softplus(logits)), then as `sigmoid_grouped` without groups (`model/dsv4_moe.py`).

DeepSeek-V4 (`deepseek_v4`, a `model.dsv4.DeepseekV4` value owned by the `dsv4_*` layer kinds): its attention,
hyper-connection and MoE settings in one typed field; a model with it runs `model/hyper.py`'s blocks.

    gpt-oss's MoE extras: `router_bias` (a bias on the router's logits), `expert_bias` (biases on the experts'
    gate, up and down projections) and its clamped SwiGLU (`swiglu_alpha` and `swiglu_limit`, both set or both
    None): gate clamped above at limit, up to [-limit, limit], out = (up + 1) * gate * sigmoid(alpha * gate).

    Attention kinds: `gqa` (grouped-query attention over per-head K/V) and `mla` (DeepSeek-V3 multi-head latent
    attention: keys and values are up-projected from a `kv_lora_rank` latent plus one shared `qk_rope_head_dim`
    rope key; queries optionally through a `q_lora_rank` bottleneck). Under `mla`, head_dim is the q.k head dim
    (qk_nope_head_dim + qk_rope_head_dim), every head has its own keys (n_kv_heads = n_heads) and RoPE rotates
    the rope slice only, interleaved pairs when `rope_interleave`.

    DeepSeek sparse attention (GLM-5, `index_topk` > 0, MLA with a q bottleneck): an indexer per layer
    (`index_n_heads` heads of `index_head_dim`) scores every visible key and each query attends only to its
    `index_topk` best.

    Layer kinds (`jaxalign.model.kinds`): `layer_types` names each layer's kind (`gqa`, `mla`, `dsa`, or any
    registered kind); None (the default) runs the attention kind on every layer (`dsa` for an MLA model with an
    indexer). `layer_kinds` is the resolved tuple. A kind validates the fields it owns; the fields of kinds no
    layer runs are left out of `to_dict` (and the fingerprint).
    """

    family: str = "jaxalign"
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    dense_mlp_dim: int
    n_experts: int
    top_k: int
    expert_dim: int
    router: str = "softmax_topk"
    norm_topk_prob: bool = True
    n_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    shared_expert_dim: int = 0
    shared_expert_gate: bool = False
    first_k_dense: int = 0
    qk_norm: str = "none"
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    tie_embeddings: bool = False
    max_seq_len: int = 256
    rms_eps: float = 1e-6
    attention_kind: str = "gqa"
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    layer_types: tuple[str, ...] | None = None
    # Qwen3.5 / Qwen3-Next: a sigmoid gate on the attention output (q_proj emits each head's query and gate) and
    # zero-centred RMSNorm scales (the norm multiplies by 1 + w, w initialised at 0)
    attn_output_gate: bool = False
    norm_zero_centred: bool = False
    # gated DeltaNet layers (kind `gated_deltanet`): key/value heads and head dims, the short conv's kernel size
    linear_n_k_heads: int = 0
    linear_n_v_heads: int = 0
    linear_k_head_dim: int = 0
    linear_v_head_dim: int = 0
    linear_conv_kernel: int = 0
    # the sink-attention kinds (gpt-oss, `model/kinds/sinks.py`): the sliding layers' window and YaRN RoPE
    sliding_window: int = 0
    rope_yarn: Yarn | None = None
    # gpt-oss's MoE (see above)
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None
    # DeepSeek-V4 (the dsv4_* kinds, hyper-connections, hash routing; see above)
    deepseek_v4: DeepseekV4 | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "dense_mlp_dim",
                     "n_experts", "top_k", "expert_dim", "n_groups", "topk_groups", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} = {value!r}; allowed: a positive int")
        for name in ("n_shared_experts", "shared_expert_dim", "first_k_dense"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ModelConfig.{name} = {value!r}; allowed: an int >= 0")
        if self.router not in ROUTERS:
            raise ValueError(f"ModelConfig.router = {self.router!r}; allowed: {', '.join(ROUTERS)}")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"ModelConfig.qk_norm = {self.qk_norm!r}; allowed: {', '.join(QK_NORMS)}")
        if self.top_k > self.n_experts:
            raise ValueError(f"ModelConfig.top_k = {self.top_k} exceeds n_experts = {self.n_experts}; "
                             f"allowed: 1..{self.n_experts}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"ModelConfig.n_heads = {self.n_heads} is not divisible by n_kv_heads = "
                             f"{self.n_kv_heads}; allowed: n_kv_heads dividing n_heads")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim = {self.head_dim}; allowed: an even number (RoPE rotates pairs)")
        if self.n_experts % self.n_groups:
            raise ValueError(f"ModelConfig.n_groups = {self.n_groups} does not divide n_experts = "
                             f"{self.n_experts}; allowed: a divisor of n_experts")
        if self.topk_groups > self.n_groups:
            raise ValueError(f"ModelConfig.topk_groups = {self.topk_groups} exceeds n_groups = {self.n_groups}")
        if self.router == "sigmoid_grouped":
            per_group = self.n_experts // self.n_groups
            if per_group < 2:
                raise ValueError(f"ModelConfig: sigmoid_grouped routing scores a group by its top-2 experts; "
                                 f"n_experts / n_groups = {per_group}, allowed: >= 2")
            if self.top_k > self.topk_groups * per_group:
                raise ValueError(f"ModelConfig.top_k = {self.top_k} exceeds the {self.topk_groups} selectable "
                                 f"groups x {per_group} experts; allowed: <= {self.topk_groups * per_group}")
        if self.first_k_dense >= self.n_layers:
            raise ValueError(f"ModelConfig.first_k_dense = {self.first_k_dense} leaves no MoE layer in "
                             f"n_layers = {self.n_layers}; allowed: 0..{self.n_layers - 1}")
        if (self.n_shared_experts > 0 or self.shared_expert_gate) and self.shared_expert_dim <= 0:
            raise ValueError("ModelConfig.shared_expert_dim must be > 0 when shared experts are used")
        if not 0 < self.partial_rotary_factor <= 1 or int(self.head_dim * self.partial_rotary_factor) % 2:
            raise ValueError(f"ModelConfig.partial_rotary_factor = {self.partial_rotary_factor}; allowed: (0, 1] "
                             f"with head_dim * factor an even number")
        if self.rope_theta <= 0 or self.rms_eps <= 0:
            raise ValueError(f"ModelConfig.rope_theta = {self.rope_theta}, rms_eps = {self.rms_eps}; "
                             f"allowed: positive floats")
        self._check_gpt_oss_moe()
        self._check_layer_kinds()

    def _check_gpt_oss_moe(self) -> None:
        object.__setattr__(self, "rope_yarn", Yarn.coerce(self.rope_yarn))  # a dict from JSON
        object.__setattr__(self, "deepseek_v4", DeepseekV4.coerce(self.deepseek_v4))
        for name in ("router_bias", "expert_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name} = {getattr(self, name)!r}; allowed: True, False")
        alpha, limit = self.swiglu_alpha, self.swiglu_limit
        if (alpha is None) != (limit is None):
            raise ValueError(f"ModelConfig.swiglu_alpha = {alpha!r}, swiglu_limit = {limit!r}; allowed: both None "
                             f"(SwiGLU) or both positive numbers (gpt-oss's clamped SwiGLU)")
        for name, value in (("swiglu_alpha", alpha), ("swiglu_limit", limit)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"ModelConfig.{name} = {value!r}; allowed: None or a positive number")

    def _check_layer_kinds(self) -> None:
        from jaxalign.model import kinds
        if self.attention_kind not in ATTENTION_KINDS:
            raise ValueError(f"ModelConfig.attention_kind = {self.attention_kind!r}; allowed: "
                             f"{', '.join(ATTENTION_KINDS)}")
        for name in ("index_topk", "index_n_heads", "index_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ModelConfig.{name} = {value!r}; allowed: an int >= 0")
        if self.layer_types is not None:
            if isinstance(self.layer_types, list):  # from JSON
                object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if not isinstance(self.layer_types, tuple) or len(self.layer_types) != self.n_layers:
                raise ValueError(f"ModelConfig.layer_types = {self.layer_types!r}; allowed: None or one kind per "
                                 f"layer (n_layers = {self.n_layers}) from {', '.join(kinds.names())}")
        for kind in kinds.kinds_of(self):  # an unknown name raises here
            kind.validate(self)
        if self.index_topk and any(k != "dsa" for k in self.layer_kinds):
            raise ValueError(f"ModelConfig.index_topk = {self.index_topk} (DeepSeek sparse attention) with "
                             f"layer_types {list(self.layer_kinds)}; allowed: 'dsa' on every layer (the routing "
                             f"record holds one indexer selection per layer)")

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's kind name (`jaxalign.model.kinds`): `layer_types`, or the attention kind on every layer."""
        if self.layer_types is not None:
            return tuple(self.layer_types)
        uniform = "dsa" if self.attention_kind == "mla" and self.index_topk else self.attention_kind
        return (uniform,) * self.n_layers

    # ----------------------------------------------------------------------------------------------------------
    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the layers with a routed MoE block (the others have a dense SwiGLU MLP)."""
        return tuple(range(self.first_k_dense, self.n_layers))

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head RoPE rotates (GLM-4.5 rotates half)."""
        if self.attention_kind == "mla":
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def n_moe_layers(self) -> int:
        """Number of MoE layers (the third axis of a RoutingRecord)."""
        return len(self.moe_layers)

    def to_dict(self) -> dict[str, Any]:
        """Field name -> value (JSON-serialisable). The fields a layer kind owns appear only when a layer runs
        that kind (e.g. the MLA fields only for an MLA model), `layer_types` only when set."""
        from jaxalign.model import kinds
        out = dataclasses.asdict(self)
        for name, value in out.items():  # a settings value with its own dict form (e.g. DeepseekV4's) gives it
            if hasattr(getattr(self, name), "to_dict"):
                out[name] = getattr(self, name).to_dict()
        used = {field for kind in kinds.kinds_of(self) for field in kind.fields}
        for name in {field for kind in kinds.all_kinds() for field in kind.fields} - used:
            del out[name]
        for name, default in _OMITTED_AT_DEFAULT.items():  # fields added later: old fingerprints stay put
            if out[name] == default:
                del out[name]
        if self.layer_types is None:
            del out["layer_types"]
        else:
            out["layer_types"] = list(self.layer_types)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        """Inverse of `to_dict`; unknown keys are refused."""
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {sorted(unknown)}")
        return cls(**data)

    def fingerprint(self) -> str:
        """A short stable hash of the architecture; routing records and golden files carry it."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with some fields changed (validated)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        """A named preset: tiny, small, bench, tiny-qwen3-moe, tiny-qwen2-moe, tiny-mixtral, tiny-olmoe,
        tiny-glm4-moe, tiny-deepseek-v3, tiny-glm5, tiny-qwen3.5, tiny-gpt-oss, tiny-deepseek-v4."""
        if name not in _PRESETS:
            raise ValueError(f"unknown model preset {name!r}; allowed: {', '.join(_PRESETS)}")
        return _PRESETS[name]


_OMITTED_AT_DEFAULT = {"attn_output_gate": False, "norm_zero_centred": False, "router_bias": False,
                       "expert_bias": False, "swiglu_alpha": None, "swiglu_limit": None}


def preset_names() -> tuple[str, ...]:
    """Names accepted by `ModelConfig.preset`."""
    return tuple(_PRESETS)


_TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, dense_mlp_dim=64,
             n_experts=8, top_k=4, expert_dim=16, max_seq_len=64)

_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(**_TINY, qk_norm="head"),
    "small": ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                         dense_mlp_dim=128, n_experts=8, top_k=2, expert_dim=64, qk_norm="head", max_seq_len=256),
    # the RL model: the character vocabulary of jaxalign.rl.tokenizer (31 ids) padded to 32
    "countdown": ModelConfig(vocab_size=32, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                             dense_mlp_dim=128, n_experts=8, top_k=2, expert_dim=64, qk_norm="head", max_seq_len=64),
    # `countdown` for vLLM rollouts: the same widths (query 64, key/value 32) as 2 heads of 32, the head size vLLM's
    # CPU attention needs (32 and up; `countdown`'s 16 is refused); `experiment countdown` picks it for vLLM arms
    "countdown-vllm": ModelConfig(vocab_size=32, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=32,
                                  dense_mlp_dim=128, n_experts=8, top_k=2, expert_dim=64, qk_norm="head",
                                  max_seq_len=64),
    # the RL model for answers with worked steps (`answer_format=steps`): `countdown` with room for 24 prompt and
    # 64 completion tokens
    "countdown-steps": ModelConfig(vocab_size=32, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                                   dense_mlp_dim=128, n_experts=8, top_k=2, expert_dim=64, qk_norm="head",
                                   max_seq_len=96),
    "bench": ModelConfig(vocab_size=256, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32,
                         dense_mlp_dim=512, n_experts=16, top_k=4, expert_dim=64, qk_norm="head", max_seq_len=256),
    "tiny-qwen3-moe": ModelConfig(**_TINY, family="qwen3_moe", qk_norm="head", norm_topk_prob=True,
                                  rope_theta=1e6),
    "tiny-qwen2-moe": ModelConfig(**_TINY, family="qwen2_moe", qkv_bias=True, norm_topk_prob=False,
                                  shared_expert_dim=32, shared_expert_gate=True),
    "tiny-mixtral": ModelConfig(**_TINY, family="mixtral", norm_topk_prob=True, rope_theta=1e6),
    "tiny-olmoe": ModelConfig(**_TINY, family="olmoe", qk_norm="proj", norm_topk_prob=False),
    "tiny-glm4-moe": ModelConfig(**{**_TINY, "n_layers": 3}, family="glm4_moe", router="sigmoid_grouped",
                                 n_groups=4, topk_groups=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                                 n_shared_experts=1, shared_expert_dim=16, first_k_dense=1,
                                 partial_rotary_factor=0.5),
    # DeepSeek-V3 / Kimi K2: MLA (q through a rank-16 bottleneck, a rank-16 KV latent, interleaved rope on 8 dims)
    # and the GLM-4.5 sigmoid grouped router with a shared expert and a dense first layer
    "tiny-deepseek-v3": ModelConfig(**{**_TINY, "n_layers": 3, "n_kv_heads": 4, "head_dim": 16},
                                    family="deepseek_v3", router="sigmoid_grouped", n_groups=4, topk_groups=2,
                                    routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=1,
                                    shared_expert_dim=16, first_k_dense=1, attention_kind="mla", q_lora_rank=16,
                                    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                                    rope_interleave=True),
    # GLM-5 (transformers glm_moe_dsa): the same MLA + MoE with a DSA indexer (2 heads of 16, rope on the first 8
    # dims, interleaved) choosing 6 keys per query; the main attention's rope is interleaved too
    "tiny-glm5": ModelConfig(**{**_TINY, "n_layers": 3, "n_kv_heads": 4, "head_dim": 16}, family="glm_moe_dsa",
                             router="sigmoid_grouped", n_groups=4, topk_groups=2, routed_scaling_factor=2.5,
                             norm_topk_prob=True, n_shared_experts=1, shared_expert_dim=16, first_k_dense=1,
                             rms_eps=1e-5, attention_kind="mla", q_lora_rank=16, kv_lora_rank=16,
                             qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, rope_interleave=True,
                             index_topk=6, index_n_heads=2, index_head_dim=16),
    # Qwen3.5-MoE (transformers qwen3_5_moe_text): two gated DeltaNet layers (2 key heads of 16, 4 value heads of
    # 8, a 4-tap conv), then gated attention (per-head q/k norms, rope on a quarter of each 16-dim head); every
    # norm zero-centred; top-4 of 8 experts plus a sigmoid-gated shared expert
    "tiny-qwen3.5": ModelConfig(**{**_TINY, "n_layers": 3, "head_dim": 16}, family="qwen3_5_moe_text",
                                qk_norm="head", norm_topk_prob=True, shared_expert_dim=16, shared_expert_gate=True,
                                partial_rotary_factor=0.25, attn_output_gate=True, norm_zero_centred=True,
                                layer_types=("gated_deltanet", "gated_deltanet", "gqa"), linear_n_k_heads=2,
                                linear_n_v_heads=4, linear_k_head_dim=16, linear_v_head_dim=8, linear_conv_kernel=4),
    # gpt-oss (transformers gpt_oss): a sliding-window layer (8 positions) then a full one, both with per-head
    # attention sinks and biased q/k/v/o projections; YaRN RoPE as the released config has it (factor 32 over 4096
    # positions, theta 150000); top-4 of 8 experts by biased router logits with a softmax over the chosen, expert
    # biases and the clamped SwiGLU (alpha 1.702, limit 7)
    "tiny-gpt-oss": ModelConfig(**{**_TINY, "dense_mlp_dim": 16}, family="gpt_oss", qkv_bias=True,
                                router="topk_softmax", norm_topk_prob=False, rope_theta=150000.0, rms_eps=1e-5,
                                layer_types=("sliding_sink_attention", "sink_attention"), sliding_window=8,
                                rope_yarn=Yarn(factor=32.0, original_max_position=4096, truncate=False),
                                router_bias=True, expert_bias=True, swiglu_alpha=1.702, swiglu_limit=7.0),
    # DeepSeek-V4 (transformers deepseek_v4): HCA (entries of 8 tokens), CSA (entries of 4, the indexer's 2 heads of
    # 16 keeping 3) and sliding-only layers, all over a window of 8 with sinks, one shared key = value head of 16
    # (rope on its last 8 dims), grouped output (2 groups of rank 8); 2 hyper-connection streams (4 Sinkhorn
    # iterations); top-2 of 8 experts by sqrtsoftplus scores, hash-routed on the first layer, a shared expert, the
    # SwiGLU limited to 2
    "tiny-deepseek-v4": ModelConfig(**{**_TINY, "n_layers": 3, "n_kv_heads": 1, "head_dim": 16, "top_k": 2},
                                    family="deepseek_v4", router="sqrtsoftplus", routed_scaling_factor=1.5,
                                    n_shared_experts=1, shared_expert_dim=16, partial_rotary_factor=0.5,
                                    layer_types=("dsv4_hca", "dsv4_csa", "dsv4_sliding"),
                                    deepseek_v4=DeepseekV4(q_rank=16, window=8, csa_rate=4, hca_rate=8,
                                                           compress_theta=40000.0, o_groups=2, o_rank=8,
                                                           index_heads=2, index_dim=16, index_topk=3, hc_mult=2,
                                                           hc_iters=4, hash_layers=(0,), swiglu_limit=2.0)),
}
