"""Basic layers: parameters with logical axis names, linear, RMSNorm, embedding, dense SwiGLU MLP.

Parameters are float32 masters. Every numeric decision goes through `jaxalign.numerics`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxalign.numerics import NumericPolicy, as_param, fp8
from jaxalign.numerics.experts import swiglu
from jaxalign.numerics.lora import lora_linear, merged_weight
from jaxalign.numerics.matmul import add_bias, lookup, matmul
from jaxalign.numerics.reduce import rms_norm


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], *, std: float | None = None,
          fan_in: int | None = None, init: str = "normal") -> nnx.Param:
    """A float32 parameter tagged with logical axis names (mapped to mesh axes by `model.sharding`).

    `init`: "normal" (std, default 1/sqrt(fan_in)), "ones" or "zeros".
    """
    if len(shape) != len(axes):
        raise ValueError(f"parameter of shape {shape} needs {len(shape)} axis names, got {axes}")
    if init == "ones":
        value = jnp.ones(shape, jnp.float32)
    elif init == "zeros":
        value = jnp.zeros(shape, jnp.float32)
    else:
        scale = std if std is not None else 1.0 / math.sqrt(fan_in if fan_in else shape[0])
        value = scale * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value, logical_axes=axes)


class LoRAParam(nnx.Param):
    """A LoRA adapter parameter (the trainer can train these alone)."""


class Linear(nnx.Module):
    """y = x @ w (+ b), w [in, out]; optional LoRA adapter (see `add_lora`)."""

    def __init__(self, d_in: int, d_out: int, axes: tuple[str, str], *, rngs: nnx.Rngs, bias: bool = False):
        self.w = param(rngs, (d_in, d_out), axes, fan_in=d_in)
        self.b = param(rngs, (d_out,), axes[1:], init="zeros") if bias else None
        self.lora_a = nnx.data(None)
        self.lora_b = nnx.data(None)
        self.lora_scale = 0.0

    def add_lora(self, rank: int, alpha: float, rngs: nnx.Rngs) -> None:
        """Attach a rank-`rank` adapter (A random, B zero: the model's function is unchanged)."""
        d_in, d_out = self.w[...].shape
        axes = self.w.logical_axes
        self.lora_a = LoRAParam(jax.random.normal(rngs.params(), (d_in, rank), jnp.float32) / math.sqrt(d_in),
                                logical_axes=(axes[0], "lora_rank"))
        self.lora_b = LoRAParam(jnp.zeros((rank, d_out), jnp.float32), logical_axes=("lora_rank", axes[1]))
        self.lora_scale = alpha / rank

    def __call__(self, x: jax.Array, policy: NumericPolicy) -> jax.Array:
        if policy.quantizes_linears:
            w = self.w[...]
            if self.lora_a is not None and not fp8.is_quantized(w):
                # lora=merged (FP8 refuses unmerged): the merged weight is quantised, as the engine's at its sync
                w = merged_weight(w, self.lora_a[...], self.lora_b[...], self.lora_scale, policy)
            y = fp8.linear(x, w, policy)
        elif self.lora_a is not None:
            y = lora_linear(x, self.w[...], self.lora_a[...], self.lora_b[...], self.lora_scale, policy)
        else:
            y = matmul(x, as_param(self.w[...], policy), policy)
        if self.b is not None:
            y = add_bias(y, self.b[...], policy)
        return y


class RMSNorm(nnx.Module):
    """RMSNorm with a learned scale. `zero_centred` (Qwen3.5): the scale is 1 + w, w initialised at 0 and stored
    as transformers stores it; 1 + w is formed in float32 from w in the param dtype."""

    def __init__(self, dim: int, eps: float, axis_name: str = "norm", *, rngs: nnx.Rngs, zero_centred: bool = False):
        self.scale = param(rngs, (dim,), (axis_name,), init="zeros" if zero_centred else "ones")
        self.eps = eps
        self.zero_centred = zero_centred

    def __call__(self, x: jax.Array, policy: NumericPolicy) -> jax.Array:
        scale = self.scale[...]
        if self.zero_centred:
            # w in the param dtype first, as transformers holds it (1 + w.float()): so a trainer's f32 master and
            # an engine's copy cast once at sync give the same scale (casting again is exact)
            scale = 1.0 + as_param(scale, policy).astype(jnp.float32)
        return rms_norm(x, scale, policy, self.eps)


class Embedding(nnx.Module):
    """Token embedding table [vocab, d_model]; `attend` uses it as the tied LM head."""

    def __init__(self, vocab: int, dim: int, *, rngs: nnx.Rngs):
        self.table = param(rngs, (vocab, dim), ("vocab", "embed"), std=1.0)

    def __call__(self, tokens: jax.Array, policy: NumericPolicy) -> jax.Array:
        return lookup(self.table[...], tokens, policy)

    def attend(self, x: jax.Array, policy: NumericPolicy) -> jax.Array:
        """Logits against the embedding table (tied LM head), in the policy's logits dtype."""
        return matmul(x, as_param(self.table[...], policy).T, policy, out_dtype=policy.logits_dtype)


class DenseMLP(nnx.Module):
    """SwiGLU MLP: down(silu(x @ gate) * (x @ up))."""

    def __init__(self, d_model: int, hidden: int, *, rngs: nnx.Rngs):
        self.gate = Linear(d_model, hidden, ("embed", "mlp"), rngs=rngs)
        self.up = Linear(d_model, hidden, ("embed", "mlp"), rngs=rngs)
        self.down = Linear(hidden, d_model, ("mlp", "embed"), rngs=rngs)

    def __call__(self, x: jax.Array, policy: NumericPolicy) -> jax.Array:
        return self.down(swiglu(self.gate(x, policy), self.up(x, policy), policy), policy)
