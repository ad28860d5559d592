"""Trainer-side scoring: per-token logprobs of given sequences under a policy."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxalign.model.routing import (RoutingRecord, check_expert_indices, check_index_positions,
                                    check_replay_weights)
from jaxalign.model.sharding import mesh_context, put_batch, shard_state
from jaxalign.model.transformer import Transformer, check_tokens
from jaxalign.numerics import NumericPolicy
from jaxalign.numerics.sampling import SamplingParams, reported_logprobs
from jaxalign.numerics.schedule import PolicySchedule, policy_for


def sequence_logprobs(model: Transformer, tokens: jax.Array, policy: NumericPolicy, *, replay=None,
                      sampling: SamplingParams | None = None, temperature: float | None = None,
                      top_k: int | None = None, top_p: float | None = None, index_replay=None,
                      replay_weights=None):
    """Traceable core of `token_logprobs` (use inside jit/grad): (logprobs [B, S-1], RoutingRecord)."""
    sampling = SamplingParams.from_args(sampling, temperature, top_k, top_p)
    logits, record = model(tokens, policy=policy, replay=replay, index_replay=index_replay,
                           replay_weights=replay_weights)
    lp = reported_logprobs(logits[:, :-1], policy_for(policy, "head"), sampling)

    return jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1)[..., 0], record


@functools.partial(jax.jit, static_argnames=("graphdef", "policy"))
def jitted_forward(graphdef, state, tokens, replay, index_replay, *, policy):
    """The jitted forward of a split model, (logits, RoutingRecord): the program `forward` runs and the precision
    audit lowers."""
    return nnx.merge(graphdef, state)(tokens, policy=policy, replay=replay, index_replay=index_replay)


def on_mesh(model: Transformer, mesh: jax.sharding.Mesh | None):
    """(graphdef, state) of `model`, with the state split over `mesh` by the sharding rules (if given)."""
    graphdef, state = nnx.split(model)
    return graphdef, shard_state(state, mesh)


def forward(model: Transformer, tokens, policy: NumericPolicy | PolicySchedule, *, replay=None,
            index_replay=None, mesh: jax.sharding.Mesh | None = None):
    """Jitted full forward: (logits [B, S, V], RoutingRecord); compiled once per structure, policy and shape
    (calling `model(tokens, policy=...)` outside jit instead compiles every operation on its own, several times
    slower the first time). `replay`, `index_replay`: as `token_logprobs` takes them.
    `mesh`: run sharded on it (parameters and batch split as `model/sharding.py` says)."""
    arr = check_tokens(tokens, model.config)
    graphdef, state = on_mesh(model, mesh)
    replay_idx = replay.indices if isinstance(replay, RoutingRecord) else replay
    if replay_idx is not None:
        replay_idx = check_expert_indices(replay_idx, model.config, *arr.shape)
    if index_replay is not None:
        index_replay = put_batch(check_index_positions(index_replay, model.config, *arr.shape), mesh)
    with mesh_context(mesh):
        return jitted_forward(graphdef, state, put_batch(np.asarray(arr, np.int32), mesh),
                        None if replay_idx is None else put_batch(replay_idx, mesh), index_replay,
                        policy=policy)


@functools.partial(jax.jit, static_argnames=("graphdef", "policy", "sampling"))
def _jitted(graphdef, state, tokens, replay, index_replay, replay_weights, *, policy, sampling):
    return sequence_logprobs(nnx.merge(graphdef, state), tokens, policy, replay=replay, sampling=sampling,
                             index_replay=index_replay, replay_weights=replay_weights)


def token_logprobs(model: Transformer, tokens, policy: NumericPolicy | PolicySchedule, *,
                   replay: RoutingRecord | jax.Array | None = None, sampling: SamplingParams | None = None,
                   temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                   mesh: jax.sharding.Mesh | None = None,
                   index_replay=None, replay_weights=None) -> tuple[jax.Array, RoutingRecord]:

    """Logprob of each next token, [batch, seq-1], and the routing record of the forward pass.

    `tokens[:, t+1]` is scored given `tokens[:, :t+1]`, under the same distribution the engine samples from
    (see `jaxalign.numerics.sampling`): `sampling` (a `SamplingParams`, e.g. a rollout's `rollout.sampling`) or
    its shorthand `temperature`/`top_k`/`top_p` (default temperature 1). Compiled once per (model structure,
    policy, sampling params, shape).
    `mesh`: run sharded on it (parameters and batch split as `model/sharding.py` says).
    `index_replay` (DSA models): key positions [batch, seq, layers, index_topk] each query attends to (index
    replay; a row whose first entry is -1 keeps the trainer's own selection).
    `replay_weights` (with `replay`; R3w): combine weights [batch, seq, moe_layers, k] used as constants for the
    replayed tokens, e.g. `rollout.routing.weights` (the engine's); see docs/router-replay.md.
    """
    if not isinstance(policy, (NumericPolicy, PolicySchedule)):
        raise ValueError(f"policy must be a NumericPolicy (or PolicySchedule), got {type(policy).__name__}; "
                         f"use NumericPolicy.preset(name) or NumericPolicy.parse(text)")
    sampling = SamplingParams.from_args(sampling, temperature, top_k, top_p)
    arr = check_tokens(tokens, model.config)
    if arr.shape[1] < 2:
        raise ValueError(f"tokens need at least 2 positions to score a next token, got length {arr.shape[1]}")
    cfg = model.config
    replay_idx = replay.indices if isinstance(replay, RoutingRecord) else replay
    if replay_idx is not None:
        replay_idx = put_batch(check_expert_indices(replay_idx, cfg, *arr.shape), mesh)
    if replay_weights is not None:
        replay_weights = put_batch(check_replay_weights(replay_weights, replay_idx), mesh)
    if index_replay is not None:
        index_replay = put_batch(check_index_positions(index_replay, cfg, *arr.shape), mesh)
    graphdef, state = on_mesh(model, mesh)
    with mesh_context(mesh):
        return _jitted(graphdef, state, put_batch(np.asarray(arr, np.int32), mesh), replay_idx, index_replay,
                       replay_weights, policy=policy, sampling=sampling)

