"""Device meshes on 8 fake CPU devices. XLA reads the device count when JAX starts, so these run in fresh
processes: tests/multidevice/ under pytest with XLA_FLAGS set, and the CLI with --host-devices."""

import json
import os
import subprocess
import sys

import pytest

from jaxalign.model.sharding import make_mesh, parse_mesh_spec, spec_for

from isa import child_env  # tests/isa.py
from rl_settings import save_one_device_reference  # tests/rl_settings.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(*xla_flags, **extra):
    """This process's environment, its XLA_FLAGS (e.g. an ISA cap) kept but any device count dropped, plus
    `xla_flags` and `extra`."""
    return child_env(*xla_flags, **extra)


@pytest.mark.slow
@pytest.mark.bitwise
def test_multidevice_suite_on_eight_fake_devices(tmp_path):
    leg = ["-m", "bitwise"] if os.environ.get("JAXALIGN_ISA_LEG") else []  # tests/test_isa_matrix.py
    # the RL run's one-device side, on this process's one device (a leg leaves the run out: tests/isa.py)
    reference = {} if leg else save_one_device_reference(str(tmp_path))
    env = _env("--xla_force_host_platform_device_count=8", JAXALIGN_MULTIDEVICE="1", **reference)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *leg,
                           os.path.join(ROOT, "tests", "multidevice")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


def _cli(*args):
    proc = subprocess.run([sys.executable, "-m", "jaxalign.cli", *args], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


_COMPARE = ("compare", "--model", "tiny", "--prompts", "8", "--max-new-tokens", "8", "--json", "--host-devices", "8")


@pytest.mark.slow
def test_compare_between_differently_parallelised_trainer_and_engine():
    aligned = json.loads(_cli(*_COMPARE, "--trainer", "aligned-bf16", "--engine", "aligned-bf16",
                              "--trainer-mesh", "fsdp=4,tensor=2", "--engine-mesh", "tensor=8"))
    assert (aligned["trainer_mesh"], aligned["engine_mesh"]) == ("fsdp=4,tensor=2", "tensor=8")
    assert aligned["runs"][0]["max_abs_logp_diff"] == 0.0
    assert aligned["runs"][0]["route_flip_rate"] == 0.0


@pytest.mark.slow
@pytest.mark.full_matrix(cover="tests/test_meshes.py::test_multidevice_suite_on_eight_fake_devices",
                         why="a mesh's own all-reduces change the bits: its cross_device knob case")
def test_compare_of_one_policy_on_one_device_and_a_mesh_has_a_gap():
    serve = json.loads(_cli(*_COMPARE, "--trainer", "serve-bf16", "--engine", "serve-bf16",
                            "--engine-mesh", "tensor=8"))
    assert serve["policy_diff"] == [] and serve["runs"][0]["max_abs_logp_diff"] > 0  # parallelism alone


def test_cli_rejects_a_bad_mesh_spec(capsys):
    from jaxalign.cli import main
    with pytest.raises(SystemExit):
        main(["compare", "--trainer-mesh", "model=2"])
    assert "expected AXIS=SIZE" in capsys.readouterr().err


def test_mesh_spec_errors_and_rules():
    assert parse_mesh_spec("data=2,tensor=4") == {"data": 2, "fsdp": 1, "expert": 1, "tensor": 4}
    for bad, says in [("tensor=0", "positive int"), ("tensor", "AXIS=SIZE"), ("pipeline=2", "AXIS=SIZE"),
                      ("data=2,data=2", "twice")]:
        with pytest.raises(ValueError, match=says):
            parse_mesh_spec(bad)
    with pytest.raises(ValueError, match="needs 64 devices"):
        make_mesh("data=64")
    with pytest.raises(ValueError, match="no sharding rule"):
        spec_for(("heads_typo",), {"tensor": 2})
    # a mesh axis divides a dimension or leaves it unsplit; one mesh axis at most once per array
    assert tuple(spec_for(("embed", "q_heads"), {"fsdp": 4, "tensor": 2}, (32, 32))) == ("fsdp", "tensor")
    assert tuple(spec_for(("kv_heads",), {"tensor": 4}, (2,))) == (None,)
    assert tuple(spec_for(("batch", "seq"), {"data": 2, "fsdp": 2}, (8, 5))) == (("data", "fsdp"), None)
