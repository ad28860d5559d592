"""The ISA matrix: every test marked `bitwise` (a bitwise or knob claim) runs again under
`XLA_FLAGS=--xla_cpu_max_isa=AVX2` and `=SSE4_2`, each in a fresh pytest process (XLA reads its flags when its
backend starts). XLA:CPU's code depends on the instruction set -- the vector width a reduce is split by, whether
a multiply-add is contracted into an FMA (AVX2 and later) -- so a claim checked on one CPU only holds there.
The native leg is the ordinary run of the same tests; on a CPU whose best instruction set is AVX2 (a Zen 3 EPYC,
say) that run is the AVX2 leg, which then skips itself (a cap only removes features above it). `python -m pytest -q` (the README's command, which
.ci/run calls) reaches this module, so CI runs the matrix; `-m bitwise` alone runs one leg.

A leg runs one case per claim: the parametrised cases tests/isa.py LEG_REPEATS lists repeat a claim another case
makes under that ISA, and each names the case that still covers it (tests/conftest.py checks the list whenever a
leg collects the suite). All the run's processes share one persistent compilation cache (tests/conftest.py); its
key hashes XLA_FLAGS, so a leg compiles its own executables (the last test here proves it).

The README's command runs the *core* of each leg: every primitive claim and one end-to-end engine == trainer
case (tests/isa.py says why); `JAXALIGN_MATRIX=full` runs the full matrix, which adds the cases tests/isa.py
FULL_MATRIX_ONLY and CORE_LEG_LEAVES list (each with the core case that still checks its numerics), the
multidevice suite among them. Inside a full leg the multidevice suite (tests/test_meshes.py) runs only its
`bitwise` cases, a representative mesh per claim, less its RL run on a mesh (a LEG_REPEATS entry: the leg's gradient, generation and
logprob cases on that mesh, the optimizer's and the loss's order tests are its numerics); the two-process test
does not run in either: its numerics are the mesh RL run's, and what it adds (gloo, checkpoints) does not depend
on the ISA.

Each leg is one pytest process of its own (`-n 0`: no workers of its own), and one unit of the suite's two
xdist workers, scheduled first (tests/conftest.py, LONGEST_FIRST)."""

import json
import os
import subprocess
import sys
import time

import pytest

from isa import (_STATIC_CHUNKED, CORE_LEG_LEAVES, FULL_MATRIX_ONLY, ISA_FLAG, LEG_REPEATS, LEGS, MATRIX_ENV,
                 child_env, core_leg, core_scope_errors, current_isa, full_matrix_only, leg_already_run,
                 matrix_scope)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.parametrize("isa", LEGS)
def test_bitwise_claims_hold_under_isa(isa):
    reason = leg_already_run(isa)
    if reason:
        pytest.skip(reason)
    scope = matrix_scope()  # refused here, before a leg starts, if JAXALIGN_MATRIX is not a scope
    if scope == "core" and isa != core_leg():
        pytest.skip(f"the core runs one leg, {core_leg()} on this host (the first below its own instruction set); "
                    f"{MATRIX_ENV}=full runs every leg")
    env = child_env(f"{ISA_FLAG}={isa}", JAXALIGN_ISA_LEG=isa, **{MATRIX_ENV: scope})
    env["XLA_FLAGS"] = " ".join(f for f in env["XLA_FLAGS"].split() if not f.startswith(ISA_FLAG + "=")
                                or f == f"{ISA_FLAG}={isa}")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-m", "bitwise", "-p", "no:cacheprovider",
                           "--durations=5", os.path.join(ROOT, "tests")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1800)
    print(f"ISA leg {isa} ({scope}): {time.perf_counter() - start:.0f} s\n{proc.stdout[-3000:]}")
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout


def test_the_core_runs_the_first_leg_below_the_hosts_own_instruction_set():
    avx512, zen3 = {"sse4_2", "avx", "avx2", "fma", "avx512f"}, {"sse4_2", "avx", "avx2", "fma"}
    assert core_leg("", avx512) == "AVX2" and core_leg("", zen3) == "SSE4_2"
    assert core_leg("--xla_cpu_max_isa=AVX2", avx512) == "SSE4_2"  # a run capped at AVX2 is that leg itself


