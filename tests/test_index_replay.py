"""Index replay end to end (the engine records its DSA selections, the trainer replays them, record files) and
gate-weight replay (R3w: the engine's combine weights as constants)."""

import jax
import numpy as np
import pytest
from flax import nnx

import jaxalign as ja
from jaxalign.align.compare import compare, random_prompts, score_rollout
from jaxalign.align.replay import FORMAT_V1, load_record, save_record
from jaxalign.model.scoring import sequence_logprobs

from conftest import build_model

ALIGNED = ja.NumericPolicy.preset("aligned-bf16")


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 64, int(rng.integers(3, 12))).astype(np.int32) for _ in range(n)]


@pytest.fixture(scope="module")
def glm5():
    return build_model("tiny-glm5")


# Rollouts here run the engine settings of tests/test_mla.py's DSA case and tests/test_check.py's glm5 pair (the
# prompts `compare` makes for seed 1, 6 new tokens, engine batch 8, continuous with 8 slots, a chunked prefill of
# 4): on tiny-glm5, one set of engine and scoring programs for the run
DSA_CASE_RUN = dict(max_new_tokens=6, seed=1, batch_size=8)


def _dsa_case_prompts(cfg, n=32):
    return random_prompts(cfg.vocab_size, n, DSA_CASE_RUN["seed"], max_len=16)


@pytest.fixture(scope="module")
def glm5_rollout(glm5):
    return ja.generate(glm5, _dsa_case_prompts(glm5.config), ALIGNED, **DSA_CASE_RUN)


@pytest.mark.bitwise
@pytest.mark.parametrize("schedule, chunk", [("static", None), ("static", 4), ("continuous", None)])
def test_engine_records_the_index_selections_of_a_teacher_forced_pass(glm5, schedule, chunk):
    """Under an aligned policy the engine's recorded selections, index margins and combine weights are those of a
    teacher-forced pass, in prefill (whole or chunked) and decode; never-forwarded positions hold -1."""
    prompts = _dsa_case_prompts(glm5.config)
    rollout = ja.generate(glm5, prompts, ALIGNED, **DSA_CASE_RUN, schedule=schedule, prefill_chunk=chunk)
    _, tf = ja.token_logprobs(glm5, rollout.tokens, ALIGNED)
    rec = rollout.routing
    forwarded = rec.indices[..., 0, 0] >= 0
    assert rec.index_positions.shape == (len(prompts), rollout.tokens.shape[1], glm5.config.n_layers,
                                         glm5.config.index_topk)
    assert (rec.index_positions[forwarded] >= 0).any() and (rec.index_positions[~forwarded] == -1).all()
    np.testing.assert_array_equal(rec.index_positions[forwarded], np.asarray(tf.index_positions)[forwarded])
    np.testing.assert_array_equal(rec.index_margins[forwarded], np.asarray(tf.index_margins)[forwarded])
    np.testing.assert_array_equal(rec.weights[forwarded], np.asarray(tf.weights)[forwarded])


def test_index_replay_in_the_trainer_gives_the_engine_selections(glm5):
    """A trainer whose indexer scores in another dtype picks other keys (a gap); replaying the engine's recorded
    selections makes it attend to the engine's keys, and since the indexer is then the only difference, the
    trainer's logprobs become the engine's bit for bit."""
    trainer = ALIGNED.replace(index_scores_dtype="bf16")
    rollout = ja.generate(glm5, _dsa_case_prompts(glm5.config, 8), ALIGNED, **DSA_CASE_RUN)
    native, replayed = (score_rollout(glm5, rollout, trainer, replay=mode) for mode in ("none", "index"))
    assert native["index"]["index_flip_rate"] > 0 and native["metrics"]["max_abs_logp_diff"] > 0
    assert replayed["metrics"]["max_abs_logp_diff"] == 0.0 and replayed["metrics"]["bitwise_equal_fraction"] == 1.0
    # the metric reports the trainer's own indexer (which still disagrees), not the replayed keys
    assert replayed["index"]["index_flip_rate"] > 0


def test_index_records_round_trip_and_bad_records_are_refused(glm5, glm5_rollout, tmp_path):
    rollout = glm5_rollout
    path = tmp_path / "routing.safetensors"
    save_record(rollout.routing, path, config=glm5.config, policy=str(ALIGNED))
    loaded, meta = load_record(path, config=glm5.config)
    assert meta["format"] == "jaxalign-routing-v2" and meta["index_topk"] == str(glm5.config.index_topk)
    np.testing.assert_array_equal(loaded.index_positions, rollout.routing.index_positions)
    np.testing.assert_array_equal(loaded.index_margins, rollout.routing.index_margins)
    a, _ = ja.token_logprobs(glm5, rollout.tokens, ALIGNED, index_replay=loaded.index_positions)
    b, _ = ja.token_logprobs(glm5, rollout.tokens, ALIGNED)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    with pytest.raises(ValueError, match="recorded for model config"):
        load_record(path, config=glm5.config.replace(index_topk=4))
    rec = rollout.routing
    narrow = ja.RoutingRecord(rec.indices, rec.weights, rec.margins, rec.index_positions[..., :4],
                              rec.index_margins)
    with pytest.raises(ValueError, match=r"\[batch, seq, index_layers, index_topk\]"):
        save_record(narrow, tmp_path / "narrow.safetensors", config=glm5.config)
    future = rec.index_positions.copy()
    future[0, 2, 0, 0] = 5  # query 2 cannot attend to key 5
    with pytest.raises(ValueError, match="the query's own position"):
        ja.token_logprobs(glm5, rollout.tokens, ALIGNED, index_replay=future)
    dense = build_model("tiny-deepseek-v3")
    from safetensors.numpy import save_file
    save_file({"indices": rec.indices, "index_positions": rec.index_positions}, str(tmp_path / "v1.safetensors"),
              metadata={"format": FORMAT_V1})
    with pytest.raises(ValueError, match="index records are 'jaxalign-routing-v2'"):
        load_record(tmp_path / "v1.safetensors", config=glm5.config)
    with pytest.raises(ValueError, match="has no indexer"):
        compare(dense, ALIGNED, ALIGNED, replay="r3+index", n_prompts=2, max_new_tokens=2)


