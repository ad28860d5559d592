"""4-bit weights (numerics/lowbit.py): MXFP4 and INT4 against float64 references of their definitions on generated
and hostile blocks, W4A16 as the unquantised policy on pre-quantised weights, the straight-through gradient,
re-quantisation at every sync, `aligned-mxfp4` engine == trainer bitwise and the `serve-mxfp4` gap. The knob
cases are in tests/test_knobs.py."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxalign import NumericPolicy
from jaxalign.numerics import fp8, lowbit

from conftest import build_model, random_tokens

E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # the spec's E2M1 magnitudes


def _flush(x: np.ndarray) -> np.ndarray:
    """float32 subnormals read and written as zero, as XLA:CPU does (the module docstring's stated semantics)."""
    x = np.asarray(x, np.float64)
    with np.errstate(invalid="ignore"):
        return np.where(np.abs(x) < 2.0 ** -126, 0.0 * x, x)


def _ref_e2m1(x: np.ndarray) -> np.ndarray:
    """Round to the E2M1 grid: nearest, ties to the value with an even mantissa bit, saturated to +-6 (float64)."""
    mag = np.minimum(np.abs(x), 6.0)
    below = E2M1_GRID[np.clip(np.searchsorted(E2M1_GRID, mag, side="right") - 1, 0, 7)]
    above = E2M1_GRID[np.clip(np.searchsorted(E2M1_GRID, mag, side="left"), 0, 7)]
    even = {0.0: True, 0.5: False, 1.0: True, 1.5: False, 2.0: True, 3.0: False, 4.0: True, 6.0: False}
    pick_above = (mag - below > above - mag) | ((mag - below == above - mag) & np.vectorize(even.get)(above))
    return np.sign(x) * np.where(pick_above, above, below)


def _ref_mxfp4(w: np.ndarray) -> np.ndarray:
    """The OCP MX v1.0 MXFP4 values of w [K, N] (float64): blocks of 32 along K, X = 2^(floor(log2 amax) - 2)
    clamped to [2^-127, 2^127], NaN for a block with a NaN or an infinity, elements rounded to E2M1."""
    w = _flush(w.astype(np.float32))
    out = np.empty_like(w)
    for start in range(0, w.shape[0], 32):
        block = w[start:start + 32]
        amax = np.abs(block).max(axis=0)
        finite = np.isfinite(amax)
        with np.errstate(divide="ignore", invalid="ignore"):
            e = np.where(amax > 0, np.floor(np.log2(np.where(finite & (amax > 0), amax, 1.0))) - 2, -127)
        x = 2.0 ** np.clip(e, -127, 127)
        with np.errstate(invalid="ignore"):
            values = _ref_e2m1(np.where(finite, block / x, 0.0)) * x
        out[start:start + 32] = np.where(finite, _flush(values), np.nan)
    return out


def _hostile_weights(rng) -> np.ndarray:
    """[70, 24] (two full blocks and a partial one per column): random scales over 60 binades, exact E2M1 ties,
    saturating values between 6X and 8X, all-zero, NaN, +-inf, tiny and huge blocks, negative zeros."""
    w = (rng.standard_normal((70, 24)) * 2.0 ** rng.integers(-30, 30, (1, 24))).astype(np.float32)
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, -5.0, 7.0, 7.9, -7.5, 6.0])
    w[:14, 0] = ties  # amax 7.9: X = 2^0, so these are ties and saturations of E2M1 itself
    w[14:32, 0] = 0.1
    w[:, 1] = 0.0
    w[32:64, 1] = -0.0
    w[3, 2] = np.nan
    w[40, 3] = np.inf
    w[65, 4] = -np.inf
    w[:, 5] = rng.standard_normal(70).astype(np.float32) * 2.0 ** -120  # near the bottom of the range
    w[:, 6] = rng.standard_normal(70).astype(np.float32) * 2.0 ** 120  # near the top
    w[:32, 7] = 2.0 ** np.arange(-16, 16)  # powers of two: amax exactly a power of two
    w[32:64, 7] = np.nextafter(np.float32(8.0), np.float32(0)) * np.sign(rng.standard_normal(32))
    return w


