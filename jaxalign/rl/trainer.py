"""The RL loop: GRPO on a `Task` (Countdown by default) with the rollout engine under one numeric set-up and the
trainer under another. The parts, each replaceable on its own:

- `RLConfig` (`rl.config`): everything a run depends on besides its warm-start weights.
- the learner (`rl.learner`): the trainer's weights on its mesh, the optimizer, the pure jitted update
  `(params, opt_state, batch) -> (params, opt_state, metrics)` and the trainer's scoring passes.
- the rollouts (`rl.rollouts`): the arm's engine -- any `jaxalign.engines.RolloutEngine`, jaxalign's own by
  default or vLLM (`engine_policy = vllm[:DTYPE]`) -- synced to the weights each batch is generated with, every
  sync of an engine that verifies them checked; the greedy-evaluation engine; the asynchronous worker.
- collect (`rl.collect`): a batch's rollout -> reward -> old-policy pass -> rollout correction, as a `TrainBatch`
  and the step's metrics.
- `Trainer.run` (here): a thin loop -- collect, update, send the row to the sinks (`metrics.jsonl`, TensorBoard,
  the progress bar), checkpoint.

`RLConfig.max_lag` k >= 1: asynchronous rollouts. The engine, on one worker thread, generates batch t with the
weights of version `behaviour_version(t, k)` = max(0, t - k) while this thread updates on earlier batches;
checkpoints hold the older versions still needed, so a killed run resumes to the same rows (docs/rl.md).

The trainer works on its own copy of the model (LoRA adapters are added to the copy; the caller's model is never
changed). A run directory records its settings, build and host (`rundir`): another configuration on the same
directory is refused, and after a kill the same command resumes with every metrics row exactly once. Checkpoints
(orbax) every N steps resume exactly; a non-finite loss stops the run with a resumable checkpoint; an engine sync
that fails its verification (`SyncMismatch`) stops it with the difference.
"""

from __future__ import annotations

import json
import os
import time
import weakref

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jaxalign.engines import RolloutEngine, describe
from jaxalign.model.sharding import make_mesh
from jaxalign.model.transformer import Transformer
from jaxalign.numerics.sampling import SamplingParams
from jaxalign.rl import rundir, tokenizer
from jaxalign.rl.collect import behaviour_pass, collect, pad_to, rewards_of  # noqa: F401  (pad_to: re-exported)
from jaxalign.rl.config import RLConfig, behaviour_version
from jaxalign.rl.learner import (Learner, TrainBatch, clip_by_global_norm, make_optimizer,  # noqa: F401  (re-exported)
                                 make_update)
from jaxalign.rl.rollouts import Rollouts, sync_fields
from jaxalign.rl.task import PROMPT_WIDTH, CountdownTask, Task  # noqa: F401  (PROMPT_WIDTH: used by sft)