@pytest.mark.bitwise
@pytest.mark.parametrize("preset", ["tiny", pytest.param("tiny-glm5", marks=pytest.mark.full_matrix(
    cover="tests/test_index_replay.py::test_gate_weight_replay_semantics[tiny]",
    why="R3w on the sigmoid-grouped router: the same replay of the engine's weights as tiny's softmax router"))])
def test_gate_weight_replay_semantics(preset):
    """R3w with the trainer's own weights gives R3's numbers; with the engine's weights (the engine's router in
    another precision) it reproduces the engine's MoE outputs -- the whole forward, bit for bit -- where R3, which
    recomputes the weights, does not."""
    model = build_model(preset)
    engine = ALIGNED
    trainer = ALIGNED.replace(router_logits_dtype="bf16")  # a router difference only: ids and weights move
    rollout = ja.generate(model, _dsa_case_prompts(model.config, 8), engine, **DSA_CASE_RUN)
    tokens, mask = rollout.tokens, rollout.mask
    own_lp, own = ja.token_logprobs(model, tokens, trainer, replay=rollout.routing)
    own_w, _ = ja.token_logprobs(model, tokens, trainer, replay=rollout.routing, replay_weights=own.weights)
    np.testing.assert_array_equal(np.asarray(own_w), np.asarray(own_lp))
    r3w, _ = ja.token_logprobs(model, tokens, trainer, replay=rollout.routing, replay_weights=rollout.routing.weights)
    np.testing.assert_array_equal(np.asarray(r3w)[mask], rollout.logprobs[mask])
    assert np.abs(np.asarray(own_lp)[mask] - rollout.logprobs[mask]).max() > 0  # R3 alone leaves a gap


def test_router_gets_no_gradient_through_replayed_weights():
    """Under R3 the router is trained through the recomputed gate weights; under R3w the weights are constants, so
    the policy loss sends the router (and its selection path) no gradient; the experts still get theirs."""
    model = build_model("tiny")
    fp32 = ja.NumericPolicy.preset("fp32")
    rollout = ja.generate(model, _prompts(2, seed=5), fp32, max_new_tokens=4, seed=0)
    tokens, mask = jax.numpy.asarray(rollout.tokens), jax.numpy.asarray(rollout.mask)
    graphdef, params = nnx.split(model, nnx.Param)
    rec = rollout.routing

    def grads(weights):
        def loss(p):
            lp, _ = sequence_logprobs(nnx.merge(graphdef, p), tokens, fp32, replay=rec.indices,
                                      replay_weights=weights)
            return (lp * mask).sum()  # completion tokens, as the policy loss: every position they read is replayed
        g = jax.jit(jax.grad(loss))(params)  # one program (op by op it compiled ~150 eager ones)
        moe = g.blocks[model.config.moe_layers[0]].mlp
        return moe.router[...], moe.w_up[...]

    router_r3, experts_r3 = grads(None)
    router_r3w, experts_r3w = grads(rec.weights)
    assert np.abs(np.asarray(router_r3)).max() > 0
    assert np.abs(np.asarray(router_r3w)).max() == 0.0
    assert np.abs(np.asarray(experts_r3w)).max() > 0


def test_rl_trainer_replays_the_engine_experts_weights_and_index_selections(tmp_path):
    """`RLConfig.replay="r3w+index"`: the trainer's old-policy pass replays the engine's experts, gate weights and
    DSA selections, so a trainer differing from the engine only in its router and indexer precision scores the
    engine's logprobs exactly (every IS weight 1); replaying the experts alone does not. The update runs on the
    same replay inputs."""
    from jaxalign.rl.trainer import Trainer
    from rl_settings import rl_config
    trainer_policy = str(ALIGNED.replace(router_logits_dtype="bf16", index_scores_dtype="bf16"))
    kw = dict(trainer_policy=trainer_policy, steps=1, prompts_per_step=2, max_new_tokens=8, eval_problems=2)
    full = Trainer(build_model("tiny-glm5"), rl_config(replay="r3w+index", **kw), str(tmp_path / "a"))
    batch, _ = full.collect()
    assert batch.index_replay.shape[2:] == (3, 6) and batch.replay_weights.shape == batch.replay.shape
    scored = batch.weights[batch.weights != 0]  # IS weights of the completion tokens (0 on padding)
    assert scored.size and (scored == 1.0).all() and batch.mask.any()
    ids_only, _ = Trainer(build_model("tiny-glm5"), rl_config(replay="r3", **kw), str(tmp_path / "b")).collect()
    assert ids_only.index_replay is None and ids_only.replay_weights is None
    assert np.any((ids_only.weights != 0) & (ids_only.weights != 1.0))
    _, _, metrics = full.learner.apply_update(batch, full.params, full.opt_state)
    assert np.isfinite(float(metrics["loss"]))
