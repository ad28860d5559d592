"""Where the suite's time goes: a pytest plugin that adds up JAX's own compile-time events per test.

    PYTHONPATH=tests python -m pytest -p compile_profile [--compile-profile=FILE] tests/test_engine.py

For every test it records wall seconds and the seconds JAX reports (`jax.monitoring` duration events) for
tracing to a jaxpr, lowering to StableHLO and the backend compile, with the number of backend compiles, and the
compile time the persistent cache saved, and which lines asked for the compiles (`sites`: the innermost
frame outside the interpreter's libraries -- jaxalign's or the test's own code -- with its compile seconds and
count), and whether it is marked `bitwise`. With the persistent compilation cache on (the suite's default) each
backend compile is also listed in `programs` as [jit name, cache key, hash of its computation, hash of the devices
it was compiled for, seconds] -- the key JAX computes (jax._src.cache_key) and logs at DEBUG, which this plugin
reads -- and the row counts the `cache_hits` that spared a compile, so `benchmarks/suite_time.py` can tell a
program compiled again (the same key twice: two workers at once) from one compiled once per device topology (the
same computation, another device count) and from the distinct programs the tests need. Rows are appended to FILE (default `compile_profile.jsonl`; one
JSON object per line, from every xdist worker); the controlling process adds a last `{"session": ...}` row with the
run's wall and CPU seconds (its own and its children's: xdist workers and every process they started) and the
number of workers. The terminal summary lists the tests and the call sites with the most backend compile time.
Tests that run pytest or the CLI in a subprocess (the ISA legs, the multidevice suite) show only their wall time:
their compiles happen in the child. `python benchmarks/suite_time.py FILE` sums a whole run by part.
Write the option as `--compile-profile=FILE`: pytest picks its rootdir before this plugin's option exists, so a
separate FILE argument is taken for a test path, and one outside the project (`/tmp/x.jsonl`) moved the rootdir
and every test id with it (tests/conftest.py refuses such a run).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import resource
import sysconfig
import time
import traceback

import pytest

EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
          "/jax/core/compile/backend_compile_duration": "compile_s",
          "/jax/compilation_cache/compile_time_saved_sec": "cache_saved_s"}

_seconds: collections.Counter = collections.Counter()
_counts: collections.Counter = collections.Counter()
_site_seconds: collections.Counter = collections.Counter()
_site_counts: collections.Counter = collections.Counter()
_rows: list[dict] = []
_programs: list[list] = []
_cache_hits = [0]
_LIBRARIES = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})


class _CacheKeyLog(logging.Handler):
    """Reads the DEBUG lines JAX logs while it computes a program's persistent-cache key and looks it up: the
    hashes of the serialized computation and accelerator config, then a miss (a compile follows) or a hit."""

    _HASH = re.compile(r"get_cache_key hash of serialized (computation|accelerator_config): (\w+)")
    _LOOKUP = re.compile(r"(PERSISTENT COMPILATION CACHE MISS|Persistent compilation cache hit) for '([^']+)' "
                         r"with key '([^']+)'")

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.hashes: dict[str, str] = {}
        self.miss: tuple[str, str, str, str] | None = None  # (name, key, computation, accelerator) to compile
        self.hit = False  # the next backend-compile event is a load from the cache

    def emit(self, record):
        message = record.getMessage()
        found = self._HASH.match(message)
        if found:
            self.hashes[found.group(1)] = found.group(2)[:16]
            return
        found = self._LOOKUP.match(message)
        if found and found.group(1).startswith("Persistent"):
            _cache_hits[0] += 1
            self.hit = True
        elif found:
            key = found.group(3).rsplit("-", 1)[-1][:16]
            self.miss = (found.group(2), key, self.hashes.get("computation"), self.hashes.get("accelerator_config"))


_KEY_LOG = _CacheKeyLog()


def _call_site() -> str:
    """`path:line:function` of the innermost frame that is neither the interpreter's libraries (jax, flax, the
    standard library, installed packages) nor this plugin: the project line whose call compiled."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_LIBRARIES) and frame.filename != __file__ \
                and not frame.filename.startswith("<"):
            return f"{os.path.relpath(frame.filename)}:{frame.lineno}:{frame.name}"
    return "?"


