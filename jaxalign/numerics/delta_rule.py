"""Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention) under a NumericPolicy: the short causal convolution,
the gates, q/k L2 norms, the gated delta rule in its two forms and the gated RMSNorm on its output.

The delta rule, per value head, with state S [Dk, Dv] and per-token decay g (log space, <= 0) and rate beta:

    S <- S * exp(g);  S <- S + k (beta (v - S^T k))^T;  out = S^T q          (q scaled by Dk^-1/2)

Two forms, the `delta_rule` policy field:
- `recurrent`: the update above one token at a time (transformers' `torch_recurrent_gated_delta_rule`, vLLM's
  fused recurrent decode kernel). Under `reduction=tree` every product meeting an add is rounded on its own
  (`uncontracted`) and the sums over Dk are the halving tree, so a row's bits do not depend on the batch or on
  where a sequence is cut: the trainer's scan over a whole sequence and the engine's prefill chunks and decode
  steps agree bitwise.
- `chunked:C`: chunks of C tokens through the UT transform (transformers' `torch_chunk_gated_delta_rule`, FLA's
  chunk kernel): within a chunk a triangular solve, across chunks a scan of the state.

Both compute in float32 (as transformers does) and store the state between tokens (recurrent) or chunks
(chunked) in `delta_state_dtype`. Padding: entries with `valid` False leave the state unchanged (a row's valid
entries are a prefix of the call): the recurrent form keeps the old state, the chunked form zeroes beta and the
decay there, which makes those tokens' updates exactly zero and their decay exactly one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxalign.numerics import precision
from jaxalign.numerics.dtypes import cast, dtype
from jaxalign.numerics.policy import NumericPolicy
from jaxalign.numerics.reduce import reduce_sum, rms_norm, uncontracted

HIGHEST = lax.Precision.HIGHEST


def _valid(valid: jax.Array | None, b: int, s: int) -> jax.Array:
    return jnp.ones((b, s), bool) if valid is None else valid


def causal_conv(x: jax.Array, weight: jax.Array, state: jax.Array | None, valid: jax.Array | None,
                policy: NumericPolicy) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal convolution then SiLU, as transformers' `causal_conv1d_fn` / `causal_conv1d_update`.

    x [B, S, C] (compute dtype), weight [K, C] (tap j multiplies the input K-1-j steps back), state [B, K-1, C]
    (the previous K-1 inputs, None: zeros). Inputs are rounded to `conv_state_dtype` (what the state stores, in
    the trainer's forward too); the K products of each output are summed in float32 in the policy's order.
    Returns (out [B, S, C] in x's dtype, new state [B, K-1, C]: the K-1 inputs before the row's first invalid
    entry, the old state where the row has none)."""
    b, s, c = x.shape
    k = weight.shape[0]
    xs = cast(x, policy.conv_state_dtype)
    if state is None:
        state = jnp.zeros((b, k - 1, c), xs.dtype)
    window = jnp.concatenate([cast(state, policy.conv_state_dtype), xs], axis=1)  # [B, K-1+S, C]
    w = weight.astype(jnp.float32)
    taps = jnp.stack([window[:, j:j + s].astype(jnp.float32) * w[j] for j in range(k)], axis=-1)  # [B, S, C, K]
    out = reduce_sum(uncontracted(taps, policy), policy, axis=-1)
    out = (out * precision.logistic(out, policy)).astype(x.dtype)
    count = jnp.sum(_valid(valid, b, s).astype(jnp.int32), axis=1)  # valid entries are a prefix
    rows = count[:, None] + jnp.arange(k - 1)[None]  # [B, K-1] into the window
    new_state = jnp.take_along_axis(window, rows[..., None], axis=1)
    return out, new_state


