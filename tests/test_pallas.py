"""The Pallas kernels (`kernel=pallas:BMxBNxBK`), run in interpret mode on the CPU: per-row bitwise invariance to
batch size and position, agreement with float64 within the float32-accumulation bound, gradients by the same
kernels, the policy's errors, and aligned-bf16 with the Pallas path forced bitwise between trainer and engine.

Interpret mode compiles slowly, so each test builds one program for all the cases it checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxalign.align.compare import compare
from jaxalign.numerics import NumericPolicy, platforms
from jaxalign.numerics.matmul import grouped_matmul, matmul
from jaxalign.numerics.pallas_matmul import check_blocks, pallas_matmul

from conftest import build_model

BLOCKS = (8, 16, 16)
PALLAS = NumericPolicy.parse("aligned-bf16,kernel=pallas:8x16x16")
U32 = 2.0 ** -24  # float32 unit roundoff

# With BM = 8 a batch of b rows is one grid of ceil(b/8) row blocks: these sizes give every grid of a batch of up
# to 32 rows (1..4 blocks), each with a partly filled and a full last block, and the single row.
BATCHES = (1, 2, 7, 8, 9, 16, 17, 25, 31, 32)


def _bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def _gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative bound of an n-term float32 dot product (any order)."""
    return n * U32 / (1 - n * U32)


def _within_f32_bound(got, a, b, what):
    """|got - a@b| <= gamma_K |a|@|b| elementwise, a@b and |a|@|b| in float64 (K the contraction length)."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err = np.abs(np.asarray(got, np.float64) - a64 @ b64)
    bound = _gamma(a64.shape[-1]) * (np.abs(a64) @ np.abs(b64))
    assert (err <= bound).all(), f"{what}: worst error/bound {np.max(err / np.maximum(bound, 1e-300)):.3g}"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_pallas_matmul_rows_are_batch_and_position_invariant_and_match_float64(dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((32, 64)), dtype)
    w = jnp.asarray(rng.standard_normal((64, 48)), dtype)
    order = np.random.default_rng(1).permutation(32)

    alone_rows = (5, 12, 31)  # rows in other blocks and block positions, each multiplied alone (batch 1)

    @jax.jit
    def every_case(x, w):
        return ([pallas_matmul(x[:b], w, BLOCKS) for b in BATCHES], pallas_matmul(x[order], w, BLOCKS),
                [pallas_matmul(x[i:i + 1], w, BLOCKS) for i in alone_rows])

    batched, shuffled, alone = every_case(x, w)
    full = np.asarray(batched[-1])
    for b, rows in zip(BATCHES, batched):
        np.testing.assert_array_equal(_bits(rows), _bits(full[:b]), err_msg=f"batch {b}")
    np.testing.assert_array_equal(_bits(np.asarray(shuffled)[np.argsort(order)]), _bits(full))
    for i, row in zip(alone_rows, alone):
        np.testing.assert_array_equal(_bits(row), _bits(full[i:i + 1]), err_msg=f"row {i} alone")
    _within_f32_bound(full, x, w, "pallas_matmul")


def test_pallas_matmul_gradients_use_the_bounded_kernels_and_match_autodiff():
    """Loss sum(c * (x @ w)): dx = c @ w^T and dw = x^T @ c, each within its float32 bound of float64, and equal
    to jax autodiff of a plain float32 product within the same bound."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((13, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((32, 48)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((13, 48)), jnp.float32)
    loss = lambda f: lambda x, w: jnp.sum(c * f(x, w))  # noqa: E731
    dx, dw = jax.jit(jax.grad(loss(lambda x, w: pallas_matmul(x, w, BLOCKS)), argnums=(0, 1)))(x, w)
    _within_f32_bound(dx, c, w.T, "dx")
    _within_f32_bound(dw, x.T, c, "dw")
    plain = jax.grad(loss(lambda x, w: jnp.dot(x, w, precision="highest")), argnums=(0, 1))(x, w)
    for got, ref, (a, b) in zip((dx, dw), plain, ((c, w.T), (x.T, c))):
        bound = 2 * _gamma(a.shape[-1]) * (np.abs(np.asarray(a, np.float64)) @ np.abs(np.asarray(b, np.float64)))
        assert (np.abs(np.asarray(got, np.float64) - np.asarray(ref, np.float64)) <= bound).all()


