"""YaRN RoPE scaling (gpt-oss's default `rope_parameters`): its settings, the inverse frequencies and attention
factor it gives, and its transformers `rope_parameters` form.

transformers' `_compute_yarn_parameters` (modeling_rope_utils.py, 5.24), mirrored step by step in float32 NumPy:

    pos_freqs = theta ** (arange(0, dim, 2) / dim)
    extrapolation, interpolation = 1 / pos_freqs, 1 / (factor * pos_freqs)
    low, high = the correction range of beta_fast and beta_slow rotations over original_max_position positions
                (floored / ceiled when `truncate`), clipped to [0, dim - 1]
    ramp = clip((arange(dim / 2) - low) / (high - low), 0, 1);  keep = 1 - ramp
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    attention_factor = 0.1 * ln(factor) + 1   (1 when factor <= 1)

cos and sin are multiplied by the attention factor in float32 (numerics/attention.py `rope`). The explicit
`attention_factor` and the `mscale` / `mscale_all_dim` variants (DeepSeek's) are refused by name.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

# the rope_parameters keys a YaRN config may carry here (besides rope_type and rope_theta)
YARN_KEYS = ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings", "truncate")
REFUSED_KEYS = ("attention_factor", "mscale", "mscale_all_dim")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Yarn:
    """YaRN settings: `factor` (context extension), `beta_fast` / `beta_slow` (the ramp's bounds in rotations),
    `original_max_position` (the pre-extension context), `truncate` (round the correction range to whole dims)."""

    factor: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position: int
    truncate: bool = True

    def __post_init__(self) -> None:
        for name in ("factor", "beta_fast", "beta_slow"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"ModelConfig.rope_yarn.{name} = {value!r}; allowed: a positive number")
            object.__setattr__(self, name, float(value))
        if isinstance(self.original_max_position, bool) or not isinstance(self.original_max_position, int) \
                or self.original_max_position <= 0:
            raise ValueError(f"ModelConfig.rope_yarn.original_max_position = {self.original_max_position!r}; "
                             f"allowed: a positive int")
        if not isinstance(self.truncate, bool):
            raise ValueError(f"ModelConfig.rope_yarn.truncate = {self.truncate!r}; allowed: true, false")

    @classmethod
    def coerce(cls, value) -> "Yarn | None":
        """A Yarn from itself, None, or its dict form (`ModelConfig.to_dict` / JSON)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise ValueError(f"ModelConfig.rope_yarn has unknown keys {sorted(unknown)}; allowed: "
                                 f"{', '.join(f.name for f in dataclasses.fields(cls))}")
            return cls(**value)
        raise ValueError(f"ModelConfig.rope_yarn = {value!r}; allowed: None or a YaRN settings object / dict")

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by: 0.1 * ln(factor) + 1 (1 for factor <= 1)."""
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0

    def correction_range(self, theta: float, dim: int) -> tuple[float, float]:
        """(low, high): the dims where the ramp from interpolation to extrapolation starts and ends."""
        def dim_of(rotations):
            return (dim * math.log(self.original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(theta))
        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, dim - 1)

    def inv_freq(self, theta: float, dim: int) -> np.ndarray:
        """The inverse frequencies [dim / 2] (float32) of a `dim`-wide rotation with base `theta`."""
        f32 = np.float32
        pos_freqs = f32(theta) ** (np.arange(0, dim, 2).astype(f32) / f32(dim))
        extrapolation = f32(1.0) / pos_freqs
        interpolation = f32(1.0) / (f32(self.factor) * pos_freqs)
        low, high = self.correction_range(theta, dim)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = np.clip((np.arange(dim // 2, dtype=f32) - f32(low)) / f32(high - low), f32(0), f32(1))
        keep = f32(1) - ramp
        return (interpolation * (f32(1) - keep) + extrapolation * keep).astype(f32)

    # --- transformers rope_parameters ---------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, params: dict, field: str = "rope_parameters") -> "Yarn":
        """From a transformers `rope_parameters` dict of rope_type `yarn`; keys this module does not implement
        (an explicit attention_factor, mscale, mscale_all_dim, a factor left to max_position_embeddings) are
        refused by name."""
        for key in REFUSED_KEYS:
            if params.get(key) is not None:
                raise ValueError(f"{field}.{key} = {params[key]!r} is not supported with rope_type 'yarn'; "
                                 f"supported: {key} unset (YaRN's factor gives the attention factor)")
        if params.get("factor") is None:
            raise ValueError(f"{field}.factor is missing; supported: rope_type 'yarn' with an explicit factor")
        if params.get("original_max_position_embeddings") is None:
            raise ValueError(f"{field}.original_max_position_embeddings is missing (required for rope_type 'yarn')")
        truncate = params.get("truncate", True)
        if not isinstance(truncate, bool):
            raise ValueError(f"{field}.truncate = {truncate!r}; allowed: true, false")
        return cls(factor=params["factor"], beta_fast=params.get("beta_fast") or 32.0,
                   beta_slow=params.get("beta_slow") or 1.0,
                   original_max_position=int(params["original_max_position_embeddings"]), truncate=truncate)

    def to_hf(self) -> dict:
        """The `rope_parameters` entries (besides rope_theta) transformers reads back to these settings."""
        return {"rope_type": "yarn", "factor": self.factor, "beta_fast": self.beta_fast, "beta_slow": self.beta_slow,
                "original_max_position_embeddings": self.original_max_position, "truncate": self.truncate}
