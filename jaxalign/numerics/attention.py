"""Rotary embeddings and attention under a NumericPolicy.

Keys live at slot = position (the engine's cache is laid out that way for every request), and a key is visible
to a query when its position is <= the query's. Masked scores are -inf, so they contribute exact zeros; with
`reduction="tree"` this makes a row's result independent of how many masked slots follow it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxalign.numerics import fp8, precision
from jaxalign.numerics.collectives import local_reduce
from jaxalign.numerics.policy import NumericPolicy
from jaxalign.numerics.dtypes import as_compute, cast, dtype
from jaxalign.numerics.kernels import select_attention
from jaxalign.numerics.pallas_attention import pallas_chunked_attention
from jaxalign.numerics.platforms import platform
from jaxalign.numerics.reduce import divide_by, expand, pad_to_tree_width, reduce_sum, tree_sum, uncontracted


def rope(x: jax.Array, positions: jax.Array, theta: float, policy: NumericPolicy,
         rotary_dim: int | None = None, interleaved: bool = False, *, inv_freq=None,
         attention_factor: float = 1.0) -> jax.Array:
    """Rotate-half RoPE on the first `rotary_dim` dims (default all) of x [B, S, H, D] at positions [B, S];
    rotation in `rope_dtype`, the other dims pass through.

    cos/sin are computed in float32 (as transformers does) and cast to `rope_dtype` before the rotation.
    `interleaved` (DeepSeek): pairs (x0, x1), (x2, x3), ... share a frequency; the dims are de-interleaved (evens,
    then odds: an exact permutation) and rotated half-wise, so the result comes out in transformers'
    `apply_rotary_pos_emb_interleave` layout.
    A scaled RoPE (YaRN, `model/rope_scaling.py`) passes its own `inv_freq` [D/2] (float32, replacing
    theta's) and `attention_factor`, which multiplies cos and sin in float32 before their cast (as transformers'
    rotary embedding does).
    """
    d = rotary_dim or x.shape[-1]
    if d < x.shape[-1]:
        passed = as_compute(x[..., d:], policy)
        return jnp.concatenate([rope(x[..., :d], positions, theta, policy, interleaved=interleaved,
                                     inv_freq=inv_freq, attention_factor=attention_factor), passed], axis=-1)
    if interleaved:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    else:
        inv_freq = jnp.asarray(inv_freq, jnp.float32)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if attention_factor != 1.0:
        cos, sin = cos * jnp.float32(attention_factor), sin * jnp.float32(attention_factor)
    cos, sin = cast(cos, policy.rope_dtype), cast(sin, policy.rope_dtype)
    xr = cast(x, policy.rope_dtype)
    rotated = jnp.concatenate([-xr[..., d // 2:], xr[..., : d // 2]], axis=-1)
    return as_compute(xr * cos + rotated * sin, policy)


def kv_cache_entries(k: jax.Array, v: jax.Array, policy: NumericPolicy) -> tuple[jax.Array, jax.Array]:
    """Keys (after RoPE) and values as the cache stores them: rounded to `kv_cache_dtype`. The trainer's full
    forward rounds them the same way, so both sides attend over the same key and value bits. Under
    `kv_quant`: rounded to FP8 first (`fp8.kv_entries`)."""
    if policy.kv_quant != "none":
        return fp8.kv_entries(k, policy), fp8.kv_entries(v, policy)
    return cast(k, policy.kv_cache_dtype), cast(v, policy.kv_cache_dtype)


def _scores(q: jax.Array, k: jax.Array, policy: NumericPolicy) -> jax.Array:
    """q [B, Q, KVH, G, D] . k [B, KVH, D, K] -> [B, KVH, G, Q, K] in float32 accumulation.

    With `reduction="tree"` the head-dim contraction is a fixed sequential sum of elementwise products (one
    fused loop, the same order for every query and key, whatever their number)."""
    if policy.tree_reduction:
        return _sequential_scores(policy, jnp.transpose(q.astype(jnp.float32), (0, 2, 3, 1, 4)),
                                  k.astype(jnp.float32))
    # keys stored [D, K]: each (b, h) is a plain [G*Q, D] x [D, K] product (with keys [K, D], XLA:CPU's dot
    # repacked every key of the cache at each decode step)
    qh = jnp.transpose(q, (0, 2, 3, 1, 4))  # [B, KVH, G, Q, D]
    return precision.einsum("bhgqd,bhdk->bhgqk", qh, k.astype(q.dtype), policy)


def _einsum_backward(spec: str):
    """Decorator: `forward(policy, a, b)` computes `einsum(spec, a, b)` in its own summation order; its gradient is
    the two einsums of the bilinear form (float32, at the policy's backward precision). The batch axes (b, h) are never summed, so each (b, h) is one
    fixed-shape product whatever the mesh; autodiff of the forward would instead transpose its implicit
    broadcasts and pads into XLA reduces, whose add order follows how the backward was fused (it differed between
    a mesh's program and one device's) and cost 25x the forward for the value tree."""
    lhs, rest = spec.split(",")
    rhs, out = rest.split("->")

    def wrap(forward):
        fn = jax.custom_vjp(forward, nondiff_argnums=(0,))

        def bwd(policy, residuals, g):
            a, b = residuals
            return (precision.einsum(f"{out},{rhs}->{lhs}", g, b, policy, backward=True),
                    precision.einsum(f"{lhs},{out}->{rhs}", a, g, policy, backward=True))

        fn.defvjp(lambda policy, a, b: (fn(policy, a, b), (a, b)), bwd)
        return fn
    return wrap


@_einsum_backward("bhgqd,bhdk->bhgqk")
def _sequential_scores(policy: NumericPolicy, q: jax.Array, k: jax.Array) -> jax.Array:
    """q [B, H, G, Q, D] . k [B, H, D, K] -> [B, H, G, Q, K]: the products summed over D one after another."""
    total = q[..., :, None, 0] * k[:, :, None, None, 0, :]
    for d in range(1, q.shape[-1]):
        total = total + q[..., :, None, d] * k[:, :, None, None, d, :]
    return total


def _weighted_values(p: jax.Array, v: jax.Array, policy: NumericPolicy) -> jax.Array:
    """p [B, KVH, G, Q, K] . v [B, KVH, K, D] -> [B, Q, KVH, G, D] in float32 (tree over keys when
    `reduction="tree"`, so masked zero-weight keys past the end never change the bits)."""
    if policy.tree_reduction:
        return jnp.transpose(_tree_pv(policy, p.astype(jnp.float32), v.astype(jnp.float32)), (0, 3, 1, 2, 4))
    # p first and the output [B, KVH, G, Q, D]: each (b, h) is a plain [G*Q, K] x [K, D] product (with v first,
    # XLA:CPU contracted v's middle axis in a slow generic dot)
    out = precision.einsum("bhgqk,bhkd->bhgqd", p, v.astype(p.dtype), policy)
    return jnp.transpose(out, (0, 3, 1, 2, 4))


@_einsum_backward("bhgqk,bhkd->bhgqd")
def _tree_pv(policy: NumericPolicy, p: jax.Array, v: jax.Array) -> jax.Array:
    """p [B, H, G, Q, K] . v [B, H, K, D] -> [B, H, G, Q, D], summed over keys with the halving tree.

    The keys are zero-padded to the tree's power-of-two width before the product, so the [.., K, D] products
    are formed once."""
    return tree_sum(pad_to_tree_width(p, 4)[..., None] * pad_to_tree_width(v, 2)[:, :, None, None], axis=4)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
              policy: NumericPolicy, scale: float | None = None, allowed: jax.Array | None = None, *,
              window: int | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """Causal GQA attention.

    q [B, Q, H, D] (compute dtype), k [B, KVH, D, K] and v [B, KVH, K, Dv] (kv-cache dtype, laid out as the
    engine's cache), q_pos [B, Q], k_pos [B, K] positions. `scale` multiplies the scores (default D ** -0.5;
    absorbed MLA passes the expanded q.k head dim's). `allowed` [B, Q, K] (sparse attention): only these keys
    are visible, besides the causal mask. `window` (sliding-window attention): a query sees only the keys of its
    last `window` positions, its own included (k_pos > q_pos - window, as transformers' sliding mask).
    `sinks` [H] (attention sinks, gpt-oss): one learned logit per head that joins the softmax's max and sum and
    brings no value; where it enters is the policy's `attn_sink` (see `_full` and `_chunked`).
    Returns [B, Q, H, Dv] in the compute dtype.
    """
    b, nq, h, d = q.shape
    kvh = k.shape[1]
    # the q.k products sum over head_dim and the value products over keys: keep both on one device (ordered)
    q = local_reduce(q, policy, (3,))
    k, v = local_reduce(k, policy, (2, 3)), local_reduce(v, policy, (2,))
    qg = q.reshape(b, nq, kvh, h // kvh, d)
    visible = k_pos[:, None, :] <= q_pos[:, :, None]
    if window is not None:
        visible = visible & (k_pos[:, None, :] > q_pos[:, :, None] - window)
    if allowed is not None:
        visible = visible & allowed
    visible = visible[:, None, None]  # [B, 1, 1, Q, K]
    chunk = policy.attention_chunk
    scale = d ** -0.5 if scale is None else scale
    standard = allowed is None and scale == d ** -0.5 and v.shape[-1] == d and window is None and sinks is None
    sink = None
    if sinks is not None:  # each row's sink logit [B, KVH, G, Q] in the softmax dtype; under reduce=tree its
        # gradient sums the rows with the tree (`expand`), not an XLA reduce ordered by the backward's fusion
        sink = cast(sinks, policy.attn_softmax_dtype).reshape(1, kvh, h // kvh, 1)
        sink = expand(expand(sink, 0, b, policy), 3, nq, policy)
    impl = select_attention(policy, h // kvh, d, standard, platform())
    if impl.kind == "pallas":
        out = pallas_chunked_attention(qg, k, v, q_pos, k_pos, policy, impl.blocks[0], impl.platform)
    else:
        out = (_full(qg, k, v, visible, policy, scale, sink) if chunk is None
               else _chunked(qg, k, v, visible, policy, chunk, scale, sink))
    return as_compute(out.reshape(b, nq, h, v.shape[-1]), policy)



def _masked_scores(qg, k, visible, policy, scale):
    """Scores rounded to `attn_scores_dtype`, times the scale (a float32 scalar, product rounded to
    `attn_scores_dtype` again), then in `attn_softmax_dtype`, masked with -inf."""
    scale = jnp.float32(scale)
    rounded = cast(_scores(qg, k, policy), policy.attn_scores_dtype).astype(jnp.float32)
    s = cast(cast(rounded * scale, policy.attn_scores_dtype), policy.attn_softmax_dtype)
    return jnp.where(visible, s, jnp.asarray(-jnp.inf, s.dtype))


def _full(qg, k, v, visible, policy, scale, sink=None):
    """Softmax over all keys, normalised before the value product (as transformers' eager attention).

    With sinks [B, KVH, G, Q] (`attn_sink`): `seed` takes the max over the keys and the sink and adds the sink's
    term exp(sink - m) to the keys' sum (transformers' eager attention concatenates the sink as one more column:
    the same terms); `merge` normalises over the keys alone and scales the output by `_sink_share`."""
    s = _masked_scores(qg, k, visible, policy, scale)
    m = lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    if sink is not None:
        sink = sink[..., None]  # [B, KVH, G, Q, 1]
        if policy.attn_sink == "seed":
            m = lax.stop_gradient(jnp.maximum(m, sink))
    e = precision.exp(s - m, policy)
    # the denominator's broadcast back over the keys goes through `expand` (in `divide_by`): its gradient is then a
    # tree sum, where an implicit broadcast's gradient was an XLA reduce ordered by how the backward was fused (a
    # mesh's data-parallel program gave other q/k gradients than one device's; benchmarks/mesh_gradients.py)
    total = reduce_sum(e, policy, axis=-1, keepdims=True)
    if sink is not None and policy.attn_sink == "seed":
        total = precision.exp(sink - m, policy) + total
    p = divide_by(e, total, -1, policy)
    out = _weighted_values(as_compute(p, policy), v, policy)
    if sink is not None and policy.attn_sink == "merge":
        out = out * _to_output_layout(_sink_share(m[..., 0], total[..., 0], sink[..., 0], policy))
    return out


def _sink_share(m, total, sink, policy):
    """The keys' share of a softmax whose keys gave running max `m` and sum `total` [B, KVH, G, Q] once the sink
    joins it (`attn_sink=merge`): a / (a + b) with M = max(m, sink), a = total * exp(m - M), b = exp(sink - M),
    in the softmax dtype (0 when no key was visible)."""
    top = jnp.maximum(m, sink)
    a = uncontracted(total * precision.exp(jnp.where(jnp.isneginf(m), top, m) - top, policy), policy)
    a = jnp.where(jnp.isneginf(m), jnp.zeros_like(a), a)
    return a / (a + precision.exp(sink - top, policy))


def _to_output_layout(w):
    """[B, KVH, G, Q] per-row factors as [B, Q, KVH, G, 1] float32, to scale a value product's output."""
    return jnp.transpose(w, (0, 3, 1, 2))[..., None].astype(jnp.float32)


def _chunked(qg, k, v, visible, policy, chunk, scale, sink=None):
    """Online softmax over fixed chunks of `chunk` keys starting at slot 0 (flash / split-KV style).

    With sinks [B, KVH, G, Q] (`attn_sink`): `seed` starts the running max at the sink and the running sum at
    exp(sink - sink) = 1, as flash kernels with sinks do; `merge` runs the keys alone and scales the output by
    `_sink_share` at the end."""
    sdt = dtype(policy.attn_softmax_dtype)
    b, kvh, d, nk = k.shape
    dv = v.shape[-1]
    pad = (-nk) % chunk
    if pad:
        k = jnp.pad(k, ((0, 0), (0, 0), (0, 0), (0, pad)))
        v = jnp.pad(v, ((0, 0), (0, 0), (0, pad), (0, 0)))
        visible = jnp.pad(visible, [(0, 0)] * 4 + [(0, pad)])
    n_chunks = (nk + pad) // chunk
    ks = jnp.moveaxis(k.reshape(b, kvh, d, n_chunks, chunk), 3, 0)
    vs = jnp.moveaxis(v.reshape(b, kvh, n_chunks, chunk, dv), 2, 0)
    vis = jnp.moveaxis(visible.reshape(*visible.shape[:4], n_chunks, chunk), 4, 0)
    bq = qg.shape[:1] + (qg.shape[2], qg.shape[3], qg.shape[1])  # [B, KVH, G, Q]

    def step(carry, xs):
        m, l, acc = carry
        kc, vc, visc = xs
        s = _masked_scores(qg, kc, visc, policy, scale)
        m_new = jnp.maximum(m, lax.stop_gradient(jnp.max(s, axis=-1)))
        safe_m = jnp.where(jnp.isneginf(m_new), jnp.zeros_like(m_new), m_new)
        corr = precision.exp(m - safe_m, policy)
        p = precision.exp(s - safe_m[..., None], policy)
        # the rescaling products meet an add: rounded on their own in every program (docs/policies.md, "FMA
        # contraction")
        l = uncontracted(l * corr, policy) + reduce_sum(p, policy, axis=-1)
        pv = _weighted_values(as_compute(p, policy), vc, policy)  # [B, Q, KVH, G, D]
        rescaled = acc * jnp.transpose(corr, (0, 3, 1, 2))[..., None].astype(jnp.float32)
        acc = uncontracted(rescaled, policy) + pv
        return (m_new, l, acc), None

    init = (jnp.full(bq, -jnp.inf, sdt), jnp.zeros(bq, sdt),
            jnp.zeros(qg.shape[:-1] + (dv,), jnp.float32))
    if sink is not None and policy.attn_sink == "seed":
        start = sink.astype(sdt)
        # exp(sink - sink) = 1, written so the sink's gradient flows (the running max is a constant, as below)
        init = (lax.stop_gradient(start), precision.exp(start - lax.stop_gradient(start), policy), init[2])
    (m, l, acc), _ = lax.scan(step, init, (ks, vs, vis))
    out = divide_by(acc, _to_output_layout(l), -1, policy)
    if sink is not None and policy.attn_sink == "merge":
        out = out * _to_output_layout(_sink_share(m, l, sink.astype(sdt), policy))
    return out
