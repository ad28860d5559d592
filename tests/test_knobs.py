"""A knob test for every NumericPolicy field: flipping it changes the logits for some input, flipping it back
restores them bitwise. Layout knobs (which expert dispatch runs) change the program, not necessarily the bits:
whether they keep the dense dispatch's bits is a fact about one compiler on one CPU, so their test asserts the
program changed and the numbers stayed within float32 tolerance of the dense dispatch. Every test here holds
under every ISA (marked `bitwise`: tests/test_isa_matrix.py reruns them under AVX2 and SSE4.2)."""

import numpy as np
import pytest

from jaxalign.numerics import FIELDS, NumericPolicy

from conftest import build_lora_model, build_model, forward_logits, random_tokens

pytestmark = pytest.mark.bitwise

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
    ("dispatch", "fp32", "capacity:0.5"),  # drops tokens: changes the numbers on any backend
    ("attention", "fp32", "chunked:4"),
    ("attn_sink", "fp32", "merge"),  # on gpt-oss (tiny-gpt-oss): where its attention sinks enter the softmax
    ("attn_scores_dtype", "fp32", "bf16"),
    ("attn_softmax_dtype", "fp32", "bf16"),
    ("kv_cache_dtype", "fp32", "bf16"),
    ("logits_dtype", "fp32", "bf16"),
    ("lora", "aligned-bf16", "unmerged"),  # on a model with LoRA adapters
    ("mla", "fp32", "absorbed"),  # on an MLA model (tiny-deepseek-v3)
    ("mla", "aligned-bf16", "absorbed"),
    ("index_scores_dtype", "fp32", "bf16"),  # on a DSA model (tiny-glm5): bf16 index scores flip selections
    ("index_scores_dtype", "aligned-bf16", "bf16"),
    ("index_ties", "fp32", "torch-cpu"),  # tiny-glm5: relu ties index scores at its top-6 boundary in some rows
    # FP8 (numerics/fp8.py): each field alone, on the trainer's base and from the FP8 presets
    ("weight_quant", "train-bf16", "e4m3:16x16"),
    ("weight_quant", "aligned-fp8", "e4m3:32x32"),  # block granularity
    ("act_quant", "train-bf16", "e4m3:16"),
    ("act_quant", "aligned-fp8", "none"),
    ("quant_scale", "serve-fp8", "e8m0"),
    ("kv_quant", "train-bf16", "e4m3"),
    # 4-bit weights (numerics/lowbit.py): MXFP4 and INT4 on the trainer's base, and which weights they apply to
    ("weight_quant", "train-bf16", "mxfp4"),
    ("weight_quant", "train-bf16", "int4:16"),
    ("quant_scope", "serve-mxfp4", "all"),
    ("kv_quant", "serve-fp8", "e5m2"),
    ("logit_scale", "serve-bf16", "1.05"),  # the synthetic study knob
    # mHC's Sinkhorn (numerics/sinkhorn.py), on DeepSeek-V4 (tiny-deepseek-v4: hc_iters = 4)
    ("sinkhorn_iters", "fp32", "2"),  # an engine running fewer iterations than the checkpoint's config
    ("sinkhorn_dtype", "fp32", "bf16"),
    # gated DeltaNet (numerics/delta_rule.py), on the Qwen3.5 hybrid (tiny-qwen3.5)
    ("delta_rule", "fp32", "recurrent"),
    ("delta_rule", "fp32", "chunked:8"),  # the chunk size (fp32's is 64); in bf16 the forms' f32 differences
    # (~1e-7) rarely cross a bf16 rounding of the output on a model this small (none did here)
    ("delta_state_dtype", "serve-bf16", "bf16"),  # recurrent: the state is rounded after every token
    ("conv_state_dtype", "fp32", "bf16"),
]
KNOB_MODELS = {"mla": "tiny-deepseek-v3", "index_scores_dtype": "tiny-glm5", "index_ties": "tiny-glm5",
               "delta_rule": "tiny-qwen3.5", "attn_sink": "tiny-gpt-oss",
               "delta_state_dtype": "tiny-qwen3.5", "conv_state_dtype": "tiny-qwen3.5",
               "sinkhorn_iters": "tiny-deepseek-v4", "sinkhorn_dtype": "tiny-deepseek-v4"}


# Values that only change how the same sums are laid out (which rows each expert product sees). XLA:CPU may or may
# not give them the dense dispatch's bits depending on the CPU: on an AVX-512 Xeon `sorted` and `gather` changed
# the bits and on a Zen 3 EPYC they did not; `bucketed` kept them except for one-row buffers under AVX-512 only.
LAYOUT_KNOBS = [
    ("dispatch", "fp32", "sorted"),
    ("dispatch", "fp32", "gather"),
    ("dispatch", "fp32", "bucketed"),
]

