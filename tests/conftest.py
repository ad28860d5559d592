"""Shared fixtures: tiny models built once per session, and one persistent compilation cache for the run."""

from __future__ import annotations

import functools
import gc
import os
import shutil
import tempfile

# Tracing and lowering a JAX program makes many short-lived Python objects: at CPython's default collection
# thresholds (700, 10, 10) tests/test_mla.py alone ran ~3,000 collections, 2.9 of its 89 s on one core (0.5 s at
# these). Only when garbage is collected changes; every process that loads this file (the workers, the ISA legs, the
# multidevice suite) takes them.
gc.set_threshold(50_000, 20, 20)

# One persistent compilation cache per pytest run, shared by every process the run starts (xdist workers, the ISA
# legs, the multidevice suite, CLI and notebook subprocesses): most of the suite's time is XLA compiling the same
# programs again in fresh processes. The outermost pytest process makes a fresh directory and removes it at the
# end, so nothing carries over between runs or builds; JAX's own env variables pass it to every child (jax reads
# them when it is imported). The cache key hashes XLA_FLAGS, so an ISA leg never loads another ISA's executable
# (tests/test_isa_matrix.py proves it, and that a cached executable is the one a fresh compile gives).
# JAXALIGN_TEST_COMPILATION_CACHE=off compiles everything fresh.
COMPILATION_CACHE_ENV = "JAXALIGN_TEST_COMPILATION_CACHE"


def _shared_compilation_cache() -> tuple[str | None, bool]:
    """(the run's cache directory or None when switched off, whether this process made it and removes it)."""
    setting = os.environ.get(COMPILATION_CACHE_ENV, "")
    if setting == "off":
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
        return None, False
    if setting and os.path.isdir(setting):
        return setting, False  # a child of the run that made it
    if setting:
        raise ValueError(f"{COMPILATION_CACHE_ENV}={setting!r}: expected 'off', or unset (the outermost pytest "
                         "process sets it to the run's cache directory for its children)")
    path = tempfile.mkdtemp(prefix="jaxalign-test-jit-cache-")
    os.environ[COMPILATION_CACHE_ENV] = path
    return path, True


COMPILATION_CACHE_DIR, _OWNS_COMPILATION_CACHE = _shared_compilation_cache()
if COMPILATION_CACHE_DIR:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = COMPILATION_CACHE_DIR
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # tiny models: every program counts

import jax  # noqa: E402  (after the cache's env variables)
import numpy as np
import pytest
from flax import nnx

from jaxalign import ModelConfig, Transformer
from jaxalign.model.scoring import forward

if COMPILATION_CACHE_DIR:  # also when a plugin imported jax before this module set the env variables
    jax.config.update("jax_compilation_cache_dir", COMPILATION_CACHE_DIR)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

# tests/multidevice/ needs 8 fake devices, set before JAX starts: tests/test_meshes.py runs it in its own process
collect_ignore = [] if os.environ.get("JAXALIGN_MULTIDEVICE") == "1" else ["multidevice"]

FAMILY_PRESETS = ("tiny", "tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral", "tiny-olmoe", "tiny-glm4-moe",
                  "tiny-deepseek-v3", "tiny-glm5")


# The suite runs on two workers (`-n 2 --dist loadgroup --no-loadscope-reorder` in pyproject's addopts). A worker
# takes whole files (so a file's fixtures and compiled programs are built once), except the tests below: each is
# one long run in processes of its own, a unit by itself, and they go first, longest first, so the two workers
# start on them and the files fill in around them. A new test that runs for minutes belongs in this list.
LONGEST_FIRST = (
    "tests/test_isa_matrix.py::test_bitwise_claims_hold_under_isa[AVX2]",
    "tests/test_isa_matrix.py::test_bitwise_claims_hold_under_isa[SSE4_2]",
    "tests/test_meshes.py::test_multidevice_suite_on_eight_fake_devices",
    "tests/test_multiprocess.py::test_two_processes_train_checkpoint_and_resume_like_one_device",
    "tests/test_notebooks.py::test_notebook_executes[01_where_mismatch_arises.ipynb]",
    "tests/test_cli.py::test_demo_quick_runs",
    "tests/test_rl_trainer.py::test_sigkill_after_a_checkpoint_then_rerun_gives_the_uninterrupted_metrics_bitwise",
    "tests/test_rl_vllm.py::test_a_sigkilled_vllm_run_leaves_no_vllm_process_and_resumes_with_every_sync_verified",
    "tests/test_lora.py::test_lora_trainer_on_mla_updates_only_adapters_and_stays_on_policy[tiny-glm5-kv_b_proj]",
)


