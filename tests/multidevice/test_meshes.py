"""Sharded trainer and engine on 8 fake CPU devices (run in their own process by tests/test_meshes.py).

fp32: sharded forward, backward and generate agree with one device within float32 tolerance. aligned-bf16
(cross_device=ordered): bitwise, for tensor-, expert-, data- and FSDP-parallel meshes, and a short RL run on
`data=2,expert=2,tensor=2` gives the same metrics as one device; the gated DeltaNet hybrid's engine and trainer
are bitwise on meshes too. Every parameter is sharded as the rules say.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxalign import NumericPolicy, generate, make_mesh
from jaxalign.engine.kernels import _empty_kv
from jaxalign.model.scoring import sequence_logprobs, token_logprobs
from jaxalign.model.sharding import logical_axes_of, shard_state, spec_for
from jaxalign.model.config import ModelConfig
from jaxalign.numerics.reduce import mean
from jaxalign.rl.sft import warm_start
from jaxalign.rl.trainer import Trainer

from conftest import build_model, random_tokens  # tests/conftest.py
from rl_settings import SFT, comparable_rows, one_device_reference, rl_config  # tests/rl_settings.py

TP = ["tensor=2", "tensor=4", "tensor=8"]
EP = ["expert=2", "expert=4", "expert=8"]
MIXED = ["data=8", "fsdp=4,tensor=2", "data=2,expert=2,tensor=2"]
ALIGNED = NumericPolicy.preset("aligned-bf16")
HERE = "tests/multidevice/test_meshes.py::"


def full_matrix(spec, cover: str, why: str, *marks):
    """A parametrised case only `JAXALIGN_MATRIX=full` runs: a mesh beyond the one the default run keeps for that
    claim (`cover`, a case of this file)."""
    return pytest.param(*(spec if isinstance(spec, tuple) else (spec,)),
                        marks=[pytest.mark.full_matrix(cover=HERE + cover, why=why), *marks])



@pytest.mark.bitwise
def test_eight_fake_devices():
    assert jax.device_count() == 8, os.environ.get("XLA_FLAGS")


@pytest.fixture(scope="module")
def model():
    return build_model("tiny")


def _variables(model):
    state = nnx.state(model, nnx.Param)
    return jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda v: isinstance(v, nnx.Variable))[0]


@pytest.mark.parametrize("spec", TP + EP + MIXED)
def test_parameters_are_sharded_as_the_rules_say(model, spec):
    mesh = make_mesh(spec)
    sharded = shard_state(nnx.state(model, nnx.Param), mesh)
    flat = dict((jax.tree_util.keystr(p), v) for p, v in
                jax.tree_util.tree_flatten_with_path(sharded)[0])
    split = 0
    for path, variable in _variables(model):
        value = flat[jax.tree_util.keystr(path) + ".value"]
        expected = spec_for(logical_axes_of(variable), dict(mesh.shape), value.shape)
        assert value.sharding.spec == expected, jax.tree_util.keystr(path)
        ways = [1 if e is None else int(np.prod([mesh.shape[a] for a in ((e,) if isinstance(e, str) else e)]))
                for e in tuple(expected) + (None,) * (value.ndim - len(expected))]
        assert value.addressable_shards[0].data.shape == tuple(d // w for d, w in zip(value.shape, ways))
        split += any(w > 1 for w in ways)
    # pure data parallelism replicates every parameter; every other mesh splits some
    assert (split == 0) if spec == "data=8" else (split > 0)
    # the rules, spelled out for a few parameters (not read back from spec_for)
    layer = flat["['blocks'][0]['attn']['q_proj']['w'].value"].sharding.spec
    experts = flat["['blocks'][0]['mlp']['w_gate'].value"].sharding.spec
    if spec == "tensor=8":
        assert layer == P(None, "tensor") and experts == P(None, None, "tensor")
    if spec == "expert=8":
        assert layer == P(None, None) and experts == P("expert", None, None)
    if spec == "fsdp=4,tensor=2":
        assert layer == P("fsdp", "tensor") and experts == P(None, "fsdp", "tensor")


def _sharded_prefill_cache(model, mesh):
    """The KV cache (16 slots) an aligned-bf16 prefill of 8 random 8-token rows leaves, parameters sharded on
    `mesh`."""
    cfg = model.config
    graphdef, state = nnx.split(model)

    @jax.jit
    def prefill(state, tokens):
        kv = _empty_kv(cfg, tokens.shape[0], 16, ALIGNED)
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        return nnx.merge(graphdef, state).forward(tokens, ALIGNED, positions=positions, kv=kv)[2]

    with jax.set_mesh(mesh):
        return prefill(shard_state(state, mesh), jnp.asarray(random_tokens(cfg, 8, 8)))


@pytest.mark.parametrize("spec", ["data=4,tensor=2", "fsdp=2,expert=2,tensor=2"])
def test_kv_cache_is_sharded(model, spec):
    """KV cache [batch, slots, kv_heads, head_dim]: rows over the batch axes, kv heads over `tensor` (the tiny
    model has 2 kv heads, so tensor=2)."""
    mesh = make_mesh(spec)
    kv = _sharded_prefill_cache(model, mesh)
    batch_axes = tuple(a for a in ("data", "fsdp") if mesh.shape[a] > 1)
    expected = (batch_axes[0] if len(batch_axes) == 1 else batch_axes, "tensor", None, None)  # [B, KVH, M, Dh]
    assert tuple(kv[0][0].sharding.spec) + (None,) * (4 - len(kv[0][0].sharding.spec)) == expected


@functools.partial(jax.jit, static_argnames=("graphdef", "policy"))
def _loss_and_grads(graphdef, state, tokens, *, policy):
    def loss(s):
        lp, _ = sequence_logprobs(nnx.merge(graphdef, s), tokens, policy)
        return -mean(lp, policy)  # in the policy's order: a jnp.mean's bits depend on the program and the ISA
    return jax.value_and_grad(loss)(state)


def _grads(model, tokens, policy, mesh):
    graphdef, state = nnx.split(model)
    if mesh is None:
        loss, grads = _loss_and_grads(graphdef, state, jnp.asarray(tokens), policy=policy)
    else:
        with jax.set_mesh(mesh):
            loss, grads = _loss_and_grads(graphdef, shard_state(state, mesh), jnp.asarray(tokens), policy=policy)
    return float(loss), [np.asarray(g) for g in jax.tree.leaves(grads)]


PROMPTS_SEED = 3


def _prompts(cfg):
    return [list(row[: 5 + i]) for i, row in enumerate(random_tokens(cfg, 8, 16, seed=PROMPTS_SEED))]


# pure data parallelism, and one mesh with every other axis (tensor and expert parallelism alone are checked
# bitwise under aligned-bf16 below; here the partitioner's own all-reduces are the point)
@pytest.mark.parametrize("spec", [
    full_matrix(spec, "test_cross_device_knob", "the partitioner's own all-reduces within float32 tolerance of one "
                "device: the cross_device knob case's xla side (fsdp=4,tensor=2), and aligned-bf16 bitwise on "
                "every core mesh") for spec in ("data=8", "fsdp=2,expert=2,tensor=2")])
def test_fp32_sharded_forward_backward_generate_match_one_device(model, spec):
    fp32, mesh = NumericPolicy.preset("fp32"), make_mesh(spec)
    tokens = random_tokens(model.config, 8, 24)
    lp1 = np.asarray(token_logprobs(model, tokens, fp32)[0])
    lpn = np.asarray(token_logprobs(model, tokens, fp32, mesh=mesh)[0])
    np.testing.assert_allclose(lpn, lp1, rtol=1e-5, atol=1e-5)
    loss1, g1 = _grads(model, tokens, fp32, None)
    lossn, gn = _grads(model, tokens, fp32, mesh)
    assert abs(loss1 - lossn) <= 1e-6 * abs(loss1)
    for a, b in zip(g1, gn):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
    r1 = generate(model, _prompts(model.config), fp32, max_new_tokens=8, temperature=0.0)
    rn = generate(model, _prompts(model.config), fp32, max_new_tokens=8, temperature=0.0, mesh=mesh)
    np.testing.assert_array_equal(rn.tokens, r1.tokens)
    np.testing.assert_allclose(rn.logprobs, r1.logprobs, rtol=1e-5, atol=1e-5)
    assert rn.stats["mesh"] == spec


@pytest.mark.parametrize("spec", [
    full_matrix(spec, "test_aligned_generation_is_bitwise_on_every_mesh[data=2,expert=2,tensor=2-continuous]",
                "the bucketed dispatch on a mesh: its one-device cases, and the dense dispatch's sharded "
                "generation") for spec in ("expert=8", "fsdp=2,expert=2,tensor=2")])
def test_bucketed_dispatch_generates_on_a_mesh(model, spec):
    """The bucketed dispatch (per-expert buffers, one `lax.switch` branch per size) runs sharded: the one-device
    tokens, and the engine's logprobs are the sharded trainer's."""
    bucketed, mesh = NumericPolicy.parse("fp32,dispatch=bucketed"), make_mesh(spec)
    r1 = generate(model, _prompts(model.config), bucketed, max_new_tokens=8, temperature=0.0)
    rn = generate(model, _prompts(model.config), bucketed, max_new_tokens=8, temperature=0.0, mesh=mesh)
    np.testing.assert_array_equal(rn.tokens, r1.tokens)
    np.testing.assert_allclose(rn.logprobs, r1.logprobs, rtol=1e-5, atol=1e-5)
    lp, _ = token_logprobs(model, rn.tokens, bucketed, mesh=mesh)
    np.testing.assert_allclose(np.asarray(lp)[rn.mask], rn.logprobs[rn.mask], rtol=1e-5, atol=1e-5)


# the smallest and largest split of each single axis (tensor=4, expert=4 lie between), and the mixed meshes; the
# default run keeps the mixed meshes, which split every axis between them
@pytest.mark.parametrize("spec", [
    pytest.param("fsdp=4,tensor=2", marks=pytest.mark.bitwise), "data=2,expert=2,tensor=2",
    *(full_matrix(s, "test_aligned_logprobs_are_bitwise_on_every_mesh[data=2,expert=2,tensor=2]",
                  "one axis alone: the mixed meshes split it with the others")
      for s in ["tensor=2", "tensor=8", "expert=2", "expert=8", "data=8"])])
def test_aligned_logprobs_are_bitwise_on_every_mesh(model, spec):
    tokens = random_tokens(model.config, 8, 24)
    one = np.asarray(token_logprobs(model, tokens, ALIGNED)[0])
    np.testing.assert_array_equal(np.asarray(token_logprobs(model, tokens, ALIGNED, mesh=make_mesh(spec))[0]), one)


@pytest.mark.bitwise
@pytest.mark.full_matrix(cover=HERE + "test_aligned_generation_is_bitwise_on_every_mesh"
                               "[data=2,expert=2,tensor=2-continuous]",
                         why="aligned-fp8 on the mixed mesh: aligned-bf16's sharded programs there, and "
                             "aligned-fp8's one-device cases, quantised from the same float32 masters")
def test_aligned_fp8_is_bitwise_on_a_mixed_mesh(model):
    """aligned-fp8 (cross_device=ordered, as aligned-bf16) on data=2,expert=2,tensor=2: the trainer's logprobs and
    the engine's generation (weights quantised from sharded masters at its sync) are one device's, bit for bit."""
    fp8 = NumericPolicy.preset("aligned-fp8")
    mesh = make_mesh("data=2,expert=2,tensor=2")
    tokens = random_tokens(model.config, 8, 24)
    one = np.asarray(token_logprobs(model, tokens, fp8)[0])
    np.testing.assert_array_equal(np.asarray(token_logprobs(model, tokens, fp8, mesh=mesh)[0]), one)
    kw = dict(max_new_tokens=8, temperature=1.0, seed=5, batch_size=8)
    alone = generate(model, _prompts(model.config), fp8, **kw)
    sharded = generate(model, _prompts(model.config), fp8, mesh=mesh, **kw)
    np.testing.assert_array_equal(sharded.tokens, alone.tokens)
    np.testing.assert_array_equal(sharded.logprobs, alone.logprobs)


@pytest.mark.parametrize("spec", [
    *(full_matrix(s, "test_aligned_gradients_are_bitwise_on_every_mesh[data=2,expert=2,tensor=2]",
                  "one axis alone: the mixed mesh splits it with the others")
      for s in ["tensor=8", "expert=8", "data=8"]),
    "fsdp=4,tensor=2", pytest.param("data=2,expert=2,tensor=2", marks=pytest.mark.bitwise)])
def test_aligned_gradients_are_bitwise_on_every_mesh(model, spec):
    tokens = random_tokens(model.config, 8, 24)
    loss1, g1 = _grads(model, tokens, ALIGNED, None)
    lossn, gn = _grads(model, tokens, ALIGNED, make_mesh(spec))
    assert loss1 == lossn
    for a, b in zip(g1, gn):
        np.testing.assert_array_equal(b, a)


@pytest.mark.bitwise
@pytest.mark.full_matrix(cover=HERE + "test_aligned_gradients_are_bitwise_on_every_mesh[data=2,expert=2,tensor=2]",
                         why="a regression's weights and tokens on data=2: every gradient goes through the same "
                             "tree-summed broadcasts on the mixed mesh")
def test_aligned_gradients_are_bitwise_on_a_mesh_for_other_weights_and_tokens():
    """`tiny` with the weights and 8 x 38 tokens of seed 3 (a case of `benchmarks/mesh_gradients.py`) on data=2:
    10 of its 27 gradient leaves differed from one device's, by one bf16 rounding, while attention divided by its
    softmax denominator broadcast implicitly -- that broadcast's gradient was an XLA reduce over the keys, ordered
    by how each program's backward was fused. It now goes through `numerics.reduce.expand` (a tree sum)."""
    seeded = build_model("tiny", 3)
    tokens = np.random.default_rng(3).integers(0, seeded.config.vocab_size, (8, 38)).astype(np.int32)
    loss1, g1 = _grads(seeded, tokens, ALIGNED, None)
    lossn, gn = _grads(seeded, tokens, ALIGNED, make_mesh("data=2"))
    assert loss1 == lossn
    for a, b in zip(g1, gn):
        np.testing.assert_array_equal(b, a)


