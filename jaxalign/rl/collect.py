"""Collect: one step's rollout -> reward -> the trainer's passes -> rollout correction, as the update's `TrainBatch`
and the step's rollout metrics. Engine-agnostic: it reads a `Rollout` (from jaxalign's engine or vLLM) and asks the
`Learner` for the trainer's logprobs.

An engine that records no routing (vLLM on the CPU: every index -1) gets no route-flip metrics (null in the row)
and no replay of its routes (`RLConfig` refuses r3 with it).
"""

from __future__ import annotations

import numpy as np

from jaxalign.metrics.routing import routing_metrics
from jaxalign.metrics.staleness import split_metrics
from jaxalign.replay_modes import replay_parts
from jaxalign.rl import tokenizer
from jaxalign.rl.correction import BYPASS, correct
from jaxalign.rl.grpo import advantages_of
from jaxalign.rl.learner import Learner, TrainBatch
from jaxalign.rl.task import Task


def pad_to(array: np.ndarray, width: int, axis: int, value) -> np.ndarray:
    """Right-pad (or check) `array` along `axis` to `width`."""
    extra = width - array.shape[axis]
    if extra < 0:
        raise ValueError(f"sequence of length {array.shape[axis]} exceeds the trainer width {width}")
    pad = [(0, 0)] * array.ndim
    pad[axis] = (0, extra)
    return np.pad(array, pad, constant_values=value)


def rewards_of(rollout, items: list, task: Task) -> np.ndarray:
    """The task's reward of each completion, float32 [R]."""
    return np.array([task.reward(item, rollout.completion(i)) for i, item in enumerate(items)], np.float32)


def trainer_inputs(rollout, width: int, replay: str):
    """What the trainer's passes over `rollout` read: (tokens, engine routes, the experts replayed to the trainer
    or None, the replay keywords of `token_logprobs`), padded to the trainer's `width`."""
    tokens = pad_to(rollout.tokens, width, 1, tokenizer.PAD)
    engine_routes = pad_to(np.asarray(rollout.routing.indices), width, 1, -1)
    expert_replay, with_index = replay_parts(replay)
    replay_kw = {"replay_weights": None, "index_replay": None}
    if expert_replay == "r3w":
        replay_kw["replay_weights"] = pad_to(np.asarray(rollout.routing.weights), width, 1, 0.0)
    if with_index:
        if rollout.routing.index_positions is None:
            raise ValueError(f"replay = {replay!r} replays indexer selections; this model has none (DSA and "
                             f"DeepSeek-V4's CSA layers have them)")
        replay_kw["index_replay"] = pad_to(np.asarray(rollout.routing.index_positions), width, 1, -1)
    engine_experts = engine_routes if expert_replay in ("r3", "r3w") else None
    return tokens, engine_routes, engine_experts, replay_kw


def behaviour_pass(learner: Learner, model, rollout, width: int):
    """The trainer's per-token logprobs and routes of `rollout` under `model` (the weights that generated it):
    the numerics/staleness split's middle term."""
    tokens, _, engine_experts, replay_kw = trainer_inputs(rollout, width, learner.config.replay)
    return learner.logprobs(tokens, model=model, replay=engine_experts, replay_kw=replay_kw)


def _flips(a, b, valid) -> dict:
    """`routing_metrics` of two routing records over the tokens the engine routed; nulls when it routed none (an
    engine that records no routing)."""
    if not valid.any():
        return {"route_flip_rate": None, "route_token_any_flip": None}
    return routing_metrics(a, b, valid=valid)


def collect(learner: Learner, rollout, items: list, task: Task, width: int, *, step: int, version: int,
            behaviour=None) -> tuple[TrainBatch, dict, dict]:
    """Reward -> old-policy pass -> rollout correction for batch `step`'s `rollout` (of `items`, generated with
    the weights of `version`; the learner holds those of `step`): (the update's batch, the step's rollout metrics,
    the three per-token logprobs {"current", "behaviour", "engine", "mask"}).

    The PPO ratio's old policy is the trainer at the current weights (AReaL's proximal policy); the correction's
    ratio is that against the engine (the behaviour policy), and its log splits per token into numerics (engine
    vs trainer, both at the behaviour weights) plus staleness (trainer at the current vs the behaviour weights),
    reported as `numerics/...` and `staleness/...` (`metrics.staleness`). `behaviour`: when `version` < `step`,
    the trainer's pass at the behaviour weights ((logprobs, indices), `behaviour_pass`), or None when the split
    is not measured on this batch; when they are equal it is the old-policy pass itself."""
    cfg = learner.config
    rewards = rewards_of(rollout, items, task)
    advantages = advantages_of(rewards, cfg.grpo)
    logp_rollout = pad_to(rollout.logprobs, width - 1, 1, 0.0)
    mask = pad_to(rollout.mask, width - 1, 1, False)
    tokens, engine_routes, engine_experts, replay_kw = trainer_inputs(rollout, width, cfg.replay)
    expert_replay, _ = replay_parts(cfg.replay)
    lp_old, old_indices = learner.logprobs(tokens, replay=engine_experts, replay_kw=replay_kw)
    replay = {"none": None, "r3": engine_routes, "r3w": engine_routes, "r2": old_indices}[expert_replay]
    logp_behaviour = logp_rollout if cfg.mode == BYPASS else lp_old  # the PPO ratio's denominator
    weights, accept, corr_metrics = correct(lp_old, logp_rollout, mask, cfg.correction)
    if cfg.mode == BYPASS:
        weights = accept.astype(np.float32)  # pi_old := pi_rollout: the PPO ratio carries the mismatch
    logp_ref = learner.reference_logprobs(tokens, replay=replay, replay_kw=replay_kw)
    if version == step:  # the behaviour weights are the current ones: the same pass
        lp_behaviour, behaviour_indices = lp_old, old_indices
    elif behaviour is not None:
        lp_behaviour, behaviour_indices = behaviour
    else:  # not measured on this batch (split_every)
        lp_behaviour, behaviour_indices = None, None
    logprobs = {"current": lp_old, "behaviour": lp_behaviour, "engine": logp_rollout, "mask": mask}
    forwarded = (engine_routes >= 0).all(-1).all(-1)
    flips = _flips(engine_routes, old_indices, forwarded)
    split = {}
    if lp_behaviour is not None:
        numerics_flips = _flips(engine_routes, behaviour_indices, forwarded)
        stale_flips = _flips(behaviour_indices, old_indices, forwarded)
        split = {**split_metrics(lp_old, lp_behaviour, logp_rollout, mask),
                 "numerics/route_flip_rate": numerics_flips["route_flip_rate"],
                 "numerics/route_token_any_flip": numerics_flips["route_token_any_flip"],
                 "staleness/route_flip_rate": stale_flips["route_flip_rate"]}
    batch = TrainBatch(tokens=tokens, logp_old=np.asarray(logp_behaviour, np.float32),
                       advantages=np.asarray(advantages), weights=np.asarray(weights), mask=np.asarray(accept),
                       replay=replay, logp_ref=logp_ref, **replay_kw)
    metrics = {"reward_mean": float(rewards.mean()), "reward_correct_fraction": float((rewards == 1.0).mean()),
               "response_length": float(rollout.completion_lens.mean()), **corr_metrics,
               "route_flip_rate": flips["route_flip_rate"], "route_token_any_flip": flips["route_token_any_flip"],
               "behaviour_version": version, "lag": step - version, **split}
    return batch, metrics, logprobs
