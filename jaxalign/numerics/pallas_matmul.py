"""Batch-invariant matrix products as Pallas kernels (`kernel=pallas:BMxBNxBK` on any backend, and `kernel=tiled:T`
on a GPU/TPU with blocks derived from T: `numerics.kernels`).

The semantics are those of `kernel=tiled:T`, held by the kernel itself rather than by XLA's choices: every output
block [BM, BN] is computed by one kernel instance, whose loop runs over the contraction in chunks of BK, in
ascending order, into a float32 accumulator. There is no split-K and no shape-dependent tiling, so a row's bits
depend only on that row and the weights, never on how many rows are multiplied with it or where it sits.

Backends: on the CPU the kernels run in Pallas interpret mode (each kernel instance evaluated by XLA:CPU, which
sees the same fixed-shape [BM, BK] x [BK, BN] products whatever the batch); on GPU (Triton lowering) and TPU
(Mosaic) they are compiled. `check_blocks` names what each backend accepts. GPU/TPU runs are not measured in this
repository.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxalign.numerics import platforms
from jaxalign.numerics.collectives import mesh_active

BACKENDS = ("cpu (interpret mode)", "gpu (Triton)", "tpu (Mosaic)")


def backend() -> str:
    """The platform the kernels are lowered for: 'cpu', 'gpu' or 'tpu' (`platforms.platform()`: JAX's default
    backend, or the one `platforms.simulate` names)."""
    return platforms.platform()


def refuse_mesh(kernel: str) -> None:
    """Raise a ValueError inside a multi-device mesh: the Pallas kernels are not partitioned here (a compiled
    pallas_call is not split by XLA's partitioner; it would need shard_map), so their bits are only promised on
    one device."""
    if mesh_active():
        raise ValueError(f"NumericPolicy.matmul_kernel = {kernel!r} under a device mesh: the Pallas kernels run on "
                         f"one device only here; allowed on a mesh: xla or tiled:T")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _block(requested: int, dim: int, target: str = "cpu") -> int:
    """The block used along a dimension of size `dim`: the requested one, or the whole dimension if smaller; on
    a GPU rounded to a power of two >= 16 (Triton's block rule; the dimension is zero-padded to it, which adds
    exact zeros)."""
    if target == "gpu":
        return max(16, min(requested, pl.next_power_of_2(dim)))
    return min(requested, dim)


def check_blocks(blocks: tuple[int, int, int], k: int, n: int, operand_dtype, kernel: str,
                 platform: str | None = None) -> None:
    """Raise a ValueError unless `kernel` (= pallas:BMxBNxBK) fits a [., k] x [k, n] product on `platform`.

    Everywhere: one device (no mesh); min(BN, n) must divide n and min(BK, k) must divide k (the model's dims are not padded).
    GPU (Triton): every block used a power of two >= 16 (Triton's block rule and tl.dot's minimum). TPU (Mosaic): BM a multiple of 8 (16 for
    16-bit operands) and each of min(BN, n), min(BK, k) a multiple of 128 or the whole dimension.
    """
    refuse_mesh(kernel)
    platform = platform or backend()
    bm, bn, bk = blocks
    where = f"NumericPolicy.matmul_kernel = {kernel!r} on backend {platform!r} for a [rows, {k}] x [{k}, {n}] product"
    for name, req, dim in (("BN", bn, n), ("BK", bk, k)):
        if dim % _block(req, dim):
            raise ValueError(f"{where}: {name} = {req} does not divide {dim}; allowed: a power of two that divides "
                             f"{dim}, or one >= {dim} (the whole dimension)")
    if platform == "gpu":
        used = (("BM", bm), ("BN", _block(bn, n)), ("BK", _block(bk, k)))
        bad = [(name, b) for name, b in used if b < 16 or b & (b - 1)]
        if bad:
            raise ValueError(f"{where}: block {bad}; allowed on gpu (Triton): every block used (BM, min(BN, {n}), "
                             f"min(BK, {k})) a power of two >= 16")
    if platform == "tpu":
        sub = 16 if jnp.dtype(operand_dtype).itemsize == 2 else 8
        if bm % sub:
            raise ValueError(f"{where}: BM = {bm}; allowed on tpu: a multiple of {sub} for {jnp.dtype(operand_dtype)}")
        for name, req, dim in (("BN", bn, n), ("BK", bk, k)):
            b = _block(req, dim)
            if b % 128 and b != dim:
                raise ValueError(f"{where}: {name} = {req}; allowed on tpu: a multiple of 128 or >= {dim}")


def _precision(dtype) -> lax.Precision:
    """Every product states HIGHEST (never a backend's bf16/TF32 default; the precision audit checks it): full
    float32 products for f32 operands; for 16-bit operands, whose products are exact in the float32 accumulation,
    it changes nothing. (Pallas kernels refuse matmul_acc other than f32, so no policy preset reaches here.)"""
    del dtype
    return lax.Precision.HIGHEST


def _matmul_kernel(a_ref, b_ref, o_ref, *, bk: int, n_k: int, precision):
    """One [bm, bn] output block: the contraction in n_k chunks of bk, in order, summed in float32."""
    def chunk(i, acc):
        start = pl.multiple_of(i * bk, bk)
        return acc + jnp.dot(a_ref[:, pl.ds(start, bk)], b_ref[pl.ds(start, bk), :],
                             preferred_element_type=jnp.float32, precision=precision)
    o_ref[...] = lax.fori_loop(0, n_k, chunk, jnp.zeros(o_ref.shape, jnp.float32))


def blocked_matmul(a: jax.Array, b: jax.Array, blocks: tuple[int, int, int], platform: str) -> jax.Array:
    """a [M, K] @ b [K, N] -> float32 [M, N] by the Pallas kernel lowered for `platform`, any sizes: rows padded
    to BM, the contraction to BK and the columns to BN with zeros (exact: a zero chunk adds zeros to the
    accumulator)."""
    bm, bn_req, bk_req = blocks
    (m, k), n = a.shape, b.shape[1]
    bn, bk = _block(bn_req, n, platform), _block(bk_req, k, platform)
    mp, np_, kp = _round_up(m, bm), _round_up(n, bn), _round_up(k, bk)
    if platform == "gpu":  # Triton blocks are powers of two: the whole-K blocks too
        kp = pl.next_power_of_2(kp)
    a = jnp.pad(a, ((0, mp - m), (0, kp - k)))
    b = jnp.pad(b.astype(a.dtype), ((0, kp - k), (0, np_ - n)))
    out = pl.pallas_call(
        functools.partial(_matmul_kernel, bk=bk, n_k=kp // bk, precision=_precision(a.dtype)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), jnp.float32),
        grid=(mp // bm, np_ // bn),
        in_specs=[pl.BlockSpec((bm, kp), lambda i, j: (i, 0)), pl.BlockSpec((kp, bn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        interpret=platforms.interpret_mode(platform),
        name="jaxalign_blocked_matmul",
    )(a, b)
    return out[:m, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def pallas_matmul(a: jax.Array, b: jax.Array, blocks: tuple[int, int, int], platform: str | None = None) -> jax.Array:
    """a [M, K] @ b [K, N] -> float32 [M, N], batch invariant (see the module docstring), lowered for `platform`
    (default: `backend()`; pass it positionally).

    Its gradient uses the same kernel: da = g @ b^T (row-wise, so batch invariant too) and db = a^T @ g (the
    rows summed in fixed BK chunks, in row order). The cotangent is rounded to the operand dtype first, as the
    tiled kernel's backward does."""
    return blocked_matmul(a, b, blocks, platform or backend())


def _pallas_matmul_fwd(a, b, blocks, platform):
    return blocked_matmul(a, b, blocks, platform or backend()), (a, b)


def _pallas_matmul_bwd(blocks, platform, residuals, g):
    a, b = residuals
    g = g.astype(a.dtype)
    platform = platform or backend()
    return (blocked_matmul(g, b.T, blocks, platform).astype(a.dtype),
            blocked_matmul(a.T, g, blocks, platform).astype(b.dtype))


pallas_matmul.defvjp(_pallas_matmul_fwd, _pallas_matmul_bwd)