@pytest.mark.bitwise
def test_e2m1_rounding_is_ml_dtypes_cast_with_saturation():
    check = lowbit.rounding_check()
    assert check["passed"], check
    x = (np.random.default_rng(0).standard_normal(20000) * 4).astype(np.float32)
    got = np.asarray(jax.jit(lowbit.round_e2m1)(x), np.float64)
    np.testing.assert_array_equal(got, _ref_e2m1(x))
    cast = np.clip(x, -6, 6).astype(ml_dtypes.float4_e2m1fn)
    np.testing.assert_array_equal(got, cast.astype(np.float64))
    codes = np.asarray(jax.jit(lowbit.e2m1_codes)(jnp.asarray(got, jnp.float32)))
    np.testing.assert_array_equal(codes, cast.view(np.uint8))  # ml_dtypes' own bit patterns
    np.testing.assert_array_equal(np.asarray(lowbit.decode_e2m1(jnp.asarray(codes))), got.astype(np.float32))


@pytest.mark.bitwise
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mxfp4_matches_the_spec_on_generated_and_hostile_blocks(seed):
    w = _hostile_weights(np.random.default_rng(seed))
    q = jax.jit(lowbit.quantize_mxfp4)(jnp.asarray(w))
    assert q.codes.dtype == jnp.uint8 and q.scales.dtype == jnp.uint8  # E2M1 bit patterns, E8M0 bytes
    assert q.scales.shape == (3, 24) and q.group == 32
    assert np.asarray(q.codes).max() < 16
    got = np.asarray(q.dequantized(), np.float64)
    np.testing.assert_array_equal(got, _ref_mxfp4(w))
    # the stored scales are the spec's biased exponents: 0 for an all-zero block, 0xFF for a non-finite one
    scale_bytes = np.asarray(q.scales)
    assert scale_bytes[0, 1] == 0 and scale_bytes[1, 1] == 0 and scale_bytes[0, 2] == 255
    assert scale_bytes[1, 3] == 255 and scale_bytes[2, 4] == 255 and scale_bytes[0, 0] == 127  # amax 7.9: 2^0
    assert np.isnan(got[:32, 2]).all() and np.isfinite(got[32:, 2]).all()


@pytest.mark.bitwise
def test_mxfp4_requantises_its_own_values_exactly():
    """Dequantised MXFP4 values quantise back to themselves (a gpt-oss checkpoint's experts held as float32
    masters come back bit for bit), including blocks whose largest element is below 6."""
    rng = np.random.default_rng(4)
    codes = rng.choice(np.concatenate([E2M1_GRID, -E2M1_GRID]), size=(96, 16))
    codes[:32, :8] = np.clip(codes[:32, :8], -3, 3)  # largest element 3 or less: another split of the same value
    scales = 2.0 ** rng.integers(-20, 20, (3, 16))
    values = (codes * np.repeat(scales, 32, axis=0)).astype(np.float32)
    again = np.asarray(lowbit.quantize_mxfp4(jnp.asarray(values)).dequantized())
    np.testing.assert_array_equal(again, values)


def _ref_int4(w: np.ndarray, group: int, fmt: str) -> np.ndarray:
    w = w.astype(np.float32)
    out = np.empty(w.shape, np.float64)
    for start in range(0, w.shape[0], group):
        block = w[start:start + group]
        amax = np.abs(block).max(axis=0)
        if fmt == "f32":
            s = np.clip((amax * (np.float32(1) / np.float32(7))).astype(np.float32), 2.0 ** -126, 2.0 ** 126)
        else:
            e = np.ceil(np.log2(np.maximum(amax, 1e-30) / 7.0))
            e = np.where(amax > 7.0 * 2.0 ** e, e + 1, e)
            e = np.where(amax <= 7.0 * 2.0 ** (e - 1), e - 1, e)
            s = 2.0 ** np.clip(e, -126, 126)
        s = np.where(amax > 0, s, 1.0).astype(np.float32)
        inv = (np.float32(1) / s).astype(np.float32)
        codes = np.clip(np.round((block * inv).astype(np.float32)), -8, 7)  # numpy rounds half to even
        out[start:start + group] = (codes.astype(np.float32) * s).astype(np.float32)
    return out


