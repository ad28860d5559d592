"""The RL trainer: aligned arm exactly on-policy, exact resume, determinism, the NaN guard, the experiment."""

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from jaxalign.model.config import ModelConfig
from jaxalign.model.transformer import Transformer
from jaxalign.rl.grpo import GRPOConfig
from jaxalign.rl.sft import warm_start
from jaxalign.numerics import NumericPolicy
from jaxalign.numerics.sampling import SamplingParams
from jaxalign.rl import tokenizer
from jaxalign.rl.trainer import RLConfig, Trainer

from rl_settings import SFT, rl_config, strip_timing



@pytest.fixture(scope="module")
def base(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("cache"))
    model = warm_start(ModelConfig.preset("countdown"), SFT, cache, progress=False)
    return cache, nnx.state(model)


def _model(base):
    cache, state = base
    model = warm_start(ModelConfig.preset("countdown"), SFT, cache, progress=False)  # from the cache
    nnx.update(model, jax.tree.map(lambda x: x, state))
    return model


def _config(**kw):
    return rl_config(**{"steps": 4, "eval_every": 2, **kw})


def test_warm_start_cache_is_keyed_by_the_build():
    """Another build's warm start is never reused: the cache key includes a hash of the source and JAX version."""
    from jaxalign.rl.sft import cache_key, code_fingerprint

    cfg = ModelConfig.preset("countdown")
    assert code_fingerprint() == code_fingerprint() and len(code_fingerprint()) == 16
    assert cache_key(cfg, SFT) == cache_key(cfg, SFT, code_fingerprint())
    assert cache_key(cfg, SFT, "build-a") != cache_key(cfg, SFT, "build-b")


def test_warm_start_is_cached_and_scores(base, tmp_path):
    model = _model(base)
    trainer = Trainer(model, _config(), str(tmp_path / "run"))
    assert trainer.evaluate() > 0.0  # the warm start already earns reward (format or correct answers)


