"""mHC's Sinkhorn iterations as policy fields (`sinkhorn_iters`, `sinkhorn_dtype`; numerics/sinkhorn.py): the
defaults run the model's own iterations in float32, exactly as the model did before the fields existed; the
fields parse, print and refuse bad values by name. Their effect on tiny-deepseek-v4's logits (flip changes them,
flip back restores them bitwise) is tests/test_knobs.py's knob cases."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxalign.numerics import NumericPolicy
from jaxalign.numerics.reduce import divide_by, reduce_sum
from jaxalign.numerics.sinkhorn import sinkhorn, sinkhorn_iterations

pytestmark = pytest.mark.bitwise


def _matrices(seed=0):
    """[2, 3, 4, 4] positive matrices as the hyper-connection gives them: a row softmax + eps, float32."""
    logits = np.random.default_rng(seed).standard_normal((2, 3, 4, 4)).astype(np.float32)
    return jax.nn.softmax(jnp.asarray(logits), axis=-1) + jnp.float32(1e-6)


def _reference(comb, policy, iters, eps):
    """The model's Sinkhorn as it was written before the policy fields (model/hyper.py at 8685760)."""
    eps = jnp.float32(eps)

    def norm(c, axis):
        return divide_by(c, reduce_sum(c, policy, axis=axis, keepdims=True) + eps, axis, policy)

    comb = norm(comb, -2)
    for _ in range(iters - 1):
        comb = norm(norm(comb, -1), -2)
    return comb


@pytest.mark.parametrize("preset", ["fp32", "aligned-bf16", "serve-bf16"])
def test_defaults_keep_the_model_iterations_in_f32_bitwise(preset):
    policy = NumericPolicy.preset(preset)
    assert policy.sinkhorn_iters == "model" and policy.sinkhorn_dtype == "f32"
    comb = _matrices()
    got = jax.jit(lambda c: sinkhorn(c, policy, 4, 1e-6))(comb)
    want = jax.jit(lambda c: _reference(c, policy, 4, 1e-6))(comb)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_explicit_count_overrides_the_model_and_bf16_rounds():
    fp32 = NumericPolicy.preset("fp32")
    comb = _matrices(1)
    assert sinkhorn_iterations(fp32, 20) == 20 and sinkhorn_iterations(fp32.replace(sinkhorn_iters=3), 20) == 3
    two = fp32.replace(sinkhorn_iters="2")
    np.testing.assert_array_equal(np.asarray(sinkhorn(comb, two, 20, 1e-6)),
                                  np.asarray(_reference(comb, fp32, 2, 1e-6)))
    one = np.asarray(sinkhorn(comb, fp32.replace(sinkhorn_iters=1), 20, 1e-6))
    np.testing.assert_allclose(one.sum(-2), 1.0, rtol=1e-5)  # one iteration: columns only
    half = sinkhorn(comb, fp32.replace(sinkhorn_dtype="bf16"), 4, 1e-6)
    assert half.dtype == jnp.float32
    assert np.array_equal(np.asarray(half), np.asarray(half.astype(jnp.bfloat16).astype(jnp.float32)))
    assert not np.array_equal(np.asarray(half), np.asarray(sinkhorn(comb, fp32, 4, 1e-6)))


def test_fields_parse_print_and_compact():
    policy = NumericPolicy.parse("aligned-bf16,sinkhorn=3,sinkhorn_dtype=bf16")
    assert policy.sinkhorn_iters == 3 and isinstance(policy.sinkhorn_iters, int) and policy.sinkhorn_dtype == "bf16"
    assert NumericPolicy.parse(str(policy)) == policy
    assert policy.compact() == "aligned-bf16,sinkhorn=3,sinkhorn_dtype=bf16"
    assert NumericPolicy.preset("aligned-bf16").diff(policy) == [("sinkhorn_iters", "model", "3"),
                                                                 ("sinkhorn_dtype", "f32", "bf16")]
    assert policy.replace(sinkhorn_iters="model") == NumericPolicy.parse("aligned-bf16,sinkhorn_dtype=bf16")


@pytest.mark.parametrize("field, value, allowed", [
    ("sinkhorn_iters", "0", "model|N (N an int >= 1)"),
    ("sinkhorn_iters", 0, "model|N (N an int >= 1)"),
    ("sinkhorn_iters", "-2", "model|N (N an int >= 1)"),
    ("sinkhorn_iters", "2.5", "model|N (N an int >= 1)"),
    ("sinkhorn_iters", True, "model|N (N an int >= 1)"),
    ("sinkhorn_iters", "auto", "model|N (N an int >= 1)"),
    ("sinkhorn_dtype", "fp8", "f32|bf16|f16"),
])
def test_bad_values_are_refused_by_name(field, value, allowed):
    with pytest.raises(ValueError, match=rf"NumericPolicy\.{field} .*allowed: {re.escape(allowed)}"):
        NumericPolicy.preset("fp32").replace(**{field: value})
    key = {"sinkhorn_iters": "sinkhorn", "sinkhorn_dtype": "sinkhorn_dtype"}[field]
    with pytest.raises(ValueError, match=rf"NumericPolicy\.{field} \({key}\)"):
        NumericPolicy.parse(f"fp32,{key}={value}")
