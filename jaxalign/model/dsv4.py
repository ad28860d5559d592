"""DeepSeek-V4's typed settings (`ModelConfig.deepseek_v4`) and the interleaved tail RoPE its attention uses.

One frozen value holds everything DeepSeek-V4 adds to a MoE transformer, so the family needs a single
`ModelConfig` field: the attention kinds' settings (`model/kinds/dsv4.py`: compression rates, window, grouped
output projection, indexer), the residual stream's (`model/hyper.py`: manifold-constrained hyper-connections) and
the MoE's (`model/dsv4_moe.py`: hash-routed layers, the SwiGLU limit). transformers' names are in brackets.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxalign.model.rope_scaling import Yarn
from jaxalign.numerics import NumericPolicy
from jaxalign.numerics.attention import rope


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepseekV4:
    """DeepSeek-V4's settings.

    - `q_rank` [q_lora_rank]: the query bottleneck (its normed latent also feeds the indexer's queries);
    - `window` [sliding_window]: raw keys a query sees, its own included, on every layer;
    - `csa_rate`, `hca_rate` [compress_rates]: tokens per compressed entry of the CSA (overlapping windows of
      2 * rate, stride rate) and HCA (disjoint windows) layers; `compress_theta` [compress_rope_theta]: their RoPE
      base (the sliding layers use `ModelConfig.rope_theta`); `compress_yarn` [rope_parameters.compress of
      rope_type yarn]: YaRN's inverse frequencies on those layers (`model/rope_scaling.Yarn`), without its
      attention factor (transformers fixes it at 1 for V4: cos and sin are not scaled), or None (unscaled);
    - `o_groups`, `o_rank` [o_groups, o_lora_rank]: the grouped low-rank output projection;
    - `index_heads`, `index_dim`, `index_topk` [index_n_heads, index_head_dim, index_topk]: the CSA indexer;
    - `hc_mult`, `hc_iters`, `hc_eps` [hc_mult, hc_sinkhorn_iters, hc_eps]: the hyper-connections' streams,
      Sinkhorn iterations and floor;
    - `hash_layers` [mlp_layer_types == "hash_moe"]: layers whose experts are a fixed function of the token id;
    - `swiglu_limit`: routed and shared experts clamp gate above and up to [-limit, limit].
    """

    q_rank: int
    window: int
    csa_rate: int = 4
    hca_rate: int = 128
    compress_theta: float = 160000.0
    compress_yarn: Yarn | None = None
    o_groups: int
    o_rank: int
    index_heads: int
    index_dim: int
    index_topk: int
    hc_mult: int = 4
    hc_iters: int = 20
    hc_eps: float = 1e-6
    hash_layers: tuple[int, ...] = ()
    swiglu_limit: float = 10.0

    def __post_init__(self) -> None:
        for name in ("q_rank", "window", "csa_rate", "hca_rate", "o_groups", "o_rank", "index_heads", "index_dim",
                     "index_topk", "hc_mult", "hc_iters"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.deepseek_v4.{name} = {value!r}; allowed: a positive int")
        for name in ("compress_theta", "hc_eps", "swiglu_limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"ModelConfig.deepseek_v4.{name} = {value!r}; allowed: a positive number")
            object.__setattr__(self, name, float(value))
        layers = tuple(self.hash_layers)
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers) or \
                list(layers) != sorted(set(layers)):
            raise ValueError(f"ModelConfig.deepseek_v4.hash_layers = {self.hash_layers!r}; allowed: increasing "
                             f"layer indices (ints >= 0)")
        object.__setattr__(self, "hash_layers", layers)
        object.__setattr__(self, "compress_yarn", Yarn.coerce(self.compress_yarn))
        if self.index_dim % 2:
            raise ValueError(f"ModelConfig.deepseek_v4.index_dim = {self.index_dim}; allowed: an even number")

    @classmethod
    def coerce(cls, value) -> "DeepseekV4 | None":
        """Itself, None, or its dict form (`ModelConfig.to_dict` / JSON)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise ValueError(f"ModelConfig.deepseek_v4 has unknown keys {sorted(unknown)}; allowed: "
                                 f"{', '.join(f.name for f in dataclasses.fields(cls))}")
            return cls(**value)
        raise ValueError(f"ModelConfig.deepseek_v4 = {value!r}; allowed: None or a DeepseekV4 settings object / dict")

    def to_dict(self) -> dict:
        """The JSON form `coerce` reads back; `compress_yarn` only when set (added later: the fingerprints of
        configs without it stay put)."""
        out = dataclasses.asdict(self)
        if self.compress_yarn is None:
            del out["compress_yarn"]
        out["hash_layers"] = list(self.hash_layers)
        return out

    def compress_inv_freq(self, rotary_dim: int) -> np.ndarray | None:
        """The compressed layers' RoPE inverse frequencies [rotary_dim / 2] under YaRN, or None (theta's own)."""
        return None if self.compress_yarn is None else self.compress_yarn.inv_freq(self.compress_theta, rotary_dim)

    def check(self, cfg) -> None:
        """Cross-field checks against the ModelConfig `cfg` (ValueError naming the fields)."""
        if self.hash_layers and self.hash_layers[-1] >= cfg.n_layers:
            raise ValueError(f"ModelConfig.deepseek_v4.hash_layers = {self.hash_layers}; allowed: layers < "
                             f"n_layers = {cfg.n_layers}")
        if cfg.n_kv_heads != 1:
            raise ValueError(f"ModelConfig.n_kv_heads = {cfg.n_kv_heads} with deepseek_v4; allowed: 1 (one shared "
                             f"key = value head)")
        if (cfg.n_heads * cfg.head_dim) % self.o_groups:
            raise ValueError(f"ModelConfig.deepseek_v4.o_groups = {self.o_groups} does not divide n_heads * "
                             f"head_dim = {cfg.n_heads * cfg.head_dim}; allowed: a divisor")
        if cfg.rotary_dim > self.index_dim:
            raise ValueError(f"ModelConfig: the rotary dims ({cfg.rotary_dim}) exceed deepseek_v4.index_dim = "
                             f"{self.index_dim}; allowed: rotary dims <= index_dim")


def rope_tail(x: jax.Array, positions: jax.Array, theta: float, rotary_dim: int, policy: NumericPolicy,
              inv_freq: np.ndarray | None = None) -> jax.Array:
    """DeepSeek-V4's RoPE on the last `rotary_dim` dims of x [B, S, H, D] (each head laid out [nope | rope]), pairs
    (x0, x1), (x2, x3), ... interleaved and left in that layout (transformers' `apply_rotary_pos_emb` of
    deepseek_v4): the project's rotate-half RoPE on the de-interleaved pairs, then the pairs interleaved back (both
    exact permutations). Negative positions rotate backwards (V4 un-rotates the attention output that way).
    `inv_freq`: a scaled RoPE's frequencies (`DeepseekV4.compress_inv_freq`) in place of theta's."""
    d = x.shape[-1]
    nope, tail = x[..., :d - rotary_dim], x[..., d - rotary_dim:]
    rotated = rope(tail, positions, theta, policy, interleaved=True, inv_freq=inv_freq)  # [evens | odds], rotated
    half = rotary_dim // 2
    rotated = jnp.stack([rotated[..., :half], rotated[..., half:]], axis=-1).reshape(tail.shape)
    return jnp.concatenate([nope.astype(rotated.dtype), rotated], axis=-1)
