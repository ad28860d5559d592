"""Chunked (flash / split-KV) attention as a Pallas kernel: `attn=chunked:C` with `kernel=pallas:BMxBNxBK` on
any backend, or with `kernel=tiled:T` on a GPU/TPU (`numerics.kernels.select_attention` chooses).

One kernel instance per (batch row, kv head, block of BM queries): the BM queries of all G heads sharing the kv
head are one fixed [BM*G, D] block; the keys are visited in chunks of C slots starting at slot 0, always all of
them and always in ascending order, with the online softmax of `numerics.attention._chunked` (scores rounded to
`attn_scores_dtype`, scaled, softmax in `attn_softmax_dtype`, probabilities in the compute dtype before the
value product, float32 accumulation). Every product has a fixed shape ([BM*G, D] x [D, C] and [BM*G, C] x
[C, D]) whatever the number of queries, the batch or the cache length, and a chunk the query cannot see adds
exact zeros, so a query's bits are the same in a trainer sequence of S keys and an engine cache of M slots.

Gradient: Pallas kernels too (`numerics.pallas_attention_grad`): the forward also writes each row's softmax
statistics, and the backward recomputes the weights chunk by chunk over the same fixed key chunks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxalign.numerics import platforms
from jaxalign.numerics.dtypes import dtype
from jaxalign.numerics.pallas_attention_grad import attention_backward
from jaxalign.numerics.pallas_chunk import chunk_scores, rounder
from jaxalign.numerics.pallas_matmul import _precision, _round_up, backend, refuse_mesh

_NEVER = jnp.iinfo(jnp.int32).max  # position of padded keys (seen by no real query) and padded queries


def check_attention_blocks(bm: int, chunk: int, groups: int, head_dim: int, kernel: str,
                           platform: str | None = None) -> None:
    """Raise a ValueError unless the attention kernel's query block `bm` and chunk are legal on `platform`: GPU
    (Triton) needs the chunk, BM*G and the head dim powers of two >= 16; TPU (Mosaic) the chunk a multiple of 128
    and BM*G a multiple of 8."""
    refuse_mesh(kernel)
    platform = platform or backend()
    rows = bm * groups
    where = (f"NumericPolicy.attention = 'chunked:{chunk}' with matmul_kernel = {kernel!r} on backend "
             f"{platform!r} (query block BM*G = {rows}, head dim {head_dim})")
    if platform == "gpu":
        bad = [(n, v) for n, v in (("chunk", chunk), ("BM*G", rows), ("head_dim", head_dim)) if v < 16 or v & (v - 1)]
        if bad:
            raise ValueError(f"{where}: {bad}; allowed on gpu (Triton): powers of two >= 16")
    if platform == "tpu" and (chunk % 128 or rows % 8):
        raise ValueError(f"{where}: allowed on tpu: chunk a multiple of 128 and BM*G a multiple of 8")


def _kernel(qpos_ref, kpos_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, chunk, n_chunks, scale, scores_dt,
            softmax_dt, compute_dt, exact_casts):
    rnd = rounder(exact_casts)
    q = q_ref[...]
    q_pos = qpos_ref[...]  # [R, 1]

    def step(c, carry):
        m, l, acc = carry
        keys = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        s = chunk_scores(q, k_ref[:, keys], q_pos, kpos_ref[:, keys], scale=scale, scores_dt=scores_dt,
                         softmax_dt=softmax_dt, rnd=rnd)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
        safe_m = jnp.where(jnp.isneginf(m_new), jnp.zeros_like(m_new), m_new)
        corr = jnp.exp(m - safe_m)
        p = jnp.exp(s - safe_m)
        l = l * corr + jnp.sum(p, axis=-1, keepdims=True)
        pv = jnp.dot(rnd(p, compute_dt), v_ref[keys, :].astype(dtype(compute_dt)),
                     preferred_element_type=jnp.float32, precision=_precision(dtype(compute_dt)))
        return m_new, l, acc * corr.astype(jnp.float32) + pv

    sdt = dtype(softmax_dt)
    rows = q.shape[0]
    init = (jnp.full((rows, 1), -jnp.inf, sdt), jnp.zeros((rows, 1), sdt), jnp.zeros(o_ref.shape, jnp.float32))
    m, l, acc = lax.fori_loop(0, n_chunks, step, init)
    o_ref[...] = acc / l.astype(jnp.float32)
    m_ref[...] = m.astype(jnp.float32)  # the softmax statistics the Pallas backward recomputes weights from
    l_ref[...] = l.astype(jnp.float32)


def _layout(qg, k, v, q_pos, k_pos, bm, chunk, platform):
    """The kernels' layout: q [B, KVH, Qp*G, D] (queries padded to whole blocks of bm), keys [B, KVH, D, Kp] and
    values [B, KVH, Kp, D] padded to whole chunks (a power of two on a GPU), each query row's position
    [B, Qp*G, 1] and each key's [B, 1, Kp] (padding: a position no real query reaches)."""
    b, nq, kvh, g, d = qg.shape
    nk = k.shape[-1]
    qp, kp = _round_up(nq, bm), _round_up(nk, chunk)
    if platform == "gpu":
        kp = pl.next_power_of_2(kp)
    q = jnp.pad(jnp.transpose(qg, (0, 2, 1, 3, 4)), ((0, 0), (0, 0), (0, qp - nq), (0, 0), (0, 0)))
    q = q.reshape(b, kvh, qp * g, d)
    q_rows = jnp.repeat(jnp.pad(q_pos.astype(jnp.int32), ((0, 0), (0, qp - nq)), constant_values=_NEVER), g,
                        axis=1)[..., None]  # [B, Qp*G, 1], each query's position once per head of its group
    k_pos = jnp.pad(k_pos.astype(jnp.int32), ((0, 0), (0, kp - nk)), constant_values=_NEVER)[:, None, :]
    k = jnp.pad(k, ((0, 0), (0, 0), (0, 0), (0, kp - nk)))
    v = jnp.pad(v, ((0, 0), (0, 0), (0, kp - nk), (0, 0)))
    return q, k, v, q_rows, k_pos


