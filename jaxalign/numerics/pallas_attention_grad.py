"""The backward of the Pallas chunked attention (`numerics.pallas_attention`), as Pallas kernels over the same fixed
key chunks.

From the forward's output o and each query row's softmax statistics (running max m and sum l, float32), the
weights of one key chunk are recomputed exactly as the forward rounded its scores: p = exp(s - m) / l. With
delta = rowsum(dO * o) (float32), dS = p * (dO . v^T - delta) and, the roundings of the scores taken as identity
(autodiff's rule for a cast):

- dq kernel -- one instance per (batch row, kv head, block of BM*G query rows): dq = scale * sum over the key
  chunks, from slot 0 in ascending order, of dS @ k_chunk^T. A query row's dq depends only on that row's
  cotangent and the keys and values: batch invariant, like the forward.
- dk/dv kernel -- one instance per (batch row, kv head, key chunk): dv = sum over the query blocks, in ascending
  order, of p^T @ dO (p rounded to the compute dtype, as the forward's value product took it), dk = scale * sum
  of q^T @ dS. A fixed order, but these sum over every query, so they are not batch invariant.

Every product accumulates in float32 at HIGHEST precision. Padded query rows carry a zero cotangent and padded
keys are masked, so both add exact zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxalign.numerics import platforms
from jaxalign.numerics.dtypes import dtype
from jaxalign.numerics.pallas_chunk import chunk_scores, rounder
from jaxalign.numerics.pallas_matmul import _precision

F32 = jnp.float32


def _dot(a, b):
    return jnp.dot(a.astype(F32), b.astype(F32), preferred_element_type=F32, precision=_precision(F32))


def _weights(q, k_chunk, q_pos, k_pos_chunk, m, l, cfg, rnd):
    """The forward's normalised weights of one key chunk for a block of query rows, float32 [R, C]."""
    s = chunk_scores(q, k_chunk, q_pos, k_pos_chunk, scale=cfg["scale"], scores_dt=cfg["scores_dt"],
                     softmax_dt=cfg["softmax_dt"], rnd=rnd).astype(F32)
    safe_m = jnp.where(jnp.isneginf(m), jnp.zeros_like(m), m)
    return jnp.where(l > 0, jnp.exp(s - safe_m) / jnp.where(l > 0, l, 1.0), 0.0)


def _dq_kernel(qpos_ref, kpos_ref, q_ref, k_ref, v_ref, do_ref, m_ref, l_ref, delta_ref, dq_ref, *, cfg, n_chunks):
    rnd = rounder(cfg["platform"] == "cpu")
    chunk = cfg["chunk"]
    q, do, q_pos = q_ref[...], do_ref[...], qpos_ref[...]
    m, l, delta = m_ref[...], l_ref[...], delta_ref[...]

    def step(c, dq):
        keys = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        k_chunk = k_ref[:, keys]
        p = _weights(q, k_chunk, q_pos, kpos_ref[:, keys], m, l, cfg, rnd)
        ds = p * (_dot(do, v_ref[keys, :].T) - delta)
        return dq + _dot(ds, k_chunk.T)
    dq_ref[...] = lax.fori_loop(0, n_chunks, step, jnp.zeros(dq_ref.shape, F32)) * cfg["scale"]


def _dkv_kernel(qpos_ref, kpos_ref, q_ref, k_ref, v_ref, do_ref, m_ref, l_ref, delta_ref, dk_ref, dv_ref, *, cfg,
                n_blocks):
    rnd = rounder(cfg["platform"] == "cpu")
    rows = cfg["rows"]
    k_chunk, v_chunk, k_pos = k_ref[...], v_ref[...], kpos_ref[...]

    def step(j, carry):
        dk, dv = carry
        block = pl.ds(pl.multiple_of(j * rows, rows), rows)
        q, do = q_ref[block, :], do_ref[block, :]
        p = _weights(q, k_chunk, qpos_ref[block, :], k_pos, m_ref[block, :], l_ref[block, :], cfg, rnd)
        ds = p * (_dot(do, v_chunk.T) - delta_ref[block, :])
        p_values = rnd(p.astype(dtype(cfg["softmax_dt"])), cfg["compute_dt"])  # as the forward's p @ v took it
        return dk + _dot(q.T, ds), dv + _dot(p_values.T, do)
    init = (jnp.zeros(dk_ref.shape, F32), jnp.zeros(dv_ref.shape, F32))
    dk, dv = lax.fori_loop(0, n_blocks, step, init)
    dk_ref[...] = dk * cfg["scale"]
    dv_ref[...] = dv


def attention_backward(q, k, v, q_rows, k_pos, o, m, l, g, cfg):
    """Gradients (float32) of the laid-out forward (`pallas_attention._forward_call`) for the cotangent g of o:
    (dq [B, KVH, Qp*G, D], dk [B, KVH, D, Kp], dv [B, KVH, Kp, D])."""
    b, kvh, n_rows, d = q.shape
    kp, rows, chunk, platform = k.shape[-1], cfg["rows"], cfg["chunk"], cfg["platform"]
    g = g.astype(F32)
    delta = jnp.sum(g * o, axis=-1, keepdims=True)  # [B, KVH, Qp*G, 1]
    operands = (q_rows, k_pos, q, k, v, g, m, l, delta)
    whole = lambda *shape: pl.BlockSpec((None, None, *shape), lambda i, h, j: (i, h, 0, 0))  # noqa: E731
    rows_of = lambda width: pl.BlockSpec((None, None, rows, width), lambda i, h, j: (i, h, j, 0))  # noqa: E731
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg, n_chunks=kp // chunk),
        out_shape=jax.ShapeDtypeStruct(q.shape, F32),
        grid=(b, kvh, n_rows // rows),
        in_specs=[pl.BlockSpec((None, rows, 1), lambda i, h, j: (i, j, 0)),
                  pl.BlockSpec((None, 1, kp), lambda i, h, j: (i, 0, 0)),
                  rows_of(d), whole(d, kp), whole(kp, d), rows_of(d), rows_of(1), rows_of(1), rows_of(1)],
        out_specs=rows_of(d),
        interpret=platforms.interpret_mode(platform),
        name="jaxalign_chunked_attention_dq",
    )(*operands)
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg, n_blocks=n_rows // rows),
        out_shape=(jax.ShapeDtypeStruct(k.shape, F32), jax.ShapeDtypeStruct(v.shape, F32)),
        grid=(b, kvh, kp // chunk),
        in_specs=[pl.BlockSpec((None, n_rows, 1), lambda i, h, c: (i, 0, 0)),
                  pl.BlockSpec((None, 1, chunk), lambda i, h, c: (i, 0, c)),
                  whole(n_rows, d),
                  pl.BlockSpec((None, None, d, chunk), lambda i, h, c: (i, h, 0, c)),
                  pl.BlockSpec((None, None, chunk, d), lambda i, h, c: (i, h, c, 0)),
                  whole(n_rows, d), whole(n_rows, 1), whole(n_rows, 1), whole(n_rows, 1)],
        out_specs=(pl.BlockSpec((None, None, d, chunk), lambda i, h, c: (i, h, 0, c)),
                   pl.BlockSpec((None, None, chunk, d), lambda i, h, c: (i, h, c, 0))),
        interpret=platforms.interpret_mode(platform),
        name="jaxalign_chunked_attention_dkv",
    )(*operands)
    return dq, dk, dv
