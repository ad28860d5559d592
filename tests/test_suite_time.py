"""benchmarks/suite_time.py: each test's row goes to one part of the suite, the parts add up, the floor is the
bitwise claims' share, and a file that is not a compile profile is refused with the line that is wrong."""

import json
import re
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from suite_time import FLOOR, main, programs_summary, read_profile, summarize  # noqa: E402


def _row(test, wall, bitwise=False, compile_s=0.0, trace_s=0.0, lower_s=0.0):
    return {"test": test, "wall_s": wall, "bitwise": bitwise, "compile_s": compile_s, "trace_s": trace_s,
            "lower_s": lower_s}


ROWS = [
    _row("tests/test_isa_matrix.py::test_bitwise_claims_hold_under_isa[AVX2]", 500.0),
    _row("tests/test_isa_matrix.py::test_bitwise_claims_hold_under_isa[SSE4_2]", 400.0),
    _row("tests/test_isa_matrix.py::test_a_leg_is_skipped_only_where_it_would_repeat_the_run", 0.5),
    _row("tests/test_meshes.py::test_multidevice_suite_on_eight_fake_devices", 300.0),
    _row("tests/test_meshes.py::test_compare_between_differently_parallelised_trainer_and_engine", 30.0),
    _row("tests/test_multiprocess.py::test_two_processes_train_checkpoint_and_resume_like_one_device", 200.0, True,
         compile_s=50.0),
    _row("tests/test_notebooks.py::test_notebook_executes[01_where_mismatch_arises.ipynb]", 100.0),
    _row("tests/test_cli.py::test_demo_quick_runs", 90.0),
    _row("tests/test_alignment.py::test_aligned_is_bitwise_for_every_batch_and_schedule[x]", 40.0, True,
         compile_s=30.0, trace_s=4.0, lower_s=2.0),
    _row("tests/test_engine.py::test_eos_and_continuous_refills", 10.0, compile_s=8.0, trace_s=1.0),
]


def test_each_row_goes_to_one_part_and_the_parts_add_up():
    summary = summarize(ROWS, {"wall_s": 1100.0, "cpu_s": 2150.0, "workers": 2})
    parts = {p["part"]: p for p in summary["parts"]}
    assert parts["ISA legs"]["tests"] == 2 and parts["ISA legs"]["worker_s"] == 900.0
    assert parts["multidevice suite"]["worker_s"] == 300.0  # the mesh-compare test runs here, not in the suite
    assert parts["two-process test"]["worker_s"] == 200.0  # a part of its own, though marked bitwise
    assert parts["other bitwise tests"] == {"part": "other bitwise tests", "tests": 1, "worker_s": 40.0,
                                            "compile_s": 30.0, "trace_lower_s": 6.0}
    assert parts["other tests"]["tests"] == 3 and parts["other tests"]["worker_s"] == 40.5
    assert sum(p["tests"] for p in parts.values()) == len(ROWS)
    assert summary["worker_s"] == pytest.approx(sum(r["wall_s"] for r in ROWS))
    assert summary["floor_worker_s"] == 40.0 + 900.0 + 300.0 + 200.0
    assert summary["floor_minutes"] == pytest.approx(1440.0 / 2 / 60)
    assert set(FLOOR) <= set(parts)
    files = {f["file"]: f for f in summary["files"]}  # each file's tests once, most worker-seconds first
    assert [f["worker_s"] for f in summary["files"]] == sorted((f["worker_s"] for f in files.values()), reverse=True)
    assert files["tests/test_isa_matrix.py"]["tests"] == 3 and files["tests/test_isa_matrix.py"]["worker_s"] == 900.5
    assert files["tests/test_alignment.py"] == {"file": "tests/test_alignment.py", "tests": 1, "worker_s": 40.0,
                                                "compile_s": 30.0, "trace_lower_s": 6.0}
    assert sum(f["tests"] for f in files.values()) == len(ROWS)
    assert sum(f["worker_s"] for f in files.values()) == pytest.approx(summary["worker_s"])


