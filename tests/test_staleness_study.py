"""The staleness x numerics grid: its verdict follows the data (synthetic runs, report rebuilt from files alone),
its arms vary only the engine and the lag, and one tiny real grid runs and reports."""

import dataclasses
import json

import pytest

from jaxalign.numerics import NumericPolicy
from jaxalign.rl import rundir, staleness_study as grid
from jaxalign.rl.experiment import ExperimentConfig
from jaxalign.rl.sft import SFTConfig


def _rows(evals, numerics, staleness, steps=30):
    """Synthetic metrics rows: eval rewards every 10 steps, sampled rewards and the k3 split every step."""
    rows = [{"step": 0, "eval_reward": evals[0]}]
    for step in range(1, steps + 1):
        row = {"step": step, "reward_mean": 0.5, "rollout_corr/kl": numerics + staleness,
               "rollout_corr/k3_kl": numerics + staleness, "rollout_corr/max_abs_logp_diff": 0.1,
               "rollout_corr/rollout_rs_masked_fraction": 0.0, "route_flip_rate": 0.0, "grad_norm": 0.1,
               "numerics/k3_kl": numerics, "staleness/k3_kl": staleness,
               "numerics/share": numerics / (numerics + staleness) if numerics + staleness else 0.0,
               "staleness/share": staleness / (numerics + staleness) if numerics + staleness else 0.0}
        if step % 10 == 0:
            row["eval_reward"] = evals[step // 10]
        rows.append(row)
    return rows


def test_the_grid_verdict_follows_the_data_and_is_rebuilt_from_the_files_alone(tmp_path):
    """Lag 2 costs the aligned engine 0.2 of final reward on every seed (staleness dominates); at lag 0 the
    serve-bf16 engine changes nothing detectable; at lag 2 its numerics k3 is a tenth of its staleness k3."""
    cfg = grid.StalenessConfig(experiment=dataclasses.replace(grid.default_experiment(), steps=30),
                               engines=grid.ENGINES[:2], lags=(0, 2))
    out = tmp_path / "grid"
    out.mkdir()
    (out / "run.json").write_text(json.dumps(rundir.make_record({"staleness": cfg.to_dict()})))
    jitter = [0.0, 0.01, -0.01, 0.02, -0.02, 0.005]
    for seed, j in enumerate(jitter):
        for arm, final, numerics, staleness in (("aligned.lag0", 0.7, 0.0, 0.0), ("serve-bf16.lag0", 0.7, 1e-4, 0.0),
                                                ("aligned.lag2", 0.4, 0.0, 1e-3), ("serve-bf16.lag2", 0.4, 1e-4, 1e-3)):
            run = out / arm / f"seed{seed}"
            run.mkdir(parents=True)
            (run / "run.json").write_text("{}")
            rows = _rows([0.3, 0.5, final + j, final + j], numerics, staleness)
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = grid.write_grid_report(str(out))
    rows = {r["arm"]: r for r in result["rows"]}
    assert [r["arm"] for r in result["rows"]] == ["aligned.lag0", "serve-bf16.lag0", "aligned.lag2",
                                                  "serve-bf16.lag2"]
    assert rows["aligned.lag2"]["final_vs_baseline"] == pytest.approx(-0.2)  # mean of the last 3 evaluations
    assert rows["serve-bf16.lag2"]["numerics_k3"] == pytest.approx(1e-4)
    assert rows["serve-bf16.lag2"]["staleness_k3"] == pytest.approx(1e-3)
    lag0, lag2 = result["verdict"]
    assert lag0.startswith("Lag 0:") and "neither gap changes learning detectably" in lag0
    assert lag2.startswith("Lag 2:") and "staleness dominates learning" in lag2
    assert "median staleness k3 10.0x the numerics k3" in lag2 and "p = 0.00216" in lag2
    assert rows["serve-bf16.lag2"]["staleness_k3_median"] == pytest.approx(1e-3)
    assert json.loads((out / "staleness.json").read_text())["rows"] == json.loads(json.dumps(result["rows"]))
    assert (out / "staleness_split.png").exists() and "## Verdict" in (out / "staleness.md").read_text()


def test_two_significant_effects_are_both_named_and_neither_is_said_to_dominate():
    """At a lag where staleness (aligned at lag k vs lag 0) and an engine's numerics (that engine vs aligned, both
    at lag k) each move final reward significantly, they measure different things: the verdict names both."""
    def effect(difference, p):
        return {"difference": difference, "p": p, "seeds": 6, "detectable": 0.05}
    engine = {**effect(-0.08, 0.04), "numerics_k3": 3e-3, "staleness_k3": 0.5, "numerics_share": 0.2,
              "numerics_k3_median": 2e-3, "staleness_k3_median": 0.05}
    (line,) = grid.grid_verdict([{"lag": 4, "lag_effect": effect(-0.07, 0.002), "staleness_k3": 0.05,
                                  "engines": {"serve-fp8": engine}}])
    assert line.endswith("So: both change learning: the engine's numerics (serve-fp8) and staleness.")
    assert "dominates" not in line and "median staleness k3 25.0x the numerics k3" in line


def test_grid_arms_vary_only_the_engine_and_the_lag():
    arms = ExperimentConfig(arms=grid.StalenessConfig().arms()).arms
    assert arms[0].name == grid.BASELINE and len(arms) == 12
    assert {a.trainer for a in arms} == {NumericPolicy.parse("aligned-bf16")}
    assert {a.correction for a in arms} == {"tis:2"}
    assert sorted({dict(a.overrides).get("max_lag", 0) for a in arms}) == [0, 1, 2, 4]
    with pytest.raises(ValueError, match="including 0"):
        grid.StalenessConfig(lags=(1, 2))
    with pytest.raises(ValueError, match="baseline"):
        grid.StalenessConfig(engines=(("serve", "serve-bf16"),))


def test_a_tiny_grid_runs_and_splits_the_gap(tmp_path):
    """Three steps at lag 0 and lag 1 with an aligned engine, from a warm start that earns some reward (so the
    updates move the weights): numerics k3 is exactly 0 everywhere, staleness k3 is
    0 at lag 0 and > 0 once a lag-1 batch comes from older weights; the report names both arms."""
    exp = ExperimentConfig(arms=("aligned",), seeds=(0,), steps=3, prompts_per_step=4, group_size=2,
                           max_new_tokens=20, eval_every=3, eval_problems=8, problem_count=(3, 3), held_out=0.2,
                           learning_rate=1e-2, sft=SFTConfig(steps=30, problems=300, max_new_tokens=20))
    cfg = grid.StalenessConfig(experiment=exp, engines=grid.ENGINES[:1], lags=(0, 1))
    result = grid.run_grid(cfg, str(tmp_path / "grid"), progress=False)
    rows = {r["arm"]: r for r in result["rows"]}
    assert set(rows) == {"aligned.lag0", "aligned.lag1"} and result["runs_finished"] == 2
    assert rows["aligned.lag0"]["numerics_k3"] == 0.0 == rows["aligned.lag1"]["numerics_k3"]
    assert rows["aligned.lag0"]["staleness_k3"] == 0.0 < rows["aligned.lag1"]["staleness_k3"]
