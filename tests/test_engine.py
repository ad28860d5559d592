"""The rollout engine: correctness against the teacher-forced forward, sampling statistics, batch/slot
invariance under the aligned policy, compile reuse, bad input."""

import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import jaxalign as ja
from jaxalign.align.compare import random_prompts, score_rollout
from jaxalign.engine.kernels import _sample
from jaxalign.numerics.sampling import SamplingParams

from conftest import build_model, forward_logits

FP32 = ja.NumericPolicy.preset("fp32")
ALIGNED = ja.NumericPolicy.preset("aligned-bf16")


def _prompts(n, seed=0, lo=3, hi=12, vocab=64):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(lo, hi))).astype(np.int32) for _ in range(n)]


@pytest.fixture(scope="module")
def model():
    return build_model("tiny")


# the second case prefills prompts of 4 to 16 tokens in chunks of 6: two in the loop (where two prompts end), then
# a last one of 4 (where the other four end)
@pytest.mark.parametrize("policy_name, chunk, longest", [("fp32", None, 11), ("fp32,dispatch=bucketed", 6, 16)])
def test_greedy_equals_teacher_forced_argmax(model, policy_name, chunk, longest):
    policy = ja.NumericPolicy.parse(policy_name)
    prompts = _prompts(6, hi=longest + 1)
    assert max(len(p) for p in prompts) == longest
    rollout = ja.generate(model, prompts, policy, max_new_tokens=10, temperature=0.0, prefill_chunk=chunk)
    logits = np.asarray(forward_logits(model, rollout.tokens, policy)[0])
    for i in range(len(rollout)):
        p, g = rollout.prompt_lens[i], rollout.completion_lens[i]
        assert g == 10 and rollout.finish_reasons[i] == "length"
        expected = logits[i, p - 1: p - 1 + g].argmax(-1)
        np.testing.assert_array_equal(rollout.completion(i), expected)


@pytest.mark.parametrize("policy_name", ["fp32", "fp32,dispatch=bucketed", "serve-bf16"])
def test_engine_logprobs_match_full_forward(model, policy_name):
    policy = ja.NumericPolicy.parse(policy_name)
    rollout = ja.generate(model, _prompts(5, seed=1), policy, max_new_tokens=8, temperature=0.8, top_p=0.9,
                          seed=2)
    lp, record = ja.token_logprobs(model, rollout.tokens, policy, temperature=0.8, top_p=0.9)
    diff = np.abs(np.asarray(lp) - rollout.logprobs)[rollout.mask]
    tol = 1e-5 if policy.compute_dtype == "f32" else 5e-2  # serve-bf16 is batch variant: prefill/decode shapes differ
    assert diff.max() <= tol
    assert rollout.mask.sum() == rollout.completion_lens.sum()


def test_sampling_travels_with_the_rollout_and_names_the_reported_logprob(model):
    """The rollout stores its SamplingParams; under top-p the two logprob semantics draw the same tokens but
    report different logprobs (renormalised over the kept set >= raw, strictly where mass was cut), and scoring
    the rollout reads its semantics from it, so each agrees with its own trainer-side score."""
    sampling = SamplingParams(temperature=0.8, top_p=0.7)
    prompts = _prompts(5, seed=1)
    renorm = ja.generate(model, prompts, FP32, max_new_tokens=8, sampling=sampling, seed=2)
    raw = ja.generate(model, prompts, FP32, max_new_tokens=8, sampling=SamplingParams(0.8, None, 0.7, "raw"), seed=2)
    assert renorm.sampling == sampling and raw.sampling.logprobs == "raw"
    np.testing.assert_array_equal(renorm.tokens, raw.tokens)
    m = renorm.mask
    assert (renorm.logprobs[m] >= raw.logprobs[m] - 1e-6).all() and (renorm.logprobs[m] > raw.logprobs[m] + 1e-3).any()
    untruncated, _ = ja.token_logprobs(model, raw.tokens, FP32, temperature=0.8)
    np.testing.assert_allclose(np.asarray(untruncated)[m], raw.logprobs[m], atol=1e-5)
    for rollout in (renorm, raw):
        assert score_rollout(model, rollout, FP32)["metrics"]["max_abs_logp_diff"] <= 1e-5
    with pytest.raises(ValueError, match="not both"):
        ja.generate(model, prompts, FP32, max_new_tokens=2, sampling=sampling, temperature=1.0)
    with pytest.raises(ValueError, match="renormalized, raw"):
        SamplingParams(logprobs="truncated")


