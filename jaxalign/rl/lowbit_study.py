"""`jaxalign experiment lowbit`: the seed's question with real numerics -- low-bit rollouts (MXFP4 experts, FP8),
aligned by quantisation-aware training or not, in an update the gap can reach.

Design (each point answers a flaw of the seed-regime study, `jaxalign.rl.study`, found by auditing its rows):
- **Real formats, no synthetic dose**: one trainer policy (`aligned-bf16`) in every arm but the aligned 4-bit
  one; each engine is that policy plus a real number format's fields and nothing else (`ENGINE_FORMATS`: FP8 =
  DeepSeek-style W8A8 with an FP8 KV cache; MXFP4 = every linear and expert weight in MXFP4 with bf16
  activations, W4A16 as 4-bit serving runs it). The gap is measured on every step, not only at the start.
- **An update the gap can reach**: every arm splits each batch into `MINIBATCHES` disjoint minibatches (one
  optimizer step each, as verl's `ppo_mini_batch_size`), so the PPO ratio leaves 1 after the first and the clip
  acts; the MXFP4 engine is run both decoupled (old policy = the trainer's recomputed logprobs, verl's default)
  and in bypass (old policy = the engine's logprobs, Tunix's and Miles' default), where the ratio carries the
  gap itself.
- **Answers long enough to compound**: Countdown with 3-4 numbers and worked steps before the answer
  (`answer_format=steps`, ~45 tokens), targets a left-to-right chain reaches (`targets=chain`: the 2-layer model
  finds no solution of arbitrary 3-4-number targets often enough for RL to learn), a warm start that teaches the
  format and prefers a wrong habit.
- **Corrections and controls at face value**: verl's default correction (token TIS 2 and the geometric band
  0.999_1.001); a ~45% rejection band re-fitted on every batch (`seq_mean_k1:top:0.45`, the seed's share, no IS);
  and a control that drops exactly that share of sequences at random (`drop:0.45`), so it differs from the
  re-fitted arm only in *which* sequences go.
- **Collapse judged on held-out reward** (`heldout_collapse`: the held-out reward peaked above its warm start and
  its last evaluation is below it), beside the training-reward rule; evaluation greedy under the trainer *and* sampled from the
  arm's engine (`eval_engine_reward`).
- **Statistics**: each arm against the aligned arm -- final held-out reward (exact permutation test) and collapses
  on either rule (Fisher's exact test) -- with Holm's correction across the arms, the smallest p the seeds can
  reach, and the rate of collapse that 0 of n seeds still allows (1 - 0.05^(1/n)).

Everything a figure needs is in the study directory: `run.json` (settings, build, host, git commit), each run's
`metrics.jsonl` and `run.json` (one directory per arm, one per seed); `lowbit.json`, `lowbit.md` and the plots are
rebuilt from those files alone by `jaxalign experiment lowbit --out DIR --report`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess

import numpy as np

from jaxalign import report
from jaxalign.rl import rundir
from jaxalign.rl.experiment import ExperimentConfig, run_arms, seed_summary
from jaxalign.rl.sft import SFTConfig
from jaxalign.rl.stats import detectable_difference, fisher_exact, permutation_p
from jaxalign.rl.study import collapse_step, finished_runs

TRAINER = "aligned-bf16"
# each engine: the trainer's policy plus one real format's fields (and nothing else)
ENGINE_FORMATS = {
    "fp8": "wq=e4m3:16x16,aq=e4m3:16,kvq=e4m3",  # W8A8 in DeepSeek's blocks (scaled to the tiny model), FP8 KV
    # every linear and expert weight in MXFP4, bf16 activations (W4A16, as GPTQ/AWQ-style 4-bit serving quantises
    # every linear layer): k3 ~4e-2 at the warm start, against ~5e-3 for MXFP4 experts alone with FP8 activations
    # and KV cache (docs/lowbit.md, "Choosing the formats")
    "mxfp4": "wq=mxfp4,wq_scope=all",
}
MINIBATCHES = 4
REJECT_SHARE = 0.45  # the seed's rejected share of each batch
FINAL_EVALS = 3  # the final figure: the mean of the last 3 held-out evaluations
ALPHA = 0.05


def engine(fmt: str) -> str:
    """The engine policy of a format: the trainer's policy plus the format's fields."""
    return f"{TRAINER},{ENGINE_FORMATS[fmt]}"


def study_arms() -> tuple[str, ...]:
    """The arms as `--arm` strings (`jaxalign.rl.arms`), the aligned reference first."""
    mx, fp8 = engine("mxfp4"), engine("fp8")
    return (
        f"aligned={TRAINER}/{TRAINER};correction=none",
        f"aligned-mxfp4={mx}/{mx};correction=none",  # quantisation-aware: the trainer's forward runs the format
        f"fp8={TRAINER}/{fp8};correction=none",
        f"mxfp4={TRAINER}/{mx};correction=none",
        f"mxfp4-bypass={TRAINER}/{mx};correction=bypass",
        f"mxfp4-r3={TRAINER}/{mx};correction=none;replay=r3",
        f"mxfp4-verl={TRAINER}/{mx};correction=tis:2+rs:seq_mean_k1:0.999_1.001",
        f"mxfp4-refit45={TRAINER}/{mx};correction=rs:seq_mean_k1:top:{REJECT_SHARE}",
        f"mxfp4-drop45={TRAINER}/{mx};correction=drop:{REJECT_SHARE}",
    )


ALIGNED_ARMS = ("aligned", "aligned-mxfp4")


def default_experiment(seeds=(0, 1, 2, 3, 4, 5), steps: int = 200) -> ExperimentConfig:
    """The study's RL settings: Countdown with 3-4 numbers in 1..5, targets a left-to-right chain of the numbers
    reaches (`countdown.TARGET_KINDS`) and worked steps (held out as the other studies: a hashed 20% split), 16
    problems x 8 samples per step in 4 minibatches at learning rate 5e-4 (2e-3, the one-minibatch studies' rate,
    drove the aligned arm onto the habit within 20 steps: docs/lowbit.md), evaluation every 10 steps (greedy under
    the trainer and sampled from the engine), a warm start that writes the format and prefers, greedily, the
    habit of dividing the numbers in the order given (45% of its traces solve)."""
    return ExperimentConfig(
        arms=study_arms(), seeds=tuple(seeds), steps=steps, model="countdown-steps", answer_format="steps",
        targets="chain", problem_count=(3, 4), max_number=5, max_target=99, max_new_tokens=64,
        minibatches=MINIBATCHES, eval_sampled=True, eval_every=10, eval_problems=256, learning_rate=5e-4,
        sft=SFTConfig(steps=1500, problems=20000, answers="habit:0.45:/", max_new_tokens=64))


def git_commit() -> str | None:
    """The commit of the working tree the study runs from (None outside a git checkout): what a later session
    checks out to resume the grid with the same code fingerprint."""
    try:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        out = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def run_lowbit(exp: ExperimentConfig, out_dir: str, *, progress: bool = True, jobs: int = 1,
               only: tuple[str, ...] | None = None) -> dict:
    """Run (or resume) every arm and seed, seed by seed (so a study stopped part way has whole seeds), then write
    the report. `only`: those arms, by name."""
    chosen = tuple(a for a in exp.arms if only is None or a.name in only)
    if only is not None and len(chosen) != len(only):
        raise ValueError(f"--only {list(only)}: allowed arm names {[a.name for a in exp.arms]}")
    with rundir.hold(out_dir, what="low-bit study"):
        record = rundir.make_record({"lowbit": exp.to_dict()})
        rundir.claim(out_dir, record, what="low-bit study")
        _note_commit(out_dir)
        run_arms(dataclasses.replace(exp, arms=chosen), out_dir, progress=progress, what="low-bit study",
                 jobs=jobs, claim=False, order="seeds")
    return write_report(out_dir)


def _note_commit(out_dir: str) -> None:
    """Record the git commit beside run.json (`commits.json`: every commit the study ran from, in order)."""
    path = os.path.join(out_dir, "commits.json")
    commits = json.load(open(path)) if os.path.exists(path) else []
    commit = git_commit()
    if commit and commit not in commits:
        with open(path, "w") as f:
            json.dump(commits + [commit], f, indent=2)


# --- figures -------------------------------------------------------------------------------------------------------

def heldout_collapse(rows: list[dict]) -> bool:
    """Collapse on held-out reward: the greedy held-out reward rose above its warm start at some evaluation and
    the last evaluation is below the warm start (the seed-regime study's corrected seed 0, 0.258 -> 0.58 ->
    0.194, is one; its training reward stayed above half its best, so the training-reward rule missed it)."""
    evals = [r["eval_reward"] for r in rows if "eval_reward" in r]
    return max(evals[1:-1], default=-math.inf) > evals[0] and evals[-1] < evals[0]


def run_figures(rows: list[dict]) -> dict:
    """One run's figures: `seed_summary`'s, the final greedy and engine-sampled held-out rewards (means of the
    last `FINAL_EVALS` evaluations) and their rise over the warm start, the k3 of the first and last fifth of the
    steps, clip fraction, mean response length and both collapse rules."""
    evals = [r["eval_reward"] for r in rows if "eval_reward" in r]
    sampled = [r["eval_engine_reward"] for r in rows if "eval_engine_reward" in r]
    steps = [r for r in rows if r["step"] > 0]
    fifth = max(1, len(steps) // 5)
    final = float(np.mean(evals[-FINAL_EVALS:]))
    out = {**seed_summary(rows), "final_reward": final, "rise": final - evals[0],
           "k3_first_fifth": float(np.mean([r["rollout_corr/k3_kl"] for r in steps[:fifth]])),
           "k3_last_fifth": float(np.mean([r["rollout_corr/k3_kl"] for r in steps[-fifth:]])),
           "max_k3": float(np.max([r["rollout_corr/k3_kl"] for r in steps])),
           "clip_fraction": float(np.mean([r["clip_fraction"] for r in steps])),
           "steps_clipped": int(sum(r["clip_fraction"] > 0 for r in steps)),
           "response_length": float(np.mean([r["response_length"] for r in steps])),
           "train_collapse_step": collapse_step(rows), "heldout_collapse": heldout_collapse(rows)}
    if sampled:
        out.update(engine_warm_start_reward=sampled[0], engine_final_reward=float(np.mean(sampled[-FINAL_EVALS:])))
    return out


def holm(pvalues: dict) -> dict:
    """Holm's step-down adjusted p-values of a family {name: p} (each adjusted p = max over the steps so far of
    (m - rank) * p, capped at 1)."""
    order = sorted(pvalues, key=lambda k: pvalues[k])
    adjusted, running = {}, 0.0
    for rank, name in enumerate(order):
        running = max(running, min(1.0, (len(order) - rank) * pvalues[name]))
        adjusted[name] = running
    return adjusted


def smallest_p(n: int, m: int) -> float:
    """The smallest two-sided p an exact permutation test of n against m values can give: the most extreme split
    alone, 1 / C(n + m, n), or with its mirror image when n == m, 2 / C(n + m, n) (0.0022 for 6 against 6)."""
    return min(1.0, (2.0 if n == m else 1.0) / math.comb(n + m, n))


def arm_rows(runs: dict, arm_order: list[str]) -> list[dict]:
    """One row per arm: means over its finished seeds, collapses on both rules, and the tests against the aligned
    arm with Holm-adjusted p-values across the arms."""
    by_arm = {}
    for (arm, seed), rows in sorted(runs.items()):
        by_arm.setdefault(arm, []).append({"seed": seed, **run_figures(rows)})
    aligned = by_arm.get("aligned")
    out = []
    for arm in [a for a in arm_order if a in by_arm]:
        per_seed = by_arm[arm]
        n = len(per_seed)
        finals = [s["final_reward"] for s in per_seed]
        row = {"arm": arm, "seeds": n,
               **{k: float(np.mean([s[k] for s in per_seed])) for k in
                  ("warm_start_reward", "final_reward", "peak_reward", "rise", "mean_k3", "k3_first_fifth",
                   "k3_last_fifth", "max_k3", "rejected_fraction", "route_flip_rate", "clip_fraction",
                   "response_length", "train_reward_end")},
               "final_reward_std": float(np.std(finals, ddof=1)) if n > 1 else 0.0,
               "heldout_collapsed": sum(s["heldout_collapse"] for s in per_seed),
               "train_collapsed": sum(s["train_collapse_step"] is not None for s in per_seed),
               "per_seed": per_seed}
        if "engine_final_reward" in per_seed[0]:
            row["engine_final_reward"] = float(np.mean([s["engine_final_reward"] for s in per_seed]))
        row["collapse_bound"] = 1 - ALPHA ** (1 / n) if row["heldout_collapsed"] == 0 else None
        if aligned and arm != "aligned":
            a_finals = [s["final_reward"] for s in aligned]
            a_held = sum(s["heldout_collapse"] for s in aligned)
            row["final_vs_aligned"] = float(np.mean(finals) - np.mean(a_finals))
            row["final_p"] = permutation_p(finals, a_finals)
            row["collapse_p"] = fisher_exact(row["heldout_collapsed"], n - row["heldout_collapsed"], a_held,
                                             len(aligned) - a_held)
            row["smallest_p"] = smallest_p(n, len(aligned))
            sd = math.sqrt((row["final_reward_std"] ** 2 + float(np.std(a_finals, ddof=1) if len(a_finals) > 1
                                                                    else 0.0) ** 2) / 2)
            row["detectable_difference"] = detectable_difference(sd, min(n, len(aligned)))
        out.append(row)
    tested = {r["arm"]: r["final_p"] for r in out if "final_p" in r}
    for name, adjusted in holm(tested).items():
        next(r for r in out if r["arm"] == name)["final_p_holm"] = adjusted
    tested = {r["arm"]: r["collapse_p"] for r in out if "collapse_p" in r}
    for name, adjusted in holm(tested).items():
        next(r for r in out if r["arm"] == name)["collapse_p_holm"] = adjusted
    return out


def verdict(rows: list[dict], seeds_planned: int, steps: int) -> list[str]:
    """Sentences the data support (generated from the rows, never hand-written)."""
    by = {r["arm"]: r for r in rows}
    aligned = by.get("aligned")
    if aligned is None:
        return ["The aligned arm has no finished run yet."]
    out = [f"aligned: held-out reward {aligned['warm_start_reward']:.3f} -> {aligned['final_reward']:.3f} "
           f"(rise {aligned['rise']:+.3f}) over {steps} steps, {aligned['heldout_collapsed']}/{aligned['seeds']} "
           f"seeds collapsed on held-out reward."]
    for r in rows:
        if r["arm"] == "aligned":
            continue
        partial = "" if r["seeds"] >= seeds_planned else f" (only {r['seeds']} of {seeds_planned} seeds so far)"
        significant = r["final_p_holm"] < ALPHA
        bound = (f"; 0/{r['seeds']} collapses bound the collapse rate below {r['collapse_bound']:.0%}"
                 if r["collapse_bound"] is not None else "")
        out.append(
            f"{r['arm']}{partial}: k3 {r['mean_k3']:.1e} (first fifth {r['k3_first_fifth']:.1e}, last "
            f"{r['k3_last_fifth']:.1e}); final held-out reward {r['final_vs_aligned']:+.3f} vs aligned "
            f"(permutation p {r['final_p']:.3g}, Holm {r['final_p_holm']:.3g}: "
            f"{'a difference' if significant else 'no detectable difference'}; smallest attainable p "
            f"{r['smallest_p']:.4f}, detectable difference ~{r['detectable_difference']:.3f}); held-out collapses "
            f"{r['heldout_collapsed']}/{r['seeds']} vs aligned's {aligned['heldout_collapsed']}/{aligned['seeds']} "
            f"(Fisher p {r['collapse_p']:.3g}, Holm {r['collapse_p_holm']:.3g}){bound}.")
    return out


COLUMNS = ["arm", "seeds", "mean_k3", "k3_first_fifth", "k3_last_fifth", "warm_start_reward", "final_reward",
           "final_reward_std", "rise", "engine_final_reward", "final_vs_aligned", "final_p_holm", "heldout_collapsed",
           "train_collapsed", "rejected_fraction", "clip_fraction", "route_flip_rate", "response_length"]


def load(out_dir: str) -> tuple[dict, dict]:
    """(settings, {(arm, seed): rows}) from a study directory's files alone (unfinished runs left out)."""
    with open(os.path.join(out_dir, "run.json")) as f:
        settings = json.load(f)["settings"]["lowbit"]
    return settings, finished_runs(out_dir, settings["steps"])


