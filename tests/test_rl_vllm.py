"""RL with vLLM rollouts: an arm's ENGINE may be `vllm[:DTYPE]`. The trainer syncs vLLM to its weights before every
batch vLLM generates, every sync is verified against a fresh load (and counted in the rows and engine.json), and a
SIGKILLed run leaves no vLLM process behind and resumes. The settings vLLM cannot serve are refused by name
without vLLM; the runs need its virtualenv (`jaxalign vllm install`): without it they skip naming that command,
except under CI (CI=true), where they fail."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from jaxalign.engines import VllmSpec
from jaxalign.engines.vllm import install

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _need_vllm() -> None:
    if install.installed() is None:
        reason = f"vLLM is not installed in {install.venv_dir()}: run `{install.INSTALL_COMMAND}`"
        if os.environ.get("CI"):
            pytest.fail(reason + " (the README's test command does)")
        pytest.skip(reason)


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command (state, ppid, pgrp, session, ...), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _vllm_workers_of(parent: int) -> list[int]:
    """The running vLLM workers `parent` started (each leads its own session)."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        fields = _stat(int(name))
        if fields and fields[0] != "Z" and int(fields[1]) == parent:
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if b"worker.py" in f.read():
                        found.append(int(name))
            except OSError:
                continue
    return found


def _alive_in_sessions(sessions: set[int]) -> list[int]:
    """Running (not zombie) processes of any of `sessions`."""
    return [int(n) for n in filter(str.isdigit, os.listdir("/proc"))
            if (f := _stat(int(n))) and f[0] != "Z" and int(f[3]) in sessions]


