"""The engine's promise on DeepSeek-V4 (tiny-deepseek-v4: HCA, CSA with its indexer and sliding-only layers over a
window shorter than prompt plus completion, sinks, hyper-connection streams, a hash-routed layer, sqrtsoftplus
routing, the SwiGLU limit): under aligned-bf16 its logprobs equal the trainer's bitwise for 6 prompts, static (batch
4, prefill in chunks of 4) and continuous (4 slots, two refills). The held-out transformers checkpoint's parity is
tests/test_deepseek_v4.py."""

import pytest

from jaxalign import NumericPolicy

from conftest import build_model

ALIGNED = NumericPolicy.preset("aligned-bf16")


CONTINUOUS = pytest.mark.full_matrix(
    cover="tests/test_deepseek_v4_engine.py::test_aligned_engine_equals_the_trainer_bitwise[static-4]",
    why="the second schedule of the same claim (continuous batching with refills: 40 s more on 2 cores)")


def _prompts(cfg):
    """8 prompts of 4-12 tokens: with 8 sampled tokens (seed 5) row 6 once met a one-tile product whose transpose
    XLA folded (docs/families.md), the aligned engine leaving the trainer from position 7 by 8.8e-3."""
    from jaxalign.align.compare import random_prompts
    return random_prompts(cfg.vocab_size, 8, seed=3, max_len=12)


def _rollout(model, policy, schedule="static", chunk=4):
    from jaxalign import generate
    return generate(model, _prompts(model.config), policy, max_new_tokens=8, temperature=1.0, seed=5,
                    batch_size=4, schedule=schedule, prefill_chunk=chunk)


@pytest.mark.bitwise
@pytest.mark.parametrize("schedule, chunk", [("static", 4), pytest.param("continuous", None, marks=CONTINUOUS)])
def test_aligned_engine_equals_the_trainer_bitwise(schedule, chunk):
    """8 prompts of up to 12 tokens and 8 new ones (window and HCA entries of 8, CSA entries of 4), static batch 4
    with prefill in chunks of 4 / continuous batching on 4 slots: logprobs, experts and the CSA indexer's
    selections (the record's one indexing layer) are the trainer's."""
    from jaxalign.align.compare import score_rollout
    from jaxalign.model.routing import index_layers
    model = build_model("tiny-deepseek-v4")
    rollout = _rollout(model, ALIGNED, schedule, chunk)
    scored = score_rollout(model, rollout, ALIGNED)
    assert scored["metrics"]["bitwise_equal_fraction"] == 1.0 and scored["metrics"]["max_abs_logp_diff"] == 0.0
    assert scored["routing"]["route_flip_rate"] == 0.0 and scored["metrics"]["n_tokens"] == 8 * 8
    assert index_layers(model.config) == (1,) and rollout.routing.index_positions.shape[2:] == (1, 3)
    assert (rollout.routing.index_positions >= 0).any() and scored["index"]["index_flip_rate"] == 0.0


def test_csa_index_replay_makes_the_trainer_attend_to_the_recorded_entries():
    """Index replay on DeepSeek-V4's CSA layer: on 8 random sequences of 48 tokens, a pass whose indexer scores in
    bf16 picks other compressed entries than aligned-bf16's float32 scores on a few queries, and other logprobs;
    replaying its record in the float32 pass makes that pass attend to the recorded entries, and with the
    indexer the only difference, its logprobs become the bf16 pass's bit for bit. (The engine records its
    selections as the trainer makes them: test_aligned_engine_equals_the_trainer_bitwise.)"""
    import numpy as np

    from jaxalign import token_logprobs
    model = build_model("tiny-deepseek-v4")
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (8, 48)).astype(np.int32)
    own, own_record = token_logprobs(model, tokens, ALIGNED)
    bf16, bf16_record = token_logprobs(model, tokens, ALIGNED.replace(index_scores_dtype="bf16"))
    recorded = np.asarray(bf16_record.index_positions)
    assert (recorded != np.asarray(own_record.index_positions)).any(-1).sum() > 0
    assert np.abs(np.asarray(own) - np.asarray(bf16)).max() > 0
    replayed, record = token_logprobs(model, tokens, ALIGNED, index_replay=recorded)
    np.testing.assert_array_equal(np.asarray(replayed), np.asarray(bf16))
    # the record still reports the float32 indexer's own choice, not the replayed one
    np.testing.assert_array_equal(np.asarray(record.index_positions), np.asarray(own_record.index_positions))


