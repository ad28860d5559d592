"""Runs you can trust and arms as data, without training: run directories record and check what produced them,
metrics survive a kill, and `--arm` strings parse into arms that differ only in what they name."""

import dataclasses
import json
import os
import subprocess

import pytest

from jaxalign.rl import rundir
from jaxalign.rl.arms import Arm, parse_arm, parse_arms
from jaxalign.rl.correction import CorrectionConfig, correction_settings
from jaxalign.rl.experiment import ExperimentConfig, experiment_record, run_config, run_experiment


def test_arms_parse_and_differ_only_in_what_they_name():
    exp = ExperimentConfig()
    base = run_config(exp, parse_arm("aligned"), seed=0).to_dict()
    cases = {
        "x=aligned-bf16,kernel=xla/serve-bf16": {"trainer_policy": "aligned-bf16,kernel=xla",
                                                 "engine_policy": "serve-bf16"},
        "x=aligned-bf16/aligned-bf16;replay=r3": {"replay": "r3"},
        "x=aligned-bf16/aligned-bf16,replay=r2": {"replay": "r2"},
        "x=aligned-bf16/aligned-bf16;replay=r3w+index": {"replay": "r3w+index"},
        "x=aligned-bf16/aligned-bf16;correction=bypass": {"mode": "bypass",
                                                          "correction": {"is_level": "none", "rs": ()}},
        "x=aligned-bf16/aligned-bf16;correction=none": {"correction": {"is_level": "none", "rs": ()}},
        "x=aligned-bf16/aligned-bf16;correction=icepop:0.5_2": {"correction": {"is_threshold": "0.5_2",
                                                                               "rs": ()}},
        "x=aligned-bf16/aligned-bf16;correction=seq-tis:3+rs:token_k3:0.1": {
            "correction": {"is_level": "sequence", "is_threshold": "3", "rs": ("token_k3:0.1",)}},
    }
    for text, named in cases.items():
        got = run_config(exp, parse_arm(text), seed=0).to_dict()
        expected = json.loads(json.dumps(base))
        for key, value in named.items():
            if isinstance(value, dict):
                expected[key] = {**expected[key], **value}
            else:
                expected[key] = value
        assert json.loads(json.dumps(got)) == json.loads(json.dumps(expected)), text
    # the defaults are today's arms; the canonical string parses back to the same arm
    assert parse_arm("misaligned") == Arm("misaligned", "train-bf16", "serve-bf16")
    for text in cases:
        assert parse_arm(parse_arm(text).spec()) == parse_arm(text)


def test_correction_none_ignores_the_engine_logprobs():
    mode, cfg = correction_settings("none", CorrectionConfig(rs=("seq_mean_k1:0.999_1.001",)))
    assert mode == "decoupled" and cfg.is_level == "none" and cfg.rs == ()


@pytest.mark.parametrize("texts, needle", [
    (["aligned-bf16/serve-bf16"], "does not parse"),
    (["x=aligned-bf16"], "one '/'"),
    (["x=aligned-bf16/serve-bf16;correction=tiss"], "unknown part 'tiss'"),
    (["x=aligned-bf16/serve-bf16;replay=r4"], "replay 'r4'"),
    (["x=aligned-bf16/nonsense"], "engine policy"),
    (["x=aligned-bf16;replay=r3/serve-bf16"], "after the engine policy"),
    (["x=aligned-bf16/serve-bf16;replay=r3,kernel=xla"], "after the arm options"),
    (["a/b=aligned-bf16/serve-bf16"], "arm name 'a/b'"),
    (["aligned", "aligned=fp32/fp16"], "same directory"),
    (["Mine=fp32/fp16", "mine=fp32/fp32"], "same directory"),
])
def test_bad_arms_are_clear_errors(texts, needle):
    with pytest.raises(ValueError, match=needle):
        parse_arms(texts)


