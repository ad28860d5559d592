"""The low-bit study (jaxalign.rl.lowbit_study): arms that differ only in real formats, the answer format with
worked steps, the re-fitted band and its random-drop control, the statistics, and a short run end to end with
its report rebuilt from the files alone. The study itself is a command (`jaxalign experiment lowbit`), its data
in docs/lowbit/ (the first design's runs in docs/lowbit-first/)."""

import dataclasses
import json
import math
import os

import numpy as np
import pytest

from jaxalign.numerics import NumericPolicy
from jaxalign.rl import countdown, lowbit_study
from jaxalign.rl.correction import CorrectionConfig, correct
from jaxalign.rl.sft import SFTConfig
from jaxalign.rl.task import CountdownTask

FORMAT_FIELDS = {"weight_quant", "quant_scope", "act_quant", "kv_quant"}


def test_engines_differ_from_the_trainer_only_in_number_formats():
    exp = lowbit_study.default_experiment()
    assert len(exp.arms) >= 7 and len(exp.seeds) >= 6 and exp.steps >= 200 and exp.minibatches > 1
    trainer = NumericPolicy.preset(lowbit_study.TRAINER)
    for arm in exp.arms:
        assert arm.engine.logit_scale == 1.0  # no synthetic dose
        assert {f for f, _, _ in arm.engine.diff(trainer)} <= FORMAT_FIELDS, arm.spec()
        if arm.name in lowbit_study.ALIGNED_ARMS:
            assert arm.trainer == arm.engine
        else:
            assert arm.trainer == trainer and arm.engine != trainer


def test_worked_steps_answers_are_long_and_scored_as_tinyzero_scores_the_answer():
    task = CountdownTask(count=(3, 4), high=9, answer_format="steps", held_out=0.2)
    problems = task.train_items(0, 200, 0)
    lengths = [len(countdown.completion_text(p.solution, "steps")) + 1 for p in problems]  # + eos
    assert np.mean(lengths) >= 32
    p = problems[0]
    from jaxalign.rl import tokenizer
    good = tokenizer.encode(countdown.completion_text(p.solution, "steps"), eos=True)
    assert task.reward(p, good) == 1.0
    assert task.prompt(p)[-1] == tokenizer.encode(":")[0]  # the completion opens the answer tag itself
    wrong_steps = tokenizer.encode("1+1=3 " + countdown.OPEN + p.solution + countdown.CLOSE)
    assert task.reward(p, wrong_steps) == 1.0  # the steps are the model's own business, as TinyZero's <think>
    assert task.reward(p, tokenizer.encode("1+1=2")) == 0.0  # no answer
    assert countdown.worked_steps("12/(8-5)*4") == "8-5=3 12/3=4 4*4=16"
    assert countdown.worked_steps("(9/4+3)*8") == "9/4=9/4 9/4+3=21/4 21/4*8=42"
    with pytest.raises(ValueError, match="answer_format"):
        CountdownTask(answer_format="cot")


def test_refitted_band_rejects_the_share_its_control_drops_at_random():
    rng = np.random.default_rng(0)
    for rows in (8, 32, 128):
        lo = rng.normal(0, 0.05, (rows, 20)).astype(np.float32)
        mask = rng.random((rows, 20)) < 0.8
        mask[:, 0] = True
        _, kept, m = correct(lo, np.zeros_like(lo), mask, CorrectionConfig(is_level="none",
                                                                          rs=("seq_mean_k1:top:0.45",)))
        _, dropped, d = correct(lo, np.zeros_like(lo), mask, CorrectionConfig(is_level="none", random_drop=0.45))
        share = m["rollout_corr/rollout_rs_seq_masked_fraction"]
        assert share == d["rollout_corr/rollout_rs_seq_masked_fraction"] == round(0.45 * rows) / rows
        # the band keeps the sequences nearest the engine: every rejected one is at least as far as every kept one
        seq = np.abs((lo * mask).sum(1) / mask.sum(1))
        rejected = ~kept.any(1)
        assert seq[rejected].min() >= seq[~rejected].max()
        assert m["rollout_corr/rollout_rs_seq_mean_k1_fitted_band"] == pytest.approx(math.exp(seq[~rejected].max()))
    with pytest.raises(ValueError, match="top:F"):
        CorrectionConfig(rs=("seq_mean_k1:top:1.5",))
    with pytest.raises(ValueError, match="sequence rules"):
        CorrectionConfig(rs=("token_k1:top:0.4",))


