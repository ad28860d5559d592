"""The seed experiment: the same RL task run in arms that differ only in how trainer and engine compute token
probabilities (and, where an arm says so, in the rollout correction and router replay).

Arms are data (`jaxalign.rl.arms`): `NAME=TRAINER/ENGINE[;correction=...][;replay=...]`; ENGINE may be
`vllm[:DTYPE]` (vLLM generates the arm's rollouts, each sync verified: docs/vllm.md). The defaults:
- `aligned`: `aligned-bf16` on both sides.
- `misaligned`: `train-bf16` trainer, `serve-bf16` engine, protected by the experiment's default verl-style
  safeguards (token-level TIS and geometric rejection sampling; thresholds configurable).

Every arm and seed starts from the same SFT warm start and sees the same problems and sampling seeds. Writes per
arm and seed `metrics.jsonl` (+ TensorBoard and checkpoints), and at the top `run.json` (the experiment's
settings and build: another configuration on the same directory is refused), `summary.json`, `summary.md` and
PNG plots.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from jaxalign import report
from jaxalign.metrics.staleness import split_summary
from jaxalign.model.config import ModelConfig
from jaxalign.rl import rundir, tokenizer
from jaxalign.rl.arms import Arm, parse_arms
from jaxalign.rl.correction import CorrectionConfig
from jaxalign.rl.sft import SFTConfig, warm_start
from jaxalign.rl.task import CountdownTask
from jaxalign.engines import VllmSpec, engine_text
from jaxalign.rl.trainer import RLConfig, Trainer

DEFAULT_RS = ("seq_mean_k1:0.999_1.001",)  # verl's "geometric" rejection sampling


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """What `jaxalign experiment countdown` runs. `arms` are `Arm`s (`jaxalign.rl.arms`; `--arm` strings are
    accepted and parsed once, here); `to_dict()` writes them back as `--arm` strings."""

    arms: tuple[Arm, ...] = ("aligned", "misaligned")
    seeds: tuple[int, ...] = (0,)
    steps: int = 40
    # a model preset; None: `countdown`, or `countdown-vllm` (its widths in heads vLLM's CPU attention runs) when
    # an arm's engine is vLLM
    model: str | None = None
    prompts_per_step: int = 16
    group_size: int = 8
    max_new_tokens: int = 16
    learning_rate: float = 2e-3
    ppo_epochs: int = 1
    is_threshold: str = "2.0"
    rs: tuple[str, ...] = DEFAULT_RS
    eval_every: int = 10
    eval_problems: int = 512  # or the whole held-out split, when smaller (125 problems by default)
    problem_count: tuple[int, int] = (2, 2)
    max_number: int = 20  # problems' numbers lie in 1..max_number
    max_target: int = 99
    held_out: float = 0.2  # that fraction of the problem space is the held-out split (CountdownTask); 0 = none
    # the warm start prefers a wrong habit (the numbers joined by '/'), so greedy held-out reward starts low and RL
    # has room to raise it; its problem space (count, numbers, targets, held-out split) is the experiment's
    sft: SFTConfig = SFTConfig(steps=900, problems=12000, answers="habit:0.3:/", max_new_tokens=16)
    trainer_mesh: str = ""  # e.g. "data=2,expert=2,tensor=2"; "" = one device
    engine_mesh: str = ""
    minibatches: int = 1  # disjoint minibatches per collected batch, one optimizer step each (RLConfig.minibatches)
    answer_format: str = "bare"  # `countdown.ANSWER_FORMATS`: bare, or steps (worked steps before the answer)
    eval_sampled: bool = False  # also evaluate held-out reward sampled from each arm's engine (RLConfig)
    targets: str = "any"  # `countdown.TARGET_KINDS`: any reachable target, or chain (left to right, order shown)

    def __post_init__(self):
        object.__setattr__(self, "arms", parse_arms(self.arms))
        object.__setattr__(self, "model", self.model or default_model(self.arms))
        object.__setattr__(self, "sft", dataclasses.replace(
            self.sft, problem_count=tuple(self.problem_count), max_number=self.max_number,
            max_target=self.max_target, held_out=self.held_out, answer_format=self.answer_format,
            targets=self.targets))
        if not self.seeds:
            raise ValueError("at least one seed is needed")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds {list(self.seeds)} repeat a seed (two runs would share a directory)")
        CorrectionConfig(is_threshold=self.is_threshold, rs=tuple(self.rs))
        self.task()
        self.sft.check_batches()  # before the run directory is claimed
        vocab = ModelConfig.preset(self.model).vocab_size  # an unknown preset raises, naming the allowed ones
        if vocab < tokenizer.VOCAB_SIZE:
            raise ValueError(f"model {self.model!r} has vocab_size {vocab}, fewer than the Countdown tokenizer's "
                             f"{tokenizer.VOCAB_SIZE} ids; allowed: a preset with vocab_size >= {tokenizer.VOCAB_SIZE}")
        check_vllm_model(self.model, self.arms)

    def parsed_arms(self) -> tuple[Arm, ...]:
        """The arms (kept for callers of the string-holding config; `arms` is parsed already)."""
        return self.arms

    def to_dict(self) -> dict:
        """JSON-ready form: arms as their `--arm` strings (`Arm.spec`), nested configs as dicts."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["arms"] = [arm.spec() for arm in self.arms]
        out["sft"] = self.sft.to_dict()
        for name, legacy in (("minibatches", 1), ("answer_format", "bare"), ("eval_sampled", False),
                             ("targets", "any")):
            if out[name] == legacy:  # as experiments recorded their settings before these fields existed
                del out[name]
        return json.loads(json.dumps(out))

    def task(self) -> CountdownTask:
        """The Countdown task every arm trains on."""
        return CountdownTask(count=tuple(self.problem_count), high=self.max_number, max_target=self.max_target,
                             eval_size=self.eval_problems, held_out=self.held_out, answer_format=self.answer_format,
                             targets=self.targets)