def _settings(policy, d, bm, groups, platform) -> dict:
    return dict(chunk=policy.attention_chunk, scale=float(d ** -0.5), scores_dt=policy.attn_scores_dtype,
                softmax_dt=policy.attn_softmax_dtype, compute_dt=policy.compute_dtype, rows=bm * groups,
                platform=platform)


def _forward_call(q, k, v, q_rows, k_pos, cfg):
    """Laid-out inputs -> (o [B, KVH, Qp*G, D], m, l [B, KVH, Qp*G, 1]), all float32."""
    b, kvh, n_rows, d = q.shape
    kp, rows, platform = k.shape[-1], cfg["rows"], cfg["platform"]
    kernel = functools.partial(
        _kernel, chunk=cfg["chunk"], n_chunks=kp // cfg["chunk"], scale=cfg["scale"], scores_dt=cfg["scores_dt"],
        softmax_dt=cfg["softmax_dt"], compute_dt=cfg["compute_dt"], exact_casts=platform == "cpu")
    row_block = lambda width: pl.BlockSpec((None, None, rows, width), lambda i, h, j: (i, h, j, 0))  # noqa: E731
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((b, kvh, n_rows, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, kvh, n_rows, 1), jnp.float32),
                   jax.ShapeDtypeStruct((b, kvh, n_rows, 1), jnp.float32)),
        grid=(b, kvh, n_rows // rows),
        in_specs=[pl.BlockSpec((None, rows, 1), lambda i, h, j: (i, j, 0)),
                  pl.BlockSpec((None, 1, kp), lambda i, h, j: (i, 0, 0)),
                  row_block(d),
                  pl.BlockSpec((None, None, d, kp), lambda i, h, j: (i, h, 0, 0)),
                  pl.BlockSpec((None, None, kp, d), lambda i, h, j: (i, h, 0, 0))],
        out_specs=(row_block(d), row_block(1), row_block(1)),
        interpret=platforms.interpret_mode(platform),
        name="jaxalign_chunked_attention",
    )(q_rows, k_pos, q, k, v)


def pallas_chunked_attention(qg, k, v, q_pos, k_pos, policy, bm: int, platform: str):
    """Chunked attention by the Pallas kernels (see the module docstring): qg [B, Q, KVH, G, D], k [B, KVH, D, K],
    v [B, KVH, K, D], q_pos [B, Q], k_pos [B, K] -> float32 [B, Q, KVH, G, D], queries in blocks of `bm`, lowered
    for `platform` (`numerics.kernels.select_attention` chooses both). Its gradient is the Pallas backward of
    `numerics.pallas_attention_grad`, over the same fixed key chunks."""
    b, nq, kvh, g, d = qg.shape
    check_attention_blocks(bm, policy.attention_chunk, g, d, policy.matmul_kernel, platform)
    cfg = _settings(policy, d, bm, g, platform)

    @jax.custom_vjp
    def attend(q, k, v, q_rows, k_pos):
        return _forward_call(q, k, v, q_rows, k_pos, cfg)[0]

    def fwd(q, k, v, q_rows, k_pos):
        o, m, l = _forward_call(q, k, v, q_rows, k_pos, cfg)
        return o, (q, k, v, q_rows, k_pos, o, m, l)

    def bwd(residuals, g_out):
        q, k, v, *_ = residuals
        dq, dk, dv = attention_backward(*residuals, g_out, cfg)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None

    attend.defvjp(fwd, bwd)
    laid_out = _layout(qg, k, v, q_pos, k_pos, bm, policy.attention_chunk, platform)
    out = attend(*laid_out)
    qp = laid_out[0].shape[2] // g
    return jnp.transpose(out.reshape(b, kvh, qp, g, d)[:, :, :nq], (0, 2, 1, 3, 4))
