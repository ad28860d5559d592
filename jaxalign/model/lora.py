"""Attach LoRA adapters to a model's linear layers, and fold them in for an engine that serves them merged."""

from __future__ import annotations

from flax import nnx

from jaxalign.model.layers import Linear, LoRAParam
from jaxalign.model.transformer import Transformer
from jaxalign.numerics import NumericPolicy
from jaxalign.numerics.lora import merged_weight

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate", "up", "down")


def add_lora(model: Transformer, rank: int, alpha: float, targets=("q_proj", "k_proj", "v_proj", "o_proj"),
             *, seed: int = 0) -> int:
    """Attach adapters to every Linear whose attribute name is in `targets` (attention projections and dense /
    shared-expert MLP layers; routed experts are stacked tensors and are not adapted). Returns the count."""
    if rank < 1 or alpha <= 0:
        raise ValueError(f"LoRA rank = {rank}, alpha = {alpha}; allowed: rank >= 1, alpha > 0")
    unknown = set(targets) - set(TARGETS)
    if unknown:
        raise ValueError(f"unknown LoRA targets {sorted(unknown)}; allowed: {', '.join(TARGETS)}")
    rngs = nnx.Rngs(seed)
    count = 0
    for path, module in nnx.iter_graph(model):
        if isinstance(module, Linear) and path and path[-1] in targets:
            module.add_lora(rank, alpha, rngs)
            count += 1
    return count


def merge_lora_for_serving(model: Transformer, policy: NumericPolicy) -> None:
    """In place: fold every adapter into its weight (rounded to the policy's param dtype, exactly as the
    `merged` forward does) and zero B, so a `merged` engine does no adapter work per step."""
    for _, module in nnx.iter_graph(model):
        if isinstance(module, Linear) and module.lora_a is not None:
            module.w[...] = merged_weight(module.w[...], module.lora_a[...], module.lora_b[...], module.lora_scale,
                                          policy)
            module.lora_b[...] = module.lora_b[...] * 0


def has_lora(model: Transformer) -> bool:
    """Whether any layer carries an adapter."""
    return any(isinstance(m, Linear) and m.lora_a is not None for _, m in nnx.iter_graph(model))


def is_lora_path(path) -> bool:
    """Whether a parameter path (from jax.tree_util) names an adapter parameter."""
    return any(str(getattr(p, "key", getattr(p, "name", p))) in ("lora_a", "lora_b") for p in path)
