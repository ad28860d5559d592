"""gpt-oss's pieces without transformers (tests/test_gpt_oss.py holds the parity with it): the attention kernel
with sinks and a window against a float64 reference in both places the sink may enter (`attn_sink`) and both
forms; the kinds' `jaxalign check` probes; the MoE extras (router bias, expert biases, clamped SwiGLU) through
every expert dispatch, with gradients. The engine's promise on tiny-gpt-oss is tests/test_gpt_oss_engine.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxalign import ModelConfig, NumericPolicy
from jaxalign.numerics.attention import attention

from conftest import build_model, forward_logits, random_tokens

FP32 = NumericPolicy.preset("fp32")
ALIGNED = NumericPolicy.preset("aligned-bf16")


def reference_attention(q, k, v, sinks, window):
    """float64: q [B, Q, H, D] at the last Q of K positions, k/v [B, K, KVH, D]; transformers' eager gpt-oss
    attention (the sink one more logit per head, dropped after the softmax; a key visible when q - window < k <= q)."""
    q, k, v, sinks = (np.asarray(x, np.float64) for x in (q, k, v, sinks))
    b, nq, h, d = q.shape
    nk, kvh = k.shape[1], k.shape[2]
    k, v = np.repeat(k, h // kvh, 2), np.repeat(v, h // kvh, 2)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
    qp, kp = np.arange(nk - nq, nk)[:, None], np.arange(nk)[None]
    visible = (kp <= qp) & ((kp > qp - window) if window else True)
    scores = np.where(visible, scores, -np.inf)
    logits = np.concatenate([scores, np.broadcast_to(sinks[None, :, None, None], (b, h, nq, 1))], -1)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p[..., :-1], v)


@pytest.mark.parametrize("form", ["full", "chunked:4"])
@pytest.mark.parametrize("sink", ["seed", "merge"])
@pytest.mark.parametrize("window", [None, 5])
def test_sink_attention_matches_a_float64_reference(form, sink, window):
    """Sinks from -3 to 3 (a sink far above the scores takes most of the mass, one far below almost none)."""
    rng = np.random.default_rng(0)
    b, nq, nk, h, kvh, d = 2, 6, 13, 4, 2, 8
    q, k, v = (rng.normal(size=shape).astype(np.float32) for shape in ((b, nq, h, d), (b, nk, kvh, d), (b, nk, kvh, d)))
    sinks = np.array([-3.0, 0.0, 1.5, 3.0], np.float32)
    policy = FP32.replace(attention=form, attn_sink=sink)
    got = jax.jit(lambda q, k, v, s: attention(
        q, jnp.transpose(k, (0, 2, 3, 1)), jnp.transpose(v, (0, 2, 1, 3)),
        jnp.broadcast_to(jnp.arange(nk - nq, nk), (b, nq)), jnp.broadcast_to(jnp.arange(nk), (b, nk)), policy,
        window=window, sinks=s))(q, k, v, sinks)
    np.testing.assert_allclose(np.asarray(got), reference_attention(q, k, v, sinks, window), rtol=0, atol=2e-6)


def test_the_sink_placements_and_forms_differ_in_bits_but_not_in_value():
    """seed and merge round differently (the knob test shows it on the model); both stay within f32 noise of each
    other, and the sink's gradient flows in every form."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.normal(size=shape).astype(np.float32) for shape in ((1, 4, 4, 8), (1, 2, 8, 9), (1, 2, 9, 8)))
    pos, kpos = jnp.arange(5, 9)[None], jnp.arange(9)[None]
    outs, grads = {}, {}
    for form in ("full", "chunked:4"):
        for sink in ("seed", "merge"):
            policy = FP32.replace(attention=form, attn_sink=sink)
            fn = jax.jit(lambda s, p=policy: attention(q, k, v, pos, kpos, p, window=6, sinks=s))
            outs[form, sink] = np.asarray(fn(jnp.ones(4)))
            grads[form, sink] = np.asarray(jax.grad(lambda s, f=fn: jnp.sum(f(s) ** 2))(jnp.ones(4)))
    assert not np.array_equal(outs["full", "seed"], outs["full", "merge"])
    for key in outs:
        np.testing.assert_allclose(outs[key], outs["full", "seed"], atol=1e-6)
        np.testing.assert_allclose(grads[key], grads["full", "seed"], atol=1e-5)
        assert np.all(np.abs(grads[key]) > 0)