def test_hash_layers_route_by_token_and_ignore_replay():
    """R3 on DeepSeek-V4: a hash-routed layer's experts are `tid2eid[token]` (the record says so, with margin +inf:
    no flip is possible), so replay there is ignored -- any recorded ids give the same logits bitwise -- while on a
    top-k layer replayed ids do move the logits."""
    import numpy as np

    from conftest import forward_logits
    model = build_model("tiny-deepseek-v4")
    cfg = model.config
    assert cfg.deepseek_v4.hash_layers == (0,)
    fp32 = NumericPolicy.preset("fp32")
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12))
    logits, record = forward_logits(model, tokens, fp32)
    indices = np.asarray(record.indices)
    np.testing.assert_array_equal(indices[:, :, 0], model.blocks[0].mlp.table.array[tokens])
    assert np.isinf(np.asarray(record.margins)[:, :, 0]).all() and np.isfinite(np.asarray(record.margins)[:, :, 1:]).all()
    noise = np.random.default_rng(1).integers(0, cfg.n_experts, indices.shape)
    on_hash = indices.copy()
    on_hash[:, :, 0] = noise[:, :, 0]
    replayed = forward_logits(model, tokens, fp32, replay=on_hash)[0]
    np.testing.assert_array_equal(np.asarray(replayed), np.asarray(logits))
    on_topk = indices.copy()
    on_topk[:, :, 1] = (indices[:, :, 1] + 1) % cfg.n_experts
    assert np.abs(np.asarray(forward_logits(model, tokens, fp32, replay=on_topk)[0]) - np.asarray(logits)).max() > 0


def test_config_round_trips_and_old_fingerprints_stay():
    """`deepseek_v4` is owned by the dsv4 kinds: a DeepSeek-V4 config round-trips through to_dict / JSON, and a
    model without it has no such key (so no other preset's fingerprint moved)."""
    import json

    from jaxalign import ModelConfig
    cfg = ModelConfig.preset("tiny-deepseek-v4")
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert "deepseek_v4" not in ModelConfig.preset("tiny").to_dict()


@pytest.mark.full_matrix(cover="tests/test_knobs.py::test_knob_changes_numbers_and_restores[sinkhorn_iters=2]",
                         why="the same flip seen through the engine and the trainer (60 s more on 2 cores)")
def test_engine_with_fewer_sinkhorn_iterations_drifts_from_the_trainer():
    """An engine that runs 2 Sinkhorn iterations where the checkpoint's config says 4 (tiny-deepseek-v4's
    hc_iters; `sinkhorn_iters=2`) against an aligned trainer running the config's: the only policy difference,
    and the logprobs differ."""
    from jaxalign.align.compare import compare
    model = build_model("tiny-deepseek-v4")
    assert model.config.deepseek_v4.hc_iters == 4
    engine = ALIGNED.replace(sinkhorn_iters=2)
    assert ALIGNED.diff(engine) == [("sinkhorn_iters", "model", "2")]
    run = compare(model, ALIGNED, engine, n_prompts=4, max_new_tokens=8, engine_batches=(4,))["runs"][0]
    assert run["max_abs_logp_diff"] > 0.0 and run["bitwise_equal_fraction"] < 1.0, run


def test_check_probes_the_compressors_and_the_indexer_and_aligned_is_batch_invariant():
    """`jaxalign check`'s kernels for the DeepSeek-V4 kinds: the attention over the shared key = value head, both
    compressors' pooling and the CSA indexer (scores and selection) keep a row's bits in any batch under
    aligned-bf16; fp32's indexer scores (a plain einsum) do not, so the probe can tell."""
    from jaxalign.check import _kernels, probe
    from jaxalign.model.config import ModelConfig
    cfg = ModelConfig.preset("tiny-deepseek-v4")
    kernels = ("dsv4_attention", "dsv4_csa_compressor", "dsv4_hca_compressor", "dsv4_index")
    assert set(kernels) <= set(_kernels(cfg, ALIGNED))
    for kernel in kernels:
        result = probe(cfg, ALIGNED, kernel, batches=(1, 3, 8))
        assert result["bitwise_invariant"] and result["max_abs_diff"] == 0.0, result
    loose = probe(cfg, NumericPolicy.preset("fp32"), "dsv4_index", batches=(1, 3, 8, 13, 32))
    assert not loose["bitwise_invariant"] and 0.0 < loose["max_abs_diff"] < 1e-5, loose