# the default run keeps the mixed mesh's continuous batching; static batches on a mesh are the FP8 and the hybrid
# cases' (fp8 on data=2,expert=2,tensor=2, the hybrid's chunked prefill on fsdp=2,expert=2,tensor=2)
@pytest.mark.parametrize("spec, schedule", [
    *(full_matrix(case, "test_aligned_generation_is_bitwise_on_every_mesh[data=2,expert=2,tensor=2-continuous]",
                  "one axis alone: the mixed mesh splits it with the others")
      for case in [("data=8", "static"), ("data=8", "continuous"), ("tensor=8", "static")]),
    pytest.param("data=2,expert=2,tensor=2", "continuous", marks=pytest.mark.bitwise)])
def test_aligned_generation_is_bitwise_on_every_mesh(model, spec, schedule):
    kw = dict(max_new_tokens=8, temperature=1.0, seed=5, schedule=schedule, batch_size=8)
    one = generate(model, _prompts(model.config), ALIGNED, **kw)
    sharded = generate(model, _prompts(model.config), ALIGNED, mesh=make_mesh(spec), **kw)
    np.testing.assert_array_equal(sharded.tokens, one.tokens)
    np.testing.assert_array_equal(sharded.logprobs, one.logprobs)
    np.testing.assert_array_equal(sharded.routing.indices, one.routing.indices)


