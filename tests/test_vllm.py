"""vLLM as a real rollout engine (jaxalign.engines.vllm): a transformers Qwen3-MoE checkpoint made here, compared
against the trainer through the CLI, a verified weight sync, no orphan after the parent is SIGKILLed; and bad
input at model loading. The vLLM tests need its virtualenv (`jaxalign vllm install`, which the README's test
command runs): without it they skip naming that command, except under CI (CI=true), where they fail."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxalign.engines.vllm import install

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a config no other test uses: head_dim 32 (vLLM's CPU attention takes 32..256), 8 experts, top-2
QWEN3_MOE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=8, num_experts_per_tok=2,
                 max_position_embeddings=128, tie_word_embeddings=False, norm_topk_prob=True)


def _need_vllm() -> None:
    if install.installed() is None:
        reason = f"vLLM is not installed in {install.venv_dir()}: run `{install.INSTALL_COMMAND}`"
        if os.environ.get("CI"):
            pytest.fail(reason + " (the README's test command does)")
        pytest.skip(reason)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A random Qwen3-MoE checkpoint written by transformers' save_pretrained (float32)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(52)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**QWEN3_MOE))
    path = str(tmp_path_factory.mktemp("qwen3moe"))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine(checkpoint):
    """One vLLM engine (bf16) on the checkpoint for the module's in-process tests."""
    _need_vllm()
    from jaxalign.engines.vllm import VllmEngine
    eng = VllmEngine(checkpoint, dtype="bf16", max_num_seqs=8)
    yield eng
    eng.close()
    assert not eng.worker.alive()