# Files whose tests run the same programs (their settings were made to match): each set is one unit of the xdist
# schedule, so one worker runs its files one after another and the later ones reuse the programs the first compiled.
# Split over two workers they ran at the same time and both compiled them (the glm5 pair of `jaxalign check` took
# 109 s beside its twin instead of ~40 after it).
SHARED_PROGRAMS = {
    "glm5 engine and scoring programs": ("tests/test_check.py", "tests/test_index_replay.py", "tests/test_mla.py"),
    # notebooks 02 and 04 make tests/test_alignment.py's and tests/test_aggregation.py's calls: their kernels load
    # those programs from the run's cache
    "the notebooks' programs": ("tests/test_aggregation.py", "tests/test_alignment.py", "tests/test_notebooks.py"),
}
_FILE_GROUP = {path: name for name, paths in SHARED_PROGRAMS.items() for path in paths}
# ... and long tests that do: both begin with the one-device RL run of tests/rl_settings.py (`one_device_rows`).
# Started together on the two workers (as after the two ISA legs of an AVX-512 host) they compiled its programs twice.
SHARED_LONG = {
    "one-device RL run": ("tests/test_meshes.py::test_multidevice_suite_on_eight_fake_devices",
                          "tests/test_multiprocess.py::test_two_processes_train_checkpoint_and_resume_like_one_device"),
}
_LONG_GROUP = {nodeid: name for name, nodeids in SHARED_LONG.items() for nodeid in nodeids}
if not set(_LONG_GROUP) <= set(LONGEST_FIRST):
    raise ValueError(f"SHARED_LONG names tests LONGEST_FIRST does not: {sorted(set(_LONG_GROUP) - set(LONGEST_FIRST))}")