@pytest.mark.full_matrix(cover=HERE + "test_kv_cache_is_sharded[data=4,tensor=2]",
                         why="MLA + DSA on data=4,tensor=2: the attention cache's sharding rules on GQA, and "
                             "tiny-glm5's one-device aligned cases")
def test_glm5_latent_cache_is_split_over_the_batch_and_generation_is_bitwise():
    """tiny-glm5 (MLA + DSA) on data=4,tensor=2: the latent cache [B, 1, rows, M] (latent, rope key and indexer
    key, shared by every head) is split over the batch axes only (LATENT_CACHE_AXES), and the aligned engine
    generates the same tokens, logprobs, experts and indexer selections as on one device."""
    from jaxalign.model.mla import LATENT_CACHE_AXES
    glm5 = build_model("tiny-glm5")
    cfg, mesh = glm5.config, make_mesh("data=4,tensor=2")
    kv = _sharded_prefill_cache(glm5, mesh)
    assert LATENT_CACHE_AXES == ("cache_batch", None, None, "cache_seq")
    spec = tuple(kv[0].sharding.spec)
    assert kv[0].shape[1:3] == (1, cfg.kv_lora_rank + cfg.qk_rope_head_dim + cfg.index_head_dim)
    assert spec + (None,) * (4 - len(spec)) == ("data", None, None, None)

    kw = dict(max_new_tokens=8, temperature=1.0, seed=5, schedule="continuous", batch_size=8)
    one = generate(glm5, _prompts(cfg), ALIGNED, **kw)
    sharded = generate(glm5, _prompts(cfg), ALIGNED, mesh=mesh, **kw)
    np.testing.assert_array_equal(sharded.tokens, one.tokens)
    np.testing.assert_array_equal(sharded.logprobs, one.logprobs)
    np.testing.assert_array_equal(sharded.routing.indices, one.routing.indices)
    np.testing.assert_array_equal(sharded.routing.index_positions, one.routing.index_positions)
    assert (one.routing.index_positions >= 0).any()  # the indexer selected keys (not an all -1 record)


