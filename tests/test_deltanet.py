"""Gated DeltaNet (kind `gated_deltanet`, numerics/delta_rule.py): both forms of the delta rule against a float64
re-implementation of transformers' documented recurrence, the short conv's state, and the engine's promises --
invalid (pad) entries never change a row's state, reset_state clears exactly the given rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxalign import ModelConfig, NumericPolicy
from jaxalign.model import kinds
from jaxalign.numerics.delta_rule import causal_conv, delta_rule

from conftest import build_model, forward_logits

FP32 = NumericPolicy.preset("fp32")


def reference_delta_rule(q, k, v, g, beta):
    """float64 numpy, one token at a time, as transformers' `torch_recurrent_gated_delta_rule` (l2-normalised
    q/k with eps 1e-6, q scaled by Dk^-1/2, key heads repeated to the value heads)."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    rep = v.shape[2] // k.shape[2]
    q, k = np.repeat(q, rep, 2), np.repeat(k, rep, 2)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(q.shape[-1])
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    b, s, h, dv = v.shape
    state = np.zeros((b, h, k.shape[-1], dv))
    out = np.zeros((b, s, h, dv))
    for t in range(s):
        state = state * np.exp(g[:, t])[..., None, None]
        delta = (v[:, t] - np.einsum("bhkv,bhk->bhv", state, k[:, t])) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = np.einsum("bhkv,bhk->bhv", state, q[:, t])
    return out, state


def _inputs(b=2, s=40, hk=2, h=4, dk=16, dv=8, seed=0):
    rng = np.random.default_rng(seed)
    q, k = rng.normal(size=(b, s, hk, dk)), rng.normal(size=(b, s, hk, dk))
    v = rng.normal(size=(b, s, h, dv))
    g = -np.log1p(np.exp(rng.normal(size=(b, s, h))))  # log decays <= 0
    beta = 1 / (1 + np.exp(-rng.normal(size=(b, s, h))))
    return [np.asarray(x, np.float32) for x in (q, k, v, g, beta)]


@pytest.mark.parametrize("form", ["recurrent", "chunked:8", "chunked:64"])
def test_both_forms_match_the_float64_recurrence(form):
    """40 tokens: five chunks of 8 (and one padded chunk of 64); outputs and final state within float32 noise."""
    inputs = _inputs()
    ref_out, ref_state = reference_delta_rule(*inputs)
    policy = FP32.replace(delta_rule=form)
    out, state = delta_rule(*map(jnp.asarray, inputs), None, None, policy)
    assert np.abs(np.asarray(out) - ref_out).max() <= 1e-5 * max(1.0, np.abs(ref_out).max())
    assert np.abs(np.asarray(state) - ref_state).max() <= 1e-5 * max(1.0, np.abs(ref_state).max())
    # continuing from a state: two calls of 24 + 16 tokens give the one call's outputs
    first = [x[:, :24] for x in inputs]
    rest = [x[:, 24:] for x in inputs]
    _, mid = delta_rule(*map(jnp.asarray, first), None, None, policy)
    out2, state2 = delta_rule(*map(jnp.asarray, rest), mid, None, policy)
    assert np.abs(np.asarray(out2) - ref_out[:, 24:]).max() <= 1e-5 * max(1.0, np.abs(ref_out).max())
    assert np.abs(np.asarray(state2) - ref_state).max() <= 1e-5 * max(1.0, np.abs(ref_state).max())