def _complete_rows(path) -> list[dict]:
    """The rows of a metrics.jsonl a running process is writing: its complete lines ([] before it exists)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.split("\n")[:-1]]


def _rows(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def check_vllm_run(run_dir, steps: int) -> list[dict]:
    """The must-show claims on a finished run with a vLLM engine: one row per step 0..steps; every training row
    carries rollout_corr/k3_kl > 0, none more than 10x the first batch's (a stale or faulty sync shows as a growing
    gap); every row counts its syncs, all verified -- one before each batch after the first, in a resumed run too
    (its engine opens at the checkpoint's weights, and that load, verified as a sync is, counts as the sync the
    uninterrupted run made there); engine.json names vLLM and says every sync was verified."""
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(steps + 1))
    train = rows[1:]
    k3 = [r["rollout_corr/k3_kl"] for r in train]
    assert all(v > 0 for v in k3), k3
    assert max(k3) <= 10 * k3[0], k3
    assert all(r["route_flip_rate"] is None for r in train)  # vLLM on the CPU records no routing
    syncs = [r["engine_syncs"] for r in train]
    assert syncs == [0] + [1] * (steps - 1), syncs
    assert all(r["engine_syncs_verified"] == r["engine_syncs"] for r in train)
    with open(os.path.join(run_dir, "engine.json")) as f:
        record = json.load(f)
    assert record["engine"]["name"] == "vllm" and record["engine"]["version"] == install.VLLM_VERSION
    assert record["engine"]["numerics"] == "vllm:bfloat16"
    assert record["syncs"] == sum(syncs) == record["syncs_verified"] and record["every_sync_verified"] is True
    return rows


def _experiment(out, *extra) -> list[str]:
    return [sys.executable, "-m", "jaxalign.cli", "experiment", "countdown", "--arm", "real=fp32/vllm:bf16",
            "--seeds", "0", "--out", str(out), *extra]


# --- what a vLLM engine cannot do, refused by name (no vLLM needed) ----------------------------------------------
def test_an_arm_may_name_vllm_as_its_engine_and_what_vllm_cannot_serve_is_refused():
    from jaxalign.rl.arms import parse_arm
    from jaxalign.rl.experiment import ExperimentConfig, run_config
    from jaxalign.rl.trainer import RLConfig
    arm = parse_arm("real=fp32/vllm:bf16;lag=2")
    assert arm.engine == VllmSpec("bf16") and arm.spec() == "real=fp32/vllm:bf16;max_lag=2"
    assert parse_arm(arm.spec()) == arm and parse_arm("v=fp32/vllm").engine == VllmSpec("bf16")
    config = run_config(ExperimentConfig(arms=(arm,)), arm, 0)
    assert config.engine_policy == VllmSpec("bf16") and config.max_lag == 2
    assert config.to_dict()["engine_policy"] == "vllm:bf16" and RLConfig(engine_policy="vllm:fp16").external_engine
    for bad, needle in (("x=fp32/vllm:bf16;replay=r3", "records none"), ("x=fp32/vllm:int3", "allowed: bf16, fp16"),
                        ("x=fp32/vllm:bf16;lora_rank=4", "lora_rank = 4"), ("x=fp32/vllm;replay=r3w", "r2")):
        with pytest.raises(ValueError, match=needle):
            parse_arm(bad)
    with pytest.raises(ValueError, match="meshes apply to jaxalign's own engine"):
        RLConfig(engine_policy="vllm", engine_mesh="data=1")
    # the experiment's model: countdown-vllm (heads of 32) when an arm runs vLLM and no model is named
    assert ExperimentConfig(arms=(arm,)).model == "countdown-vllm" and ExperimentConfig().model == "countdown"
    assert ExperimentConfig(arms=("aligned", arm)).to_dict()["model"] == "countdown-vllm"


def test_a_model_whose_heads_vllm_cannot_run_exits_2_naming_the_preset_to_use(tmp_path, capsys):
    from jaxalign import cli
    args = ["experiment", "countdown", "--arm", "real=fp32/vllm:bf16", "--model", "countdown", "--steps", "1",
            "--out", str(tmp_path / "out")]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "head_dim 16" in err and "--model countdown-vllm" in err
    assert not (tmp_path / "out").exists()  # refused before anything ran


# --- runs ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_sigkilled_vllm_run_leaves_no_vllm_process_and_resumes_with_every_sync_verified(tmp_path):
    """A small run (random-init countdown-vllm, 2 problems x 4 samples, 3 steps) SIGKILLed once vLLM has synced
    and been verified (both workers running): no process of either worker's session survives; the same command
    then resumes the run to its end, and the finished run shows the must-show claims (`check_vllm_run`)."""
    _need_vllm()
    out = tmp_path / "exp"
    command = _experiment(out, "--steps", "3", "--sft-steps", "0", "--sft-problems", "64",
                          "--prompts-per-step", "2", "--group-size", "4",
                          "--eval-problems", "4", "--eval-every", "3", "--json")
    parent = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    metrics = out / "real" / "seed0" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 480
        while not any(row.get("engine_syncs") for row in _complete_rows(metrics)):
            assert parent.poll() is None, parent.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no verified sync within 8 minutes"
            time.sleep(0.5)
        workers = _vllm_workers_of(parent.pid)
        assert len(workers) == 2  # the engine and the reference its syncs are verified against
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 20
        while _alive_in_sessions(set(workers)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive_in_sessions(set(workers)), "a vLLM process outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    check_vllm_run(out / "real" / "seed0", 3)


@pytest.mark.slow
def test_a_sync_that_fails_its_verification_stops_the_command_with_the_difference(tmp_path):
    """`experiment countdown --arm 'real=fp32/vllm:bf16,sync=inplace'`: vLLM synced in place (its reload_weights,
    which leaves MoE experts in the wrong layout on the CPU: docs/vllm.md), so the sync before batch 1 fails its
    verification; the command exits 1 with one line naming the method and the difference, after one row of
    training, with its checkpoint intact, and leaves no vLLM process behind."""
    _need_vllm()
    out = tmp_path / "exp"
    command = [sys.executable, "-m", "jaxalign.cli", "experiment", "countdown", "--arm",
               "real=fp32/vllm:bf16,sync=inplace", "--seeds", "0", "--out", str(out), "--steps", "2",
               "--sft-steps", "0", "--sft-problems", "64", "--prompts-per-step", "2", "--group-size", "4",
               "--eval-problems", "4", "--eval-every", "2"]
    parent = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        _, err = parent.communicate(timeout=600)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    assert parent.returncode == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("jaxalign experiment: error: after a inplace sync vLLM scores the probe unlike a fresh "
                           "load"), err[-3000:]
    assert "the run stopped (its last checkpoint resumes it)" in last
    run = out / "real" / "seed0"
    assert [r["step"] for r in _rows(run)] == [0, 1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["1"]
    assert not _alive_in_sessions({parent.pid}), "a vLLM process outlived the stopped run"


@pytest.mark.slow
@pytest.mark.full_matrix(
    cover="tests/test_rl_vllm.py::test_a_sigkilled_vllm_run_leaves_no_vllm_process_and_resumes_with_every_sync_verified",
    why="the literal command trains the default 900-step SFT warm start first (about 4.5 minutes on 2 cores) and "
        "16 problems x 8 samples a step; the covering case runs the same loop, claims and SIGKILL at a small size")
def test_the_experiment_with_a_vllm_arm_exits_0_with_every_sync_verified(tmp_path):
    """`jaxalign experiment countdown --arm 'real=fp32/vllm:bf16' --steps 4 --seeds 0 --out DIR`, as issue 52
    writes it."""
    _need_vllm()
    done = subprocess.run(_experiment(tmp_path / "exp", "--steps", "4"), cwd=ROOT, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    check_vllm_run(tmp_path / "exp" / "real" / "seed0", 4)
    with open(tmp_path / "exp" / "summary.json") as f:
        arm = json.load(f)["arms"]["real"]
    assert arm["policies"]["engine"] == "vllm:bf16" and arm["engine_syncs"] == arm["engine_syncs_verified"] == 3
    assert json.loads((tmp_path / "exp" / "run.json").read_text())["settings"]["experiment"]["model"] == \
        "countdown-vllm"


def test_the_demo_rerun_on_vllm_in_the_docs_is_the_committed_record():
    """docs/vllm.md's table of the demo's misaligned arm rerun on vLLM is what benchmarks/vllm_demo.py makes of
    docs/vllm/demo.json, and that record says every sync of the vLLM arm was verified."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("vllm_demo", os.path.join(ROOT, "benchmarks", "vllm_demo.py"))
    vllm_demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vllm_demo)
    with open(vllm_demo.RECORD) as f:
        record = json.load(f)
    with open(vllm_demo.DOC) as f:
        text = f.read()
    assert vllm_demo.render(text, record) == text, "run python benchmarks/vllm_demo.py"
    arm = record["arms"]["misaligned-vllm"]
    assert arm["policies"]["engine"] == "vllm:bf16" and arm["route_flip_rate"] is None
    assert arm["engine_record"]["every_sync_verified"] is True
    assert arm["engine_syncs"] == arm["engine_syncs_verified"] == record["config"]["steps"] - 1
    assert all(k > 0 for k in arm["k3_per_step"]) and len(arm["k3_per_step"]) == record["config"]["steps"]
