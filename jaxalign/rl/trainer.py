"""The RL trainer: GRPO on Countdown with the rollout engine under one policy and the trainer under another.

One step: sample a batch of problems (deterministic in (seed, step)), generate G completions each with the
engine, score them, compute the trainer's logprobs of the same tokens (the old-policy pass), apply verl-style
rollout correction, take one AdamW step on the PPO-clip loss, sync the engine's weights. Checkpoints (orbax)
every N steps resume exactly; metrics go to JSONL and TensorBoard; a non-finite loss stops the run with a
resumable checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

from jaxalign.align.routing import routing_metrics
from jaxalign.engine import Engine
from jaxalign.model.scoring import sequence_logprobs, token_logprobs
from jaxalign.model.sharding import (make_mesh, mesh_context, parse_mesh_spec, put_batch, put_global, replicated,
                                     shard_state, state_shardings, to_host)
from jaxalign.model.transformer import Transformer
from jaxalign.numerics import NumericPolicy
from jaxalign.numerics.collectives import replicate
from jaxalign.numerics.optimizer import adamw
from jaxalign.numerics.reduce import global_norm
from jaxalign.rl import countdown, tokenizer
from jaxalign.rl.correction import CorrectionConfig, correct
from jaxalign.rl.grpo import GRPOConfig, group_advantages, policy_loss

MODES = ("decoupled", "bypass")
REPLAYS = ("none", "r2", "r3")
PROMPT_WIDTH = 24  # every Countdown prompt (<bos> + up to 4 numbers + target) fits; keeps trainer shapes fixed


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """Everything an RL run depends on (besides the warm-start weights)."""

    trainer_policy: str = "aligned-bf16"
    engine_policy: str = "aligned-bf16"
    steps: int = 20
    prompts_per_step: int = 8
    max_new_tokens: int = 24
    temperature: float = 1.0
    learning_rate: float = 3e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    mode: str = "decoupled"
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
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    trainer_mesh: str = ""  # a mesh spec (`jaxalign.make_mesh`), e.g. "data=2,expert=2,tensor=2"; "" = one device
    engine_mesh: str = ""  # with several processes: a mesh over each process's own devices

    def __post_init__(self):
        NumericPolicy.parse(self.trainer_policy)
        NumericPolicy.parse(self.engine_policy)
        parse_mesh_spec(self.trainer_mesh)
        parse_mesh_spec(self.engine_mesh)
        if self.mode not in MODES:
            raise ValueError(f"mode = {self.mode!r}; allowed: {', '.join(MODES)}")
        if self.replay not in REPLAYS:
            raise ValueError(f"replay = {self.replay!r}; allowed: {', '.join(REPLAYS)}")
        for name in ("steps", "prompts_per_step", "max_new_tokens", "checkpoint_every", "eval_every",
                     "eval_problems"):
            if getattr(self, name) < 1:
                raise ValueError(f"RLConfig.{name} = {getattr(self, name)}; allowed: >= 1")

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


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


def rewards_of(rollout, problems: list[countdown.Problem]) -> tuple[np.ndarray, list[str]]:
    """Countdown reward of each completion (the prompt ends with the opening <answer> tag)."""
    texts = [tokenizer.decode(rollout.completion(i)) for i in range(len(rollout))]
    rewards = np.array([countdown.score(p.numbers, p.target, "<answer>" + t) for p, t in zip(problems, texts)],
                       np.float32)
    return rewards, texts


class Trainer:
    """Runs GRPO for `config.steps` steps from `model`'s weights, writing into `run_dir`."""

    def __init__(self, model: Transformer, config: RLConfig, run_dir: str):
        if model.config.vocab_size < tokenizer.VOCAB_SIZE:
            raise ValueError(f"model vocab_size {model.config.vocab_size} < tokenizer vocab {tokenizer.VOCAB_SIZE}")
        self.model, self.config, self.run_dir = model, config, run_dir
        if config.lora_rank:
            from jaxalign.model.lora import add_lora, has_lora
            if not has_lora(model):
                add_lora(model, config.lora_rank, config.lora_alpha, config.lora_targets, seed=config.seed)
        self.trainer_policy = NumericPolicy.parse(config.trainer_policy)
        self.mesh = make_mesh(config.trainer_mesh) if config.trainer_mesh else None
        engine_devices = jax.local_devices() if jax.process_count() > 1 else None
        engine_mesh = make_mesh(config.engine_mesh, engine_devices) if config.engine_mesh else None
        self.engine = Engine(model, NumericPolicy.parse(config.engine_policy), mesh=engine_mesh)
        self.graphdef, self.params = nnx.split(model)
        self.params = shard_state(self.params, self.mesh)
        nnx.update(self.model, self.params)
        # the frozen reference for the optional KL penalty: the weights the run starts from
        self.reference = (nnx.merge(self.graphdef, jax.tree.map(lambda x: x, self.params))
                          if config.grpo.kl_coef > 0 else None)
        self.optimizer = make_optimizer(config.learning_rate, config.weight_decay, config.grad_clip,
                                        lora_only=bool(config.lora_rank), policy=self.trainer_policy)
        self.opt_state = self._shard_opt_state(self.optimizer.init(self.params))
        self.width = PROMPT_WIDTH + config.max_new_tokens
        self.step = 0
        os.makedirs(run_dir, exist_ok=True)
        self.checkpoints = ocp.CheckpointManager(
            os.path.abspath(os.path.join(run_dir, "checkpoints")),
            options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
        self.eval_problems = countdown.generate_problems(config.eval_problems, seed=1_000_003 + config.seed,
                                                         count=config.problem_count)
        self._update = self._compile_update()

    # --- placement ------------------------------------------------------------------------------------------
    def _shard_opt_state(self, opt_state):
        """Optimizer moments split like their parameters; counters replicated."""
        if self.mesh is None:
            return opt_state
        keystr = jax.tree_util.keystr
        by_path = {keystr(path): s for path, s in jax.tree_util.tree_flatten_with_path(
            state_shardings(self.params, self.mesh))[0]}

        def place(path, x):
            name = keystr(path)
            match = [s for p, s in by_path.items() if name.endswith(p)]  # mu[...]/nu[...] end with a param path
            return put_global(x, match[0] if match else replicated(self.mesh))
        return jax.tree_util.tree_map_with_path(place, opt_state)

    # --- state ----------------------------------------------------------------------------------------------
    def _state_tree(self):
        return {"params": nnx.to_pure_dict(self.params), "opt_state": self.opt_state,
                "step": np.asarray(self.step, np.int64)}

    def save(self) -> None:
        """Checkpoint the current state (params, optimizer state, step)."""
        self.checkpoints.save(self.step, args=ocp.args.StandardSave(self._state_tree()), force=True)
        self.checkpoints.wait_until_finished()

    def restore_latest(self) -> bool:
        """Resume from the newest checkpoint in the run directory, if any."""
        latest = self.checkpoints.latest_step()
        if latest is None:
            return False
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, self._state_tree())
        restored = self.checkpoints.restore(latest, args=ocp.args.StandardRestore(abstract))
        nnx.replace_by_pure_dict(self.params, restored["params"])
        self.opt_state = restored["opt_state"]
        self.step = int(restored["step"])
        nnx.update(self.model, self.params)
        self.engine.sync_weights(self.model)
        return True

    # --- one update -----------------------------------------------------------------------------------------
    def _update_fn(self, params, opt_state, tokens, replay, logp_old, advantages, weights, mask, logp_ref):
        cfg = self.config

        ordered = self.trainer_policy.cross_device == "ordered"

        def loss_fn(p):
            lp, _ = sequence_logprobs(nnx.merge(self.graphdef, p), tokens, self.trainer_policy, replay=replay,
                                      temperature=cfg.temperature)
            per_token = (lp, logp_old, advantages, weights, mask, logp_ref)
            if ordered:  # the loss sums over the whole batch: on one device, in the one-device order
                per_token = replicate(per_token)
            return policy_loss(*per_token[:5], cfg.grpo, logp_ref=per_token[5], policy=self.trainer_policy)

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        if ordered:  # the clipping norm sums over every (sharded) gradient: replicated, it sums in one place
            grads, params, opt_state = replicate((grads, params, opt_state))
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, stats, global_norm(grads, self.trainer_policy)

    def _compile_update(self):
        """The jitted update; on a mesh its outputs keep the parameters' and optimizer state's placement."""
        if self.mesh is None:
            return jax.jit(self._update_fn)
        shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
        return jax.jit(self._update_fn, out_shardings=(shardings(self.params), shardings(self.opt_state),
                                                       None, None, None))

    def _apply_update(self, *batch):
        """Run the update on (params, opt_state, *batch) on the trainer's mesh (rows of the batch split)."""
        if self.mesh is None:
            return self._update(self.params, self.opt_state, *(None if b is None else jnp.asarray(b) for b in batch))
        with mesh_context(self.mesh):
            return self._update(self.params, self.opt_state,
                                *(None if b is None else put_batch(b, self.mesh) for b in batch))

    def _problems(self, step: int) -> list[countdown.Problem]:
        return countdown.generate_problems(self.config.prompts_per_step, seed=self.config.seed * 100_003 + step,
                                           count=self.config.problem_count)

    def train_step(self) -> dict:
        """One GRPO step; returns its metrics."""
        cfg, g = self.config, self.config.grpo.group_size
        start = time.perf_counter()
        problems = [p for p in self._problems(self.step) for _ in range(g)]
        prompts = [tokenizer.encode(p.prompt(), bos=True) for p in problems]
        rollout = self.engine.generate(prompts, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                       eos_id=tokenizer.EOS, seed=cfg.seed * 1_000_003 + self.step,
                                       batch_size=cfg.engine_batch)
        rewards, _ = rewards_of(rollout, problems)
        advantages = group_advantages(rewards, g)
        tokens = pad_to(rollout.tokens, self.width, 1, tokenizer.PAD)
        logp_rollout = pad_to(rollout.logprobs, self.width - 1, 1, 0.0)
        mask = pad_to(rollout.mask, self.width - 1, 1, False)
        engine_routes = pad_to(np.asarray(rollout.routing.indices), self.width, 1, -1)
        lp_old, old_record = token_logprobs(self.model, tokens, self.trainer_policy, temperature=cfg.temperature,
                                            replay=engine_routes if cfg.replay == "r3" else None, mesh=self.mesh)
        lp_old, old_indices = to_host(lp_old), to_host(old_record.indices)
        replay = {"none": None, "r3": engine_routes, "r2": old_indices}[cfg.replay]
        logp_behaviour = logp_rollout if cfg.mode == "bypass" else lp_old  # the PPO ratio's denominator
        weights, accept, corr_metrics = correct(lp_old, logp_rollout, mask, cfg.correction)
        if cfg.mode == "bypass":
            weights = accept.astype(np.float32)  # pi_old := pi_rollout: the PPO ratio carries the mismatch
        logp_ref = None
        if self.reference is not None:
            logp_ref = to_host(token_logprobs(self.reference, tokens, self.trainer_policy,
                                              temperature=cfg.temperature, replay=replay, mesh=self.mesh)[0])
        forwarded = (engine_routes >= 0).all(-1).all(-1)
        flips = routing_metrics(engine_routes, old_indices, valid=forwarded)
        params, opt_state, loss, stats, gnorm = self._apply_update(
            tokens, replay, np.asarray(logp_behaviour, np.float32), np.asarray(advantages), np.asarray(weights),
            np.asarray(accept), logp_ref)
        loss, gnorm = float(loss), float(gnorm)
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
        return {"step": self.step, "reward_mean": float(rewards.mean()),
                "reward_correct_fraction": float((rewards == 1.0).mean()),
                "response_length": float(rollout.completion_lens.mean()), "loss": loss, "grad_norm": gnorm,
                **{k: float(v) for k, v in stats.items()}, **corr_metrics,
                "route_flip_rate": flips["route_flip_rate"], "route_token_any_flip": flips["route_token_any_flip"],
                "seconds": time.perf_counter() - start}

    def evaluate(self) -> float:
        """Mean reward of greedy completions on the held-out problems."""
        prompts = [tokenizer.encode(p.prompt(), bos=True) for p in self.eval_problems]
        rollout = self.engine.generate(prompts, max_new_tokens=self.config.max_new_tokens, temperature=0.0,
                                       eos_id=tokenizer.EOS, batch_size=self.config.engine_batch)
        return float(rewards_of(rollout, self.eval_problems)[0].mean())

    # --- the loop -------------------------------------------------------------------------------------------
    def run(self, *, resume: bool = True, progress: bool = True, stop_after: int | None = None) -> list[dict]:
        """Train to `config.steps` (or stop after `stop_after` more steps, to test resumption); returns all
        metrics rows of the run (including those before a resume)."""
        from tensorboardX import SummaryWriter
        from tqdm import tqdm

        from jaxalign.distributed import is_primary

        if resume:
            self.restore_latest()
        primary = is_primary()  # with several processes, one writes the metrics, config and TensorBoard files
        progress = progress and primary
        metrics_path = os.path.join(self.run_dir, "metrics.jsonl")
        rows = []
        if os.path.exists(metrics_path):
            with open(metrics_path) as f:
                rows = [r for r in map(json.loads, f) if r["step"] <= self.step]
        if primary:
            with open(os.path.join(self.run_dir, "config.json"), "w") as f:
                json.dump(self.config.to_dict(), f, indent=2)
        writer = SummaryWriter(os.path.join(self.run_dir, "tb")) if primary else None
        if self.step == 0 and not rows:
            rows.append({"step": 0, "eval_reward": self.evaluate()})
        last = self.config.steps if stop_after is None else min(self.config.steps, self.step + stop_after)
        bar = tqdm(total=last, initial=self.step, desc=os.path.basename(self.run_dir), disable=not progress)
        try:
            while self.step < last:
                row = self.train_step()
                if self.step % self.config.eval_every == 0 or self.step == self.config.steps:
                    row["eval_reward"] = self.evaluate()
                rows.append(row)
                for key, value in row.items():
                    if writer is not None and key != "step" and isinstance(value, (int, float)):
                        writer.add_scalar(key, value, self.step)
                if self.step % self.config.checkpoint_every == 0 or self.step == last:
                    self.save()
                bar.update(1)
                bar.set_postfix(reward=f"{row['reward_mean']:.2f}", kl=f"{row['rollout_corr/kl']:.1e}")
        finally:
            bar.close()
            if primary:
                writer.close()
                with open(metrics_path, "w") as f:
                    for r in rows:
                        f.write(json.dumps(r) + "\n")
            if jax.process_count() > 1:  # the others may read these files next (a resumed run)
                from jax.experimental import multihost_utils
                multihost_utils.sync_global_devices(f"metrics written at step {self.step}")
        return rows