@pytest.mark.parametrize("form", ["recurrent", "chunked:8"])
def test_invalid_entries_never_change_a_state(form):
    """Rows with 0, 5 and all 12 valid entries: the delta rule's and the conv's new states equal those of the
    valid prefix alone -- bitwise in the recurrent form; in the chunked form the pads' updates are exact zeros
    but the prefix alone is another program with other chunk contents, so within float32 noise. Treating the
    pads as valid changes them far beyond that (so the check has teeth)."""
    policy = FP32.replace(delta_rule=form)
    q, k, v, g, beta = map(jnp.asarray, _inputs(b=3, s=12, seed=1))
    start = jnp.asarray(np.random.default_rng(2).normal(size=(3, 4, 16, 8)), jnp.float32)
    counts = [0, 5, 12]
    valid = jnp.arange(12)[None, :] < jnp.asarray(counts)[:, None]
    _, state = delta_rule(q, k, v, g, beta, start, valid, policy)
    _, leaky = delta_rule(q, k, v, g, beta, start, None, policy)
    for row, n in enumerate(counts):
        one = lambda x: x[row:row + 1, :n]  # noqa: E731
        expected = start[row] if n == 0 else delta_rule(one(q), one(k), one(v), one(g), one(beta),
                                                        start[row:row + 1], None, policy)[1][0]
        got, want = np.asarray(state[row]), np.asarray(expected)
        if form == "recurrent":
            np.testing.assert_array_equal(got, want)
        else:
            assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()
        if n < 12:
            assert np.abs(np.asarray(leaky[row]) - want).max() > 1e-3 * np.abs(want).max()
    # the conv state: the last K-1 valid inputs (the old state's tail where a row has fewer than K-1)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(3, 12, 6)), jnp.float32)
    weight = jnp.asarray(np.random.default_rng(4).normal(size=(4, 6)), jnp.float32)
    conv_start = jnp.asarray(np.random.default_rng(5).normal(size=(3, 3, 6)), jnp.float32)
    _, conv_state = causal_conv(x, weight, conv_start, valid, policy)
    for row, n in enumerate(counts):
        window = np.concatenate([np.asarray(conv_start[row]), np.asarray(x[row, :n])])
        np.testing.assert_array_equal(np.asarray(conv_state[row]), window[-3:])


def test_causal_conv_matches_torch_semantics_and_carries_its_state():
    """out[t] = silu(sum_j w[j] x[t - (K-1) + j]) with zeros before the sequence; a split call continues it."""
    rng = np.random.default_rng(6)
    x, w = rng.normal(size=(2, 10, 5)).astype(np.float32), rng.normal(size=(4, 5)).astype(np.float32)
    padded = np.concatenate([np.zeros((2, 3, 5)), x], 1)
    pre = sum(w[j] * padded[:, j:j + 10] for j in range(4))
    expected = pre / (1 + np.exp(-pre))
    out, _ = causal_conv(jnp.asarray(x), jnp.asarray(w), None, None, FP32)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-6)
    a, state = causal_conv(jnp.asarray(x[:, :6]), jnp.asarray(w), None, None, FP32)
    b, _ = causal_conv(jnp.asarray(x[:, 6:]), jnp.asarray(w), state, None, FP32)
    np.testing.assert_array_equal(np.concatenate([np.asarray(a), np.asarray(b)], 1), np.asarray(out))


def test_kind_state_reset_bytes_and_config():
    cfg = ModelConfig.preset("tiny-qwen3.5")
    kind = kinds.get("gated_deltanet")
    assert cfg.layer_kinds == ("gated_deltanet", "gated_deltanet", "gqa")
    policy = NumericPolicy.preset("serve-bf16")
    state = kind.init_state(cfg, 3, 32, policy)
    assert state["recurrent"].shape == (3, 4, 16, 8) and state["recurrent"].dtype == jnp.float32
    assert state["conv"].shape == (3, 3, 2 * 32 + 32) and state["conv"].dtype == jnp.bfloat16
    # flat in the cache length
    assert kind.state_bytes(cfg, 3, 32, policy) == kind.state_bytes(cfg, 3, 4096, policy) == \
        3 * (4 * 16 * 8 * 4 + 3 * 96 * 2)
    ones = jax.tree.map(jnp.ones_like, state)
    reset = kind.reset_state(cfg, ones, jnp.asarray([False, True, False]))
    for leaf in jax.tree.leaves(reset):
        assert np.all(np.asarray(leaf[1]) == 0) and np.all(np.asarray(leaf[np.array([0, 2])]) == 1)
    assert kind.form(policy) == "recurrent" and kind.form(NumericPolicy.preset("train-bf16")) == "chunked:64"
    with pytest.raises(ValueError, match="linear_n_v_heads = 3 is not divisible by linear_n_k_heads = 2"):
        cfg.replace(linear_n_v_heads=3)
    with pytest.raises(ValueError, match="ModelConfig.linear_conv_kernel = 0; allowed: a positive int"):
        cfg.replace(linear_conv_kernel=0)
    assert "linear_n_k_heads" not in ModelConfig.preset("tiny").to_dict()  # owned by the kind: fingerprints kept
    assert "attn_output_gate" not in ModelConfig.preset("tiny").to_dict()


