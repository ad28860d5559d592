"""jaxalign's own engine behind the engine interface (`jaxalign.engines.base.RolloutEngine`): a thin adapter over
`jaxalign.engine.Engine` that changes none of its numerics (same programs, same weights cast, same Rollout)."""

from __future__ import annotations

import time

from jaxalign.engine.engine import Engine
from jaxalign.engine.rollout import Rollout
from jaxalign.model.transformer import Transformer
from jaxalign.numerics import NumericPolicy
from jaxalign.numerics.sampling import SamplingParams
from jaxalign.version import __version__


class LocalEngine:
    """`jaxalign.engine.Engine` as a `RolloutEngine`: `LocalEngine(model, policy, mesh=None, schedule="static",
    prefill_chunk=None)`; `.engine` is the wrapped Engine (for what the interface leaves out), `.policy` its
    policy."""

    name = "jaxalign"
    version = __version__

    def __init__(self, model: Transformer, policy: NumericPolicy, *, mesh=None, schedule: str = "static",
                 prefill_chunk: int | None = None):
        self.engine = Engine(model, policy, mesh=mesh)
        self.policy, self.numerics = policy, str(policy)
        self.schedule, self.prefill_chunk = schedule, prefill_chunk

    def generate(self, prompts, *, max_new_tokens: int, sampling: SamplingParams | None = None,
                 eos_id: int | None = None, seed: int = 0, batch_size: int | None = None) -> Rollout:
        """`Engine.generate` with this adapter's schedule and prefill chunk (see `RolloutEngine.generate`)."""
        rollout = self.engine.generate(prompts, max_new_tokens=max_new_tokens, sampling=sampling, eos_id=eos_id,
                                       seed=seed, batch_size=batch_size, schedule=self.schedule,
                                       prefill_chunk=self.prefill_chunk)
        rollout.stats.update(engine=self.name, engine_version=self.version, routing="recorded")
        return rollout

    def sync(self, model: Transformer) -> dict:
        """`Engine.sync_weights`: the engine casts the new weights once. Nothing to verify: the weights are the
        engine's own arrays, cast by one jitted program."""
        start = time.perf_counter()
        self.engine.sync_weights(model)
        return {"seconds": time.perf_counter() - start, "method": "cast", "verified": None}

    def close(self) -> None:
        """Nothing to release beyond Python references."""
