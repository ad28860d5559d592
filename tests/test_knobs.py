"""A knob test for every NumericPolicy field: flipping it changes the logits for some input, flipping it back
restores them bitwise."""

import numpy as np
import pytest

from jaxalign.numerics import FIELDS, NumericPolicy

from conftest import build_lora_model, build_model, forward_logits, random_tokens

# (field, base policy, flipped value). The base is chosen so that the field is live (e.g. matmul accumulation
# in bf16 needs a bf16 compute dtype; combine order needs a low-precision accumulator to show).
KNOBS = [
    ("param_dtype", "fp32", "bf16"),
    ("compute_dtype", "fp32", "bf16"),
    ("matmul_acc", "train-bf16", "bf16"),
    ("matmul_kernel", "fp32", "tiled:8"),
    ("reduction", "fp32", "tree"),
    ("norm_dtype", "train-bf16", "bf16"),
    ("rope_dtype", "train-bf16", "bf16"),
    ("router_logits_dtype", "fp32", "bf16"),
    ("router_softmax_dtype", "fp32", "bf16"),
    ("combine_weight_dtype", "fp32", "bf16"),
    ("combine_acc_dtype", "fp32", "bf16"),
    ("combine_order", "hf-eager-bf16", "slot"),
    ("combine_order", "serve-bf16", "dense"),
    ("dispatch", "fp32", "sorted"),
    ("dispatch", "fp32", "capacity:0.5"),
    ("dispatch", "fp32", "gather"),
    ("attention", "fp32", "chunked:4"),
    ("attn_scores_dtype", "fp32", "bf16"),
    ("attn_softmax_dtype", "fp32", "bf16"),
    ("kv_cache_dtype", "fp32", "bf16"),
    ("logits_dtype", "fp32", "bf16"),
    ("lora", "aligned-bf16", "unmerged"),  # on a model with LoRA adapters
    ("mla", "fp32", "absorbed"),  # on an MLA model (tiny-deepseek-v3)
    ("mla", "aligned-bf16", "absorbed"),
    ("index_scores_dtype", "fp32", "bf16"),  # on a DSA model (tiny-glm5): bf16 index scores flip selections
    ("index_scores_dtype", "aligned-bf16", "bf16"),
]
KNOB_MODELS = {"mla": "tiny-deepseek-v3", "index_scores_dtype": "tiny-glm5"}


# Fields whose knob needs a device mesh: their knob test runs on 8 fake devices in tests/multidevice/.
MESH_KNOBS = {"cross_device": "tests/multidevice/test_meshes.py::test_cross_device_knob"}


def test_every_field_has_a_knob():
    assert {field for field, _, _ in KNOBS} | set(MESH_KNOBS) == set(FIELDS)


def test_cross_device_is_a_no_op_on_one_device():
    """`cross_device` only decides where sums run on a mesh; on one device both values give the same bits."""
    model = build_model("tiny")
    tokens = random_tokens(model.config, 4, 32, seed=3)
    ordered = NumericPolicy.preset("aligned-bf16")
    assert ordered.cross_device == "ordered"
    np.testing.assert_array_equal(np.asarray(forward_logits(model, tokens, ordered)[0]),
                                  np.asarray(forward_logits(model, tokens, ordered.replace(cross_device="xla"))[0]))


@pytest.mark.parametrize("field, base_name, value", KNOBS, ids=[f"{f}={v}" for f, _, v in KNOBS])
def test_knob_changes_numbers_and_restores(field, base_name, value):
    model = build_lora_model() if field == "lora" else build_model(KNOB_MODELS.get(field, "tiny"))
    tokens = random_tokens(model.config, 4, 32, seed=3)
    base = NumericPolicy.preset(base_name)
    flipped = base.replace(**{field: value})
    assert base.diff(flipped) == [(field, getattr(base, field), value)]
    before = np.asarray(forward_logits(model, tokens, base)[0])
    after = np.asarray(forward_logits(model, tokens, flipped)[0])
    restored = np.asarray(forward_logits(model, tokens, NumericPolicy.parse(str(flipped)).replace(
        **{field: getattr(base, field)}))[0])
    assert not np.array_equal(before, after), f"{field}: {getattr(base, field)} -> {value} changed nothing"
    np.testing.assert_array_equal(before, restored)


def test_bucketed_dispatch_changes_bits_through_row_counts():
    """`dispatch=bucketed` multiplies each expert's rows in a buffer sized to its busiest expert. On the standard
    input it gives the dense dispatch's bits on XLA:CPU (a row of its multi-row products does not depend on the
    row count), so its knob is shown where the row count matters: two tokens on disjoint experts make one-row
    buffers, which XLA:CPU multiplies with its vector-matrix kernel, rounding differently from the dense
    two-row product."""
    import jax
    import jax.numpy as jnp

    from jaxalign.numerics.experts import dispatch

    model = build_model("tiny")
    tokens = random_tokens(model.config, 4, 32, seed=3)
    base = NumericPolicy.preset("fp32")
    np.testing.assert_array_equal(np.asarray(forward_logits(model, tokens, base)[0]),
                                  np.asarray(forward_logits(model, tokens, base.replace(dispatch="bucketed"))[0]))
    rng = np.random.default_rng(0)
    cfg = model.config  # the tiny model's expert shapes
    e, d, f = cfg.n_experts, cfg.d_model, cfg.expert_dim
    w_gate, w_up = (jnp.asarray(rng.standard_normal((e, d, f)), jnp.float32) for _ in range(2))
    w_down = jnp.asarray(rng.standard_normal((e, f, d)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, d)), jnp.float32)
    idx = jnp.arange(2 * cfg.top_k, dtype=jnp.int32).reshape(2, cfg.top_k)  # disjoint experts
    run = jax.jit(lambda policy: dispatch(x, idx, w_gate, w_up, w_down, policy)[0], static_argnums=0)
    dense, bucketed = np.asarray(run(base)), np.asarray(run(base.replace(dispatch="bucketed")))
    assert not np.array_equal(dense, bucketed), "dense -> bucketed changed nothing"
    np.testing.assert_allclose(bucketed, dense, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(run(NumericPolicy.parse(str(base)))), dense)


def test_narrowing_casts_survive_xla_cpu_fusion():
    """XLA:CPU's XNNPACK fusions fold an f32 -> bf16 -> f32 convert pair inside a fused dot + softmax for
    large enough shapes (512 rows here), which made a bf16 router silently run in f32. `numerics.cast` rounds
    with `lax.reduce_precision`, which those rewrites keep; this pins the behaviour."""
    import jax
    import jax.numpy as jnp

    from jaxalign.model.moe import route

    model = build_model("small")
    router = model.blocks[0].mlp.router[...]
    x = jnp.asarray(np.random.default_rng(0).standard_normal((512, model.config.d_model)), jnp.bfloat16)
    f32_router = NumericPolicy.preset("train-bf16")
    bf16_router = f32_router.replace(router_logits_dtype="bf16")
    fn = jax.jit(lambda x, p: route(x, router, None, model.config, p)[1], static_argnums=1)
    assert np.abs(np.asarray(fn(x, f32_router)) - np.asarray(fn(x, bf16_router))).max() > 1e-4
