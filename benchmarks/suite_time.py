"""Where the test suite's time goes, by part, from one whole run under the compile-profile plugin:

    PYTHONPATH=tests python -m pytest -q -p compile_profile --compile-profile=suite.jsonl
    python benchmarks/suite_time.py suite.jsonl

Each test's row (tests/compile_profile.py) is put in one part -- the ISA legs, the multidevice suite, the
two-process test, the notebooks, the CLI tests, the other `bitwise` tests, the rest -- and each part's
worker-seconds (the sum of its tests' wall times), backend compile and trace+lower seconds are added up; so is
each test file's (the `--files` with the most worker-seconds are printed, all of them written). The
floor is what the bitwise claims alone take (the native `bitwise` tests, the legs, the multidevice suite and the
two-process test: the claims issue 19 asks to hold on every ISA and mesh) in minutes of the run's workers, before
any other test. Subprocess tests (legs, multidevice, notebooks, CLI) show wall time only: their compiles happen in
the child. From the programs each row lists (tests/compile_profile.py: every backend compile with its persistent
cache key) it also counts the compiles that repeat a key (two workers compiling one program at once), those of a
computation already compiled under another key (e.g. in a process with another device count), and the distinct
programs left -- the suite's floor under the shared cache -- with the jit names that cost the most.
Writes benchmarks/results/suite_time.json (`--out` elsewhere) with the run's session row (wall, CPU,
workers) and the machine the summary was made on -- run it on the machine that ran the suite.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_json  # noqa: E402,I001

# (part, test of a node id and its row); the first that matches takes the test
PARTS = (
    ("ISA legs", lambda test, row: "test_isa_matrix.py::test_bitwise_claims_hold_under_isa[" in test),
    ("multidevice suite", lambda test, row: test.startswith("tests/test_meshes.py::test_multidevice_suite")),
    ("two-process test", lambda test, row: test.startswith("tests/test_multiprocess.py::")),
    ("notebooks", lambda test, row: test.startswith("tests/test_notebooks.py::")),
    ("CLI tests", lambda test, row: test.startswith("tests/test_cli.py::")),
    ("other bitwise tests", lambda test, row: bool(row.get("bitwise"))),
    ("other tests", lambda test, row: True),
)
FLOOR = ("other bitwise tests", "ISA legs", "multidevice suite", "two-process test")


def read_profile(path: str) -> tuple[list[dict], dict | None]:
    """The test rows and the session row (None if the run did not finish) of a compile-profile JSONL file."""
    rows, session = [], None
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not a JSON line ({exc.msg}); expected the rows "
                                 "tests/compile_profile.py writes") from None
            if isinstance(row, dict) and "session" in row:
                session = row["session"]
            elif isinstance(row, dict) and isinstance(row.get("test"), str) and "wall_s" in row:
                if not all(isinstance(p, list) and len(p) == 5 and isinstance(p[4], (int, float))
                           for p in row.get("programs", [])):
                    raise ValueError(f"{path}:{number}: `programs` must list [name, key, computation, devices, "
                                     "seconds] per compile")
                rows.append(row)
            else:
                raise ValueError(f"{path}:{number}: expected a test row (`test`, `wall_s`, ...) or a session row, "
                                 f"got {line.strip()[:80]!r}")
    if not rows:
        raise ValueError(f"{path}: no test rows; run the suite with `-p compile_profile --compile-profile={path}`")
    return rows, session


def _add(total: dict, row: dict) -> None:
    """Add one test's row to a part's or a file's running totals."""
    total["tests"] += 1
    total["worker_s"] += row["wall_s"]
    total["compile_s"] += row.get("compile_s", 0.0)
    total["trace_lower_s"] += row.get("trace_s", 0.0) + row.get("lower_s", 0.0)


def _totals(key: str, name: str) -> dict:
    return {key: name, "tests": 0, "worker_s": 0.0, "compile_s": 0.0, "trace_lower_s": 0.0}


def summarize(rows: list[dict], session: dict | None) -> dict:
    """Per part and per test file (most worker-seconds first): tests, worker-seconds, compile and trace+lower
    seconds; their total; the bitwise floor."""
    parts = {name: _totals("part", name) for name, _ in PARTS}
    files: dict[str, dict] = {}
    for row in rows:
        _add(parts[next(name for name, matches in PARTS if matches(row["test"], row))], row)
        path = row["test"].split("::", 1)[0]
        _add(files.setdefault(path, _totals("file", path)), row)
    total = sum(p["worker_s"] for p in parts.values())
    workers = (session or {}).get("workers") or 1
    floor = sum(parts[name]["worker_s"] for name in FLOOR)
    return {"parts": list(parts.values()), "files": sorted(files.values(), key=lambda f: -f["worker_s"]),
            "worker_s": total, "session": session, "workers": workers, "floor_worker_s": floor,
            "floor_minutes": floor / workers / 60}


