"""transformers families behind a registry: one module per `model_type` (config mapping, refused fields, weight
names, bf16 emulation overrides), the mixers' weight names through their layer kinds (`jaxalign.model.kinds`).
`docs/adding-a-family.md` walks through adding one."""

from __future__ import annotations

from jaxalign.interop.families.base import Family
from jaxalign.interop.families.deepseek_v3 import DeepseekV3
from jaxalign.interop.families.deepseek_v4 import DeepseekV4
from jaxalign.interop.families.glm4_moe import Glm4Moe
from jaxalign.interop.families.glm_moe_dsa import GlmMoeDsa
from jaxalign.interop.families.gpt_oss import GptOss
from jaxalign.interop.families.mixtral import Mixtral
from jaxalign.interop.families.olmoe import Olmoe
from jaxalign.interop.families.qwen2_moe import Qwen2Moe
from jaxalign.interop.families.qwen3_5_moe import Qwen3_5Moe, Qwen3_5MoeText
from jaxalign.interop.families.qwen3_moe import Qwen3Moe
from jaxalign.interop.families.qwen3_next import Qwen3Next

_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add a family under its `model_type` (a model_type already taken by another class is refused)."""
    if not isinstance(family, Family) or not family.model_type:
        raise ValueError(f"register takes a Family instance with a model_type, got {family!r}")
    taken = _FAMILIES.get(family.model_type)
    if taken is not None and type(taken) is not type(family):
        raise ValueError(f"model_type {family.model_type!r} is already registered ({type(taken).__name__})")
    _FAMILIES[family.model_type] = family
    return family


def names() -> tuple[str, ...]:
    """Registered model_types, in registration order."""
    return tuple(_FAMILIES)


def get(model_type: str) -> Family:
    """The family of `model_type`; an unknown one raises ValueError listing the supported ones."""
    if model_type not in _FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(_FAMILIES)}")
    return _FAMILIES[model_type]


for _family in (Qwen3Moe(), Qwen2Moe(), Mixtral(), Olmoe(), Glm4Moe(), DeepseekV3(), GlmMoeDsa(), Qwen3_5MoeText(),
                Qwen3_5Moe(), Qwen3Next(), GptOss(), DeepseekV4()):
    register(_family)