def vllm_arms(arms) -> list[str]:
    """The names of the arms whose engine is vLLM."""
    return [arm.name for arm in arms if isinstance(arm.engine, VllmSpec)]


def default_model(arms) -> str:
    """The model preset an experiment uses when none is named: `countdown-vllm` when an arm's engine is vLLM (whose
    CPU attention needs heads of 32 or more), else `countdown`."""
    return "countdown-vllm" if vllm_arms(arms) else "countdown"


def check_vllm_model(model: str, arms) -> None:
    """A ValueError naming the constraint and the preset to use when an arm's engine is vLLM and `model`'s heads
    are a size vLLM's CPU attention does not run (the `countdown` preset's 16)."""
    names = vllm_arms(arms)
    if not names:
        return
    from jaxalign.engines.vllm.engine import CPU_HEAD_SIZES, check_runs_on_vllm_cpu
    try:
        check_runs_on_vllm_cpu(ModelConfig.preset(model))
    except ValueError:
        raise ValueError(f"model {model!r} has head_dim {ModelConfig.preset(model).head_dim}, and arm "
                         f"{names[0]!r} runs vLLM, whose CPU attention takes head sizes "
                         f"{', '.join(map(str, CPU_HEAD_SIZES))} only; use --model countdown-vllm (the countdown "
                         f"model as 2 heads of 32), the default when an arm's engine is vLLM") from None