def test_statistics():
    assert lowbit_study.smallest_p(6, 6) == pytest.approx(2 / 924)
    assert lowbit_study.smallest_p(6, 5) == pytest.approx(1 / 462)
    assert lowbit_study.holm({"a": 0.01, "b": 0.04, "c": 0.03}) == pytest.approx({"a": 0.03, "b": 0.06, "c": 0.06})
    rise_and_fall = [{"step": s, "eval_reward": v} for s, v in enumerate([0.3, 0.5, 0.4, 0.2, 0.2, 0.25])]
    assert lowbit_study.heldout_collapse(rise_and_fall)
    assert not lowbit_study.heldout_collapse([{"step": s, "eval_reward": v} for s, v in
                                              enumerate([0.3, 0.5, 0.4, 0.35, 0.3, 0.33])])
    assert not lowbit_study.heldout_collapse([{"step": s, "eval_reward": v} for s, v in
                                              enumerate([0.3, 0.2, 0.1, 0.1])])  # never rose: no peak
    # the seed-regime study's corrected seed 0, which the training-reward rule called healthy
    from jaxalign.rl.study import collapse_step, finished_runs
    study = os.path.join(os.path.dirname(__file__), "..", "docs", "study")
    seed0 = finished_runs(study, 100)[("k3-1.3e-02.corrected", 0)]
    assert lowbit_study.heldout_collapse(seed0) and collapse_step(seed0) is None


@pytest.mark.slow
@pytest.mark.full_matrix(
    cover="tests/test_lowbit_study.py::test_refitted_band_rejects_the_share_its_control_drops_at_random",
    why="the study end to end (two minutes on 2 cores): its band and control, formats and statistics have core cases")
def test_a_short_study_runs_resumes_and_reports_from_its_files(tmp_path):
    """Two steps of the re-fitted band and its random-drop control from a quick warm start: the control drops
    exactly the band's share at every step, the engine's k3 is measured on every step, both evaluations are
    made, and `--report` rebuilds the table from the directory alone. (The aligned arms' k3 of exactly 0 is the
    aligned presets' engine == trainer claim: tests/test_lowbit.py, tests/test_rl_trainer.py.)"""
    exp = dataclasses.replace(
        lowbit_study.default_experiment(seeds=(0,), steps=2), prompts_per_step=4, group_size=4, minibatches=2,
        eval_every=2, eval_problems=8,
        sft=SFTConfig(steps=30, problems=300, answers="habit:0.3:/", max_new_tokens=64, batch_size=32))
    only = ("mxfp4-refit45", "mxfp4-drop45")
    out = tmp_path / "lowbit"
    result = lowbit_study.run_lowbit(exp, str(out), progress=False, only=only)
    assert [r["arm"] for r in result["rows"]] == list(only) and result["runs_finished"] == 2
    runs = lowbit_study.load(str(out))[1]
    refit, drop = runs[("mxfp4-refit45", 0)], runs[("mxfp4-drop45", 0)]
    for a, b in zip(refit[1:], drop[1:]):
        assert a["rollout_corr/rollout_rs_seq_masked_fraction"] == b["rollout_corr/rollout_rs_seq_masked_fraction"]
        assert a["rollout_corr/rollout_rs_seq_masked_fraction"] > 0.4
    assert all(r["rollout_corr/k3_kl"] > 0.0 for r in refit[1:])
    assert "eval_engine_reward" in refit[0] and "eval_engine_reward" in refit[-1]
    assert json.loads((out / "commits.json").read_text())  # the commit a later session resumes from
    again = lowbit_study.write_report(str(out))
    assert again["rows"] == json.loads(json.dumps(result["rows"]))
    assert (out / "lowbit.md").read_text().count("| mxfp4") == 2 and (out / "lowbit_k3.png").exists()