def gates(a: jax.Array, b: jax.Array, a_log: jax.Array, dt_bias: jax.Array,
          policy: NumericPolicy) -> tuple[jax.Array, jax.Array]:
    """(g, beta) [B, S, H] in float32 from the projections a, b [B, S, H] (compute dtype): beta = sigmoid(b)
    (computed in float32, rounded to b's dtype as torch's bf16 sigmoid), g = -exp(A_log) * softplus(a + dt_bias)
    in float32 (torch's softplus: the identity above 20)."""
    beta = precision.logistic(b.astype(jnp.float32), policy).astype(b.dtype).astype(jnp.float32)
    z = a.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    softplus = jnp.where(z > 20.0, z, jnp.log1p(precision.exp(jnp.minimum(z, 20.0), policy)))
    g = -precision.exp(a_log.astype(jnp.float32), policy) * softplus
    return g, beta


def l2norm(x: jax.Array, policy: NumericPolicy, eps: float = 1e-6) -> jax.Array:
    """x * rsqrt(sum(x^2) + eps) over the last axis in float32 (FLA's and transformers' l2norm)."""
    x = x.astype(jnp.float32)
    total = reduce_sum(uncontracted(x * x, policy), policy, axis=-1, keepdims=True)
    return x * lax.rsqrt(total + jnp.float32(eps))