def test_a_leg_is_skipped_only_where_it_would_repeat_the_run():
    avx512, zen3 = {"sse4_2", "avx", "avx2", "fma", "avx512f"}, {"sse4_2", "avx", "avx2", "fma"}
    assert leg_already_run("AVX2", "", avx512) is None and leg_already_run("SSE4_2", "", avx512) is None
    assert "best instruction set is AVX2" in leg_already_run("AVX2", "", zen3)
    assert leg_already_run("SSE4_2", "", zen3) is None
    assert "already capped" in leg_already_run("SSE4_2", "--xla_cpu_max_isa=SSE4_2", avx512)
    assert leg_already_run("AVX2", "--xla_cpu_max_isa=SSE4_2", zen3) is None  # capped below the CPU: not native


def test_the_matrix_scope_is_core_unless_full_is_asked_for_and_anything_else_is_refused():
    assert matrix_scope({}) == "core" and matrix_scope({MATRIX_ENV: ""}) == "core"
    assert matrix_scope({MATRIX_ENV: "full"}) == "full"
    for bad in ("all", "FULL", "off", "core,full"):
        with pytest.raises(ValueError, match=f"{MATRIX_ENV}=.*expected one of core, full"):
            matrix_scope({MATRIX_ENV: bad})
    # the variable's old name is refused by name, not ignored (a user asking for the full matrix would get the core)
    with pytest.raises(ValueError, match=f"JAXALIGN_ISA_LEGS is now {MATRIX_ENV}.*{MATRIX_ENV}=full"):
        matrix_scope({"JAXALIGN_ISA_LEGS": "full"})


def test_the_core_scope_check_catches_a_stale_prefix_and_a_cover_the_core_does_not_run():
    """conftest runs core_scope_errors on every leg's collection; here on made-up collections, so that a list
    which no longer matches the suite cannot pass unnoticed."""
    prefixes = list(FULL_MATRIX_ONLY) + [p for leaves in CORE_LEG_LEAVES.values() for p in leaves]
    every = {prefix + ("x" if prefix.endswith("::") else "") for prefix in prefixes}
    covers = {cover for cover, _ in FULL_MATRIX_ONLY.values() if cover}
    covers |= {cover for leaves in CORE_LEG_LEAVES.values() for cover, _ in leaves.values() if cover}
    assert core_scope_errors(every | covers) == []
    stale = sorted(FULL_MATRIX_ONLY)[0]
    assert any("matches no bitwise test" in e and stale in e for e in core_scope_errors((every - {stale + "x", stale})
                                                                                        | covers))
    cover = next(c for c, _ in FULL_MATRIX_ONLY.values() if c)
    assert any("not a bitwise case a core leg runs" in e for e in core_scope_errors(every | covers - {cover}))
    assert not set(covers) & set(LEG_REPEATS)
    # the core's one leg (AVX2) runs the excess-precision flag; every leg leaves the knobs to the full matrix
    flag = "tests/test_alignment.py::test_excess_precision_is_off_and_would_make_bf16_bits_depend_on_fusion"
    assert not full_matrix_only(flag, "AVX2") and not full_matrix_only(flag, "SSE4_2") and not full_matrix_only(flag)
    knob = "tests/test_knobs.py::test_knob_changes_numbers_and_restores[reduction=tree]"
    assert full_matrix_only(knob, "AVX2") and full_matrix_only(knob, "SSE4_2")
    assert not full_matrix_only(_STATIC_CHUNKED, "AVX2") and not full_matrix_only(_STATIC_CHUNKED, "SSE4_2")


