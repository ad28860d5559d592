"""The learner: the trainer's side of an RL run -- its own copy of the weights, placed on its mesh, the optimizer,
the pure jitted update and the trainer's scoring passes. It knows nothing of engines, tasks or run directories
(the loop, `jaxalign.rl.trainer`, drives it).

- `make_optimizer`: AdamW with global-norm clipping summed as the trainer policy says.
- `make_update`: the pure update `(params, opt_state, batch) -> (params, opt_state, metrics)` (one optimizer step
  on the PPO-clip loss of a `TrainBatch`).
- `Learner`: holds `model` (a copy: LoRA and updates never touch the caller's), `params`, `opt_state`, `mesh`;
  `update(batch, minibatches)` runs the step's optimizer steps without committing them, `commit` adopts them,
  `logprobs` scores tokens with the trainer's policy at the current weights or a given version's.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxalign.model.scoring import sequence_logprobs, token_logprobs
from jaxalign.model.sharding import (make_mesh, mesh_context, on_first_device, put_batch, put_global, replicated,
                                     shard_state, state_shardings, to_host)
from jaxalign.model.transformer import Transformer
from jaxalign.numerics import NumericPolicy
from jaxalign.numerics.collectives import replicate
from jaxalign.numerics.optimizer import adamw
from jaxalign.numerics.reduce import global_norm
from jaxalign.rl.config import RLConfig
from jaxalign.rl.grpo import policy_loss


def clip_by_global_norm(max_norm: float, policy: NumericPolicy) -> optax.GradientTransformation:
    """optax's clip_by_global_norm with the norm summed as the trainer policy's `reduction` says
    (`numerics.reduce.global_norm`), so clipping is as reproducible across meshes as the gradients are."""

    def update(updates, state, params=None):
        del params
        norm = global_norm(updates, policy)
        scale = jnp.where(norm < max_norm, jnp.ones_like(norm), max_norm / norm)
        return jax.tree.map(lambda g: (g * scale).astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(learning_rate: float, weight_decay: float, grad_clip: float, lora_only: bool = False,
                   policy: NumericPolicy | None = None) -> optax.GradientTransformation:
    """AdamW with global-norm gradient clipping (norm summed as `policy` says; optax's own when None); with
    `lora_only`, every non-adapter parameter is frozen."""
    if policy is None:
        opt = optax.chain(optax.clip_by_global_norm(grad_clip), optax.adamw(learning_rate, weight_decay=weight_decay))
    else:  # the norm's order and AdamW's multiply-adds as the policy says (numerics.optimizer)
        opt = optax.chain(clip_by_global_norm(grad_clip, policy), adamw(learning_rate, weight_decay, policy))
    if not lora_only:
        return opt
    from jaxalign.model.lora import is_lora_path

    def labels(params):
        return jax.tree_util.tree_map_with_path(lambda path, _: "train" if is_lora_path(path) else "freeze",
                                                params)
    return optax.multi_transform({"train": opt, "freeze": optax.set_to_zero()}, labels)


class TrainBatch(NamedTuple):
    """One update's inputs (a pytree; per-token arrays are [B, width-1], tokens [B, width]).

    `logp_old` is the PPO ratio's denominator (the trainer's old-policy logprobs, or the engine's in bypass mode);
    `weights` the rollout-correction IS weights and `mask` the accepted completion tokens; `replay` the routing
    the trainer's forward pass replays (None: its own router), `replay_weights` the engine's combine weights
    (r3w), `index_replay` the engine's DSA index selections (+index); `logp_ref` the frozen reference's logprobs
    for the KL penalty (None without one)."""

    tokens: np.ndarray
    logp_old: np.ndarray
    advantages: np.ndarray
    weights: np.ndarray
    mask: np.ndarray
    replay: np.ndarray | None = None
    logp_ref: np.ndarray | None = None
    replay_weights: np.ndarray | None = None
    index_replay: np.ndarray | None = None


def make_update(graphdef, policy: NumericPolicy, optimizer: optax.GradientTransformation, config: RLConfig):
    """The pure update `(params, opt_state, batch) -> (params, opt_state, metrics)`: one optimizer step on the
    PPO-clip loss of `batch` (a `TrainBatch`); metrics are `loss`, `grad_norm` and `policy_loss`'s statistics.
    Under `cross_device=ordered` the loss and the clipping norm are summed on one device, in one-device order."""
    ordered = policy.ordered_cross_device

    def update(params, opt_state, batch: TrainBatch):
        def loss_fn(p):
            lp, _ = sequence_logprobs(nnx.merge(graphdef, p), batch.tokens, policy, replay=batch.replay,
                                      temperature=config.temperature, replay_weights=batch.replay_weights,
                                      index_replay=batch.index_replay)
            per_token = (lp, batch.logp_old, batch.advantages, batch.weights, batch.mask, batch.logp_ref)
            if ordered:  # the loss sums over the whole batch: on one device, in the one-device order
                per_token = replicate(per_token)
            return policy_loss(*per_token[:5], config.grpo, logp_ref=per_token[5], policy=policy,
                               max_tokens=config.max_new_tokens)

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        if ordered:  # the clipping norm sums over every (sharded) gradient: replicated, it sums in one place
            grads, params, opt_state = replicate((grads, params, opt_state))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        metrics = {"loss": loss, "grad_norm": global_norm(grads, policy), **stats}
        return optax.apply_updates(params, updates), opt_state, metrics

    return update


class Learner:
    """The trainer's side of a run on `config` from a copy of `model`'s weights (see the module docstring).

    The weights are placed as the updates will leave them (split on `config.trainer_mesh`, or committed to the
    first device), so every program is specialised once; `model` holds them (engines are cast from it)."""

    def __init__(self, model: Transformer, config: RLConfig):
        self.config, self.policy = config, config.trainer_policy
        self.version = 0  # the weights' version: how many updates they have had (the loop's step)
        model = nnx.clone(model)  # the trainer's own copy: LoRA and updates never touch the caller's model
        if config.lora_rank:
            from jaxalign.model.lora import add_lora, has_lora
            if not has_lora(model):
                add_lora(model, config.lora_rank, config.lora_alpha, config.lora_targets, seed=config.seed)
        self.model = model
        self.mesh = make_mesh(config.trainer_mesh) if config.trainer_mesh else None
        self.graphdef, self.params = nnx.split(model)
        self.params = shard_state(self.params, self.mesh)
        if self.mesh is None:  # placed as the updates will leave them: every program specialised once
            self.params = on_first_device(self.params)
        nnx.update(self.model, self.params)
        # the frozen reference for the optional KL penalty: the weights the run starts from
        self.reference = self.version_model(self.params) if config.grpo.kl_coef > 0 else None
        self.optimizer = make_optimizer(config.learning_rate, config.weight_decay, config.grad_clip,
                                        lora_only=bool(config.lora_rank), policy=self.policy)
        self.opt_state = self.shard_opt_state(self.optimizer.init(self.params))
        # the state a run starts from (immutable arrays): where a run goes back to when its rows are not all there
        self.start = {"params": nnx.to_pure_dict(self.params), "opt_state": self.opt_state}
        self._update = self._compile_update()

    def version_model(self, params) -> Transformer:
        """A model holding `params` (fresh variables: the learner's own are untouched)."""
        return nnx.merge(self.graphdef, jax.tree.map(lambda x: x, params))

    # --- placement ------------------------------------------------------------------------------------------
    def shard_opt_state(self, opt_state):
        """Optimizer moments split like their parameters; counters replicated (on one device: all on it)."""
        if self.mesh is None:
            return on_first_device(opt_state)
        keystr = jax.tree_util.keystr
        by_path = {keystr(path): s for path, s in jax.tree_util.tree_flatten_with_path(
            state_shardings(self.params, self.mesh))[0]}

        def place(path, x):
            name = keystr(path)
            match = [s for p, s in by_path.items() if name.endswith(p)]  # mu[...]/nu[...] end with a param path
            return put_global(x, match[0] if match else replicated(self.mesh))
        return jax.tree_util.tree_map_with_path(place, opt_state)

    # --- state ----------------------------------------------------------------------------------------------
    def set_state(self, params_pure: dict, opt_state) -> None:
        """Adopt weights (a pure dict, as checkpoints hold them) and an optimizer state."""
        nnx.replace_by_pure_dict(self.params, params_pure)
        self.opt_state = opt_state
        nnx.update(self.model, self.params)

    def commit(self, params, opt_state) -> None:
        """Adopt the weights and optimizer state an `update` returned."""
        self.params, self.opt_state = params, opt_state
        nnx.update(self.model, self.params)

    # --- scoring --------------------------------------------------------------------------------------------
    def logprobs(self, tokens, *, model: Transformer | None = None, replay=None, replay_kw=None):
        """The trainer policy's per-token logprobs [B, width-1] and expert indices of `tokens`, on the host, under
        `model` (default: the current weights), replaying `replay` (None: its own router)."""
        lp, record = token_logprobs(self.model if model is None else model, tokens, self.policy,
                                    temperature=self.config.temperature, replay=replay, mesh=self.mesh,
                                    **(replay_kw or {}))
        return to_host(lp), to_host(record.indices)

    def reference_logprobs(self, tokens, *, replay=None, replay_kw=None):
        """The frozen reference's per-token logprobs of `tokens` (for the KL penalty), or None without one."""
        if self.reference is None:
            return None
        return to_host(token_logprobs(self.reference, tokens, self.policy, temperature=self.config.temperature,
                                      replay=replay, mesh=self.mesh, **(replay_kw or {}))[0])

    # --- the update -----------------------------------------------------------------------------------------
    def _compile_update(self):
        """The jitted update; on a mesh its outputs keep the parameters' and optimizer state's placement."""
        update = make_update(self.graphdef, self.policy, self.optimizer, self.config)
        if self.mesh is None:
            return jax.jit(update)
        shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
        return jax.jit(update, out_shardings=(shardings(self.params), shardings(self.opt_state), None))

    def apply_update(self, batch: TrainBatch, params, opt_state):
        """Run the update from (params, opt_state) on the trainer's mesh (rows of the batch split)."""
        if self.mesh is None:
            return self._update(params, opt_state, jax.tree.map(jnp.asarray, batch))
        with mesh_context(self.mesh):
            return self._update(params, opt_state, jax.tree.map(lambda b: put_batch(b, self.mesh), batch))

    def update(self, batch: TrainBatch, passes) -> tuple:
        """The step's optimizer steps on `batch`, one per minibatch of each pass (`passes`: per epoch, the rows of
        each minibatch, None for the whole batch), from the current state. Returns (params, opt_state, metrics):
        each statistic's mean over the optimizer steps; nothing is committed (`commit`)."""
        params, opt_state = self.params, self.opt_state
        steps_metrics = []
        for minibatches in passes:
            for rows in minibatches:
                part = batch if rows is None else jax.tree.map(lambda a: a[rows], batch)
                params, opt_state, metrics = self.apply_update(part, params, opt_state)
                steps_metrics.append(metrics)
        # each statistic's mean over the step's optimizer steps (the first minibatch's ratio is exactly 1 when
        # on-policy; the clip acts on the later ones)
        return params, opt_state, {name: float(np.mean([float(m[name]) for m in steps_metrics]))
                                   for name in steps_metrics[0]}
