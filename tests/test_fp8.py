"""FP8 (numerics/fp8.py): the quantiser against float64 / ml_dtypes references, the block-scaled product within a
tolerance derived from e4m3's precision, the straight-through gradient, re-quantisation at every weight sync,
and the serve-fp8 gap. The bitwise aligned-fp8 claims are in tests/test_alignment.py and tests/test_engine.py,
the knobs in tests/test_knobs.py."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxalign import NumericPolicy
from jaxalign.numerics import fp8
from jaxalign.numerics.matmul import matmul

from conftest import FAMILY_PRESETS, build_model, random_tokens

E4M3_UNIT = 2.0 ** -4  # unit roundoff of e4m3 (3 stored mantissa bits), relative, for normal values
E4M3_SUBNORMAL_STEP = 2.0 ** -9  # spacing of e4m3 subnormals (times the scale)


def _ref_scale(amax: np.ndarray, fmt: str) -> np.ndarray:
    """float64 reference of `fp8.scale_from_amax` (its stated definition)."""
    amax = np.asarray(amax, np.float64)
    if fmt == "f32":
        s = (np.float32(amax) * (np.float32(1) / np.float32(448))).astype(np.float64)  # one f32 rounding
        s = np.clip(s, 2.0 ** -126, 2.0 ** 126)
    else:
        e = np.ceil(np.log2(np.maximum(amax, 1e-300) / 448.0))
        # log2's rounding can be off by one: make e the smallest integer with amax <= 448 * 2^e, exactly
        e = np.where(amax > 448.0 * 2.0 ** e, e + 1, e)
        e = np.where(amax <= 448.0 * 2.0 ** (e - 1), e - 1, e)
        s = 2.0 ** np.clip(e, -126, 126)
    return np.where(amax > 0, s, 1.0)


def _ref_e4m3(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float64 -> e4m3 via ml_dtypes: x * fl32(1/scale) rounded once to float32, saturated, cast (nearest even)."""
    inv = (np.float32(1) / np.asarray(scale, np.float32))
    y = (np.asarray(x, np.float32) * inv).astype(np.float32)
    return np.clip(y, -448, 448).astype(ml_dtypes.float8_e4m3fn)


def _e4m3_probe_values() -> np.ndarray:
    """Every e4m3 value, every midpoint between neighbours (ties: nearest even decides), one float32 ulp either
    side of each midpoint, values past the largest (saturate) and random ones."""
    v = fp8.e4m3_values()
    mids = ((v[1:] + v[:-1]) / 2).astype(np.float32)
    rng = np.random.default_rng(0)
    return np.concatenate([v, mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf)),
                           [464.0, -464.0, 500.0, 1e30, -1e30, 449.0, 447.9], rng.standard_normal(20000) * 50,
                           rng.standard_normal(20000) * 1e-2]).astype(np.float32)


@pytest.mark.bitwise
def test_e4m3_rounding_is_ml_dtypes_cast_with_saturation():
    x = _e4m3_probe_values()
    got = np.asarray(jax.jit(lambda a: fp8.to_e4m3(a, jnp.float32(1.0)))(x))
    ref = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    assert got.dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(got.view(np.uint8), ref.view(np.uint8))
    assert np.asarray(got, np.float64).max() == 448.0 and not np.isnan(np.asarray(got, np.float64)).any()