@pytest.mark.bitwise
@pytest.mark.parametrize("fmt", ["f32", "e8m0"])
def test_int4_matches_its_definition(fmt):
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((70, 12)) * 2.0 ** rng.integers(-20, 20, (1, 12))).astype(np.float32)
    w[:, 0] = 0.0
    w[:16, 1] = np.array([3.5, 0.5, 1.5, -2.5, -0.5, 7.0, 1.0, 2.0, 6.5, -6.5, 4.5, 5.5, 0.0, 0.0, 0.0, 0.0])
    q = jax.jit(lambda a: lowbit.quantize_int4(a, 16, fmt))(jnp.asarray(w))
    assert q.codes.dtype == jnp.int8 and int(np.abs(np.asarray(q.codes)).max()) <= 8
    np.testing.assert_array_equal(np.asarray(q.dequantized(), np.float64), _ref_int4(w, 16, fmt))
    bad = w.copy()
    bad[20, 2] = np.nan
    assert np.isnan(np.asarray(lowbit.quantize_int4(jnp.asarray(bad), 16, fmt).dequantized())[16:32, 2]).all()


def _quantize_experts(model, fmt_policy: NumericPolicy):
    """A copy of `model` whose routed-expert weights hold their 4-bit values (float32), quantised beforehand."""
    state = nnx.state(model)

    def one(path, x):
        names = tuple(str(getattr(p, "key", getattr(p, "name", p))) for p in path)
        names = names[:-1] if names[-1] == "value" else names
        if fp8.is_quantized_leaf(names, "experts"):
            return lowbit.quantize(x, fmt_policy).dequantized()
        return x
    return nnx.merge(nnx.graphdef(model), jax.tree_util.tree_map_with_path(one, state))


@pytest.mark.parametrize("fmt", ["mxfp4", pytest.param("int4:32", marks=pytest.mark.full_matrix(
    cover="tests/test_lowbit.py::test_w4a16_is_the_unquantised_policy_on_prequantised_weights[mxfp4]",
    why="the same W4A16 product on INT4's values; INT4's quantiser has its own core case"))])
def test_w4a16_is_the_unquantised_policy_on_prequantised_weights(fmt):
    """The fields that make serve-mxfp4 differ from serve-bf16 (weight_quant, quant_scope), applied to fp32, give
    fp32's logprobs on a model whose expert weights were quantised beforehand by the format's definition."""
    from jaxalign.model.scoring import token_logprobs

    serve = NumericPolicy.preset("serve-mxfp4")
    fields = {f: getattr(serve, f) for f, _, _ in serve.diff(NumericPolicy.preset("serve-bf16"))}
    assert set(fields) == {"weight_quant", "quant_scope"}
    fields["weight_quant"] = fmt
    policy = NumericPolicy.preset("fp32").replace(**fields)
    model = build_model("small")
    tokens = jnp.asarray(random_tokens(model.config, 3, 20, seed=1))
    got = np.asarray(token_logprobs(model, tokens, policy)[0])
    want = np.asarray(token_logprobs(_quantize_experts(model, policy), tokens, NumericPolicy.preset("fp32"))[0])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    plain = np.asarray(token_logprobs(model, tokens, NumericPolicy.preset("fp32"))[0])
    assert np.abs(got - plain).max() > 1e-3  # the experts did run on 4-bit weights