@pytest.mark.bitwise
@pytest.mark.parametrize("spec,schedule,prefill_chunk", [
    full_matrix(("data=4,tensor=2", "continuous", None),
                "test_hybrid_generation_and_scoring_are_bitwise_on_a_mesh[fsdp=2,expert=2,tensor=2-static-4]",
                "states reset on refill, sharded: the one-device continuous hybrid case, and states carried "
                "across chunks sharded over every axis here"),
    ("fsdp=2,expert=2,tensor=2", "static", 4)])
def test_hybrid_generation_and_scoring_are_bitwise_on_a_mesh(spec, schedule, prefill_chunk):
    """tiny-qwen3.5 (gated DeltaNet + gated attention) under aligned-bf16: the sharded engine -- continuous
    batching over 4 slots for 8 prompts (states reset on refill), or a static batch prefilled in chunks of 4
    (states carried across chunks) -- generates the one-device tokens, logprobs and experts, and the sharded
    trainer scores them to the engine's bits."""
    hybrid = build_model("tiny-qwen3.5")
    cfg, mesh = hybrid.config, make_mesh(spec)
    kw = dict(max_new_tokens=8, temperature=1.0, seed=5, schedule=schedule, batch_size=4 if schedule == "continuous"
              else 8, prefill_chunk=prefill_chunk)
    one = generate(hybrid, _prompts(cfg), ALIGNED, **kw)
    sharded = generate(hybrid, _prompts(cfg), ALIGNED, mesh=mesh, **kw)
    np.testing.assert_array_equal(sharded.tokens, one.tokens)
    np.testing.assert_array_equal(sharded.logprobs, one.logprobs)
    np.testing.assert_array_equal(sharded.routing.indices, one.routing.indices)
    scored = np.asarray(token_logprobs(hybrid, one.tokens, ALIGNED, mesh=mesh)[0])
    np.testing.assert_array_equal(np.where(one.mask, scored, 0.0), np.where(one.mask, one.logprobs, 0.0))


