"""Sinkhorn normalisation as a numeric decision (DeepSeek-V4's manifold-constrained hyper-connections).

mHC's stream-mixing matrix is pushed towards a doubly stochastic one by Sinkhorn iterations: columns normalised,
then `iters - 1` rounds of rows then columns, each divided by its sum + eps. How many iterations run and in what
dtype they are computed are where trainers and engines differ (an engine may run fewer iterations than the
checkpoint's `hc_sinkhorn_iters`, or a fused kernel may normalise in bf16), so both are policy fields:
`sinkhorn_iters` (`model` = the model config's `hc_iters`, or an explicit count >= 1) and `sinkhorn_dtype`
(f32 by default). Sums go through the policy's reductions and divisions through `divide_by`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxalign.numerics.dtypes import cast
from jaxalign.numerics.policy import NumericPolicy
from jaxalign.numerics.reduce import divide_by, reduce_sum


def sinkhorn_iterations(policy: NumericPolicy, model_iters: int) -> int:
    """The iteration count the forward runs: the model's `model_iters` under `sinkhorn_iters=model`, else the
    policy's explicit count."""
    return model_iters if policy.sinkhorn_iters == "model" else policy.sinkhorn_iters


def sinkhorn(comb: jax.Array, policy: NumericPolicy, model_iters: int, eps: float) -> jax.Array:
    """Sinkhorn-normalise comb [..., N, N] (float32, positive): columns, then `iters - 1` rounds of rows then
    columns, each divided by its sum + eps; computed (sums and divisions) in `policy.sinkhorn_dtype`, the result
    returned in float32. Under the defaults (`model`, f32) these are the model's own iterations in float32."""
    c = cast(comb, policy.sinkhorn_dtype)
    eps_c = jnp.asarray(eps, c.dtype)

    def norm(x, axis):
        return divide_by(x, reduce_sum(x, policy, axis=axis, keepdims=True) + eps_c, axis, policy)

    c = norm(c, -2)
    for _ in range(sinkhorn_iterations(policy, model_iters) - 1):
        c = norm(norm(c, -1), -2)
    return c.astype(jnp.float32)
