"""The seed-regime study: its statistics against scipy, its report rebuilt from files alone, and one tiny real run
(calibration, arms that vary only the engine, parallel runs equal to serial ones)."""

import dataclasses
import json
import os

import numpy as np
import pytest
from scipy import stats as scipy_stats

from jaxalign.numerics import NumericPolicy
from jaxalign.rl import study
from jaxalign.rl.experiment import ExperimentConfig, run_one
from jaxalign.rl.sft import SFTConfig
from jaxalign.rl.stats import detectable_difference, fisher_exact, permutation_p


def test_fisher_exact_matches_scipy_on_every_small_table():
    for a in range(7):
        for b in range(7 - a):
            for c in range(7):
                for d in range(7 - c):
                    ours = fisher_exact(a, b, c, d)
                    theirs = scipy_stats.fisher_exact([[a, b], [c, d]]).pvalue
                    assert ours == pytest.approx(theirs, rel=1e-9, abs=1e-12), (a, b, c, d)
    assert fisher_exact(6, 0, 0, 6) == pytest.approx(0.0021645, rel=1e-4)  # 6/6 collapsed vs 0/6: p = 2/924
    with pytest.raises(ValueError, match=">= 0"):
        fisher_exact(-1, 0, 0, 0)


def test_permutation_p_is_the_exact_two_sided_test():
    rng = np.random.default_rng(0)
    for _ in range(20):
        x, y = rng.normal(0, 1, 6), rng.normal(rng.uniform(-2, 2), 1, 6)
        theirs = scipy_stats.permutation_test((x, y), lambda a, b: np.mean(a) - np.mean(b), permutation_type=
                                              "independent", alternative="two-sided", n_resamples=np.inf).pvalue
        assert permutation_p(x, y) == pytest.approx(theirs, rel=1e-9)
    assert permutation_p([1.0] * 6, [1.0] * 6) == 1.0  # ties: every split is as extreme
    assert permutation_p([0, 0, 0], [1, 1, 1]) == pytest.approx(2 / 20)
    assert detectable_difference(0.05, 6) == pytest.approx(2.8 * 0.05 * np.sqrt(2 / 6))