@pytest.mark.bitwise
@pytest.mark.parametrize("preset", [
    full_matrix(preset, "test_hybrid_generation_and_scoring_are_bitwise_on_a_mesh[fsdp=2,expert=2,tensor=2-static-4]",
                "the same sharded engine and trainer claim on another family (about 90 s more each on 2 cores)")
    for preset in ("tiny-gpt-oss", "tiny-deepseek-v4")])
def test_newest_families_generate_and_score_bitwise_on_a_mesh(preset):
    """gpt-oss (sinks, sliding layers, biased projections) and DeepSeek-V4 (hyper-connection streams, CSA and HCA
    compressors and indexer, hash routing) under aligned-bf16 on fsdp=2,expert=2,tensor=2: the sharded engine
    (static batch 8, prefill in chunks of 4) generates the one-device tokens, logprobs, experts and index
    selections, and the sharded trainer scores them to the engine's bits."""
    model = build_model(preset)
    cfg, mesh = model.config, make_mesh("fsdp=2,expert=2,tensor=2")
    kw = dict(max_new_tokens=8, temperature=1.0, seed=5, batch_size=8, prefill_chunk=4)
    one = generate(model, _prompts(cfg), ALIGNED, **kw)
    sharded = generate(model, _prompts(cfg), ALIGNED, mesh=mesh, **kw)
    np.testing.assert_array_equal(sharded.tokens, one.tokens)
    np.testing.assert_array_equal(sharded.logprobs, one.logprobs)
    np.testing.assert_array_equal(sharded.routing.indices, one.routing.indices)
    if one.routing.index_positions is not None:
        np.testing.assert_array_equal(sharded.routing.index_positions, one.routing.index_positions)
    scored = np.asarray(token_logprobs(model, one.tokens, ALIGNED, mesh=mesh)[0])
    np.testing.assert_array_equal(np.where(one.mask, scored, 0.0), np.where(one.mask, one.logprobs, 0.0))


