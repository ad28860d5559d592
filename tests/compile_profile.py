"""Where the suite's time goes: a pytest plugin that adds up JAX's own compile-time events per test.

    PYTHONPATH=tests python -m pytest -p compile_profile [--compile-profile FILE] tests/test_engine.py

For every test it records wall seconds and the seconds JAX reports (`jax.monitoring` duration events) for
tracing to a jaxpr, lowering to StableHLO and the backend compile, with the number of backend compiles, and the
compile time the persistent cache saved. Rows are appended to FILE (default `compile_profile.jsonl`; one JSON
object per line, from every xdist worker), and the terminal summary lists the tests with the most backend
compile time. Tests that run pytest or the CLI in a subprocess (the ISA legs, the multidevice suite) show only
their wall time: their compiles happen in the child.
"""

from __future__ import annotations

import collections
import json
import os
import time

import pytest

EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
          "/jax/core/compile/backend_compile_duration": "compile_s",
          "/jax/compilation_cache/compile_time_saved_sec": "cache_saved_s"}

_seconds: collections.Counter = collections.Counter()
_counts: collections.Counter = collections.Counter()
_rows: list[dict] = []


def _listener(event: str, duration: float, **_) -> None:
    """Add one JAX duration event to the running totals."""
    if event in EVENTS:
        _seconds[EVENTS[event]] += duration
        _counts[EVENTS[event]] += 1


def pytest_addoption(parser):
    """--compile-profile FILE."""
    parser.addoption("--compile-profile", default="compile_profile.jsonl",
                     help="compile_profile plugin: the JSONL file its per-test rows are appended to")


def pytest_configure(config):
    """Listen to JAX's duration events; the controlling process (not an xdist worker) starts a fresh file."""
    import jax
    if not hasattr(config, "workerinput"):
        open(config.getoption("--compile-profile"), "w").close()
    jax.monitoring.register_event_duration_secs_listener(_listener)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """One row per test: the events recorded while it ran (setup, call and teardown)."""
    seconds, counts, start = dict(_seconds), dict(_counts), time.perf_counter()
    yield
    row = {"test": item.nodeid, "wall_s": time.perf_counter() - start}
    row.update({name: _seconds[name] - seconds.get(name, 0.0) for name in EVENTS.values()})
    row["compiles"] = _counts["compile_s"] - counts.get("compile_s", 0)
    _rows.append(row)


def pytest_sessionfinish(session):
    """Append this process's rows (each xdist worker appends its own)."""
    with open(session.config.getoption("--compile-profile"), "a") as f:
        for row in _rows:
            f.write(json.dumps(row) + "\n")


def pytest_terminal_summary(terminalreporter, config):
    """The total compile share and the 15 tests with the most backend compile time."""
    path = config.getoption("--compile-profile")
    if not os.path.exists(path):
        return
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    wall, compile_s = sum(r["wall_s"] for r in rows), sum(r["compile_s"] for r in rows)
    terminalreporter.write_sep("=", f"compile profile ({path}: {len(rows)} rows)")
    terminalreporter.write_line(f"backend compile {compile_s:.1f} s of {wall:.1f} s test wall time "
                                f"({compile_s / wall:.0%})" if wall else "no test time recorded")
    for r in sorted(rows, key=lambda r: -r["compile_s"])[:15]:
        terminalreporter.write_line(f"{r['compile_s']:7.1f} s compile in {r['compiles']:4d} programs, "
                                    f"{r['wall_s']:7.1f} s wall  {r['test']}")
