"""The engine interface: anything that turns prompts into a `Rollout` and accepts weights (DESIGN.md, "Engines").

Tunix's `BaseRollout` is the anchor: a rollout engine generates from token ids, reports the logprob of every
sampled token under the distribution it sampled from, takes new weights with `sync`, and is closed when done.
jaxalign's own engine (`jaxalign.engines.local.LocalEngine`) and vLLM run as a separate process
(`jaxalign.engines.vllm.VllmEngine`) both implement it; `jaxalign.engines.open_engine` builds either from a
spec string (`vllm[:DTYPE]` or a jaxalign policy string).

Routing: an engine that cannot record which experts it used (vLLM on the CPU) fills `Rollout.routing.indices`
with -1 (not routed) and says so in `Rollout.stats["routing"]` (`"not recorded"`), so no router replay (R3) is
built from it.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

from jaxalign.engine.engine import check_prompts as engine_prompts
from jaxalign.engine.rollout import Rollout
from jaxalign.model.transformer import Transformer
from jaxalign.numerics.sampling import SamplingParams


@runtime_checkable
class RolloutEngine(Protocol):
    """A rollout engine (see the module docstring).

    `name`: a short name (`jaxalign`, `vllm`); `version`: its version string; `numerics`: what it computes in
    (a policy string for jaxalign, e.g. `vllm:bfloat16` for vLLM) -- the three go into every report."""

    name: str
    version: str
    numerics: str

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                 sampling: SamplingParams | None = None, eos_id: int | None = None, seed: int = 0,
                 batch_size: int | None = None) -> Rollout:
        """A completion for every prompt (token-id sequences), at most `max_new_tokens` each, stopping at
        `eos_id` (None: never), drawn from `sampling` (default temperature 1) with random draws keyed by `seed`
        and the request's index; `batch_size` requests run together (None: all at once). Returns a `Rollout`
        with the engine's logprob of every sampled token."""
        ...

    def sync(self, model: Transformer) -> dict:
        """Take `model`'s weights. Returns what was done (seconds, and whether and how the sync was verified)."""
        ...

    def close(self) -> None:
        """Release the engine (a process, memory); calling it twice is harmless."""
        ...


def describe(engine: RolloutEngine) -> dict:
    """The engine as a report names it: {"name", "version", "numerics"}."""
    return {"name": engine.name, "version": engine.version, "numerics": engine.numerics}


def check_prompts(prompts, vocab_size: int, max_new_tokens: int, max_len: int | None = None) -> list[list[int]]:
    """Prompts as lists of Python ints, checked as jaxalign's own engine checks them (`engine.check_prompts`:
    non-empty, 1-D, integer ids in 0..vocab_size-1, and with `max_len` prompt + max_new_tokens within it)."""
    return [[int(t) for t in arr] for arr in
            engine_prompts(prompts, vocab_size, max_new_tokens, max_len, f"the engine's maximum length {max_len}")]
