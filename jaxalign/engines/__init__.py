"""Rollout engines behind one interface (`base.RolloutEngine`): jaxalign's own (`local.LocalEngine`) and vLLM run
as a separate process (`vllm.VllmEngine`). `open_engine(spec, model)` builds one from what `--engine` takes: a
jaxalign policy string, or `vllm[:DTYPE]`."""

from __future__ import annotations

import dataclasses

from jaxalign.engines.base import RolloutEngine, check_prompts, describe
from jaxalign.engines.local import LocalEngine
from jaxalign.numerics import NumericPolicy


@dataclasses.dataclass(frozen=True)
class VllmSpec:
    """`vllm[:DTYPE]` as `--engine` takes it: vLLM in its own process, computing in DTYPE (bf16 default)."""

    dtype: str = "bf16"

    def __str__(self) -> str:
        return f"vllm:{self.dtype}"


def parse_engine(text: str) -> NumericPolicy | VllmSpec:
    """An engine spec: `vllm` or `vllm:DTYPE` (DTYPE bf16, fp16, fp32) -> VllmSpec; anything else is a jaxalign
    policy string -> NumericPolicy. ValueError naming what is allowed."""
    if text == "vllm" or text.startswith("vllm:"):
        dtype = text.partition(":")[2] or "bf16"
        from jaxalign.engines.vllm.engine import parse_dtype
        parse_dtype(dtype)
        return VllmSpec(dtype)
    return NumericPolicy.parse(text)


def coerce_engine(value: "NumericPolicy | VllmSpec | str", *, label: str = "engine") -> NumericPolicy | VllmSpec:
    """An engine spec as it is (a `NumericPolicy` or `VllmSpec`); text is read by `parse_engine` (errors name
    `label`); anything else is refused clearly."""
    if isinstance(value, (NumericPolicy, VllmSpec)):
        return value
    if isinstance(value, str):
        try:
            return parse_engine(value)
        except ValueError as err:
            raise ValueError(f"{label}: {err}") from None
    raise ValueError(f"{label} must be a NumericPolicy, a policy string or vllm[:DTYPE], got {type(value).__name__}")


def engine_text(spec: NumericPolicy | VllmSpec) -> str:
    """An engine spec as text that `parse_engine` reads back: a policy's compact form, or `vllm:DTYPE`."""
    return spec.compact() if isinstance(spec, NumericPolicy) else str(spec)


def open_engine(spec: NumericPolicy | VllmSpec | str, model, **kw) -> RolloutEngine:
    """A `RolloutEngine` for `spec` (`parse_engine`'s result or text) holding `model`'s weights: a `LocalEngine`
    for a policy, a `VllmEngine` for `vllm[:DTYPE]` (`model` may then also be a transformers checkpoint
    directory). `kw` goes to the engine's constructor."""
    if isinstance(spec, str):
        spec = parse_engine(spec)
    if isinstance(spec, VllmSpec):
        from jaxalign.engines.vllm import VllmEngine
        return VllmEngine(model, dtype=spec.dtype, **kw)
    return LocalEngine(model, spec, **kw)


__all__ = ["LocalEngine", "RolloutEngine", "VllmSpec", "check_prompts", "coerce_engine", "describe", "engine_text",
           "open_engine", "parse_engine"]
