"""benchmarks/op_profile.py's trace arithmetic: self time under nesting, per thread, and the op categories."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from op_profile import category, op_kind, self_times  # noqa: E402


def _ev(name, ts, dur, tid=1):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid}


def test_self_time_subtracts_nested_ops_on_the_same_thread_only():
    events = [_ev("while.3", 0, 100), _ev("ynn_fusion.1", 10, 30), _ev("add_pad_fusion.2", 50, 20),
              _ev("copy.4", 55, 5),  # nested two deep: inside add_pad_fusion.2
              _ev("ynn_fusion.9", 20, 40, tid=2),  # another thread: not subtracted from while.3
              _ev("ThunkExecutor::Execute", 0, 500), _ev("$python frame", 0, 500),  # not ops
              {"ph": "i", "name": "marker", "ts": 3, "pid": 7, "tid": 1}]
    got = dict(self_times(events))
    assert got == {"while.3": 50, "ynn_fusion.1": 30, "add_pad_fusion.2": 15, "copy.4": 5, "ynn_fusion.9": 40}
    assert sum(got.values()) == 100 + 40  # every microsecond of an op counted once


def test_back_to_back_ops_are_siblings_not_nested():
    got = self_times([_ev("a.1", 0, 10), _ev("b.1", 10, 10), _ev("c.1", 20, 5)])
    assert sorted(got) == [("a.1", 10), ("b.1", 10), ("c.1", 5)]


def test_categories_follow_the_hlo_names():
    assert op_kind("add_pad_fusion.12") == "add_pad_fusion" and op_kind("while.1.2") == "while"
    assert [category(n) for n in ("ynn_fusion.3", "dot.1", "while.7", "conditional.2", "copy.5",
                                  "bitcast_dynamic-update-slice_fusion.1", "wrapped_scatter.2", "wrapped_reduce.1",
                                  "and_reduce_fusion.3", "reduce-precision_convert_fusion.4", "add_rsqrt_fusion")] \
        == ["matmul", "matmul", "loop", "loop", "data movement", "data movement", "data movement", "reduction",
            "reduction", "elementwise", "elementwise"]