@pytest.mark.full_matrix(cover="tests/test_gpt_oss.py::test_fp32_logits_match_transformers_in_every_form",
                         why="transformers' parity already needs the window (12 of 96 positions) and the sinks")
def test_window_and_sinks_change_the_model():
    """tiny-gpt-oss over 32 tokens: its window (8) and its sinks each change the logits."""
    from flax import nnx
    model = build_model("tiny-gpt-oss")
    assert model.config.sliding_window == 8 and model.config.layer_kinds[0] == "sliding_sink_attention"
    tokens = random_tokens(model.config, 2, 32, seed=0)
    base = np.asarray(forward_logits(model, tokens, FP32)[0])
    no_sinks = nnx.clone(model)
    for block in no_sinks.blocks:
        block.attn.sinks[...] = jnp.full_like(block.attn.sinks[...], -1e30)
    no_window = nnx.clone(model)
    no_window.blocks[0].attn.window = None
    for other in (no_sinks, no_window):
        assert np.abs(np.asarray(forward_logits(other, tokens, FP32)[0]) - base).max() > 1e-3


def test_check_probes_the_sink_kernels_and_aligned_is_batch_invariant():
    from jaxalign.check import _kernels, probe
    cfg = ModelConfig.preset("tiny-gpt-oss")
    assert {"sink_attention", "sliding_sink_attention"} <= set(_kernels(cfg, ALIGNED))
    for kernel in ("sink_attention", "sliding_sink_attention"):
        result = probe(cfg, ALIGNED, kernel, batches=(1, 3, 8))
        assert result["bitwise_invariant"], result


def _bias_gradients(model, tokens, policy):
    """The gradient of a next-token loss for layer 0's router and expert biases and its sinks."""
    from flax import nnx
    graphdef, state = nnx.split(model)

    def loss(state):
        logits = nnx.merge(graphdef, state)(jnp.asarray(tokens), policy=policy)[0]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1))

    block = nnx.to_pure_dict(jax.jit(jax.grad(loss))(state))["blocks"][0]
    return {**{name: np.asarray(block["mlp"][name]) for name in ("router_bias", "b_gate", "b_up", "b_down")},
            "sinks": np.asarray(block["attn"]["sinks"])}


def test_gpt_oss_moe_extras_and_sinks_get_gradients():
    """The router bias, the expert biases (through the clamped SwiGLU) and the sinks are trained."""
    model = build_model("tiny-gpt-oss")
    for name, grad in _bias_gradients(model, random_tokens(model.config, 2, 16, seed=1), FP32).items():
        assert np.abs(grad).max() > 0, name


@pytest.mark.full_matrix(cover="tests/test_sink_attention.py::test_gpt_oss_moe_extras_and_sinks_get_gradients",
                         why="the same biases through the other expert dispatches")
@pytest.mark.parametrize("dispatch", ["sorted", "gather", "bucketed", "capacity:8"])
def test_gpt_oss_experts_agree_across_dispatches_with_gradients(dispatch):
    """The router bias, the expert biases and the clamped SwiGLU ride through every dispatch: logits and the
    biases' gradients within f32 tolerance of the dense dispatch's."""
    model = build_model("tiny-gpt-oss")
    tokens = random_tokens(model.config, 2, 16, seed=1)
    policy = FP32.replace(dispatch=dispatch)
    np.testing.assert_allclose(np.asarray(forward_logits(model, tokens, policy)[0]),
                               np.asarray(forward_logits(model, tokens, FP32)[0]), rtol=1e-5, atol=1e-5)
    dense, ours = _bias_gradients(model, tokens, FP32), _bias_gradients(model, tokens, policy)
    for name in dense:
        np.testing.assert_allclose(ours[name], dense[name], rtol=1e-4, atol=1e-6, err_msg=name)