def programs_summary(rows: list[dict]) -> dict:
    """The backend compiles the rows list (`programs`: [name, cache key, computation hash, devices hash, seconds]),
    in the order the tests ran: how many and how long in all; how many repeat a key compiled before (`again`), how
    many compile a computation already compiled under another key (`other_key`), the distinct programs left, and
    the seconds per jit name (most first). Compiles without a key (no persistent cache) count in the totals only."""
    total = {"compiles": 0, "seconds": 0.0}
    again = {"compiles": 0, "seconds": 0.0}
    other_key = {"compiles": 0, "seconds": 0.0}
    keys, computations, by_name = set(), set(), {}
    for row in rows:
        for name, key, computation, _devices, seconds in row.get("programs", []):
            total["compiles"] += 1
            total["seconds"] += seconds
            named = by_name.setdefault(name or "?", {"name": name or "?", "compiles": 0, "seconds": 0.0})
            named["compiles"] += 1
            named["seconds"] += seconds
            if key is None:
                continue
            if key in keys:
                again["compiles"] += 1
                again["seconds"] += seconds
            elif computation is not None and computation in computations:
                other_key["compiles"] += 1
                other_key["seconds"] += seconds
            keys.add(key)
            if computation is not None:
                computations.add(computation)
    distinct = {"compiles": total["compiles"] - again["compiles"] - other_key["compiles"],
                "seconds": total["seconds"] - again["seconds"] - other_key["seconds"]}
    return {"all": total, "again": again, "other_key": other_key, "distinct": distinct,
            "cache_hits": sum(row.get("cache_hits", 0) for row in rows),
            "by_name": sorted(by_name.values(), key=lambda n: -n["seconds"])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", help="the JSONL file a `-p compile_profile` run wrote")
    parser.add_argument("--out", default="benchmarks/results/suite_time.json")
    parser.add_argument("--files", type=int, default=15, help="print this many test files, most worker-s first "
                        "(the JSON has them all)")
    args = parser.parse_args(argv)
    from jaxalign import report
    try:
        rows, session = read_profile(args.profile)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    if args.files < 0:
        parser.error(f"--files {args.files}: expected a count >= 0")
    summary, programs = summarize(rows, session), programs_summary(rows)

    def rounded(totals):
        return [{**t, **{k: round(t[k]) for k in ("worker_s", "compile_s", "trace_lower_s")}} for t in totals]
    table = report.table(rounded(summary["parts"]), ["part", "tests", "worker_s", "compile_s", "trace_lower_s"])
    by_file = report.table(rounded(summary["files"][:args.files]),
                           ["file", "tests", "worker_s", "compile_s", "trace_lower_s"])
    print(table)
    print(f"\nthe {min(args.files, len(summary['files']))} of {len(summary['files'])} test files with the most "
          f"worker-s (subprocess tests count their wall time only)\n{by_file}\n")
    session = summary["session"]
    if session:
        print(f"session: {session['wall_s'] / 60:.1f} min wall, {session['cpu_s']:.0f} s CPU, "
              f"{summary['workers']} workers")
    compiles_table = report.table(
        [{"compiles": label, "n": programs[key]["compiles"], "seconds": round(programs[key]["seconds"])}
         for key, label in (("all", "all backend compiles"), ("again", "of a key compiled before"),
                            ("other_key", "of a computation compiled under another key"),
                            ("distinct", "distinct programs"))], ["compiles", "n", "seconds"])
    by_name = report.table([{**n, "seconds": round(n["seconds"])} for n in programs["by_name"][:8]],
                           ["name", "compiles", "seconds"])
    if any("programs" in row for row in rows):
        print(f"in-process backend compiles ({programs['cache_hits']} persistent-cache hits spared others; "
              f"subprocess tests' compiles are not here)\n{compiles_table}\n{by_name}\n")
    else:
        print("no per-compile records in this profile (written before tests/compile_profile.py listed programs)\n")
    print(f"all tests: {summary['worker_s']:.0f} worker-s; the bitwise claims alone ({', '.join(FLOOR)}): "
          f"{summary['floor_worker_s']:.0f} worker-s = {summary['floor_minutes']:.1f} min on {summary['workers']} "
          "workers")
    write_json(args.out, {"args": vars(args), **summary, "programs": programs,
                          "tables": {"suite_time": table, "files": by_file, "programs": compiles_table,
                                     "programs_by_name": by_name}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
