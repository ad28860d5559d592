"""Attach LoRA adapters to a model's linear layers, and fold them in for an engine that serves them merged."""

from __future__ import annotations

from flax import nnx

from jaxalign.model.config import ModelConfig
from jaxalign.model.layers import Linear, LoRAParam  # noqa: F401
from jaxalign.model.transformer import Transformer
from jaxalign.numerics import NumericPolicy
from jaxalign.numerics.lora import merged_weight

MLP_TARGETS = ("gate", "up", "down")  # dense layers and shared experts (routed experts are stacked tensors)


def all_targets() -> tuple[str, ...]:
    """Every adaptable layer name: each registered layer kind's `lora_names`, then the MLP layers."""
    from jaxalign.model import kinds
    return tuple(dict.fromkeys([t for kind in kinds.all_kinds() for t in kind.lora_names] + list(MLP_TARGETS)))
# the DSA indexer only feeds a top-k: no gradient reaches its projections (transformers runs it under no_grad)
INDEXER_LINEARS = ("wq_b", "wk", "weights_proj")


def attention_targets(cfg: ModelConfig) -> tuple[str, ...]:
    """Every projection of the mixers `cfg`'s layer kinds run (`LayerKind.lora_targets`; what `add_lora` adapts
    by default)."""
    from jaxalign.model import kinds
    return tuple(dict.fromkeys(t for kind in kinds.kinds_of(cfg) for t in kind.lora_targets(cfg)))


def _targets_of(model: Transformer) -> set[str]:
    """The adaptable layer names this model has."""
    return {path[-1] for path, module in nnx.iter_graph(model)
            if isinstance(module, Linear) and path and path[-1] in all_targets()}


def add_lora(model: Transformer, rank: int, alpha: float, targets=None, *, seed: int = 0) -> int:
    """Attach adapters to every Linear whose attribute name is in `targets` (default: `attention_targets` of the
    model's config; also the dense / shared-expert MLP layers `gate`, `up`, `down`). Returns the count.

    A target this model does not have (e.g. `k_proj` on an MLA model) is refused with the ones it has; so are
    the DSA indexer's projections, which no gradient reaches."""
    TARGETS = all_targets()
    if rank < 1 or alpha <= 0:
        raise ValueError(f"LoRA rank = {rank}, alpha = {alpha}; allowed: rank >= 1, alpha > 0")
    targets = attention_targets(model.config) if targets is None else tuple(targets)
    indexer = sorted(set(targets) & set(INDEXER_LINEARS))
    if indexer:
        raise ValueError(f"LoRA targets {indexer} are the DSA indexer's projections: its top-k is not "
                         f"differentiable, so no gradient would reach an adapter there; allowed: "
                         f"{', '.join(TARGETS)}")
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise ValueError(f"unknown LoRA targets {unknown}; allowed: {', '.join(TARGETS)}")
    present = _targets_of(model)
    absent = [t for t in targets if t not in present]
    if absent:
        attention = attention_targets(model.config)
        others = [t for t in TARGETS if t in present and t not in attention]
        raise ValueError(f"LoRA targets {absent} match no layer of this {model.config.attention_kind} model; "
                         f"its targets: {', '.join(attention + tuple(others))}")
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