def test_a_profile_file_round_trips_and_garbage_is_refused_with_its_line(tmp_path, capsys):
    good = tmp_path / "suite.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in ROWS) + json.dumps(
        {"session": {"wall_s": 1100.0, "cpu_s": 2150.0, "workers": 2}}) + "\n")
    rows, session = read_profile(str(good))
    assert rows == ROWS and session["workers"] == 2
    out = tmp_path / "suite_time.json"
    assert main([str(good), "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["floor_worker_s"] == 1440.0 and record["session"]["cpu_s"] == 2150.0 and "machine" in record
    printed = capsys.readouterr().out
    assert "12.0 min on 2 workers" in printed and re.search(r"\ntests/test_isa_matrix\.py +3 +900 ", printed)
    assert record["files"][0]["file"] == "tests/test_isa_matrix.py" and len(record["files"]) == 7
    assert main([str(good), "--out", str(out), "--files", "2"]) == 0  # two printed, all written
    assert "the 2 of 7 test files" in capsys.readouterr().out and len(json.loads(out.read_text())["files"]) == 7
    with pytest.raises(SystemExit):
        main([str(good), "--out", str(out), "--files", "-1"])
    assert "no per-compile records in this profile" in printed  # these rows list no programs
    for text, needle in (("{not json\n", ":1: not a JSON line"), ('{"tests": 1}\n', ":1: expected a test row"),
                         (json.dumps(ROWS[0]) + "\n[1, 2]\n", ":2: expected a test row"), ("\n", "no test rows"),
                         (json.dumps({**ROWS[0], "programs": [["jit_f", "k", "c", "d"]]}) + "\n", ":1: `programs`"),
                         (json.dumps({**ROWS[0], "programs": [["jit_f", "k", "c", "d", "1s"]]}) + "\n",
                          ":1: `programs`")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text)
        with pytest.raises(ValueError, match=needle):
            read_profile(str(bad))
    with pytest.raises(SystemExit):  # the command names the file and the line, and writes nothing
        main([str(bad), "--out", str(tmp_path / "none.json")])
    assert not (tmp_path / "none.json").exists()


def test_programs_are_split_into_repeats_other_keys_and_distinct_ones(tmp_path, capsys):
    # [name, cache key, computation, devices, seconds], in the order the tests ran
    first = _row("tests/test_a.py::test_one", 10.0) | {"cache_hits": 2, "programs": [
        ["jit_run_static", "k1", "c1", "d1", 6.0], ["jit__forward", "k2", "c2", "d1", 2.0],
        [None, None, None, None, 0.5]]}  # compiled without a persistent cache: totals only
    second = _row("tests/test_b.py::test_two", 9.0) | {"cache_hits": 1, "programs": [
        ["jit_run_static", "k1", "c1", "d1", 5.0],  # the same key again: another worker at the same time
        ["jit__forward", "k3", "c2", "d8", 3.0],  # the same computation for another device count
        ["jit_run_static", "k4", "c4", "d1", 4.0]]}
    summary = programs_summary([first, second, _row("tests/test_c.py::test_none", 1.0)])
    assert summary["all"] == {"compiles": 6, "seconds": 20.5} and summary["cache_hits"] == 3
    assert summary["again"] == {"compiles": 1, "seconds": 5.0}
    assert summary["other_key"] == {"compiles": 1, "seconds": 3.0}
    assert summary["distinct"] == {"compiles": 4, "seconds": 12.5}  # k1, k2, k4 and the keyless one
    assert [(n["name"], n["compiles"], n["seconds"]) for n in summary["by_name"]] == [
        ("jit_run_static", 3, 15.0), ("jit__forward", 2, 5.0), ("?", 1, 0.5)]
    profile = tmp_path / "suite.jsonl"
    profile.write_text(json.dumps(first) + "\n" + json.dumps(second) + "\n")
    out = tmp_path / "suite_time.json"
    assert main([str(profile), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"of a key compiled before +1 +5\n", printed) and re.search(r"distinct programs +4 +12\n", printed)
    assert json.loads(out.read_text())["programs"]["other_key"] == {"compiles": 1, "seconds": 3.0}