def pytest_unconfigure(config):
    """The process that made the run's compilation cache removes it."""
    if _OWNS_COMPILATION_CACHE:
        shutil.rmtree(COMPILATION_CACHE_DIR, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Group the tests for pytest-xdist (LONGEST_FIRST: one unit each, SHARED_LONG's together, first; the rest by
    file, SHARED_PROGRAMS' files together) and order them. Both are keyed by node ids relative to the project
    root; ids relative to another directory would leave every test unscheduled by them, silently, so that is
    refused."""
    stray = [item.nodeid for item in items if not item.nodeid.startswith("tests/")]
    if stray:
        raise pytest.UsageError(
            f"test ids are relative to {config.rootpath}, not the project root (e.g. {stray[0]!r}): pytest took a "
            "path given to an option it did not know yet (a plugin's, e.g. `--compile-profile /tmp/x.jsonl`) for a "
            "test path when it chose its rootdir; write such options as `--option=PATH`")

    def rank(item):
        return LONGEST_FIRST.index(item.nodeid) if item.nodeid in LONGEST_FIRST else len(LONGEST_FIRST)
    for item in items:
        long = rank(item) < len(LONGEST_FIRST)
        path = item.nodeid.split("::", 1)[0]
        group = _LONG_GROUP.get(item.nodeid, item.nodeid) if long else _FILE_GROUP.get(path, path)
        item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=rank)  # stable: files keep their order
    errors = full_matrix_errors(items)  # on the whole collection, before any case is left out
    if errors:
        raise pytest.UsageError("full_matrix marks: " + "; ".join(errors))
    if os.environ.get("JAXALIGN_ISA_LEG"):
        _leave_out_leg_repeats(config, items)
    if _matrix_scope() == "core":
        _deselect(config, items, lambda item: item.get_closest_marker("full_matrix") is not None)


def _deselect(config, items, left_out) -> None:
    """Deselect (and report) the items for which `left_out(item)` holds."""
    dropped = [item for item in items if left_out(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if not left_out(item)]


def _leave_out_leg_repeats(config, items):
    """In an ISA leg, deselect the cases tests/isa.py LEG_REPEATS lists and, in a core leg (JAXALIGN_MATRIX unset
    or `core`), those FULL_MATRIX_ONLY and CORE_LEG_LEAVES leave to the full matrix, after checking the lists
    against the collection: the whole suite's entries where the whole suite is collected (as a leg does), the
    multidevice suite's where that suite is (its own process, which a full leg starts)."""
    from isa import LEG_REPEATS, MULTIDEVICE, core_scope_errors, full_matrix_only, leg_repeat_errors
    core = _matrix_scope() == "core"
    ids = {item.nodeid for item in items}
    whole = any(nodeid.startswith("tests/test_isa_matrix.py::") for nodeid in ids)
    multidevice = any(nodeid.startswith(MULTIDEVICE) for nodeid in ids)
    if whole or multidevice:  # the whole suite, or the multidevice suite in its own process
        bitwise = {item.nodeid for item in items if item.get_closest_marker("bitwise")}
        errors = leg_repeat_errors(bitwise, ids, multidevice=multidevice and not whole)
        if whole:
            errors += core_scope_errors(bitwise)
        if errors:
            raise pytest.UsageError("tests/isa.py LEG_REPEATS / FULL_MATRIX_ONLY: " + "; ".join(errors))

    leg = os.environ.get("JAXALIGN_ISA_LEG")

    _deselect(config, items, lambda item: item.nodeid in LEG_REPEATS or (core and full_matrix_only(item.nodeid, leg)))


def _matrix_scope() -> str:
    from isa import matrix_scope
    try:
        return matrix_scope()
    except ValueError as err:
        raise pytest.UsageError(str(err)) from None


def full_matrix_errors(items) -> list[str]:
    """What is wrong with the `full_matrix` marks of a collection: a mark without its `cover` (the case that
    still checks the claim in the core) and `why`, or a cover that is not a case the core runs -- checked where
    the cover's file is collected (running one test alone checks nothing)."""
    ids = {item.nodeid for item in items}
    marked = {item.nodeid: item.get_closest_marker("full_matrix") for item in items}
    marked = {nodeid: mark for nodeid, mark in marked.items() if mark}
    errors = []
    for nodeid, mark in marked.items():
        cover, why = mark.kwargs.get("cover"), mark.kwargs.get("why")
        if not cover or not why or mark.args:
            errors.append(f"{nodeid}: mark it full_matrix(cover=NODE_ID, why=TEXT)")
        elif any(other.startswith(cover.split("::")[0] + "::") for other in ids) and (
                cover not in ids or cover in marked):
            errors.append(f"{nodeid} is covered by {cover!r}, which is not a case the core runs")
    return errors


def _memory_map_count() -> int | None:
    try:
        with open("/proc/self/maps") as maps:
            return sum(1 for _ in maps)
    except OSError:  # not Linux
        return None


@functools.lru_cache(maxsize=None)
def _memory_map_limit() -> int | None:
    try:
        with open("/proc/sys/vm/max_map_count") as limit:
            return int(limit.read())
    except (OSError, ValueError):
        return None


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """Clear JAX's compile caches when this process nears the kernel's limit on memory mappings.

    XLA:CPU maps ~3 pages (code, read-only data, data) for every kernel it JITs, and keeps them while the
    executable lives in a jit cache: one aligned-bf16 forward on `tiny` costs ~500 mappings. The whole suite in one
    process passed vm.max_map_count (65530 by default); the next mmap inside XLA's JIT then failed and the process
    died with SIGSEGV in whichever test compiled next. Clearing the caches frees those mappings (programs that are
    needed again recompile)."""
    yield
    limit, count = _memory_map_limit(), _memory_map_count()
    if limit and count and count > limit // 2:
        jax.clear_caches()


@functools.lru_cache(maxsize=None)
def build_model(preset: str, seed: int = 0) -> Transformer:
    """A model from a preset, built once per (preset, seed) for the whole session."""
    model = Transformer(ModelConfig.preset(preset), rngs=nnx.Rngs(seed))
    if model.config.router == "sigmoid_grouped":
        # a non-zero selection bias, so tests see it change the selection but not the weights
        bias = np.random.default_rng(seed).normal(0, 0.05, model.config.n_experts)
        for block in model.blocks:
            if block.is_moe:
                block.mlp.selection_bias[...] = bias.astype(np.float32)
    return model


def random_tokens(cfg: ModelConfig, batch: int, seq: int, seed: int = 0) -> np.ndarray:
    """Uniform random token ids [batch, seq]."""
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, seq)).astype(np.int32)


@pytest.fixture(scope="session")
def tiny_model() -> Transformer:
    return build_model("tiny")


def forward_logits(model: Transformer, tokens, policy, replay=None, index_replay=None):
    """Jitted (logits, RoutingRecord); compiled once per (model structure, policy, shapes). Tests call this, not
    `model(tokens, policy=...)` outside jit, which compiles each operation apart (several times slower the first
    time), unless the eager call is what they test."""
    return forward(model, tokens, policy, replay=replay, index_replay=index_replay)


@functools.lru_cache(maxsize=None)
def build_lora_model(preset: str = "tiny") -> Transformer:
    """A model with rank-4 adapters on the attention projections and non-zero B (so adapters do something)."""
    from jaxalign.model.lora import add_lora
    model = Transformer(ModelConfig.preset(preset), rngs=nnx.Rngs(0))
    add_lora(model, 4, 8.0)
    rng = np.random.default_rng(0)
    for _, module in nnx.iter_graph(model):
        if getattr(module, "lora_b", None) is not None:
            module.lora_b[...] = rng.normal(0, 0.1, module.lora_b[...].shape).astype(np.float32)
    return model