def run_config(exp: ExperimentConfig, arm: Arm, seed: int) -> RLConfig:
    """The RLConfig of one arm and seed: identical across arms except what the arm names (policies, correction,
    replay, and its `;KEY=VALUE` overrides, applied after the experiment's settings)."""
    from jaxalign.rl.grpo import GRPOConfig
    default = CorrectionConfig(is_threshold=exp.is_threshold, rs=tuple(exp.rs))
    return arm.apply(RLConfig(**arm.settings(default), steps=exp.steps, prompts_per_step=exp.prompts_per_step,
                    max_new_tokens=exp.max_new_tokens, learning_rate=exp.learning_rate,
                    ppo_epochs=exp.ppo_epochs, minibatches=exp.minibatches, eval_sampled=exp.eval_sampled,
                    grpo=GRPOConfig(group_size=exp.group_size), seed=seed, eval_every=exp.eval_every,
                    eval_problems=exp.eval_problems, problem_count=tuple(exp.problem_count),
                    checkpoint_every=max(1, exp.steps // 3), trainer_mesh=exp.trainer_mesh,
                    engine_mesh=exp.engine_mesh))


def experiment_record(exp: ExperimentConfig) -> dict:
    """What the experiment directory's `run.json` holds (settings, build, host)."""
    return rundir.make_record({"experiment": exp.to_dict()})


def run_one(exp: ExperimentConfig, arm: Arm, seed: int, out_dir: str, progress: bool = False) -> list[dict]:
    """One arm and seed from the experiment's (cached) warm start, resumed where it stopped; a run whose
    `metrics.jsonl` is complete is read, not rebuilt (`rundir.finished_rows`)."""
    run_dir = os.path.join(out_dir, arm.name, f"seed{seed}")
    done = rundir.finished_rows(run_dir, exp.steps)
    if done is not None:
        return done
    base = warm_start(ModelConfig.preset(exp.model), exp.sft, os.path.join(out_dir, "cache"), progress=False)
    # the trainer copies the model: every arm and seed starts from the same warm start; it closes the engine it
    # opened (a vLLM process) when the run ends or fails
    with Trainer(base, run_config(exp, arm, seed), run_dir, task=exp.task()) as trainer:
        return trainer.run(progress=progress)


def run_arms(exp: ExperimentConfig, out_dir: str, *, progress: bool = True, what: str = "experiment",
             jobs: int = 1, claim: bool = True, order: str = "arms") -> dict:
    """Run (or resume) every arm and seed; {(arm name, seed): metrics rows}. A directory holding another
    configuration's experiment is refused before anything runs (`claim`; False when the caller claimed it).
    `jobs` > 1 runs that many at once, each in its own process (results are identical: each run is deterministic
    and owns its directory). `order`: "arms" (arm by arm), "priority" (the first two arms at every seed, then
    seed by seed) or "seeds" (every arm at a seed, seed by seed): the order in which a long study is most useful
    when stopped part way."""
    if jobs < 1:
        raise ValueError(f"jobs = {jobs}; allowed: >= 1")
    held = rundir.hold(out_dir, what=what)  # a second command on this directory is refused, naming this one
    try:
        return _run_arms(exp, out_dir, progress=progress, what=what, jobs=jobs, claim=claim, order=order)
    finally:
        held.release()


def _run_arms(exp, out_dir, *, progress, what, jobs, claim, order) -> dict:
    from tqdm import tqdm

    if claim:
        rundir.claim(out_dir, experiment_record(exp), what=what)
    warm_start(ModelConfig.preset(exp.model), exp.sft, os.path.join(out_dir, "cache"), progress=progress)
    arms = exp.parsed_arms()
    if order == "priority":
        todo = ([(a, s) for s in exp.seeds for a in arms[:2]] + [(a, s) for s in exp.seeds for a in arms[2:]])
    elif order == "seeds":
        todo = [(arm, seed) for seed in exp.seeds for arm in arms]
    else:
        todo = [(arm, seed) for arm in arms for seed in exp.seeds]
    runs = {}
    bar = tqdm(total=len(todo), desc="runs", disable=not progress or len(todo) == 1)
    if jobs == 1:
        for arm, seed in todo:
            runs[(arm.name, seed)] = run_one(exp, arm, seed, out_dir, progress=progress)
            bar.update(1)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(run_one, exp, arm, seed, out_dir): (arm.name, seed) for arm, seed in todo}
            for future in futures:  # in submission order; a failed run raises here, naming nothing lost
                runs[futures[future]] = future.result()
                bar.update(1)
    bar.close()
    return {key: runs[key] for key in sorted(runs, key=lambda k: (
        [a.name for a in arms].index(k[0]), k[1]))}


def run_experiment(exp: ExperimentConfig, out_dir: str, *, progress: bool = True, jobs: int = 1) -> dict:
    """Run every arm and seed (resuming finished or interrupted runs; `jobs` at once), then write the summary
    and plots."""
    runs = run_arms(exp, out_dir, progress=progress, jobs=jobs)
    summary = summarize(runs, exp)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(summary_markdown(summary))
    summary["plots"] = plot(runs, out_dir)
    return summary