def test_routing_record_covers_forwarded_tokens(model):
    rollout = ja.generate(model, _prompts(4, seed=3), FP32, max_new_tokens=6, temperature=0.0)
    _, record = ja.token_logprobs(model, rollout.tokens, FP32)
    forwarded = rollout.routing.indices[..., 0, 0] >= 0
    expected = np.arange(rollout.tokens.shape[1])[None] < (rollout.prompt_lens + rollout.completion_lens - 1)[:, None]
    np.testing.assert_array_equal(forwarded, expected)
    np.testing.assert_array_equal(rollout.routing.indices[forwarded], np.asarray(record.indices)[forwarded])


def _draws(logits, n, **kw):
    rows = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, len(logits)))
    sampling = SamplingParams(kw.get("temperature", 1.0), kw.get("top_k"), kw.get("top_p"))
    tokens, _ = _sample(rows, jnp.arange(n, dtype=jnp.int32), jnp.full((n,), 5, jnp.int32), jnp.int32(7), FP32,
                        sampling)
    return np.bincount(np.asarray(tokens), minlength=len(logits))


@pytest.mark.parametrize("kw, expected", [
    (dict(temperature=1.0), None),
    (dict(temperature=0.5), None),
    (dict(temperature=1.0, top_k=3), [0, 1, 2]),
    (dict(temperature=1.0, top_p=0.7), None),
])
def test_sampling_frequencies_pass_chi_square(kw, expected):
    logits = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))
    scaled = logits / kw["temperature"]
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if kw.get("top_k"):
        keep = np.zeros(6, bool)
        keep[expected] = True
        probs = np.where(keep, probs, 0)
    if kw.get("top_p"):
        order = np.argsort(-probs)
        before = np.cumsum(probs[order]) - probs[order]
        keep = np.zeros(6, bool)
        keep[order[before < kw["top_p"]]] = True
        probs = np.where(keep, probs, 0)
    probs /= probs.sum()
    n = 20000
    counts = _draws(logits, n, **kw)
    support = probs > 0
    assert counts[~support].sum() == 0  # filtered tokens are never drawn
    chi2, pvalue = stats.chisquare(counts[support], n * probs[support])
    assert pvalue > 1e-3, (counts, n * probs)


@pytest.mark.bitwise
@pytest.mark.parametrize("policy_name, preset", [pytest.param("aligned-bf16", "small", id="aligned-bf16"),
                                                 pytest.param("aligned-fp8", "tiny", id="aligned-fp8")])
def test_aligned_request_is_invariant_to_batch_and_slot(policy_name, preset):
    """A request's completion, logprobs and experts are the same alone, in static batches of 8 and 32, in
    continuous batching over 3 slots and with a chunked prefill. The models, prompts and settings are those of
    tests/test_alignment.py's bitwise cases (`compare`: 32 prompts, 12 new tokens, seed 1; aligned-bf16 on
    `small`, aligned-fp8 on `tiny`), whose engine batches and schedules these are, so a run compiles their engine
    programs once for both claims."""
    aligned = ja.NumericPolicy.preset(policy_name)
    model = build_model(preset)
    prompts = random_prompts(model.config.vocab_size, 32, 1, max_len=16)
    kw = dict(max_new_tokens=12, temperature=1.0, seed=1)
    alone = [ja.generate(model, [prompts[i]], aligned, request_ids=[i], batch_size=1, **kw) for i in (0, 5, 31)]
    runs = [ja.generate(model, prompts, aligned, batch_size=8, **kw),
            ja.generate(model, prompts, aligned, batch_size=32, **kw),
            ja.generate(model, prompts, aligned, batch_size=3, schedule="continuous", **kw),
            ja.generate(model, prompts, aligned, batch_size=8, prefill_chunk=4, **kw)]
    assert runs[2].stats["compiles"] <= 1
    assert len({len(p) for p in prompts}) > 1  # slots of continuous batching free up at different steps
    for run in runs:
        for j, i in enumerate((0, 5, 31)):
            np.testing.assert_array_equal(run.completion(i), alone[j].completion(0))
            np.testing.assert_array_equal(run.completion_logprobs(i), alone[j].completion_logprobs(0))
    for run in runs[1:]:
        np.testing.assert_array_equal(run.tokens, runs[0].tokens)
        np.testing.assert_array_equal(run.logprobs, runs[0].logprobs)
        np.testing.assert_array_equal(run.routing.indices, runs[0].routing.indices)


def test_eos_and_continuous_refills(model):
    prompts = _prompts(12, seed=5)
    # eos = a token the greedy model produces early for some prompts
    first = ja.generate(model, prompts, FP32, max_new_tokens=6, temperature=0.0)
    eos = int(first.completion(0)[2])
    r = ja.generate(model, prompts, FP32, max_new_tokens=6, temperature=0.0, eos_id=eos, schedule="continuous",
                    batch_size=3)
    assert r.finish_reasons[0] == "eos" and r.completion_lens[0] == 3
    for i in range(len(r)):
        c = r.completion(i)
        assert (r.finish_reasons[i] == "eos") == (c[-1] == eos and len(c) <= 6)
        assert eos not in c[:-1]
        np.testing.assert_array_equal(c, first.completion(i)[: len(c)])