def test_pallas_grouped_rows_have_the_bits_of_their_expert_alone_and_gradients_are_bounded():
    """Rows sorted by expert (one expert empty, groups that end mid-tile): each row's output has the bits
    pallas_matmul gives it with its expert's weight (the dense dispatch's bits), i.e. it does not depend on the other rows or the group sizes. The
    gradients (same kernels: dx on the transposed weights, dW summed over the expert's tiles) lie within the
    float32 bound of float64."""
    rng = np.random.default_rng(3)
    experts, k, n = 4, 32, 16
    sizes = np.array([7, 0, 9, 4], np.int32)
    rows = int(sizes.sum())
    expert_of = np.repeat(np.arange(experts), sizes)
    # bf16 values in f32 arrays under an f32-compute policy: the products are exact, the checks see the f32 sums
    x, w, c = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16).astype(jnp.float32)
               for shape in ((rows, k), (experts, k, n), (rows, n)))
    policy = PALLAS.replace(compute_dtype="f32")

    @jax.jit
    def run(x, w):
        y, vjp = jax.vjp(lambda x, w: grouped_matmul(x, w, jnp.asarray(sizes), policy), x, w)
        # pallas_matmul is batch invariant (tested above): one call per expert gives each row's bits alone
        alone = [pallas_matmul(x[expert_of == e], w[e], BLOCKS) for e in range(experts) if sizes[e]]
        return y, vjp(c), alone

    y, (dx, dw), alone = run(x, w)
    np.testing.assert_array_equal(_bits(y), _bits(np.concatenate([np.asarray(a) for a in alone])))
    x64, w64, c64 = (np.asarray(a, np.float64) for a in (x, w, c))
    for i in range(rows):
        _within_f32_bound(np.asarray(y)[i:i + 1], x64[i:i + 1], w64[expert_of[i]], f"row {i}")
        _within_f32_bound(np.asarray(dx)[i:i + 1], c64[i:i + 1], w64[expert_of[i]].T, f"dx row {i}")
    for e in range(experts):
        mine = expert_of == e
        _within_f32_bound(np.asarray(dw)[e], x64[mine].T, c64[mine], f"dW[{e}]")


def test_tpu_code_path_in_the_tpu_interpreter_gives_the_cpu_interpreter_bits():
    """The TPU variant of the kernels (scalar vectors in SMEM, TPU-legal blocks: whole dims under 128) run by
    Pallas' TPU interpreter, which simulates TPU memory spaces on the CPU, gives the bits of the CPU path for the
    grouped product and both its gradients. (Mosaic's lowering itself is not exercised here.)"""
    rng = np.random.default_rng(5)
    sizes = jnp.asarray([5, 0, 11], jnp.int32)
    x = jnp.asarray(rng.standard_normal((16, 32)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((3, 32, 16)), jnp.bfloat16)
    policy = NumericPolicy.parse("aligned-bf16,kernel=pallas:16x128x128")

    def run(x, w):
        y, vjp = jax.vjp(lambda x, w: grouped_matmul(x, w, sizes, policy), x, w)
        return (y, *vjp(jnp.ones_like(y)))

    on_cpu = jax.jit(run)(x, w)
    with platforms.simulate("tpu"):
        on_tpu = jax.jit(run)(x, w)
    for name, a, b in zip(("y", "dx", "dw"), on_cpu, on_tpu):
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=name)


@pytest.mark.parametrize("text, message", [
    ("kernel=pallas:8x16", "pallas:BMxBNxBK"),
    ("kernel=pallas:8x24x16", "power of two"),
    ("kernel=pallas:4x16x16", ">= 8"),
    ("kernel=pallas:8x16x16,matmul=bf16,compute=bf16", "accumulate in float32"),
])
def test_bad_pallas_policies_are_refused_with_the_field_and_allowed_values(text, message):
    with pytest.raises(ValueError, match="matmul") as info:
        NumericPolicy.parse(text)
    assert message in str(info.value)