def test_a_full_matrix_mark_needs_a_cover_the_core_runs():
    """conftest checks the `full_matrix` marks of every collection (native, a leg, the multidevice suite) with
    full_matrix_errors; here on made-up items, so that a mark whose cover was renamed or left to the full matrix
    too cannot pass unnoticed."""
    from conftest import full_matrix_errors

    class Item:  # what full_matrix_errors reads of a collected test
        def __init__(self, nodeid, mark=None):
            self.nodeid, self.mark = nodeid, mark

        def get_closest_marker(self, name):
            return self.mark if name == "full_matrix" else None

    def full(cover, why="a mesh beyond the core's"):
        return pytest.mark.full_matrix(cover=cover, why=why).mark

    core, extra = "tests/test_x.py::test_claim[core]", "tests/test_x.py::test_claim[extra]"
    assert full_matrix_errors([Item(core), Item(extra, full(core))]) == []
    assert full_matrix_errors([Item(extra, full(core))]) != []  # the cover's file is collected, the cover is not
    assert "not a case the core runs" in full_matrix_errors([Item(core, full(extra)), Item(extra, full(core))])[0]
    assert "full_matrix(cover=NODE_ID, why=TEXT)" in full_matrix_errors([Item(core), Item(extra, full(core, ""))])[0]
    # a run of one test alone (its cover's file not collected) has nothing to check against
    assert full_matrix_errors([Item("tests/test_y.py::test_other", full(core))]) == []


# A child that compiles one program (`jit_probe`, a reduction whose code XLA:CPU vectorises by the ISA) with the
# persistent compilation cache at argv[1], and prints its result's bits and the cache events it caused.
_CACHE_PROBE = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
events = []
jax.monitoring.register_event_listener(lambda name, **_: events.append(name))
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
def probe(v, w):
    return jnp.sum(v * w + jnp.tanh(v))
v, w = np.random.default_rng(0).normal(size=(2, 4099)).astype(np.float32)
out = np.asarray(jax.jit(probe)(v, w))
print(json.dumps({"bits": out.view(np.uint32).item(), "hits": events.count("/jax/compilation_cache/cache_hits"),
                  "writes": events.count("/jax/compilation_cache/cache_misses")}))
"""


def _cache_probe(cache_dir, isa: str | None = None) -> dict:
    env = child_env()
    if isa:
        kept = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(ISA_FLAG + "=")]
        env["XLA_FLAGS"] = " ".join(kept + [f"{ISA_FLAG}={isa}"])
    proc = subprocess.run([sys.executable, "-c", _CACHE_PROBE, str(cache_dir)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _probe_entries(cache_dir) -> list[str]:
    return sorted(p.name for p in cache_dir.iterdir() if p.name.startswith("jit_probe-"))


def test_the_shared_compilation_cache_keys_on_the_isa_and_returns_the_bits_it_stored(tmp_path):
    """tests/conftest.py shares one persistent compilation cache between all the processes of a run, the ISA legs
    included. Its key hashes XLA_FLAGS, so a leg under another ISA cap compiles its own executable rather than
    loading this one; and a loaded executable gives the bits of the compile that stored it. (Not a `bitwise` case
    for the legs to repeat: its children already run under two ISAs, and its subject is the cache.)

    (Not asserted, because it is false: that two fresh compiles give the same bytes. Under jaxalign's
    `--xla_cpu_experimental_ynn_fusion_type=-reduce`, XLA:CPU picks its tiled or its loop emitter for a fusion
    differently from one compile to the next, so jax's `jax_compilation_cache_check_contents` fails on this very
    program. The cache does not add that variation: it makes a run use one compile per program and flags.)"""
    fresh = _cache_probe(tmp_path)
    assert (fresh["hits"], fresh["writes"]) == (0, 1) and len(_probe_entries(tmp_path)) == 1
    cached = _cache_probe(tmp_path)
    assert (cached["hits"], cached["writes"]) == (1, 0) and cached["bits"] == fresh["bits"]

    other_isa = "SSE4_2" if current_isa() != "SSE4_2" else "AVX2"
    other = _cache_probe(tmp_path, isa=other_isa)
    assert (other["hits"], other["writes"]) == (0, 1), f"{other_isa} loaded an executable compiled for another ISA"
    assert len(_probe_entries(tmp_path)) == 2
    again = _cache_probe(tmp_path, isa=other_isa)  # that ISA's own entry is found again, with its own bits
    assert (again["hits"], again["writes"], again["bits"]) == (1, 0, other["bits"])