def _prepare(q, k, v, g, beta, policy):
    """[B, S, H*, D] inputs -> float32 [B, H, S, D] with q/k L2-normalised, q scaled, and k heads repeated to the
    value heads (each key head serves H / Hk consecutive value heads)."""
    hv, hk = v.shape[2], k.shape[2]
    q, k = l2norm(q, policy), l2norm(k, policy)
    if hv != hk:
        q, k = jnp.repeat(q, hv // hk, axis=2), jnp.repeat(k, hv // hk, axis=2)
    q = q * jnp.float32(q.shape[-1] ** -0.5)
    t = lambda x: jnp.swapaxes(x.astype(jnp.float32), 1, 2)  # noqa: E731
    return t(q), t(k), t(v), t(g), t(beta)


def recurrent_delta_rule(q, k, v, g, beta, state, valid, policy: NumericPolicy):
    """One token at a time. q, k [B, S, Hk, Dk], v [B, S, H, Dv], g, beta [B, S, H] (float32), state
    [B, H, Dk, Dv] or None (zeros). Returns (out [B, S, H, Dv] float32, final state in `delta_state_dtype`)."""
    b, s = q.shape[:2]
    q, k, v, g, beta = _prepare(q, k, v, g, beta, policy)
    h, dk, dv = v.shape[1], q.shape[-1], v.shape[-1]
    sdt = dtype(policy.delta_state_dtype)
    start = jnp.zeros((b, h, dk, dv), sdt) if state is None else state.astype(sdt)
    keep = _valid(valid, b, s)

    def step(carry, inputs):
        q_t, k_t, v_t, g_t, beta_t, keep_t = inputs  # [B, H, D], [B, H], keep [B]
        old = carry.astype(jnp.float32)
        decayed = uncontracted(old * precision.exp(g_t, policy)[..., None, None], policy)
        kv_mem = reduce_sum(uncontracted(decayed * k_t[..., :, None], policy), policy, axis=-2)  # [B, H, Dv]
        delta = (v_t - kv_mem) * beta_t[..., None]
        new = decayed + uncontracted(k_t[..., :, None] * delta[..., None, :], policy)
        new = new.astype(sdt).astype(jnp.float32)  # the stored state is what the read sees
        out = reduce_sum(uncontracted(new * q_t[..., :, None], policy), policy, axis=-2)
        new = jnp.where(keep_t[:, None, None, None], new.astype(sdt), carry)
        return new, out

    moved = [jnp.moveaxis(x, 2, 0) for x in (q, k, v)] + [jnp.moveaxis(x, 2, 0) for x in (g, beta)]
    final, outs = lax.scan(step, start, (*moved, jnp.swapaxes(keep, 0, 1)))
    return jnp.moveaxis(outs, 0, 1), final  # [S, B, H, Dv] -> [B, S, H, Dv]


def chunked_delta_rule(q, k, v, g, beta, state, valid, chunk: int, policy: NumericPolicy):
    """Chunks of `chunk` tokens through the UT transform (transformers' `torch_chunk_gated_delta_rule`): same
    arguments and result as `recurrent_delta_rule`; the state is rounded to `delta_state_dtype` after each
    chunk. Invalid entries get beta = 0 and g = 0 (no update, no decay)."""
    b, s = q.shape[:2]
    keep = _valid(valid, b, s)
    beta = jnp.where(keep[..., None], beta, 0.0)
    g = jnp.where(keep[..., None], g, 0.0)
    q, k, v, g, beta = _prepare(q, k, v, g, beta, policy)
    h, dk, dv = v.shape[1], q.shape[-1], v.shape[-1]
    sdt = dtype(policy.delta_state_dtype)
    pad = (-s) % chunk
    pad4 = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0)))  # noqa: E731
    q, k, v = pad4(q), pad4(k), pad4(v)
    g, beta = (jnp.pad(x, ((0, 0), (0, 0), (0, pad))) for x in (g, beta))
    n = (s + pad) // chunk
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    split = lambda x: x.reshape(b, h, n, chunk, x.shape[-1])  # noqa: E731
    q, k, k_beta, v_beta = split(q), split(k), split(k_beta), split(v_beta)
    cum = jnp.cumsum(g.reshape(b, h, n, chunk), axis=-1)
    upper = jnp.triu(jnp.ones((chunk, chunk), bool), 1)
    pairwise = jnp.exp(jnp.where(upper, -jnp.inf, cum[..., :, None] - cum[..., None, :]))
    mm = lambda a, c: jnp.matmul(a, c, precision=HIGHEST)  # noqa: E731
    ut = mm(k_beta, jnp.swapaxes(k, -1, -2)) * pairwise
    intra = mm(q, jnp.swapaxes(k, -1, -2)) * pairwise
    decayed_k_beta = k_beta * jnp.exp(cum)[..., None]
    # unit lower-triangular system: only the strictly lower part of `ut` is read (its diagonal is taken as 1)
    solve = lambda rhs: jax.scipy.linalg.solve_triangular(ut, rhs, lower=True, unit_diagonal=True)  # noqa: E731
    new_values, k_cumdecay = solve(v_beta), solve(decayed_k_beta)
    q = q * jnp.exp(cum)[..., None]
    k = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]  # [B, H, n, 1, 1]
    start = jnp.zeros((b, h, dk, dv), sdt) if state is None else state.astype(sdt)

    def step(carry, inputs):
        nv, kc, qi, ki, ii, di = inputs
        last = carry.astype(jnp.float32)
        v_new = nv - mm(kc, last)
        out = mm(qi, last) + mm(ii, v_new)
        new = last * di + mm(jnp.swapaxes(ki, -1, -2), v_new)
        return new.astype(sdt), out

    per_chunk = [jnp.moveaxis(x, 2, 0) for x in (new_values, k_cumdecay, q, k, intra, chunk_decay)]
    final, outs = lax.scan(step, start, per_chunk)  # outs [n, B, H, C, Dv]
    out = jnp.moveaxis(outs, 0, 2).reshape(b, h, n * chunk, dv)[:, :, :s]
    return jnp.swapaxes(out, 1, 2), final


def delta_rule(q, k, v, g, beta, state, valid, policy: NumericPolicy):
    """The gated delta rule in the form `policy.delta_rule` names (`recurrent` or `chunked:C`)."""
    if policy.delta_chunk is None:
        return recurrent_delta_rule(q, k, v, g, beta, state, valid, policy)
    return chunked_delta_rule(q, k, v, g, beta, state, valid, policy.delta_chunk, policy)


def gated_rms_norm(x: jax.Array, weight: jax.Array, gate: jax.Array, policy: NumericPolicy,
                   eps: float) -> jax.Array:
    """transformers' RMSNormGated: RMSNorm(x) * weight (as `rms_norm`), then times silu(gate) in float32, rounded
    once to the compute dtype. x, gate [..., D]."""
    y = rms_norm(x, weight, policy, eps)
    z = gate.astype(jnp.float32)
    return cast(y.astype(jnp.float32) * (z * precision.logistic(z, policy)), policy.compute_dtype)