def test_block_shapes_are_checked_against_the_product_and_the_backend():
    check_blocks((8, 16, 16), 64, 48, jnp.bfloat16, "pallas:8x16x16", "cpu")  # fits
    check_blocks((8, 64, 64), 32, 16, jnp.bfloat16, "pallas:8x64x64", "cpu")  # blocks >= dims: whole dims
    with pytest.raises(ValueError, match=r"pallas:8x16x16.*'cpu'.*BN = 16 does not divide 24"):
        check_blocks((8, 16, 16), 64, 24, jnp.bfloat16, "pallas:8x16x16", "cpu")
    with pytest.raises(ValueError, match=r"'gpu'.*\('BM', 8\).*power of two >= 16"):
        check_blocks((8, 16, 16), 64, 48, jnp.bfloat16, "pallas:8x16x16", "gpu")
    with pytest.raises(ValueError, match=r"'gpu'.*\('BN', 48\).*power of two >= 16"):
        check_blocks((16, 64, 16), 64, 48, jnp.bfloat16, "pallas:16x64x16", "gpu")
    check_blocks((16, 16, 16), 64, 48, jnp.bfloat16, "pallas:16x16x16", "gpu")
    with pytest.raises(ValueError, match=r"'tpu'.*multiple of 16 for bfloat16"):
        check_blocks((8, 128, 128), 256, 256, jnp.bfloat16, "pallas:8x128x128", "tpu")
    with pytest.raises(ValueError, match=r"'tpu'.*BN = 64; allowed on tpu: a multiple of 128 or >= 256"):
        check_blocks((16, 64, 128), 256, 256, jnp.bfloat16, "pallas:16x64x128", "tpu")
    check_blocks((16, 128, 128), 256, 64, jnp.bfloat16, "pallas:16x128x128", "tpu")