@pytest.mark.bitwise
@pytest.mark.parametrize("fmt", ["f32", "e8m0"])
def test_weight_scales_and_values_match_the_float64_reference(fmt):
    rng = np.random.default_rng(1)
    # blocks of very different magnitudes, one all-zero block, a partial last block on both axes (40 x 24, 16x16)
    w = rng.standard_normal((40, 24)).astype(np.float32) * np.float32(10.0) ** rng.integers(-6, 4, (40, 1))
    w[:16, :16] = 0.0
    w[16, 3] = 448.0 * 2.0 ** 5  # amax exactly 448 * 2^e: e8m0 must not round it up
    q = jax.jit(lambda a: fp8.quantize_weight(a, (16, 16), fmt))(w)
    scales = np.asarray(q.scales, np.float64)
    assert scales.shape == (3, 2)
    padded = np.zeros((48, 32))
    padded[:40, :24] = np.abs(w)
    amax = padded.reshape(3, 16, 2, 16).max(axis=(1, 3))
    np.testing.assert_array_equal(scales, _ref_scale(amax, fmt))
    assert scales[0, 0] == 1.0  # the all-zero block
    if fmt == "e8m0":
        np.testing.assert_array_equal(np.exp2(np.round(np.log2(scales))), scales)  # powers of two
        np.testing.assert_array_equal(scales.astype(ml_dtypes.float8_e8m0fnu).astype(np.float64), scales)
        assert scales[1, 0] == 2.0 ** 5
    full = np.repeat(np.repeat(scales, 16, 0), 16, 1)[:40, :24]
    np.testing.assert_array_equal(np.asarray(q.values).view(np.uint8), _ref_e4m3(w, full).view(np.uint8))
    assert (np.abs(np.asarray(q.values, np.float64)) <= 448).all()
    # every block that is not all zero uses the top of the e4m3 range (f32) or at least its upper half (e8m0)
    top = np.abs(np.asarray(q.values, np.float64))
    top = np.pad(top, ((0, 8), (0, 8))).reshape(3, 16, 2, 16).max(axis=(1, 3))
    assert (top[amax > 0] >= (440 if fmt == "f32" else 224)).all()


@pytest.mark.bitwise
def test_activation_tiles_match_the_float64_reference():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((5, 3, 40)) * 3).astype(np.float32)
    x[0, 0] = 0.0
    values, scales = jax.jit(lambda a: fp8.quantize_tiles(a, 16, "f32"))(x)
    amax = np.abs(np.pad(x, ((0, 0), (0, 0), (0, 8)))).reshape(5, 3, 3, 16).max(-1)
    np.testing.assert_array_equal(np.asarray(scales, np.float64), _ref_scale(amax, "f32"))
    full = np.repeat(np.asarray(scales), 16, -1)[..., :40]
    np.testing.assert_array_equal(np.asarray(values).view(np.uint8), _ref_e4m3(x, full).view(np.uint8))


def _block_product_f64(x, w, policy):
    """float64 of the quantised operands' block-scaled product: sum over K blocks of sa * sw * (qa . qw)."""
    r, c = policy.weight_blocks
    b = policy.act_tile
    qa, sa = (np.asarray(a, np.float64) for a in fp8.quantize_tiles(jnp.asarray(x), b, policy.quant_scale))
    qw = fp8.quantize_weight(jnp.asarray(w), (r, c), policy.quant_scale)
    sw, vw = np.asarray(qw.scales, np.float64), np.asarray(qw.values, np.float64)
    xa = qa * np.repeat(sa, b, -1)[..., :x.shape[-1]]
    wd = vw * np.repeat(np.repeat(sw, r, 0), c, 1)[:w.shape[0], :w.shape[1]]
    return xa @ wd, xa, wd


@pytest.mark.parametrize("policy", ["fp32,wq=e4m3:16x16,aq=e4m3:16", "fp32,wq=e4m3:16x8,aq=e4m3:8,qscale=e8m0",
                                    "train-bf16,wq=e4m3:32x16,aq=e4m3:16,kernel=tiled:8"])
