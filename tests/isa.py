"""XLA flags for test subprocesses, so that a run under `XLA_FLAGS=--xla_cpu_max_isa=...` tests its children
under the same instruction set (XLA:CPU's code, and with it some bits, depend on the ISA it targets)."""

from __future__ import annotations

import os

ISA_FLAG = "--xla_cpu_max_isa"
LEGS = ("AVX2", "SSE4_2")  # the capped legs of tests/test_isa_matrix.py, highest first


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


def core_leg(xla_flags: str | None = None, cpu_flags: set[str] | None = None) -> str | None:
    """The one leg the core runs: the first of LEGS that would not repeat this run (AVX2 on an AVX-512 host,
    SSE4_2 on an AVX2 host, whose native run is the AVX2 leg); None where every leg would. The full matrix runs
    every leg."""
    return next((isa for isa in LEGS if leg_already_run(isa, xla_flags, cpu_flags) is None), None)


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


# The test matrix's scope. The README's command (CI) runs the *core*: every case natively except those marked
# `full_matrix` (a family, a mesh or a schedule beyond the one the core keeps for that claim; tests/conftest.py
# checks each names a core case), and under each other ISA every claim about a numeric primitive (rounding,
# reductions, the optimizer, the loss's order, Pallas kernels, the FP8 quantiser) plus one end-to-end engine ==
# trainer case. `JAXALIGN_MATRIX=full` runs everything: the cases below (every end-to-end case and every knob
# under both ISAs, the multidevice suite), every family and every mesh. On 2 cores the core is the suite's
# 20-minute budget and the full matrix about 40 minutes (docs/testing.md), so the full matrix is a command, run
# before a change to numerics lands.
MATRIX_ENV = "JAXALIGN_MATRIX"
MATRIX_SCOPES = ("core", "full")
_RETIRED_ENV = "JAXALIGN_ISA_LEGS"  # its name before the scope covered meshes and families too
# node-id prefix -> (the core case that still checks its numerics under the leg's ISA, or None, and why); a core
# leg also leaves out the cases CORE_LEG_LEAVES[leg] names
_END_TO_END = "the engine == trainer claim end to end: the core leg keeps the static case with a chunked prefill"
_STATIC_CHUNKED = "tests/test_alignment.py::test_aligned_is_bitwise_for_every_batch_and_schedule[static-batches2-4]"
_HYBRID = "the gated DeltaNet hybrid end to end: natively in the core (every case), under other ISAs in the full matrix"
FULL_MATRIX_ONLY = {
    "tests/test_meshes.py::test_multidevice_suite_on_eight_fake_devices":
        (None, "meshes: sharded programs against one device; the core keeps every one-device claim they rest on"),
    "tests/test_alignment.py::test_aligned_is_bitwise_for_every_batch_and_schedule[continuous-batches1-None]":
        (_STATIC_CHUNKED, _END_TO_END + ", and the engine's slot refills are test_engine's claim natively"),
    "tests/test_alignment.py::test_aligned_is_bitwise_for_every_batch_and_schedule[hybrid-":
        (None, _HYBRID),
    "tests/test_alignment.py::test_aligned_is_bitwise_for_every_batch_and_schedule[fp8-":
        ("tests/test_fp8.py::test_e4m3_rounding_is_ml_dtypes_cast_with_saturation",
         "aligned-fp8 end to end: the FP8 quantiser's primitive cases, and its knob cases under SSE4_2"),
    "tests/test_engine.py::test_aligned_request_is_invariant_to_batch_and_slot":
        (_STATIC_CHUNKED, "the engine's batch and slot invariance: " + _END_TO_END),
    "tests/test_batch_invariance.py::test_aligned_forward_is_batch_and_position_invariant":
        (_STATIC_CHUNKED, "the aligned forward's rows at every batch and position: " + _END_TO_END),
    "tests/test_deltanet.py::test_aligned_engine_equals_trainer_with_trained_norms_decays_and_conv": (None, _HYBRID),
    "tests/test_fp8.py::test_aligned_fp8_engine_equals_trainer_on_every_family":
        ("tests/test_fp8.py::test_e4m3_rounding_is_ml_dtypes_cast_with_saturation",
         "aligned-fp8 on every family: the FP8 quantiser's cases"),
    "tests/test_lowbit.py::test_aligned_mxfp4_engine_equals_trainer":
        ("tests/test_lowbit.py::test_e2m1_rounding_is_ml_dtypes_cast_with_saturation",
         "aligned-mxfp4 end to end: the MXFP4 quantiser's primitive cases (rounding, the spec's blocks)"),
    "tests/test_fp8.py::test_merged_lora_adapters_are_quantised_with_their_weight":
        ("tests/test_fp8.py::test_weight_scales_and_values_match_the_float64_reference[f32]",
         "merged adapters quantised with their weight: the weight quantiser's cases"),
    "tests/test_index_replay.py::":
        (None, "the engine's index selections and R3w replay: natively in the core, the indexer's knobs too"),
    "tests/test_layer_seam.py::": (None, "pads and refilled slots on the hybrid: " + _HYBRID),
    "tests/test_lora.py::":
        (_STATIC_CHUNKED, "adapters in the engine and the trainer: natively in the core; " + _END_TO_END),
    "tests/test_knobs.py::":
        (None, "the knob cases: natively in the core; under another ISA a knob can turn into a no-op for want of "
               "what its arithmetic differs by -- FMA contraction, F16C (the index scores' float16 once changed no "
               "selection under SSE4_2 alone) -- which the full matrix checks"),
    "tests/test_ynn_reduce_fusion.py::test_rl_step34_trainer_batch_scores_the_engine_tokens_bitwise":
        ("tests/test_ynn_reduce_fusion.py::test_ynn_reduce_fusions_are_off_and_would_make_exp_depend_on_the_batch",
         "the RL step YNNPACK's reduce fusions broke: the fusions' own case"),
    "tests/test_pallas.py::test_aligned_bf16_on_a_simulated_gpu_runs_pallas_and_is_bitwise_between_trainer_and_engine":
        ("tests/test_pallas.py::test_tiled_kernel_on_a_simulated_accelerator_runs_the_pallas_kernel_it_chose"
         "[gpu-pallas:16x64x64]", "the Pallas kernels end to end: the kernel cases"),
}

