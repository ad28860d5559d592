"""`kernel=probed:T` (numerics/invariance.py): the backend's plain product proved row-invariant per shape by a
probe, the proof recorded with its environment, a product that is not invariant caught, and the engine still
equal to the trainer bit for bit."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import build_model
from jaxalign.numerics import invariance, kernels, matmul
from jaxalign.numerics.policy import NumericPolicy


def _plain(w):
    return lambda rows: jnp.dot(rows, w, preferred_element_type=jnp.float32)


def _k_split_from(threshold):
    """A product that splits its contraction in two halves once it has `threshold` rows or more, as GEMM
    libraries do for some shapes: each row's sum is then formed in another order."""
    def product_of(w):
        half = w.shape[0] // 2

        def product(rows):
            if rows.shape[0] < threshold:
                return jnp.dot(rows, w, preferred_element_type=jnp.float32)
            return (jnp.dot(rows[:, :half], w[:half], preferred_element_type=jnp.float32)
                    + jnp.dot(rows[:, half:], w[half:], preferred_element_type=jnp.float32))
        return product
    return product_of


def test_buckets_cover_every_row_count_once_and_respect_the_operand_budget():
    assert invariance.BUCKETS[:8] == (8, 16, 24, 32, 40, 48, 56, 64)
    assert all(b > a for a, b in zip(invariance.BUCKETS, invariance.BUCKETS[1:]))
    for rows in (1, 7, 8, 9, 63, 65, 97, 1000, 4097):
        b = invariance.bucket(rows, 64)
        assert b >= rows and b in invariance.BUCKETS and all(c < rows for c in invariance.BUCKETS if c < b)
    assert invariance.max_rows(4096) * 4096 * 4 <= invariance.PROBE_BYTES
    with pytest.raises(ValueError, match="exceed the largest probed bucket"):
        invariance.bucket(invariance.max_rows(4096) + 1, 4096)


def test_a_k_split_product_is_caught_at_the_first_bucket_it_splits():
    """The probe is not a check that cannot fail: a product that changes its summation order at 64 rows is
    refused, naming 64, and a product whose rows see each other is refused too."""
    w = jnp.asarray(np.random.default_rng(0).standard_normal((96, 32)), jnp.float32)
    buckets = (8, 16, 64, 128)
    proven, first, reason = invariance.prove(jax.jit(_k_split_from(64)(w)), 96, jnp.float32, buckets=buckets)
    assert not proven and first == 64 and "differ" in reason
    leaky = jax.jit(lambda rows: _plain(w)(rows + 1e-3 * rows.sum(0)))
    proven, _, reason = invariance.prove(leaky, 96, jnp.float32, buckets=buckets)
    assert not proven
    assert invariance.prove(jax.jit(_plain(w)), 96, jnp.float32, buckets=(8, 16))[0] in (True, False)


def test_an_unproven_shape_keeps_the_tiles_and_says_why(tmp_path, monkeypatch):
    """select_matmul under probed:8 follows the evidence: a refused proof keeps tiled:8 (and the recorded choice
    carries the reason); a proof is kept in the environment's file and read back without probing again."""
    monkeypatch.setenv("JAXALIGN_CACHE_DIR", str(tmp_path))
    invariance.forget()
    policy = NumericPolicy.parse("aligned-bf16,kernel=probed:8")
    split = lambda w: _k_split_from(16)(w)  # noqa: E731

    def refused(product, k, dtype, *, buckets):
        return invariance.prove(product, k, dtype, buckets=tuple(b for b in buckets if b <= 128))

    proof = invariance.evidence(48, 24, jnp.bfloat16, jnp.bfloat16, "t", split, "cpu", prover=refused)
    assert not proof.proven and proof.first_difference == 16
    impl = kernels.select_matmul(policy, 48, 24, jnp.bfloat16, "cpu", probe=lambda: proof)
    assert impl.kind == "lax-tiled" and impl.tile == 8 and "differ" in str(impl)
    stored = json.load(open(invariance.cache_path()))
    assert stored["environment"] == invariance.environment() and len(stored["proofs"]) == 1
    invariance.forget()

    def must_not_probe(*args, **kwargs):
        raise AssertionError("probed again although the environment's file holds the proof")
    must_not_probe.__qualname__ = refused.__qualname__
    again = invariance.evidence(48, 24, jnp.bfloat16, jnp.bfloat16, "t", split, "cpu", prover=must_not_probe)
    assert again == proof
    # another environment (an instruction-set cap) is another file
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_max_isa=AVX")
    assert invariance.cache_path() != invariance.cache_path({**invariance.environment(), "xla_flags": ""})
    # a backend the module does not probe keeps the tiles without a probe
    gpu = invariance.evidence(48, 24, jnp.bfloat16, jnp.bfloat16, "t", split, "gpu", prover=must_not_probe)
    assert not gpu.proven and "not probed" in gpu.reason
    invariance.forget()