def test_block_product_is_within_e4m3_precision_of_float64(policy):
    """Two tolerances, both derived, not tuned: (1) against float64 of the same quantised operands, only float32
    accumulation and scaling error (K products summed, then two scale multiplies and the block sums: (K + 4)
    float32 roundings of |terms|); (2) against float64 of the unquantised operands, each operand's e4m3 rounding
    (relative 2^-4 for normal values, 2^-9 * scale for subnormal ones) bounds the error of each product term."""
    policy = NumericPolicy.parse(policy)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((12, 48)).astype(np.float32)
    w = (rng.standard_normal((48, 40)) / 7).astype(np.float32)
    if policy.compute_dtype != "f32":
        x = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)  # the activation the product sees
    y = np.asarray(jax.jit(lambda a, b: fp8.linear(a, b, policy.replace(compute_dtype="f32")))(x, w), np.float64)
    ref, xa, wd = _block_product_f64(x, w, policy)
    magnitude = np.abs(xa) @ np.abs(wd)
    assert np.all(np.abs(y - ref) <= (48 + 4) * 2.0 ** -24 * magnitude + 1e-30)
    exact = x.astype(np.float64) @ w.astype(np.float64)
    # |xa - x| <= u|x| + step*sa, |wd - w| <= u|w| + step*sw: per term |x||w|(2u + u^2) + subnormal terms
    sa_max = np.abs(x).max() / 448 * 2
    sw_max = np.abs(w).max() / 448 * 2
    bound = ((2 * E4M3_UNIT + E4M3_UNIT ** 2) * (np.abs(x) @ np.abs(w))
             + E4M3_SUBNORMAL_STEP * (sa_max * np.abs(w).sum(0)[None] + sw_max * np.abs(x).sum(1)[:, None]) * 1.1
             + (48 + 4) * 2.0 ** -24 * magnitude)
    assert np.all(np.abs(y - exact) <= bound)
    assert np.abs(y - exact).max() > 1e-3  # the quantisation is real: the error is not float32 noise


def test_straight_through_gradient_is_the_unquantised_products():
    """The trainer's FP8 product differentiates as if quantisation were the identity: its VJP is, bit for bit, the
    VJP of the policy's unquantised product matmul(x, as_param(w)), for the input and the master weight."""
    policy = NumericPolicy.preset("aligned-fp8")
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((9, 32)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((32, 24)) / 6, jnp.float32)
    g = jnp.asarray(rng.standard_normal((9, 24)), jnp.bfloat16)
    y, vjp = jax.vjp(lambda a, b: fp8.linear(a, b, policy), x, w)
    y_plain, vjp_plain = jax.vjp(lambda a, b: matmul(a, b.astype(jnp.bfloat16), policy), x, w)
    assert not np.array_equal(np.asarray(y, np.float32), np.asarray(y_plain, np.float32))  # forward is FP8
    for got, want in zip(jax.jit(vjp)(g), jax.jit(vjp_plain)(g)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_aligned_fp8_model_gradients_are_finite_and_reach_every_quantised_weight():
    from jaxalign.model.scoring import sequence_logprobs

    model = build_model("tiny")
    tokens = jnp.asarray(random_tokens(model.config, 3, 12, seed=2))
    graphdef, state = nnx.split(model)
    policy = NumericPolicy.preset("aligned-fp8")
    grads = jax.jit(jax.grad(lambda s: jnp.sum(sequence_logprobs(nnx.merge(graphdef, s), tokens, policy)[0])))(state)
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    assert all(np.isfinite(np.asarray(g)).all() for _, g in leaves)
    quantized = [np.abs(np.asarray(g)).sum() for p, g in leaves
                 if fp8.is_quantized_leaf(tuple(str(getattr(k, "key", k)) for k in p)[:-1])]
    assert len(quantized) >= 8 and all(q > 0 for q in quantized)


def test_weights_are_requantized_at_every_sync():
    """The engine quantises from the float32 masters at each sync: after an update every quantised weight is
    the quantisation of the new master, and none is the one from before."""
    from jaxalign.engine.engine import Engine

    model = build_model("tiny", seed=7)
    policy = NumericPolicy.preset("serve-fp8")
    engine = Engine(model, policy)

    def quantized(state):
        return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(
            state, is_leaf=lambda v: isinstance(v, fp8.QuantizedWeight)) if isinstance(v, fp8.QuantizedWeight)}
    before = quantized(engine.state)
    assert len(before) >= 10
    updated = jax.tree.map(lambda a: a * 1.07 + 0.01, nnx.state(model))
    copy = nnx.merge(nnx.graphdef(model), updated)
    engine.sync_weights(copy)
    after = quantized(engine.state)
    masters = dict(jax.tree_util.tree_leaves_with_path(nnx.state(copy)))
    assert before.keys() == after.keys()
    for key, q in after.items():
        master = next(v for p, v in masters.items() if jax.tree_util.keystr(p) == key)
        expected = fp8.quantize_weight(master, (16, 16), "f32")
        np.testing.assert_array_equal(np.asarray(q.values).view(np.uint8), np.asarray(expected.values).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(q.scales), np.asarray(expected.scales))
        assert not np.array_equal(np.asarray(q.scales), np.asarray(before[key].scales)), key
    # the LM head, embedding and router stay in their dtypes
    plain = [v for v in jax.tree.leaves(engine.state, is_leaf=lambda v: isinstance(v, fp8.QuantizedWeight))
             if not isinstance(v, fp8.QuantizedWeight)]
    assert plain and all(v.dtype != fp8.E4M3 for v in plain)