# What one core leg leaves to the full matrix beside FULL_MATRIX_ONLY ({leg: {prefix: (cover, why)}}). Empty since
# the core runs one leg (`core_leg`: the first below the host's own ISA), which runs the excess-precision flag too
CORE_LEG_LEAVES: dict[str, dict[str, tuple[str | None, str]]] = {}


def matrix_scope(environ=None) -> str:
    """The test matrix's scope, `core` (the default) or `full`, from JAXALIGN_MATRIX; anything else is refused,
    and so is the retired JAXALIGN_ISA_LEGS (which would otherwise be ignored without a word)."""
    environ = os.environ if environ is None else environ
    if environ.get(_RETIRED_ENV):
        raise ValueError(f"{_RETIRED_ENV} is now {MATRIX_ENV} (it also selects meshes and families): "
                         f"set {MATRIX_ENV}={environ[_RETIRED_ENV]} instead")
    scope = environ.get(MATRIX_ENV, "") or "core"
    if scope not in MATRIX_SCOPES:
        raise ValueError(f"{MATRIX_ENV}={scope!r}: expected one of {', '.join(MATRIX_SCOPES)} (unset: core)")
    return scope


def full_matrix_only(nodeid: str, leg: str | None = None) -> bool:
    """Whether a core leg (under the ISA `leg`, if given) leaves the case `nodeid` to the full matrix
    (FULL_MATRIX_ONLY, and CORE_LEG_LEAVES[leg])."""
    prefixes = list(FULL_MATRIX_ONLY) + list(CORE_LEG_LEAVES.get(leg, {}))
    return any(nodeid.startswith(prefix) for prefix in prefixes)


def core_scope_errors(bitwise_ids: set[str]) -> list[str]:
    """What is wrong with FULL_MATRIX_ONLY, given the node ids the whole suite marks `bitwise`: a prefix that
    matches no bitwise case, or a covering case that is not a bitwise case the core runs."""
    errors = []
    entries = [(prefix, cover, None) for prefix, (cover, _why) in FULL_MATRIX_ONLY.items()]
    entries += [(prefix, cover, leg) for leg, leaves in CORE_LEG_LEAVES.items()
                for prefix, (cover, _why) in leaves.items()]
    for prefix, cover, leg in entries:
        if not any(nodeid.startswith(prefix) for nodeid in bitwise_ids):
            errors.append(f"{prefix!r} matches no bitwise test (renamed?)")
        if cover is not None and (cover not in bitwise_ids or full_matrix_only(cover, leg) or cover in LEG_REPEATS):
            errors.append(f"{prefix!r} is covered by {cover!r}, which is not a bitwise case a core leg runs")
    return errors


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
