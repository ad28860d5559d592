"""Multi-head latent attention (DeepSeek-V2/V3) in its two forms, under a NumericPolicy (`mla` field).

Every key position holds a latent c [R] (kv_lora_rank) and one rope key k_r [r] shared by all heads. The key
up-projection W_uk [R, H, dn] and value up-projection W_uv [R, H, dv] are the two halves of `kv_b_proj`.

- expanded (trainers, transformers): k_h = [c W_uk_h, k_r], v_h = c W_uv_h, then per-head attention.
- absorbed (serving engines): q'_h = [q_nope_h W_uk_h^T, q_rope_h] attends over [c, k_r] directly (one "head" of
  keys shared by all query heads), and the output latent o'_h = sum p c is up-projected: o_h = o'_h W_uv_h.

Both scale the scores by (dn + r) ** -0.5. The same sums in another order: equal in exact arithmetic, not in
floating point. Both read the cache [B, 1, R + r, M] (latent rows, then rope rows; slots last, like the GQA key
cache) in the kv-cache dtype.

A LoRA adapter on `kv_b_proj` (W + s A B, A [R, rank], B [rank, H * (dn + dv)]) follows the policy's `lora` mode:
merged folds it into W (`numerics.lora.merged_weight`) before either form; unmerged keeps the low-rank path
separate in both forms -- expanded: c W + s (c A) B; absorbed: q_nope W_uk^T + s (q_nope B_uk^T) A^T for the
query and o' W_uv + s (o' A) B_uv for the output (each low-rank term rounded as `numerics.lora.lora_linear`
rounds it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxalign.numerics.attention import attention
from jaxalign.numerics.dtypes import as_compute, as_param, cast
from jaxalign.numerics.lora import lora_linear, merged_weight
from jaxalign.numerics.matmul import expert_matmul, matmul
from jaxalign.numerics.policy import NumericPolicy

KvbLoRA = tuple[jax.Array, jax.Array, float]  # (A [R, rank], B [rank, H * (dn + dv)], scale) of kv_b_proj


def _per_head(x: jax.Array, w: jax.Array, policy: NumericPolicy) -> jax.Array:
    """x [B, Q, H, K] @ w [H, K, N] -> [B, Q, H, N]: one product per head with the policy's kernel."""
    b, q, h, k = x.shape
    rows = jnp.transpose(x, (2, 0, 1, 3)).reshape(h, b * q, k)
    return jnp.transpose(expert_matmul(rows, w, policy).reshape(h, b, q, -1), (1, 2, 0, 3))


def _low_rank(x: jax.Array, first: jax.Array, second: jax.Array, lora_scale: float, policy: NumericPolicy,
              *, per_head_second: bool) -> jax.Array:
    """s * (x @ first) @ second for x [B, Q, H, K], rounded to the compute dtype as `lora_linear` rounds its
    low-rank path: `first` per head [H, K, rank] and `second` shared [rank, N], or with `per_head_second`
    `first` shared [K, rank] and `second` per head [H, rank, N]."""
    if per_head_second:
        low = _per_head(matmul(x, as_param(first, policy), policy), as_param(second, policy), policy)
    else:
        low = matmul(_per_head(x, as_param(first, policy), policy), as_param(second, policy), policy)
    return cast(low * jnp.asarray(lora_scale, low.dtype), policy.compute_dtype)


def mla_attention(q: jax.Array, cache: jax.Array, w_kv_b: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
                  policy: NumericPolicy, *, nope_dim: int, v_dim: int, allowed: jax.Array | None = None,
                  kv_b_lora: KvbLoRA | None = None) -> jax.Array:
    """q [B, Q, H, dn + r] (nope dims, then rotated rope dims), cache [B, 1, R + r, K] (kv-cache dtype),
    w_kv_b [R, H * (dn + dv)] (the f32 master of kv_b_proj), positions q_pos [B, Q], k_pos [B, K].
    `allowed` [B, Q, K]: the keys each query may attend to (DSA), or None for all. `kv_b_lora`: kv_b_proj's
    adapter (A, B, scale), applied in the policy's `lora` mode (module docstring), or None.
    Returns the per-head attention output [B, Q, H, dv] in the compute dtype, in the policy's `mla` form."""
    b, nq, h, qk_dim = q.shape
    latent_dim = w_kv_b.shape[0]
    scale = qk_dim ** -0.5
    if kv_b_lora is not None and policy.lora == "merged":
        w_kv_b, kv_b_lora = merged_weight(w_kv_b, *kv_b_lora, policy), None
    w = as_param(w_kv_b, policy).reshape(latent_dim, h, nope_dim + v_dim)
    cache = cache[:, :, :latent_dim + qk_dim - nope_dim]  # latent and rope key rows (a DSA cache has more)
    latent = cache[:, 0, :latent_dim]  # [B, R, K]
    if policy.mla == "expanded":
        rows = jnp.transpose(latent, (0, 2, 1))
        if kv_b_lora is None:
            kv = matmul(rows, w.reshape(latent_dim, -1), policy)
        else:
            kv = lora_linear(rows, w_kv_b, *kv_b_lora, policy)
        kv = kv.reshape(b, -1, h, nope_dim + v_dim)  # [B, K, H, dn + dv]
        rope_part = as_compute(cache[:, :, latent_dim:], policy)  # [B, 1, r, K]: one rope key for all heads
        rope_keys = jnp.broadcast_to(rope_part, (b, h) + rope_part.shape[2:])
        keys = jnp.concatenate([jnp.transpose(kv[..., :nope_dim], (0, 2, 3, 1)), rope_keys], axis=2)
        values = jnp.transpose(kv[..., nope_dim:], (0, 2, 1, 3))  # [B, H, K, dv]
        return attention(q, keys, values, q_pos, k_pos, policy, scale=scale, allowed=allowed)
    w_uk_t = jnp.transpose(w[..., :nope_dim], (1, 2, 0))  # [H, dn, R]
    w_uv = jnp.transpose(w[..., nope_dim:], (1, 0, 2))  # [H, R, dv]
    q_latent = _per_head(q[..., :nope_dim], w_uk_t, policy)  # [B, Q, H, R]
    if kv_b_lora is not None:
        a, b_up, lora_scale = kv_b_lora
        b_up = b_up.reshape(-1, h, nope_dim + v_dim)  # [rank, H, dn + dv]
        b_uk_t = jnp.transpose(b_up[..., :nope_dim], (1, 2, 0))  # [H, dn, rank]
        q_latent = q_latent + _low_rank(q[..., :nope_dim], b_uk_t, a.T, lora_scale, policy, per_head_second=False)
    q_abs = jnp.concatenate([q_latent, as_compute(q[..., nope_dim:], policy)], axis=-1)
    values = jnp.transpose(cache[:, :, :latent_dim], (0, 1, 3, 2))  # [B, 1, K, R]
    out_latent = attention(q_abs, cache, values, q_pos, k_pos, policy, scale=scale, allowed=allowed)  # [B, Q, H, R]
    out = _per_head(out_latent, w_uv, policy)
    if kv_b_lora is not None:
        b_uv = jnp.transpose(b_up[..., nope_dim:], (1, 0, 2))  # [H, rank, dv]
        out = out + _low_rank(out_latent, a, b_uv, lora_scale, policy, per_head_second=True)
    return out
