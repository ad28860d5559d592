"""Multi-head latent attention in the engine: the latent cache, greedy decoding against the teacher-forced
forward in both forms, aligned-bf16 bitwise trainer == engine, and the expanded/absorbed gap."""

import numpy as np
import pytest

import jaxalign as ja
from jaxalign.align.compare import compare
from jaxalign.engine import Engine

from conftest import build_model, forward_logits

ALIGNED = ja.NumericPolicy.preset("aligned-bf16")


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-deepseek-v3")


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 64, int(rng.integers(3, 12))).astype(np.int32) for _ in range(n)]


def _greedy_cases():
    """Each schedule in one MLA form by default, alternating; the other form of each in the full matrix."""
    here = "tests/test_mla.py::test_greedy_equals_teacher_forced_argmax"
    cases = []
    for i, (schedule, chunk) in enumerate([("static", None), ("static", 4), ("continuous", None)]):
        core, other = ("expanded", "absorbed") if i % 2 == 0 else ("absorbed", "expanded")
        cases.append(pytest.param(schedule, chunk, core, id=f"{schedule}-{chunk}-{core}"))
        full = pytest.mark.full_matrix(cover=f"{here}[{schedule}-{chunk}-{core}]",
                                       why="the same schedule in the other MLA form")
        cases.append(pytest.param(schedule, chunk, other, id=f"{schedule}-{chunk}-{other}", marks=full))
    return cases


@pytest.mark.parametrize("schedule, chunk, form", _greedy_cases())
def test_greedy_equals_teacher_forced_argmax(model, form, schedule, chunk):
    """The engine decodes from the latent cache (prefilled whole or in chunks of 4, or one token per slot under
    continuous batching) and picks the teacher-forced argmax at every step."""
    policy = ja.NumericPolicy.parse(f"fp32,mla={form}")
    rollout = ja.generate(model, _prompts(5), policy, max_new_tokens=8, temperature=0.0, batch_size=3,
                          schedule=schedule, prefill_chunk=chunk)
    logits = np.asarray(forward_logits(model, rollout.tokens, policy)[0])
    for i in range(len(rollout)):
        p, g = rollout.prompt_lens[i], rollout.completion_lens[i]
        assert g == 8
        np.testing.assert_array_equal(rollout.completion(i), logits[i, p - 1: p - 1 + g].argmax(-1))


def test_latent_cache_is_smaller_than_per_head_keys_and_values(model):
    """The engine's cache holds kv_lora_rank + qk_rope_head_dim numbers per slot and layer, not per-head keys
    (nope + rope dims) and values (v dims) for every head: 24 vs 4 * (16 + 8) = 96 here."""
    cfg = model.config
    engine = Engine(model, ja.NumericPolicy.parse("fp32,kv=bf16"))
    rollout = engine.generate(_prompts(2), max_new_tokens=4, temperature=0.0)
    batch, slots = rollout.stats["batch_size"], rollout.stats["cache_len"]
    latent = rollout.stats["kv_cache_bytes"]
    assert latent == cfg.n_layers * batch * slots * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2  # bf16
    per_head = cfg.n_layers * batch * slots * cfg.n_heads * (cfg.head_dim + cfg.v_head_dim) * 2
    assert per_head == 4 * latent


# the absorbed case runs the engine program of the gap test below (8 prompts, 6 new tokens, batch 8)
@pytest.mark.parametrize("form, batches, continuous", [("expanded", (1, 8, 32), True), ("absorbed", (8,), False)])
def test_aligned_is_bitwise_at_every_engine_batch_and_continuous(model, form, batches, continuous):
    """aligned-bf16 (expanded MLA, its preset's form) on both sides: the trainer's logprobs equal the engine's bit
    for bit at engine batch 1, 8 and 32 and under continuous batching; in the absorbed form too."""
    policy = ALIGNED.replace(mla=form)
    runs = compare(model, policy, policy, n_prompts=max(batches), max_new_tokens=6, engine_batches=batches,
                   seed=1)["runs"]
    if continuous:
        runs += compare(model, policy, policy, n_prompts=32, max_new_tokens=6, engine_batches=(8,),
                        schedule="continuous", seed=1)["runs"]
    for run in runs:
        assert run["max_abs_logp_diff"] == 0.0 and run["bitwise_equal_fraction"] == 1.0, run
        assert run["route_flip_rate"] == 0.0, run


def test_expanded_trainer_against_absorbed_engine_has_a_gap(model):
    """The same weights and precisions, only the MLA form differs: mathematically equal, numerically not."""
    run = compare(model, ALIGNED, ALIGNED.replace(mla="absorbed"), n_prompts=8, max_new_tokens=6,
                  engine_batches=(8,), seed=1)["runs"][0]
    assert run["max_abs_logp_diff"] > 0 and run["bitwise_equal_fraction"] < 1.0



@pytest.mark.parametrize("schedule, chunk", [
    pytest.param("static", None, marks=pytest.mark.full_matrix(
        cover="tests/test_mla.py::test_dsa_engine_greedy_equals_teacher_forced_argmax[static-4]",
        why="the static schedule without a prefill chunk: the chunked case's selections include its prompts'")),
    ("static", 4), ("continuous", None)])
def test_dsa_engine_greedy_equals_teacher_forced_argmax(schedule, chunk):
    """tiny-glm5: decode selects among the cached indexer keys; greedy picks the teacher-forced argmax."""
    glm5 = build_model("tiny-glm5")
    rollout = ja.generate(glm5, _prompts(5, seed=2), ja.NumericPolicy.preset("fp32"), max_new_tokens=10,
                          temperature=0.0, batch_size=3, schedule=schedule, prefill_chunk=chunk)
    logits = np.asarray(forward_logits(glm5, rollout.tokens, ja.NumericPolicy.preset("fp32"))[0])
    for i in range(len(rollout)):
        p, g = rollout.prompt_lens[i], rollout.completion_lens[i]
        np.testing.assert_array_equal(rollout.completion(i), logits[i, p - 1: p - 1 + g].argmax(-1))


@pytest.mark.full_matrix(
    cover="tests/test_check.py::test_glm5_aligned_pair_passes_with_latent_attention_and_indexer_probes",
    why="the DSA model's aligned engine at several batches: `check` on the same pair asserts it bit for bit")
def test_dsa_aligned_is_bitwise_at_every_engine_batch_and_continuous():
    glm5 = build_model("tiny-glm5")
    runs = compare(glm5, ALIGNED, ALIGNED, n_prompts=32, max_new_tokens=6, engine_batches=(1, 8, 32),
                   seed=1)["runs"]
    runs += compare(glm5, ALIGNED, ALIGNED, n_prompts=32, max_new_tokens=6, engine_batches=(8,),
                    schedule="continuous", seed=1)["runs"]
    for run in runs:
        assert run["max_abs_logp_diff"] == 0.0 and run["bitwise_equal_fraction"] == 1.0, run
