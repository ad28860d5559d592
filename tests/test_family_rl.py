"""RL on the families whose layers are not the default model's: `jaxalign experiment countdown --model tiny-<family>`
(GRPO and evaluation; no warm start, to stay fast) runs end to end, and the aligned arm's engine reports the
trainer's logprobs bitwise at every step: rollout KL, k3 and max |dlogp| 0 (issue 53: "RL through experiment
countdown --model tiny-<family> with the aligned arm at KL 0")."""

import json

import pytest

# (model preset, the core case whose engine == trainer bits the aligned arm's KL 0 rests on)
FAMILIES = (
    ("tiny-qwen3.5", "tests/test_deltanet.py::test_aligned_engine_equals_trainer_with_trained_norms_decays_and_conv"),
    ("tiny-gpt-oss", "tests/test_gpt_oss_engine.py::test_aligned_engine_equals_the_trainer_bitwise[static-4]"),
    ("tiny-deepseek-v4", "tests/test_deepseek_v4_engine.py::test_aligned_engine_equals_the_trainer_bitwise[static-4]"),
)


@pytest.mark.slow
@pytest.mark.parametrize("preset", [
    pytest.param(preset, id=preset, marks=pytest.mark.full_matrix(
        cover=cover, why="the aligned arm's KL 0 rests on the family's engine == trainer bits (the cover); the RL "
                         "loop itself is the default model's (tests/test_rl_trainer.py); 1.5-3.5 minutes each"))
    for preset, cover in FAMILIES])
def test_countdown_experiment_runs_on_the_family_with_the_aligned_arm_at_kl_0(tmp_path, preset):
    from jaxalign import cli
    out = tmp_path / "exp"
    code = cli.main(["experiment", "countdown", "--model", preset, "--arm", "aligned", "--steps", "2",
                     "--prompts-per-step", "4", "--group-size", "4", "--eval-every", "2", "--eval-problems", "8",
                     "--sft-steps", "0", "--out", str(out)])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["model"] == preset
    arm = summary["arms"]["aligned"]
    assert arm["steps_with_nonzero_kl"] == 0 and arm["mean_kl"] == 0.0 and arm["max_abs_logp_diff"] == 0.0
    rows = [json.loads(line) for line in (out / "aligned" / "seed0" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("step", 0) > 0 and "rollout_corr/kl" in r]
    assert len(steps) == 2 and all(r["rollout_corr/kl"] == 0.0 and r["rollout_corr/k3_kl"] == 0.0 for r in steps)
    assert all(r["rollout_corr/max_abs_logp_diff"] == 0.0 for r in steps)
