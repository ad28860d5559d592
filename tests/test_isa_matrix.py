"""The ISA matrix: every test marked `bitwise` (a bitwise or knob claim) runs again under
`XLA_FLAGS=--xla_cpu_max_isa=AVX2` and `=SSE4_2`, each in a fresh pytest process (XLA reads its flags when its
backend starts). XLA:CPU's code depends on the instruction set -- the vector width a reduce is split by, whether
a multiply-add is contracted into an FMA (AVX2 and later) -- so a claim checked on one CPU only holds there.
The native leg is the ordinary run of the same tests. `python -m pytest -q` (the README's command, which
.ci/run calls) reaches this module, so CI runs the matrix; `-m bitwise` alone runs one leg.

Inside a leg the multidevice suite (tests/test_meshes.py) runs only its `bitwise` cases, a representative mesh
per claim, and the two-process test does not run: its numerics are the single-process mesh RL run's (marked),
and what it adds (gloo, checkpoints) does not depend on the ISA.

Each leg is one pytest process of its own (`-n 0`: no workers of its own), and one unit of the suite's two
xdist workers, scheduled first (tests/conftest.py, LONGEST_FIRST)."""

import os
import subprocess
import sys
import time

import pytest

from isa import ISA_FLAG, child_env, current_isa

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEGS = ["AVX2", "SSE4_2"]


@pytest.mark.slow
@pytest.mark.parametrize("isa", LEGS)
def test_bitwise_claims_hold_under_isa(isa):
    if current_isa() == isa:
        pytest.skip(f"this run is already capped at {isa}: its own bitwise tests are this leg")
    env = child_env(f"{ISA_FLAG}={isa}", JAXALIGN_ISA_LEG=isa)
    env["XLA_FLAGS"] = " ".join(f for f in env["XLA_FLAGS"].split() if not f.startswith(ISA_FLAG + "=")
                                or f == f"{ISA_FLAG}={isa}")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-m", "bitwise", "-p", "no:cacheprovider",
                           "--durations=5", os.path.join(ROOT, "tests")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1800)
    print(f"ISA leg {isa}: {time.perf_counter() - start:.0f} s\n{proc.stdout[-3000:]}")
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout
