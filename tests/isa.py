"""XLA flags for test subprocesses, so that a run under `XLA_FLAGS=--xla_cpu_max_isa=...` tests its children
under the same instruction set (XLA:CPU's code, and with it some bits, depend on the ISA it targets)."""

from __future__ import annotations

import os

ISA_FLAG = "--xla_cpu_max_isa"


def child_xla_flags(*extra: str, flags: str | None = None) -> str:
    """This process's XLA_FLAGS (the user's, e.g. `--xla_cpu_max_isa=AVX2`, plus jaxalign's own) without any fake
    device count (a child sets its own), followed by `extra`."""
    flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
    kept = [f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join(kept + list(extra))


def child_env(*xla_flags: str, **extra: str) -> dict[str, str]:
    """os.environ for a child process: XLA_FLAGS from `child_xla_flags(*xla_flags)`, plus `extra`."""
    env = dict(os.environ)
    flags = child_xla_flags(*xla_flags)
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    env.update(extra)
    return env


def probe_with_flag(code: str, flag: str, value: str) -> str:
    """Run the Python `code` in a fresh process whose XLA_FLAGS are this one's (`child_xla_flags`, e.g. an ISA
    cap kept) with `flag` set to `value` instead of any setting of it; the last line it prints."""
    import subprocess
    import sys
    kept = [f for f in child_xla_flags().split() if not f.startswith(flag + "=")]
    env = dict(os.environ, XLA_FLAGS=" ".join(kept + [f"{flag}={value}"]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def leg_already_run(isa: str, xla_flags: str | None = None, cpu_flags: set[str] | None = None) -> str | None:
    """Why the `isa` leg would repeat this run (a reason to skip it), or None: the run is capped at `isa`, or it
    is uncapped on a CPU whose best instruction set is `isa` (e.g. AVX2 on a Zen 3 EPYC), where XLA:CPU already
    generates the code the cap would ask for -- a cap only removes features above it."""
    from jaxalign.numerics.platforms import host_isa, isa_cap
    cap = isa_cap(xla_flags)
    if cap == isa:
        return f"this run is already capped at {isa}: its own bitwise tests are this leg"
    if cap is None and host_isa(cpu_flags) == isa:
        return f"this CPU's best instruction set is {isa}: the native run is this leg"
    return None


def current_isa() -> str:
    """The ISA cap this process runs under (`native` without one)."""
    for flag in os.environ.get("XLA_FLAGS", "").split():
        if flag.startswith(ISA_FLAG + "="):
            return flag.split("=", 1)[1]
    return "native"


# The ISA legs (tests/test_isa_matrix.py) run one case per claim: these `bitwise` cases repeat a claim another
# case already makes under the leg's ISA, so a leg leaves them out (the native run keeps every case). Each maps to
# the case the leg still runs for that claim; tests/conftest.py checks both exist and are `bitwise` whenever a
# leg collects the suite (the MULTIDEVICE entries when the leg's multidevice process collects that suite). A new
# bitwise test runs in the legs unless it is listed here.
MULTIDEVICE = "tests/multidevice/test_meshes.py::"  # collected only in the multidevice suite's own process
LEG_REPEATS = {
    # trainer == engine bitwise: the continuous schedule's case (batches 3 and 8), and the static one with a
    # chunked prefill; the engine's invariance to batch 1/8/32, schedule and chunk by test_engine's case
    "tests/test_alignment.py::test_aligned_is_bitwise_for_every_batch_and_schedule[static-batches0-None]":
        "tests/test_alignment.py::test_aligned_is_bitwise_for_every_batch_and_schedule[continuous-batches1-None]",
    # the README's API example prints k3 0.0 for aligned-bf16 on both sides: test_alignment's claim on another model
    "tests/test_readme.py::test_readme_python_block_runs_as_written[mismatch_metrics]":
        "tests/test_alignment.py::test_aligned_is_bitwise_for_every_batch_and_schedule[continuous-batches1-None]",
    "tests/test_alignment.py::test_aligned_is_bitwise_for_every_batch_and_schedule[fp8-static]":
        "tests/test_alignment.py::test_aligned_is_bitwise_for_every_batch_and_schedule[fp8-continuous]",
    # the engine records the teacher-forced pass's index selections: one schedule (prefill and decode)
    "tests/test_index_replay.py::test_engine_records_the_index_selections_of_a_teacher_forced_pass[static-None]":
        "tests/test_index_replay.py::test_engine_records_the_index_selections_of_a_teacher_forced_pass"
        "[continuous-None]",
    "tests/test_index_replay.py::test_engine_records_the_index_selections_of_a_teacher_forced_pass[static-4]":
        "tests/test_index_replay.py::test_engine_records_the_index_selections_of_a_teacher_forced_pass"
        "[continuous-None]",
    # R3w replay reproduces the engine's MoE outputs bit for bit: one family
    "tests/test_index_replay.py::test_gate_weight_replay_semantics[tiny-glm5]":
        "tests/test_index_replay.py::test_gate_weight_replay_semantics[tiny]",
    # aligned-fp8 engine == trainer on every family: the legs keep MLA + DSA (tiny-glm5) and tiny's cases
    **{f"tests/test_fp8.py::test_aligned_fp8_engine_equals_trainer_on_every_family[{family}]":
       "tests/test_fp8.py::test_aligned_fp8_engine_equals_trainer_on_every_family[tiny-glm5]"
       for family in ("tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral", "tiny-olmoe", "tiny-glm4-moe",
                      "tiny-deepseek-v3")},
    # the same field flipped to the same value from a second base policy
    "tests/test_knobs.py::test_knob_changes_numbers_and_restores[mla=absorbed1]":
        "tests/test_knobs.py::test_knob_changes_numbers_and_restores[mla=absorbed0]",
    "tests/test_knobs.py::test_knob_changes_numbers_and_restores[index_scores_dtype=bf16_1]":
        "tests/test_knobs.py::test_knob_changes_numbers_and_restores[index_scores_dtype=bf16_0]",
    # RL on a trainer mesh == one device, bitwise: the leg keeps the narrower mesh cases -- the loss and every
    # gradient (this cover) and the engine's generation on data=2,expert=2,tensor=2, the ordered logprobs on
    # fsdp=4,tensor=2 -- plus the optimizer's program-independent update (tests/test_optimizer.py), the loss's
    # order (tests/test_rl_algorithm.py) and the forward's rounding inside a gradient program
    # (tests/test_tree_reduction.py). Those are not the whole run: a whole run capped at AVX2 found a division
    # XLA rewrote in one program and not another, which none of them exercised (now its own test, in the leg).
    # The run itself (~40% of a leg's multidevice time, its programs compiled for no other test) runs natively,
    # and under a whole run capped at an ISA
    MULTIDEVICE + "test_rl_run_on_a_trainer_mesh_matches_one_device_bitwise":
        MULTIDEVICE + "test_aligned_gradients_are_bitwise_on_every_mesh[data=2,expert=2,tensor=2]",
    # the held-out Qwen3.5 checkpoint's aligned engine: the same claim as the hybrid preset's continuous case
    "tests/test_hf_interop.py::test_qwen3_5_moe_checkpoint_aligned_engine_is_bitwise_and_the_stack_pair_has_a_gap":
        "tests/test_alignment.py::test_aligned_is_bitwise_for_every_batch_and_schedule[hybrid-continuous]",
    # the hybrid's states on a mesh: the leg keeps the static case with a chunked prefill (states carried across
    # chunks, sharded over every axis); continuous refills are the one-device hybrid case's claim
    MULTIDEVICE + "test_hybrid_generation_and_scoring_are_bitwise_on_a_mesh[data=4,tensor=2-continuous-None]":
        MULTIDEVICE + "test_hybrid_generation_and_scoring_are_bitwise_on_a_mesh[fsdp=2,expert=2,tensor=2-static-4]",
}


def leg_repeat_errors(bitwise_ids: set[str], all_ids: set[str], multidevice: bool = False) -> list[str]:
    """What is wrong with the LEG_REPEATS entries of one collection -- the whole suite, or with `multidevice`
    the multidevice suite's own -- given its node ids (all, and those marked `bitwise`)."""
    errors = []
    for dropped, cover in LEG_REPEATS.items():
        if dropped.startswith(MULTIDEVICE) != multidevice:
            continue
        for role, nodeid in (("left out", dropped), ("covering case", cover)):
            if nodeid not in all_ids:
                errors.append(f"{role} {nodeid!r} is not a test of the suite (renamed?)")
            elif nodeid not in bitwise_ids:
                errors.append(f"{role} {nodeid!r} is not marked bitwise")
        if cover in LEG_REPEATS:
            errors.append(f"{dropped!r} is covered by {cover!r}, which the legs leave out too")
    return errors
