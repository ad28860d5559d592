"""Layer kinds: the seam a model family plugs into.

A model is a stack of layers; `ModelConfig.layer_kinds` names each layer's kind (`layer_types`, or every layer
the attention kind). A kind (`base.LayerKind`) owns its config fields and their validation, its mixer (the
nnx module in a block's `attn` slot, trainer and engine forms picked by policy fields), its per-layer engine
state (an opaque pytree: init, reset of refilled rows, bytes), its LoRA targets, its transformers weight names
and its `jaxalign check` probes. `docs/adding-a-family.md` walks through adding one.

Registered here: `gqa` (grouped-query attention), `mla` (multi-head latent attention), `dsa` (MLA with the
DeepSeek sparse attention indexer), `gated_deltanet` (Qwen3.5 / Qwen3-Next linear attention), `sink_attention` and
`sliding_sink_attention` (gpt-oss: GQA with attention sinks, full or over a sliding window), `dsv4_sliding`,
`dsv4_csa` and `dsv4_hca` (DeepSeek-V4: sliding window, plus compressed sparse or heavily compressed attention).
"""

from __future__ import annotations

from jaxalign.model.kinds.base import LayerKind, MixerOutput, split_rows  # noqa: F401

_KINDS: dict[str, LayerKind] = {}


def register(kind: LayerKind) -> LayerKind:
    """Add a kind to the registry under `kind.name` (a name already taken by another kind is refused)."""
    if not isinstance(kind, LayerKind) or not kind.name:
        raise ValueError(f"register takes a LayerKind instance with a name, got {kind!r}")
    if kind.name in _KINDS and type(_KINDS[kind.name]) is not type(kind):
        raise ValueError(f"layer kind {kind.name!r} is already registered ({type(_KINDS[kind.name]).__name__})")
    _KINDS[kind.name] = kind
    return kind


def get(name: str) -> LayerKind:
    """The kind registered as `name`; an unknown name raises ValueError listing the registered ones."""
    if name not in _KINDS:
        raise ValueError(f"unknown layer kind {name!r}; registered: {', '.join(_KINDS)}")
    return _KINDS[name]


def names() -> tuple[str, ...]:
    """Registered kind names, in registration order."""
    return tuple(_KINDS)


def all_kinds() -> tuple[LayerKind, ...]:
    """Every registered kind."""
    return tuple(_KINDS.values())


def kinds_of(cfg) -> tuple[LayerKind, ...]:
    """The distinct kinds `cfg`'s layers run, in first-layer order."""
    return tuple(get(name) for name in dict.fromkeys(cfg.layer_kinds))


def kind_of(cfg, layer: int) -> LayerKind:
    """The kind of layer `layer` of `cfg`."""
    return get(cfg.layer_kinds[layer])


def _register_builtin() -> None:
    from jaxalign.model.kinds.deltanet import GatedDeltaNetKind
    from jaxalign.model.kinds.dsv4 import DeepseekV4CSAKind, DeepseekV4HCAKind, DeepseekV4Kind
    from jaxalign.model.kinds.gqa import GQA
    from jaxalign.model.kinds.mla import DSA, MLA
    from jaxalign.model.kinds.sinks import SinkAttentionKind, SlidingSinkAttentionKind
    for kind in (GQA(), MLA(), DSA(), GatedDeltaNetKind(), SinkAttentionKind(), SlidingSinkAttentionKind(),
                 DeepseekV4Kind(), DeepseekV4CSAKind(), DeepseekV4HCAKind()):
        register(kind)


_register_builtin()