def test_a_block_shape_that_does_not_fit_a_mesh_or_an_unknown_backend_fails_at_trace_time(monkeypatch):
    x = jnp.ones((3, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"kernel = 'pallas:8x32x16'.*BN = 32 does not divide 48"):
        jax.eval_shape(lambda x: matmul(x, jnp.ones((64, 48)), NumericPolicy.parse("kernel=pallas:8x32x16")), x)
    import jaxalign.numerics.pallas_matmul as pallas_matmul_module

    monkeypatch.setattr(pallas_matmul_module, "mesh_active", lambda: True)
    with pytest.raises(ValueError, match=r"'pallas:8x16x16' under a device mesh.*allowed on a mesh: xla or tiled:T"):
        jax.eval_shape(lambda x: matmul(x, jnp.ones((64, 48)), NumericPolicy.parse("kernel=pallas:8x16x16")), x)
    monkeypatch.setattr(pallas_matmul_module, "mesh_active", lambda: False)
    monkeypatch.setattr(jax, "default_backend", lambda: "metal")
    with pytest.raises(ValueError, match=r"kernel = 'pallas:8x16x16': backend 'metal' has no Pallas lowering.*"
                                         r"allowed backends: cpu"):
        jax.eval_shape(lambda x: matmul(x, jnp.ones((64, 48)), NumericPolicy.parse("kernel=pallas:8x16x16")), x)
    # a platform without Pallas keeps the lax paths of xla and tiled:T
    for kernel in ("xla", "tiled:8"):
        assert jax.eval_shape(lambda x: matmul(x, jnp.ones((64, 48)), NumericPolicy.parse(f"kernel={kernel}")),
                              x).shape == (3, 48)


def test_pallas_kernel_changes_the_numbers_of_the_tiled_kernel():
    """Knob: flipping aligned-bf16's `kernel=tiled:8` to `pallas:8x16x16` changes the program and the bits (the
    Pallas kernel sums the contraction in BK chunks, the tiled kernel in one XLA dot per tile), and flipping back
    restores them."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((13, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 48)), jnp.float32)
    tiled = NumericPolicy.preset("aligned-bf16")
    assert tiled.diff(PALLAS) == [("matmul_kernel", "tiled:8", "pallas:8x16x16")]
    run = jax.jit(lambda x, w, p: matmul(x, w, p, out_dtype="f32"), static_argnums=2)
    assert run.lower(x, w, tiled).as_text() != run.lower(x, w, PALLAS).as_text()
    before, after = np.asarray(run(x, w, tiled)), np.asarray(run(x, w, PALLAS))
    assert not np.array_equal(_bits(before), _bits(after))
    np.testing.assert_array_equal(_bits(run(x, w, PALLAS.replace(matmul_kernel="tiled:8"))), _bits(before))


def _attention_inputs(seed=6, b=2, nq=5, h=4, kvh=2, d=8, nk=40):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, nq, h, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, kvh, d, nk)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, kvh, nk, d)), jnp.float32)
    q_pos = jnp.asarray(np.array([[10, 11, 12, 13, 14], [30, 31, 32, 33, 34]])[:b, :nq], jnp.int32)
    return q, k, v, q_pos, jnp.broadcast_to(jnp.arange(nk, dtype=jnp.int32), (b, nk))


def _attention_f64(q, k, v, q_pos, k_pos):
    """Causal GQA softmax attention in float64: [B, Q, H, D]."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    group = q.shape[2] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [B, H, D, K], [B, H, K, D]
    s = np.einsum("bqhd,bhdk->bhqk", q, k) * q.shape[-1] ** -0.5
    s = np.where(np.asarray(k_pos)[:, None, None, :] <= np.asarray(q_pos)[:, None, :, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bhkd->bqhd", p / p.sum(-1, keepdims=True), v)


def test_pallas_attention_query_bits_do_not_depend_on_batch_queries_or_cache_length():
    """float32 policy, chunks of 16 keys. A query's output has the same bits alone (decode), with other queries
    (prefill), in another batch row position, and with a cache of 16 or 40 slots (chunks past its position add
    exact zeros). Against float64: |error| <= (2 e_s + 2 gamma_K + (4 n_chunks + 5) u) max|v|, e_s the float32
    bound on a scaled score (gamma_D |q|.|k| scale + u |s|), exp taken within 2 ulp: first-order error of the
    softmax weights and their normalisation."""
    from jaxalign.numerics.attention import attention

    policy = NumericPolicy.parse("fp32,kernel=pallas:8x16x16,attn=chunked:16,reduce=tree")
    q, k, v, q_pos, k_pos = _attention_inputs()
    run = jax.jit(lambda q, k, v, qp, kp: attention(q, k, v, qp, kp, policy))

    @jax.jit
    def every_case(q, k, v, q_pos, k_pos):
        return (run(q, k, v, q_pos, k_pos),
                run(q[:1, :1], k[:1, ..., :16], v[:1, :, :16], q_pos[:1, :1], k_pos[:1, :16]),  # decode, 16 slots
                run(q[1:, 3:], k[1:], v[1:], q_pos[1:, 3:], k_pos[1:]))  # batch row 1 alone, 2 queries

    full, first_alone, row1 = every_case(q, k, v, q_pos, k_pos)
    np.testing.assert_array_equal(_bits(first_alone), _bits(np.asarray(full)[:1, :1]))
    np.testing.assert_array_equal(_bits(row1), _bits(np.asarray(full)[1:, 3:]))
    d, n_keys, n_chunks = q.shape[-1], k.shape[-1], -(-k.shape[-1] // 16)
    ref = _attention_f64(q, k, v, q_pos, k_pos)
    scale = d ** -0.5
    abs_dots = np.einsum("bqhd,bhdk->bhqk", np.abs(np.asarray(q, np.float64)),
                         np.repeat(np.abs(np.asarray(k, np.float64)), 2, axis=1))
    e_s = _gamma(d) * scale * abs_dots.max() + U32 * scale * abs_dots.max()
    bound = (2 * e_s + 2 * _gamma(n_keys) + (4 * n_chunks + 5) * U32) * np.abs(np.asarray(v)).max()
    assert np.abs(np.asarray(full, np.float64) - ref).max() <= bound


def test_pallas_attention_gradient_is_the_lax_chunked_gradient():
    """The kernel's custom VJP differentiates the lax chunked attention of the same policy: the gradients equal
    autodiff of that path (kernel=xla) bitwise, for q, k and v."""
    from jaxalign.numerics.attention import attention

    policy = NumericPolicy.parse("fp32,kernel=pallas:8x16x16,attn=chunked:16,reduce=tree")
    q, k, v, q_pos, k_pos = _attention_inputs(seed=7, b=1, nk=24)
    c = jnp.asarray(np.random.default_rng(8).standard_normal(q.shape), jnp.float32)
    grads = jax.jit(jax.grad(lambda q, k, v, p: jnp.sum(c * attention(q, k, v, q_pos, k_pos, p)),
                             argnums=(0, 1, 2)), static_argnums=3)
    for name, a, b in zip("qkv", grads(q, k, v, policy), grads(q, k, v, policy.replace(matmul_kernel="xla"))):
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"d{name}")


def test_aligned_bf16_with_pallas_is_bitwise_between_trainer_and_engine():
    """Every kernel on the Pallas path (matmuls, the grouped expert products, chunked attention over a 64-slot
    engine cache and a shorter trainer sequence)."""
    model = build_model("tiny")
    policy = PALLAS.replace(attention="chunked:16")
    result = compare(model, policy, policy, n_prompts=3, max_new_tokens=4, engine_batches=(3,), seed=1)
    for run in result["runs"]:
        assert run["max_abs_logp_diff"] == 0.0 and run["bitwise_equal_fraction"] == 1.0, run
        assert run["route_flip_rate"] == 0.0 and run["k3_kl"] == 0.0
