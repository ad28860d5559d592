"""tests/compile_profile.py, the plugin that measures the suite's compile time, run on a two-test file."""

import json
import os
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))

_FILE = '''
import jax, jax.numpy as jnp
import pytest

def test_compiles_one_program():
    assert float(jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)(jnp.arange(7.0)).sum()) != 0.0
    jax.clear_caches()  # the same program again: loaded from the persistent cache, not compiled
    assert float(jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)(jnp.arange(7.0)).sum()) != 0.0

@pytest.mark.bitwise
def test_compiles_nothing():
    assert sum(range(4)) == 6
'''
_CONFTEST = '''
def pytest_configure(config):
    config.addinivalue_line("markers", "bitwise: a bitwise claim")
'''


def test_compile_profile_counts_each_tests_own_compiles(tmp_path):
    (tmp_path / "test_two.py").write_text(_FILE)
    (tmp_path / "conftest.py").write_text(_CONFTEST)
    out = tmp_path / "profile.jsonl"
    out.write_text('{"test": "a stale row from an earlier run"}\n')  # replaced, not appended to
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}  # compile for real,
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path / "jit-cache")  # into a cache of the test's own
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTS, env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "compile_profile", "-p", "no:cacheprovider",
                           f"--compile-profile={out}", "test_two.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    *lines, last = map(json.loads, out.read_text().splitlines())
    rows = {r["test"]: r for r in lines}
    # the controlling process's session row comes last: the whole run's wall and CPU, and its xdist workers (none)
    session = last["session"]
    assert session["workers"] is None and 0 < session["wall_s"] and 0 < session["cpu_s"]
    assert session["wall_s"] >= sum(r["wall_s"] for r in lines)
    assert set(rows) == {"test_two.py::test_compiles_one_program", "test_two.py::test_compiles_nothing"}
    jitted, plain = rows["test_two.py::test_compiles_one_program"], rows["test_two.py::test_compiles_nothing"]
    assert jitted["compiles"] >= 1 and 0 < jitted["compile_s"] <= jitted["wall_s"]
    assert plain["compiles"] == 0 and plain["compile_s"] == 0.0
    assert plain["bitwise"] and not jitted["bitwise"]
    # the compile is charged to the test's own line that called the jitted function (jax's frames skipped)
    site = "test_two.py:6:test_compiles_one_program"
    assert set(jitted["sites"]) == {site, site.replace(":6:", ":8:")} and plain["sites"] == {}
    assert sum(s for s, _ in jitted["sites"].values()) == pytest.approx(jitted["compile_s"])
    # each compile listed with its persistent-cache key; the second call was a cache hit, not a compile
    # (JAX reports the load as a backend compile too: `compiles` counts both, `programs` the compiles only)
    loaded, compiled = jitted["sites"][site.replace(":6:", ":8:")], jitted["sites"][site]
    assert jitted["cache_hits"] == loaded[1] == compiled[1] and jitted["compiles"] == 2 * compiled[1]
    assert len(jitted["programs"]) == compiled[1] and "jit__lambda" in [p[0] for p in jitted["programs"]]
    for name, key, computation, devices, seconds in jitted["programs"]:
        assert all(isinstance(h, str) and len(h) == 16 and int(h, 16) >= 0 for h in (key, computation, devices))
    assert sum(p[4] for p in jitted["programs"]) == pytest.approx(compiled[0])
    assert plain["programs"] == [] and plain["cache_hits"] == 0
    assert "compile profile" in proc.stdout and "test_compiles_one_program" in proc.stdout
    assert "call sites with the most backend compile time" in proc.stdout and site in proc.stdout
