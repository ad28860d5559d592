"""`jaxalign experiment study`: what a trainer/engine gap of the seed's size does to RL, and what closes it.

Design (each point answers a flaw of a study that varied several things at once):
- **One thing varies**: every arm trains under the same trainer policy (`aligned-bf16`) and evaluates under it;
  only the engine differs. The exception is the `aligned-fp8` arm, the fix under test, whose trainer forward runs
  the engine's W8A8 path.
- **Doses, not outcomes**: the engines are chosen *before* training by measuring, at the warm start, the k3 of each
  candidate engine against the trainer on the task's own prompts (`calibrate`); for each target dose (1e-3,
  1e-2, 3e-2) the candidate nearest in log distance. Candidates are FP8 engines of several granularities (the
  realistic doses) and, beyond what FP8 reaches on this model (k3 ~1e-3), the FP8 engine with the synthetic
  engine-side knob `logit_scale` (its logits scaled: sampling at another temperature), named as such
  (`fp8+synthetic`) wherever a dose is reported.
- **At the seed-regime dose** (the dose nearest the seed's k3 0.013): uncorrected; corrected (token TIS 2 and a
  geometric rejection band calibrated at the warm start to reject ~45% of sequences, as in the seed); router
  replay (R3); a control that drops the same fraction of sequences at random (`correction=drop:F`); and
  `aligned-fp8`.
- **Evaluation that measures learning**: a hashed held-out split training and the warm start never draw from,
  greedy under the trainer's policy; the final figure is the mean of the last 3 evaluations.
- **Statistics**: collapsed seeds per arm against the aligned arm's (Fisher's exact test), final reward against
  the aligned arm's (exact permutation test) and the smallest difference these seeds can detect.

Collapse (`collapse_step`): the sampled training reward, as a trailing mean over `COLLAPSE_WINDOW` steps, falls
below `COLLAPSE_FRACTION` of its best value so far and stays below it to the end of the run.

Everything a figure needs is in the study directory: `run.json` (settings, build and host), `calibration.json`
(every candidate's measured dose), each run's `metrics.jsonl` (every step's verl-named mismatch metrics; eval
rewards on eval steps) and `run.json`; `study.json`, `study.md` and the plots are rebuilt from those files alone
by `jaxalign experiment study --out DIR --report`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np

from jaxalign import report
from jaxalign.numerics import NumericPolicy
from jaxalign.rl import rundir
from jaxalign.rl.experiment import ExperimentConfig, run_arms, seed_summary
from jaxalign.rl.stats import detectable_difference, fisher_exact, permutation_p

COLLAPSE_WINDOW = 10
COLLAPSE_FRACTION = 0.5
FINAL_EVALS = 3  # the final figure: the mean of the last 3 held-out evaluations
TRAINER = "aligned-bf16"
TARGETS = (1e-3, 1e-2, 3e-2)
SEED_REGIME_K3 = 0.013  # the seed's trainer/engine KL, where its run collapsed
REJECT_TARGET = 0.45  # the seed's rejected share of each batch
# (name, engine policy, kind): FP8 engines of several granularities -- weights in e4m3 blocks, activations in e4m3
# tiles, f32 or e8m0 scales, and the KV cache in e4m3 (scaled) or e5m2 (a direct cast, vLLM's fp8_e5m2)
CANDIDATES = (
    ("bf16", "serve-bf16", "bf16"),
    ("w16-a16", "serve-fp8,kvq=none", "fp8"),
    ("w64-a64-e8m0", "serve-fp8,wq=e4m3:64x64,aq=e4m3:64,qscale=e8m0,kvq=none", "fp8"),
    ("w16-a16-kv4", "serve-fp8", "fp8"),
    ("w64-a64-e8m0-kv4", "serve-fp8,wq=e4m3:64x64,aq=e4m3:64,qscale=e8m0", "fp8"),
    ("kv5", "serve-bf16,kvq=e5m2", "fp8"),
    ("w16-a16-kv5", "serve-fp8,kvq=e5m2", "fp8"),
    ("w64-a64-e8m0-kv5", "serve-fp8,wq=e4m3:64x64,aq=e4m3:64,qscale=e8m0,kvq=e5m2", "fp8"),
    # FP8 reaches k3 ~1e-3 on this model; beyond it, the FP8 engine plus the synthetic `logit_scale` (its logits
    # scaled, i.e. sampling at another temperature), marked as such wherever a dose is reported
    *((f"w16-a16-kv4+logits{s}", f"serve-fp8,logit_scale={s}", "fp8+synthetic") for s in
      ("0.95", "0.9", "0.85", "0.8", "0.75", "0.7", "0.6")),
)


def default_experiment() -> ExperimentConfig:
    """The study's RL settings: the experiment's defaults (two-number Countdown over 1..20 with a 20% held-out
    split, a warm start that prefers a wrong habit, `habit:0.3:/`, so greedy reward has room to rise) with 100
    steps and six seeds."""
    return ExperimentConfig(arms=("aligned",), seeds=(0, 1, 2, 3, 4, 5), steps=100)


@dataclasses.dataclass(frozen=True)
class StudyConfig:
    """The study: RL settings (`experiment`; its arms are replaced by the study's), the fixed trainer policy, the
    candidate engines and target doses, and the calibration batch."""

    experiment: ExperimentConfig = dataclasses.field(default_factory=default_experiment)
    trainer: str = TRAINER
    candidates: tuple[tuple[str, str, str], ...] = CANDIDATES
    targets: tuple[float, ...] = TARGETS
    reject_target: float = REJECT_TARGET
    calibration_problems: int = 64  # x group_size samples each, from the warm start

    def __post_init__(self):
        NumericPolicy.parse(self.trainer)
        for name, engine, _ in self.candidates:
            NumericPolicy.parse(engine)
        if not 0 < self.reject_target < 1:
            raise ValueError(f"reject_target = {self.reject_target}; allowed: 0 < F < 1")

    def to_dict(self) -> dict:
        """JSON-ready settings (arms excluded: they follow from the calibration)."""
        exp = self.experiment.to_dict()
        exp.pop("arms")
        return {"experiment": exp, "trainer": self.trainer, "candidates": [list(c) for c in self.candidates],
                "targets": list(self.targets), "reject_target": self.reject_target,
                "calibration_problems": self.calibration_problems}


# --- calibration ------------------------------------------------------------------------------------------------

def calibrate(model, study: StudyConfig) -> dict:
    """Every candidate engine's gap to the trainer at the warm start, on the task's first training prompts
    (`calibration_problems` problems x group_size samples at temperature 1, as step 1 draws them): k3, k1 and the
    rejection band that rejects `reject_target` of the sequences (geometric: `seq_mean_k1` in [1/u, u])."""
    from jaxalign.engine import Engine
    from jaxalign.metrics.mismatch import mismatch_metrics
    from jaxalign.metrics.routing import routing_metrics
    from jaxalign.model.scoring import token_logprobs
    from jaxalign.rl import tokenizer
    from jaxalign.rl.correction import CorrectionConfig, correct

    exp = study.experiment
    task, trainer = exp.task(), NumericPolicy.parse(study.trainer)
    items = [p for p in task.train_items(0, study.calibration_problems, 0) for _ in range(exp.group_size)]
    prompts = [task.prompt(p) for p in items]
    rows = []
    for name, engine, kind in study.candidates:
        rollout = Engine(model, NumericPolicy.parse(engine)).generate(
            prompts, max_new_tokens=exp.max_new_tokens, temperature=1.0, eos_id=tokenizer.EOS, seed=0)
        logp, record = token_logprobs(model, rollout.tokens, trainer, sampling=rollout.sampling)
        engine_routes = np.asarray(rollout.routing.indices)
        flips = routing_metrics(engine_routes, np.asarray(record.indices),
                                valid=(engine_routes >= 0).all(-1).all(-1))
        lt, le, mask = np.asarray(logp), rollout.logprobs, rollout.mask
        metrics = mismatch_metrics(lt, le, mask)
        seq_k1 = np.abs([np.mean(le[i][mask[i]] - lt[i][mask[i]]) for i in range(len(items)) if mask[i].any()])
        half_width = float(np.quantile(seq_k1, 1.0 - study.reject_target))
        # written with enough digits, rounded outward, so a sequence at the quantile stays inside the band
        band = f"{math.exp(-half_width) * (1 - 1e-9):.12g}_{math.exp(half_width) * (1 + 1e-9):.12g}"
        _, accept, corr = correct(lt, le, mask, CorrectionConfig(is_level="token", rs=(f"seq_mean_k1:{band}",)))
        rows.append({"name": name, "engine": engine, "kind": kind, "k3": metrics["k3_kl"], "kl": metrics["kl"],
                     "max_abs_logp_diff": metrics["max_abs_logp_diff"],
                     "route_flip_rate": flips["route_flip_rate"], "reject_band": band,
                     "rejected_seq_fraction": corr["rollout_corr/rollout_rs_seq_masked_fraction"]})
    return {"trainer": study.trainer, "samples": len(items), "candidates": rows}


def choose_doses(calibration: dict, targets, *, within: float = 2.0) -> list[dict]:
    """For each target k3, the realistic candidate (kind without "synthetic") nearest in log distance when one
    lies within a factor `within` of it, else the nearest candidate of any kind; with its measured k3 and how far
    off it is."""
    usable = [c for c in calibration["candidates"] if c["k3"] > 0]
    distance = lambda c, target: abs(math.log(c["k3"] / target))  # noqa: E731
    doses = []
    for target in targets:
        real = [c for c in usable if "synthetic" not in c["kind"] and distance(c, target) <= math.log(within)]
        best = min(real or usable, key=lambda c: distance(c, target))
        doses.append({"target": target, **best, "off_by": best["k3"] / target})
    return doses


def dose_label(k3: float) -> str:
    """An arm-name-safe label of a dose, e.g. 1.3e-02 -> "k3-1.3e-02"."""
    return f"k3-{k3:.1e}"


def study_arms(study: StudyConfig, doses: list[dict]) -> tuple[str, ...]:
    """The `--arm` strings: aligned; each dose uncorrected; at the seed-regime dose also corrected, R3, the
    random-drop control and aligned-fp8. The first two (aligned, seed-regime uncorrected) are the verdict's."""
    trainer = study.trainer
    regime = min(doses, key=lambda d: abs(math.log(d["k3"] / SEED_REGIME_K3)))
    label = dose_label(regime["k3"])
    arms = ["aligned=" + trainer + "/" + trainer, f"{label}.none={trainer}/{regime['engine']};correction=none"]
    for dose in doses:
        if dose is not regime and dose_label(dose["k3"]) != label:
            arm = f"{dose_label(dose['k3'])}.none={trainer}/{dose['engine']};correction=none"
            if arm not in arms:
                arms.append(arm)
    engine = regime["engine"]
    arms += [f"{label}.corrected={trainer}/{engine};correction=tis:2+rs:seq_mean_k1:{regime['reject_band']}",
             f"{label}.r3={trainer}/{engine};correction=none;replay=r3",
             f"{label}.drop={trainer}/{engine};correction=drop:{regime['rejected_seq_fraction']:.3f}",
             f"{label}.aligned-fp8={aligned_fp8(engine)}/{aligned_fp8(engine)}"]
    return tuple(arms)


def aligned_fp8(engine: str) -> str:
    """`aligned-fp8` with the engine's FP8 granularity (weight blocks, activation tiles, scale format): the fix
    for that engine, trainer and engine on one W8A8 path."""
    policy = NumericPolicy.parse(engine)
    overrides = [f"{k}={getattr(policy, f)}" for k, f in (("wq", "weight_quant"), ("aq", "act_quant"),
                                                          ("qscale", "quant_scale"))
                 if getattr(policy, f) != "none"]
    return ",".join(["aligned-fp8", *overrides])


# --- running ----------------------------------------------------------------------------------------------------

def study_record(study: StudyConfig) -> dict:
    """The study directory's `run.json` (settings, build, host)."""
    return rundir.make_record({"study": study.to_dict()})


def run_study(study: StudyConfig, out_dir: str, *, progress: bool = True, jobs: int = 1,
              only: tuple[str, ...] | None = None) -> dict:
    """Calibrate (once; `calibration.json`), then run every arm and seed (resumable; `only`: those arms, by name),
    then write the report (`write_report`)."""
    with rundir.hold(out_dir, what="study"):  # one command per study directory (reentrant for run_arms)
        return _run_study(study, out_dir, progress=progress, jobs=jobs, only=only)


def _run_study(study, out_dir, *, progress, jobs, only) -> dict:
    from jaxalign.model.config import ModelConfig
    from jaxalign.rl.sft import warm_start

    exp = study.experiment
    rundir.claim(out_dir, study_record(study), what="study")
    path = os.path.join(out_dir, "calibration.json")
    if os.path.exists(path):
        with open(path) as f:
            calibration = json.load(f)
    else:
        model = warm_start(ModelConfig.preset(exp.model), exp.sft, os.path.join(out_dir, "cache"),
                           progress=progress)
        calibration = calibrate(model, study)
        calibration["doses"] = choose_doses(calibration, study.targets)
        with open(path, "w") as f:
            json.dump(calibration, f, indent=2)
    arms = study_arms(study, calibration["doses"])
    exp = dataclasses.replace(exp, arms=arms)
    chosen = tuple(a for a in exp.arms if only is None or a.name in only)
    if only is not None and len(chosen) != len(only):
        raise ValueError(f"--only {list(only)}: allowed arm names {[a.name for a in exp.arms]}")
    run_arms(dataclasses.replace(exp, arms=chosen), out_dir, progress=progress, what="study", jobs=jobs,
             claim=False, order="priority")
    return write_report(out_dir)


def load_runs(out_dir: str) -> tuple[dict, dict, dict]:
    """(settings, calibration, {(arm, seed): rows}) from a study directory's files alone; runs not finished yet
    are left out."""
    with open(os.path.join(out_dir, "run.json")) as f:
        settings = json.load(f)["settings"]["study"]
    with open(os.path.join(out_dir, "calibration.json")) as f:
        calibration = json.load(f)
    return settings, calibration, finished_runs(out_dir, settings["experiment"]["steps"])


def finished_runs(out_dir: str, steps: int) -> dict:
    """{(arm, seed): metrics rows} of every run in an experiment directory (`ARM/seedN/`) that reached `steps`,
    read from its files alone (`rundir.finished_rows`)."""
    runs = {}
    for arm in sorted(os.listdir(out_dir)):
        arm_dir = os.path.join(out_dir, arm)
        if not os.path.isdir(arm_dir) or arm == "cache":
            continue
        for seed_dir in sorted(os.listdir(arm_dir)):
            rows = rundir.finished_rows(os.path.join(arm_dir, seed_dir), steps)
            if rows is not None:
                runs[(arm, int(seed_dir.removeprefix("seed")))] = rows
    return runs


def collapse_step(rows: list[dict], window: int = COLLAPSE_WINDOW, fraction: float = COLLAPSE_FRACTION):
    """The step at which the run collapsed (module docstring), or None."""
    steps = [(r["step"], r["reward_mean"]) for r in rows if r["step"] > 0 and "reward_mean" in r]
    if len(steps) < window:
        return None
    values = np.array([v for _, v in steps])
    trailing = np.convolve(values, np.ones(window) / window, mode="valid")
    best = np.maximum.accumulate(trailing)
    below = trailing < fraction * best
    if not below[-1] or best[-1] <= 0:
        return None
    start = len(below) - 1
    while start > 0 and below[start - 1]:
        start -= 1
    return int(steps[start + window - 1][0])


def run_figures(rows: list[dict]) -> dict:
    """One run's figures: `seed_summary`'s, the final reward as the mean of the last `FINAL_EVALS` evaluations,
    the rise over the warm start and the collapse step."""
    evals = [r["eval_reward"] for r in rows if "eval_reward" in r]
    final = float(np.mean(evals[-FINAL_EVALS:]))
    return {**seed_summary(rows), "final_reward": final, "rise": final - evals[0],
            "collapse_step": collapse_step(rows)}


def study_rows(calibration: dict, runs: dict) -> list[dict]:
    """One row per arm (in the calibration's arm order where known): means and spreads over the finished seeds,
    collapsed seeds, and the tests against the aligned arm."""
    by_arm = {}
    for (arm, seed), rows in sorted(runs.items()):
        by_arm.setdefault(arm, []).append({"seed": seed, **run_figures(rows)})
    doses = {dose_label(d["k3"]): d for d in calibration["doses"]}
    aligned = by_arm.get("aligned")
    out = []
    for arm, per_seed in by_arm.items():
        n = len(per_seed)
        collapsed = [s for s in per_seed if s["collapse_step"] is not None]
        finals = [s["final_reward"] for s in per_seed]
        dose = doses.get(arm.rpartition(".")[0])
        row = {"arm": arm, "engine_kind": dose["kind"] if dose else "aligned",
               "dose_k3": dose["k3"] if dose else 0.0, "seeds": n,
               "gap_k3": float(np.mean([s["mean_k3"] for s in per_seed])),
               **{k: float(np.mean([s[k] for s in per_seed])) for k in
                  ("warm_start_reward", "final_reward", "peak_reward", "rise", "train_reward_end",
                   "rejected_fraction", "route_flip_rate", "mean_grad_norm")},
               "final_reward_std": float(np.std(finals, ddof=1)) if n > 1 else 0.0,
               "collapsed": len(collapsed), "collapsed_seeds": f"{len(collapsed)}/{n}",
               "median_collapse_step": float(np.median([s["collapse_step"] for s in collapsed])) if collapsed
               else None, "per_seed": per_seed}
        if aligned and arm != "aligned":
            a_finals = [s["final_reward"] for s in aligned]
            a_collapsed = sum(s["collapse_step"] is not None for s in aligned)
            row["collapse_p"] = fisher_exact(len(collapsed), n - len(collapsed), a_collapsed,
                                             len(aligned) - a_collapsed)
            row["final_vs_aligned"] = float(np.mean(finals) - np.mean(a_finals))
            row["final_p"] = permutation_p(finals, a_finals)
        out.append(row)
    return out


def verdict(rows: list[dict], seeds_planned: int) -> list[str]:
    """Sentences the data support (generated, never hand-written): collapse reproduced or bounded at each arm
    against aligned, with the tests and the detectable difference."""
    by = {r["arm"]: r for r in rows}
    aligned = by.get("aligned")
    if aligned is None:
        return ["The aligned arm has no finished run yet."]
    out = [f"Aligned: {aligned['collapsed_seeds']} seeds collapsed; held-out reward "
           f"{aligned['warm_start_reward']:.3f} -> {aligned['final_reward']:.3f} (rise {aligned['rise']:+.3f})."]
    for r in rows:
        if r["arm"] == "aligned":
            continue
        n = min(r["seeds"], aligned["seeds"])
        sd = math.sqrt((r["final_reward_std"] ** 2 + aligned["final_reward_std"] ** 2) / 2)
        mdd = detectable_difference(sd, n)
        partial = "" if r["seeds"] >= seeds_planned else f" (only {r['seeds']} of {seeds_planned} seeds so far)"
        if r["collapsed"] >= 4 and r["seeds"] >= 6:
            state = "collapse reproduced"
        elif r["collapsed"] == 0:
            state = "no collapse"
        else:
            state = "some seeds collapsed"
        out.append(f"{r['arm']} (k3 {r['gap_k3']:.1e}){partial}: {state}, {r['collapsed_seeds']} vs aligned's "
                   f"{aligned['collapsed_seeds']} (Fisher p = {r['collapse_p']:.3g}); final reward "
                   f"{r['final_vs_aligned']:+.3f} vs aligned (permutation p = {r['final_p']:.3g}; "
                   f"detectable difference at these seeds ~{mdd:.3f}).")
    return out


COLUMNS = ["arm", "engine_kind", "dose_k3", "gap_k3", "seeds", "warm_start_reward", "final_reward",
           "final_reward_std", "rise", "peak_reward", "collapsed_seeds", "collapse_p", "final_vs_aligned",
           "final_p", "rejected_fraction", "route_flip_rate"]


def write_report(out_dir: str) -> dict:
    """Rebuild `study.json`, `study.md` and the plots from the study directory's files alone (no training)."""
    settings, calibration, runs = load_runs(out_dir)
    rows = study_rows(calibration, runs)
    planned = len(settings["experiment"]["seeds"])
    result = {"settings": settings, "calibration": calibration, "rows": rows, "verdict": verdict(rows, planned),
              "runs_finished": len(runs), "collapse": {"window": COLLAPSE_WINDOW, "fraction": COLLAPSE_FRACTION},
              "code": _record_field(out_dir, "code"), "host": _record_field(out_dir, "host")}
    with open(os.path.join(out_dir, "study.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(out_dir, "study.md"), "w") as f:
        f.write(study_markdown(result))
    result["plots"] = plot_study(runs, out_dir)
    return result


def _record_field(out_dir: str, key: str):
    with open(os.path.join(out_dir, "run.json")) as f:
        return json.load(f).get(key)


def study_markdown(result: dict) -> str:
    """The calibration, the table and the verdict in Markdown."""
    exp = result["settings"]["experiment"]
    cal = "| candidate | kind | k3 at warm start | band for 45% | rejected |\n|---|---|---|---|---|\n" + "".join(
        f"| {c['name']} | {c['kind']} | {report.fmt(c['k3'])} | {c['reject_band']} | "
        f"{report.fmt(c['rejected_seq_fraction'])} |\n" for c in result["calibration"]["candidates"])
    head = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n"
    body = "".join("| " + " | ".join(report.fmt(r.get(c)) for c in COLUMNS) + " |\n" for r in result["rows"])
    return (f"# Seed-regime study: Countdown GRPO, {exp['steps']} steps, seeds {exp['seeds']}\n\n"
            f"Trainer `{result['settings']['trainer']}` in every arm; rewards are greedy held-out rewards under the "
            f"trainer's policy (final = mean of the last {FINAL_EVALS} evaluations); {result['runs_finished']} runs "
            f"finished. Collapse: the trailing {result['collapse']['window']}-step mean of the sampled training "
            f"reward falls below {result['collapse']['fraction']} of its best and stays there.\n\n"
            f"## Doses (measured at the warm start)\n\n{cal}\n## Arms\n\n{head}{body}\n## Verdict\n\n"
            + "".join(f"- {line}\n" for line in result["verdict"]))


def plot_study(runs: dict, out_dir: str) -> list[str]:
    """study_reward.png (held-out reward), study_train_reward.png and study_k3.png: one line per arm (mean over
    its finished seeds), from the per-step rows."""
    from matplotlib.figure import Figure

    panels = [("study_reward.png", "held-out reward (greedy, trainer policy)", "eval_reward"),
              ("study_train_reward.png", "training reward (sampled)", "reward_mean"),
              ("study_k3.png", "trainer-engine k3 (rollout_corr/k3_kl)", "rollout_corr/k3_kl")]
    arms = list(dict.fromkeys(arm for arm, _ in sorted(runs)))
    paths = []
    for name, title, key in panels:
        fig = Figure(figsize=(7, 4))
        ax = fig.subplots()
        for i, arm in enumerate(arms):
            series = [[(r["step"], r[key]) for r in rows if key in r] for (a, _), rows in runs.items() if a == arm]
            steps = [s for s, _ in series[0]]
            mean = np.mean([[v for _, v in s] for s in series], axis=0)
            ax.plot(steps, mean, label=f"{arm} ({len(series)} seeds)", color=f"C{i % 10}")
        if key == "rollout_corr/k3_kl":
            ax.set_yscale("symlog", linthresh=1e-5)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=6)
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=100)
        paths.append(path)
    return paths