@pytest.mark.bitwise
def test_merged_lora_adapters_are_quantised_with_their_weight():
    """lora=merged under aligned-fp8: the engine (merged at its sync, then quantised) and the trainer (merging and
    quantising inside its forward) hold the same e4m3 weights: same logits, bit for bit."""
    from jaxalign.engine.engine import Engine
    from jaxalign.model.scoring import jitted_forward

    from conftest import build_lora_model
    model = build_lora_model("tiny")
    policy = NumericPolicy.preset("aligned-fp8")
    tokens = jnp.asarray(random_tokens(model.config, 3, 12, seed=2))
    engine = Engine(model, policy)
    masters = np.asarray(jitted_forward(engine.graphdef, nnx.state(model), tokens, None, None, policy=policy)[0])
    synced = np.asarray(jitted_forward(engine.graphdef, engine.state, tokens, None, None, policy=policy)[0])
    np.testing.assert_array_equal(synced, masters)
    bf16 = np.asarray(jitted_forward(engine.graphdef, nnx.state(model), tokens, None, None,
                               policy=NumericPolicy.preset("aligned-bf16"))[0])
    assert not np.array_equal(masters, bf16)  # the adapted layers did run in FP8


def test_kv_quant_rounds_keys_and_values_per_token_and_head():
    policy = NumericPolicy.parse("train-bf16,kvq=e4m3")
    rng = np.random.default_rng(5)
    k = (rng.standard_normal((2, 3, 2, 8)) * np.float32(10.0) ** rng.integers(-3, 3, (2, 3, 2, 1))).astype(np.float32)
    got = np.asarray(jax.jit(lambda a: fp8.kv_entries(a, policy))(k), np.float64)
    scale = _ref_scale(np.abs(k).max(-1, keepdims=True), "f32")
    ref = np.asarray(_ref_e4m3(k, scale), np.float64) * scale
    np.testing.assert_array_equal(got, np.asarray(jnp.asarray(ref.astype(np.float32), jnp.bfloat16), np.float64))


