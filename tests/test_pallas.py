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


def _attention_grads_f64(q, k, v, q_pos, k_pos, c):
    """Gradients of sum(c * attention) in float64 (the softmax backward written out): dq, dk, dv in the inputs'
    layouts ([B, Q, H, D], [B, KVH, D, K], [B, KVH, K, D])."""
    q, k, v, c = (np.asarray(a, np.float64) for a in (q, k, v, c))
    group = q.shape[2] // k.shape[1]
    kh, vh = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [B, H, D, K], [B, H, K, D]
    scale = q.shape[-1] ** -0.5
    s = np.einsum("bqhd,bhdk->bhqk", q, kh) * scale
    s = np.where(np.asarray(k_pos)[:, None, None, :] <= np.asarray(q_pos)[:, None, :, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    do = np.transpose(c, (0, 2, 1, 3))  # [B, H, Q, D]
    dp = np.einsum("bhqd,bhkd->bhqk", do, vh)
    ds = p * (dp - np.sum(dp * p, -1, keepdims=True))
    dq = np.einsum("bhqk,bhdk->bqhd", ds, kh) * scale
    dk = np.einsum("bhqk,bqhd->bhdk", ds, q) * scale
    dv = np.einsum("bhqk,bhqd->bhkd", p, do)
    fold = lambda x: x.reshape(x.shape[0], -1, group, *x.shape[2:]).sum(2)  # noqa: E731  heads -> their kv head
    return dq, fold(dk), fold(dv)


@pytest.mark.bitwise
def test_pallas_attention_backward_kernels_match_float64_and_keep_query_rows_batch_invariant():
    """The Pallas backward (numerics/pallas_attention_grad.py, the same fixed key chunks as the forward): float32
    policy, 40 keys in chunks of 16, two batch rows. dq, dk, dv lie within 32 K u max|g| of the float64 gradient
    (K keys, u the float32 unit roundoff), and as close to the lax chunked
    attention's autodiff gradient. A query's dq has the same bits computed alone (its batch row, its queries
    only) as in the full batch; dk and dv sum over every query, so they are not promised invariant."""
    from jaxalign.numerics.attention import attention

    policy = NumericPolicy.parse("fp32,kernel=pallas:8x16x16,attn=chunked:16,reduce=tree")
    q, k, v, q_pos, k_pos = _attention_inputs(seed=7)
    c = jnp.asarray(np.random.default_rng(8).standard_normal(q.shape), jnp.float32)
    grads = jax.jit(jax.grad(lambda q, k, v, qp, kp, c, p: jnp.sum(c * attention(q, k, v, qp, kp, p)),
                             argnums=(0, 1, 2)), static_argnums=6)
    pallas = grads(q, k, v, q_pos, k_pos, c, policy)
    lax_path = grads(q, k, v, q_pos, k_pos, c, policy.replace(matmul_kernel="xla"))
    reference = _attention_grads_f64(q, k, v, q_pos, k_pos, c)
    n_keys = k.shape[-1]
    for name, got, via_lax, ref in zip("qkv", pallas, lax_path, reference):
        tolerance = 32 * n_keys * U32 * np.abs(ref).max()
        assert np.abs(np.asarray(got, np.float64) - ref).max() <= tolerance, f"d{name} vs float64"
        assert np.abs(np.asarray(got, np.float64) - np.asarray(via_lax, np.float64)).max() <= tolerance, name
    alone = grads(q[1:, 3:], k[1:], v[1:], q_pos[1:, 3:], k_pos[1:], c[1:, 3:], policy)
    np.testing.assert_array_equal(_bits(alone[0]), _bits(np.asarray(pallas[0])[1:, 3:]))


def test_aligned_bf16_with_pallas_is_bitwise_between_trainer_and_engine():
    """Every kernel on the Pallas path (matmuls, the grouped expert products, chunked attention over a 64-slot
    engine cache and a shorter trainer sequence)."""
    model = build_model("tiny")
    policy = PALLAS.replace(attention="chunked:16")
    result = compare(model, policy, policy, n_prompts=3, max_new_tokens=4, engine_batches=(3,), seed=1)
    for run in result["runs"]:
        assert run["max_abs_logp_diff"] == 0.0 and run["bitwise_equal_fraction"] == 1.0, run
        assert run["route_flip_rate"] == 0.0 and run["k3_kl"] == 0.0


def test_tiled_kernel_is_chosen_by_platform_with_blocks_derived_from_t(monkeypatch):
    """numerics/kernels.py: `tiled:T` is lax on the CPU and the Pallas kernels on a GPU/TPU, with blocks derived
    from T, the operand dtype and the product's dims (never the rows); `xla` is XLA everywhere, `pallas:...`
    the Pallas kernels everywhere; on a mesh `tiled:T` stays lax. What has no implementation is refused with the
    field, the value, the backend and what is allowed."""
    from jaxalign.numerics import kernels

    aligned = NumericPolicy.preset("aligned-bf16")
    bf16, f32 = jnp.bfloat16, jnp.float32
    pick = lambda policy, platform, dtype=bf16, k=32, n=64: kernels.select_matmul(policy, k, n, dtype, platform)  # noqa: E731,E501
    assert str(pick(aligned, "cpu")) == "matmul: lax-tiled T=8 (cpu)"
    assert str(pick(aligned, "gpu")) == "matmul: pallas 16x64x64 from tiled:8 (gpu, Triton)"
    assert str(pick(aligned, "tpu")) == "matmul: pallas 16x128x128 from tiled:8 (tpu, Mosaic)"
    assert pick(aligned, "tpu", f32).blocks == (8, 128, 128)  # 8 sublanes for 32-bit operands
    assert pick(aligned.replace(matmul_kernel="tiled:24"), "gpu").blocks == (32, 64, 64)
    assert pick(aligned.replace(matmul_kernel="tiled:24"), "tpu", f32).blocks == (24, 128, 128)
    for platform in ("cpu", "gpu", "tpu"):
        assert pick(aligned.replace(matmul_kernel="xla"), platform).kind == "xla"
    forced = pick(PALLAS, "cpu", k=64, n=48)
    assert (forced.kind, forced.blocks, forced.derived) == ("pallas", BLOCKS, False)
    grouped = kernels.select_matmul(aligned, 32, 16, bf16, "gpu", kernel="grouped_matmul")
    assert str(grouped) == "grouped_matmul: pallas 16x64x64 from tiled:8 (gpu, Triton)"
    with kernels.recording() as found:
        pick(aligned, "gpu")
        pick(aligned, "cpu")
    assert found == {"matmul: pallas 16x64x64 from tiled:8 (gpu, Triton)", "matmul: lax-tiled T=8 (cpu)"}
    with pytest.raises(ValueError, match=r"matmul_acc = 'BF16_BF16_F32' with matmul_kernel = 'tiled:8' on backend "
                                         r"'gpu'.*allowed: matmul_acc f32 \(or matmul_kernel=xla\)"):
        pick(aligned.replace(matmul_acc="BF16_BF16_F32"), "gpu")
    with pytest.raises(ValueError, match=r"matmul_bwd = 'BF16_BF16_F32'.*'tpu'.*allowed: matmul_bwd same or f32"):
        pick(aligned.replace(matmul_bwd="BF16_BF16_F32"), "tpu")
    assert pick(aligned.replace(matmul_acc="BF16_BF16_F32"), "cpu").kind == "lax-tiled"

    attend = kernels.select_attention
    chunked = aligned.replace(attention="chunked:16")
    assert attend(aligned, 2, 16, True, "gpu").kind == "lax-full"  # attn=full: lax on every platform
    assert str(attend(chunked, 2, 16, True, "cpu")) == "attention: lax-chunked (cpu)"
    assert str(attend(chunked, 2, 16, True, "gpu")) == "attention: pallas BM=16 from tiled:8 (gpu, Triton)"
    assert attend(chunked, 1, 16, True, "gpu").blocks == (16,)
    assert attend(chunked.replace(attention="chunked:128"), 2, 8, True, "tpu").blocks == (8,)
    assert attend(chunked, 2, 16, False, "gpu").kind == "lax-chunked"  # MLA/DSA: no Pallas kernel
    with pytest.raises(ValueError, match=r"attention = 'chunked:16' with matmul_kernel = 'tiled:8' on backend 'gpu'"
                                         r".*head_dim', 8\).*allowed on gpu \(Triton\): powers of two >= 16"):
        attend(chunked, 2, 8, True, "gpu")
    with pytest.raises(ValueError, match=r"'chunked:16'.*'tpu'.*allowed on tpu: chunk a multiple of 128"):
        attend(chunked, 2, 16, True, "tpu")
    with pytest.raises(ValueError, match=r"Pallas attention kernel computes standard causal attention"):
        attend(PALLAS.replace(attention="chunked:16"), 2, 16, False, "cpu")

    monkeypatch.setattr(kernels, "mesh_active", lambda: True)
    assert pick(aligned, "gpu").kind == "lax-tiled" and attend(chunked, 2, 16, True, "gpu").kind == "lax-chunked"
    with pytest.raises(ValueError, match=r"simulate\('metal'\): allowed platforms: cpu, gpu, tpu"):
        with platforms.simulate("metal"):
            pass


@pytest.mark.bitwise
@pytest.mark.parametrize("target, forced", [("gpu", "pallas:16x64x64"), ("tpu", "pallas:8x128x128")])
def test_tiled_kernel_on_a_simulated_accelerator_runs_the_pallas_kernel_it_chose(target, forced):
    """`tiled:8` on a GPU/TPU, simulated on the CPU (the kernels in interpret mode; Pallas' TPU interpreter for
    the TPU): the product is the Pallas kernel with the derived blocks -- bitwise the forced `pallas:...` of
    those blocks --, each row has its bits alone and in every batch, within the float32 bound of float64, and the
    choice is recorded."""
    from jaxalign.numerics import kernels

    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.standard_normal((33, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)  # dims the forced GPU blocks accept unpadded
    tiled = NumericPolicy.parse("fp32,kernel=tiled:8,reduce=tree")
    product = lambda x, policy: matmul(x, w, policy, out_dtype="f32")  # noqa: E731
    with platforms.simulate(target), kernels.recording() as found:
        @jax.jit
        def every_case(x):
            return [product(x[:b], tiled) for b in (1, 7, 16, 33)], product(x, tiled.replace(matmul_kernel=forced))
        batched, by_forced = every_case(x)
    assert f"matmul: pallas {forced[len('pallas:'):]} from tiled:8 ({target}, {kernels.LOWERINGS[target]})" in found
    full = np.asarray(batched[-1])
    np.testing.assert_array_equal(_bits(by_forced), _bits(full))
    for rows in batched:
        np.testing.assert_array_equal(_bits(rows), _bits(full[:rows.shape[0]]), err_msg=f"batch {rows.shape[0]}")
    _within_f32_bound(full, x, w, f"tiled:8 on {target}")


@pytest.mark.bitwise
def test_aligned_bf16_on_a_simulated_gpu_runs_pallas_and_is_bitwise_between_trainer_and_engine():
    """aligned-bf16 as a GPU would run it (simulated: Pallas kernels chosen for the GPU, in interpret mode): every
    matmul and the sorted dispatch's grouped product run the Pallas kernels with blocks derived from tiled:8 (attn
    is full, so attention stays lax), and trainer and engine agree bitwise."""
    from jaxalign.numerics import kernels

    model = build_model("tiny")
    policy = NumericPolicy.preset("aligned-bf16")
    with platforms.simulate("gpu"), kernels.recording() as found:
        result = compare(model, policy, policy, n_prompts=3, max_new_tokens=4, engine_batches=(3,), seed=1)
    assert {"matmul: pallas 16x64x64 from tiled:8 (gpu, Triton)",
            "grouped_matmul: pallas 16x64x64 from tiled:8 (gpu, Triton)", "attention: lax-full (gpu)"} <= found, found
    assert not any("lax-tiled" in f for f in found), found
    for run in result["runs"]:
        assert run["max_abs_logp_diff"] == 0.0 and run["bitwise_equal_fraction"] == 1.0, run
        assert run["route_flip_rate"] == 0.0 and run["k3_kl"] == 0.0