def _running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (one that ended and waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _in_session(sid: int) -> list[int]:
    """Running (not zombie) processes of session `sid`: the worker starts its own, and anything vLLM started
    would be in it."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[3]) == sid:  # state, ppid, pgrp, session
                found.append(int(name))
    return found


def _run(args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxalign.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=600, **kw)


# --- loading: bad input exits 2 naming what is wrong (no vLLM needed) --------------------------------------------
def test_a_config_lacking_a_field_its_family_needs_exits_2_naming_the_field(tmp_path, capsys):
    from jaxalign import cli
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "vocab_size": 64,
                                                      "hidden_size": 16}))
    assert cli.main(["check", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs the field 'num_attention_heads'" in err and "config.json" in err


def test_vllm_missing_is_one_line_naming_the_install_command_and_exit_2(tmp_path, capsys, monkeypatch):
    from jaxalign import cli
    monkeypatch.setenv("JAXALIGN_VLLM_VENV", str(tmp_path / "absent"))
    assert cli.main(["compare", "--model", "tiny", "--engine", "vllm:bf16", "--prompts", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "jaxalign vllm install" in err and "not installed" in err
    with pytest.raises(SystemExit) as exit_:
        cli.main(["compare", "--engine", "vllm:int3"])
    assert exit_.value.code == 2 and "allowed: bf16, fp16, fp32" in capsys.readouterr().err


def test_engine_specs_and_jaxaligns_engine_behind_the_interface(tiny_model):
    from jaxalign.engine import Engine
    from jaxalign.engines import LocalEngine, RolloutEngine, VllmSpec, open_engine, parse_engine
    from jaxalign.numerics import NumericPolicy
    assert parse_engine("vllm") == VllmSpec("bf16") and str(parse_engine("vllm:fp32")) == "vllm:fp32"
    assert parse_engine("serve-bf16") == NumericPolicy.preset("serve-bf16")
    with pytest.raises(ValueError, match="allowed: bf16, fp16, fp32"):
        parse_engine("vllm:int3")
    # the sync method: reload (default, not written) or inplace (vLLM's reload_weights, to show its fault caught)
    assert parse_engine("vllm:bf16,sync=inplace") == VllmSpec("bf16", "inplace") == parse_engine("vllm,sync=inplace")
    assert str(VllmSpec("fp32", "inplace")) == "vllm:fp32,sync=inplace" and parse_engine("vllm:bf16,sync=reload") \
        == VllmSpec("bf16")
    for bad, needle in (("vllm:bf16,sync=fast", "sync method 'fast'; allowed: reload, inplace .in 'vllm:bf16,sync=fast'"),
                        ("vllm:bf16,kv=fp8", "option 'kv=fp8'.*allowed: sync=METHOD"),
                        ("vllm:bf16,sync", "option 'sync'")):
        with pytest.raises(ValueError, match=needle):
            parse_engine(bad)
    with pytest.raises(ValueError, match="sync method 'fast'; allowed: reload, inplace"):
        VllmSpec("bf16", "fast")  # the Python API refuses what the text form refuses
    with pytest.raises(ValueError, match="allowed: bf16, fp16, fp32"):
        VllmSpec("int3")
    policy = NumericPolicy.preset("serve-bf16")
    local = open_engine("serve-bf16", tiny_model)
    assert isinstance(local, LocalEngine) and isinstance(local, RolloutEngine)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    got = local.generate(prompts, max_new_tokens=4, seed=1, batch_size=2)
    want = Engine(tiny_model, policy).generate(prompts, max_new_tokens=4, seed=1, batch_size=2)
    np.testing.assert_array_equal(got.tokens, want.tokens)  # the adapter changes no numerics
    np.testing.assert_array_equal(got.logprobs, want.logprobs)
    assert got.stats["engine"] == "jaxalign" and local.sync(tiny_model)["method"] == "cast"


# --- vLLM ----------------------------------------------------------------------------------------------------------
@pytest.mark.hf
@pytest.mark.slow
def test_compare_against_vllm_reports_a_small_gap_and_the_engine_version(checkpoint):
    _need_vllm()
    done = _run(["compare", "--model", checkpoint, "--engine", "vllm:bf16", "--trainer", "fp32", "--json",
                 "--engine-batch", "1,8", "--prompts", "8", "--max-new-tokens", "8"])
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["engine"] == {"name": "vllm", "version": install.VLLM_VERSION, "numerics": "vllm:bfloat16"}
    assert [r["engine_batch"] for r in result["runs"]] == [1, 8]
    for run in result["runs"]:
        assert 0 < run["k3_kl"] < 1e-3, run
        assert run["n_tokens"] == 64 and 0 < run["max_abs_logp_diff"] < 0.1
        assert {"kl", "k3_kl", "max_abs_logp_diff", "bitwise_equal_fraction"} <= set(run)
    assert "not recorded" in result["routing"]


@pytest.mark.hf
@pytest.mark.slow
def test_vllm_rollout_is_what_the_trainer_consumes(engine):
    rollout = engine.generate([[1, 2, 3], [4, 5, 6, 7, 8]], max_new_tokens=6, seed=3, batch_size=2)
    assert rollout.tokens.shape[0] == 2 and list(rollout.completion_lens) == [6, 6]
    assert rollout.mask.sum() == 12 and (rollout.logprobs[rollout.mask] < 0).all()
    assert (rollout.logprobs[~rollout.mask] == 0).all()
    assert (np.asarray(rollout.routing.indices) == -1).all() and "not recorded" in rollout.stats["routing"]
    assert rollout.stats["engine_version"] == install.VLLM_VERSION
    again = engine.generate([[1, 2, 3], [4, 5, 6, 7, 8]], max_new_tokens=6, seed=3, batch_size=2)
    np.testing.assert_array_equal(again.tokens, rollout.tokens)  # reruns are deterministic
    np.testing.assert_array_equal(again.logprobs, rollout.logprobs)


@pytest.mark.hf
@pytest.mark.slow
def test_golden_check_against_vllms_output(engine, checkpoint, tmp_path):
    """The porting kit on a real stack: a golden file of the checkpoint under hf-eager-bf16, vLLM's prompt
    logprobs of the same sequences as the candidate (what `golden check --engine vllm` writes)."""
    from jaxalign.cli.golden import write_candidate
    from jaxalign.interop import golden
    from jaxalign.loading import load_model
    from jaxalign.numerics import NumericPolicy
    sequences = [list(range(1, 13)), [5, 9, 2, 77, 40, 3, 3, 61, 12, 8, 90, 1]]  # one length: one compile
    golden.export_golden(load_model(checkpoint), sequences, NumericPolicy.preset("hf-eager-bf16"),
                         str(tmp_path / "golden.json"))
    write_candidate(engine, str(tmp_path / "golden.json"), str(tmp_path / "candidate.jsonl"))
    result = golden.check_golden(str(tmp_path / "golden.json"), str(tmp_path / "candidate.jsonl"))
    assert result["passed"] and 0 < result["k3_kl"] < 1e-3 and result["n_tokens"] == 22


@pytest.mark.hf
@pytest.mark.slow
def test_sync_is_verified_against_a_fresh_load_of_the_same_weights(engine, checkpoint):
    import jax
    from flax import nnx

    from jaxalign.loading import load_model
    model = load_model(checkpoint)
    before = engine.probe()
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x * 1.5, state))  # new weights, as after a training step
    done = engine.sync(model)
    assert done["method"] == "reload" and done["verified"] is True and done["probe_tokens"] > 0
    after = engine.probe()
    assert not np.array_equal(after, before)  # the weights changed
    # bitwise what a separate process freshly loaded from the same exported files scores
    np.testing.assert_array_equal(after, engine.reference_probe(engine.weights_dir))


@pytest.mark.hf
@pytest.mark.slow
def test_no_vllm_process_survives_its_parent_being_sigkilled(checkpoint):
    _need_vllm()
    script = ("import sys, time\nfrom jaxalign.engines.vllm import VllmEngine\n"
              f"e = VllmEngine({checkpoint!r}, max_num_seqs=2)\n"
              "print(e.worker.pid, flush=True)\ntime.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = parent.stdout.readline()
        assert line.strip().isdigit(), "the parent did not start vLLM"
        worker = int(line)
        with open(f"/proc/{worker}/cmdline", "rb") as f:
            assert b"worker.py" in f.read()  # the vLLM worker, with the model loaded
        assert _in_session(worker) == [worker]  # vLLM's core runs in the worker: one process
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 15
        while _in_session(worker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _in_session(worker), "a vLLM process outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


@pytest.mark.slow
def test_no_worker_survives_its_parent_being_interrupted():
    """SIGINT (Ctrl-C) to a parent holding a worker: the parent exits and the worker with it (the SIGKILL test
    above runs the same with a model loaded)."""
    _need_vllm()
    script = ("import signal, time\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"  # even if ignored
              "from jaxalign.engines.vllm.process import WorkerProcess\n"
              "w = WorkerProcess()\nprint(w.pid, flush=True)\ntime.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True, cwd=ROOT)
    try:
        worker = int(parent.stdout.readline())
        assert _running(worker)
        parent.send_signal(signal.SIGINT)
        assert parent.wait(30) != 0
        deadline = time.monotonic() + 15
        while _running(worker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _running(worker), "the vLLM worker outlived its interrupted parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