def test_kv_quant_e5m2_is_a_direct_cast_as_vllms_fp8_e5m2_cache():
    import ml_dtypes
    policy = NumericPolicy.parse("train-bf16,kvq=e5m2")
    rng = np.random.default_rng(6)
    k = (rng.standard_normal((2, 3, 2, 8)) * np.float32(10.0) ** rng.integers(-3, 4, (2, 3, 2, 1))).astype(np.float32)
    k[0, 0, 0, :2] = [1e6, -1e6]  # saturates, as a cast with clipping does
    got = np.asarray(jax.jit(lambda a: fp8.kv_entries(a, policy))(k), np.float64)
    ref = np.clip(k, -57344.0, 57344.0).astype(ml_dtypes.float8_e5m2).astype(np.float32)
    np.testing.assert_array_equal(got, np.asarray(jnp.asarray(ref, jnp.bfloat16), np.float64))
    e4m3 = np.asarray(fp8.kv_entries(jnp.asarray(k), NumericPolicy.parse("train-bf16,kvq=e4m3")), np.float64)
    small = np.abs(k) < 1e4
    assert np.abs(got - k)[small].mean() > 2 * np.abs(e4m3 - k)[small].mean()  # 2 mantissa bits against 3


@pytest.mark.parametrize("text, needle", [
    ("train-bf16,wq=e4m3:16", "wq"), ("train-bf16,aq=e4m3:0", "aq"), ("train-bf16,qscale=ue8m0", "qscale"),
    ("train-bf16,kvq=e3m4", "kvq"), ("train-bf16,wq=e4m3:16x16,dispatch=gather", "gather"),
    ("serve-fp8,lora=unmerged", "lora"), ("serve-fp8,matmul=bf16", "matmul_acc")])
def test_bad_fp8_policies_are_refused_naming_the_field(text, needle):
    with pytest.raises(ValueError, match=needle):
        NumericPolicy.parse(text)


def test_a_quantized_weight_meets_only_its_own_blocks():
    q = fp8.quantize_weight(jnp.ones((32, 16)), (16, 16), "f32")
    with pytest.raises(ValueError, match="weight_quant"):
        fp8.linear(jnp.ones((2, 32), jnp.bfloat16), q, NumericPolicy.parse("serve-fp8,wq=e4m3:32x32"))


def test_serve_fp8_gap_exceeds_serve_bf16():
    from jaxalign.align.compare import compare

    model = build_model("tiny")
    trainer = NumericPolicy.preset("train-bf16")
    k3 = {name: compare(model, trainer, NumericPolicy.preset(name), n_prompts=16, max_new_tokens=12,
                        engine_batches=(8,), seed=0)["runs"][0]["k3_kl"] for name in ("serve-bf16", "serve-fp8")}
    assert k3["serve-fp8"] > 3 * k3["serve-bf16"] > 0, k3


OTHER_FAMILIES = tuple(p for p in FAMILY_PRESETS if p != "tiny")  # tiny: tests/test_alignment.py's cases
# the default run keeps MLA + DSA + shared experts (tiny-glm5; tiny is tests/test_alignment.py's); the other
# families quantise the same linear layers (JAXALIGN_MATRIX=full runs them)
FP8_CORE_FAMILIES = ("tiny-glm5",)
_FP8_COVER = "tests/test_fp8.py::test_aligned_fp8_engine_equals_trainer_on_every_family[tiny-glm5]"


@pytest.mark.bitwise
@pytest.mark.parametrize("preset", [
    p if p in FP8_CORE_FAMILIES else pytest.param(p, marks=pytest.mark.full_matrix(
        cover=_FP8_COVER, why="aligned-fp8 on one more family: the same quantised linear layers"))
    for p in OTHER_FAMILIES])
def test_aligned_fp8_engine_equals_trainer_on_every_family(preset):
    """Static batches of every family: the aligned-fp8 engine's logprobs (weights quantised once, at its sync)
    are its trainer's (quantising its float32 masters inside the forward), bit for bit."""
    from jaxalign.align.compare import compare

    model = build_model(preset)
    policy = NumericPolicy.preset("aligned-fp8")
    run = compare(model, policy, policy, n_prompts=3, max_new_tokens=4, engine_batches=(3,), seed=2)["runs"][0]
    assert run["max_abs_logp_diff"] == 0.0 and run["bitwise_equal_fraction"] == 1.0 and run["k3_kl"] == 0.0, run