def test_bad_arm_on_the_command_line_fails_before_anything_runs(tmp_path):
    out = tmp_path / "exp"
    proc = subprocess.run(["jaxalign", "experiment", "countdown", "--arm", "x=aligned-bf16/serve-bf16;correction=tiss",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "unknown part 'tiss'" in proc.stderr
    assert not out.exists()


def test_experiment_model_is_a_checked_preset(tmp_path, capsys):
    """`--model` takes a family preset (tiny-glm5: MLA + DSA) and is recorded; an unknown preset and SFT
    settings that cannot draw a batch are refused before the run directory is claimed."""
    from jaxalign import cli
    from jaxalign.rl.sft import SFTConfig
    assert ExperimentConfig(model="tiny-glm5").to_dict()["model"] == "tiny-glm5"
    with pytest.raises(ValueError, match="unknown model preset 'nope'; allowed: .*tiny-glm5"):
        ExperimentConfig(model="nope")
    with pytest.raises(ValueError, match="problems = 50 is fewer than batch_size = 64"):
        ExperimentConfig(model="tiny-glm5", sft=SFTConfig(problems=50))
    out = tmp_path / "exp"
    with pytest.raises(SystemExit) as exit_:
        cli.main(["experiment", "countdown", "--model", "nope", "--out", str(out)])
    assert exit_.value.code == 2 and "unknown model preset 'nope'" in capsys.readouterr().err
    assert not out.exists()


def test_a_changed_setting_on_an_experiment_directory_is_refused(tmp_path):
    out = str(tmp_path / "exp")
    first = ExperimentConfig(steps=3, learning_rate=3e-4)
    rundir.claim(out, experiment_record(first), what="experiment")  # as the first run did
    rundir.claim(out, experiment_record(first), what="experiment")  # the same command again: fine
    with pytest.raises(rundir.RunMismatch, match=r"learning_rate: 0.0003 -> 0.123"):
        run_experiment(dataclasses.replace(first, learning_rate=0.123), out, progress=False)
    with pytest.raises(rundir.RunMismatch, match=r"code: 'build-a' -> "):
        record = json.load(open(os.path.join(out, "run.json")))
        record["code"] = "build-a"
        json.dump(record, open(os.path.join(out, "run.json"), "w"))
        run_experiment(first, out, progress=False)
    assert sorted(os.listdir(out)) == [".lock", "run.json"]  # refused before any work (the lock is taken first)


def test_results_without_a_record_are_refused(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(rundir.RunMismatch, match="no run.json"):
        rundir.claim(str(tmp_path), rundir.make_record({"a": 1}))


def test_resuming_on_another_host_warns_naming_the_difference(tmp_path):
    record = rundir.make_record({"a": 1})
    rundir.claim(str(tmp_path), record)
    other = json.loads(json.dumps(record))
    # an ISA this run is not on (a run under XLA_FLAGS=--xla_cpu_max_isa=SSE4_2 records that one already)
    isa = "AVX2" if record["host"]["isa"].startswith("SSE4_2") else "SSE4_2"
    other["host"]["isa"] = f"{isa} (XLA_FLAGS)"
    assert other["host"]["isa"] != record["host"]["isa"]
    with pytest.warns(UserWarning, match=rf"host.isa: .*-> '{isa} \(XLA_FLAGS\)'"):
        rundir.claim(str(tmp_path), other)


def test_effective_isa_reads_xla_flags_then_the_cpu():
    from jaxalign.numerics.platforms import effective_isa, host_isa
    assert effective_isa("--xla_cpu_max_isa=avx2 --foo", set()) == "AVX2 (XLA_FLAGS)"
    assert effective_isa("--xla_cpu_max_isa=AVX2 --xla_cpu_max_isa=SSE4_2", {"avx2"}) == "SSE4_2 (XLA_FLAGS)"
    assert effective_isa("", {"sse4_2", "avx", "avx2"}) == "AVX2"
    assert effective_isa("", {"sse4_2", "avx512f", "avx2"}) == "AVX512"
    assert effective_isa("", {"sse4_2", "avx512f", "avx2", "amx_tile"}) == "AMX"
    assert host_isa(set()) is None and host_isa({"sse4_2", "fma"}) == "SSE4_2"
    host = rundir.host_info()
    assert {"backend", "jax", "jaxlib", "cpu", "isa"} <= set(host)


def test_metrics_log_keeps_exactly_the_rows_up_to_the_restored_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = rundir.MetricsLog(str(path))
    for step in range(4):
        log.append({"step": step, "x": 0.1 * step})
    with open(path, "a") as f:
        f.write('{"step": 4, "x": 0.')  # torn by a kill
    assert [r["step"] for r in log.resume(2)] == [0, 1, 2]
    assert path.read_text() == "".join(json.dumps({"step": s, "x": 0.1 * s}) + "\n" for s in range(3))
    assert [r["step"] for r in log.resume(0)] == [0]


def test_collapse_is_a_lasting_fall_below_half_the_best_trailing_reward():
    from jaxalign.rl.study import collapse_step
    rise = [0.2] * 10 + [0.8] * 20
    assert collapse_step([{"step": i + 1, "reward_mean": r} for i, r in enumerate(rise)]) is None
    fall = rise + [0.1] * 20
    step = collapse_step([{"step": i + 1, "reward_mean": r} for i, r in enumerate(fall)])
    # the trailing 10-step mean first drops below 0.4 (half of 0.8) once six 0.1s are in the window
    assert step == 30 + 6
    dip = rise + [0.1] * 10 + [0.8] * 10  # recovered: not a collapse
    assert collapse_step([{"step": i + 1, "reward_mean": r} for i, r in enumerate(dip)]) is None