def test_straight_through_gradient_is_the_unquantised_products():
    policy = NumericPolicy.parse("train-bf16,wq=mxfp4")
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((5, 40)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((40, 24)) * 0.2, jnp.float32)
    g = jnp.asarray(rng.standard_normal((5, 24)), jnp.bfloat16)
    from jaxalign.numerics.matmul import matmul
    from jaxalign.numerics.dtypes import as_param
    _, vjp = jax.vjp(lambda a, b: fp8.linear(a, b, policy), x, w)
    _, plain_vjp = jax.vjp(lambda a, b: matmul(a, as_param(b, policy), policy), x, w)
    for got, want in zip(vjp(g), plain_vjp(g)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_engine_requantises_experts_only_at_every_sync():
    from jaxalign.engine.engine import Engine

    model = build_model("tiny", seed=7)
    engine = Engine(model, NumericPolicy.preset("serve-mxfp4"))
    is_low = lambda v: isinstance(v, lowbit.LowBitWeight)  # noqa: E731

    def quantized(state):
        return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(state, is_leaf=is_low)
                if is_low(v)}
    before = quantized(engine.state)
    assert len(before) == 3 * model.config.n_layers
    assert all(any(f"'{leaf}'" in k for leaf in ("w_gate", "w_up", "w_down")) for k in before), list(before)
    updated = jax.tree.map(lambda a: a * 1.07 + 0.01, nnx.state(model))
    copy = nnx.merge(nnx.graphdef(model), updated)
    engine.sync_weights(copy)
    after = quantized(engine.state)
    masters = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(nnx.state(copy))}
    for key, q in after.items():
        expected = lowbit.quantize_mxfp4(masters[key])
        np.testing.assert_array_equal(np.asarray(q.codes).view(np.uint8), np.asarray(expected.codes).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8), np.asarray(expected.scales).view(np.uint8))
        assert not np.array_equal(np.asarray(q.scales).view(np.uint8), np.asarray(before[key].scales).view(np.uint8))


def test_a_lowbit_weight_meets_only_its_own_format():
    q = lowbit.quantize_mxfp4(jnp.ones((32, 16)))
    with pytest.raises(ValueError, match="weight_quant"):
        fp8.linear(jnp.ones((2, 32), jnp.bfloat16), q, NumericPolicy.parse("serve-bf16,wq=int4:32"))


@pytest.mark.parametrize("text, needle", [
    ("train-bf16,wq=mxfp4:16", "wq"), ("train-bf16,wq=int4:0", "wq"), ("train-bf16,wq=int4", "wq"),
    ("train-bf16,wq_scope=routed", "wq_scope"), ("serve-mxfp4,dispatch=gather", "gather")])
def test_bad_lowbit_policies_are_refused_naming_the_field(text, needle):
    with pytest.raises(ValueError, match=needle):
        NumericPolicy.parse(text)


def test_serve_mxfp4_gap_exceeds_serve_bf16():
    from jaxalign.align.compare import compare

    model = build_model("small")
    trainer = NumericPolicy.preset("train-bf16")
    k3 = {name: compare(model, trainer, NumericPolicy.preset(name), n_prompts=16, max_new_tokens=12,
                        engine_batches=(8,), seed=0)["runs"][0]["k3_kl"] for name in ("serve-bf16", "serve-mxfp4")}
    assert k3["serve-mxfp4"] > 3 * k3["serve-bf16"] > 0, k3


@pytest.mark.bitwise
@pytest.mark.parametrize("schedule, policy_text", [
    ("static", "aligned-mxfp4"), ("continuous", "aligned-mxfp4"),
    pytest.param("static", "aligned-bf16,wq=mxfp4", marks=pytest.mark.full_matrix(
        cover="tests/test_lowbit.py::test_aligned_mxfp4_engine_equals_trainer[static-aligned-mxfp4]",
        why="every linear in MXFP4 (the low-bit study's aligned arm): the same quantised product in more layers"))])
def test_aligned_mxfp4_engine_equals_trainer(schedule, policy_text):
    """aligned-mxfp4 on the small model: the engine's logprobs (experts quantised once, at its sync) are its
    trainer's (quantising its float32 masters inside the forward), bit for bit; and they are not aligned-bf16's.
    Also with every linear in MXFP4 (`wq_scope=all`, the low-bit study's aligned arm)."""
    from jaxalign.align.compare import compare

    model = build_model("small")
    policy = NumericPolicy.parse(policy_text)
    result = compare(model, policy, policy, n_prompts=6, max_new_tokens=8, engine_batches=(4,), seed=2,
                     schedule=schedule)
    run = result["runs"][0]
    assert run["max_abs_logp_diff"] == 0.0 and run["bitwise_equal_fraction"] == 1.0 and run["k3_kl"] == 0.0, run
    bf16 = NumericPolicy.preset("aligned-bf16")
    other = compare(model, bf16, policy, n_prompts=6, max_new_tokens=8, engine_batches=(4,), seed=2,
                    schedule=schedule)["runs"][0]
    assert other["max_abs_logp_diff"] > 0
