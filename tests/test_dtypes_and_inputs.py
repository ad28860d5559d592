"""Intermediate dtypes follow the policy; bad inputs are refused on the host with a clear message."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxalign import NumericPolicy, token_logprobs
from jaxalign.numerics import PRESETS, dtype
from jaxalign.numerics.precision import runs_on
from jaxalign.numerics.attention import attention
from jaxalign.numerics.experts import combine
from jaxalign.numerics.matmul import matmul
from jaxalign.numerics.reduce import rms_norm, softmax

from conftest import build_model, random_tokens

RUNNABLE = [name for name, policy in PRESETS.items() if runs_on(policy)]


def _dot_operand_dtypes(jaxpr) -> set:
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("dot_general", "ragged_dot_general"):
            found.update(str(v.aval.dtype) for v in eqn.invars[:2])
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", None)
            if inner is not None:
                found |= _dot_operand_dtypes(inner if hasattr(inner, "eqns") else inner.jaxpr)
    return found


@pytest.mark.parametrize("name", RUNNABLE)  # fp32-tf32 on the CPU: tests/test_precision.py
def test_model_dtypes_follow_policy(name):
    policy = PRESETS[name]
    model = build_model("tiny")
    tokens = jnp.asarray(random_tokens(model.config, 2, 8))
    graphdef, state = nnx.split(model)
    fn = lambda s, t: nnx.merge(graphdef, s)(t, policy=policy)  # noqa: E731
    logits, record = jax.eval_shape(fn, state, tokens)
    assert logits.dtype == dtype(policy.logits_dtype)
    assert record.indices.dtype == jnp.int32
    # every matmul in the program multiplies operands in the compute dtype, or (router) the router dtype
    jaxpr = jax.make_jaxpr(fn)(state, tokens).jaxpr
    allowed = {str(jnp.dtype(dtype(policy.compute_dtype))), str(jnp.dtype(dtype(policy.router_logits_dtype)))}
    seen = _dot_operand_dtypes(jaxpr)
    assert seen and seen <= allowed, (seen, allowed)


@pytest.mark.parametrize("name", RUNNABLE)  # fp32-tf32 on the CPU: tests/test_precision.py
def test_primitive_dtypes_follow_policy(name):
    p = PRESETS[name]
    cdt = dtype(p.compute_dtype)
    x = jnp.ones((3, 8), jnp.float32)
    assert matmul(x, jnp.ones((8, 4)), p).dtype == cdt
    assert matmul(x, jnp.ones((8, 4)), p, out_dtype=p.logits_dtype).dtype == dtype(p.logits_dtype)
    assert rms_norm(x, jnp.ones(8), p, 1e-6).dtype == cdt
    assert softmax(x, p, p.router_softmax_dtype).dtype == dtype(p.router_softmax_dtype)
    q = jnp.ones((1, 4, 4, 8), cdt)
    k = jnp.ones((1, 2, 8, 4), dtype(p.kv_cache_dtype))  # [B, KVH, D, K]
    v = jnp.ones((1, 2, 4, 8), dtype(p.kv_cache_dtype))  # [B, KVH, K, D]
    pos = jnp.arange(4)[None]
    assert attention(q, k, v, pos, pos, p).dtype == cdt
    y = jnp.ones((3, 2, 8), cdt)
    assert combine(y, jnp.zeros((3, 2), jnp.int32), jnp.ones((3, 2)), 4, p).dtype == cdt


@pytest.mark.parametrize("tokens, needle", [
    (np.array([[1, 2, 64]]), r"allowed: 0\.\.63"),
    (np.array([[-1, 2, 3]]), r"allowed: 0\.\.63"),
    (np.zeros((1, 65), np.int32), "max_seq_len = 64"),
    (np.zeros((1, 0), np.int32), "non-empty"),
    (np.zeros((3,), np.int32), r"\[batch, seq\]"),
    (np.zeros((1, 4), np.float32), "integer"),
    (np.zeros((1, 1), np.int32), "at least 2"),
])
def test_bad_tokens_refused(tokens, needle):
    with pytest.raises(ValueError, match=needle):
        token_logprobs(build_model("tiny"), tokens, NumericPolicy())


def test_bad_replay_and_sampling_refused():
    model = build_model("tiny")
    tokens = random_tokens(model.config, 1, 6)
    with pytest.raises(ValueError, match=r"\[batch, seq, moe_layers, k\]"):
        token_logprobs(model, tokens, NumericPolicy(), replay=np.zeros((1, 6, 2, 3), np.int32))
    with pytest.raises(ValueError, match=r"allowed: -1 \(not routed\) .. 7"):
        token_logprobs(model, tokens, NumericPolicy(), replay=np.full((1, 6, 2, 4), 8, np.int32))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(model, tokens, NumericPolicy(), temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        token_logprobs(model, tokens, NumericPolicy(), top_p=1.5)
    with pytest.raises(ValueError, match="NumericPolicy"):
        token_logprobs(model, tokens, "fp32")
