"""The RL trainer: GRPO on a `Task` (Countdown by default) with the rollout engine under one policy and the
trainer under another.

The parts, each replaceable on its own:
- `collect` (engine -> reward -> old-policy pass -> rollout correction): items for the step (deterministic in
  (seed, step)), G completions each from the engine, their rewards, the trainer's logprobs of the same tokens,
  verl-style correction; returns a `TrainBatch` and the step's metrics.
- `make_update`: the pure update `(params, opt_state, batch) -> (params, opt_state, metrics)` (one AdamW step on
  the PPO-clip loss), jitted by the trainer.
- `Trainer.run`: a thin loop -- collect, update, sync the engine, send the row to the sinks (`metrics.jsonl`,
  TensorBoard, the progress bar), checkpoint.
- `RLConfig.max_lag` k >= 1: asynchronous rollouts. A second engine on one worker thread generates batch t with
  the weights of version `behaviour_version(t, k)` = max(0, t - k) while this thread updates on earlier batches;
  checkpoints hold the older versions still needed, so a killed run resumes to the same rows (docs/rl.md).

The trainer works on its own copy of the model (LoRA adapters are added to the copy; the caller's model is never
changed). A run directory records its settings, build and host (`rundir`): another configuration on the same
directory is refused, and after a kill the same command resumes with every metrics row exactly once. Checkpoints
(orbax) every N steps resume exactly; a non-finite loss stops the run with a resumable checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

from jaxalign.metrics.routing import routing_metrics
from jaxalign.metrics.staleness import split_metrics
from jaxalign.engine import Engine
from jaxalign.model.scoring import sequence_logprobs, token_logprobs
from jaxalign.model.sharding import (make_mesh, mesh_context, on_first_device, parse_mesh_spec, put_batch, put_global,
                                     replicated, shard_state, state_shardings, to_host)
from jaxalign.model.transformer import Transformer
from jaxalign.numerics import NumericPolicy
from jaxalign.numerics.collectives import replicate
from jaxalign.numerics.optimizer import adamw
from jaxalign.numerics.precision import float16_fields
from jaxalign.numerics.reduce import global_norm
from jaxalign.rl import options, rundir, tokenizer
from jaxalign.replay_modes import REPLAY_MODES, check_replay, replay_parts
from jaxalign.rl.correction import BYPASS, DECOUPLED, MODES, CorrectionConfig, correct
from jaxalign.rl.grpo import GRPOConfig, advantages_of, policy_loss
from jaxalign.rl.task import PROMPT_WIDTH, CountdownTask, Task  # noqa: F401  (PROMPT_WIDTH: used by sft)



@dataclasses.dataclass(frozen=True)
class RLConfig:
    """Everything an RL run depends on (besides the warm-start weights)."""

    trainer_policy: NumericPolicy = NumericPolicy.preset("aligned-bf16")  # a policy string is accepted and parsed
    engine_policy: NumericPolicy = NumericPolicy.preset("aligned-bf16")
    steps: int = 20
    prompts_per_step: int = 8
    max_new_tokens: int = 24
    temperature: float = 1.0
    learning_rate: float = 3e-4
    ppo_epochs: int = 1  # passes over each collected batch (PPO epochs)
    # each pass splits the batch into this many disjoint minibatches, one optimizer step each (verl's
    # ppo_mini_batch_size = batch / minibatches): after the first, the PPO ratio leaves 1 and the clip acts
    minibatches: int = 1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    mode: str = DECOUPLED
    replay: str = "none"
    grpo: GRPOConfig = GRPOConfig()
    correction: CorrectionConfig = CorrectionConfig()
    seed: int = 0
    checkpoint_every: int = 5
    eval_every: int = 5
    eval_problems: int = 64
    engine_batch: int | None = None
    problem_count: tuple[int, int] = (3, 3)
    lora_rank: int = 0  # 0 = full fine-tuning
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] | None = None  # None: the model's attention projections (`attention_targets`)
    trainer_mesh: str = ""  # a mesh spec (`jaxalign.make_mesh`), e.g. "data=2,expert=2,tensor=2"; "" = one device
    engine_mesh: str = ""  # with several processes: a mesh over each process's own devices
    max_lag: int = 0  # k: batch t is generated with the weights of version max(0, t - k) (0 = synchronous)
    # measure the numerics/staleness split on every N-th batch (0: never). At lag > 0 it costs one more trainer
    # pass, at the older weights (on the rollout worker); at lag 0 it is free and always measured.
    split_every: int = 1
    # at each evaluation also sample the held-out prompts from the engine (temperature `temperature`) and report
    # their mean reward as `eval_engine_reward`: what the engine's numerics make of the policy
    eval_sampled: bool = False

    def __post_init__(self):
        for side in ("trainer_policy", "engine_policy"):
            object.__setattr__(self, side, NumericPolicy.coerce(getattr(self, side), label=side))
        if float16_fields(self.trainer_policy):
            raise ValueError(
                f"trainer_policy asks for f16 in {', '.join(float16_fields(self.trainer_policy))}: float16 training "
                f"needs dynamic loss scaling (gradients below 6e-8 flush to zero, above 65504 overflow), which "
                f"jaxalign does not implement; allowed trainer dtypes: f32, bf16 (an f16 engine_policy is allowed)")
        parse_mesh_spec(self.trainer_mesh)
        parse_mesh_spec(self.engine_mesh)
        if self.mode not in MODES:
            raise ValueError(f"mode = {self.mode!r}; allowed: {', '.join(MODES)}")
        check_replay(self.replay, REPLAY_MODES)
        for name in ("steps", "prompts_per_step", "max_new_tokens", "checkpoint_every", "eval_every",
                     "eval_problems", "ppo_epochs", "minibatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"RLConfig.{name} = {getattr(self, name)}; allowed: >= 1")
        if not isinstance(self.split_every, int) or isinstance(self.split_every, bool) or self.split_every < 0:
            raise ValueError(f"RLConfig.split_every = {self.split_every!r}; allowed: an int >= 0 (0 = never at "
                             f"lag > 0)")
        rows = self.prompts_per_step * self.grpo.group_size
        if rows % self.minibatches:
            raise ValueError(f"RLConfig.minibatches = {self.minibatches} does not divide the batch of {rows} rows "
                             f"(prompts_per_step x group_size); allowed: a divisor of {rows}")
        if not isinstance(self.max_lag, int) or isinstance(self.max_lag, bool) or self.max_lag < 0:
            raise ValueError(f"RLConfig.max_lag = {self.max_lag!r}; allowed: an int >= 0 (0 = synchronous rollouts)")

    @classmethod
    def parse_option(cls, key: str, text: str):
        """The typed value of field `key` written as `text` (`jaxalign.rl.options`), e.g. ("learning_rate",
        "2e-3") -> 0.002; a clear error naming the key, the value and what is allowed."""
        return options.parse_option(cls, key, text)

    def to_dict(self) -> dict:
        """JSON-ready form; policies as compact text (`NumericPolicy.compact`)."""
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, NumericPolicy):
                value = value.compact()
            elif dataclasses.is_dataclass(value):
                value = dataclasses.asdict(value)
            out[field.name] = value
        if not self.max_lag:  # synchronous runs record what they recorded before the field existed (they resume)
            del out["max_lag"]
        # likewise the fields added later, at the values runs had before them
        for name, legacy in (("split_every", 1), ("minibatches", 1), ("eval_sampled", False)):
            if getattr(self, name) == legacy:
                del out[name]
        return json.loads(json.dumps(out))


def behaviour_version(step: int, max_lag: int) -> int:
    """The weight version that generates batch `step` (0-based) at lag `max_lag`: max(0, step - max_lag). Version
    v = the weights after v updates. A fixed function of (step, lag), never of timing, so an asynchronous run is
    as reproducible and resumable as a synchronous one."""
    return max(0, step - max_lag)


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


class Trainer:
    """Runs GRPO for `config.steps` steps from a copy of `model`'s weights on `task` (default: Countdown from
    the config's `problem_count` / `eval_problems`), writing into `run_dir`."""

    def __init__(self, model: Transformer, config: RLConfig, run_dir: str, task: Task | None = None):
        if model.config.vocab_size < tokenizer.VOCAB_SIZE:
            raise ValueError(f"model vocab_size {model.config.vocab_size} < tokenizer vocab {tokenizer.VOCAB_SIZE}")
        self.config, self.run_dir = config, run_dir
        self.task = task or CountdownTask(count=tuple(config.problem_count), eval_size=config.eval_problems)
        start_weights = rundir.weights_fingerprint(nnx.state(model))
        model = nnx.clone(model)  # the trainer's own copy: LoRA and updates never touch the caller's model
        if config.lora_rank:
            from jaxalign.model.lora import add_lora, has_lora
            if not has_lora(model):
                add_lora(model, config.lora_rank, config.lora_alpha, config.lora_targets, seed=config.seed)
        self.model = model
        self.trainer_policy = config.trainer_policy
        self.mesh = make_mesh(config.trainer_mesh) if config.trainer_mesh else None
        engine_devices = jax.local_devices() if jax.process_count() > 1 else None
        engine_mesh = make_mesh(config.engine_mesh, engine_devices) if config.engine_mesh else None
        self.graphdef, self.params = nnx.split(model)
        self.params = shard_state(self.params, self.mesh)
        if self.mesh is None:  # placed as the updates will leave them: every program specialised once
            self.params = on_first_device(self.params)
        nnx.update(self.model, self.params)
        self.engine = Engine(model, config.engine_policy, mesh=engine_mesh)  # from the placed weights
        # greedy evaluation decodes under the trainer's policy, so every arm of an experiment is scored alike
        self.eval_engine = (self.engine if config.engine_policy == config.trainer_policy
                            else Engine(model, config.trainer_policy, mesh=engine_mesh))
        # asynchronous rollouts (max_lag k >= 1): a second engine, driven by one worker thread, generates batch t
        # with the weights of version behaviour_version(t, k) while this thread scores and updates earlier batches
        self.behaviour = {0: self.params}  # weight version -> weights, for the versions pending batches need
        self._pending = {}  # step -> Future of the Rollout generated for it
        self.rollout_engine, self._worker = None, None
        if config.max_lag:
            self.rollout_engine = Engine(model, config.engine_policy, mesh=engine_mesh)
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxalign-rollouts")
        self.last_logprobs = None  # the last collected batch's per-token logprobs (see `collect`)
        # the frozen reference for the optional KL penalty: the weights the run starts from
        self.reference = (nnx.merge(self.graphdef, jax.tree.map(lambda x: x, self.params))
                          if config.grpo.kl_coef > 0 else None)
        self.optimizer = make_optimizer(config.learning_rate, config.weight_decay, config.grad_clip,
                                        lora_only=bool(config.lora_rank), policy=self.trainer_policy)
        self.opt_state = self._shard_opt_state(self.optimizer.init(self.params))
        # the state a run starts from (immutable arrays): where a run goes back to when its rows are not all there
        self._start = {"params": nnx.to_pure_dict(self.params), "opt_state": self.opt_state}
        self.width = self.task.prompt_width + config.max_new_tokens
        self.step = 0
        from jaxalign.distributed import is_primary
        self.primary = is_primary()  # with several processes, one writes the run's files
        if self.primary:  # refuse a directory in use, or holding another configuration's run, before touching it
            self._hold = rundir.hold(run_dir)
            weakref.finalize(self, self._hold.release)
            rundir.claim(run_dir, rundir.make_record({"rl": config.to_dict(), "task": self.task.describe()},
                                                     start_weights))
        os.makedirs(run_dir, exist_ok=True)
        self.checkpoints = ocp.CheckpointManager(
            os.path.abspath(os.path.join(run_dir, "checkpoints")),
            options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
        self.eval_items = self.task.eval_items(config.seed)
        self._update = self._compile_update()

    # --- placement ------------------------------------------------------------------------------------------
    def _shard_opt_state(self, opt_state):
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
    def _kept_versions(self, step: int) -> range:
        """The weight versions older than `step` that batches `step` .. `step + k` are generated with: the
        in-flight state of an asynchronous run (empty when synchronous)."""
        return range(behaviour_version(step, self.config.max_lag), step)

    def _state_tree(self, step: int | None = None):
        step = self.step if step is None else step
        tree = {"params": nnx.to_pure_dict(self.params), "opt_state": self.opt_state,
                "step": np.asarray(step, np.int64)}
        if self._kept_versions(step):  # (a template when restoring: only shapes are read)
            tree["behaviour"] = {f"v{v}": nnx.to_pure_dict(self.behaviour.get(v, self.params))
                                 for v in self._kept_versions(step)}
        return tree

    def save(self) -> None:
        """Checkpoint the current state (params, optimizer state, step and, with `max_lag`, the older weight
        versions the next batches are generated with)."""
        self.checkpoints.save(self.step, args=ocp.args.StandardSave(self._state_tree()), force=True)
        self.checkpoints.wait_until_finished()

    def restore_latest(self) -> bool:
        """Resume from the newest checkpoint in the run directory, if any."""
        latest = self.checkpoints.latest_step()
        if latest is None:
            return False
        self.restore(latest)
        return True

    def rewind(self, step: int) -> None:
        """Go back to the newest state at or before `step`: a checkpoint, or the run's start when none is that old
        (checkpoints past it are deleted, so the steps after it are recomputed and saved again)."""
        usable = [s for s in self.checkpoints.all_steps() if s <= step]
        for later in [s for s in self.checkpoints.all_steps() if s > (max(usable) if usable else -1)]:
            self.checkpoints.delete(later)
        if usable:
            self.restore(max(usable))
            return
        self._drop_pending()
        nnx.replace_by_pure_dict(self.params, self._start["params"])
        self.opt_state, self.step = self._start["opt_state"], 0
        self.behaviour = {0: self.params}
        nnx.update(self.model, self.params)
        self.engine.sync_weights(self.model)

    def restore(self, latest: int) -> None:
        """Resume from the checkpoint of step `latest`."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, self._state_tree(latest))
        restored = self.checkpoints.restore(latest, args=ocp.args.StandardRestore(abstract))
        self._drop_pending()
        nnx.replace_by_pure_dict(self.params, restored["params"])
        self.opt_state = restored["opt_state"]
        self.step = int(restored["step"])
        self.behaviour = {self.step: self.params}
        for key, pure in restored.get("behaviour", {}).items():
            version = jax.tree.map(lambda x: x, self.params)  # fresh variables, the same structure
            nnx.replace_by_pure_dict(version, pure)
            self.behaviour[int(key[1:])] = version
        nnx.update(self.model, self.params)
        self.engine.sync_weights(self.model)

    # --- asynchronous rollouts ------------------------------------------------------------------------------
    def _drop_pending(self) -> None:
        """Forget the batches generated ahead (cancelled, or waited for when already running)."""
        for future in self._pending.values():
            future.cancel()
        for future in self._pending.values():
            if not future.cancelled():
                future.exception()
        self._pending = {}

    def _generate_with(self, step: int, params, version: int):
        """(worker thread) Batch `step` from the rollout engine holding `params` (weight version `version`), and,
        when those are not the weights the batch will be trained at, the trainer's pass over it at `params`
        (`_behaviour_pass`): the worker, not the trainer's thread, pays for the older weights."""
        model = nnx.merge(self.graphdef, jax.tree.map(lambda x: x, params))
        self.rollout_engine.sync_weights(model)
        rollout = self.generate(step, self.rollout_engine)
        return rollout, (self._behaviour_pass(model, rollout) if version != step and self.splits(step) else None)

    def splits(self, step: int) -> bool:
        """Whether batch `step` measures the numerics/staleness split (`RLConfig.split_every`)."""
        every = self.config.split_every
        return every > 0 and step % every == 0

    def _trainer_inputs(self, rollout):
        """What the trainer's passes over `rollout` read: (tokens, engine routes, the experts replayed to the
        trainer or None, the replay keywords of `token_logprobs`)."""
        cfg = self.config
        tokens = pad_to(rollout.tokens, self.width, 1, tokenizer.PAD)
        engine_routes = pad_to(np.asarray(rollout.routing.indices), self.width, 1, -1)
        expert_replay, with_index = replay_parts(cfg.replay)
        replay_kw = {"replay_weights": None, "index_replay": None}
        if expert_replay == "r3w":
            replay_kw["replay_weights"] = pad_to(np.asarray(rollout.routing.weights), self.width, 1, 0.0)
        if with_index:
            if rollout.routing.index_positions is None:
                raise ValueError(f"replay = {cfg.replay!r} replays DSA index selections; this model has none")
            replay_kw["index_replay"] = pad_to(np.asarray(rollout.routing.index_positions), self.width, 1, -1)
        engine_experts = engine_routes if expert_replay in ("r3", "r3w") else None
        return tokens, engine_routes, engine_experts, replay_kw

    def _behaviour_pass(self, model, rollout):
        """The trainer's per-token logprobs and routes of `rollout` under `model` (the weights that generated it):
        the numerics/staleness split's middle term."""
        tokens, _, engine_experts, replay_kw = self._trainer_inputs(rollout)
        lp, record = token_logprobs(model, tokens, self.trainer_policy, temperature=self.config.temperature,
                                    replay=engine_experts, mesh=self.mesh, **replay_kw)
        return to_host(lp), to_host(record.indices)

    def _schedule(self) -> None:
        """Queue every batch up to `step + k` whose weight version exists (all of them: version
        max(0, s - k) <= step), each with that version's weights; the worker runs them in step order."""
        k = self.config.max_lag
        for s in range(self.step, min(self.step + k, self.config.steps - 1) + 1):
            if s not in self._pending:
                version = behaviour_version(s, k)
                self._pending[s] = self._worker.submit(self._generate_with, s, self.behaviour[version], version)

    # --- the update -----------------------------------------------------------------------------------------
    def _compile_update(self):
        """The jitted update; on a mesh its outputs keep the parameters' and optimizer state's placement."""
        update = make_update(self.graphdef, self.trainer_policy, self.optimizer, self.config)
        if self.mesh is None:
            return jax.jit(update)
        shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
        return jax.jit(update, out_shardings=(shardings(self.params), shardings(self.opt_state), None))

    def _apply_update(self, batch: TrainBatch, params, opt_state):
        """Run the update from (params, opt_state) on the trainer's mesh (rows of the batch split)."""
        if self.mesh is None:
            return self._update(params, opt_state, jax.tree.map(jnp.asarray, batch))
        with mesh_context(self.mesh):
            return self._update(params, opt_state, jax.tree.map(lambda b: put_batch(b, self.mesh), batch))

    # --- collect --------------------------------------------------------------------------------------------
    def _items(self, step: int) -> list:
        cfg = self.config
        return [p for p in self.task.train_items(step, cfg.prompts_per_step, cfg.seed)
                for _ in range(cfg.grpo.group_size)]

    def generate(self, step: int, engine: Engine | None = None):
        """The rollout of batch `step` (G completions of each of its items) from `engine` (default: the trainer's
        engine) at whatever weights it holds; sampling is seeded by (seed, step)."""
        cfg, items = self.config, self._items(step)
        return (engine or self.engine).generate(
            [self.task.prompt(p) for p in items], max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
            eos_id=tokenizer.EOS, seed=cfg.seed * 1_000_003 + step, batch_size=cfg.engine_batch)

    def collect(self, rollout=None, version: int | None = None, behaviour=None) -> tuple[TrainBatch, dict]:
        """Engine -> reward -> old-policy pass -> rollout correction for the current step: the update's batch
        and the step's rollout metrics.

        `rollout`: the step's batch as generated with the weights of `version` (default: generated here by the
        engine, which holds the current weights). The PPO ratio's old policy is the trainer at the current
        weights (AReaL's proximal policy); the correction's ratio is that against the engine (the behaviour
        policy), and its log splits per token into numerics (engine vs trainer, both at the behaviour weights)
        plus staleness (trainer at the current vs the behaviour weights), reported as `numerics/...` and
        `staleness/...` (`metrics.staleness`). `behaviour`: the trainer's pass at the behaviour weights when
        the worker made it (`_behaviour_pass`), else it runs here. `self.last_logprobs` keeps the three per-token
        logprobs."""
        cfg = self.config
        items = self._items(self.step)
        if rollout is None:
            rollout = self.generate(self.step)
        version = self.step if version is None else version
        rewards = rewards_of(rollout, items, self.task)
        advantages = advantages_of(rewards, cfg.grpo)
        logp_rollout = pad_to(rollout.logprobs, self.width - 1, 1, 0.0)
        mask = pad_to(rollout.mask, self.width - 1, 1, False)
        tokens, engine_routes, engine_experts, replay_kw = self._trainer_inputs(rollout)
        expert_replay, _ = replay_parts(cfg.replay)
        lp_old, old_record = token_logprobs(self.model, tokens, self.trainer_policy, temperature=cfg.temperature,
                                            replay=engine_experts, mesh=self.mesh, **replay_kw)
        lp_old, old_indices = to_host(lp_old), to_host(old_record.indices)
        replay = {"none": None, "r3": engine_routes, "r3w": engine_routes, "r2": old_indices}[expert_replay]
        logp_behaviour = logp_rollout if cfg.mode == BYPASS else lp_old  # the PPO ratio's denominator
        weights, accept, corr_metrics = correct(lp_old, logp_rollout, mask, cfg.correction)
        if cfg.mode == BYPASS:
            weights = accept.astype(np.float32)  # pi_old := pi_rollout: the PPO ratio carries the mismatch
        logp_ref = None
        if self.reference is not None:
            logp_ref = to_host(token_logprobs(self.reference, tokens, self.trainer_policy,
                                              temperature=cfg.temperature, replay=replay, mesh=self.mesh,
                                              **replay_kw)[0])
        if version == self.step:  # the behaviour weights are the current ones: the same pass
            lp_behaviour, behaviour_indices = lp_old, old_indices
        elif self.splits(self.step):
            lp_behaviour, behaviour_indices = behaviour or self._behaviour_pass(
                nnx.merge(self.graphdef, jax.tree.map(lambda x: x, self.behaviour[version])), rollout)
        else:  # not measured on this batch (split_every)
            lp_behaviour, behaviour_indices = None, None
        self.last_logprobs = {"current": lp_old, "behaviour": lp_behaviour, "engine": logp_rollout, "mask": mask}
        forwarded = (engine_routes >= 0).all(-1).all(-1)
        flips = routing_metrics(engine_routes, old_indices, valid=forwarded)
        split = {}
        if lp_behaviour is not None:
            numerics_flips = routing_metrics(engine_routes, behaviour_indices, valid=forwarded)
            stale_flips = routing_metrics(behaviour_indices, old_indices, valid=forwarded)
            split = {**split_metrics(lp_old, lp_behaviour, logp_rollout, mask),
                     "numerics/route_flip_rate": numerics_flips["route_flip_rate"],
                     "numerics/route_token_any_flip": numerics_flips["route_token_any_flip"],
                     "staleness/route_flip_rate": stale_flips["route_flip_rate"]}
        batch = TrainBatch(tokens=tokens, logp_old=np.asarray(logp_behaviour, np.float32),
                           advantages=np.asarray(advantages), weights=np.asarray(weights), mask=np.asarray(accept),
                           replay=replay, logp_ref=logp_ref, **replay_kw)
        metrics = {"reward_mean": float(rewards.mean()), "reward_correct_fraction": float((rewards == 1.0).mean()),
                   "response_length": float(rollout.completion_lens.mean()), **corr_metrics,
                   "route_flip_rate": flips["route_flip_rate"],
                   "route_token_any_flip": flips["route_token_any_flip"],
                   "behaviour_version": version, "lag": self.step - version, **split}
        return batch, metrics

    def train_step(self) -> dict:
        """One GRPO step (collect, `ppo_epochs` updates on the batch, sync the engine); returns its metrics row
        (the update's metrics are the last epoch's). With `max_lag` k >= 1 the step's batch comes from the
        worker (generated with the weights of version max(0, step - k)), and once the update is done the batches
        the new weights generate are queued."""
        k = self.config.max_lag
        if k:
            self._schedule()
            rollout, behaviour = self._pending.pop(self.step).result()
            batch, rollout_metrics = self.collect(rollout, behaviour_version(self.step, k), behaviour)
        else:
            batch, rollout_metrics = self.collect()
        params, opt_state = self.params, self.opt_state
        steps_metrics = []
        for epoch in range(self.config.ppo_epochs):
            for rows in self.minibatch_rows(epoch):
                part = batch if rows is None else jax.tree.map(lambda a: a[rows], batch)
                params, opt_state, metrics = self._apply_update(part, params, opt_state)
                steps_metrics.append(metrics)
        # each statistic's mean over the step's optimizer steps (the first minibatch's ratio is exactly 1 when
        # on-policy; the clip acts on the later ones)
        update_metrics = {name: float(np.mean([float(m[name]) for m in steps_metrics])) for name in steps_metrics[0]}
        loss, gnorm = update_metrics["loss"], update_metrics["grad_norm"]
        if not (np.isfinite(loss) and np.isfinite(gnorm)):
            if self.checkpoints.latest_step() != self.step:
                self.save()  # the state before this update: resumable
            raise FloatingPointError(
                f"non-finite loss ({loss}) or gradient norm ({gnorm}) at step {self.step}; the run stopped and the "
                f"last good state is checkpointed in {self.run_dir}/checkpoints (step {self.step})")
        self.params, self.opt_state = params, opt_state
        nnx.update(self.model, self.params)
        self.engine.sync_weights(self.model)
        self.step += 1
        if k:
            self.behaviour[self.step] = self.params
            self.behaviour = {v: p for v, p in self.behaviour.items() if v >= behaviour_version(self.step, k)}
            self._schedule()  # the worker starts on the batches these weights generate
        stats = {name: v for name, v in update_metrics.items() if name not in ("loss", "grad_norm")}
        return {"step": self.step, **{k: rollout_metrics[k] for k in ("reward_mean", "reward_correct_fraction",
                                                                       "response_length")},
                "loss": loss, "grad_norm": gnorm, **stats,
                **{k: v for k, v in rollout_metrics.items() if k.startswith("rollout_corr/")},
                "route_flip_rate": rollout_metrics["route_flip_rate"],
                "route_token_any_flip": rollout_metrics["route_token_any_flip"],
                **{name: v for name, v in rollout_metrics.items()
                   if name in ("behaviour_version", "lag") or name.startswith(("numerics/", "staleness/"))}}

    def minibatch_rows(self, epoch: int) -> list[np.ndarray | None]:
        """The rows of each minibatch of the current step's batch in pass `epoch`: [None] (the whole batch) with
        one minibatch; else a permutation seeded by (seed, step, epoch), cut into `minibatches` equal parts."""
        cfg = self.config
        if cfg.minibatches == 1:
            return [None]
        rows = cfg.prompts_per_step * cfg.grpo.group_size
        order = np.random.default_rng([cfg.seed, self.step, epoch, 7919]).permutation(rows)
        return list(order.reshape(cfg.minibatches, -1))

    def evaluate(self) -> float:
        """Mean reward of greedy completions on the held-out items, decoded under the trainer's policy (the same
        numerics for every arm whatever its engine)."""
        if self.eval_engine is not self.engine:
            self.eval_engine.sync_weights(self.model)
        rollout = self.eval_engine.generate([self.task.prompt(p) for p in self.eval_items],
                                       max_new_tokens=self.config.max_new_tokens, temperature=0.0,
                                       eos_id=tokenizer.EOS, batch_size=self.config.engine_batch)
        # in float64: a float32 mean's last bit depends on where each reward sits, so the same rewards in another
        # order showed a 'rise' of 3e-8
        return float(rewards_of(rollout, self.eval_items, self.task).mean(dtype=np.float64))

    def evaluate_sampled(self) -> float:
        """Mean reward of completions sampled by the rollout engine (at `temperature`, seeded by (seed, step)) on
        the held-out items: the policy as the engine's numerics deliver it."""
        cfg = self.config
        rollout = self.engine.generate([self.task.prompt(p) for p in self.eval_items],
                                       max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                       eos_id=tokenizer.EOS, seed=cfg.seed * 1_000_003 + 500_009 + self.step,
                                       batch_size=cfg.engine_batch)
        return float(rewards_of(rollout, self.eval_items, self.task).mean(dtype=np.float64))

    def _evaluations(self) -> dict:
        """The evaluation row entries: `eval_reward` (greedy, trainer's policy) and, with `eval_sampled`,
        `eval_engine_reward`."""
        out = {"eval_reward": self.evaluate()}
        if self.config.eval_sampled:
            out["eval_engine_reward"] = self.evaluate_sampled()
        return out

    # --- the loop -------------------------------------------------------------------------------------------
    def run(self, *, resume: bool = True, progress: bool = True, stop_after: int | None = None) -> list[dict]:
        """Train to `config.steps` (or stop after `stop_after` more steps, to test resumption); returns all
        metrics rows of the run (including those before a resume). Each row reaches `metrics.jsonl` (fsynced)
        before the step's checkpoint, so a killed run resumes with every row exactly once."""
        from tensorboardX import SummaryWriter
        from tqdm import tqdm

        if resume:
            self.restore_latest()
        log = rundir.MetricsLog(os.path.join(self.run_dir, "metrics.jsonl"), writer=self.primary)
        rows = log.resume(self.step)
        if self.step > 0 and len(rows) < self.step + 1:
            # the checkpoint is ahead of the rows: a row was torn or cut after its checkpoint was written (a full
            # disk, a copy cut short). Go back to a state whose rows are all there and recompute the rest.
            self.rewind(len(rows) - 1)
            rows = log.resume(self.step)
        if jax.process_count() > 1:  # every process continues from the same rows
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices(f"metrics resumed at step {self.step}")
        writer = SummaryWriter(os.path.join(self.run_dir, "tb")) if self.primary else None
        timing = os.path.join(self.run_dir, "timing.jsonl")

        def emit(row: dict, seconds: float) -> None:
            rows.append(row)
            log.append(row)
            if writer is not None:
                for key, value in row.items():
                    if key != "step" and isinstance(value, (int, float)):
                        writer.add_scalar(key, value, row["step"])
                with open(timing, "a") as f:
                    f.write(json.dumps({"step": row["step"], "seconds": seconds}) + "\n")

        if self.step == 0 and not rows:
            start = time.perf_counter()
            emit({"step": 0, **self._evaluations()}, time.perf_counter() - start)
        last = self.config.steps if stop_after is None else min(self.config.steps, self.step + stop_after)
        bar = tqdm(total=last, initial=self.step, desc=os.path.basename(self.run_dir),
                   disable=not (progress and self.primary))
        try:
            while self.step < last:
                start = time.perf_counter()
                row = self.train_step()
                if self.step % self.config.eval_every == 0 or self.step == self.config.steps:
                    row.update(self._evaluations())
                emit(row, time.perf_counter() - start)
                if self.step % self.config.checkpoint_every == 0 or self.step == last:
                    self.save()
                bar.update(1)
                bar.set_postfix(reward=f"{row['reward_mean']:.2f}", kl=f"{row['rollout_corr/kl']:.1e}")
        finally:
            bar.close()
            if writer is not None:
                writer.close()
        return rows