class Trainer:
    """Runs GRPO for `config.steps` steps from a copy of `model`'s weights on `task` (default: Countdown from
    the config's `problem_count` / `eval_problems`), writing into `run_dir`.

    `engine`: the rollout engine (a `jaxalign.engines.RolloutEngine` holding `model`'s weights; the caller closes
    it), or None for the arm's own, opened when first needed from `config.engine_policy` (jaxalign's engine, or
    vLLM in its own process) and closed by `close()` (or at the end of a `with` block)."""

    def __init__(self, model: Transformer, config: RLConfig, run_dir: str, task: Task | None = None,
                 engine: RolloutEngine | None = None):
        if model.config.vocab_size < tokenizer.VOCAB_SIZE:
            raise ValueError(f"model vocab_size {model.config.vocab_size} < tokenizer vocab {tokenizer.VOCAB_SIZE}")
        self.config, self.run_dir = config, run_dir
        self.task = task or CountdownTask(count=tuple(config.problem_count), eval_size=config.eval_problems)
        start_weights = rundir.weights_fingerprint(nnx.state(model))
        self.learner = Learner(model, config)
        engine_devices = jax.local_devices() if jax.process_count() > 1 else None
        engine_mesh = make_mesh(config.engine_mesh, engine_devices) if config.engine_mesh else None
        self.rollouts = Rollouts(self.learner, self.task, config, engine=engine, engine_mesh=engine_mesh)
        self.last_logprobs = None  # the last collected batch's per-token logprobs (see `collect`)
        self._eval_syncs = []  # the syncs the current evaluation made (the sampled one, at lag >= 1)
        self.width = self.task.prompt_width + config.max_new_tokens
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

    # --- the parts, by the names the loop had before it was split ---------------------------------------------
    step = property(lambda self: self.learner.version, lambda self, v: setattr(self.learner, "version", v),
                    doc="The current weight version: how many updates the weights have had.")
    model = property(lambda self: self.learner.model, doc="The trainer's model (its own copy).")
    params = property(lambda self: self.learner.params, lambda self, v: setattr(self.learner, "params", v),
                      doc="The trainer's parameters (nnx.State).")
    opt_state = property(lambda self: self.learner.opt_state, lambda self, v: setattr(self.learner, "opt_state", v),
                         doc="The optimizer state.")
    graphdef = property(lambda self: self.learner.graphdef, doc="The model's graph definition.")
    mesh = property(lambda self: self.learner.mesh, doc="The trainer's mesh (None: one device).")
    trainer_policy = property(lambda self: self.learner.policy, doc="The trainer's numeric policy.")
    reference = property(lambda self: self.learner.reference, doc="The KL penalty's frozen reference, or None.")
    engine = property(lambda self: self.rollouts.engine, doc="The rollout engine (a RolloutEngine).")
    eval_engine = property(lambda self: self.rollouts.eval_engine, doc="The greedy-evaluation engine.")
    behaviour = property(lambda self: self.rollouts.behaviour, doc="Weight versions pending batches need.")
    _pending = property(lambda self: self.rollouts._pending, doc="step -> Future of its generated batch.")

    def close(self) -> None:
        """Stop the rollout worker and close the engines the trainer opened (a vLLM process). Harmless twice."""
        self.rollouts.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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
        self.rollouts.forget_engine_weights()
        self.learner.set_state(self.learner.start["params"], self.learner.start["opt_state"])
        self.step = 0
        self.rollouts.behaviour = {0: self.params}

    def restore(self, latest: int) -> None:
        """Resume from the checkpoint of step `latest`."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, self._state_tree(latest))
        restored = self.checkpoints.restore(latest, args=ocp.args.StandardRestore(abstract))
        self.rollouts.forget_engine_weights()
        self.learner.set_state(restored["params"], restored["opt_state"])
        self.step = int(restored["step"])
        behaviour = {self.step: self.params}
        for key, pure in restored.get("behaviour", {}).items():
            version = jax.tree.map(lambda x: x, self.params)  # fresh variables, the same structure
            nnx.replace_by_pure_dict(version, pure)
            behaviour[int(key[1:])] = version
        self.rollouts.behaviour = behaviour

    # --- collect --------------------------------------------------------------------------------------------
    def splits(self, step: int) -> bool:
        """Whether batch `step` measures the numerics/staleness split (`RLConfig.split_every`)."""
        every = self.config.split_every
        return every > 0 and step % every == 0

    def generate(self, step: int, engine: RolloutEngine | None = None):
        """The rollout of batch `step` (G completions of each of its items) from `engine` (default: the rollout
        engine) at whatever weights it holds; sampling is seeded by (seed, step)."""
        return self.rollouts.generate(step, engine)

    def _behaviour_of(self, step: int, version: int):
        """The pass the worker runs with batch `step` generated at `version`: the trainer's at those weights when
        they are not the ones the batch is trained at and the split is measured on it, else None."""
        if version == step or not self.splits(step):
            return None
        return lambda model, rollout: behaviour_pass(self.learner, model, rollout, self.width)

    def collect(self, rollout=None, version: int | None = None, behaviour=None) -> tuple[TrainBatch, dict]:
        """Engine -> reward -> old-policy pass -> rollout correction for the current step (`rl.collect.collect`):
        the update's batch and the step's rollout metrics. `rollout`: the step's batch as generated with the
        weights of `version` (default: generated here by the engine at the current weights); `behaviour`: the
        trainer's pass at those weights when the worker made it, else it runs here if the split is measured.
        `self.last_logprobs` keeps the three per-token logprobs."""
        if rollout is None:
            self.rollouts.at(self.step, self.params)
            rollout = self.generate(self.step)
        version = self.step if version is None else version
        if behaviour is None and self._behaviour_of(self.step, version) is not None:
            behaviour = behaviour_pass(self.learner, self.learner.version_model(self.behaviour[version]), rollout,
                                       self.width)
        batch, metrics, self.last_logprobs = collect(self.learner, rollout, self.rollouts.items(self.step),
                                                     self.task, self.width, step=self.step, version=version,
                                                     behaviour=behaviour)
        return batch, metrics

    # --- a step ---------------------------------------------------------------------------------------------
    def train_step(self) -> dict:
        """One GRPO step (sync the engine to the current weights, collect, `ppo_epochs` passes of optimizer steps
        on the batch); returns its metrics row. With `max_lag` k >= 1 the step's batch comes from the worker
        (generated with the weights of version max(0, step - k)), and once the update is done the batches the
        new weights generate are queued. Rows of a run whose engine verifies its syncs (vLLM) count them
        (`rl.rollouts.sync_fields`)."""
        k = self.config.max_lag
        if k:
            self.rollouts.schedule(self.step, self._behaviour_of)
            rollout, behaviour, syncs = self.rollouts.take(self.step)
            batch, rollout_metrics = self.collect(rollout, behaviour_version(self.step, k), behaviour)
        else:
            syncs = self.rollouts.at(self.step, self.params)
            batch, rollout_metrics = self.collect(self.generate(self.step))
        passes = [self.minibatch_rows(epoch) for epoch in range(self.config.ppo_epochs)]
        params, opt_state, update_metrics = self.learner.update(batch, passes)
        loss, gnorm = update_metrics["loss"], update_metrics["grad_norm"]
        if not (np.isfinite(loss) and np.isfinite(gnorm)):
            if self.checkpoints.latest_step() != self.step:
                self.save()  # the state before this update: resumable
            raise FloatingPointError(
                f"non-finite loss ({loss}) or gradient norm ({gnorm}) at step {self.step}; the run stopped and the "
                f"last good state is checkpointed in {self.run_dir}/checkpoints (step {self.step})")
        self.learner.commit(params, opt_state)
        self.step += 1
        if k:
            self.rollouts.keep_versions(self.step)
            self.rollouts.schedule(self.step, self._behaviour_of)  # the worker starts on these weights' batches
        stats = {name: v for name, v in update_metrics.items() if name not in ("loss", "grad_norm")}
        return {"step": self.step, **{k: rollout_metrics[k] for k in ("reward_mean", "reward_correct_fraction",
                                                                       "response_length")},
                "loss": loss, "grad_norm": gnorm, **stats,
                **{k: v for k, v in rollout_metrics.items() if k.startswith("rollout_corr/")},
                "route_flip_rate": rollout_metrics["route_flip_rate"],
                "route_token_any_flip": rollout_metrics["route_token_any_flip"],
                **{name: v for name, v in rollout_metrics.items()
                   if name in ("behaviour_version", "lag") or name.startswith(("numerics/", "staleness/"))},
                **self._sync_fields(syncs)}

    def _sync_fields(self, reports: list[dict]) -> dict:
        """`sync_fields` of a step's sync reports, present on every row of a run whose engine verifies syncs."""
        if not self.rollouts.records_syncs:
            return {}
        return sync_fields(reports, always=True)

    def minibatch_rows(self, epoch: int) -> list[np.ndarray | None]:
        """The rows of each minibatch of the current step's batch in pass `epoch`: [None] (the whole batch) with
        one minibatch; else a permutation seeded by (seed, step, epoch), cut into `minibatches` equal parts."""
        cfg = self.config
        if cfg.minibatches == 1:
            return [None]
        rows = cfg.prompts_per_step * cfg.grpo.group_size
        order = np.random.default_rng([cfg.seed, self.step, epoch, 7919]).permutation(rows)
        return list(order.reshape(cfg.minibatches, -1))

    # --- evaluation -----------------------------------------------------------------------------------------
    def evaluate(self) -> float:
        """Mean reward of greedy completions on the held-out items, decoded under the trainer's policy (the same
        numerics for every arm whatever its engine)."""
        rollout = self.rollouts.evaluation_engine().generate(
            [self.task.prompt(p) for p in self.eval_items], max_new_tokens=self.config.max_new_tokens,
            sampling=SamplingParams(temperature=0.0), eos_id=tokenizer.EOS, batch_size=self.config.engine_batch)
        # in float64: a float32 mean's last bit depends on where each reward sits, so the same rewards in another
        # order showed a 'rise' of 3e-8
        return float(rewards_of(rollout, self.eval_items, self.task).mean(dtype=np.float64))

    def evaluate_sampled(self) -> float:
        """Mean reward of completions sampled by the rollout engine at the current weights (at `temperature`,
        seeded by (seed, step)) on the held-out items: the policy as the engine's numerics deliver it. (At lag
        >= 1 it runs on the rollout worker, after the batches queued before it.)"""
        cfg, step, params = self.config, self.step, self.params

        def sample():
            self._eval_syncs += self.rollouts.at(step, params)
            return self.rollouts.engine.generate(
                [self.task.prompt(p) for p in self.eval_items], max_new_tokens=cfg.max_new_tokens,
                sampling=SamplingParams(temperature=cfg.temperature), eos_id=tokenizer.EOS,
                seed=cfg.seed * 1_000_003 + 500_009 + step, batch_size=cfg.engine_batch)
        if cfg.max_lag:
            self.rollouts.open(step, params)  # on this thread, if not open yet
        rollout = self.rollouts.on_worker(sample)
        return float(rewards_of(rollout, self.eval_items, self.task).mean(dtype=np.float64))

    def _evaluations(self) -> dict:
        """The evaluation row entries: `eval_reward` (greedy, trainer's policy) and, with `eval_sampled`,
        `eval_engine_reward` (with the syncs that needed, when the engine verifies them)."""
        self._eval_syncs = []
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

        def evaluated(row: dict) -> dict:
            row.update(self._evaluations())
            if self._eval_syncs and self.rollouts.records_syncs:  # the sampled evaluation synced the engine:
                for key, value in sync_fields(self._eval_syncs, always=True).items():  # counted with the step's
                    row[key] = row.get(key, 0) + value
            return row

        if self.step == 0 and not rows:
            start = time.perf_counter()
            emit(evaluated({"step": 0}), time.perf_counter() - start)
        last = self.config.steps if stop_after is None else min(self.config.steps, self.step + stop_after)
        bar = tqdm(total=last, initial=self.step, desc=os.path.basename(self.run_dir),
                   disable=not (progress and self.primary))
        try:
            while self.step < last:
                start = time.perf_counter()
                row = self.train_step()
                if self.step % self.config.eval_every == 0 or self.step == self.config.steps:
                    evaluated(row)
                emit(row, time.perf_counter() - start)
                if self.step % self.config.checkpoint_every == 0 or self.step == last:
                    self.save()
                bar.update(1)
                bar.set_postfix(reward=f"{row['reward_mean']:.2f}", kl=f"{row['rollout_corr/kl']:.1e}")
        finally:
            bar.close()
            if writer is not None:
                writer.close()
        self._record_engine(rows)
        return rows

    def _record_engine(self, rows: list[dict]) -> None:
        """`engine.json` in the run directory, for an engine whose syncs are claims (vLLM): the engine by name,
        version and numerics, and over the run's rows how many syncs it made and how many were verified."""
        engine = self.rollouts.opened
        if not (self.primary and engine is not None and self.rollouts.records_syncs):
            return  # (an engine never opened made no sync: a finished run's record stays as it was)
        syncs = sum(r.get("engine_syncs", 0) for r in rows)
        verified = sum(r.get("engine_syncs_verified", 0) for r in rows)
        record = {"engine": describe(engine), "syncs": syncs, "syncs_verified": verified,
                  "every_sync_verified": syncs == verified}
        with open(os.path.join(self.run_dir, "engine.json"), "w") as f:
            json.dump(record, f, indent=2)


__all__ = ["RLConfig", "TrainBatch", "Trainer", "behaviour_version", "clip_by_global_norm", "make_optimizer",
           "make_update", "pad_to", "rewards_of"]
