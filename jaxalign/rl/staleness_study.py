"""`jaxalign experiment staleness`: which gap dominates learning at which lag -- the engine's numerics or the
rollouts' staleness.

A grid of arms, lag {0, 1, 2, 4} x engine {aligned-bf16, serve-bf16, serve-fp8}, everything else as the
seed-regime study's (`study.default_experiment`: the same warm start, held-out split, evaluation, steps and
seeds; one trainer policy, `aligned-bf16`, in every arm). Every arm trains with AReaL's decoupled objective
(`RLConfig.max_lag`; the PPO ratio against the proximal policy, the trainer at the current weights) and the
behaviour correction `tis:2` (token IS weights pi_prox / pi_engine, truncated at 2), which sees both gaps at once;
each step's rows split that log ratio into numerics and staleness (`metrics.staleness`).

Two questions, answered from the data alone (`grid_verdict`):
- **In the log ratio**: per arm, the mean numerics k3 and staleness k3 over steps and each part's share.
- **In learning**: at each lag, the lag's effect on the final held-out reward (aligned engine at lag k against
  aligned at lag 0) and each engine's effect at that lag (engine at lag k against aligned at lag k), each with an
  exact permutation p and the smallest difference the seeds can detect. The gap that "dominates learning" at a lag
  is the one whose effect is larger and detectable; when neither is, the data say so.

Like the seed-regime study, everything is in the directory: `run.json` (settings, build, host), each run's
`metrics.jsonl` and `run.json`; `staleness.json`, `staleness.md` and the plots are rebuilt from those files alone
by `jaxalign experiment staleness --out DIR --report`.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from jaxalign import report
from jaxalign.numerics import NumericPolicy
from jaxalign.rl import rundir
from jaxalign.rl.experiment import ExperimentConfig, run_arms
from jaxalign.rl.stats import detectable_difference, permutation_p
from jaxalign.rl.study import TRAINER, default_experiment, finished_runs, run_figures

LAGS = (0, 1, 2, 4)
ENGINES = (("aligned", "aligned-bf16"), ("serve-bf16", "serve-bf16"), ("serve-fp8", "serve-fp8"))
CORRECTION = "tis:2"
BASELINE = "aligned.lag0"
SIGNIFICANT = 0.05  # a permutation p below this calls an effect detectable


@dataclasses.dataclass(frozen=True)
class StalenessConfig:
    """The grid: RL settings (`experiment`; its arms are replaced by the grid's), the trainer policy, the engines
    (name, policy), the lags and the behaviour correction every arm uses."""

    experiment: ExperimentConfig = dataclasses.field(default_factory=default_experiment)
    trainer: str = TRAINER
    engines: tuple[tuple[str, str], ...] = ENGINES
    lags: tuple[int, ...] = LAGS
    correction: str = CORRECTION

    def __post_init__(self):
        NumericPolicy.parse(self.trainer)
        for _, engine in self.engines:
            NumericPolicy.parse(engine)
        if not self.lags or any(not isinstance(k, int) or k < 0 for k in self.lags) or 0 not in self.lags:
            raise ValueError(f"lags = {list(self.lags)}; allowed: ints >= 0 including 0 (the baseline)")
        if self.engines[0][1] != self.trainer:
            raise ValueError(f"the first engine ({self.engines[0][0]}) must be the trainer's policy {self.trainer!r}: "
                             f"it is every lag's baseline")

    def arms(self) -> tuple[str, ...]:
        """The `--arm` strings, `ENGINE.lagK`, the baseline (first engine, lag 0) first."""
        return tuple(f"{name}.lag{k}={self.trainer}/{engine};correction={self.correction};lag={k}"
                     for k in sorted(self.lags) for name, engine in self.engines)

    def to_dict(self) -> dict:
        """JSON-ready settings (the experiment without its arms, which follow from the grid)."""
        exp = self.experiment.to_dict()
        exp.pop("arms")
        return {"experiment": exp, "trainer": self.trainer, "engines": [list(e) for e in self.engines],
                "lags": list(self.lags), "correction": self.correction}


def run_grid(cfg: StalenessConfig, out_dir: str, *, progress: bool = True, jobs: int = 1,
             only: tuple[str, ...] | None = None) -> dict:
    """Run every arm and seed of the grid (resumable; `only`: those arms, by name), then write the report."""
    with rundir.hold(out_dir, what="staleness study"):
        rundir.claim(out_dir, rundir.make_record({"staleness": cfg.to_dict()}), what="staleness study")
        exp = dataclasses.replace(cfg.experiment, arms=cfg.arms())
        chosen = tuple(a for a in exp.arms if only is None or a.name in only)
        if only is not None and len(chosen) != len(only):
            raise ValueError(f"--only {list(only)}: allowed arm names {[a.name for a in exp.arms]}")
        run_arms(dataclasses.replace(exp, arms=chosen), out_dir, progress=progress, what="staleness study",
                 jobs=jobs, claim=False, order="seeds")  # stopped part way, every arm has as many seeds
        return write_grid_report(out_dir)


def _engine_and_lag(arm: str) -> tuple[str, int]:
    name, _, lag = arm.rpartition(".lag")
    return name, int(lag)


def grid_rows(runs: dict) -> list[dict]:
    """One row per arm (engine order, then lag): means over finished seeds of the final reward (mean of the last
    3 evaluations), rise, numerics and staleness k3 and shares; against the baseline, the difference in final
    reward and its permutation p."""
    by_arm = {}
    for (arm, seed), rows in sorted(runs.items()):
        by_arm.setdefault(arm, []).append({"seed": seed, **run_figures(rows), **_median_k3(rows)})
    base = by_arm.get(BASELINE)
    out = []
    for arm, per_seed in by_arm.items():
        engine, lag = _engine_and_lag(arm)
        finals = [s["final_reward"] for s in per_seed]
        mean = lambda key: float(np.mean([s.get(key, np.nan) for s in per_seed]))  # noqa: E731
        row = {"arm": arm, "engine": engine, "lag": lag, "seeds": len(per_seed),
               "warm_start_reward": mean("warm_start_reward"), "final_reward": float(np.mean(finals)),
               "final_reward_std": float(np.std(finals, ddof=1)) if len(finals) > 1 else 0.0,
               "rise": mean("rise"), "numerics_k3": mean("numerics/mean_k3"), "staleness_k3": mean("staleness/mean_k3"),
               "numerics_k3_median": mean("numerics/median_k3"), "staleness_k3_median": mean("staleness/median_k3"),
               "numerics_share": mean("numerics/mean_share"), "staleness_share": mean("staleness/mean_share"),
               "rejected_fraction": mean("rejected_fraction"),
               "collapsed": sum(s["collapse_step"] is not None for s in per_seed), "per_seed": per_seed}
        if base and arm != BASELINE:
            b = [s["final_reward"] for s in base]
            row["final_vs_baseline"] = float(np.mean(finals) - np.mean(b))
            row["final_p"] = permutation_p(finals, b)
        out.append(row)
    return sorted(out, key=lambda r: (r["lag"], [e for e, _ in ENGINES].index(r["engine"])
                                      if r["engine"] in [e for e, _ in ENGINES] else 99))


def _median_k3(rows: list[dict]) -> dict:
    """The median over a run's measured steps of each part's k3: the typical step, where the mean is led by the
    rare step whose update moved a sampled token by nats (k3 is heavy-tailed)."""
    return {f"{part}/median_k3": float(np.median([r[f"{part}/k3_kl"] for r in rows if f"{part}/k3_kl" in r]))
            for part in ("numerics", "staleness") if any(f"{part}/k3_kl" in r for r in rows)}


def _effect(a: dict, b: dict) -> dict:
    """Final reward of arm `a` minus arm `b` over their seeds, the permutation p and the detectable difference."""
    fa = [s["final_reward"] for s in a["per_seed"]]
    fb = [s["final_reward"] for s in b["per_seed"]]
    sd = float(np.sqrt((np.var(fa, ddof=1) + np.var(fb, ddof=1)) / 2)) if min(len(fa), len(fb)) > 1 else 0.0
    return {"difference": float(np.mean(fa) - np.mean(fb)), "p": permutation_p(fa, fb), "seeds": min(len(fa), len(fb)),
            "detectable": detectable_difference(sd, min(len(fa), len(fb))) if sd > 0 else 0.0}


def grid_effects(rows: list[dict]) -> list[dict]:
    """For each lag: the lag's effect (aligned engine at lag k vs lag 0) and each engine's effect at that lag
    (engine at lag k vs the aligned engine at lag k), with their log-ratio k3 parts."""
    by = {(r["engine"], r["lag"]): r for r in rows}
    aligned = ENGINES[0][0]
    out = []
    for lag in sorted({r["lag"] for r in rows}):
        here = by.get((aligned, lag))
        if here is None or (aligned, 0) not in by:
            continue
        entry = {"lag": lag, "lag_effect": _effect(here, by[(aligned, 0)]) if lag else None,
                 "staleness_k3": here["staleness_k3"], "engines": {}}
        for (engine, k), r in by.items():
            if k == lag and engine != aligned:
                entry["engines"][engine] = {**_effect(r, here), "numerics_k3": r["numerics_k3"],
                                            "staleness_k3": r["staleness_k3"], "numerics_share": r["numerics_share"],
                                            "numerics_k3_median": r["numerics_k3_median"],
                                            "staleness_k3_median": r["staleness_k3_median"]}
        out.append(entry)
    return out


def grid_verdict(effects: list[dict]) -> list[str]:
    """Sentences the data support, one per lag: which gap is larger in the log ratio, and which changes learning
    (a detectable effect on the final held-out reward), or that neither does at these seeds."""
    lines = []
    for e in effects:
        parts = []
        for engine, x in e["engines"].items():
            ratio = ("median staleness k3 " + (f"{x['staleness_k3_median'] / x['numerics_k3_median']:.1f}x the "
                                               f"numerics k3" if x["numerics_k3_median"] > 0 else "> 0, numerics 0")
                     if e["lag"] else f"numerics k3 {x['numerics_k3']:.1e}, staleness 0")
            parts.append(f"{engine}: {ratio}; engine effect on final reward {x['difference']:+.3f}{_test(x)}")
        candidates = [(abs(x["difference"]), f"the engine's numerics ({engine})") for engine, x in e["engines"].items()
                      if x["p"] < SIGNIFICANT]
        if e["lag_effect"] is not None:
            lag = e["lag_effect"]
            parts.insert(0, f"the lag alone moves final reward {lag['difference']:+.3f}{_test(lag)}")
            if lag["p"] < SIGNIFICANT:
                candidates.append((abs(lag["difference"]), "staleness"))
        effects = [x for x in e["engines"].values()] + ([e["lag_effect"]] if e["lag_effect"] else [])
        if all(x["seeds"] < 2 for x in effects):
            winner = "with one seed per arm, which gap changes learning cannot be tested yet"
        elif len(candidates) > 1:  # two significant effects measure different things: name both, rank neither
            winner = "both change learning: " + " and ".join(name for _, name in sorted(candidates, reverse=True))
        else:
            winner = (f"{candidates[0][1]} dominates learning" if candidates else
                      "neither gap changes learning detectably at these seeds")
        lines.append(f"Lag {e['lag']}: " + "; ".join(parts) + f". So: {winner}.")
    return lines


def _test(effect: dict) -> str:
    """The permutation p and detectable difference of an effect, or that one seed allows no test."""
    if effect["seeds"] < 2:
        return " (one seed: no test yet)"
    return f" (p = {effect['p']:.3g}, detectable ~{effect['detectable']:.3f})"


COLUMNS = ["arm", "seeds", "warm_start_reward", "final_reward", "final_reward_std", "final_vs_baseline", "final_p",
           "numerics_k3", "staleness_k3", "numerics_k3_median", "staleness_k3_median", "staleness_share",
           "rejected_fraction", "collapsed"]


def write_grid_report(out_dir: str) -> dict:
    """Rebuild `staleness.json`, `staleness.md` and the plots from the directory's files alone (no training)."""
    with open(os.path.join(out_dir, "run.json")) as f:
        record = json.load(f)
    settings = record["settings"]["staleness"]
    runs = finished_runs(out_dir, settings["experiment"]["steps"])
    rows = grid_rows(runs)
    effects = grid_effects(rows)
    result = {"settings": settings, "rows": rows, "effects": effects, "verdict": grid_verdict(effects),
              "runs_finished": len(runs), "code": record.get("code"), "host": record.get("host")}
    with open(os.path.join(out_dir, "staleness.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(out_dir, "staleness.md"), "w") as f:
        f.write(grid_markdown(result))
    result["plots"] = plot_grid(runs, out_dir)
    return result


def grid_markdown(result: dict) -> str:
    """The table and the verdict in Markdown."""
    s, exp = result["settings"], result["settings"]["experiment"]
    head = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n"
    body = "".join("| " + " | ".join(report.fmt(r.get(c)) for c in COLUMNS) + " |\n" for r in result["rows"])
    return (f"# Staleness x numerics: Countdown GRPO, {exp['steps']} steps, seeds {exp['seeds']}\n\n"
            f"Trainer `{s['trainer']}` in every arm; engines {', '.join(e for e, _ in s['engines'])}; lags "
            f"{s['lags']}; decoupled objective with correction `{s['correction']}`. Final = mean of the last 3 "
            f"greedy held-out evaluations under the trainer's policy; k3 parts are means over steps; "
            f"{result['runs_finished']} runs finished.\n\n{head}{body}\n## Verdict\n\n"
            + "".join(f"- {line}\n" for line in result["verdict"]))


def plot_grid(runs: dict, out_dir: str) -> list[str]:
    """staleness_reward.png (held-out reward per arm, mean over seeds) and staleness_split.png (each arm's
    numerics and staleness k3 per step, mean over seeds)."""
    from matplotlib.figure import Figure

    arms = list(dict.fromkeys(arm for arm, _ in sorted(runs)))
    mean_series = lambda arm, key: (  # noqa: E731
        [r["step"] for r in next(rows for (a, _), rows in runs.items() if a == arm) if key in r],
        np.mean([[r[key] for r in rows if key in r] for (a, _), rows in runs.items() if a == arm], axis=0))
    panels = [("staleness_reward.png", "held-out reward (greedy, trainer policy)", (("eval_reward", "-"),), None),
              ("staleness_split.png", "k3 per step: numerics (solid) and staleness (dotted)",
               (("numerics/k3_kl", "-"), ("staleness/k3_kl", ":")), 1e-6)]
    paths = []
    for name, title, series, linthresh in panels:
        fig = Figure(figsize=(7, 4))
        ax = fig.subplots()
        for i, arm in enumerate(arms):
            for key, style in series:
                label = arm if len(series) == 1 else f"{arm} {key.split('/')[0]}"
                ax.plot(*mean_series(arm, key), style, color=f"C{i % 10}", label=label)
        if linthresh:
            ax.set_yscale("symlog", linthresh=linthresh)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=6 if len(series) == 1 else 5, ncol=2)
        fig.tight_layout()
        paths.append(os.path.join(out_dir, name))
        fig.savefig(paths[-1], dpi=100)
    return paths