def test_probed_products_keep_row_bits_whatever_the_row_count():
    """Under probed:8 a row's product has the same bits in a 1-row, 3-row, ... and 700-row call -- through the
    bucketed plain product where the probe proved it, through the tiles where it did not (the environment's
    proofs file is the user's, as in a real run)."""
    policy = NumericPolicy.parse("aligned-bf16,kernel=probed:8")
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((700, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 96)), jnp.float32)
    run = jax.jit(lambda a, b: matmul.matmul(a, b, policy))
    with kernels.recording() as found:
        full = np.asarray(run(x, w)).view(np.uint16)
    assert len(found) == 1 and ("xla-bucketed" in next(iter(found)) or "tiles" in next(iter(found)))
    for rows in (1, 3, 37, 64, 65):
        assert np.array_equal(np.asarray(run(x[:rows], w)).view(np.uint16), full[:rows]), rows


COVER = "tests/test_invariance.py::test_probed_gives_the_tiles_bits_with_the_plain_product"


@pytest.mark.parametrize("schedule", [
    pytest.param("static", marks=pytest.mark.full_matrix(
        cover=COVER, why="the cover runs the same static compare with the probed engine against a tiled trainer")),
    pytest.param("continuous", marks=pytest.mark.full_matrix(
        cover=COVER, why="the same products as the static case; the continuous schedule's alignment is the tiles'"))])
def test_probed_engine_equals_trainer_bitwise(schedule):
    """aligned-bf16 with kernel=probed:8 on the small model: the engine's logprobs are its trainer's, bit for
    bit, static and continuous (the alignment claim does not depend on which products the probe proved)."""
    from jaxalign.align.compare import compare

    model = build_model("small")
    policy = NumericPolicy.parse("aligned-bf16,kernel=probed:8")
    run = compare(model, policy, policy, n_prompts=6, max_new_tokens=8, engine_batches=(4,), seed=2,
                  schedule=schedule)["runs"][0]
    assert run["max_abs_logp_diff"] == 0.0 and run["bitwise_equal_fraction"] == 1.0 and run["k3_kl"] == 0.0, run


def test_probed_gives_the_tiles_bits_with_the_plain_product():
    """Where a shape is proven its bucket-8 product is the tile's product, and every bucket's rows are the
    bucket-8 rows: so an engine under probed:8 scores exactly what a trainer under tiled:8 does (where a shape is
    not proven it runs the same tiles). The choice changes the implementation, not the bits -- which is why
    switching the aligned presets to it would leave their fingerprints alone on a host where the proofs hold."""
    from jaxalign.align.compare import compare

    model = build_model("small")
    jax.clear_caches()  # recording sees only programs traced inside it; the static test above traced these
    with kernels.recording() as found:
        run = compare(model, NumericPolicy.preset("aligned-bf16"), NumericPolicy.parse("aligned-bf16,kernel=probed:8"),
                      n_prompts=6, max_new_tokens=8, engine_batches=(4,), seed=2, schedule="static")["runs"][0]
    assert run["max_abs_logp_diff"] == 0.0 and run["bitwise_equal_fraction"] == 1.0, run
    assert any("(probed)" in f or ": tiles (" in f for f in found), found  # the probe decided something