def seed_summary(rows: list[dict]) -> dict:
    """One run's figures: warm-start / final / peak held-out reward and the rise (final - warm start), the
    sampled training reward over the first and last fifth of the steps, mean KL / k3, largest |dlogp|, rejected
    fraction, route flip rate, mean gradient norm, the number of steps with a nonzero trainer-engine KL, and the
    staleness/numerics split's per-part mean and largest k3 and mean share (`metrics.staleness.split_summary`).
    The route flip rate is null for an engine that records no routing (vLLM); a run whose engine verifies its
    syncs adds their count and how many were verified (`engine_syncs`, `engine_syncs_verified`)."""
    evals = [r["eval_reward"] for r in rows if "eval_reward" in r]
    steps = [r for r in rows if r["step"] > 0 and "rollout_corr/kl" in r]
    fifth = max(1, len(steps) // 5)
    return {
        "warm_start_reward": evals[0], "final_reward": evals[-1], "peak_reward": max(evals),
        "rise": evals[-1] - evals[0],
        "train_reward_start": float(np.mean([r["reward_mean"] for r in steps[:fifth]])),
        "train_reward_end": float(np.mean([r["reward_mean"] for r in steps[-fifth:]])),
        "mean_kl": float(np.mean([r["rollout_corr/kl"] for r in steps])),
        "mean_k3": float(np.mean([r["rollout_corr/k3_kl"] for r in steps])),
        "max_abs_logp_diff": float(np.max([r["rollout_corr/max_abs_logp_diff"] for r in steps])),
        "rejected_fraction": float(np.mean([r["rollout_corr/rollout_rs_masked_fraction"] for r in steps])),
        "route_flip_rate": _mean([r["route_flip_rate"] for r in steps]),
        "mean_grad_norm": float(np.mean([r["grad_norm"] for r in steps])),
        "steps_with_nonzero_kl": int(sum(r["rollout_corr/k3_kl"] != 0 or r["rollout_corr/kl"] != 0 for r in steps)),
        **split_summary(steps),  # the staleness/numerics split (metrics.staleness): rows written before it lack it
        **{key: int(sum(r[key] for r in steps)) for key in ("engine_syncs", "engine_syncs_verified")
           if any(key in r for r in steps)},
    }


def _mean(values: list) -> float | None:
    """The mean of `values`, or None when one is None (a figure the engine does not record)."""
    return None if any(v is None for v in values) else float(np.mean(values))


def summarize(runs: dict, exp: ExperimentConfig) -> dict:
    """Per arm: `seed_summary`'s figures as means over seeds, with `<key>_std` (sample std over seeds; 0 for one
    seed) for the held-out rewards and the rise, and the per-seed figures."""
    arms = {}
    for spec in exp.parsed_arms():
        per_seed = [{"seed": seed, **seed_summary(runs[(spec.name, seed)])} for seed in exp.seeds]
        keys = [k for k in per_seed[0] if k != "seed"]
        spread = {f"{k}_std": float(np.std([s[k] for s in per_seed], ddof=1)) if len(per_seed) > 1 else 0.0
                  for k in ("warm_start_reward", "final_reward", "peak_reward", "rise")}
        arms[spec.name] = {"policies": {"trainer": spec.trainer.compact(), "engine": engine_text(spec.engine)},
                           "spec": spec.spec(),
                           **{k: _mean([s[k] for s in per_seed]) for k in keys}, **spread,
                           "per_seed": per_seed}
    return {"config": exp.to_dict(), "arms": arms, "eval_size": len(exp.task().eval_items(exp.seeds[0]))}


SUMMARY_COLUMNS = ["arm", "warm_start_reward", "final_reward", "final_reward_std", "peak_reward", "rise", "rise_std",
                   "train_reward_start", "train_reward_end", "mean_kl", "mean_k3", "max_abs_logp_diff",
                   "rejected_fraction", "route_flip_rate", "steps_with_nonzero_kl", "numerics/mean_k3",
                   "staleness/mean_k3"]


def eval_set(summary: dict) -> str:
    """What a summary's evaluation rewards are measured on, in words (older summaries lack `eval_size`)."""
    cfg = summary["config"]
    size = summary.get("eval_size", cfg["eval_problems"])
    if cfg.get("held_out"):
        return f"the {size} held-out problems (a hashed {cfg['held_out']:.0%} split no run ever trains on)"
    return f"{size} problems drawn like the training problems"


def summary_markdown(summary: dict) -> str:
    """The summary as a Markdown table."""
    rows = [{"arm": arm, **vals} for arm, vals in summary["arms"].items()]
    head = "| " + " | ".join(SUMMARY_COLUMNS) + " |\n|" + "---|" * len(SUMMARY_COLUMNS) + "\n"
    body = "".join("| " + " | ".join(report.fmt(r.get(c)) for c in SUMMARY_COLUMNS) + " |\n" for r in rows)
    cfg = summary["config"]
    return (f"# Countdown: {', '.join(summary['arms'])}\n\n{cfg['steps']} steps, seeds {cfg['seeds']}, "
            f"{cfg['prompts_per_step']} problems x {cfg['group_size']} samples per step, model `{cfg['model']}`. "
            f"Rewards are greedy rewards on {eval_set(summary)}; KL / k3 / rejected "
            f"fraction are means over steps and seeds.\n\n" + head + body)


def plot(runs: dict, out_dir: str) -> list[str]:
    """reward.png, kl.png and rejected.png: one line per arm and seed."""
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend (e.g. a notebook's) alone

    panels = [("reward.png", "held-out reward (greedy)", "eval_reward"),
              ("train_reward.png", "training reward (sampled)", "reward_mean"),
              ("kl.png", "trainer-engine KL (rollout_corr/kl)", "rollout_corr/kl"),
              ("k3.png", "trainer-engine k3", "rollout_corr/k3_kl"),
              ("rejected.png", "rejected token fraction", "rollout_corr/rollout_rs_masked_fraction")]
    paths = []
    colors = {arm: f"C{i}" for i, arm in enumerate(dict.fromkeys(arm for arm, _ in runs))}
    for name, title, key in panels:
        fig = Figure(figsize=(6, 3.5))
        ax = fig.subplots()
        for (arm, seed), rows in runs.items():
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", markersize=3, label=f"{arm} seed {seed}",
                        color=colors[arm], alpha=0.8)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=100)
        paths.append(path)
    return paths