@pytest.mark.bitwise
def test_cross_device_knob(model):
    """The knob test of `cross_device`: on fsdp=4,tensor=2 the partitioner's all-reduces (xla) change the bits,
    ordered restores the one-device bits."""
    tokens = random_tokens(model.config, 8, 24)
    mesh = make_mesh("fsdp=4,tensor=2")
    one = np.asarray(token_logprobs(model, tokens, ALIGNED)[0])
    xla = np.asarray(token_logprobs(model, tokens, ALIGNED.replace(cross_device="xla"), mesh=mesh)[0])
    ordered = np.asarray(token_logprobs(model, tokens, ALIGNED, mesh=mesh)[0])
    assert not np.array_equal(xla, one)
    np.testing.assert_allclose(xla, one, atol=1e-5)
    np.testing.assert_array_equal(ordered, one)


@pytest.mark.bitwise
def test_rl_run_on_a_trainer_mesh_matches_one_device_bitwise(tmp_path):
    """The run of `rl_config()` on data=2,expert=2,tensor=2 (the engine on tensor=2) gives the metric rows of
    the same run on one device. That run is the one-device process's that started this suite
    (tests/test_meshes.py: its programs are the trainer tests', where this process would compile them for 8
    devices again), from the warm start both load; run on its own, this suite makes both here."""
    one, sft = one_device_reference(str(tmp_path))
    meshed = Trainer(warm_start(ModelConfig.preset("countdown"), SFT, sft, progress=False),
                     rl_config(trainer_mesh="data=2,expert=2,tensor=2", engine_mesh="tensor=2"),
                     str(tmp_path / "mesh"))
    rows = meshed.run(progress=False)
    assert comparable_rows(rows) == one
    assert any(r.get("grad_norm", 0) > 0 for r in rows)  # the weights did move
    # parameters and Adam moments stayed split by the rules through the updates
    q = meshed.params["blocks"][0]["attn"]["q_proj"]["w"][...]
    assert q.sharding.spec == P(None, "tensor")
    mu = meshed.opt_state[1][0].mu["blocks"][0]["attn"]["q_proj"]["w"][...]
    assert mu.sharding == q.sharding
