"""The score chunk both Pallas attention kernels compute (the forward in `pallas_attention`, the backward in
`pallas_attention_grad`): one definition, so the backward recomputes the forward's scores bit for bit."""

from __future__ import annotations

import jax.numpy as jnp

from jaxalign.numerics.dtypes import cast, dtype
from jaxalign.numerics.pallas_matmul import _precision


def rounder(exact_casts: bool):
    """`rnd(x, name)`: x rounded to the dtype `name` -- in interpret mode by `cast` (a rounding XLA:CPU's fusions
    keep), compiled by a plain convert."""
    def rnd(x, name):
        return cast(x, name) if exact_casts else x.astype(dtype(name))
    return rnd


def chunk_scores(q, k_chunk, q_pos, k_pos_chunk, *, scale, scores_dt, softmax_dt, rnd):
    """Scores of a query block against one key chunk as the lax chunked path rounds them: q.k (float32
    accumulation) rounded to `scores_dt`, times the scale, rounded again, in `softmax_dt`; -inf where the key's
    position is past the query's."""
    s = jnp.dot(q, k_chunk.astype(q.dtype), preferred_element_type=jnp.float32, precision=_precision(q.dtype))
    s = rnd(rnd(rnd(s, scores_dt).astype(jnp.float32) * scale, scores_dt), softmax_dt)
    return jnp.where(k_pos_chunk <= q_pos, s, jnp.asarray(-jnp.inf, s.dtype))