def test_no_recompile_at_same_shapes(model):
    """Each engine counts the programs its own calls compiled: the first call at new shapes compiles, a second
    call at the same buckets (other data, seed, number of new tokens and EOS id: traced operands, not part of the
    program) compiles nothing, in this engine or a fresh one; a new cache bucket compiles again."""
    kw = dict(temperature=1.0, batch_size=4)
    engine = ja.Engine(model, FP32)
    first = engine.generate(_prompts(8, seed=6), seed=11, max_new_tokens=7, **kw)
    assert first.stats["compiles"] >= 1 and engine.compiles == first.stats["compiles"]
    prompts = _prompts(8, seed=7)
    eos = int(first.completion(0)[1])
    r = engine.generate(prompts, seed=3, max_new_tokens=5, eos_id=eos, **kw)  # same buckets, other data and stops
    assert r.stats["compiles"] == 0 and engine.compiles == first.stats["compiles"]
    assert r.stats["cache_len"] == first.stats["cache_len"] and r.completion_lens.max() <= 5
    for i in range(len(r)):  # the traced stops act: a completion ends at max_new or at its first EOS
        c = r.completion(i)
        assert (r.finish_reasons[i] == "eos") == (eos in c) and eos not in c[:-1]
        assert len(c) == 5 or r.finish_reasons[i] == "eos"
    other = ja.Engine(model, FP32)
    assert other.generate(_prompts(8, seed=8), max_new_tokens=7, **kw).stats["compiles"] == 0
    assert other.compiles == 0
    longer = other.generate(_prompts(8, seed=8), max_new_tokens=9, **kw)  # 16 + 9 tokens: the next cache bucket
    assert longer.stats["cache_len"] > first.stats["cache_len"] and longer.stats["compiles"] >= 1


def test_chunked_prefill_program_does_not_grow_with_the_number_of_chunks(model):
    """The whole chunks of a chunked prefill run in one loop: the lowered static program holds as many matrix
    products for a 32-token prompt bucket (8 chunks of 4) as for 16 (4 chunks), and a short last chunk adds one
    more copy of the model's products (16 = 3 chunks of 5 + 1). Unrolled, every chunk added its own copy."""
    from jaxalign.engine.kernels import run_static

    engine = ja.Engine(model, FP32)

    def products(bucket, chunk):
        b = 2
        lowered = run_static.lower(engine.graphdef, engine.state, jnp.zeros((b, bucket), jnp.int32),
                                   jnp.full((b,), 3, jnp.int32), jnp.arange(b, dtype=jnp.int32), jnp.int32(0),
                                   jnp.int32(4), jnp.int32(-1), policy=FP32, cache_len=bucket + 8,
                                   sampling=SamplingParams(temperature=0.0), prefill_chunk=chunk)
        return lowered.as_text().count("stablehlo.dot_general")

    whole, four = products(16, None), products(16, 4)
    assert four == products(32, 4) < products(16, 5) < 2 * whole
    assert four == whole  # one prefill copy, whole or in chunks, and the decode step's


def test_kv_cache_dtype_follows_policy(model):
    engine32, engine16 = ja.Engine(model, FP32), ja.Engine(model, ALIGNED)
    assert engine32.kv_cache_bytes(4, 32) == 2 * engine16.kv_cache_bytes(4, 32)
    import jax
    dtypes = {jax.tree_util.keystr(path): str(x.dtype) for path, x in jax.tree_util.tree_leaves_with_path(engine16.state)}
    # weights are cast once to the param dtype; router parameters are kept in the router dtype (f32 here)
    assert {d for k, d in dtypes.items() if "router" not in k} == {"bfloat16"}
    assert {d for k, d in dtypes.items() if "router" in k} == {"float32"}


@pytest.mark.parametrize("kw, needle", [
    (dict(prompts=[[]]), "empty"),
    (dict(prompts=[[1, 2, 99]]), "allowed: 0..63"),
    (dict(prompts=[list(range(60))]), "cache"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.1), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(schedule="dynamic"), "static, continuous"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(prompts=[]), "non-empty"),
])
def test_bad_input_refused(model, kw, needle):
    args = dict(prompts=[[1, 2, 3]], max_new_tokens=8)
    args.update(kw)
    with pytest.raises(ValueError, match=needle):
        ja.generate(model, args.pop("prompts"), FP32, **args)
