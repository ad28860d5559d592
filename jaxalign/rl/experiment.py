"""The seed experiment: the same RL task run in arms that differ only in whether trainer and engine compute
token probabilities the same way.

- `aligned`: `aligned-bf16` on both sides.
- `misaligned`: `train-bf16` trainer, `serve-bf16` engine, protected by verl-style safeguards (token-level TIS
  and rejection sampling; thresholds configurable).

Both arms start from the same SFT warm start, see the same problems and sampling seeds, and use the same
algorithm settings. Writes per arm and seed `metrics.jsonl` (+ TensorBoard and checkpoints), and at the top
`summary.json`, `summary.md` and PNG plots.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from jaxalign import report
from jaxalign.model.config import ModelConfig
from jaxalign.rl.correction import CorrectionConfig
from jaxalign.rl.sft import SFTConfig, warm_start
from jaxalign.rl.trainer import RLConfig, Trainer

ARMS = {
    "aligned": ("aligned-bf16", "aligned-bf16"),
    "misaligned": ("train-bf16", "serve-bf16"),
}
DEFAULT_RS = ("seq_mean_k1:0.999_1.001",)  # verl's "geometric" rejection sampling


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """What `jaxalign experiment countdown` runs."""

    arms: tuple[str, ...] = ("aligned", "misaligned")
    seeds: tuple[int, ...] = (0,)
    steps: int = 30
    model: str = "countdown"
    prompts_per_step: int = 8
    group_size: int = 4
    max_new_tokens: int = 24
    learning_rate: float = 3e-4
    is_threshold: str = "2.0"
    rs: tuple[str, ...] = DEFAULT_RS
    eval_every: int = 5
    eval_problems: int = 64
    sft: SFTConfig = SFTConfig()
    trainer_mesh: str = ""  # e.g. "data=2,expert=2,tensor=2"; "" = one device
    engine_mesh: str = ""

    def __post_init__(self):
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown or not self.arms:
            raise ValueError(f"arms {list(self.arms)}; allowed: {', '.join(ARMS)}")
        if not self.seeds:
            raise ValueError("at least one seed is needed")


def run_config(exp: ExperimentConfig, arm: str, seed: int) -> RLConfig:
    """The RLConfig of one arm and seed: identical across arms except the two policies."""
    from jaxalign.rl.grpo import GRPOConfig
    trainer, engine = ARMS[arm]
    return RLConfig(trainer_policy=trainer, engine_policy=engine, steps=exp.steps,
                    prompts_per_step=exp.prompts_per_step, max_new_tokens=exp.max_new_tokens,
                    learning_rate=exp.learning_rate, grpo=GRPOConfig(group_size=exp.group_size),
                    correction=CorrectionConfig(is_threshold=exp.is_threshold, rs=tuple(exp.rs)), seed=seed,
                    eval_every=exp.eval_every, eval_problems=exp.eval_problems,
                    checkpoint_every=max(1, exp.steps // 3), trainer_mesh=exp.trainer_mesh,
                    engine_mesh=exp.engine_mesh)


def run_experiment(exp: ExperimentConfig, out_dir: str, *, progress: bool = True) -> dict:
    """Run every arm and seed (resuming finished or interrupted runs), then write the summary and plots."""
    os.makedirs(out_dir, exist_ok=True)
    model_config = ModelConfig.preset(exp.model)
    base = warm_start(model_config, exp.sft, os.path.join(out_dir, "cache"), progress=progress)
    base_state = _snapshot(base)
    runs = {}
    for arm in exp.arms:
        for seed in exp.seeds:
            _restore(base, base_state)  # every arm and seed starts from the same warm start
            trainer = Trainer(base, run_config(exp, arm, seed), os.path.join(out_dir, arm, f"seed{seed}"))
            runs[(arm, seed)] = trainer.run(progress=progress)
    summary = summarize(runs, exp)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(summary_markdown(summary))
    summary["plots"] = plot(runs, out_dir)
    return summary


def _snapshot(model):
    from flax import nnx
    import jax
    return jax.tree.map(lambda x: x, nnx.state(model))


def _restore(model, state):
    from flax import nnx
    nnx.update(model, state)


def summarize(runs: dict, exp: ExperimentConfig) -> dict:
    """Per arm: final and peak held-out reward, mean KL / k3, rejected fraction and route flip rate (means over
    seeds), plus the warm-start reward."""
    arms = {}
    for arm in exp.arms:
        per_seed = []
        for seed in exp.seeds:
            rows = runs[(arm, seed)]
            evals = [r["eval_reward"] for r in rows if "eval_reward" in r]
            steps = [r for r in rows if r["step"] > 0 and "rollout_corr/kl" in r]
            per_seed.append({
                "seed": seed, "warm_start_reward": evals[0], "final_reward": evals[-1], "peak_reward": max(evals),
                "mean_kl": float(np.mean([r["rollout_corr/kl"] for r in steps])),
                "mean_k3": float(np.mean([r["rollout_corr/k3_kl"] for r in steps])),
                "max_abs_logp_diff": float(np.max([r["rollout_corr/max_abs_logp_diff"] for r in steps])),
                "rejected_fraction": float(np.mean([r["rollout_corr/rollout_rs_masked_fraction"] for r in steps])),
                "route_flip_rate": float(np.mean([r["route_flip_rate"] for r in steps])),
                "steps_with_nonzero_kl": int(sum(r["rollout_corr/k3_kl"] != 0 or r["rollout_corr/kl"] != 0
                                                 for r in steps)),
            })
        keys = [k for k in per_seed[0] if k != "seed"]
        arms[arm] = {"policies": dict(zip(("trainer", "engine"), ARMS[arm])),
                     **{k: float(np.mean([s[k] for s in per_seed])) for k in keys}, "per_seed": per_seed}
    return {"config": json.loads(json.dumps(dataclasses.asdict(exp))), "arms": arms}


SUMMARY_COLUMNS = ["arm", "warm_start_reward", "final_reward", "peak_reward", "mean_kl", "mean_k3",
                   "max_abs_logp_diff", "rejected_fraction", "route_flip_rate", "steps_with_nonzero_kl"]


def summary_markdown(summary: dict) -> str:
    """The summary as a Markdown table."""
    rows = [{"arm": arm, **vals} for arm, vals in summary["arms"].items()]
    head = "| " + " | ".join(SUMMARY_COLUMNS) + " |\n|" + "---|" * len(SUMMARY_COLUMNS) + "\n"
    body = "".join("| " + " | ".join(report.fmt(r.get(c)) for c in SUMMARY_COLUMNS) + " |\n" for r in rows)
    cfg = summary["config"]
    return (f"# Countdown: aligned vs misaligned\n\n{cfg['steps']} steps, seeds {cfg['seeds']}, "
            f"{cfg['prompts_per_step']} problems x {cfg['group_size']} samples per step, model `{cfg['model']}`. "
            f"Rewards are greedy held-out rewards on {cfg['eval_problems']} problems; KL / k3 / rejected "
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
    for name, title, key in panels:
        fig = Figure(figsize=(6, 3.5))
        ax = fig.subplots()
        for (arm, seed), rows in runs.items():
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", markersize=3, label=f"{arm} seed {seed}",
                        color="tab:blue" if arm == "aligned" else "tab:red", alpha=0.8)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=100)
        paths.append(path)
    return paths
