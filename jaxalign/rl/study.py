"""`jaxalign experiment countdown --study gap`: what a trainer/engine gap of a given size does to learning.

A ladder of (trainer, engine) policy pairs from aligned to increasingly coarse engine numerics, each run with
the correction off (`correction=none`: the PPO ratio against the trainer's recomputed logprobs, the engine's
ignored) and on (token TIS 2 + verl's geometric rejection sampling); the aligned rung runs once, because there
every IS weight is exactly 1 and nothing is rejected, so the corrected run would repeat it bit for bit. Every arm
runs every seed from the same warm start, resumably (the experiment's run directories). Output: `study.json`,
`study.md` (a table) and plots of each outcome against the measured gap (mean k3 over the run).

Collapse (a definition, used for `collapse_step`): the sampled training reward, as a trailing mean over
`COLLAPSE_WINDOW` steps, falls below `COLLAPSE_FRACTION` of its best value so far and stays below it to the end of
the run; the step where that last fall happens. None: no collapse.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from jaxalign import report
from jaxalign.rl.experiment import ExperimentConfig, run_arms, seed_summary

STUDY_STEPS = 200  # `jaxalign experiment countdown --study gap` defaults: long runs, three seeds
STUDY_SEEDS = (0, 1, 2)
COLLAPSE_WINDOW = 10
COLLAPSE_FRACTION = 0.5
CORRECTED = "tis:2+rs:seq_mean_k1:0.999_1.001"
# (rung, trainer policy, engine policy), in order of increasing gap
LADDER = (
    ("aligned", "aligned-bf16", "aligned-bf16"),
    ("serve-bf16", "train-bf16", "serve-bf16"),
    ("bf16-acc", "train-bf16", "serve-bf16,matmul=bf16,combine_acc=bf16"),
    ("fp16", "fp16", "fp16,dispatch=sorted,attn=chunked:16"),
    ("coarse", "train-bf16", "serve-bf16,matmul=bf16,combine_acc=bf16,attn_scores=bf16,attn_softmax=bf16,"
                             "router_softmax=bf16"),
)


def ladder_arms() -> tuple[str, ...]:
    """The study's `--arm` strings: every rung without and with correction (the aligned rung once)."""
    arms = []
    for rung, trainer, engine in LADDER:
        arms.append(f"{rung}.none={trainer}/{engine};correction=none")
        if rung != "aligned":
            arms.append(f"{rung}.corrected={trainer}/{engine};correction={CORRECTED}")
    return tuple(arms)


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


def study_rows(runs: dict, exp: ExperimentConfig) -> list[dict]:
    """One row per arm: means (and spreads) over seeds of the outcome figures, collapsed seeds and the median
    collapse step, against the measured gap."""
    rows = []
    for arm in exp.parsed_arms():
        per_seed = []
        for seed in exp.seeds:
            rows_ = runs[(arm.name, seed)]
            per_seed.append({**seed_summary(rows_), "collapse_step": collapse_step(rows_)})
        collapses = [s["collapse_step"] for s in per_seed if s["collapse_step"] is not None]
        mean = lambda key: float(np.mean([s[key] for s in per_seed]))  # noqa: E731
        std = lambda key: float(np.std([s[key] for s in per_seed], ddof=1)) if len(per_seed) > 1 else 0.0  # noqa
        rung, _, correction = arm.name.partition(".")
        rows.append({"arm": arm.name, "rung": rung, "correction": correction or arm.correction,
                     "trainer": arm.trainer.compact(), "engine": arm.engine.compact(), "gap_k3": mean("mean_k3"),
                     "warm_start_reward": mean("warm_start_reward"), "final_reward": mean("final_reward"),
                     "final_reward_std": std("final_reward"), "peak_reward": mean("peak_reward"),
                     "collapsed_seeds": f"{len(collapses)}/{len(per_seed)}",
                     "median_collapse_step": float(np.median(collapses)) if collapses else None,
                     "rejected_fraction": mean("rejected_fraction"), "mean_grad_norm": mean("mean_grad_norm"),
                     "route_flip_rate": mean("route_flip_rate"), "per_seed": per_seed})
    return rows


COLUMNS = ["arm", "gap_k3", "warm_start_reward", "final_reward", "final_reward_std", "peak_reward",
           "collapsed_seeds", "median_collapse_step", "rejected_fraction", "mean_grad_norm", "route_flip_rate"]


def run_study(exp: ExperimentConfig, out_dir: str, *, progress: bool = True, arms=None) -> dict:
    """Run the gap study (the ladder, or `arms` when given) with `exp`'s other settings; resumable. Writes and
    returns {"config", "rows", "plots"}."""
    exp = dataclasses.replace(exp, arms=tuple(arms) if arms else ladder_arms())
    runs = run_arms(exp, out_dir, progress=progress, what="gap study")
    result = {"config": exp.to_dict(), "rows": study_rows(runs, exp),
              "collapse": {"window": COLLAPSE_WINDOW, "fraction": COLLAPSE_FRACTION}}
    with open(os.path.join(out_dir, "study.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(out_dir, "study.md"), "w") as f:
        f.write(study_markdown(result))
    result["plots"] = plot_study(result["rows"], out_dir)
    return result


def study_markdown(result: dict) -> str:
    """The study's table in Markdown, with what was run and the collapse definition."""
    cfg = result["config"]
    head = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n"
    body = "".join("| " + " | ".join(report.fmt(r.get(c)) for c in COLUMNS) + " |\n" for r in result["rows"])
    return (f"# Gap study: Countdown GRPO, {cfg['steps']} steps, seeds {cfg['seeds']}\n\n"
            f"gap_k3 = mean trainer-engine k3 over the run's steps; rewards are greedy held-out rewards (means over "
            f"seeds); collapse = the trailing {result['collapse']['window']}-step mean of the sampled training "
            f"reward falls below {result['collapse']['fraction']} of its best so far and stays there.\n\n"
            + head + body)


def plot_study(rows: list[dict], out_dir: str) -> list[str]:
    """study_<outcome>.png: each outcome against the measured gap, uncorrected (o) and corrected (^) arms."""
    from matplotlib.figure import Figure

    outcomes = [("final_reward", "final held-out reward"), ("peak_reward", "peak held-out reward"),
                ("median_collapse_step", "median collapse step (collapsed seeds)"),
                ("rejected_fraction", "rejected token fraction"), ("mean_grad_norm", "mean gradient norm")]
    paths = []
    for key, title in outcomes:
        fig = Figure(figsize=(5, 3.5))
        ax = fig.subplots()
        for row in rows:
            if row[key] is None:
                continue
            x = max(row["gap_k3"], 1e-12)  # the aligned arm's gap is exactly 0: drawn at the axis floor
            ax.scatter([x], [row[key]], marker="^" if row["correction"] == "corrected" else "o")
            ax.annotate(row["arm"], (x, row[key]), fontsize=6)
        ax.set_xscale("log")
        ax.set_xlabel("measured gap: mean k3 (aligned at 1e-12)")
        ax.set_title(title)
        fig.tight_layout()
        path = os.path.join(out_dir, f"study_{key}.png")
        fig.savefig(path, dpi=100)
        paths.append(path)
    return paths
