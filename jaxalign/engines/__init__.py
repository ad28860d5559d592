"""Rollout engines behind one interface (`base.RolloutEngine`): jaxalign's own (`local.LocalEngine`) and vLLM run
as a separate process (`vllm.VllmEngine`). `open_engine(spec, model)` builds one from what `--engine` takes: a
jaxalign policy string, or `vllm[:DTYPE][,sync=METHOD]`."""

from __future__ import annotations

import dataclasses

from jaxalign.engines.base import RolloutEngine, check_prompts, describe
from jaxalign.engines.local import LocalEngine
from jaxalign.numerics import NumericPolicy


@dataclasses.dataclass(frozen=True)
class VllmSpec:
    """`vllm[:DTYPE][,sync=METHOD]` as `--engine` takes it: vLLM in its own process, computing in DTYPE (bf16
    default), synced to the trainer's weights by METHOD: `reload` (default: a fresh load of the exported files) or
    `inplace` (vLLM's own `reload_weights`, which leaves MoE experts wrong on the CPU; docs/vllm.md -- there to
    show that every sync's verification catches it)."""

    dtype: str = "bf16"
    sync: str = "reload"

    def __post_init__(self):
        from jaxalign.engines.vllm.engine import SYNC_METHODS, parse_dtype
        parse_dtype(self.dtype)
        if self.sync not in SYNC_METHODS:
            raise ValueError(f"vLLM sync method {self.sync!r}; allowed: {', '.join(SYNC_METHODS)}")

    def __str__(self) -> str:
        return f"vllm:{self.dtype}" + ("" if self.sync == "reload" else f",sync={self.sync}")


def parse_engine(text: str) -> NumericPolicy | VllmSpec:
    """An engine spec: `vllm[:DTYPE][,sync=METHOD]` (DTYPE bf16, fp16, fp32; METHOD reload, inplace) -> VllmSpec;
    anything else is a jaxalign policy string -> NumericPolicy. ValueError naming what is allowed."""
    if text == "vllm" or text.startswith(("vllm:", "vllm,")):
        from jaxalign.engines.vllm.engine import SYNC_METHODS
        head, *options = text.split(",")
        sync = "reload"
        for option in options:
            key, eq, value = option.partition("=")
            if key != "sync" or not eq:
                raise ValueError(f"vLLM engine option {option!r} in {text!r}; allowed: sync=METHOD "
                                 f"(METHOD one of {', '.join(SYNC_METHODS)})")
            sync = value
        try:
            return VllmSpec(head.partition(":")[2] or "bf16", sync)
        except ValueError as err:
            raise ValueError(f"{err} (in {text!r})") from None
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
    raise ValueError(f"{label} must be a NumericPolicy, a policy string or vllm[:DTYPE][,sync=METHOD], "
                     f"got {type(value).__name__}")


def engine_text(spec: NumericPolicy | VllmSpec) -> str:
    """An engine spec as text that `parse_engine` reads back: a policy's compact form, or `vllm:DTYPE[,sync=METHOD]`."""
    return spec.compact() if isinstance(spec, NumericPolicy) else str(spec)


def open_engine(spec: NumericPolicy | VllmSpec | str, model, **kw) -> RolloutEngine:
    """A `RolloutEngine` for `spec` (`parse_engine`'s result or text) holding `model`'s weights: a `LocalEngine`
    for a policy, a `VllmEngine` for `vllm[:DTYPE]` (`model` may then also be a transformers checkpoint
    directory). `kw` goes to the engine's constructor."""
    if isinstance(spec, str):
        spec = parse_engine(spec)
    if isinstance(spec, VllmSpec):
        from jaxalign.engines.vllm import VllmEngine
        return VllmEngine(model, dtype=spec.dtype, **{"sync_method": spec.sync, **kw})
    return LocalEngine(model, spec, **kw)


__all__ = ["LocalEngine", "RolloutEngine", "VllmSpec", "check_prompts", "coerce_engine", "describe", "engine_text",
           "open_engine", "parse_engine"]
