"""The rollout side of an RL run: the arm's rollout engine (any `jaxalign.engines.RolloutEngine`: jaxalign's own
by default, or vLLM), the engine that evaluates greedily under the trainer's policy, and, at `max_lag` k >= 1, the
worker thread that generates batch t with the weights of version `behaviour_version(t, k)` while the trainer
updates on earlier batches.

Weights reach an engine only through `sync`, and every sync's report is kept with the batch or step it served
(`SyncLog`): an engine that verifies its syncs (vLLM: a fixed probe scored bitwise against a fresh load of the
same exported weights) raises `SyncMismatch` when one fails, which stops the run; the rows of a run on such an
engine count the step's syncs and how many were verified (`engine_syncs`, `engine_syncs_verified`).

The engine is opened when first used, from the weights it must first generate with, so a resumed run opens it at
its checkpoint's weights (no reload); an engine that verifies its syncs verifies that load as it would a sync, and
the row counts it as the sync it stands for (uninterrupted, that batch's weights came by a sync), so a resumed
run's rows count what the uninterrupted run's do. An engine handed in by the caller holds the starting weights
(version 0).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from jaxalign.engines import LocalEngine, RolloutEngine, VllmSpec, open_engine
from jaxalign.numerics.sampling import SamplingParams
from jaxalign.rl import tokenizer
from jaxalign.rl.config import RLConfig, behaviour_version
from jaxalign.rl.learner import Learner
from jaxalign.rl.task import Task


def open_rollout_engine(config: RLConfig, model, *, mesh=None) -> RolloutEngine:
    """The arm's rollout engine holding `model`'s weights (`jaxalign.engines.open_engine`): jaxalign's own under
    `config.engine_policy` (on `mesh`), or vLLM for a `VllmSpec`, sized for a step's batch (`max_num_seqs` = the
    engine batch, or every row of the step)."""
    if isinstance(config.engine_policy, VllmSpec):
        rows = config.prompts_per_step * config.grpo.group_size
        return open_engine(config.engine_policy, model, max_num_seqs=config.engine_batch or rows)
    return open_engine(config.engine_policy, model, mesh=mesh)


def sync_fields(reports: list[dict], *, always: bool = False) -> dict:
    """The row entries of a step's sync reports: {"engine_syncs": how many, "engine_syncs_verified": how many
    were verified} over the reports of an engine that verifies its syncs (`verified` not None); {} when there is
    none unless `always`. jaxalign's own engine verifies nothing (its syncs cast the trainer's arrays), so its
    rows are what they always were."""
    checked = [r for r in reports if r.get("verified") is not None]
    if not checked and not always:
        return {}
    return {"engine_syncs": len(checked), "engine_syncs_verified": sum(r["verified"] is True for r in checked)}


class Rollouts:
    """Generation for a run: `learner`'s weights, `task`'s items, `config`'s sampling (see the module docstring).

    `engine`: a `RolloutEngine` holding the learner's starting weights, or None to open the arm's
    (`open_rollout_engine`; closed by `close`). `engine_mesh`: where jaxalign's own engines run."""

    def __init__(self, learner: Learner, task: Task, config: RLConfig, *, engine: RolloutEngine | None = None,
                 engine_mesh=None):
        self.learner, self.task, self.config, self.engine_mesh = learner, task, config, engine_mesh
        self._engine, self._owned = engine, engine is None
        self.engine_version = 0 if engine is not None else None  # the weight version the engine holds
        self._eval_engine = None
        self._opening_reports: list[dict] = []  # a resumed run's verified first load, counted by the next `at`
        # asynchronous rollouts (max_lag k >= 1): the engine, driven by one worker thread, generates batch t with
        # the weights of version behaviour_version(t, k) while the trainer's thread scores and updates earlier ones
        self.behaviour = {0: learner.params}  # weight version -> weights, for the versions pending batches need
        self._pending = {}  # step -> Future of (Rollout, behaviour pass or None, sync reports)
        self._worker = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxalign-rollouts")
                        if config.max_lag else None)

    # --- engines --------------------------------------------------------------------------------------------
    def _model(self, params):
        """A model holding `params` (fresh variables over the same arrays: the worker thread never reads the
        learner's model, which the trainer's thread updates)."""
        return self.learner.version_model(params)

    def open(self, version: int, params) -> RolloutEngine:
        """The rollout engine, opened (on the calling thread: start engines from a thread that lives as long as
        they do) with the weights `params` of `version` when it is not open yet."""
        if self._engine is None:
            start = time.perf_counter()
            self._engine = open_rollout_engine(self.config, self._model(params), mesh=self.engine_mesh)
            self.engine_version = version
            if version > 0:
                self._opening_reports = self._verified_opening(self._engine, time.perf_counter() - start)
        return self._engine

    @staticmethod
    def _verified_opening(engine: RolloutEngine, seconds: float) -> list[dict]:
        """The report of an engine opened at weights version > 0 (a resumed run), where the uninterrupted run
        synced: for an engine that verifies its syncs (`verify_sync`), its first load checked against a fresh load
        in a process apart, as a sync is (`SyncMismatch` when it differs); [] for one that does not."""
        if not getattr(engine, "verify_sync", False):
            return []
        return [{"method": "load", "seconds": seconds, **engine.verify()}]

    @property
    def engine(self) -> RolloutEngine:
        """The rollout engine (opened at the learner's current weights when first used)."""
        return self.open(self.learner.version, self.learner.params)

    @property
    def opened(self) -> RolloutEngine | None:
        """The rollout engine if it is open, else None (without opening it)."""
        return self._engine

    @property
    def records_syncs(self) -> bool:
        """Whether the rollout engine's syncs are claims to record (every engine but jaxalign's own: vLLM)."""
        if self._engine is None:
            return isinstance(self.config.engine_policy, VllmSpec)
        return not isinstance(self._engine, LocalEngine)

    def _shares_engine(self) -> bool:
        """Whether greedy evaluation can use the rollout engine: jaxalign's own under the trainer's policy,
        holding the current weights (lag 0)."""
        cfg = self.config
        if cfg.max_lag or isinstance(cfg.engine_policy, VllmSpec):
            return False
        if self._owned:
            return cfg.engine_policy == cfg.trainer_policy
        return isinstance(self._engine, LocalEngine) and self._engine.policy == cfg.trainer_policy

    @property
    def eval_engine(self) -> RolloutEngine:
        """The engine of greedy evaluation: jaxalign's own under the trainer's policy, so every arm of an experiment
        is scored alike whatever its engine (the rollout engine itself when it is that one, at lag 0)."""
        if self._eval_engine is None:
            self._eval_engine = (self.engine if self._shares_engine() else
                                 LocalEngine(self.learner.model, self.config.trainer_policy, mesh=self.engine_mesh))
        return self._eval_engine

    def sync(self, engine: RolloutEngine, version: int, params) -> dict:
        """Sync `engine` to the weights `params` of `version`; the report (`SyncMismatch` from an engine whose
        verification fails)."""
        report = engine.sync(self._model(params))
        if engine is self._engine:
            self.engine_version = version
        return report

    def evaluation_engine(self) -> RolloutEngine:
        """The greedy evaluation engine at the learner's current weights (a separate one is synced each time, as
        jaxalign's engine syncs: a cast, nothing to record)."""
        engine = self.eval_engine
        if engine is self._engine:
            self.at(self.learner.version, self.learner.params)
        else:
            engine.sync(self.learner.model)
        return engine

    def forget_engine_weights(self) -> None:
        """The learner's weights were replaced (restore, rewind): the engine's version is unknown until synced."""
        self.drop_pending()
        if self._engine is not None:
            self.engine_version = None

    # --- generation -----------------------------------------------------------------------------------------
    def items(self, step: int) -> list:
        """Batch `step`'s items, each repeated for its GRPO group (deterministic in (seed, step))."""
        cfg = self.config
        return [p for p in self.task.train_items(step, cfg.prompts_per_step, cfg.seed)
                for _ in range(cfg.grpo.group_size)]

    def generate(self, step: int, engine: RolloutEngine | None = None):
        """The rollout of batch `step` (G completions of each of its items) from `engine` (default: the rollout
        engine) at whatever weights it holds; sampling is seeded by (seed, step)."""
        cfg = self.config
        return (self.engine if engine is None else engine).generate(
            [self.task.prompt(p) for p in self.items(step)], max_new_tokens=cfg.max_new_tokens,
            sampling=SamplingParams(temperature=cfg.temperature), eos_id=tokenizer.EOS,
            seed=cfg.seed * 1_000_003 + step, batch_size=cfg.engine_batch)

    def at(self, version: int, params) -> list[dict]:
        """Make the rollout engine hold the weights of `version` (`params`): opened with them, or synced when it
        holds another version. The sync reports ([] when nothing was synced; a resumed run's verified first load,
        see `open`)."""
        engine = self.open(version, params)
        if self.engine_version == version:
            reports, self._opening_reports = self._opening_reports, []
            return reports
        return [self.sync(engine, version, params)]

    # --- asynchronous rollouts ------------------------------------------------------------------------------
    def drop_pending(self) -> None:
        """Forget the batches generated ahead (cancelled, or waited for when already running)."""
        for future in self._pending.values():
            future.cancel()
        for future in self._pending.values():
            if not future.cancelled():
                future.exception()
        self._pending = {}

    def _generate_with(self, step: int, params, version: int, behaviour_pass):
        """(worker thread) Batch `step` from the rollout engine holding `params` (weight version `version`), and,
        when `behaviour_pass` is given, the trainer's pass over it at those weights: the worker, not the
        trainer's thread, pays for the older weights. Returns (rollout, behaviour or None, sync reports)."""
        reports = self.at(version, params)
        rollout = self.generate(step)
        model = self.learner.version_model(params)
        return rollout, (behaviour_pass(model, rollout) if behaviour_pass is not None else None), reports

    def schedule(self, step: int, behaviour_pass) -> None:
        """Queue every batch up to `step + k` whose weight version exists (all of them: version
        max(0, s - k) <= step), each with that version's weights; the worker runs them in step order.
        `behaviour_pass(s)`: the pass to run with batch s (or None)."""
        k = self.config.max_lag
        first = behaviour_version(step, k)
        self.open(first, self.behaviour[first])  # opened here, on the trainer's thread
        for s in range(step, min(step + k, self.config.steps - 1) + 1):
            if s not in self._pending:
                version = behaviour_version(s, k)
                self._pending[s] = self._worker.submit(self._generate_with, s, self.behaviour[version], version,
                                                       behaviour_pass(s, version))

    def take(self, step: int):
        """(rollout, behaviour pass or None, sync reports) of batch `step`, generated by the worker."""
        return self._pending.pop(step).result()

    def keep_versions(self, step: int) -> None:
        """After the update to version `step`: keep its weights and drop the versions no pending batch needs."""
        self.behaviour[step] = self.learner.params
        self.behaviour = {v: p for v, p in self.behaviour.items()
                          if v >= behaviour_version(step, self.config.max_lag)}

    def on_worker(self, fn, *args):
        """Run `fn(*args)` on the rollout worker after the batches queued before it (lag >= 1), else here."""
        if self._worker is None:
            return fn(*args)
        return self._worker.submit(fn, *args).result()

    def close(self) -> None:
        """Stop the worker and close the engines this object opened (not one handed in). Harmless twice."""
        self.drop_pending()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        for engine in {id(e): e for e in (self._engine, self._eval_engine) if e is not None}.values():
            if engine is not self._engine or self._owned:
                engine.close()
        if self._owned:
            self._engine = None
        self._eval_engine = None