def _rows(evals, train, k3):
    """Synthetic metrics rows: eval rewards every 10 steps, sampled rewards and k3 every step."""
    rows = [{"step": 0, "eval_reward": evals[0]}]
    for step in range(1, len(train) + 1):
        row = {"step": step, "reward_mean": train[step - 1], "rollout_corr/kl": k3, "rollout_corr/k3_kl": k3,
               "rollout_corr/max_abs_logp_diff": k3 * 10, "rollout_corr/rollout_rs_masked_fraction": 0.0,
               "route_flip_rate": 0.0, "grad_norm": 0.1}
        if step % 10 == 0:
            row["eval_reward"] = evals[step // 10]
        rows.append(row)
    return rows


def test_the_report_is_rebuilt_from_the_files_alone_and_its_verdict_follows_the_data(tmp_path):
    """Six aligned seeds that learn, six uncorrected seeds that climb and collapse: the report counts 6/6 vs 0/6
    (Fisher p = 2/924), the final reward is the mean of the last three evaluations, unfinished runs are left
    out, and the verdict says collapse reproduced."""
    out = tmp_path / "study"
    cfg = study.StudyConfig(experiment=dataclasses.replace(study.default_experiment(), steps=30))
    out.mkdir()
    (out / "run.json").write_text(json.dumps({**study.study_record(cfg)}))
    doses = [{"target": 1e-2, "name": "x", "engine": "serve-fp8", "kind": "fp8", "k3": 1.2e-2, "kl": 0.0,
              "reject_band": "0.9_1.1", "rejected_seq_fraction": 0.45, "off_by": 1.2}]
    (out / "calibration.json").write_text(json.dumps({"candidates": doses, "doses": doses}))
    label = study.dose_label(1.2e-2)
    climb = [0.3 + 0.02 * i for i in range(30)]
    for seed in range(6):
        for arm, evals, train, k3 in (("aligned", [0.3, 0.5, 0.6, 0.7], climb, 0.0),
                                      (f"{label}.none", [0.3, 0.6, 0.2, 0.1], climb[:15] + [0.05] * 15, 0.012)):
            run = out / arm / f"seed{seed}"
            run.mkdir(parents=True)
            (run / "run.json").write_text("{}")
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(evals, train, k3)))
    unfinished = out / f"{label}.r3" / "seed0"
    unfinished.mkdir(parents=True)
    (unfinished / "run.json").write_text("{}")
    (unfinished / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval_reward": 0.3}) + "\n")
    result = study.write_report(str(out))
    rows = {r["arm"]: r for r in result["rows"]}
    assert set(rows) == {"aligned", f"{label}.none"} and result["runs_finished"] == 12
    assert rows["aligned"]["final_reward"] == pytest.approx(0.6) and rows["aligned"]["collapsed_seeds"] == "0/6"
    bad = rows[f"{label}.none"]
    assert bad["collapsed_seeds"] == "6/6" and bad["collapse_p"] == pytest.approx(2 / 924)
    assert bad["final_reward"] == pytest.approx(0.3) and bad["final_p"] == pytest.approx(2 / 924)
    assert bad["gap_k3"] == pytest.approx(0.012) and bad["dose_k3"] == 1.2e-2
    assert any(line.startswith(f"{label}.none") and "collapse reproduced" in line for line in result["verdict"])
    again = json.loads((out / "study.json").read_text())
    assert again["rows"] == json.loads(json.dumps(result["rows"]))
    assert (out / "study_reward.png").exists() and "## Verdict" in (out / "study.md").read_text()


def test_doses_prefer_a_realistic_engine_within_a_factor_two():
    cands = [{"name": n, "kind": k, "k3": v, "engine": "serve-fp8"} for n, k, v in (
        ("fp8", "fp8", 1.1e-3), ("syn-a", "fp8+synthetic", 1.0e-3), ("syn-b", "fp8+synthetic", 6e-3),
        ("syn-c", "fp8+synthetic", 2.6e-2), ("bf16", "bf16", 0.0))]
    doses = study.choose_doses({"candidates": cands}, (1e-3, 1e-2, 3e-2))
    assert [d["name"] for d in doses] == ["fp8", "syn-b", "syn-c"]
    assert doses[0]["off_by"] == pytest.approx(1.1)


def test_study_arms_vary_only_the_engine_except_the_fix():
    doses = [{"target": t, "name": n, "engine": e, "kind": "fp8", "k3": k, "reject_band": "0.98_1.02",
              "rejected_seq_fraction": 0.4375}
             for t, n, e, k in ((1e-3, "a", "serve-fp8,wq=e4m3:64x64,aq=e4m3:64", 9e-4), (1e-2, "b", "serve-fp8", 1.1e-2),
                                (3e-2, "c", "serve-fp8,qscale=e8m0", 2.5e-2))]
    arms = ExperimentConfig(arms=study.study_arms(study.StudyConfig(), doses)).arms
    names = [a.name for a in arms]
    assert names[:2] == ["aligned", "k3-1.1e-02.none"]  # the verdict's pair runs first
    assert {a.trainer for a in arms if "aligned-fp8" not in a.name} == {NumericPolicy.parse("aligned-bf16")}
    by = {a.name: a for a in arms}
    assert by["k3-1.1e-02.corrected"].correction == "tis:2+rs:seq_mean_k1:0.98_1.02"
    assert by["k3-1.1e-02.drop"].correction == "drop:0.438" and by["k3-1.1e-02.r3"].replay == "r3"
    fix = by["k3-1.1e-02.aligned-fp8"]
    assert fix.trainer == fix.engine and fix.engine.weight_quant == NumericPolicy.parse("serve-fp8").weight_quant
    assert "k3-9.0e-04.none" in names and "k3-2.5e-02.none" in names


@pytest.mark.full_matrix(
    cover="tests/test_study.py::test_the_report_is_rebuilt_from_the_files_alone_and_its_verdict_follows_the_data",
    why="the seed-regime study end to end (calibration, jobs=2 == jobs=1); its report is the cover's claim and "
        "the experiment runner it calls is tests/test_staleness_study.py's and tests/test_lowbit_study.py's")
def test_a_tiny_study_calibrates_runs_in_parallel_like_serially_and_reports(tmp_path):
    exp = ExperimentConfig(arms=("aligned",), seeds=(0,), steps=2, prompts_per_step=2, group_size=2,
                           max_new_tokens=16, eval_every=1, eval_problems=8, problem_count=(2, 2), held_out=0.2,
                           sft=SFTConfig(steps=2, problems=64, max_new_tokens=16))
    cfg = study.StudyConfig(experiment=exp, candidates=(("serve-bf16", "serve-bf16", "bf16"),
                                                        ("fp8", "serve-fp8", "fp8")), calibration_problems=2)
    out = str(tmp_path / "study")
    with pytest.raises(ValueError, match="allowed arm names"):
        study.run_study(cfg, out, progress=False, only=("nope",))
    calibration = json.loads(open(os.path.join(out, "calibration.json")).read())
    k3 = {c["name"]: c["k3"] for c in calibration["candidates"]}
    assert k3["fp8"] > k3["serve-bf16"] > 0  # FP8 rollouts are the larger dose
    for c in calibration["candidates"]:  # each band rejects about reject_target of the 4 sequences
        assert abs(c["rejected_seq_fraction"] - 0.45) <= 0.25
    pair = ("aligned", study.dose_label(calibration["doses"][0]["k3"]) + ".none")
    result = study.run_study(cfg, out, progress=False, jobs=2, only=pair)
    assert result["runs_finished"] == 2 and {r["arm"] for r in result["rows"]} == set(pair)
    # the parallel run's rows equal a run in this process, bit for bit
    arm = [a for a in ExperimentConfig(arms=study.study_arms(cfg, calibration["doses"])).arms
           if a.name == pair[1]][0]
    here = run_one(dataclasses.replace(exp, arms=(arm,)), arm, 0, str(tmp_path / "serial"))
    there = [json.loads(line) for line in open(os.path.join(out, pair[1], "seed0", "metrics.jsonl"))]
    assert here == there and any(r.get("rollout_corr/k3_kl", 0) > 0 for r in here)
    assert study.write_report(out)["rows"] == result["rows"]  # --report rebuilds the same table