def write_report(out_dir: str) -> dict:
    """Rebuild `lowbit.json`, `lowbit.md` and the plots from the study directory's files alone (no training)."""
    settings, runs = load(out_dir)
    arm_order = [spec.partition("=")[0] for spec in settings["arms"]]
    rows = arm_rows(runs, arm_order)
    with open(os.path.join(out_dir, "run.json")) as f:
        record = json.load(f)
    commits_path = os.path.join(out_dir, "commits.json")
    result = {"settings": settings, "rows": rows,
              "verdict": verdict(rows, len(settings["seeds"]), settings["steps"]), "runs_finished": len(runs),
              "runs_planned": len(settings["seeds"]) * len(arm_order), "code": record.get("code"),
              "host": record.get("host"),
              "commits": json.load(open(commits_path)) if os.path.exists(commits_path) else []}
    with open(os.path.join(out_dir, "lowbit.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(out_dir, "lowbit.md"), "w") as f:
        f.write(markdown(result))
    result["plots"] = plot(runs, arm_order, out_dir)
    return result


def markdown(result: dict) -> str:
    """The table and the verdict in Markdown."""
    s = result["settings"]
    head = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n"
    body = "".join("| " + " | ".join(report.fmt(r.get(c)) for c in COLUMNS) + " |\n" for r in result["rows"])
    arms = "".join(f"- `{a}`\n" for a in s["arms"])
    return (f"# Low-bit rollouts: Countdown GRPO with worked steps, {s['steps']} steps, seeds {s['seeds']}\n\n"
            f"{result['runs_finished']} of {result['runs_planned']} runs finished. Model `{s['model']}`, "
            f"{s['prompts_per_step']} problems x {s['group_size']} samples per step in {s['minibatches']} "
            f"minibatches. Rewards: held-out, greedy under the trainer (final = mean of the last {FINAL_EVALS} "
            f"evaluations); `engine_final_reward` sampled from the arm's engine. Held-out collapse: peaked above "
            f"the warm start, last evaluation below it. p-values: permutation test against aligned, Holm-adjusted across "
            f"arms.\n\n## Arms\n\n{arms}\n## Results\n\n{head}{body}\n## Verdict\n\n"
            + "".join(f"- {line}\n" for line in result["verdict"]))


def plot(runs: dict, arm_order: list[str], out_dir: str) -> list[str]:
    """lowbit_reward.png (greedy held-out), lowbit_engine_reward.png (sampled from the engine), lowbit_k3.png and
    lowbit_rejected.png: one panel per arm, one line per seed (a collapse is a per-seed event)."""
    from matplotlib.figure import Figure

    panels = [("lowbit_reward.png", "held-out reward (greedy, trainer)", "eval_reward", "linear"),
              ("lowbit_engine_reward.png", "held-out reward (sampled, engine)", "eval_engine_reward", "linear"),
              ("lowbit_k3.png", "trainer-engine k3", "rollout_corr/k3_kl", "symlog"),
              ("lowbit_rejected.png", "rejected token fraction", "rollout_corr/rollout_rs_masked_fraction", "linear")]
    arms = [a for a in arm_order if any(arm == a for arm, _ in runs)]
    paths = []
    for name, title, key, scale in panels:
        cols = 3
        rows_n = max(1, math.ceil(len(arms) / cols))
        fig = Figure(figsize=(4 * cols, 2.8 * rows_n))
        axes = np.atleast_1d(fig.subplots(rows_n, cols, sharex=True, sharey=True)).ravel()
        for ax, arm in zip(axes, arms):
            for (a, seed), rows in sorted(runs.items()):
                if a != arm:
                    continue
                pts = [(r["step"], r[key]) for r in rows if key in r]
                if pts:
                    ax.plot(*zip(*pts), lw=1, label=f"seed {seed}", color=f"C{seed % 10}")
            if scale == "symlog":
                ax.set_yscale("symlog", linthresh=1e-4)
            ax.set_title(arm, fontsize=9)
        for ax in axes[len(arms):]:
            ax.set_visible(False)
        if arms:
            axes[0].legend(fontsize=6)
        fig.suptitle(title)
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=90)
        paths.append(path)
    return paths
