"""Two processes on localhost (jax.distributed over CPU, gloo collectives) run GRPO together with the trainer
mesh spanning both, checkpoint, restore in fresh Trainers and finish -- with the same metrics, bitwise, as one
process on one device (aligned-bf16)."""

import json
import os
import socket
import subprocess
import sys

import pytest

from isa import child_env
from rl_settings import one_device_rows, sft_cache, strip_timing

TESTS = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_train_checkpoint_and_resume_like_one_device(tmp_path):
    # two steps (tests/multidevice/rl_worker.py runs them too): the first stops, checkpoints and is resumed from
    reference = one_device_rows(str(tmp_path), steps=2)
    cache = sft_cache(str(tmp_path))  # the warm start the reference made, which the workers load
    port = _free_port()
    procs, outs = [], []
    for pid in range(2):
        # one CPU device per process (no fake device count): the mesh's two devices are in two processes;
        # the rest of XLA_FLAGS (an ISA cap) is kept
        env = child_env(JAXALIGN_COORDINATOR=f"127.0.0.1:{port}", JAXALIGN_NUM_PROCESSES="2",
                        JAXALIGN_PROCESS_ID=str(pid))
        out = str(tmp_path / f"rows{pid}.json")
        outs.append(out)
        procs.append(subprocess.Popen([sys.executable, os.path.join(TESTS, "multidevice", "rl_worker.py"), TESTS, cache,
                                       str(tmp_path / "run"), out], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:  # a generous limit (a loaded 2-core machine runs each process on a fraction of a core); none left behind
        logs = [p.communicate(timeout=1800)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    results = [json.load(open(o)) for o in outs]
    assert [r["process"] for r in results] == [0, 1]
    assert all(r["devices"] == 2 for r in results)
    assert os.path.isdir(tmp_path / "run" / "checkpoints" / "1")  # written by both, restored from by both
    for r in results:
        assert strip_timing(r["rows"]) == reference
    assert [row["step"] for row in reference] == [0, 1, 2]