def test_train_and_serve_forms_differ_on_the_hybrid():
    """train-bf16 (chunked) and serve-bf16 (recurrent, bf16 norms/router/combine...) give different logprobs."""
    model = build_model("tiny-qwen3.5")
    tokens = np.random.default_rng(0).integers(0, 64, (2, 40))
    train = np.asarray(forward_logits(model, tokens, NumericPolicy.preset("train-bf16"))[0])
    serve = np.asarray(forward_logits(model, tokens, NumericPolicy.preset("serve-bf16"))[0])
    assert np.abs(train - serve).max() > 0


def test_check_probes_the_delta_rule_and_the_aligned_form_is_batch_invariant():
    """`jaxalign check` runs the kind's `delta_rule` probe: a row alone and inside batches gives its bits under
    aligned-bf16 (the recurrent form, tree sums)."""
    from jaxalign.check import probe
    cfg = ModelConfig.preset("tiny-qwen3.5")
    result = probe(cfg, NumericPolicy.preset("aligned-bf16"), "delta_rule", batches=(1, 3, 8))
    assert result["cases"] == 7 and result["bitwise_invariant"], result  # 1 + 3 + 3 positions


def test_check_reports_the_delta_rules_gap_between_the_trainers_and_the_engines_form():
    """`check`'s kernel gap: the same rows through train-bf16's chunked rule and serve-bf16's recurrent one differ;
    with the engine switched to the trainer's form (and the delta-rule fields alone) they are bitwise equal."""
    from jaxalign.check import kernel_gap
    cfg = ModelConfig.preset("tiny-qwen3.5")
    train, serve = NumericPolicy.preset("train-bf16"), NumericPolicy.preset("serve-bf16")
    assert (str(train.delta_rule), str(serve.delta_rule)) == ("chunked:64", "recurrent")
    gap = kernel_gap(cfg, train, serve, "delta_rule")
    assert not gap["bitwise_equal"] and gap["max_abs_diff"] > 0 and gap["kernel"] == "delta_rule"
    same_form = kernel_gap(cfg, train, serve.replace(delta_rule=train.delta_rule), "delta_rule")
    assert same_form["bitwise_equal"] and same_form["max_abs_diff"] == 0.0


@pytest.mark.bitwise
def test_aligned_engine_equals_trainer_with_trained_norms_decays_and_conv():
    """Every parameter of the hybrid moved off its init (zero-centred norm weights, A_log, dt_bias, conv taps --
    as after SFT): the aligned engine, whose weights are cast once at sync, still reports the trainer's logprobs
    bitwise (a zero-centred scale formed from the f32 master instead of the param-dtype weight broke this)."""
    import jax
    from flax import nnx

    import jaxalign as ja
    from jaxalign import Transformer
    model = Transformer(ModelConfig.preset("tiny-qwen3.5"), rngs=nnx.Rngs(1))
    state = nnx.state(model, nnx.Param)
    leaves, tree = jax.tree.flatten(state)
    rng = np.random.default_rng(0)
    leaves = [x + jnp.asarray(rng.normal(0, 0.3, x.shape), jnp.float32) for x in leaves]
    nnx.update(model, jax.tree.unflatten(tree, leaves))
    policy = NumericPolicy.preset("aligned-bf16")
    prompts = [list(rng.integers(3, 60, n)) for n in (5, 11, 8, 3)]
    rollout = ja.generate(model, prompts, policy, max_new_tokens=8, temperature=1.0, seed=0, batch_size=4)
    lp, _ = ja.token_logprobs(model, rollout.tokens, policy, sampling=rollout.sampling)
    np.testing.assert_array_equal(np.asarray(lp)[rollout.mask], rollout.logprobs[rollout.mask])