def test_after_its_first_step_a_run_lowers_no_new_program(tmp_path):
    """A run's update, its old-policy scoring, its engine and its evaluation are specialised once, in the first
    step: the steps after it (here after a resume from that step's checkpoint) lower nothing new. Fresh
    parameters and optax's step counter are uncommitted arrays and the first update's outputs committed ones,
    and jit specialises on that: before the run's starting state was placed on its device
    (`sharding.on_first_device`), the second step lowered and compiled the update, the scoring and the engine's
    programs a second time. Counted by JAX's lowering events, which fire whether or not the persistent
    compilation cache then supplies the executable. The model is a fresh one, as a user's first run has (a
    loaded model's arrays are committed already); its engine copy is cast from the placed weights,
    so the engine's programs too see the placement every later weight sync gives them."""
    fresh = Transformer(ModelConfig.preset("countdown"), rngs=nnx.Rngs(0))
    assert not any(x.committed for x in jax.tree.leaves(nnx.state(fresh)))
    trainer = Trainer(fresh, _config(), str(tmp_path / "run"))
    trainer.run(progress=False, stop_after=1)
    lowerings = []

    def count(event, duration, **_):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowerings.append(duration)
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        rows = trainer.run(progress=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and "eval_reward" in rows[-1]
    assert lowerings == [], f"{len(lowerings)} programs lowered after the first step"


def test_aligned_arm_is_exactly_on_policy_and_misaligned_is_not(base, tmp_path):
    rows = Trainer(_model(base), _config(), str(tmp_path / "aligned")).run(progress=False)
    steps = [r for r in rows if r["step"] > 0]
    assert len(steps) == 4
    for r in steps:
        assert r["rollout_corr/kl"] == 0.0 and r["rollout_corr/k3_kl"] == 0.0
        assert r["rollout_corr/max_abs_logp_diff"] == 0.0
        assert r["rollout_corr/rollout_rs_masked_fraction"] == 0.0 and r["route_flip_rate"] == 0.0
        # lag 0: generated with the current weights, and the engine agrees with the trainer at them
        assert r["behaviour_version"] == r["step"] - 1 and r["lag"] == 0
        assert r["numerics/k3_kl"] == 0.0 and r["staleness/k3_kl"] == 0.0
    mis = Trainer(_model(base), _config(trainer_policy="train-bf16", engine_policy="serve-bf16", eval_sampled=True),
                  str(tmp_path / "misaligned")).run(progress=False)
    assert all(r["rollout_corr/max_abs_logp_diff"] > 0 for r in mis if r["step"] > 0)
    # the sampled evaluation syncs jaxalign's engine (a cast): nothing to verify, so its rows count no syncs
    assert [r["step"] for r in mis if 0 <= r.get("eval_engine_reward", -1) <= 1] == [0, 2, 4]
    assert not any("engine_syncs" in r for r in mis + rows)
    # held-out evaluation decodes under the trainer's policy, whatever the engine: the misaligned arm's warm-start
    # evaluation is that of a run whose engine is its trainer's policy, and not its serve-bf16 engine's
    own = Trainer(_model(base), _config(trainer_policy="train-bf16", engine_policy="train-bf16"),
                  str(tmp_path / "train-bf16"))
    assert mis[0]["eval_reward"] == own.evaluate() and own.eval_engine is own.engine
    probe = Trainer(_model(base), _config(trainer_policy="train-bf16", engine_policy="serve-bf16"),
                    str(tmp_path / "probe"))
    assert probe.eval_engine.policy == NumericPolicy.parse("train-bf16")
    # an engine handed in is the caller's: the trainer uses it and its close leaves it to the caller
    from jaxalign.engines import LocalEngine
    given = LocalEngine(_model(base), NumericPolicy.parse("serve-bf16"))
    lent = Trainer(_model(base), _config(trainer_policy="train-bf16", engine_policy="serve-bf16"),
                   str(tmp_path / "lent"), engine=given)
    assert lent.engine is given
    lent.close()
    assert lent.rollouts.opened is given
    probe.close()
    assert probe.rollouts.opened is None  # the engine it opened itself, closed and dropped
    prompts = [probe.task.prompt(p) for p in probe.eval_items[:8]]
    greedy = [e.generate(prompts, max_new_tokens=6, sampling=SamplingParams(temperature=0.0),
                         eos_id=tokenizer.EOS).logprobs
              for e in (probe.eval_engine, probe.engine)]
    assert not np.array_equal(*greedy)  # the two engines do compute differently
    with open(tmp_path / "aligned" / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [0, 1, 2, 3, 4]
    assert os.listdir(tmp_path / "aligned" / "tb")


def test_resume_is_exact_and_runs_are_deterministic(base, tmp_path):
    cfg = _config(trainer_policy="train-bf16", engine_policy="serve-bf16")
    straight = Trainer(_model(base), cfg, str(tmp_path / "straight"))
    rows_straight = straight.run(progress=False)
    again = Trainer(_model(base), cfg, str(tmp_path / "again")).run(progress=False)
    assert strip_timing(again) == strip_timing(rows_straight)  # same seed -> same metrics
    interrupted = Trainer(_model(base), cfg, str(tmp_path / "resumed"))
    interrupted.run(progress=False, stop_after=2)
    assert interrupted.step == 2
    resumed = Trainer(_model(base), cfg, str(tmp_path / "resumed"))  # a fresh process would do this
    rows_resumed = resumed.run(progress=False)
    assert resumed.step == 4
    assert strip_timing(rows_resumed) == strip_timing(rows_straight)
    for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # a finished run whose last row was cut mid-write after its checkpoint (a full disk, a copy cut short): the
    # same command goes back to an older checkpoint and recomputes the lost step -- its final evaluation too --
    # to the same bits, instead of reporting the run finished without it
    path = tmp_path / "resumed" / "metrics.jsonl"
    text = path.read_bytes()
    path.write_bytes(text[:-40])
    from jaxalign.rl import rundir
    assert rundir.finished_rows(str(tmp_path / "resumed"), 4) is None
    rows_repaired = Trainer(_model(base), cfg, str(tmp_path / "resumed")).run(progress=False)
    assert strip_timing(rows_repaired) == strip_timing(rows_straight) and "eval_reward" in rows_repaired[-1]
    assert path.read_bytes() == text


def test_nan_guard_stops_with_a_resumable_checkpoint(base, tmp_path):
    trainer = Trainer(_model(base), _config(), str(tmp_path / "nan"))
    trainer.run(progress=False, stop_after=1)
    # NaN into the trainer's own copy of the weights (the caller's model is never touched), which holds the arrays
    # as the updates place them: the next update runs the program the first one compiled
    leaf = trainer.model.blocks[0].attn.q_proj.w
    leaf[...] = leaf[...] * np.nan
    trainer.params = nnx.split(trainer.model)[1]
    with pytest.raises(FloatingPointError, match="last good state is checkpointed"):
        trainer.run(progress=False, resume=False)
    assert trainer.checkpoints.latest_step() == 1


def test_bad_rl_settings():
    with pytest.raises(ValueError, match="mode"):
        RLConfig(mode="offline")
    with pytest.raises(ValueError, match="replay"):
        RLConfig(replay="r4")
    with pytest.raises(ValueError, match="group_size"):
        GRPOConfig(group_size=1)
    with pytest.raises(ValueError, match="allowed keys|allowed:"):
        RLConfig(trainer_policy="warp=9")
    # float16 training would need dynamic loss scaling, which jaxalign does not implement: refused, naming the
    # fields; an f16 engine is a real engine set-up and stays allowed
    with pytest.raises(ValueError, match=r"f16 in compute_dtype, matmul_acc: float16 training needs dynamic loss"):
        RLConfig(trainer_policy="aligned-bf16,compute=f16,matmul=f16")
    assert RLConfig(engine_policy="serve-bf16,compute=f16").engine_policy.compute_dtype == "f16"


def test_kl_to_reference_is_logged_and_grows_from_zero(base, tmp_path):
    rows = Trainer(_model(base), _config(grpo=GRPOConfig(group_size=2, kl_coef=0.1), learning_rate=1e-2),
                   str(tmp_path / "kl")).run(progress=False)
    kl = [r["kl_ref"] for r in rows if r["step"] > 0]
    assert kl[0] == 0.0  # the first update starts at the reference
    assert max(kl[1:]) > 0.0


KILL_SETTINGS = {"steps": 6, "checkpoint_every": 2, "eval_every": 2}


@pytest.fixture(scope="module")
def straight(base, tmp_path_factory):
    """An uninterrupted run of KILL_SETTINGS (its directory); the caller's model is left untouched."""
    model = _model(base)
    before = [np.asarray(x).copy() for x in jax.tree.leaves(nnx.state(model))]
    run = tmp_path_factory.mktemp("sync") / "straight"
    Trainer(model, rl_config(**KILL_SETTINGS), str(run)).run(progress=False)
    for a, b in zip(before, jax.tree.leaves(nnx.state(model))):  # the trainer trained its own copy
        np.testing.assert_array_equal(a, np.asarray(b))
    return run


def test_sigkill_after_a_checkpoint_then_rerun_gives_the_uninterrupted_metrics_bitwise(base, tmp_path, straight):
    """The issue's case: killed just after its first checkpoint, the same command again must keep the warm-start
    evaluation (step 0) and steps 1-2, and leave metrics.jsonl byte-identical to an uninterrupted run's."""
    from jaxalign.rl.rundir import RunMismatch

    killed = _kill_after_first_checkpoint_and_rerun(base, tmp_path, KILL_SETTINGS)
    assert (killed / "metrics.jsonl").read_bytes() == (straight / "metrics.jsonl").read_bytes()

    # the finished directory refuses another setting instead of reporting its numbers as the new run's
    with pytest.raises(RunMismatch, match=r"learning_rate: 0.0003 -> 0.123"):
        Trainer(_model(base), rl_config(**KILL_SETTINGS, learning_rate=0.123), str(killed))


def test_two_identical_commands_on_one_directory_one_refuses_and_the_rows_are_a_lone_runs(base, tmp_path, straight):
    """Two identical runs started together on one directory: one exits 2 naming the holder (no traceback, nothing
    of the directory touched), the other finishes, and metrics.jsonl holds every step once, byte-identical to a
    lone run's. Once the holder has exited, the directory is free again (the kernel dropped the lock)."""
    import subprocess
    import sys

    cache, _ = base
    shared = tmp_path / "shared"
    tests = os.path.dirname(__file__)
    command = [sys.executable, os.path.join(tests, "rl_run_worker.py"), tests, cache, str(shared),
               json.dumps(KILL_SETTINGS)]
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], outs
    refused = outs[[p.returncode for p in procs].index(2)][1]
    assert "is in use by pid" in refused and "Traceback" not in refused, refused
    assert (shared / "metrics.jsonl").read_bytes() == (straight / "metrics.jsonl").read_bytes()
    from jaxalign.rl.rundir import hold
    with hold(str(shared)):  # free: the finished holder's exit released it
        pass


def test_a_held_directory_is_refused_by_the_command_line_without_a_traceback(tmp_path, capsys):
    """`jaxalign experiment countdown --out DIR` while another process holds DIR: exit 2, the message names the
    directory and the holder's pid, and the directory is left as it was."""
    import subprocess
    import sys

    from jaxalign.cli import main

    out = tmp_path / "busy"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from jaxalign.rl.rundir import hold; "
                               f"h = hold({str(out)!r}); print('held', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = sorted(os.listdir(out))
        assert main(["experiment", "countdown", "--out", str(out), "--steps", "1"]) == 2
        err = capsys.readouterr().err
        assert f"{out} is in use by pid {holder.pid}" in err and "Traceback" not in err, err
        assert sorted(os.listdir(out)) == before
    finally:
        holder.kill()
        holder.wait()


def _kill_after_first_checkpoint_and_rerun(base, tmp_path, settings):
    """Run `rl_config(**settings)` in a subprocess (tests/rl_run_worker.py), SIGKILL it as soon as its step-2
    checkpoint exists, check the rows up to it are durable, then run the same settings again here to the end;
    returns the run directory."""
    import signal
    import subprocess
    import sys
    import time

    cache, _ = base
    killed = tmp_path / "killed"
    tests = os.path.dirname(__file__)
    proc = subprocess.Popen([sys.executable, os.path.join(tests, "rl_run_worker.py"), tests, cache, str(killed),
                             json.dumps(settings)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while not (killed / "checkpoints" / "2").is_dir():
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < deadline, "no checkpoint within 10 minutes"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL  # killed mid-run, not finished
    with open(killed / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f][:3] == [0, 1, 2]  # durable before the checkpoint

    Trainer(_model(base), rl_config(**settings), str(killed)).run(progress=False)  # the same command again
    with open(killed / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == list(range(settings["steps"] + 1))
    return killed


# --- asynchronous rollouts (max_lag) -------------------------------------------------------------------------
LAG2_SETTINGS = {**KILL_SETTINGS, "max_lag": 2}


@pytest.fixture(scope="module")
def lag2_aligned(base, tmp_path_factory):
    """An uninterrupted lag-2 run of the SIGKILL test's settings, aligned-bf16 on both sides: (run dir, rows)."""
    run = tmp_path_factory.mktemp("lag2") / "straight"
    return run, Trainer(_model(base), rl_config(**LAG2_SETTINGS), str(run)).run(progress=False)


def test_lag_two_aligned_has_exactly_zero_numerics_and_positive_staleness(lag2_aligned):
    """Batch t is generated with the weights of version max(0, t - 2); the trainer at those weights reproduces
    the engine's logprobs bitwise (numerics k3 exactly 0, no route flip: the worker's engine really held that
    version), while the trainer's current weights have moved from them (staleness k3 > 0 once they differ)."""
    _, rows = lag2_aligned
    steps = [r for r in rows if r["step"] > 0]
    assert len(steps) == LAG2_SETTINGS["steps"]
    for r in steps:
        t = r["step"] - 1
        assert r["behaviour_version"] == max(0, t - 2) and r["lag"] == min(t, 2)
        assert r["numerics/k3_kl"] == 0.0 and r["numerics/max_abs_logp_diff"] == 0.0
        assert r["numerics/route_flip_rate"] == 0.0
        if r["lag"] == 0:
            assert r["staleness/k3_kl"] == 0.0 and r["rollout_corr/k3_kl"] == 0.0
        else:  # the whole correction ratio is staleness
            assert r["staleness/k3_kl"] > 0.0 and r["staleness/share"] == 1.0
            assert r["rollout_corr/kl"] == pytest.approx(r["staleness/kl"], rel=1e-9, abs=0)


def test_the_split_is_only_a_measurement_and_split_every_thins_it(base, tmp_path, lag2_aligned):
    """A lag-2 run measuring the split on every 3rd batch (`split_every=3`, which skips the extra trainer pass at
    the older weights on the others) trains exactly as the run measuring it on every batch: the same rows, bit
    for bit, less the numerics/staleness keys of the batches it did not measure."""
    _, every = lag2_aligned
    thinned = Trainer(_model(base), rl_config(**LAG2_SETTINGS, split_every=3), str(tmp_path / "thin")).run(
        progress=False)
    is_split = lambda key: key.startswith(("numerics/", "staleness/"))  # noqa: E731
    for full, thin in zip(every, thinned):
        t = full["step"] - 1
        measured = full["step"] == 0 or t % 3 == 0 or full["lag"] == 0
        assert {k: v for k, v in thin.items() if not is_split(k)} == {k: v for k, v in full.items()
                                                                       if not is_split(k)}
        assert thin == full if measured else not any(is_split(k) for k in thin)
    with pytest.raises(ValueError, match="split_every"):
        RLConfig(split_every=-1)


def test_sigkilled_lag_two_run_reruns_to_the_uninterrupted_rows(base, tmp_path, lag2_aligned):
    """Killed right after its step-2 checkpoint, with batches 2-4 in flight or queued on the worker: the
    checkpoint holds the weight versions those batches are generated with (0 and 1 besides the current 2), and
    the same command again ends with a metrics.jsonl byte-identical to the uninterrupted lag-2 run's."""
    straight, _ = lag2_aligned
    killed = _kill_after_first_checkpoint_and_rerun(base, tmp_path, LAG2_SETTINGS)
    assert (killed / "metrics.jsonl").read_bytes() == (straight / "metrics.jsonl").read_bytes()


def test_lag_two_serve_bf16_splits_the_log_ratio_into_numerics_plus_staleness(base, tmp_path):
    """train-bf16 trainer, serve-bf16 engine, lag 2: at step 2 (generated with version 0) both parts are > 0,
    and per token the correction's log ratio (trainer now - engine) is the numerics part (trainer - engine at
    version 0) plus the staleness part (trainer now - trainer at version 0), to float64 rounding."""
    trainer = Trainer(_model(base), _config(trainer_policy="train-bf16", engine_policy="serve-bf16", max_lag=2,
                                            steps=3), str(tmp_path / "run"))
    rows = [trainer.train_step() for _ in range(3)]
    row = rows[-1]
    assert row["behaviour_version"] == 0 and row["lag"] == 2
    assert row["numerics/k3_kl"] > 0.0 and row["staleness/k3_kl"] > 0.0
    assert 0.0 < row["numerics/share"] < 1.0 and row["numerics/share"] + row["staleness/share"] == pytest.approx(1.0)
    lp = {k: np.asarray(v, np.float64) for k, v in trainer.last_logprobs.items()}
    valid = lp["mask"] != 0
    total = (lp["current"] - lp["engine"])[valid]
    numerics = (lp["behaviour"] - lp["engine"])[valid]
    staleness = (lp["current"] - lp["behaviour"])[valid]
    assert np.abs(numerics).max() > 0 and np.abs(staleness).max() > 0
    # each float64 subtraction of float32 logprobs (|logp| < 64) rounds by at most 2^-53 * 64
    np.testing.assert_allclose(numerics + staleness, total, rtol=0, atol=3 * 64 * 2.0 ** -53)
    # verl's k1 of the whole ratio is the two parts' k1 (its mean divides by count + 1e-8)
    assert row["rollout_corr/kl"] == pytest.approx(row["numerics/kl"] + row["staleness/kl"], rel=1e-9, abs=1e-15)
    with pytest.raises(ValueError, match="max_lag"):
        RLConfig(max_lag=-1)


def test_minibatches_let_the_ratio_leave_one_on_an_aligned_arm(base, tmp_path):
    """Two disjoint minibatches per batch, one optimizer step each: the second sees the updated policy, so even
    exactly on-policy (aligned, decoupled) the step's PPO ratio is not 1 -- what one minibatch cannot show."""
    rows = Trainer(_model(base), _config(steps=2, minibatches=2, learning_rate=3e-3),
                   str(tmp_path / "mini")).run(progress=False)
    steps = [r for r in rows if r["step"] > 0]
    assert all(r["rollout_corr/k3_kl"] == 0.0 for r in steps)
    # (a step whose first minibatch has no advantage, all its groups tied, leaves the policy unchanged)
    assert any(r["ratio_mean"] != 1.0 and r["clip_fraction"] > 0 for r in steps), steps
    trainer = Trainer(_model(base), _config(steps=2, minibatches=4), str(tmp_path / "rows"))
    parts = trainer.minibatch_rows(0)
    assert len(parts) == 4 and sorted(np.concatenate(parts).tolist()) == list(range(8))
    with pytest.raises(ValueError, match="minibatches"):
        _config(minibatches=3)