# Fields whose knob needs a device mesh: their knob test runs on 8 fake devices in tests/multidevice/.
MESH_KNOBS = {"cross_device": "tests/multidevice/test_meshes.py::test_cross_device_knob"}
# Fields XLA:CPU does not act on (dot algorithms, exp/log accuracy): their knob tests show the program change.
PROGRAM_KNOBS = {"matmul_bwd": "tests/test_precision.py::test_matmul_bwd_knob_changes_only_the_gradient_products",
                 "transcendental_accuracy":
                     "tests/test_precision.py::test_transcendental_accuracy_knob_changes_the_program"}


def test_every_field_has_a_knob():
    assert {field for field, _, _ in KNOBS + LAYOUT_KNOBS} | set(MESH_KNOBS) | set(PROGRAM_KNOBS) == set(FIELDS)



def test_cross_device_is_a_no_op_on_one_device():
    """`cross_device` only decides where sums run on a mesh; on one device both values give the same bits."""
    model = build_model("tiny")
    tokens = random_tokens(model.config, 4, 32, seed=3)
    ordered = NumericPolicy.preset("aligned-bf16")
    assert ordered.cross_device == "ordered"
    np.testing.assert_array_equal(np.asarray(forward_logits(model, tokens, ordered)[0]),
                                  np.asarray(forward_logits(model, tokens, ordered.replace(cross_device="xla"))[0]))


def _knob_cases():
    """KNOBS as cases, with pytest's ids (a repeated id numbered 0, 1, ...); a field flipped to the same value from
    a second base (aligned-bf16) runs in the full matrix, the first base's case in the core."""
    ids = [f"{f}={v}" for f, _, v in KNOBS]
    first, cases = {}, []
    for i, knob in enumerate(KNOBS):
        case_id = ids[i]
        if ids.count(ids[i]) > 1:  # as pytest numbers repeated ids ("_" after a trailing digit)
            case_id += ("_" if case_id[-1].isdigit() else "") + str(ids[:i].count(ids[i]))
        marks = []
        if ids[i] in first:
            marks = [pytest.mark.full_matrix(cover=f"tests/test_knobs.py::test_knob_changes_numbers_and_restores"
                                                   f"[{first[ids[i]]}]", why="the same flip from another base policy")]
        else:
            first[ids[i]] = case_id
        cases.append(pytest.param(*knob, id=case_id, marks=marks))
    return cases


@pytest.mark.parametrize("field, base_name, value", _knob_cases())
def test_knob_changes_numbers_and_restores(field, base_name, value):
    model = build_lora_model() if field == "lora" else build_model(KNOB_MODELS.get(field, "tiny"))
    tokens = random_tokens(model.config, 4, 32, seed=3)
    base = NumericPolicy.preset(base_name)
    flipped = base.replace(**{field: value})
    assert base.diff(flipped) == [(field, str(getattr(base, field)), value)]
    before = np.asarray(forward_logits(model, tokens, base)[0])
    after = np.asarray(forward_logits(model, tokens, flipped)[0])
    restored = np.asarray(forward_logits(model, tokens, NumericPolicy.parse(str(flipped)).replace(
        **{field: getattr(base, field)}))[0])
    assert not np.array_equal(before, after), f"{field}: {getattr(base, field)} -> {value} changed nothing"
    np.testing.assert_array_equal(before, restored)


@pytest.mark.parametrize("field, base_name, value", LAYOUT_KNOBS, ids=[f"{f}={v}" for f, _, v in LAYOUT_KNOBS])
def test_layout_knob_changes_the_program_and_restores(field, base_name, value):
    """A layout knob compiles another program (e.g. a ragged grouped matmul instead of a dense expert product)
    whose logits are the base's within float32 tolerance -- equal bits or not, as the CPU's kernels have it --
    and flipping it back restores the base's bits."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxalign.model.scoring import jitted_forward

    model = build_model("tiny")
    tokens = random_tokens(model.config, 4, 32, seed=3)
    base = NumericPolicy.preset(base_name)
    flipped = base.replace(**{field: value})
    assert base.diff(flipped) == [(field, str(getattr(base, field)), value)]
    graphdef, state = nnx.split(model)
    program = lambda p: jitted_forward.lower(graphdef, state, jnp.asarray(tokens), None, None,  # noqa: E731
                                       policy=p).as_text()
    assert program(base) != program(flipped), f"{field}: {getattr(base, field)} -> {value} compiled the same program"
    before = np.asarray(forward_logits(model, tokens, base)[0])
    after = np.asarray(forward_logits(model, tokens, flipped)[0])
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-4)
    restored = NumericPolicy.parse(str(flipped)).replace(**{field: getattr(base, field)})
    np.testing.assert_array_equal(np.asarray(forward_logits(model, tokens, restored)[0]), before)


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