def _listener(event: str, duration: float, **_) -> None:
    """Add one JAX duration event to the running totals (a backend compile also to its call site's)."""
    if event in EVENTS:
        _seconds[EVENTS[event]] += duration
        _counts[EVENTS[event]] += 1
    if EVENTS.get(event) == "compile_s":
        if _KEY_LOG.hit:  # JAX reports loading an executable from the persistent cache as a backend compile
            _KEY_LOG.hit = False
        else:
            name, key, computation, devices = _KEY_LOG.miss or (None, None, None, None)
            _programs.append([name, key, computation, devices, duration])
        _KEY_LOG.miss = None
        site = _call_site()
        _site_seconds[site] += duration
        _site_counts[site] += 1


def pytest_addoption(parser):
    """--compile-profile=FILE (with `=`: see the module docstring)."""
    parser.addoption("--compile-profile", default="compile_profile.jsonl",
                     help="compile_profile plugin: the JSONL file its per-test rows are appended to")


def _cpu_seconds() -> float:
    """User and system CPU of this process and of its children that have ended."""
    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


def pytest_configure(config):
    """Listen to JAX's duration events; the controlling process (not an xdist worker) starts a fresh file."""
    import jax
    if not hasattr(config, "workerinput"):
        open(config.getoption("--compile-profile"), "w").close()
        config._compile_profile_start = (time.perf_counter(), _cpu_seconds())
    jax.monitoring.register_event_duration_secs_listener(_listener)
    for name in ("jax._src.cache_key", "jax._src.compiler"):
        logger = logging.getLogger(name)
        logger.addHandler(_KEY_LOG)
        logger.setLevel(logging.DEBUG)


def pytest_unconfigure(config):
    """The controlling process appends the session row, after its workers have ended."""
    start = getattr(config, "_compile_profile_start", None)
    if start is None:
        return
    workers = getattr(config.option, "numprocesses", None)  # xdist's -n (an int once it has resolved "auto")
    with open(config.getoption("--compile-profile"), "a") as f:
        f.write(json.dumps({"session": {"wall_s": time.perf_counter() - start[0], "cpu_s": _cpu_seconds() - start[1],
                                        "workers": workers if isinstance(workers, int) else None}}) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """One row per test: the events recorded while it ran (setup, call and teardown)."""
    seconds, counts, start = dict(_seconds), dict(_counts), time.perf_counter()
    _site_seconds.clear()
    _site_counts.clear()
    _programs.clear()
    _cache_hits[0] = 0
    yield
    row = {"test": item.nodeid, "wall_s": time.perf_counter() - start,
           "bitwise": item.get_closest_marker("bitwise") is not None}
    row.update({name: _seconds[name] - seconds.get(name, 0.0) for name in EVENTS.values()})
    row["compiles"] = _counts["compile_s"] - counts.get("compile_s", 0)
    row["sites"] = {site: [s, _site_counts[site]] for site, s in _site_seconds.most_common()}
    row["programs"] = [list(p) for p in _programs]
    row["cache_hits"] = _cache_hits[0]
    _rows.append(row)


def pytest_sessionfinish(session):
    """Append this process's rows (each xdist worker appends its own)."""
    with open(session.config.getoption("--compile-profile"), "a") as f:
        for row in _rows:
            f.write(json.dumps(row) + "\n")


def pytest_terminal_summary(terminalreporter, config):
    """The total compile share, and the 15 tests and the 15 call sites with the most backend compile time."""
    path = config.getoption("--compile-profile")
    if not os.path.exists(path):
        return
    with open(path) as f:
        rows = [row for row in map(json.loads, filter(str.strip, f)) if "test" in row]
    wall, compile_s = sum(r["wall_s"] for r in rows), sum(r["compile_s"] for r in rows)
    terminalreporter.write_sep("=", f"compile profile ({path}: {len(rows)} rows)")
    terminalreporter.write_line(f"backend compile {compile_s:.1f} s of {wall:.1f} s test wall time "
                                f"({compile_s / wall:.0%})" if wall else "no test time recorded")
    for r in sorted(rows, key=lambda r: -r["compile_s"])[:15]:
        terminalreporter.write_line(f"{r['compile_s']:7.1f} s compile in {r['compiles']:4d} programs, "
                                    f"{r['wall_s']:7.1f} s wall  {r['test']}")
    sites, site_counts = collections.Counter(), collections.Counter()
    for r in rows:
        for site, (s, n) in r.get("sites", {}).items():
            sites[site] += s
            site_counts[site] += n
    terminalreporter.write_sep("-", "call sites with the most backend compile time")
    for site, s in sites.most_common(15):
        terminalreporter.write_line(f"{s:7.1f} s compile in {site_counts[site]:4d} programs  {site}")
