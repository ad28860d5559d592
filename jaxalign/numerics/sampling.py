"""The distribution a token is sampled from, shared by the engine (to sample and report a logprob) and the
trainer (to score the same token). Both call `sampling_logprobs`, so they compute the same quantity.

Semantics: logits are cast to float32 and divided by the temperature; top-k keeps the k largest (ties at the
k-th value are kept); top-p keeps the smallest prefix of tokens, sorted by probability, whose mass reaches p
(the most likely token is always kept); the kept logits are renormalised (log-softmax over the kept set).
The reported logprob of a sampled token is its entry in this distribution. Greedy decoding
(temperature 0) reports the temperature-1 logprob of the argmax token, without filtering.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxalign.numerics import precision
from jaxalign.numerics.policy import NumericPolicy
from jaxalign.numerics.reduce import log_softmax


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Host-side validation of sampling parameters."""
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature = {temperature!r}; allowed: a float >= 0 (0 = greedy)")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k = {top_k!r}; allowed: None or an int >= 1")
    if top_p is not None and (not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p = {top_p!r}; allowed: None or a float in (0, 1]")


def sampling_logprobs(logits: jax.Array, policy: NumericPolicy, temperature: float = 1.0,
                      top_k: int | None = None, top_p: float | None = None) -> jax.Array:
    """Log-probabilities [..., V] (float32) of the distribution sampled from; filtered entries are -inf."""
    x = logits.astype(jnp.float32)
    if temperature == 0:
        return log_softmax(x, policy)
    x = x / jnp.float32(temperature)
    neg_inf = jnp.float32(-jnp.inf)
    if top_k is not None and top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, top_k)[0][..., -1:]
        x = jnp.where(x >= kth, x, neg_inf)
    if top_p is not None and top_p < 1.0:
        probs = precision.exp(log_softmax(x, policy), policy)
        order = jnp.argsort(-probs, axis=-1, stable=True)
        sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
        mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = mass_before < jnp.float32(top_p)
        keep = jnp.zeros_like(keep_sorted).at[
            tuple(jnp.indices(order.shape)[:-1]) + (order,)].set(keep_sorted)
        x = jnp.where(keep, x, neg_inf)
    return log_softmax(x, policy)
