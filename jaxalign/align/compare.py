"""compare: generate with the engine policy, score the same tokens with the trainer policy, report the gap."""

from __future__ import annotations

import numpy as np

from jaxalign.align.metrics import mismatch_metrics
from jaxalign.align.routing import routing_metrics
from jaxalign.engine import Engine, Rollout
from jaxalign.model.scoring import token_logprobs
from jaxalign.model.sharding import mesh_description
from jaxalign.model.transformer import Transformer
from jaxalign.numerics import NumericPolicy
from jaxalign.replay_modes import REPLAY_MODES



def random_prompts(vocab_size: int, n: int, seed: int, min_len: int = 4, max_len: int = 16) -> list[np.ndarray]:
    """`n` prompts of uniform random token ids with lengths in [min_len, max_len]."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, int(rng.integers(min_len, max_len + 1))).astype(np.int32)
            for _ in range(n)]


def score_rollout(model: Transformer, rollout: Rollout, trainer: NumericPolicy, *, replay: str = "none",
                  mesh=None) -> dict:
    """Trainer-side scores of a rollout and the mismatch/routing metrics against the engine's, under the sampling
    parameters the rollout was generated with (`rollout.sampling`).

    replay: `none` (trainer routes natively), `r3` (engine-recorded experts), `r2` (experts recorded by a
    separate trainer pass of the old policy -- at identical weights, the trainer's own native routing).
    `mesh`: the trainer's device mesh (None = one device).
    Returns {"metrics": {...}, "routing": {...}, "native_routing": {...}, "logp_trainer": array}.
    """
    if replay not in REPLAY_MODES:
        raise ValueError(f"replay = {replay!r}; allowed: {', '.join(REPLAY_MODES)}")
    kw = dict(sampling=rollout.sampling, mesh=mesh)
    engine_idx = np.asarray(rollout.routing.indices)
    forwarded = (engine_idx >= 0).all(-1).all(-1)
    _, native = token_logprobs(model, rollout.tokens, trainer, **kw)
    replay_idx = {"none": None, "r3": engine_idx, "r2": np.asarray(native.indices)}[replay]
    logp, record = token_logprobs(model, rollout.tokens, trainer, replay=replay_idx, **kw)
    return {
        "metrics": mismatch_metrics(np.asarray(logp), rollout.logprobs, rollout.mask),
        "routing": routing_metrics(engine_idx, np.asarray(record.indices), valid=forwarded,
                                   margins_a=rollout.routing.margins),
        "native_routing": routing_metrics(engine_idx, np.asarray(native.indices), valid=forwarded),
        "logp_trainer": np.asarray(logp),
    }


def compare(model: Transformer, trainer: NumericPolicy, engine: NumericPolicy, *, replay: str = "none",
            n_prompts: int = 16, max_new_tokens: int = 32, engine_batches=(8,), schedule: str = "static",
            prefill_chunk: int | None = None, seed: int = 0, temperature: float = 1.0, trainer_mesh=None,
            engine_mesh=None) -> dict:
    """Run the engine at each batch size and score with the trainer. Returns a JSON-ready report.
    `trainer_mesh` / `engine_mesh`: device meshes (`jaxalign.make_mesh`) for each side; None = one device."""
    prompts = random_prompts(model.config.vocab_size, n_prompts, seed,
                             max_len=min(16, model.config.max_seq_len - max_new_tokens))
    eng = Engine(model, engine, mesh=engine_mesh)
    runs = []
    for batch in engine_batches:
        rollout = eng.generate(prompts, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                               batch_size=batch, schedule=schedule, prefill_chunk=prefill_chunk)
        scored = score_rollout(model, rollout, trainer, replay=replay, mesh=trainer_mesh)
        routing = scored["routing"]
        runs.append({"engine_batch": batch, **scored["metrics"],
                     **{k: v for k, v in routing.items() if k != "n_decisions"},
                     "native_route_flip_rate": scored["native_routing"]["route_flip_rate"],
                     "engine_seconds": rollout.stats["seconds"]})
    return {"model": model.config.family if model.config.family != "jaxalign" else "jaxalign",
            "config_fingerprint": model.config.fingerprint(), "trainer": str(trainer), "engine": str(engine),
            "policy_diff": [list(d) for d in trainer.diff(engine)], "replay": replay, "schedule": schedule,
            "prefill_chunk": prefill_chunk, "trainer_mesh": mesh_description(trainer_mesh),
            "engine_mesh": mesh_description(engine_mesh), "prompts": n_prompts, "max_new_tokens": max_new_tokens, "seed": seed,
            "runs": runs}
