"""compare: generate with the engine policy, score the same tokens with the trainer policy, report the gap."""

from __future__ import annotations

import numpy as np

from jaxalign.metrics.index import index_flip_metrics
from jaxalign.metrics.mismatch import mismatch_metrics
from jaxalign.metrics.routing import routing_metrics
from jaxalign.metrics.staleness import split_metrics
from jaxalign.engine import Engine, Rollout
from jaxalign.model.routing import index_layers
from jaxalign.model.scoring import token_logprobs
from jaxalign.model.sharding import mesh_description
from jaxalign.model.transformer import Transformer
from jaxalign.numerics import NumericPolicy
from jaxalign.replay_modes import REPLAY_MODES, replay_parts


def engine_replay(rollout: Rollout, mode: str, native_indices=None) -> dict:
    """The trainer-side replay inputs of `mode` for a rollout's tokens, as `token_logprobs` keywords: `replay`
    (r3/r3w: the engine's experts; r2: `native_indices`, a trainer pass's own), `replay_weights` (r3w: the
    engine's combine weights) and `index_replay` (+index: the engine's indexer selections, DSA's or CSA's)."""
    expert, with_index = replay_parts(mode)
    routing = rollout.routing
    if with_index and routing.index_positions is None:
        raise ValueError(f"replay = {mode!r} replays indexer selections, but this rollout has none (the model "
                         f"has no indexer: DSA or DeepSeek-V4's CSA); allowed here: {', '.join(m for m in REPLAY_MODES if 'index' not in m)}")
    experts = {"none": None, "r2": native_indices, "r3": routing.indices, "r3w": routing.indices}[expert]
    return {"replay": None if experts is None else np.asarray(experts),
            "replay_weights": np.asarray(routing.weights) if expert == "r3w" else None,
            "index_replay": np.asarray(routing.index_positions) if with_index else None}


def random_prompts(vocab_size: int, n: int, seed: int, min_len: int = 4, max_len: int = 16) -> list[np.ndarray]:
    """`n` prompts of uniform random token ids with lengths in [min_len, max_len]."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, int(rng.integers(min_len, max_len + 1))).astype(np.int32)
            for _ in range(n)]


def score_rollout(model: Transformer, rollout: Rollout, trainer: NumericPolicy, *, replay: str = "none",
                  mesh=None) -> dict:
    """Trainer-side scores of a rollout and the mismatch/routing metrics against the engine's, under the sampling
    parameters the rollout was generated with (`rollout.sampling`).

    replay: `none` (trainer routes natively), `r3` (engine-recorded experts), `r3w` (engine-recorded experts and
    combine weights), `r2` (experts recorded by a separate trainer pass of the old policy -- at identical
    weights, the trainer's own native routing); `index` / `r3+index` / `r3w+index` also replay the engine's DSA
    index selections (DSA models).
    `mesh`: the trainer's device mesh (None = one device).
    Returns {"metrics": {...}, "routing": {...}, "native_routing": {...}, "logp_trainer": array} and, for a DSA
    model, "index": the engine's index selections against the trainer's own indexer (`index_flip_metrics`).
    """
    replay_parts(replay)
    kw = dict(sampling=rollout.sampling, mesh=mesh)
    engine_idx = np.asarray(rollout.routing.indices)
    forwarded = (engine_idx >= 0).all(-1).all(-1)
    _, native = token_logprobs(model, rollout.tokens, trainer, **kw)
    logp, record = token_logprobs(model, rollout.tokens, trainer, **kw,
                                  **engine_replay(rollout, replay, np.asarray(native.indices)))
    out = {
        "metrics": mismatch_metrics(np.asarray(logp), rollout.logprobs, rollout.mask),
        "routing": routing_metrics(engine_idx, np.asarray(record.indices), valid=forwarded,
                                   margins_a=rollout.routing.margins),
        "native_routing": routing_metrics(engine_idx, np.asarray(native.indices), valid=forwarded),
        "logp_trainer": np.asarray(logp),
    }
    if rollout.routing.index_positions is not None:
        out["index"] = index_flip_metrics(rollout.routing.index_positions, np.asarray(record.index_positions),
                                          valid=forwarded, margins_a=rollout.routing.index_margins)
    return out


def compare(model: Transformer, trainer: NumericPolicy, engine: NumericPolicy, *, replay: str = "none",
            n_prompts: int = 16, max_new_tokens: int = 32, engine_batches=(8,), schedule: str = "static",
            prefill_chunk: int | None = None, seed: int = 0, temperature: float = 1.0, trainer_mesh=None,
            engine_mesh=None, behaviour_model: Transformer | None = None) -> dict:
    """Run the engine at each batch size and score with the trainer. Returns a JSON-ready report.
    `trainer_mesh` / `engine_mesh`: device meshes (`jaxalign.make_mesh`) for each side; None = one device.
    `behaviour_model`: older weights of the same model (an asynchronous run's behaviour version): the engine
    generates with them, the trainer scores with `model` (the current weights) and with them, and each run adds
    the staleness/numerics split of the log ratio (`metrics.staleness.split_metrics`: `numerics/...` = trainer vs
    engine at the behaviour weights, `staleness/...` = trainer at the current vs the behaviour weights)."""
    if behaviour_model is not None and behaviour_model.config != model.config:
        raise ValueError("behaviour_model must be older weights of the same model (another ModelConfig was given)")
    if replay_parts(replay)[1] and not index_layers(model.config):
        raise ValueError(f"replay = {replay!r} replays indexer selections, but this model has no indexer (DSA or "
                         f"DeepSeek-V4's CSA); allowed here: "
                         f"{', '.join(m for m in REPLAY_MODES if 'index' not in m)}")
    prompts = random_prompts(model.config.vocab_size, n_prompts, seed,
                             max_len=min(16, model.config.max_seq_len - max_new_tokens))
    eng = Engine(model if behaviour_model is None else behaviour_model, engine, mesh=engine_mesh)
    runs = []
    for batch in engine_batches:
        rollout = eng.generate(prompts, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                               batch_size=batch, schedule=schedule, prefill_chunk=prefill_chunk)
        scored = score_rollout(model, rollout, trainer, replay=replay, mesh=trainer_mesh)
        routing = scored["routing"]
        split = {}
        if behaviour_model is not None:
            stale = score_rollout(behaviour_model, rollout, trainer, replay=replay, mesh=trainer_mesh)
            split = split_metrics(scored["logp_trainer"], stale["logp_trainer"], rollout.logprobs, rollout.mask)
            split["numerics/route_flip_rate"] = stale["routing"]["route_flip_rate"]
        runs.append({"engine_batch": batch, **scored["metrics"], **split,
                     **{k: v for k, v in routing.items() if k != "n_decisions"},
                     "native_route_flip_rate": scored["native_routing"]["route_flip_rate"],
                     **({"index_flip_rate": scored["index"]["index_flip_rate"]} if "index" in scored else {}),
                     "engine_seconds": rollout.stats["seconds"]})
    return {"model": model.config.family if model.config.family != "jaxalign" else "jaxalign",
            "config_fingerprint": model.config.fingerprint(), "trainer": str(trainer), "engine": str(engine),
            "policy_diff": [list(d) for d in trainer.diff(engine)], "replay": replay, "schedule": schedule,
            "behaviour_model": behaviour_model is not None,
            "prefill_chunk": prefill_chunk, "trainer_mesh": mesh_description(trainer_mesh),
            "engine_mesh": mesh_description(engine_mesh), "prompts": n_prompts, "max_new_tokens": max_new_tokens, "seed": seed,
            "runs": runs}
